"""Layers probe: which decoder layers the run captures, and in which convention.

The convention follows the engine (``remote.wire.layers.ENGINE_CONVENTION``): ``output`` of
layer i for speculators-0.3, ``input`` of layer i for vllm-server. The engine's default
ids are computed from the model's layer count; ids the user gave are validated with
:func:`remote.extract.runplan.resolve` (the run's plan, as the supervisor and the shard probe resolve it; the
probe leaves it in ``ctx.plan``). Ids given in the other convention
(``params["layer_convention"]``, ``--layer-ids output:2,4,5,7``) name the same tensors
under other numbers: they are translated (``output:i`` == ``input:i+1``) and the record
shows the mapping, or refused with the mapping when one has no counterpart
(``input:0``, the embeddings, is no layer's output). Mixing them silently is the one
thing this probe exists to prevent.
"""
from __future__ import annotations

from remote.extract import runplan
from remote.probes import Context
from remote.system import modelconfig
from remote.wire import layers
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record

#: kept under its old name: the probe's callers and doctests know it here
translate = layers.translate


def probe(ctx: Context) -> list:
    """Leaves ``{"ids", "convention", "source"}`` in ``ctx.layers`` when the ids are usable."""
    n = ctx.model.get("num_layers")
    engine, given = ctx.params["engine"], ctx.params["layer_ids"]
    asked = ctx.params.get("layer_convention")
    if not n:
        return [record("layers.ids", SKIPPED, "no layer count (model config unreadable)", detail={})]
    convention = layers.ENGINE_CONVENTION.get(engine)
    if convention is None:
        return [record("layers.ids", FAIL, f"unknown engine {engine!r}", detail={"engine": engine},
                       fix=f"set engine to one of {sorted(layers.ENGINE_CONVENTION)}")]
    if asked is not None and asked not in layers.CONVENTIONS:
        return [record("layers.ids", FAIL, f"layer_convention {asked!r} is not a layer convention",
                       detail={"layer_convention": asked},
                       fix=f"set layer_convention to one of {sorted(layers.CONVENTIONS)} (or leave it out: the "
                           f"engine's own, {convention})")]
    try:
        resolved = runplan.resolve(ctx.params, modelconfig.read(ctx.params["model_path"]),
                                   engine=ctx.engine or (engine, "given"))
    except (runplan.PlanError, modelconfig.ConfigError) as exc:
        if getattr(exc, "field", None) == "format":  # fp8 on an engine that writes no fp8 (engine auto here)
            return [record("params.format", FAIL, str(exc), detail={"engine": engine, "format": ctx.params.get("format")},
                           fix="set format: bf16 (or drop --format fp8), or extract on a host whose speculators "
                               ">= 0.5 picks the vllm-server engine")]
        if getattr(exc, "field", None) == "canary_samples":
            summary, _, fix = str(exc).partition(" Fix: ")
            return [record("params.canary_samples", FAIL, summary,
                           detail={"canary_samples": ctx.params.get("canary_samples")}, fix=fix)]
        return [record("layers.ids", FAIL, f"no run plan: {exc}", detail={"engine": engine, "num_layers": n},
                       fix="fix the value named above in the inventory or on the command line")]
    ctx.plan = resolved
    plan = {"ids": resolved.layer_ids, "source": resolved.source, "default": resolved.default,
            "mapping": resolved.mapping, "refused": resolved.refused, "problems": resolved.problems}
    n = resolved.num_layers
    ids, source, default = plan["ids"], plan["source"], plan["default"]
    detail = {"layer_ids": ids, "source": source, "convention": convention,
              "convention_meaning": layers.CONVENTIONS[convention], "engine": engine, "num_layers": n,
              "engine_default": default}
    translated = ""
    if given is not None and asked and asked != convention:
        mapping = plan["mapping"]
        detail.update(given_ids=list(given), given_convention=asked, mapping=mapping)
        if plan["refused"]:
            detail["refused"] = plan["refused"]
            return [record("layers.ids", FAIL,
                           f"layer ids {asked}:{list(given)} cannot all be named in engine {engine}'s {convention} "
                           f"convention: {'; '.join(plan['refused'])}", detail=detail,
                           fix=f"drop or change those ids; {asked}:i is {convention}:"
                               f"{'i+1' if asked == layers.OUTPUT else 'i-1'} (mapping: "
                               f"{', '.join(mapping) or 'none'}), or give {convention}: ids directly")]
        translated = f", translated {', '.join(mapping)}"
    detail["hf_hidden_states_index"] = [layers.hf_hidden_state_index(i, convention) for i in ids
                                        if isinstance(i, int)] if isinstance(ids, list) else []
    problems = plan["problems"]
    if problems:
        detail["problems"] = problems
        fix = ("pass layer_ids explicitly: distinct ids in range for this model" if source == "engine default"
               else f"give distinct integer ids within the range (engine default for {n} layers: {default})")
        return [record("layers.ids", FAIL, f"layer ids {ids} ({source}): {problems[0]}", detail=detail, fix=fix)]
    ctx.layers = {"ids": ids, "convention": convention, "source": source}
    return [record("layers.ids", OK, f"layers {ids} ({source}, {convention} of layer i, {n} layers{translated})",
                   detail=detail)] + algorithm_records(ctx, ids, convention, n)


def algorithm_records(ctx: Context, ids: list, convention: str, num_layers: int) -> list:
    """``--algorithm`` given: the host's speculators trains it, these ids fit its plan
    (:func:`remote.wire.layers.algorithm_plan`), and whether the host's vLLM serves it (a warn: the
    states may be trained and served elsewhere). Unset: eagle3's plan, unchanged, and no record."""
    from remote.drift import algorithms
    from remote.drift.source import site_packages

    if "algorithm" not in getattr(ctx.params, "given", ()) or not ctx.params.get("algorithm"):
        return []
    algorithm = ctx.params["algorithm"]
    spec_root, vllm_root = site_packages(ctx.params)
    trains = algorithms.trainable_record(algorithm, spec_root)
    if trains["status"] == FAIL and not trains["detail"]["speculators"]:
        # a host that only extracts (vLLM, no speculators) is a normal layout: the states train elsewhere
        trains = dict(trains, status=WARN, summary=f"{trains['summary']}: the states can be extracted here, and "
                      f"train where speculators is installed")
    out = [trains]  # first: no plan matters where it cannot train
    state_ids = layers.convert(ids, convention, layers.INPUT)
    plan = layers.algorithm_plan(algorithm, state_ids, num_layers)
    detail = {"algorithm": algorithm, **plan}
    if plan["problems"]:
        needs = plan["needs"]
        out.append(record("layers.algorithm", FAIL, f"layers input:{state_ids} cannot train {algorithm}: "
                          f"{'; '.join(plan['problems'])}", detail=detail,
                          fix=f"--layer-ids input:{','.join(map(str, needs))} (its plan for {num_layers} layers)"
                          if needs else f"pick --algorithm {' / '.join(layers.ALGORITHMS)}"))
    else:
        engine = f"; vLLM reads them as {plan['engine_field']} {plan['engine_ids']}" if plan["engine_field"] and \
            plan["engine_ids"] != plan["trainer_ids"] else ""
        out.append(record("layers.algorithm", OK, f"{algorithm}: states input:{state_ids} -> --target-layer-ids "
                          f"{plan['trainer_ids']} (its config's {plan['config_ids_field']}){engine}", detail=detail))
    served = algorithms.servable_record(algorithm, vllm_root)
    if served["status"] == FAIL:  # the states still train here; serving needs another vLLM
        served = dict(served, status=WARN, summary=f"{served['summary']}: eval on this host would refuse the draft")
    elif not plan["problems"] and vllm_root:
        served = _default_draft_loads(served, algorithm, plan["trainer_ids"], vllm_root)
    return out + [served]


def _default_draft_loads(served: dict, algorithm: str, aux_ids, vllm_root) -> dict:
    """``served`` turned a warn where this vLLM could not load the draft speculators trains by default on these ids
    (:func:`remote.drift.rules.known_bad.planned_draft_problem`: a DSpark draft's 5 layers on 3 aux ids, vLLM
    0.25-0.26)."""
    from remote.drift.pyindex import PackageIndex
    from remote.drift.rules import known_bad

    draft_layers = layers.default_draft_layers(algorithm)
    problem = known_bad.planned_draft_problem(PackageIndex(vllm_root), algorithm, aux_ids, draft_layers)
    if problem is None:
        return served
    return dict(served, status=WARN, fix=problem["fix"], detail={**served["detail"], "draft_problem": problem},
                summary=f"{served['summary']}, but not speculators' default draft on these ids: {problem['summary']}")
