"""``specops train``: an EAGLE-3 draft trained on a finished extraction run's states, detached.

Per host: the training preflight and the start (``remote/train.py``: the plan from the
states run's manifest -- model, ids minus the final state, read backend, seq len, data
path --, the samples whole, the installed trainer's flags, disk for the checkpoints),
then the run followed like an extraction (one python on the host streaming status
changes: step, epoch, loss, per-position accuracy, tokens/s, ETA), then the run's
status, logs and ``metrics.jsonl`` fetched into ``runs/<host>/<run-id>/``. The run is an
ordinary run dir on the host, so ``specops status / logs / abort --run-id`` act on it;
Ctrl-C detaches; the same command again re-attaches, or resumes an aborted or failed run
from its last epoch checkpoint (speculators resumes from its save path).

    >>> train(inventory, "modern", run_id="d1", from_run="llama-tp1", epochs=40)
    th  step 88/90  epoch 20/20  loss 0.009  acc 0.46/0.39/0.37  58 tok/s  ETA 2s
    ...
    train.run ok: run d1 done: step 90, epoch 20, loss 0.009, accuracy [0.46, 0.39, 0.37]; checkpoint .../19
"""
from __future__ import annotations

from specops import jobs
from specops.errors import SpecopsError, UsageError
from specops.exit_codes import ExitCode
from specops.host import Host
from specops.inventory import Inventory
from specops.parallel import report_from_payload, run_on_hosts
from specops.report import console, err_console, print_reports
from specops.result import HostReport, Record, RunState


def train_params(host: Host, run_id: str, from_run: str, *, epochs: int, dry_run: bool, force: bool,
                 action: str = "start") -> dict:
    return {"action": action, "run_id": run_id, "work_dir": host.spec.work_dir, "from_run": from_run,
            "epochs": int(epochs), "dry_run": bool(dry_run), "python": host.spec.python, "device": host.spec.device,
            "env": dict(host.spec.env), "force": bool(force)}


def start_step(host: Host, run_id: str, from_run: str, *, epochs: int, dry_run: bool, force: bool) -> HostReport:
    """The training preflight and the start (or re-attach, or resume) on one host."""
    payload = host.run_task("train", train_params(host, run_id, from_run, epochs=epochs, dry_run=dry_run,
                                                  force=force))
    report = report_from_payload(host.name, "train", payload)
    report.data.update(payload.get("data") or {})
    return report


def progress_line(host: str, st: dict) -> str:
    """One line of a training run's progress from its status."""
    acc = st.get("accuracy") or []
    parts = [f"[bold]{host}[/]", st.get("state") or ""]
    if st.get("step") is not None:
        parts.append(f"step {st['step']}/{st.get('steps_total') or '?'}")
        parts.append(f"epoch {int(st.get('epoch') or 0) + 1}/{st.get('epochs') or '?'}")
    if st.get("loss") is not None:
        parts.append(f"loss {st['loss']:.4g}")
    if acc:
        parts.append("acc " + "/".join(f"{a:.2f}" for a in acc))
    if st.get("tokens_per_s"):
        parts.append(f"{st['tokens_per_s']:.0f} tok/s")
    if st.get("eta_s") is not None:
        parts.append(f"ETA {st['eta_s']:.0f}s")
    return "  ".join(p for p in parts if p)


def run_record(run_id: str, state: RunState) -> Record:
    """``train.run``: how the run ended, with its last numbers (fail: its root cause)."""
    st = state.model_dump()
    if state.state == "done":
        ckpt = st.get("checkpoint") or {}
        where = ckpt.get("path") or st.get("checkpoints")
        return Record(name="train.run", status="ok",
                      summary=f"run {run_id} done: step {st.get('step')}, epoch {int(st.get('epoch') or 0) + 1}, "
                              f"loss {st.get('loss')}, accuracy {st.get('accuracy')}; checkpoint {where}",
                      detail={"checkpoint": where, "resumed_from": st.get("resumed_from"),
                              "tokens_per_s": st.get("tokens_per_s"), "val_loss": st.get("val_loss"),
                              "val_accuracy": st.get("val_accuracy"), "wall_s": st.get("wall_s")})
    err = state.error
    status = "warn" if state.state == "aborted" else "fail"
    return Record(name="train.run", status=status,
                  summary=f"run {run_id} {state.state}: " + (f"{err.type}: {err.message}" if err else "no error recorded"),
                  detail={"error": err.model_dump() if err else None},
                  fix=None if status == "warn" else "read the traceback (specops logs --run-id "
                      f"{run_id}); fix the cause, then run the same train command again to resume")


def train(inventory: Inventory, selector: str | None, *, run_id: str | None, from_run: str | None, epochs: int = 1,
          dry_run: bool = False, detach: bool = False, force: bool = False, as_json: bool = False,
          accept_new_host_key: bool = False) -> ExitCode:
    """Start (or resume) the train run on every selected host, follow it, fetch what it wrote."""
    from specops.extract import check_run_id

    if not run_id:
        raise UsageError("--run-id is required", "name the train run (the same id re-attaches or resumes)")
    if not from_run:
        raise UsageError("--from-run is required", "name the finished extraction run whose states to train on")
    check_run_id(run_id)
    check_run_id(from_run)
    try:
        epochs = int(epochs)
    except (TypeError, ValueError):
        raise UsageError(f"--epochs {epochs!r} is not a whole number", "pass --epochs N (N >= 1)") from None
    if epochs < 1:
        raise UsageError(f"--epochs {epochs} must be at least 1", "pass --epochs N (N >= 1)")
    hosts = {spec.name: Host(spec, inventory, accept_new_host_key) for spec in inventory.select(selector)}
    reports = run_on_hosts(inventory, ",".join(hosts), "train", lambda h: start_step(
        hosts[h.name], run_id, from_run, epochs=epochs, dry_run=dry_run, force=force))
    started = [r.host for r in reports if not r.failed]
    if detach or not started:
        print_reports(reports, as_json=as_json)
        return max((r.exit_code for r in reports), default=ExitCode.SUCCESS)
    if not as_json:
        print_reports(reports)
        console.print(f"Following train run [bold]{run_id}[/] on {', '.join(started)} (Ctrl-C detaches)")
    shown: dict[str, str] = {}

    def on_event(name: str, event: dict) -> None:
        if event["event"] == "status" and not as_json:
            line = progress_line(name, event["status"])
            if line != shown.get(name):
                shown[name] = line
                err_console.print(line)

    try:
        final = jobs.follow_runs([hosts[n] for n in started], run_id, on_event)
    except KeyboardInterrupt:
        for host in hosts.values():
            host.close()
        err_console.print(f"\n[yellow]detached[/]: train run {run_id} goes on. Re-attach: the same command; "
                          f"status: specops status --run-id {run_id}")
        return ExitCode.JOB_RUNNING
    fetched = run_on_hosts(inventory, ",".join(started), "fetch",
                           lambda h: fetch_step(hosts[h.name], run_id))
    codes = []
    starts = {r.host: r for r in reports}
    for report in fetched:
        report.records[:0] = starts[report.host].records  # one report per host: the checks, the start, the end
        result = final[report.host]
        if isinstance(result, Exception):
            report.records.append(Record(name="train.run", status="fail", summary=f"lost the follow: {result}",
                                         fix="the run goes on; follow it again with the same command"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
            continue
        report.records.append(run_record(run_id, result))
        report.data["final_status"] = result.model_dump()
        codes.append(result.exit_code)
    print_reports(fetched, as_json=as_json)
    return max(codes + [r.exit_code for r in fetched], default=ExitCode.SUCCESS)


def fetch_step(host: Host, run_id: str) -> HostReport:
    """The run's status, params, logs and metrics into ``runs/<host>/<run-id>/``."""
    from specops.assets import remote_fsutil

    report = jobs.fetch_run(host, run_id)
    dest = report.data.get("dest")
    state = jobs.status_report(host, run_id)
    run_dir = (state.data or {}).get("run_dir")
    if dest and run_dir:
        data = jobs.read_remote(host, f"{host.remote_path(run_dir)}/metrics.jsonl")
        if data is not None:
            from pathlib import Path

            remote_fsutil().atomic_write(Path(dest) / "metrics.jsonl", data, mode=0o644)
            report.data.setdefault("files", []).append("metrics.jsonl")
    return report
