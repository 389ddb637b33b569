"""``fab verify``, host side: recompute samples of a finished run with an independent
reference and compare every captured layer.

The reference (``reference: hf``) is a plain transformers forward of the run's own
model on the same ``input_ids`` (:mod:`remote.verify.reference`; ``llama_4_scaling``
applied the way vLLM does where transformers lacks it, :mod:`remote.verify.scaling`).
Each captured layer of the chosen samples (:mod:`remote.verify.run`, either sample
format) is compared with the reference's residual stream at the index its recorded
convention names, and with every other index, to name an off-by-one layer
(:mod:`remote.verify.compare`). On MoE models a token whose router nearly tied is
recomputed with the engine's expert choice (:mod:`remote.verify.routing`), and a layer
whose error every token shares is judged against what rounding to the capture's dtype
alone does (:mod:`remote.verify.floor`).

Records, in this order: ``verify.run``, ``verify.reference``, ``verify.layer.<id>``
per layer, ``verify.routing`` (models with a DeepSeek-V3-style router),
``verify.convention``, ``verify.llama_4_scaling`` (models with the scaling).

Parameters (:data:`SPEC`): ``run_id`` + ``work_dir`` (or ``run_dir``); ``samples`` (3; the
longest samples of the run, most positions), ``dtype`` (float32), ``reference`` (hf;
``layer``: each captured decoder layer alone, :mod:`remote.verify.layer`; ``logits``: the last
captured state against the engine's own prompt logprobs, :mod:`remote.verify.logits`),
``model_path`` (default: the model the run recorded), ``trust_remote_code`` (default,
or None: what the run recorded), ``env``. Stdlib only at import.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remote.run import slurm
from remote.verify.compare import (BF16_REL, CONVENTION_MARGIN, COS_TOL, FLOOR_FACTOR, FLOOR_MIN, REL_TOL, TOLERANCES,
                                   WARN_SHARE, beyond_rounding, convention_record, expected_indices, layer_numbers,
                                   layer_record, merge, nrmse_by_index, token_errors)
from remote.verify.floor import rounding_floor
from remote.verify.reference import Reference, StreamRecorder, load_reference, reference_record
from remote.verify.routing import (MAX_ROUTE_FORWARDS, NEAR_TIE_SIGMAS, ROUTE_KEEP_SHARE, RouterControl,
                                   RouterDecisions, match_routing, router_spec, routing_record)
from remote.verify.run import (DEFAULT_SAMPLES, Run, VerifyError, check_files, choose_samples, load_sample, open_run,
                               trust_remote_code)
from remote.verify.scaling import Llama4Scaling, llama4_record
from remote.wire import protocol
from remote.wire.argspec import RUN_ARGS, Arg, Spec

__all__ = [
    "BF16_REL", "CONVENTION_MARGIN", "COS_TOL", "DEFAULT_SAMPLES", "FLOOR_FACTOR", "FLOOR_MIN",
    "MAX_ROUTE_FORWARDS", "NEAR_TIE_SIGMAS", "REFERENCES", "REL_TOL", "ROUTE_KEEP_SHARE", "WARN_SHARE",
    "Comparison", "Llama4Scaling", "Reference", "RouterControl", "RouterDecisions", "StreamRecorder",
    "VerifyError", "layer_numbers", "load_reference", "load_sample", "main", "match_routing", "merge",
    "rounding_floor", "router_spec", "token_errors", "verify",
]

#: ``hf``: the whole model in transformers; ``layer``: one decoder layer at a time (:mod:`remote.verify.layer`);
#: ``logits``: the last state through the final norm and lm_head against the engine's prompt logprobs
#: (:mod:`remote.verify.logits`).
REFERENCES = ("hf", "layer", "logits")
#: which run (by ``run_id`` in ``work_dir``, or its ``run_dir``), and how to check it.
SPEC = Spec("verify", {
    "run_id": Arg("str"), "work_dir": RUN_ARGS["work_dir"], "run_dir": Arg("path", doc="instead of run_id + work_dir"),
    "samples": Arg("int", DEFAULT_SAMPLES, min=1, doc="how many of the run's samples (the longest) to recompute"),
    "dtype": Arg("str", "float32", doc="the reference's dtype"),
    "reference": Arg("str", "hf", choices=REFERENCES),
    "model_path": RUN_ARGS["model_path"].but(doc="default: the model the run recorded"),
    "trust_remote_code": RUN_ARGS["trust_remote_code"].but(doc="default: what the run recorded"),
    "env": RUN_ARGS["env"],
})


@SPEC.task
def main(params: dict) -> dict:
    payload = protocol.run_in_job_env(verify, params)
    node = slurm.node_record("verify.node", "verify")  # a host behind Slurm verifies on a compute node (srun)
    if node is not None:
        payload["records"].insert(0, node)
    return payload


def verify(params: dict) -> dict:
    """Verify the run ``params`` names; the payload's records are listed in the module docstring.

    :raises VerifyError: a run that cannot be verified, sample files that do not match the
        manifest, layer ids the model does not have.
    """
    if params.get("reference") == "layer":
        from remote.verify.layer import verify_layers

        return verify_layers(params)
    if params.get("reference") == "logits":
        from remote.verify.logits import verify_logits

        return verify_logits(params)
    run = open_run(params)
    chosen = choose_samples(run.manifest, params["samples"])
    records = [check_files(run, chosen)]

    model_path = params["model_path"] or run.manifest["model"]["path"]
    dtype = params["dtype"]
    trust = trust_remote_code(params, run.manifest)
    reference = load_reference(model_path, dtype, trust)
    recorder = StreamRecorder(reference.model)
    route = RouterControl(recorder.layers)
    try:
        num_layers = len(recorder.layers)
        reference_rec = reference_record(reference, model_path, dtype, num_layers)
        records.append(reference_rec)
        expected = expected_indices(run.layer_ids, run.convention, num_layers)
        found = compare_samples(run, chosen, reference.model, recorder, route, expected)
        # what rounding to the capture's dtype alone does to this model, with the same experts
        floor = rounding_floor(model_path, found.capture_dtype, trust, found.kept, expected)
        reference_rec["detail"]["rounding_floor"] = floor
        records += judge_layers(run, found, floor, expected)
        if route.routers:
            records.append(routing_record(route, found.flips, found.routing, found.per_sample,
                                          beyond_rounding(records)))
        records.append(convention_record(run.layer_ids, run.convention, expected, found.by_index))
        if reference.scaling is not None:
            route.forced = {}  # the unscaled reference of llama4_record routes as the model does
            records.append(llama4_record(reference, records, found.loaded, recorder, run.layer_ids, expected))
    finally:
        route.close()
        recorder.close()
    return protocol.payload(records, per_sample=found.per_sample, layer_ids=run.layer_ids,
                            convention=run.convention, run_dir=str(run.run_dir))


@dataclass
class Comparison:
    """What comparing the chosen samples with the reference found."""

    #: layer id -> its numbers (:func:`layer_numbers`) per sample.
    per_layer: dict[int, list[dict]]
    #: layer id -> the capture's nrmse against every stream index, averaged over the samples.
    by_index: dict[int, list[float]]
    #: per sample: its numbers per layer and the tokens that disagree (the payload's ``per_sample``).
    per_sample: list[dict] = field(default_factory=list)
    #: ``(manifest entry, sample)`` of every compared sample, in order.
    loaded: list[tuple[dict, dict]] = field(default_factory=list)
    #: tokens recomputed with the engine's expert choice (:func:`match_routing`), and per sample its info.
    flips: list[dict] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)
    #: what the rounding floor recomputes (:func:`rounding_floor`'s ``kept``).
    kept: list[dict] = field(default_factory=list)

    @property
    def capture_dtype(self) -> str:
        """The dtype the engine stored its states in (``bfloat16``..., ``fp8``: float8_e4m3fn with
        per-token scales, read dequantized)."""
        first = self.loaded[0][1]
        return first.get("state_format") or str(first["hidden_states"][0].dtype).replace("torch.", "")


def compare_samples(run: Run, chosen: list[dict], model, recorder: StreamRecorder, route: RouterControl,
                    expected: dict) -> Comparison:
    """Every captured layer of every chosen sample against the reference, and against every stream index."""
    found = Comparison(per_layer={lid: [] for lid in run.layer_ids},
                       by_index={lid: [0.0] * (len(recorder.layers) + 1) for lid in run.layer_ids})
    for entry in chosen:
        data = load_sample(run.output_dir / entry["path"], run.manifest)
        ids = data["input_ids"]
        found.loaded.append((entry, data))
        captured_at = {expected[lid]: captured for lid, captured in zip(run.layer_ids, data["hidden_states"])}
        if route.routers:
            streams, raw, flips, info = match_routing(route, recorder, model, ids, captured_at, entry["path"])
            found.flips += flips
            found.routing.append(dict(info, sample=entry["path"], tokens=len(ids)))
        else:
            streams = raw = recorder.streams(model, ids)
            flips = []
        row = {"sample": entry["path"], "tokens": len(ids), "layers": {}}
        for lid, captured in zip(run.layer_ids, data["hidden_states"]):
            numbers = layer_numbers(captured, streams[expected[lid]], tolerances(run))
            # tokens whose state here was computed with the engine's choice at an earlier router
            numbers["rerouted"] = len({f["token"] for f in flips if f["layer"] < expected[lid]})
            if route.routers:
                numbers["raw"] = layer_numbers(captured, raw[expected[lid]])
                numbers["raw"].pop("bad_tokens")
            found.per_layer[lid].append(numbers)
            row["layers"][str(lid)] = numbers
            for k, value in enumerate(nrmse_by_index(captured, streams)):
                found.by_index[lid][k] += value / len(chosen)
        row["disagreeing_tokens"] = sorted({t for n in row["layers"].values() for t in n.pop("bad_tokens")})
        found.per_sample.append(row)
        found.kept.append({"ids": ids, "streams": {lid: streams[expected[lid]] for lid in run.layer_ids},
                           "experts": route.used_experts()})
    return found


def judge_layers(run: Run, found: Comparison, floor: dict, expected: dict) -> list[dict]:
    """One ``verify.layer.<id>`` record per captured layer."""
    return [layer_record(lid, found.per_layer[lid], floor, run.convention, expected[lid], run.manifest,
                         tolerances(run))
            for lid in run.layer_ids]


def tolerances(run: Run) -> tuple:
    """The per-token tolerances of the run's state format (:data:`remote.verify.compare.TOLERANCES`)."""
    return TOLERANCES.get(run.plan.state_format, TOLERANCES["bf16"])
