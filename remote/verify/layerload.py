"""One decoder layer of the run's model, from its checkpoint alone: the tensors of that layer
read from the shards that hold them, the model's own transformers layer class around them.

Used by the layer-local check (:mod:`remote.verify.layer`). Nothing here ever holds more
than one decoder layer's weights: :class:`Checkpoint` finds a layer's tensors through the
safetensors index (or the shards' headers, read by hand) and reads only those keys, with
plain reads at the offsets its header gives (:func:`read_tensor`: never a memory map, whose
touched pages would count as the process's own until it closes, and converted a few MiB at a
time, so a layer in float32 costs its float32 bytes and no more); :class:`LayerFactory` gets the decoder layer class, the rotary embedding
and the attention/experts implementations from a one-layer skeleton of the model built on
the meta device, then builds layer ``j`` on the meta device and assigns the tensors, cast
to float32. A text model under a wrapper (Kimi-K2.5's ``text_config``, weights under
``language_model.``) is found by the checkpoint's own key names. transformers 5 keeps a
MoE layer's experts fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H,
I]``) where checkpoints keep one tensor per expert: :func:`plan_state` and :func:`fill_state`
stack them the way transformers' own loader does, one expert at a time. Stdlib only at import.
"""
from __future__ import annotations

import os
import re
from contextlib import ExitStack, contextmanager

from remote.system import modelconfig
from remote.system.weights import ShardError, find_weights, read_header
from remote.verify.dequant import LayerView, config_block, method_of
from remote.verify.run import VerifyError
from remote.verify.scaling import Llama4Scaling, hf_implements_llama4, scaling_config

#: where a decoder layer's tensors sit: ``<root>layers.<j>.<name>`` (root ``model.``, or
#: ``language_model.model.`` under a wrapper).
LAYER_KEY = re.compile(r"^(.*?)layers\.(\d+)\.(.+)$")
#: safetensors dtypes a float checkpoint holds; anything else is a quantized layout.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
#: model types whose layer 0 takes the embedding rows as they are (no scaling such as
#: Gemma's sqrt(hidden)): the input of layer 0 can then be read from the checkpoint.
PLAIN_EMBEDDING_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                         "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe")


def quantization(config: dict):
    """``(where, method)`` of a quantized model's config (``quantization_config`` or
    ``compression_config``, at the top or in the text config), or None."""
    found = config_block(config)
    return (found[0], method_of(found[1])) if found else None


def refuse_quantized(config: dict, model_path) -> None:
    """:raises VerifyError: the model is quantized (a check that reads float weights only: the logits
    check; the layer-local check dequantizes what :mod:`remote.verify.dequant` supports)."""
    found = quantization(config)
    if found:
        where, method = found
        raise VerifyError(
            "verify.reference",
            f"{os.path.basename(str(model_path).rstrip('/'))} is quantized ({method}, config.json {where}): "
            f"this reference reads float weights only and does not dequantize",
            "verify this run with --reference layer (it dequantizes fp8 block and compressed-tensors "
            "pack-quantized layers) or --reference hf on a host with the float model",
            detail={"quantization": {"key": where, "quant_method": method}})


class Checkpoint:
    """The model's safetensors: which shard holds each tensor, and reading a few of them."""

    def __init__(self, model_path, num_layers: int, quant=None):
        self.model_path = str(model_path)
        #: the quantization its layers are dequantized by (:func:`remote.verify.dequant.scheme_of`), or None
        self.quant = quant
        try:
            index, expected, on_disk, _others = find_weights(self.model_path)
        except (OSError, ValueError) as exc:
            raise VerifyError("verify.reference", f"the checkpoint index of {model_path} is unreadable: {exc}",
                              "run specops preflight: it names what is wrong with the checkpoint") from None
        missing = sorted(set(expected) - set(on_disk))
        if not expected or missing:
            raise VerifyError("verify.reference", f"{model_path}: " + (
                f"shards missing: {', '.join(missing[:3])}" if missing else "no safetensors weights"),
                "the layer check reads the checkpoint's safetensors; run specops preflight")
        #: key -> {"dtype", "shape", "offsets"} from the shards' headers (read by hand, a shard at a time,
        #: when needed); ``offsets``: the tensor's first and end byte in its shard
        self.info = {}
        if index is not None:
            self.where = dict(index["weight_map"])
        else:
            self.where = {}
            for shard in expected:
                for name in self._header(shard):
                    self.where[name] = shard
        self.shards = sorted(set(self.where.values()))
        self.root, self.layers = self._text_layers(num_layers)

    def _text_layers(self, num_layers: int):
        """The key root of the text model's decoder layers and layer -> {local name: key}.

        The root whose layers cover ``0..num_layers-1`` (a vision tower's or an MTP
        block's do not), the one with most keys first."""
        roots = {}
        for key in self.where:
            found = LAYER_KEY.match(key)
            if found:
                root, j, name = found.group(1), int(found.group(2)), found.group(3)
                roots.setdefault(root, {}).setdefault(j, {})[name] = key
        fitting = [r for r, by in roots.items() if all(j in by for j in range(num_layers))]
        if not fitting:
            raise VerifyError("verify.reference",
                              f"{self.model_path}: no tensors named <...>layers.<j>.* for all {num_layers} decoder "
                              f"layers (roots seen: {sorted(roots) or 'none'})",
                              "the checkpoint does not match its config.json; run specops preflight")
        root = max(fitting, key=lambda r: sum(len(v) for v in roots[r].values()))
        return root, roots[root]

    def layer_keys(self, j: int) -> dict:
        """Local name (``self_attn.q_proj.weight``) -> checkpoint key, for decoder layer ``j``."""
        return dict(self.layers[j])

    def files_of(self, keys) -> list:
        return sorted({self.where[k] for k in keys})

    def _header(self, shard: str) -> dict:
        try:
            found = read_header(os.path.join(self.model_path, shard))
            tensors = found["tensors"]
        except (OSError, ShardError) as exc:
            raise VerifyError("verify.reference", f"{shard}: {exc}", "run specops preflight: it checks every shard") \
                from None
        start = 8 + int(found["header_bytes"])
        for name, entry in tensors.items():
            begin, end = entry["data_offsets"]
            self.info[name] = {"dtype": entry["dtype"], "shape": list(entry["shape"]),
                               "offsets": [start + int(begin), start + int(end)]}
        return tensors

    def describe(self, keys) -> dict:
        """key -> ``{"dtype", "shape"}`` as the shard headers say (each needed header read once)."""
        for shard in self.files_of([k for k in keys if k not in self.info]):
            self._header(shard)
        return {k: self.info[k] for k in keys}

    @contextmanager
    def reader(self, dtype):
        """``get(key, raw=False, dtype=None)``: one tensor read (:func:`read_tensor`) in the reader's
        ``dtype`` or the call's (``raw``: as stored); each shard opened once."""
        default = dtype
        with ExitStack() as stack:
            handles = {}

            def get(key, raw=False, dtype=None):
                shard = self.where[key]
                if shard not in handles:
                    handles[shard] = stack.enter_context(open(os.path.join(self.model_path, shard), "rb",
                                                              buffering=0))
                info = self.describe([key])[key]
                return read_tensor(handles[shard], info, None if raw else (dtype or default), key)
            yield get

    def embedding_rows(self, ids) -> object:
        """The embedding rows of ``ids`` ([T, H], the checkpoint's dtype), reading only those rows; None
        when the checkpoint has no ``<root>embed_tokens.weight``."""
        import torch
        from safetensors import safe_open

        key = f"{self.root}embed_tokens.weight"
        if key not in self.where:
            return None
        unique = sorted(set(int(t) for t in ids))
        with safe_open(os.path.join(self.model_path, self.where[key]), framework="pt", device="cpu") as fh:
            table = fh.get_slice(key)
            rows = {t: table[t:t + 1] for t in unique}
        return torch.cat([rows[int(t)] for t in ids])

    def whole_fp32_bytes(self) -> int:
        """What every tensor of the checkpoint would take in float32 (the shards' headers, no data read)."""
        total = 0
        for key, info in self.describe(list(self.where)).items():
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            total += 4 * (self.quant.fp32_numel(key, numel) if self.quant is not None else numel)
        return total


def layer_kinds(checkpoint: Checkpoint, text: dict, num_layers: int) -> dict:
    """Decoder layer -> its kinds: ``first``, ``last``, ``moe`` or ``dense`` (by the checkpoint's own
    key names: an ``.experts.`` tensor), and its ``layer_types`` entry where the text config mixes
    them (``sliding_attention`` / ``full_attention``). Reads the index or headers only."""
    types = text.get("layer_types")
    mixed = isinstance(types, list) and len(set(map(str, types))) > 1
    kinds = {}
    for j in range(num_layers):
        found = ["first"] if j == 0 else []
        found += ["last"] if j == num_layers - 1 else []
        found.append("moe" if any(".experts." in f".{n}" for n in checkpoint.layer_keys(j)) else "dense")
        if mixed and j < len(types):
            found.append(str(types[j]))
        kinds[j] = found
    return kinds


#: safetensors dtype -> torch dtype name (what :func:`read_tensor` can read)
TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
                "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64"}
#: bytes of the checkpoint read (and converted) at a time: what a tensor costs above its result
READ_CHUNK_BYTES = 8 * 1024 * 1024


def read_tensor(fh, info: dict, dtype, key: str = "?"):
    """One tensor of an open shard (``fh``, unbuffered) at ``info["offsets"]``, in ``dtype`` (None: as
    stored), read ``READ_CHUNK_BYTES`` at a time into the result.

    Plain reads, not ``safe_open``'s memory map: the map's touched pages count in the process's
    resident memory until it closes (a whole bf16 layer beside its float32 copy, measured: peak
    1.5x the float32 layer on a 4096-wide Llama), and ``get_tensor`` then ``.to(float32)`` holds the
    stored tensor and the converted one at once. Here the result is the only whole copy.
    """
    import torch

    name = TORCH_DTYPES.get(info["dtype"])
    stored = getattr(torch, name, None) if name else None
    if stored is None:
        raise VerifyError("verify.reference", f"tensor {key}: dtype {info['dtype']} is not readable by this torch",
                          "use --reference hf")
    begin, end = info["offsets"]
    out = torch.empty(info["shape"], dtype=dtype or stored)
    flat = out.view(-1)
    size = torch.empty(0, dtype=stored).element_size()
    if end - begin != flat.numel() * size:
        raise VerifyError("verify.reference", f"tensor {key}: {end - begin} bytes for {info['dtype']}{info['shape']}",
                          "the shard's header is corrupt; run specops preflight")
    step = max(size, READ_CHUNK_BYTES // size * size)
    buf = bytearray(min(step, end - begin))
    view = memoryview(buf)
    done = 0
    while begin + done < end:
        n = min(step, end - begin - done)
        got = 0
        fh.seek(begin + done)
        while got < n:
            read = fh.readinto(view[got:n])
            if not read:
                raise VerifyError("verify.reference", f"tensor {key}: the shard ends before its data",
                                  "the shard is truncated; run specops preflight")
            got += read
        chunk = torch.frombuffer(buf, dtype=torch.uint8, count=n).view(stored)
        flat[done // size:(done + n) // size].copy_(chunk)
        done += n
    return out


def plan_state(layer, shapes: dict) -> tuple:
    """How to fill the layer's ``state_dict`` from the checkpoint tensors of that layer (local
    names -> shape): ``(plan, problems)``, ``plan[name]`` being ``("copy", local name)`` or
    ``("stack", [[local names] per expert], transpose)``. Per-expert tensors are stacked where
    the layer keeps its experts fused (``experts.gate_up_proj``: gate and up of each expert
    concatenated; ``experts.down_proj``), transposed where its layout is transposed."""
    left = dict(shapes)
    plan, problems = {}, []
    for name, want in layer.state_dict(keep_vars=True).items():
        shape = list(want.shape)
        if name in left:
            have = left.pop(name)
            plan[name] = ("copy", name)
        elif name.endswith(("gate_up_proj", "down_proj", "up_proj")) and len(shape) == 3:
            base, part = name.rsplit(".", 1)
            parts = ("gate_proj", "up_proj") if part == "gate_up_proj" else (part,)
            per = [[f"{base}.{e}.{p}.weight" for p in parts] for e in range(shape[0])]
            if any(n not in left for row in per for n in row):
                problems.append(f"{name}: neither it nor {base}.<e>.{'/'.join(parts)}.weight for {shape[0]} "
                                f"experts is in the checkpoint")
                continue
            rows = [[left.pop(n) for n in row] for row in per]
            one = [sum(r[0] for r in rows[0])] + list(rows[0][0][1:])
            have = [shape[0]] + one
            transpose = have != shape and [shape[0], one[1], one[0]] == shape
            have = shape if transpose else have
            plan[name] = ("stack", per, transpose)
        else:
            problems.append(f"{name} is not in the checkpoint")
            continue
        if list(have) != shape:
            problems.append(f"{name}: checkpoint shape {list(have)}, the layer wants {shape}")
            plan.pop(name, None)
    problems += [f"{name} is in the checkpoint but not in the layer" for name in sorted(left)
                 if not name.endswith("rotary_emb.inv_freq")]
    return plan, problems


def fill_state(plan: dict, shapes: dict, keys: dict, get, dtype, float32=()) -> dict:
    """The state the plan names, each tensor read in ``dtype`` (the names in ``float32``: in float32)
    as it is needed: a stacked tensor is filled one expert at a time, so no more than one expert
    is ever held twice. ``get(token, dtype)`` reads one tensor."""
    import torch

    state = {}
    for name, step in plan.items():
        want = torch.float32 if name in float32 else dtype
        if step[0] == "copy":
            state[name] = get(keys[step[1]], want)
            continue
        _, per, transpose = step
        rows, cols = sum(shapes[n][0] for n in per[0]), shapes[per[0][0]][1]
        out = torch.empty((len(per), cols, rows) if transpose else (len(per), rows, cols), dtype=want)
        for e, names in enumerate(per):
            block = torch.cat([get(keys[n], want) for n in names], dim=0)
            out[e] = block.t() if transpose else block
        state[name] = out
    return state


class LayerFactory:
    """The run's decoder layers, one at a time, in float32 on CPU, built by transformers'
    own classes for the model's (text) config, without remote code."""

    def __init__(self, config: dict):
        import torch
        from transformers import AutoModelForCausalLM

        from remote.extract.engines.hf_reference import decoder_layers
        from remote.extract.tinymodel import _hf_config_class

        text = modelconfig.text_config(config)
        self.text = text
        config_cls = _hf_config_class(text)
        # the quantization is undone while loading (remote.verify.dequant): the layers are plain float
        fields = {k: v for k, v in text.items()
                  if k not in ("model_type", "quantization_config", "compression_config")}
        self.hf_config = config_cls(**fields)
        self.scaling = scaling_config(text)
        self.hook = Llama4Scaling(self.scaling) if self.scaling is not None else None
        kwargs = {"dtype": torch.float32}
        if self.hook is not None:
            kwargs["attn_implementation"] = self.hook.register()
        # a one-layer skeleton on the meta device: the classes and implementations transformers picks
        small = dict(fields, num_hidden_layers=1)
        if isinstance(small.get("layer_types"), list):
            small["layer_types"] = small["layer_types"][:1]
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config_cls(**small), **kwargs)
        self.layer_class = type(decoder_layers(skeleton)[0])
        rotary = [m for name, m in skeleton.named_modules() if name.endswith("rotary_emb") and ".layers." not in name]
        if not rotary:
            raise VerifyError("verify.reference", f"{type(skeleton).__name__}: no model-level rotary embedding "
                              "(rotary_emb) found", "the layer-local check supports models whose layers take "
                              "position_embeddings from the model; use --reference hf")
        for attr in ("_attn_implementation", "_experts_implementation"):
            value = getattr(skeleton.config, attr, None)
            if value is not None:
                setattr(self.hf_config, attr, value)
        if self.hook is not None:
            self.hook.active = not hf_implements_llama4(skeleton)
        self.rotary = type(rotary[0])(config=self.hf_config)
        #: what transformers picked (the llama_4_scaling hook where the config has the scaling):
        #: :func:`dense_forward`'s attention; the layers run :class:`BoundedAttention` instead
        self.stock_attention = getattr(self.hf_config, "_attn_implementation", None)
        self.bounded = BoundedAttention(self.hook)
        self.hf_config._attn_implementation = self.bounded.register()
        self.attention = (f"bounded sdpa ({QUERY_CHUNK}-token query chunks; transformers picked "
                          f"{self.stock_attention})")
        del skeleton

    def build(self, j: int, checkpoint: Checkpoint, dtype=None):
        """Decoder layer ``j`` with its checkpoint tensors in float32: ``(layer, facts)``. ``dtype`` (bf16,
        for the rounding floor): its parameters in that dtype instead, read so from the checkpoint --
        the float32 layer cast -- while buffers (a router's correction bias) stay float32, as
        transformers and vLLM keep them.

        :raises VerifyError: a tensor the layer needs that the checkpoint lacks (or the
            reverse), or a tensor that is not a float (a quantized layout).
        """
        import torch

        dtype = dtype or torch.float32
        keys = checkpoint.layer_keys(j)
        described = checkpoint.describe(list(keys.values()))
        with checkpoint.reader(torch.float32) as get:
            view = LayerView(checkpoint.quant, keys, described, get)
            odd = sorted(f"{name} ({dtype})" for name, dtype in view.plain.items() if dtype not in FLOAT_DTYPES)
            if odd:
                raise VerifyError("verify.reference", f"decoder layer {j} holds tensors that are not float weights: "
                                  f"{', '.join(odd[:3])}: a quantized layout the layer-local check cannot read",
                                  "verify with --reference hf, or on an unquantized twin (specops smoke)")
            with torch.device("meta"):
                layer = self.layer_class(self.hf_config, layer_idx=j)
            plan, problems = plan_state(layer, view.shapes)
            if problems:
                raise VerifyError("verify.reference", f"decoder layer {j} ({self.layer_class.__name__}) does not "
                                  f"fit the checkpoint: {problems[0]}" + (f" (+{len(problems) - 1} more)"
                                                                           if len(problems) > 1 else ""),
                                  "the checkpoint and config.json disagree, or transformers lays this model out "
                                  "otherwise; use --reference hf", detail={"problems": problems})
            buffers = {name for name, _ in layer.named_buffers()}
            state = fill_state(plan, view.shapes, view.tokens, view.get, dtype, float32=buffers)
        layer.load_state_dict(state, assign=True, strict=True)
        left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if left:
            raise VerifyError("verify.reference", f"decoder layer {j}: {', '.join(left[:3])} not set after loading",
                              "use --reference hf for this model")
        layer.eval()
        self.bounded.defer_expansion(layer)
        facts = {"tensors": len(keys), "shards": checkpoint.files_of(keys.values()),
                 "fp32_bytes": sum(t.numel() * 4 for t in state.values()),
                 "moe": any(".experts." in f".{name}" for name in keys),
                 "class": self.layer_class.__name__, "dequantized": len(view.dequantized)}
        return layer, facts


#: query positions the layer runs on at a time, each with the keys of every position before it: what
#: bounds a forward's activations (projections, MoE experts, attention) to this many tokens
QUERY_CHUNK = 256
#: bytes of attention scores (and softmax) one block of heads x queries x keys may take
SCORE_BYTES = 8 * 1024 * 1024


class PrefixCache:
    """The keys and values of the positions run so far, for one decoder layer: what transformers'
    attention gets through ``past_key_values.update``. Allocated once for the whole sample at the
    first chunk (a ``DynamicCache`` concatenates, holding the prefix twice at every chunk); it holds
    whatever the layer caches (transformers 5's MLA: the latents, not the expanded heads)."""

    def __init__(self, tokens: int):
        self.tokens, self.seen, self.key, self.value = tokens, 0, None, None

    def update(self, key, value, layer_idx=None, cache_kwargs=None):
        if self.key is None:
            self.key = key.new_empty(key.shape[:2] + (self.tokens,) + key.shape[3:])
            self.value = value.new_empty(value.shape[:2] + (self.tokens,) + value.shape[3:])
        end = self.seen + key.shape[2]
        self.key[:, :, self.seen:end].copy_(key)
        self.value[:, :, self.seen:end].copy_(value)
        self.seen = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def get_seq_length(self, layer_idx=0) -> int:
        return self.seen


class LatentKeys:
    """An MLA layer's keys and values before their expansion to heads (transformers 5 caches the
    latents and expands the whole prefix at every call: ``expand_kv``): :meth:`block` expands only
    the heads and positions one block of :class:`BoundedAttention` needs, so the ``[heads, T,
    qk + v]`` keys and values never exist at once."""

    def __init__(self, module, kv_nope, k_rot):
        #: kv_nope ``[batch, 1, T, kv_lora_rank]`` (after its norm), k_rot ``[batch, 1, T, rope]`` (rotated)
        self.module, self.kv_nope, self.k_rot = module, kv_nope, k_rot
        self.shape = (kv_nope.shape[0], module.num_heads, kv_nope.shape[2], module.qk_head_dim)
        self.v_head_dim = module.v_head_dim

    def block(self, h0: int, h1: int, k0: int, k1: int):
        """keys ``[batch, h1-h0, k1-k0, qk]`` and values ``[batch, h1-h0, k1-k0, v]``, as ``expand_kv``
        computes them, for heads ``h0:h1`` at positions ``k0:k1``."""
        import torch

        m = self.module
        per_head = m.qk_nope_head_dim + m.v_head_dim
        rows = slice(h0 * per_head, h1 * per_head)
        bias = m.kv_b_proj.bias[rows] if m.kv_b_proj.bias is not None else None
        kv = torch.nn.functional.linear(self.kv_nope[:, 0, k0:k1], m.kv_b_proj.weight[rows], bias)
        kv = kv.view(kv.shape[0], k1 - k0, h1 - h0, per_head).transpose(1, 2)
        k_nope, value = torch.split(kv, [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        key = kv.new_empty(*kv.shape[:-1], m.qk_head_dim)
        key[..., :m.qk_nope_head_dim].copy_(k_nope)
        key[..., m.qk_nope_head_dim:].copy_(self.k_rot[:, :, k0:k1].expand(-1, h1 - h0, -1, -1))
        return key, value


class BoundedAttention:
    """Causal attention without a dense ``[T, T]`` mask or a ``[heads, T, T]`` score tensor: torch's
    ``scaled_dot_product_attention`` on blocks of heads x queries, each against the keys up to its
    last query (the queries are the last ``q`` of the ``k`` positions: a chunk after its prefix),
    each block's scores at most ``SCORE_BYTES``. Registered with transformers' ``AttentionInterface``
    as the layers' attention; the mask transformers passes is not read (causality, and a layer's
    ``sliding_window``, are built per block). Attention that changes the scores otherwise (a
    ``softcap``, sinks ``s_aux``) goes to transformers' own SDPA with the chunk's mask."""

    #: attention arguments this function does not implement
    STOCK_ONLY = ("softcap", "s_aux", "sinks")

    def __init__(self, scaling: Llama4Scaling | None = None):
        #: llama_4_scaling applied to the query (while it is ``active``), at the queries' own positions
        self.scaling = scaling
        self.name = f"specops_bounded_sdpa_{id(self):x}"

    def register(self) -> str:
        from transformers import AttentionInterface

        AttentionInterface.register(self.name, self.attention)
        return self.name

    def defer_expansion(self, layer) -> None:
        """Let this attention expand an MLA layer's latents block by block (:class:`LatentKeys`): its
        attention module's ``expand_kv`` (transformers 5) hands them over unexpanded while this
        function is the layers' attention, and expands as before otherwise (:func:`dense_forward`)."""
        for module in layer.modules():
            expand = getattr(module, "expand_kv", None)
            if not callable(expand) or getattr(module, "kv_b_proj", None) is None:
                continue

            def deferred(kv_nope, k_rot, module=module, expand=expand):
                if module.config._attn_implementation != self.name:
                    return expand(kv_nope, k_rot)
                latent = LatentKeys(module, kv_nope, k_rot)
                return latent, latent
            module.expand_kv = deferred

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        import torch

        latent = key if isinstance(key, LatentKeys) else None
        batch, heads, q_len, _ = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        first = k_len - q_len  # the position of the first query
        if self.scaling is not None and self.scaling.active:
            query = self.scaling.scale(query, first)
        if any(kwargs.get(name) is not None for name in self.STOCK_ONLY):
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            if latent is not None:
                key, value = latent.block(0, kv_heads, 0, k_len)
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        per_kv = heads // kv_heads
        window = kwargs.get("sliding_window")
        v_dim = latent.v_head_dim if latent is not None else value.shape[-1]
        out = query.new_empty((batch, q_len, heads, v_dim))
        # the biggest block: scores, their softmax and a copy (torch's math path) of kv heads x queries x keys
        # (+ an MLA block's keys and values, expanded for it)
        row = 3 * per_kv * k_len * query.element_size() * batch
        rows = max(1, SCORE_BYTES // row)
        q_step = min(q_len, rows)
        per_head = (q_step * 3 * per_kv + (2 * query.shape[-1] if latent is not None or v_dim != query.shape[-1]
                                           else 0)) * k_len * query.element_size() * batch
        kv_step = max(1, min(kv_heads, SCORE_BYTES // per_head))
        lowest = max(0, first - window + 1) if window else 0  # the first key any query here sees
        for g0 in range(0, kv_heads, kv_step):
            g1 = min(kv_heads, g0 + kv_step)
            # an MLA head group's keys and values expanded once for all of this chunk's queries
            if latent is not None:
                keys_g, values_g = latent.block(g0, g1, lowest, k_len)
            else:
                keys_g, values_g = key[:, g0:g1, lowest:], value[:, g0:g1, lowest:]
            if v_dim != keys_g.shape[-1]:  # MLA: torch's flash kernel (no score tensor) wants one head dim
                values_g = torch.nn.functional.pad(values_g, (0, keys_g.shape[-1] - v_dim))
            for q0 in range(0, q_len, q_step):
                q1 = min(q_len, q0 + q_step)
                k1 = first + q1  # keys up to the block's last query
                k0 = max(0, first + q0 - window + 1) if window else 0
                positions = torch.arange(first + q0, first + q1)[:, None]
                keys = torch.arange(k0, k1)[None, :]
                allowed = keys <= positions
                if window:
                    allowed &= keys > positions - window
                got = torch.nn.functional.scaled_dot_product_attention(
                    query[:, g0 * per_kv:g1 * per_kv, q0:q1], keys_g[:, :, k0 - lowest:k1 - lowest],
                    values_g[:, :, k0 - lowest:k1 - lowest], attn_mask=allowed, scale=scaling,
                    enable_gqa=per_kv > 1)
                out[:, q0:q1, g0 * per_kv:g1 * per_kv] = got[..., :v_dim].transpose(1, 2)
        return out, None


def forward(factory: LayerFactory, layer, x, chunk: int = QUERY_CHUNK, dtype=None):
    """Layer output ``[T, H]`` for its input ``x`` ``[T, H]`` (one sequence from position 0, causal),
    in ``dtype`` (default: the dtype of ``x``; each chunk of ``x`` is converted as it is run, so a
    bf16 capture is never held in float32 whole), in bounded memory at any length: the layer runs on ``chunk`` query
    positions at a time with the keys and values of the positions before (:class:`PrefixCache`),
    so its activations -- projections, MoE experts, attention (:class:`BoundedAttention`) -- are
    those of ``chunk`` tokens, no ``[T, T]`` mask is built, and a MoE router sees a chunk at a time
    (:class:`remote.verify.routing.RouterControl` joins them by ``position_ids``)."""
    import torch

    tokens = x.shape[0]
    dtype = dtype or x.dtype
    out = torch.empty(x.shape, dtype=dtype)
    cache = PrefixCache(tokens)
    with torch.inference_mode():
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            hidden = x[start:end].to(dtype).unsqueeze(0)
            positions = torch.arange(start, end).unsqueeze(0)
            # the chunk's causal mask [chunk, end]: only transformers' own attention reads it (STOCK_ONLY)
            mask = torch.zeros((end - start, end), dtype=dtype).masked_fill_(
                torch.arange(end)[None, :] > positions[0][:, None], torch.finfo(dtype).min)[None, None]
            cos_sin = factory.rotary(hidden, positions)
            got = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                        past_key_values=cache, use_cache=True, cache_position=positions[0])
            got = got[0] if isinstance(got, (tuple, list)) else got
            out[start:end] = got[0]
    return out


def dense_forward(factory: LayerFactory, layer, x, dtype=None):
    """The layer on all of ``x`` at once with a dense ``[T, T]`` causal mask and transformers' own
    attention (``factory.stock_attention``): what :func:`forward` replaced, whose memory grows with
    ``T^2``. Kept for the tests and ``scripts/bench_layer_reference.py`` that compare the two."""
    import torch

    x = x.to(dtype or x.dtype)
    tokens = x.shape[0]
    hidden = x.unsqueeze(0)
    positions = torch.arange(tokens).unsqueeze(0)
    mask = torch.full((tokens, tokens), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    bounded, factory.hf_config._attn_implementation = factory.hf_config._attn_implementation, factory.stock_attention
    try:
        with torch.inference_mode():
            cos_sin = factory.rotary(hidden, positions)
            out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                        use_cache=False)
    finally:
        factory.hf_config._attn_implementation = bounded
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out[0]
