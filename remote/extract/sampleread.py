"""Reading a sample file back: its structure, its digest and its per-layer statistics (stdlib at import).

:func:`digest_hs_file` reads one ``hs_{i}.safetensors`` once (memory-mapped) for
everything a manifest keeps; :func:`hs_file_problem` judges a file by its safetensors
header alone (a resume counts only whole files); :class:`LayerStats` adds the layers
of many samples up, from tensors (``data_{i}.pt``) or from :func:`layer_partial` results.
:mod:`remote.extract.samples` names the files and walks a run's samples with these.

torch is imported inside the functions that need it.
"""
from __future__ import annotations

import json
import math
import os
import threading

from remote.wire import fsutil
from remote.wire.contract import FP8, FP8_SCALES_KEY


class LayerStats:
    """Running statistics of one layer over all samples (float64 sums; exact NaN/Inf counts)."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id
        self.count = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.abs_max = 0.0
        self.nan = 0
        self.inf = 0
        self.hidden = None
        self.dtype = None
        self.tokens = 0

    def add(self, tensor) -> None:
        import torch

        t = tensor.detach().to(torch.float64)
        finite = torch.isfinite(t)
        self.nan += int(torch.isnan(t).sum())
        self.inf += int(torch.isinf(t).sum())
        good = t[finite]
        self.count += good.numel()
        self.total += float(good.sum())
        self.total_sq += float((good * good).sum())
        if good.numel():
            self.abs_max = max(self.abs_max, float(good.abs().max()))
        self.tokens += int(tensor.shape[0])
        self.hidden = int(tensor.shape[-1])
        self.dtype = str(tensor.dtype).replace("torch.", "")

    def merge(self, part: dict) -> None:
        """Add one sample's :func:`layer_partial` (computed as the file landed)."""
        self.count += part["count"]
        self.total += part["total"]
        self.total_sq += part["total_sq"]
        if part["count"]:
            self.abs_max = max(self.abs_max, part["abs_max"])
        self.nan += part["nan"]
        self.inf += part["inf"]
        self.tokens += part["tokens"]
        self.hidden, self.dtype = part["hidden"], part["dtype"]

    def as_dict(self) -> dict:
        mean = self.total / self.count if self.count else float("nan")
        var = self.total_sq / self.count - mean * mean if self.count else float("nan")
        return {
            "layer_id": self.layer_id,
            "shape": [self.tokens, self.hidden],
            "dtype": self.dtype,
            "mean": mean,
            "std": math.sqrt(max(var, 0.0)) if self.count else float("nan"),
            "abs_max": self.abs_max,
            "nan": self.nan,
            "inf": self.inf,
        }


#: how many non-finite places a refusal lists in its detail (the count says how many there were)
MAX_NONFINITE_LISTED = 20


def non_finite(hidden_states, layer_ids, scales=None) -> list[dict]:
    """Every ``{layer, token, what}`` place of one sample whose state is not finite, ``what`` being the first
    non-finite value's kind (``NaN``, ``+Inf``, ``-Inf``). An fp8 file's non-finite per-token scale is named as
    ``layer: "scale"`` and its token's layers are not listed again (the scale spoils all of them).

    The one reader of non-finite states: the supervisor refuses a batch with it before writing, and
    ``verify.states`` refuses a landed run with it."""
    import torch

    found = []
    if scales is not None:
        flat = scales.reshape(-1)
        for token in (~torch.isfinite(flat)).nonzero().flatten().tolist():
            found.append({"layer": "scale", "token": token, "what": _value_kind(float(flat[token]))})
    spoiled = {p["token"] for p in found}
    for lid, states in zip(layer_ids, hidden_states):
        rows = (~torch.isfinite(states)).reshape(states.shape[0], -1).any(dim=-1)
        for token in rows.nonzero().flatten().tolist():
            if token in spoiled:
                continue
            value = states[token].reshape(-1)
            found.append({"layer": lid, "token": token, "what": _value_kind(float(value[~torch.isfinite(value)][0]))})
    return found


def _value_kind(value: float) -> str:
    return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")


def read_pt_sample(path, stats, layer_ids):
    """Add a ``data_{i}.pt`` file's layers to ``stats``; returns ``(tokens, tensors entry)``."""
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    hs = data.get("hidden_states")
    if not isinstance(hs, list) or len(hs) != len(layer_ids):
        raise ValueError(f"{path}: hidden_states holds {len(hs) if isinstance(hs, list) else hs!r} "
                         f"layers, expected {len(layer_ids)} ({layer_ids})")
    n = int(data["input_ids"].shape[0])
    for st, h in zip(stats, hs):
        if tuple(h.shape[:1]) != (n,):
            raise ValueError(f"{path}: layer {st.layer_id} has {h.shape[0]} rows for {n} tokens")
        st.add(h)
    return n, {
        "input_ids": shape_dtype(data["input_ids"]),
        "loss_mask": shape_dtype(data["loss_mask"]),
        "hidden_states": [dict(layer_id=lid, **shape_dtype(h)) for lid, h in zip(layer_ids, hs)],
    }


#: safetensors dtype -> (bytes per element, torch dtype name)
_ST_DTYPES = {"BF16": (2, "bfloat16"), "F16": (2, "float16"), "F32": (4, "float32"), "F64": (8, "float64"),
              "I64": (8, "int64"), "I32": (4, "int32"), "F8_E4M3": (1, "float8_e4m3fn")}
#: the safetensors dtype of an fp8 file's states (hs-connectors' FP8HiddenStatesConnector)
FP8_DTYPE = "F8_E4M3"
#: a safetensors header larger than this is not one the connector wrote
_MAX_HEADER = 1 << 24


def _hs_header(handle, size: int):
    """``(header, data_start, problem)`` of an open safetensors file of ``size`` bytes."""
    head = handle.read(8)
    if len(head) < 8:
        return None, 0, f"{size} bytes: shorter than a safetensors header"
    header_len = int.from_bytes(head, "little")
    if header_len > min(_MAX_HEADER, size - 8):
        return None, 0, f"header length {header_len} does not fit a {size}-byte file"
    try:
        header = json.loads(handle.read(header_len))
    except ValueError as exc:
        return None, 0, f"unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return None, 0, "safetensors header is not a JSON object"
    data_start = 8 + header_len
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            width = _ST_DTYPES[info["dtype"]][0]
            count = math.prod(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            return None, 0, f"tensor {name!r}: dtype/shape/data_offsets unreadable ({info!r})"
        if hi - lo != count * width or lo < 0:
            return None, 0, f"tensor {name!r}: {hi - lo} bytes for shape {info['shape']} {info['dtype']}"
        end = max(end, hi)
    if data_start + end != size:
        return None, 0, f"{size} bytes, but its header declares {data_start + end} (cut short or padded)"
    return header, data_start, None


def hs_file_problem(path) -> str | None:
    """Why ``path`` is not a whole safetensors file (header only, nothing loaded); None if it is."""
    try:
        with open(path, "rb") as handle:
            return _hs_header(handle, os.fstat(handle.fileno()).st_size)[2]
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


#: the float32 working set of one statistics step: small enough to stay in a core's L2 cache.
#: One pass over a whole layer (a 4096-token, 4096-wide layer is 64 MB in float32) went to DRAM
#: three times (sum, dot, min/max) and cost 3x per byte what a 1024-token one did
#: (scripts/bench_digest.py prints both).
STATS_BLOCK_BYTES = 2 << 20


def layer_partial(x, scales=None) -> dict:
    """Mergeable statistics of one layer's ``[T, H]`` states (see :meth:`LayerStats.merge`).

    Sums in float32, a block of tokens at a time (:data:`STATS_BLOCK_BYTES`: each block's
    float32 copy is summed, squared and ranged while it is still in cache), so the cost is
    linear in the tokens. ``scales`` (``[T, 1]`` float32): an fp8 layer's per-token scales,
    applied to each block (the statistics of what a reader dequantizes). The exact NaN/Inf
    split only when a sum is not finite.
    """
    import torch

    n, width = int(x.shape[0]), int(x.shape[-1])
    rows = max(1, STATS_BLOCK_BYTES // (4 * max(1, width)))
    total = total_sq = 0.0
    lo, hi = math.inf, -math.inf
    for start in range(0, n, rows):
        f = x[start:start + rows].float()
        if scales is not None:
            f = f * scales[start:start + rows]
        f = f.reshape(-1)
        total += float(f.sum())
        total_sq += float(torch.dot(f, f))
        low, high = torch.aminmax(f)
        lo, hi = min(lo, float(low)), max(hi, float(high))
    part = {"tokens": n, "hidden": width, "dtype": str(x.dtype).replace("torch.", "")}
    if all(map(math.isfinite, (total, total_sq, lo, hi))) and n:
        return dict(part, count=n * width, total=total, total_sq=total_sq, abs_max=max(-lo, hi), nan=0, inf=0)
    d = (x.float() * scales if scales is not None else x).double().reshape(-1)
    finite = torch.isfinite(d)
    good = d[finite]
    return dict(part, count=good.numel(), total=float(good.sum()), total_sq=float((good * good).sum()),
                abs_max=float(good.abs().max()) if good.numel() else 0.0,
                nan=int(torch.isnan(d).sum()), inf=int(torch.isinf(d).sum()))


#: float8_e4m3fn's value is the float16 its 7 magnitude bits make, shifted 7 up, times this (see :func:`_fp8_widener`)
FP8_AS_HALF_FACTOR = 256.0


def _fp8_widener(states):
    """``(start, stop, pos, out) -> out``: an fp8 ``[T, L, H]`` tensor's rows of one layer as float32,
    divided by :data:`FP8_AS_HALF_FACTOR` (exact: a power of two; the caller folds it into the scales).

    e4m3fn's exponent (4 bits, bias 7) and mantissa (3 bits) shifted 7 up are the low exponent and top
    mantissa bits of a float16 (5 bits, bias 15): that half is the fp8 value / 2^8, subnormals included,
    and a half widens to float32 in hardware. So an int8 -> int16 widening (sign-extended), a shift and
    a mask make the halves: ~10x the speed of a 256-entry table lookup, which was the fp8 digest's limit
    (a byte a cycle; torch's own float8 cast is slower still). The NaN codes (0x7F, 0xFF) would read as
    480 / 256: a block that holds one reads NaN, and the caller takes the exact NaN/Inf path.
    """
    import torch

    codes = states.view(torch.int8)

    def widen(start, stop, pos, out):
        block = codes[start:stop, pos]
        halves = _thread_buffer("halves", block.numel(), torch.int16).view(block.shape)
        halves.copy_(block)  # sign-extended: the sign lands on bit 15 and bit 14 (the half's top exponent bit)
        halves.bitwise_left_shift_(7).bitwise_and_(~0x4000)
        out.copy_(halves.view(torch.float16))
        if int(block.view(torch.uint8).bitwise_and(0x7F).amax()) == 0x7F:
            out.view(-1)[0] = math.nan
        return out
    return widen


#: one float32 block per digest thread, reused file after file (see :func:`_block_buffer`)
_BLOCKS = threading.local()


def _block_buffer(rows: int, width: int):
    """This thread's float32 ``[rows, width]`` working block, allocated once and reused.

    A fresh ``.float()`` copy per block and layer was a new 2 MiB allocation each time: glibc
    hands blocks that size out by ``mmap`` and back by ``munmap``, so every block paid page faults
    on new memory, and every thread of the process queued on the kernel's one lock for its
    address space -- the digest ran 2-3x slower per byte and stopped scaling with threads
    (``scripts/bench_digest.py`` prints the ratio).
    """
    import torch

    return _thread_buffer("buf", rows * width, torch.float32).view(rows, width)


def _thread_buffer(name: str, need: int, dtype):
    """This thread's flat buffer ``name`` of at least ``need`` elements of ``dtype``, reused (see
    :func:`_block_buffer`)."""
    import torch

    buf = getattr(_BLOCKS, name, None)
    if buf is None or buf.numel() < need or buf.dtype != dtype:
        buf = torch.empty(need, dtype=dtype)
        setattr(_BLOCKS, name, buf)
    return buf[:need]


def _one_pass(mapped, data_start: int, offsets, states, scales, positions) -> tuple[list[dict], dict]:
    """The file's digest and its layers' statistics in one walk over the bytes, in file order.

    The states are hashed and summed a block of tokens at a time (the rows whose float32 copy
    of one layer is :data:`STATS_BLOCK_BYTES`): each block is hashed, then each layer's part of it
    summed, while it is still in cache, so each byte leaves memory once. Hashing the whole
    file, then the statistics layer by layer, read every byte twice from memory, and digests
    on several threads stopped scaling at ~4 GB/s on the H200 host. The hash is updated in file order, so it equals the whole
    file's (:func:`remote.wire.fsutil.buffer_digest`).

    :param positions: the file's layer index of each layer to report, in report order.
    :returns: ``(layer partials as :func:`layer_partial` gives them, {algorithm: hex})``.
    """
    import torch

    name = fsutil.default_hash()
    hasher = fsutil.new_hasher(name)
    view = memoryview(mapped)
    lo, hi = data_start + int(offsets[0]), data_start + int(offsets[1])
    hasher.update(view[:lo])
    n, width = int(states.shape[0]), int(states.shape[-1])
    row_bytes = (hi - lo) // n if n else 0
    # a block holds STATS_BLOCK_BYTES of one layer in float32; hashed for all layers, summed layer by layer
    rows = max(1, STATS_BLOCK_BYTES // (4 * max(1, width)))
    sums = {pos: [0.0, 0.0, math.inf, -math.inf] for pos in positions}
    widen = _fp8_widener(states) if states.dtype == getattr(torch, _ST_DTYPES[FP8_DTYPE][1]) else None
    block_scales = scales
    if widen:  # the widened halves are the values / FP8_AS_HALF_FACTOR: the scales take it back (exact)
        block_scales = (scales if scales is not None else torch.ones(n, 1)) * FP8_AS_HALF_FACTOR
    block = _block_buffer(rows, width)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        hasher.update(view[lo + start * row_bytes:lo + stop * row_bytes])
        for pos, acc in sums.items():
            f = block[:stop - start]
            if widen:
                widen(start, stop, pos, f)
            else:
                f.copy_(states[start:stop, pos])
            if block_scales is not None:
                f.mul_(block_scales[start:stop])
            f = f.reshape(-1)
            acc[0] += float(f.sum())
            acc[1] += float(torch.dot(f, f))
            low, high = torch.aminmax(f)
            acc[2], acc[3] = min(acc[2], float(low)), max(acc[3], float(high))
    hasher.update(view[hi:])
    del view
    layers = []
    for pos in positions:
        total, total_sq, low, high = sums[pos]
        if n and all(map(math.isfinite, sums[pos])):
            layers.append({"tokens": n, "hidden": width, "dtype": str(states.dtype).replace("torch.", ""),
                           "count": n * width, "total": total, "total_sq": total_sq,
                           "abs_max": max(-low, high), "nan": 0, "inf": 0})
        else:  # the exact NaN/Inf split (rare: a file that is about to be refused)
            layers.append(layer_partial(states[:, pos], scales))
    return layers, {name: hasher.hexdigest()}


def digest_hs_file(path, layer_ids, file_layer_ids, token_ids=None, hidden_size=None, state_format=None) -> dict:
    """Everything a run keeps about one ``hs`` file, from a single read of it.

    Checks the safetensors structure and size, ``token_ids`` (int64 [T]; equal to
    ``token_ids`` when given), ``hidden_states`` ([T, len(file_layer_ids), H], H =
    ``hidden_size`` when given), and NaN/Inf; hashes the bytes (BLAKE3 where this python has it, else sha256; one thread) and
    computes each layer's statistics (as :func:`layer_partial`, in ``layer_ids`` order), both in
    one pass over the bytes (:func:`_one_pass`). The file is memory-mapped
    once: hash, checks and statistics read the page cache in place, nothing is copied whole.

    An fp8 file (``hidden_states`` float8_e4m3fn) must carry its per-token scales
    (``hidden_states_scales`` float32 [T, 1, 1]); its statistics and NaN/Inf check are of the
    dequantized values (fp8 x scale), what a reader through the fp8 backend gets.
    ``state_format`` (``bf16``/``fp8``; None: either) is the format the run asked for: a file
    of the other one is a problem.

    :returns: ``{"problems": [...], "tokens", "bytes", "hash", "tensors", "layers"}``, ``hash``
        the manifest entry's ``{algorithm: hex}``;
        with problems, the rest may be missing.
    """
    import mmap

    import torch

    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        header, data_start, problem = _hs_header(handle, size)
        if problem:
            return {"problems": [problem]}
        missing = {"token_ids", "hidden_states"} - set(header)
        if missing:
            return {"problems": [f"file lacks {sorted(missing)} (has {sorted(set(header) - {'__metadata__'})})"]}
        # ACCESS_COPY: a private, writable view (torch.frombuffer wants one); the file is never written
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        problems = []
        tid, hs = header["token_ids"], header["hidden_states"]
        if tid["dtype"] != "I64" or len(tid["shape"]) != 1:
            return {"problems": [f"token_ids is {tid['dtype']} {tid['shape']}, expected int64 [T]"]}
        n = int(tid["shape"][0])
        ids = torch.frombuffer(mapped, dtype=torch.int64, count=n, offset=data_start + tid["data_offsets"][0])
        if token_ids is not None and ids.tolist() != list(token_ids):
            problems.append(f"token_ids do not echo the request ({n} ids back, {len(token_ids)} sent)")
        shape, want = [int(d) for d in hs["shape"]], [n, len(file_layer_ids)]
        if len(shape) != 3 or shape[:2] != want or (hidden_size and shape[2] != hidden_size) or \
                hs["dtype"] not in ("BF16", "F16", "F32", "F64", FP8_DTYPE):
            problems.append(f"hidden_states {hs['dtype']} {shape}, expected a float [{want[0]}, {want[1]}, "
                            f"{hidden_size or 'H'}] [T, L, H] (layers {list(file_layer_ids)})")
            return {"problems": problems}
        fp8 = hs["dtype"] == FP8_DTYPE
        if state_format is not None and fp8 != (state_format == FP8):
            problems.append(f"hidden_states is {hs['dtype']}, but the run asked for {state_format} states (is the "
                            f"server's connector the one for format {state_format}?)")
            return {"problems": problems}
        scales = None
        if fp8:
            sc = header.get(FP8_SCALES_KEY)
            if sc is None or sc["dtype"] != "F32" or [int(d) for d in sc["shape"]] != [n, 1, 1]:
                found = f"{sc['dtype']} {sc['shape']}" if sc else "missing"
                problems.append(f"fp8 hidden_states need {FP8_SCALES_KEY} float32 [{n}, 1, 1] (per-token scales): {found}")
                return {"problems": problems}
            scales = torch.frombuffer(mapped, dtype=torch.float32, count=n,
                                      offset=data_start + sc["data_offsets"][0]).view(n, 1)
        states = torch.frombuffer(mapped, dtype=getattr(torch, _ST_DTYPES[hs["dtype"]][1]),
                                  count=math.prod(shape), offset=data_start + hs["data_offsets"][0]).view(shape)
        positions = [list(file_layer_ids).index(lid) for lid in layer_ids]
        layers, digest = _one_pass(mapped, data_start, hs["data_offsets"], states, scales, positions)
        if fp8:  # statistics of what a reader gets: fp8 x its token's scale, in float32
            layers = [dict(part, dtype="float8_e4m3fn") for part in layers]
        bad = [(lid, p["nan"], p["inf"]) for lid, p in zip(layer_ids, layers) if p["nan"] or p["inf"]]
        if bad:
            problems.append("hidden_states has NaN/Inf: " + ", ".join(
                f"layer {lid}: {nan} NaN, {inf} Inf" for lid, nan, inf in bad))
        entry = {"token_ids": {"shape": [n], "dtype": "int64"},
                 "hidden_states": {"layer_ids": list(file_layer_ids), "shape": shape,
                                   "dtype": _ST_DTYPES[hs["dtype"]][1]}}
        if fp8:
            entry[FP8_SCALES_KEY] = {"shape": [n, 1, 1], "dtype": "float32"}
        del ids, states, scales
        return {"problems": problems, "tokens": n, "bytes": size, "hash": digest, "tensors": entry,
                "layers": layers}
    finally:
        try:
            mapped.close()
        except BufferError:  # a tensor view still alive (an exception above): the GC unmaps it
            pass


def shape_dtype(t) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def digest_process_init() -> None:
    """A digest process's start (:class:`remote.extract.engines.vllm_server.landing.DigestPool`): torch
    imported once, one intra-op thread (the pool is the parallelism)."""
    import torch

    torch.set_num_threads(1)


def digest_process_ready(hold_s: float = 0.05) -> int:
    """The pool start's probe (a no-op task): this process's pid, once it is up. Held a moment so the
    first process up does not take every probe, though one that is still importing torch takes none."""
    import time

    time.sleep(hold_s)
    return os.getpid()
