"""Preflight: every failure that would waste a model load, found without loading weights.

One process per host runs every probe (``remote/probes/``) and returns one payload::

    >>> payload = main({"model_path": "/models/llama", "output_dir": "/data/out", "device": "cuda", "tp": 8})
    >>> [r["name"] for r in payload["records"]][:3]
    ['host.python', 'host.os', 'host.cpus']
    >>> payload["data"]["seconds"]   # measured over SSH on the CPU test host (tiny DeepSeek-V3)
    {'static': 0.017, 'autoconfig': 0.002, 'transformers_import': 2.893, 'hf_child_wall': 4.442,
     'drift': 0.364, 'patch': 0.002, 'total': 4.808}

The static checks read files and metadata only (stdlib). The one check that imports
transformers (AutoConfig + AutoTokenizer) runs in a child python started first, so it
loads while the static checks run, and is timed on its own. API drift and patch status
are :func:`remote.drift.check` and :func:`remote.patcher.status_records`, run last.

Params: :data:`SPEC` (``model_path`` required; the run's parameters, the packages to check,
``autoconfig_timeout``, ``skip_autoconfig``, ``hidden_dtype_bytes``, ``skip_drift``,
``skip_patch``; ``shard_probe`` for a group run's plan: :func:`remote.extract.shard.probe` runs in this
process too, from the same plan, its records and ``data.shard`` in the payload). Unset ones get their defaults; an unknown key, or a value of the wrong
type or range, is a ``params.values`` fail and the checks go on with the default.
"""
from __future__ import annotations

import time
import traceback

from remote import drift, patcher
from remote.extract import runplan, shard
from remote.probes import (Context, capacity, checkpoint, cpu_kernels, gpu, hf_load, host, layer_ids, model, packages,
                           parallel, tokenizer_data)
from remote.system.jsonfile import Malformed
from remote.wire import contract, protocol
from remote.wire.argspec import RUN_ARGS, STACK_ARGS, Arg, Spec
from remote.wire.protocol import FAIL, OK, SKIPPED, STATUSES, record

#: what preflight takes: a run's parameters (defaults from :data:`remote.wire.contract.DEFAULTS`), which
#: packages to check (the drift and patch checks read those), and its own switches.
SPEC = Spec("preflight", RUN_ARGS, STACK_ARGS, {
    "model_path": RUN_ARGS["model_path"].but(required=True),
    "device": RUN_ARGS["device"].but(default="cuda"),
    "trust_remote_code": RUN_ARGS["trust_remote_code"].but(default=False),
    "env": RUN_ARGS["env"].but(default={}),
    "hidden_dtype_bytes": Arg("int", 2, min=1, doc="bytes per hidden-state value, for the disk estimate"),
    "autoconfig_timeout": Arg("float", 60.0, above=0, max=3600, doc="seconds for the AutoConfig child"),
    "skip_autoconfig": Arg("bool", False),
    "skip_drift": Arg("bool", False),
    "skip_patch": Arg("bool", False),
    "data_check_bytes": Arg("int", min=1, doc="how much of the dataset the data probe reads"),
    # a pipeline size would reach the vLLM server: declared so the parallel probe can refuse it by name
    "pp": Arg("int"),
    "pipeline_parallel_size": Arg("int"),
    # a group run's plan: the shard probe's facts from this same process (one host python per host)
    "shard_probe": Arg("dict", options={"storage_probe": shard.STORAGE_PROBE},
                       doc="also run remote.extract.shard's probe; its records and data.shard join the payload"),
}, defaults=contract.DEFAULTS, lenient=True)
#: what an unset parameter means here.
DEFAULTS = SPEC.defaults
#: Order in which areas are reported (the controller groups by area in this order).
AREAS = ("params", "host", "packages", "model", "layers", "parallel", "checkpoint", "gpu", "tokenizer", "data",
         "capacity", "drift", "patch", "shard")

#: The static probes, in the order they run; later ones read facts earlier ones left on the context.
STATIC_PROBES = (host.probe, packages.probe, model.probe, cpu_kernels.probe, layer_ids.probe, parallel.probe,
                 checkpoint.probe, gpu.probe, tokenizer_data.probe_tokenizer, tokenizer_data.probe_data, capacity.probe)
#: Checks other modules own, run after the probes: area -> (check(params) -> records, the
#: params flag that skips it).
OWNED_CHECKS = {
    "drift": (drift.check, "skip_drift"),
    "patch": (patcher.status_records, "skip_patch"),
}


def _guarded(probe, ctx):
    """A probe's records; a bug in a probe becomes one fail record, not a lost preflight.

    Malformed content a probe did not turn into its own record is still the user's file,
    not a specops bug: it becomes ``<area>.input`` naming the file, key and expectation.
    """
    area = probe.__module__.rsplit(".", 1)[-1]
    try:
        return probe(ctx)
    except Malformed as exc:
        return [record(f"{area}.input", FAIL, exc.summary, detail=exc.detail(), fix=exc.fix)]
    except Exception:
        tb = traceback.format_exc()
        return [record(f"{area}.crash", FAIL, f"probe {probe.__module__}.{probe.__name__} crashed: "
                       f"{tb.strip().splitlines()[-1]}", detail={"traceback": tb},
                       fix="a specops bug: report detail.traceback")]


def _owned(area, params) -> list:
    """The records of another module's check; its crash, or an answer that is not a list of
    records, becomes one ``<area>.crash`` fail record instead of a lost preflight."""
    check, skip_flag = OWNED_CHECKS[area]
    qualified = f"{check.__module__}.{check.__name__}"
    if params.get(skip_flag):
        return [record(f"{area}.check", SKIPPED, f"skipped by {skip_flag}", detail={})]
    try:
        found = check(params)
    except Exception:
        tb = traceback.format_exc()
        return [record(f"{area}.crash", FAIL, f"{qualified} failed: {tb.strip().splitlines()[-1]}",
                       detail={"traceback": tb},
                       fix=f"read detail.traceback; {qualified} is a specops bug or does not fit this host's packages")]
    if not isinstance(found, list) or not all(isinstance(r, dict) and r.get("status") in STATUSES and r.get("name")
                                              for r in found):
        return [record(f"{area}.crash", FAIL, f"{qualified} returned something that is not a list of records",
                       detail={"returned": repr(found)[:2000]},
                       fix=f"fix {qualified} to return protocol.record(...) items")]
    return found


def _resolve_engine(params: dict) -> tuple[dict, tuple | None]:
    """``params.engine`` made concrete (``auto`` -> what the installed speculators needs): its
    record, and ``(engine, why)`` for the run's plan (None when no engine fits)."""
    asked = params.get("engine") or "auto"
    try:
        params["engine"], why = runplan.resolve_engine(asked)
    except runplan.PlanError as exc:
        params["engine"] = "speculators-0.3"  # the probes still run; the record says why none fits
        return record("params.engine", FAIL, str(exc), detail={"asked": asked},
                      fix="install the speculators that matches the host's vLLM, or set engine in the "
                          "inventory"), None
    return record("params.engine", OK, f"engine {params['engine']} ({why})",
                  detail={"asked": asked, "engine": params["engine"], "why": why}), (params["engine"], why)


@SPEC.task
def main(params: dict, problems: list) -> dict:
    """Run every preflight check once; see the module docstring for params and payload."""
    t_start = time.perf_counter()
    params["model_path"] = params["model_path"] or ""  # missing: a params.values fail, the probes say the rest
    records = []
    if problems:
        records.append(record("params.values", FAIL, f"bad params: {problems[0]}", detail={"problems": problems},
                              fix="fix these values in the inventory or on the command line"))
    asked_engine = params.get("engine")
    engine_record, engine = _resolve_engine(params)
    records.append(engine_record)
    ctx = Context(params)
    ctx.engine = engine
    try:
        child = hf_load.start(ctx)  # loads transformers while the static checks run
    except OSError as exc:
        child = None
        records.append(record("model.autoconfig", FAIL, f"cannot start the AutoConfig child: {exc}",
                              detail={}, fix="check the host's python can start subprocesses"))
    seconds = {}
    t0 = time.perf_counter()
    for probe in STATIC_PROBES:
        records += _guarded(probe, ctx)
    seconds["static"] = round(time.perf_counter() - t0, 3)

    hf_records = hf_load.records(ctx, child) if child is not None or not any(
        r["name"] == "model.autoconfig" for r in records) else []
    records += hf_records
    if child is not None:
        answer = child.result()
        seconds["autoconfig"] = round((answer.get("config") or {}).get("seconds") or 0.0, 3)
        seconds["transformers_import"] = round(answer.get("import_seconds") or 0.0, 3)
        seconds["hf_child_wall"] = round(answer["wall_seconds"], 3)

    for area in OWNED_CHECKS:
        t0 = time.perf_counter()
        records += _owned(area, ctx.params)
        seconds[area] = round(time.perf_counter() - t0, 3)
    shard_data = None
    if ctx.params.get("shard_probe") is not None:
        t0 = time.perf_counter()
        # the engine as asked: where none fits, the shard probe's stack record says so too
        probed = shard.probe(dict(ctx.params, engine=asked_engine, **ctx.params["shard_probe"]),
                             plan=ctx.plan if engine is not None else None)
        records += probed["records"]
        shard_data = probed["data"]
        seconds["shard"] = round(time.perf_counter() - t0, 3)
    seconds["total"] = round(time.perf_counter() - t_start, 3)

    order = {area: i for i, area in enumerate(AREAS)}
    records.sort(key=lambda r: order.get(r["area"], len(AREAS)))  # stable: probe order kept inside an area
    return protocol.payload(records, host=ctx.host, model=ctx.model, layers=ctx.layers,
                            plan=ctx.plan.as_dict() if ctx.plan is not None else None,
                            checkpoint=ctx.checkpoint, seconds=seconds,
                            **({"shard": shard_data} if shard_data is not None else {}))
