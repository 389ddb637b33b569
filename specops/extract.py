"""``specops extract`` on one host: start the TP extraction detached, follow it, bring the proof back.

:func:`specops.runs.run.extract` is the command: it opens the run (one host's, or a group's,
:mod:`specops.runs`) and a host run comes here (:func:`extract_on`). Steps per host: preflight (stops on a fail unless skipped) -> smoke on a tiny twin of the
model (the CLI runs it by default; stops on a fail) -> start the job detached
(``remote/run/job.py``; the same run id re-attaches, never starts twice) -> follow it with a
progress bar (one remote python streaming status changes over one channel) -> fetch
logs, manifest and summary into ``runs/<host>/<run-id>/``. Every step of a host runs
over that host's one SSH connection. Ctrl-C while following detaches: the connection
closes, the follower on the host exits with it, and the job goes on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from specops.errors import SpecopsError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.preflight import preflight_step
from specops.report import console, err_console, print_reports
from specops.result import HostReport, Record, RunStatus
from specops.runs import hostjob
from specops.runs.start import start_job
from specops.smoke import rehearse
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts


def start_step(host: Host, run_id: str, overrides: dict, *, skip_preflight: bool, force: bool,
               skip_smoke: bool = False, smoke_real: bool = False) -> HostReport:
    """Preflight, smoke (``smoke_real``: on the real model too), then start (or re-attach to) the run on one host."""
    report = HostReport(host=host.name, task="extract")
    if hostjob.run_state(host, run_id).found:
        skip_preflight = skip_smoke = True  # re-attaching or resuming: the checks ran before
        smoke_real = False
    if not skip_preflight:
        pre = preflight_step(host, overrides, skip_autoconfig=True)
        failed = [r for r in pre.records if r.status == "fail"]
        report.records.extend(failed)
        if failed:
            report.records.append(Record(
                name="extract.preflight", status="fail",
                summary=f"preflight found {len(failed)} failure(s); not starting the run",
                fix="fix the failures above (specops preflight shows all checks), or pass "
                    "--skip-preflight if you know better"))
            return report
        report.records.append(Record(name="extract.preflight", status="ok",
                                     summary=f"preflight passed ({len(pre.records)} checks)"))
    if not skip_smoke:
        report.records.extend(rehearse(host, overrides, force=force))
    if smoke_real and not report.failed:  # after the twin's minute, the real model's load
        report.records.extend(rehearse(host, overrides, force=force, real=True))
    if report.failed:
        return report
    payload = start_job(host, run_id, overrides, force=force)
    started = report_from_payload(host.name, "extract", payload)
    report.records.extend(started.records)
    report.data.update(payload.get("data") or {})
    return report


def follow(hosts: list[Host], run_id: str) -> dict[str, RunStatus | Exception]:
    """Show progress until every run is final; returns each host's last state (or the error
    that cut its follow short).

    :raises KeyboardInterrupt: passed through to the caller, who detaches.
    """
    with Progress(TextColumn("{task.fields[host]}", style="bold", markup=False),
                  TextColumn("{task.fields[phase]:<12}", markup=False),
                  BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(), console=err_console,
                  transient=False) as progress:
        bars = {h.name: progress.add_task("", host=h.name, phase="starting", rate="", eta="?", total=None)
                for h in hosts}

        def show(name: str, state: RunStatus) -> None:
            rate, eta = state.tokens_per_s, state.eta_s
            progress.update(bars[name], completed=state.samples_done or 0, total=state.samples_total,
                            phase=state.state, rate=f"{rate:.0f} tok/s" if rate else "",
                            eta=f"{eta:.0f}s" if eta is not None else "?")

        def on_event(name: str, event: dict) -> None:
            if event["event"] == "status":
                show(name, RunStatus.model_validate(event["status"]))

        final = hostjob.follow_runs(hosts, run_id, on_event)
        for name, result in final.items():
            if isinstance(result, RunStatus):
                show(name, result)
    return final


def _on_hosts(inventory: Inventory, names: list[str], task: str, hosts: dict[str, Host],
              step: Callable[[Host], HostReport]) -> list[HostReport]:
    """``run_on_hosts`` over the Host objects this command keeps for all its steps.

    run_on_hosts makes a Host per name of its own; that one is never used, so it never
    connects (Hosts connect lazily), and every step goes over the one connection per host.
    """
    return run_on_hosts(inventory, ",".join(names), task, lambda throwaway: step(hosts[throwaway.name]))


def extract_on(inventory: Inventory, hosts: dict[str, Host], overrides: dict, *, run_id: str, detach: bool,
               force: bool, skip_preflight: bool, as_json: bool, tensors: bool, skip_smoke: bool,
               smoke_real: bool = False) -> ExitCode:
    """The run on each of ``hosts`` (one shard, the whole dataset): start, follow, fetch into
    ``runs/<host>/<run-id>/``."""
    reports = _on_hosts(inventory, list(hosts), "extract", hosts,
                        lambda h: start_step(h, run_id, overrides, skip_preflight=skip_preflight, force=force,
                                             skip_smoke=skip_smoke, smoke_real=smoke_real))
    started = [r.host for r in reports if not r.failed]
    if detach or not started:
        print_reports(reports, as_json=as_json)
        if started and not as_json:
            console.print(Text.assemble("run ", (run_id, "bold"), f" started detached. Follow: specops extract "
                                        f"--run-id {run_id} --on {','.join(started)};  status: specops status "
                                        f"--run-id {run_id}"))
        return max((r.exit_code for r in reports), default=ExitCode.SUCCESS)
    if not as_json:
        print_reports(reports)
        console.print(Text.assemble("Following run ", (run_id, "bold"),
                                    f" on {', '.join(started)} (Ctrl-C detaches; the run goes on)"))
    try:
        final = follow([hosts[name] for name in started], run_id)
    except KeyboardInterrupt:
        for host in hosts.values():
            host.close()  # closing the channels ends the followers on the hosts; the runs go on
        err_console.print(Text.assemble("\n", ("detached", "yellow"), f": run {run_id} goes on. Re-attach: specops "
                                        f"extract --run-id {run_id} --on {','.join(started)}; logs: specops logs "
                                        f"--run-id {run_id} --follow"))
        return ExitCode.JOB_RUNNING
    fetched = _on_hosts(inventory, started, "fetch", hosts, lambda h: hostjob.fetch_run(h, run_id, tensors=tensors))
    codes = []
    for report in fetched:
        result = final[report.host]
        if isinstance(result, Exception):
            report.records.append(Record(
                name="extract.run", status="fail", summary=f"lost the follow of run {run_id}: {result}",
                fix=f"the run goes on on the host; follow it again: specops extract --run-id {run_id} "
                    f"--on {report.host}"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
            continue
        if result.state == "done":
            report.records.append(Record(name="extract.run", status="ok", summary=f"run {run_id} done"))
            shown = hostjob.canary_record("extract.canary", result)
            if shown is not None:
                report.records.append(shown)
        else:
            err = result.error
            report.records.append(Record(
                name="extract.run", status="fail",
                summary=f"run {run_id} {result.state}: " + (err.headline() if err else "no error recorded"),
                detail={"error": err.model_dump() if err else None},
                fix=(f"{err.fix}; then " if err and err.fix else "read the traceback below and "
                     "runs/<host>/<run-id>/logs; fix the cause, then ") + "start the same run id again to resume"))
            if err and err.traceback and not as_json:
                console.print(Text(f"{report.host} traceback (rank {err.rank}):", style="bold red")
                              + Text(f"\n{err.traceback}"))
        report.data["final_status"] = result.model_dump()
        codes.append(result.exit_code)
    print_reports(fetched, as_json=as_json)
    if not as_json:
        for report in fetched:
            hostjob.show_summary(Path(report.data.get("dest", "")))
    return max(codes, default=ExitCode.SUCCESS)
