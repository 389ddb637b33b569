"""Parallelism probe: TP size against devices and against the attention heads.

vLLM splits attention heads over TP ranks: ``num_attention_heads`` must divide by TP;
KV heads either divide by TP or, when there are fewer KV heads than ranks, are
replicated, which needs TP to be a multiple of them.

The vllm-server engine (vLLM's ``extract_hidden_states`` method) runs without pipeline
parallelism: the hidden-states connector reads the aux states on TP rank 0 of one
pipeline stage, and vLLM places the whole drafter on the last stage only. specops
passes no pipeline size itself; one that reaches the server anyway (a ``pp`` /
``pipeline_parallel_size`` param, or ``--pipeline-parallel-size`` in ``server_args``)
is refused here.
"""
from __future__ import annotations

from remote.probes import Context
from remote.wire.contract import SPECULATORS_03, VLLM_SERVER
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record


def kv_heads_problem(kv_heads: int, tp: int) -> str | None:
    if kv_heads >= tp and kv_heads % tp:
        return f"{kv_heads} kv heads do not divide by TP {tp}"
    if kv_heads < tp and tp % kv_heads:
        return f"TP {tp} is not a multiple of {kv_heads} kv heads (needed to replicate them)"
    return None


#: where a pipeline-parallel size could come from: params keys, and the server's own flags.
PP_PARAMS = ("pp", "pipeline_parallel_size")
PP_FLAGS = ("--pipeline-parallel-size", "-pp")


def probe(ctx: Context) -> list:
    tp = ctx.params["tp"]
    # a host of a replica over several hosts runs its share of the ranks (remote/extract/replica.py)
    local = int((ctx.params.get("replica") or {}).get("ranks_per_node") or tp)
    records = [_devices(ctx, local), _layout(ctx, local), _heads(ctx, tp)]
    if ctx.params["engine"] == VLLM_SERVER:
        records.append(_pipeline(ctx))
    return records


def pipeline_sizes(params: dict) -> dict:
    """``{where: value}`` of every pipeline-parallel size the run's params would give the server."""
    found = {key: params[key] for key in PP_PARAMS if params.get(key) is not None}
    args = [str(a) for a in params.get("server_args") or []]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in PP_FLAGS:
            found[f"server_args {flag}"] = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def _pipeline(ctx):
    sizes = pipeline_sizes(ctx.params)
    detail = {"found": sizes, "looked_at": list(PP_PARAMS) + [f"server_args {f}" for f in PP_FLAGS]}
    bad = {}
    for where, value in sizes.items():
        try:
            if int(value) != 1:
                bad[where] = value
        except (TypeError, ValueError):
            bad[where] = value
    if bad:
        where, value = next(iter(bad.items()))
        return record("parallel.pipeline", FAIL, f"pipeline parallelism ({where}={value}) is refused: vLLM's "
                      f"extract_hidden_states runs on one pipeline stage", detail=detail,
                      fix=f"remove {where} (or set it to 1) and use tensor parallelism (tp) across the GPUs")
    return record("parallel.pipeline", OK, "no pipeline parallelism (extract_hidden_states runs on one stage; "
                  "TP only)", detail=detail)


def _devices(ctx, tp):
    if ctx.params["device"] == "cuda":
        n = len(ctx.host.get("visible_gpus") or [])
        detail = {"tp": tp, "gpus": n}
        if tp > n:
            return record("parallel.devices", FAIL, f"TP {tp} needs {tp} GPUs, {n} usable", detail=detail,
                          fix=f"set tp to at most {n} (or make more GPUs visible)" if n else
                              "this host has no usable GPU: fix the driver or set device: cpu")
        return record("parallel.devices", OK, f"TP {tp} on {n} GPU(s)", detail=detail)
    cores = (ctx.host.get("cpus") or {}).get("usable") or 0
    detail = {"tp": tp, "cpu_cores": cores}
    if tp > cores:
        return record("parallel.devices", FAIL, f"TP {tp} on the CPU engine needs a core per rank, {cores} usable",
                      detail=detail, fix=f"set tp to at most {cores}")
    return record("parallel.devices", OK, f"device=cpu: TP {tp} over {cores} CPU core(s)", detail=detail)


def layout_of(ctx, tp: int | None = None):
    """The run's ``dp x tp`` layout over the devices the host probe saw (:mod:`remote.extract.layout`)."""
    from remote.extract import layout

    if tp is None:
        tp = int((ctx.params.get("replica") or {}).get("ranks_per_node") or ctx.params["tp"])
    if ctx.params["device"] == "cuda":
        kind, ids = "cuda", [int(g["index"]) for g in ctx.host.get("visible_gpus") or []]
    else:
        kind, ids = "cpu", list(range(int((ctx.host.get("cpus") or {}).get("usable") or 0)))
    return layout.resolve(ctx.params, tp, kind, ids, ctx.params.get("engine"))


def gpus_in_use(ctx) -> list:
    """The visible GPUs every replica of the run holds (the first ``dp x tp``): the memory checks' GPUs."""
    plan = layout_of(ctx)
    used = {d for s in plan.sets for d in s} if not plan.problem else set()
    gpus = ctx.host.get("visible_gpus") or []
    return [g for g in gpus if int(g["index"]) in used] or gpus[:ctx.params["tp"]]


def _layout(ctx, tp):
    plan = layout_of(ctx, tp)
    detail = plan.as_dict()
    unit = "GPU" if plan.kind == "cuda" else "core"
    if plan.problem and plan.dp == 1:  # one replica: its devices are parallel.devices' to judge
        return record("parallel.layout", SKIPPED, f"one replica of tp {plan.tp}: {plan.problem}", detail=detail)
    if plan.problem:
        fix = ("set dp to 1: the vllm-server and speculators-0.3 engines run data-parallel replicas"
               if "engine" in plan.problem else "leave the replica's hosts at dp 1" if ctx.params.get("replica")
               else f"set dp to at most {max(1, len(plan.devices) // plan.tp)} (dp x tp {unit}s), or leave dp out")
        return record("parallel.layout", FAIL, plan.problem, detail=detail, fix=fix)
    if plan.dp > 1 and not ctx.params.get("replica") and plan.idle and plan.kind == "cuda":
        return record("parallel.layout", WARN, f"{plan.text()}; {len(plan.idle)} {unit}(s) idle "
                      f"({', '.join(map(str, plan.idle))}): {len(plan.devices)} is not a multiple of tp {plan.tp}",
                      detail=detail, fix=f"pick a tp that divides {len(plan.devices)} to use every {unit}")
    if plan.kind == "cuda" and plan.idle and plan.dp == 1 and "asked" in plan.why:
        return record("parallel.layout", WARN, f"{plan.text()}; {len(plan.idle)} GPU(s) idle: dp 1 was asked",
                      detail=detail, fix=f"leave dp out (default {max(1, len(plan.devices) // plan.tp)}) to use them")
    return record("parallel.layout", OK, f"{plan.text()}: {plan.dp} replica(s), {_each(ctx)} ({plan.why})",
                  detail=detail)


def _each(ctx) -> str:
    """What each replica runs: the seed engine's in-process generator has no server (one process each)."""
    return "one generator process each" if ctx.params.get("engine") == SPECULATORS_03 else "one server each"


def _heads(ctx, tp):
    heads, kv = ctx.model.get("num_attention_heads"), ctx.model.get("num_key_value_heads")
    if not heads:
        return record("parallel.heads", SKIPPED, "no head counts (model config unreadable)", detail={})
    kv = kv or heads
    detail = {"tp": tp, "num_attention_heads": heads, "num_key_value_heads": kv}
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads do not divide by TP {tp}")
    kv_problem = kv_heads_problem(kv, tp)
    if kv_problem:
        problems.append(kv_problem)
    if problems:
        good = [t for t in range(1, heads + 1) if heads % t == 0 and kv_heads_problem(kv, t) is None]
        detail.update(problems=problems, valid_tp=good)
        return record("parallel.heads", FAIL, "; ".join(problems), detail=detail,
                      fix=f"pick tp from {good}")
    if kv < tp:
        return record("parallel.heads", OK, f"{heads} heads split over TP {tp}; {kv} kv heads replicated",
                      detail=detail)
    return record("parallel.heads", OK, f"{heads} heads / {kv} kv heads divide by TP {tp}", detail=detail)
