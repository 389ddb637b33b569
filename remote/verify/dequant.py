"""Quantized checkpoints in the layer-local check: one decoder layer's quantized tensors read
and dequantized to float32 as they load, for the two layouts the real targets ship.

- ``fp8`` with ``weight_block_size`` (DeepSeek-V3/R1, ``quantization_config: {quant_method:
  fp8, weight_block_size: [128, 128], fmt: e4m3, activation_scheme: dynamic}``): each
  quantized Linear keeps ``<m>.weight`` as float8_e4m3fn ``[out, in]`` and
  ``<m>.weight_scale_inv`` ``[ceil(out/bn), ceil(in/bk)]``; the weight is ``weight.float() *
  scale_inv`` expanded over its block, the last block of a dimension partial where the
  block does not divide it -- as vLLM's ``block_dequant`` (``int8_utils``) and
  ``scaled_dequantize`` (``quant_utils``) compute it, in float32.
- ``compressed-tensors`` ``pack-quantized`` (Kimi-K2.5/K2-thinking INT4, symmetric, group
  size 32, only the routed experts): ``<m>.weight_packed`` int32 ``[out, ceil(in/(32/b))]``
  (value ``k`` of a word in bits ``k*b .. k*b+b-1``, stored unsigned with offset ``2^(b-1)``),
  ``<m>.weight_scale`` ``[out, ceil(in/group)]``, ``<m>.weight_shape`` ``[out, in]``: unpacked as
  compressed-tensors' ``unpack_from_int32`` does and multiplied by the group's scale (its
  ``dequantize``), in float32.

What a layer holds decides, tensor by tensor: a module with the quantized tensors is
dequantized, any other tensor is read as it is (norms, the router, the modules the config
``ignore``\\ s). Any other quantization is refused naming its method and what is supported.
The engine's own activation quantization is part of its rounding: for fp8 with
``activation_scheme: dynamic`` (vLLM's W8A8 block path quantizes each linear's input per token
in groups of ``bk`` columns to e4m3, scale ``amax / 448``) the layer's floor runs with every
bf16 linear's input rounded so (:class:`Fp8Activations`); without it a healthy fp8 engine
reads 7-9x the bf16 floor on the tiny DeepSeek-V3 (measured). Stdlib only at import.
"""
from __future__ import annotations

import os

from remote.system import modelconfig
from remote.verify.run import VerifyError

SUPPORTED = ("fp8 with weight_block_size (float8 weights and weight_scale_inv per block, as DeepSeek-V3/R1 "
             "ship) and compressed-tensors pack-quantized symmetric int weights with group or channel scales "
             "(as Kimi-K2.5/K2-thinking ship INT4)")
#: safetensors dtypes of an fp8 weight, and of the scales this module reads as floats
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E8M0")
INT_DTYPES = ("I32", "I64", "I16", "I8", "U8")


def config_block(config: dict):
    """``(where, block)`` of a quantized model's config (``quantization_config`` or
    ``compression_config``, at the top or in the text config), or None."""
    text = modelconfig.text_config(config)
    for holder in (config, text):
        for key in ("quantization_config", "compression_config"):
            block = holder.get(key)
            if isinstance(block, dict):
                prefix = f"{modelconfig.wrapper_key(config)}." if holder is not config else ""
                return f"{prefix}{key}", block
    return None


def method_of(block: dict) -> str:
    return str(block.get("quant_method") or block.get("format") or "unknown method")


def scheme_of(config: dict, model_path):
    """The checkpoint's quantization as this module dequantizes it (:class:`Fp8Block` or
    :class:`PackQuantized`), or None for a float checkpoint.

    :raises VerifyError: a quantization this module does not dequantize, named.
    """
    found = config_block(config)
    if found is None:
        return None
    where, block = found
    method = method_of(block)
    why = None
    if method == "fp8":
        size = block.get("weight_block_size")
        if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size):
            return Fp8Block(where, block, list(size))
        why = f"fp8 without a weight_block_size of two ints (got {size!r}: per-tensor or per-channel fp8)"
    elif method == "compressed-tensors":
        scheme, why = PackQuantized.parse(where, block)
        if scheme is not None:
            return scheme
    name = os.path.basename(str(model_path).rstrip("/"))
    raise VerifyError(
        "verify.reference",
        f"{name} is quantized ({method}, config.json {where}){': ' + why if why else ''}: the layer-local "
        f"reference dequantizes {SUPPORTED} only",
        "verify this run with --reference hf on a host with the float model, or check the engine on an "
        "unquantized twin (specops smoke)",
        detail={"quantization": {"key": where, "quant_method": method, "why": why, "supported": SUPPORTED}})


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Block:
    """fp8 weights with a float scale per ``[bn, bk]`` block (``weight_scale_inv``)."""

    name = "fp8"

    def __init__(self, where: str, block: dict, size: list):
        self.where, self.block, self.size = where, block, size

    def detail(self) -> dict:
        return {"key": self.where, "quant_method": "fp8", "weight_block_size": self.size,
                "fmt": self.block.get("fmt"), "activation_scheme": self.block.get("activation_scheme"),
                "dequantized": "float32: weight x weight_scale_inv per block (vLLM block_dequant)"}

    def describe(self) -> str:
        return f"fp8 {self.size[0]}x{self.size[1]} blocks"

    def claim(self, name: str, described: dict, names: dict, read):
        """``(logical name, token, shape, used local names)`` where ``name`` is a quantized
        weight of this layout, else None; :raises VerifyError: a quantized weight without its scale."""
        if not name.endswith(".weight") or described[name]["dtype"] not in FP8_DTYPES:
            return None
        scale = f"{name}_scale_inv"
        if scale not in names:
            raise VerifyError("verify.reference", f"{name} is {described[name]['dtype']} but the checkpoint has no "
                              f"{scale}", "the checkpoint is not the fp8 block layout its config says; run specops "
                              "preflight")
        rows, cols = described[name]["shape"][-2:]
        want = [_ceil(rows, self.size[0]), _ceil(cols, self.size[1])]
        have = described[scale]["shape"]
        if list(have[-2:]) != want or described[scale]["dtype"] not in SCALE_DTYPES:
            raise VerifyError("verify.reference", f"{scale}: {described[scale]['dtype']} {have}, expected a float "
                              f"{want} (a {self.size} block grid over {[rows, cols]})",
                              "the checkpoint and its quantization_config disagree; run specops preflight")
        return name, ("fp8", names[name], names[scale], tuple(self.size)), list(described[name]["shape"]), (name, scale)

    @staticmethod
    def load(token, get):
        return fp8_block_dequant(get(token[1], raw=True), get(token[2], raw=True), token[3])

    def fp32_numel(self, name: str, numel: int) -> int:
        return numel


class PackQuantized:
    """compressed-tensors ``pack-quantized``: symmetric int weights packed in int32 words, a
    scale per group of input columns (or per output channel)."""

    name = "compressed-tensors"

    def __init__(self, where: str, block: dict, weights: dict):
        self.where, self.block, self.weights = where, block, weights
        self.bits = int(weights["num_bits"])
        self.group = weights.get("group_size") if weights.get("strategy") == "group" else None

    @classmethod
    def parse(cls, where: str, block: dict):
        """``(scheme, None)`` or ``(None, why it is not supported)``."""
        groups = block.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            return None, "no config_groups"
        seen = {}
        for gname, group in groups.items():
            fmt = (group or {}).get("format") or block.get("format")
            weights = (group or {}).get("weights") or {}
            if fmt != "pack-quantized":
                return None, f"config group {gname} has format {fmt!r} (only pack-quantized is dequantized)"
            if weights.get("type") != "int" or not weights.get("symmetric", True):
                return None, (f"config group {gname}: {'asymmetric ' if not weights.get('symmetric', True) else ''}"
                              f"{weights.get('type')} weights (symmetric int only)")
            strategy = weights.get("strategy")
            bits = weights.get("num_bits")
            if strategy not in ("group", "channel") or not isinstance(bits, int) or not 1 <= bits <= 8 \
                    or (strategy == "group" and not isinstance(weights.get("group_size"), int)):
                return None, f"config group {gname}: strategy {strategy!r}, num_bits {bits!r} (group or channel, 1-8)"
            if weights.get("actorder") == "group":
                return None, f"config group {gname}: actorder group (a g_idx permutation) is not dequantized"
            seen[(bits, strategy, weights.get("group_size"))] = weights
        if len(seen) > 1:
            return None, f"config groups with different weight schemes {sorted(map(str, seen))}"
        return cls(where, block, next(iter(seen.values()))), None

    def detail(self) -> dict:
        return {"key": self.where, "quant_method": "compressed-tensors", "format": "pack-quantized",
                "num_bits": self.bits, "strategy": self.weights.get("strategy"), "group_size": self.group,
                "symmetric": True, "ignore": len(self.block.get("ignore") or []),
                "dequantized": "float32: unpack_from_int32 x weight_scale per group (compressed-tensors)"}

    def describe(self) -> str:
        return f"compressed-tensors int{self.bits} " + (f"group {self.group}" if self.group else "per channel")

    def claim(self, name: str, described: dict, names: dict, read):
        if not name.endswith(".weight_packed"):
            return None
        base = name[:-len("_packed")]
        scale, shape_key = f"{base}_scale", f"{base}_shape"
        extra = [n for n in (f"{base}_zero_point", f"{base}_g_idx") if n in names]
        missing = [n for n in (scale, shape_key) if n not in names]
        if missing or extra:
            raise VerifyError("verify.reference", f"{name}: " + (f"no {', '.join(missing)}" if missing else
                              f"{', '.join(extra)} (asymmetric or activation-ordered) is not dequantized"),
                              "the checkpoint is not the symmetric pack-quantized layout its config says")
        shape = [int(v) for v in read(names[shape_key], raw=True).tolist()]
        packed, scales = described[name]["shape"], described[scale]["shape"]
        group = self.group or shape[-1]
        want_packed = [shape[0], _ceil(shape[1], 32 // self.bits)]
        want_scale = [shape[0], _ceil(shape[1], group)]
        if len(shape) != 2 or described[name]["dtype"] != "I32" or list(packed) != want_packed \
                or list(scales) != want_scale or described[scale]["dtype"] not in SCALE_DTYPES:
            raise VerifyError("verify.reference", f"{name} {described[name]['dtype']} {packed}, {scale} "
                              f"{described[scale]['dtype']} {scales} do not fit weight_shape {shape} as int{self.bits} "
                              f"(expected I32 {want_packed} and a float {want_scale})",
                              "the checkpoint and its quantization_config disagree; run specops preflight")
        return base, ("pack", names[name], names[scale], self.bits, group, tuple(shape)), shape, \
            (name, scale, shape_key)

    @staticmethod
    def load(token, get):
        _, packed, scale, bits, group, shape = token
        return pack_dequant(get(packed, raw=True), get(scale, raw=True), bits, group, shape)

    def fp32_numel(self, name: str, numel: int) -> int:
        return numel * (32 // self.bits) if name.endswith(".weight_packed") else numel


def fp8_block_dequant(weight, scale, block):
    """``weight`` (an fp8 ``[..., n, k]``) times its block scales ``[..., ceil(n/bn), ceil(k/bk)]``, float32."""
    import torch

    n, k = weight.shape[-2:]
    s = scale.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return weight.to(torch.float32) * s


def unpack_int32(packed, bits: int, columns: int):
    """Signed ints ``[rows, columns]`` (int32) from words packed along dim 1, value ``i`` of
    a word in bits ``i*bits ..`` and offset by ``2^(bits-1)`` (compressed-tensors' layout)."""
    import torch

    factor, mask = 32 // bits, (1 << bits) - 1
    out = torch.empty((packed.shape[0], packed.shape[1] * factor), dtype=torch.int32)
    for i in range(factor):
        out[:, i::factor] = (packed >> (bits * i)) & mask
    return out[:, :columns] - (1 << (bits - 1))


def pack_dequant(packed, scale, bits: int, group: int, shape):
    """The float32 weight ``shape`` of a symmetric pack-quantized module: ints times their group's scale."""
    import torch

    q = unpack_int32(packed, bits, shape[1])
    s = scale.to(torch.float32).repeat_interleave(group, dim=1)[:, :shape[1]]
    return q.to(torch.float32) * s


def activation_rounding(scheme):
    """The engine's activation rounding for this quantization (:class:`Fp8Activations`), or None."""
    if isinstance(scheme, Fp8Block) and scheme.block.get("activation_scheme") == "dynamic":
        return Fp8Activations(scheme.size[1])
    return None


class Fp8Activations:
    """Inside ``with``: every linear with bf16/fp16 weights takes its input rounded to e4m3 per
    token in groups of ``group`` columns (scale ``max(amax, 1e-10) / 448``, as vLLM's
    ``per_token_group_quant_fp8``) and multiplies in float32 (fp8 x fp8 products are exact, the
    kernel accumulates in float32), its output in the weight's dtype. The router (a float32
    linear) is left alone. Patches ``torch.nn.functional.linear``, restored on exit."""

    def __init__(self, group: int):
        self.group, self.saved = group, None

    def describe(self) -> str:
        return f"fp8 e4m3 activations per token in groups of {self.group} (activation_scheme dynamic)"

    def round(self, x):
        import torch

        cols, pad = x.shape[-1], (-x.shape[-1]) % self.group
        grouped = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, self.group)
        scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
        q = (grouped / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
        return q.reshape(*x.shape[:-1], -1)[..., :cols]

    def __enter__(self):
        import torch

        self.saved = linear = torch.nn.functional.linear

        def rounded(x, weight, bias=None):
            if weight.dtype not in (torch.bfloat16, torch.float16):
                return linear(x, weight, bias)
            out = linear(self.round(x), weight.float(), None if bias is None else bias.float())
            return out.to(weight.dtype)
        torch.nn.functional.linear = rounded
        return self

    def __exit__(self, *exc):
        import torch

        torch.nn.functional.linear = self.saved
        return False


class LayerView:
    """A decoder layer's checkpoint tensors as float weights: local name -> shape and a token
    to read it by; a quantized module's tensors stand as its one dequantized weight."""

    def __init__(self, scheme, keys: dict, described: dict, get):
        """``keys``: local name -> checkpoint key; ``described``: checkpoint key -> dtype and
        shape; ``get(key, raw=False)``: a tensor read (raw: as stored)."""
        self.scheme, self.get_raw = scheme, get
        by_name = {name: described[key] for name, key in keys.items()}
        self.tokens, self.shapes, self.dequantized = {}, {}, []
        used = set()
        for name in sorted(keys):
            claimed = scheme.claim(name, by_name, keys, get) if scheme is not None else None
            if claimed:
                logical, token, shape, parts = claimed
                self.tokens[logical], self.shapes[logical] = token, shape
                self.dequantized.append(logical)
                used.update(parts)
        for name, key in keys.items():
            if name not in used and name not in self.tokens:
                self.tokens[name], self.shapes[name] = key, list(by_name[name]["shape"])
        self.plain = {name: by_name[name]["dtype"] for name in keys if name not in used}

    def get(self, token, dtype=None):
        """The tensor a token names, in ``dtype`` (None: the reader's, float32; dequantized where it is
        quantized: to float32 first, then ``dtype``)."""
        if isinstance(token, tuple):
            tensor = (Fp8Block if token[0] == "fp8" else PackQuantized).load(token, self.get_raw)
            return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        return self.get_raw(token, dtype=dtype)
