"""``specops smoke``: rehearse the exact extraction path on a tiny twin of the target model.

Static checks catch signatures; they cannot catch a calling convention that runs but
computes the wrong thing. Smoke closes that gap in about a minute, before paying for
the real load:

1. ``remote/extract/smoke.py`` builds (or reuses, by content hash) a tiny random twin of the
   target from its own config.json -- same model_type, architectures, family keys and
   ``text_config`` wrapping, the target's own tokenizer -- under
   ``<work_dir>/smoke/<hash>/``, plus a handful of the target's dataset rows;
2. the run goes through ``remote/run/job.py`` exactly like ``specops extract``: same
   engine, same installed (patched) speculators, same TP size, same env, same
   supervisor; only ``model_path``/``dataset``/``max_samples``/``seq_len`` point at the
   twin, and the samples land in the run dir, never in the real output dir;
3. a failed run is reported with the supervisor's root cause (rank, exception type and
   message; the traceback in the record's detail);
4. a finished run is verified (``remote/verify.py``) against a transformers forward.

``rehearse`` (a ``smoke_step`` and its verdict) is what ``specops extract`` runs before the real run.

``--real`` (``smoke_step(real=True)``; ``extract --smoke-real`` before the run) rehearses on the
target itself: a short verification run, one load of the real model, whose ids are the run's
plus a consecutive pair per kind of layer (``remote/verify/pairs.py``), every sample asking for
its prompt logprobs; it is verified with ``--reference layer`` (each chosen decoder layer of the
real checkpoint alone) and, where the engine gives logprobs, ``--reference logits``.
"""
from __future__ import annotations

import time

from specops.inventory import CONTRACT, RUN_ARGS, Inventory
from specops.params import run_params
from specops.result import FINAL_STATES, STATE, HostReport, Record
from specops.runs import hostjob
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts
from specops.verify import verify_step

#: Keys of the run parameters the twin replaces.
TWIN_KEYS = ("model_path", "dataset", "max_samples", "seq_len", "output_dir")
DEFAULT_TIMEOUT_S = 900.0


#: how long a verification run of the real model may take (its load is the real one: minutes)
REAL_TIMEOUT_S = 3600.0
#: samples of the verification run before a real run (``extract --smoke-real``)
REAL_SAMPLES = 2


def smoke_run_id(twin_hash: str, real: bool = False) -> str:
    return f"smoke-{'real-' if real else ''}{twin_hash[:12]}-{time.strftime('%Y%m%d-%H%M%S')}"


def smoke_step(host: Host, overrides: dict | None = None, samples: int = 4, *, verify: bool = True,
               verify_samples: int = 2, force: bool = False, timeout: float | None = None,
               run_id: str | None = None, real: bool = False) -> HostReport:
    """Build the twin, run the extraction path on it, wait, verify; one report.

    :param overrides: the same flags ``specops extract`` takes (model, tp, engine, ...).
    :param samples: rows of the target's dataset to extract.
    :param verify: also recompute ``verify_samples`` of them with the transformers reference.
    :param force: start even if the host runs another extraction (as ``extract --force``).
    :param timeout: seconds to wait for the smoke run before aborting it (default
        :data:`DEFAULT_TIMEOUT_S`, :data:`REAL_TIMEOUT_S` for ``real``).
    :param real: no twin: a short verification run of the target itself (``remote/extract/smoke.py``
        ``prepare_real``): the run's ids plus a consecutive pair per kind of layer, every sample
        asking for its prompt logprobs; verified with ``--reference layer`` (each chosen decoder
        layer alone, from the real checkpoint) and, where the engine gives logprobs, ``logits``.
    :returns: records ``smoke.twin`` (``smoke.target``), ``smoke.samples``, ``smoke.run`` (+ ``verify.*``);
        ``report.failed`` means the real run would fail or compute wrong states.
    """
    report = HostReport(host=host.name, task="smoke")
    params = run_params(host.spec, **(overrides or {}))
    prepared = host.run_task("smoke", {**params, "samples": int(samples), **({"real": True} if real else {})})
    report.records.extend(report_from_payload(host.name, "smoke", prepared).records)
    data = prepared.get("data") or {}
    if report.failed or not data.get("twin_dir"):
        return report
    timeout = timeout or (REAL_TIMEOUT_S if real else DEFAULT_TIMEOUT_S)
    run_id = run_id or smoke_run_id(data["twin_hash"], real)
    job = {**params, "model_path": data["twin_dir"], "dataset": data["dataset"],
           "max_samples": int(data["samples"]), "seq_len": int(data["seq_len"]), "output_dir": None,
           "force": force}
    if real:  # the chosen ids, and every sample's prompt logprobs for the logits check
        job.update(layer_ids=data["layer_ids"], layer_convention=data["layer_convention"], sample_range=None,
                   canary_samples=min(int(data["samples"]), RUN_ARGS["canary_samples"].max))
        verify_samples = int(data["samples"])
    if data.get("layer_ids_note"):
        # ids chosen for the real depth do not exist in the 8-layer twin (the host's plan says):
        # the engine's defaults exercise the same capture code.
        report.data["layer_ids_note"] = data["layer_ids_note"]
        job["layer_ids"] = None
    report.data.update(run_id=run_id, twin=data.get("twin"))
    t0 = time.monotonic()
    started = hostjob.job_call(host, "start", run_id, **job)
    start_records = report_from_payload(host.name, "smoke", started).records
    if any(r.status == "fail" for r in start_records):
        report.records.extend(start_records)
        return report
    # until="exited": a done supervisor may still be closing the engine, and the real run
    # started right after smoke would be refused as "already running" while it lives.
    state = hostjob.follow_run(host, run_id, until="exited", timeout=timeout)
    seconds = time.monotonic() - t0
    status = state.model_dump(exclude={"run_dir"})
    report.data.update(seconds=round(seconds, 1), status=status)
    report.records.append(run_record(run_id, status, seconds, params, timeout))
    if not state.is_final:
        hostjob.job_call(host, "abort", run_id)
    if state.state == STATE.DONE and verify:
        references = ["layer"] + (["logits"] if data.get("engine") in CONTRACT.CANARY_ENGINES else []) if real else ["hf"]
        for reference in references:
            checked = verify_step(host, run_id, samples=verify_samples, reference=reference)
            records = checked.records
            if reference == "logits":  # its run and reference records beside the layer check's own
                records = [r.model_copy(update={"name": f"verify.logits.{r.name.split('.', 1)[1]}"})
                           if r.name in ("verify.run", "verify.reference") else r for r in records]
            report.records.extend(records)
            report.data["verify" if reference in ("hf", "layer") else f"verify_{reference}"] = checked.data
    return report


def run_record(run_id: str, status: dict, seconds: float, params: dict, timeout: float) -> Record:
    state = status.get("state") or STATE.MISSING
    # the engine the host resolved (``auto`` names none), else what was asked for
    engine, tp = status.get("engine") or params.get("engine"), params.get("tp")
    on = "the real model" if str(run_id).startswith("smoke-real-") else "the twin"
    if state == STATE.DONE:
        phases = status.get("phase_seconds") or {}
        return Record(name="smoke.run", status="ok",
                      summary=f"the extraction path ran on {on} in {seconds:.0f}s ({engine}, tp={tp}; "
                              f"load {phases.get('load', 0):.0f}s, {status.get('samples_done')} samples, "
                              f"{status.get('tokens_per_s') or 0:.0f} tok/s)",
                      detail={"run_id": run_id, "seconds": round(seconds, 1), "phase_seconds": phases})
    if state not in FINAL_STATES:
        return Record(name="smoke.run", status="fail",
                      summary=f"the smoke run {run_id} did not finish in {timeout:.0f}s (state {state}); aborted",
                      detail={"run_id": run_id, "status": status},
                      fix=f"read the logs (specops logs --run-id {run_id}); a hang here would hang the real run "
                          f"too")
    err = status.get("error") or {}
    return Record(name="smoke.run", status="fail",
                  summary=f"the extraction path fails on {on} ({engine}, tp={tp}): rank {err.get('rank')}: "
                          f"{err.get('type')}: {err.get('message')}",
                  detail={"run_id": run_id, "error": err, "traceback": err.get("traceback"),
                          "seconds": round(seconds, 1)},
                  fix=f"the real run would fail the same way: fix the cause (specops logs --run-id {run_id}; "
                      f"specops preflight; specops patch), then smoke again")


def smoke(inventory: Inventory, selector: str | None, overrides: dict | None = None, samples: int = 4,
          accept_new_host_key: bool = False, **options) -> list[HostReport]:
    """Smoke on every selected host in parallel; one report per host."""
    return run_on_hosts(inventory, selector, "smoke",
                        lambda h: smoke_step(h, overrides or {}, samples, **options),
                        accept_new_host_key=accept_new_host_key)


def rehearse(host: Host, overrides: dict, *, force: bool, name: str = "extract.smoke",
             real: bool = False) -> list[Record]:
    """Smoke on one host before its real run: the smoke's failures and warnings, then one
    verdict record called ``name`` (``<name>-real`` for ``real``; ``fail``: the real run must
    not start there). ``real``: the verification run of the real model (:func:`smoke_step`)."""
    smoked = smoke_step(host, overrides, samples=REAL_SAMPLES if real else 4, force=force, real=real)
    records = [r for r in smoked.records if r.status in ("fail", "warn")]
    on = "the real model (a verification run)" if real else "the tiny twin"
    verdict = f"{name}-real" if real else name
    if smoked.failed:
        records.append(Record(
            name=verdict, status="fail",
            summary=f"smoke failed on {on} (run {smoked.data.get('run_id')}); not starting the real run",
            fix=f"fix the failure above (specops smoke{' --real' if real else ''} shows it alone), or pass "
                f"{'no --smoke-real' if real else '--skip-smoke'}"))
    else:
        seconds = smoked.data.get("seconds")
        records.append(Record(name=verdict, status="ok",
                              summary=f"smoke passed on {on} ({len(smoked.records)} checks"
                                      + (f", {seconds:.0f} s" if seconds is not None else "") + ")",
                              detail={"run_id": smoked.data.get("run_id"), "seconds": seconds})
                       )
    return records
