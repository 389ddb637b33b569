"""Capacity probe: the bytes an extraction run writes, against free disk at the output dir.

speculators 0.3.0 writes one ``data_{idx}.pt`` per sample holding ``input_ids`` and
``loss_mask`` (int64 per token) and one ``[tokens, hidden]`` tensor per captured layer.
The vllm-server engine writes one ``hs_{idx}.safetensors`` per sample: ``token_ids``
(int64 ``[T]``) and ``hidden_states`` ``[T, L, H]`` in the model dtype. With every
sample at ``seq_len`` tokens this is an upper bound::

    samples x seq_len x (hidden x layers x dtype_bytes + id_arrays x 8) + samples x overhead

With ``format: fp8`` (vllm-server) each value is one byte (float8_e4m3fn) and each token
adds its float32 scale (``hidden_states_scales`` [T, 1, 1]): about half the bf16 figure, landed at
bf16's rate (0.99x) and made durable at 1.4x through specops' connector (``contract.FP8_SPEED``, and the
stock connector's half of it where specops' cannot run), which the record says wherever it names fp8.
"""
from __future__ import annotations

from remote.probes import Context
from remote.wire.contract import (FP8, FP8_SCALES_KEY, FP8_SPEED, FP8_SPEED_COST, HS, PT, VLLM_SERVER, sample_name,
                                  state_format)
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import human_bytes

TOKEN_ID_BYTES = 8  # one int64 per token per id array
PER_SAMPLE_OVERHEAD = 4096  # torch.save's zip container and pickle, or a safetensors header, per file
#: engine -> (sample file, int64 arrays per token): ``input_ids`` + ``loss_mask`` in 0.3's
#: ``.pt``, ``token_ids`` alone in the server's safetensors.
ENGINE_FILES = {VLLM_SERVER: (sample_name("{i}", HS) + " [T, L, H]", 1)}
DEFAULT_FILES = (sample_name("{i}", PT), 2)
DEFAULT_LAYER_COUNT = 4  # EAGLE-3 captures four layers by default
TIGHT_SHARE = 0.8
#: fp8 states: one byte a value, plus one float32 scale a token
FP8_VALUE_BYTES, FP8_SCALE_BYTES = 1, 4


def output_bytes(samples: int, seq_len: int, hidden: int, num_layers: int, dtype_bytes: int,
                 id_arrays: int = 2, token_extra_bytes: int = 0) -> int:
    """Upper bound of the bytes written for ``samples`` samples of ``seq_len`` tokens
    (``token_extra_bytes``: more bytes a token, an fp8 file's scale)."""
    per_token = hidden * num_layers * dtype_bytes + id_arrays * TOKEN_ID_BYTES + token_extra_bytes
    return samples * (seq_len * per_token + PER_SAMPLE_OVERHEAD)


def probe(ctx: Context) -> list:
    hidden = ctx.model.get("hidden_size")
    disk = (ctx.host.get("disk") or {}).get("output_dir")
    if not hidden or not disk:
        why = "no hidden size (model config unreadable)" if not hidden else "no free-disk figure for output_dir"
        return [record("capacity.output", SKIPPED, why, detail={})]
    params = ctx.params
    samples = params["max_samples"]
    if ctx.data.get("records") is not None:
        samples = min(samples, ctx.data["records"])
    n_layers = len(ctx.layers.get("ids") or []) or DEFAULT_LAYER_COUNT
    sample_file, id_arrays = ENGINE_FILES.get(params["engine"], DEFAULT_FILES)
    fmt = state_format(params)
    fp8 = fmt == FP8 and params["engine"] == VLLM_SERVER
    dtype_bytes = FP8_VALUE_BYTES if fp8 else params["hidden_dtype_bytes"]
    extra = FP8_SCALE_BYTES if fp8 else 0
    need = output_bytes(samples, params["seq_len"], hidden, n_layers, dtype_bytes, id_arrays, extra)
    free = disk["free_bytes"]
    detail = {"samples": samples, "max_samples": params["max_samples"], "dataset_records": ctx.data.get("records"),
              "seq_len": params["seq_len"], "hidden_size": hidden, "layers": n_layers, "format": fmt,
              "dtype_bytes": dtype_bytes, "token_extra_bytes": extra, "bytes": need, "free_bytes": free,
              "measured_at": disk["measured_at"], "upper_bound": True, "sample_file": sample_file,
              "per_sample_bytes": need // samples if samples else 0}
    if fp8:
        detail["bf16_bytes"] = output_bytes(samples, params["seq_len"], hidden, n_layers,
                                            params["hidden_dtype_bytes"], id_arrays)
        detail["fp8_speed"] = dict(FP8_SPEED)
    states = (f"fp8 + {FP8_SCALES_KEY}, {need / max(detail['bf16_bytes'], 1):.2f}x bf16's bytes, {FP8_SPEED_COST}"
              if fp8 else f"{fmt}, {dtype_bytes} bytes a value")
    line = (f"up to {human_bytes(need)} for {samples} samples x {params['seq_len']} tokens x {n_layers} layers "
            f"x {hidden} ({sample_file}; {states}) vs {human_bytes(free)} free at {disk['measured_at']}")
    if need > free:
        to_fp8 = "" if fp8 or params["engine"] != VLLM_SERVER else \
            f", or write fp8 states (format: fp8, about half the bytes; {FP8_SPEED_COST})"
        return record_list(FAIL, line, detail, fix="free disk at the output dir, point output_dir at a bigger "
                                                    "disk, or lower max_samples / seq_len" + to_fp8)
    if need > TIGHT_SHARE * free:
        return record_list(WARN, line, detail, fix="leave headroom: free disk or lower max_samples")
    return record_list(OK, line, detail)


def record_list(status, summary, detail, fix=None):
    return [record("capacity.output", status, summary, detail=detail, fix=fix)]
