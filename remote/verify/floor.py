"""The rounding floor: how far rounding to the capture's dtype alone moves each layer.

Per-token tolerances let through an error that every token shares while each stays
small: vLLM's CPU rotary op mis-rotating DeepSeek's 3-D query moves the tiny random
DeepSeek-V3 by 3.0-3.3 % nrmse with 317-320 of 320 tokens within tolerance. So the
reference also runs once in the capture's own dtype (bf16), every token routed to the
experts the fp32 reference used, and its nrmse against fp32 is the floor a correct
engine sits at for this model (0.5-0.9 % on the tiny models; a healthy vLLM 0.32 is
0.9-1.2x it at TP=1 and TP=2). A layer above ``FLOOR_FACTOR`` times its floor fails
(:func:`remote.verify.compare.layer_status`). fp32 captures have no floor.
"""
from __future__ import annotations

from remote.verify.reference import StreamRecorder, load_reference
from remote.verify.routing import RouterControl

LOW_PRECISION = ("bfloat16", "float16")


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
    :returns: ``{"dtype", "nrmse": {layer id: worst nrmse} or None, "why"}``.
    """
    if dtype not in LOW_PRECISION:
        return {"dtype": dtype, "nrmse": None, "why": f"the capture is {dtype}: no rounding floor to measure"}
    worst = {lid: 0.0 for lid in expected}
    try:
        model = load_reference(model_path, dtype, trust_remote_code).model
        recorder = StreamRecorder(model)
        route = RouterControl(recorder.layers)
        try:
            for sample in kept:
                route.forced = sample["experts"]
                streams = recorder.streams(model, sample["ids"])
                for lid, reference in sample["streams"].items():
                    rounded = streams[expected[lid]]
                    worst[lid] = max(worst[lid], float((rounded - reference).norm() / (reference.norm() + 1e-12)))
        finally:
            route.close()
            recorder.close()
    except Exception as exc:  # a dtype this CPU's kernels lack must not cost the fp32 verdict
        return {"dtype": dtype, "nrmse": None, "why": f"the {dtype} reference failed: {type(exc).__name__}: {exc}"}
    return {"dtype": dtype, "nrmse": worst, "why": None}
