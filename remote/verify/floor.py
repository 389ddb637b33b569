"""The rounding floor: how far rounding to the capture's dtype alone moves each layer.

Per-token tolerances let through an error that every token shares while each stays
small: vLLM's CPU rotary op mis-rotating DeepSeek's 3-D query moves the tiny random
DeepSeek-V3 by 3.0-3.3 % nrmse with 317-320 of 320 tokens within tolerance. So the
reference also runs once in the capture's own dtype (bf16), every token routed to the
experts the fp32 reference used, and its nrmse against fp32 is the floor a correct
engine sits at for this model (0.5-0.9 % on the tiny models; a healthy vLLM 0.32 is
0.9-1.2x it at TP=1 and TP=2). A layer above ``FLOOR_FACTOR`` times its floor fails
(:func:`remote.verify.compare.layer_status`). fp32 captures have no floor.

**fp8 captures** (``format: fp8``: float8_e4m3fn with one float32 scale per token over all
the file's layers, hs-connectors' ``quantize_tensor_to_fp8``) have fp8's floor, not
bf16's: the reference in bf16 (what the engine computed in), then every token of the
captured layers quantized the way the connector does (:func:`fp8_round`), against fp32.
The logits check has no whole-model reference; there the dequantized state is quantized
once more on a grid offset from the file's (:func:`fp8_regrid`), which moves it about as
far as the connector's own rounding did.
"""
from __future__ import annotations

from remote.verify.reference import StreamRecorder, load_reference
from remote.verify.routing import RouterControl
from remote.wire import contract

LOW_PRECISION = ("bfloat16", "float16")
#: the capture dtype of an fp8 run's states (dequantized when read: float32 values on the fp8 grid)
FP8 = contract.FP8
#: what an fp8 capture was computed in before the connector quantized it
FP8_COMPUTE_DTYPE = "bfloat16"
#: float8_e4m3fn's largest finite value
FP8_MAX = 448.0
#: the re-quantization grid of :func:`fp8_regrid`: the file's scale times this (not a power of two,
#: so the grids' points do not coincide). Measured on the tiny Llama (4 x 100 tokens, the last state
#: through the head): fp8(bf16 state) vs the bf16 state moves the logprobs 0.92-1.13x what this
#: re-rounding does (1.09: 1.29-1.50x; 1.41: 0.80-0.97x).
REGRID = 1.25


def fp8_round(layers: list) -> list:
    """The ``[T, H]`` states of every captured layer of one sample, quantized to float8_e4m3fn and
    back the way hs-connectors' ``quantize_tensor_to_fp8`` does: one scale per token, its amax over
    all the layers / 448 (float32 results)."""
    import torch

    stacked = torch.stack([x.float() for x in layers], dim=1)  # [T, L, H]
    scale = (stacked.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=1e-12)
    rounded = (stacked / scale).to(torch.float8_e4m3fn).float() * scale
    return [rounded[:, k] for k in range(len(layers))]


def fp8_with_scales(state, scales):
    """``state`` ``[T, H]`` quantized to float8_e4m3fn with the given per-token ``scales`` ``[T, 1]`` and
    back (float32): what the connector stores of it, where the token's scale is known."""
    import torch

    scale = scales.float().reshape(-1, 1)
    return (state.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def fp8_regrid(state, scales):
    """``state`` ``[T, H]`` (dequantized fp8, float32) quantized again with each token's scale
    (``scales`` ``[T, 1]``) times :data:`REGRID`: a rounding as large as the connector's, on another grid."""
    return fp8_with_scales(state, scales.float().reshape(-1, 1) * REGRID)


def rounding_floor(model_path, dtype: str, trust_remote_code: bool, kept: list[dict], expected: dict) -> dict:
    """How far rounding to ``dtype`` alone moves each captured layer of this model.

    The same transformers forward, run in the capture's dtype with every token routed to
    the experts the fp32 reference used (so a router near-tie cannot count twice), on the
    verified samples. Its nrmse against the fp32 reference is what a correct engine in
    that dtype should show, whatever the model's weights make of bf16 (tiny random
    models, sharp twins and trained models differ by several times). An engine far
    above it computes something else for every token -- a defect that per-token
    tolerances alone let through when it is small.

    :param kept: per sample ``{"ids", "streams": {layer id: fp32 [T, H]}, "experts": {router
        layer: {token: experts}}}``.
    :param expected: layer id -> stream index (HF ``hidden_states`` index).
    :param dtype: the capture's dtype, or ``fp8`` (computed in bf16, stored as fp8 per token).
    :returns: ``{"dtype", "nrmse": {layer id: worst nrmse} or None, "why"}``.
    """
    fp8 = dtype == FP8
    if dtype not in LOW_PRECISION and not fp8:
        return {"dtype": dtype, "nrmse": None, "why": f"the capture is {dtype}: no rounding floor to measure"}
    worst = {lid: 0.0 for lid in expected}
    try:
        model = load_reference(model_path, FP8_COMPUTE_DTYPE if fp8 else dtype, trust_remote_code).model
        recorder = StreamRecorder(model)
        route = RouterControl(recorder.layers)
        try:
            for sample in kept:
                route.forced = sample["experts"]
                streams = recorder.streams(model, sample["ids"])
                lids = list(sample["streams"])
                stored = fp8_round([streams[expected[lid]] for lid in lids]) if fp8 else \
                    [streams[expected[lid]] for lid in lids]
                for lid, rounded in zip(lids, stored):
                    reference = sample["streams"][lid]
                    worst[lid] = max(worst[lid], float((rounded - reference).norm() / (reference.norm() + 1e-12)))
        finally:
            route.close()
            recorder.close()
    except Exception as exc:  # a dtype this CPU's kernels lack must not cost the fp32 verdict
        return {"dtype": dtype, "nrmse": None, "why": f"the {dtype} reference failed: {type(exc).__name__}: {exc}"}
    return {"dtype": dtype, "nrmse": worst, "why": None}
