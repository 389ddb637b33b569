"""``specops logs``: print a run's logs, and follow them as they grow.

The host keeps one log per TP rank plus the supervisor's. A first look prints the last
lines of each; ``--follow`` then streams new lines from one follower process per host
(``remote/run/job.py follow``, one SSH channel) until the run is final or Ctrl-C.
"""
from __future__ import annotations

import json
import sys

from rich.text import Text

from specops.errors import SpecopsError
from specops.exit_codes import ExitCode
from specops.report import console
from specops.result import RunStatus
from specops.runs import hostjob
from specops.transport.host import Host


def log_printer(collected: dict[str, dict[str, str]], only: str | None, as_json: bool):
    """``show(label, log_name, text)``: keeps ``text`` under ``collected[label]`` and, unless ``as_json``,
    prints each line prefixed by the label (a host, or a shard and its host) and the log's name."""

    def show(label: str, name: str, text: str) -> None:
        if only and not name.startswith(only):
            return
        mine = collected.setdefault(label, {})  # a replica's worker host gets its own label
        mine[name] = mine.get(name, "") + text
        if not as_json:
            for line in text.splitlines():
                console.print(Text(f"{label} {name[:-4]:>10} | ", style="dim") + Text(line))

    return show


def show_logs(hosts: list[Host], run_id: str, follow: bool = False, only: str | None = None,
              as_json: bool = False) -> ExitCode:
    """Print every log of the run on every host (``only``: files whose name starts with it)."""
    collected: dict[str, dict[str, str]] = {h.name: {} for h in hosts}
    show = log_printer(collected, only, as_json)

    if follow:
        code = _follow(hosts, run_id, show)
    else:
        code = _look(hosts, run_id, show)
    if as_json:
        sys.stdout.write(json.dumps({"run_id": run_id, "logs": collected}, indent=2) + "\n")
    return code


def _look(hosts: list[Host], run_id: str, show) -> ExitCode:
    """The last lines of each log, one remote call per host."""
    for host in hosts:
        payload = hostjob.job_call(host, "logs", run_id)
        data = payload.get("data") or {}
        if "logs" not in data:
            console.print(Text(f"{host.name}: {payload['records'][0]['summary']}", style="bold red"))
            return ExitCode.JOB_NOT_FOUND
        for name, chunk in data["logs"].items():
            show(host.name, name, chunk["text"])
    return ExitCode.SUCCESS


def _follow(hosts: list[Host], run_id: str, show) -> ExitCode:
    """The last lines of each log, then every new line until the runs are final or Ctrl-C."""
    def on_event(host_name: str, event: dict) -> None:
        if event["event"] == "log":
            show(host_name, event["file"], event["text"])

    try:
        final = hostjob.follow_runs(hosts, run_id, on_event, logs=True)
    except KeyboardInterrupt:
        for host in hosts:
            host.close()  # ends the followers on the hosts
        console.print("[yellow]stopped following; the run goes on[/]")
        return ExitCode.SUCCESS
    codes = [ExitCode.SUCCESS]
    for name, result in final.items():
        if isinstance(result, RunStatus) and result.found:
            continue
        if isinstance(result, RunStatus):
            console.print(Text(f"{name}: no run {run_id} on this host", style="bold red"))
            codes.append(ExitCode.JOB_NOT_FOUND)
        else:
            console.print(Text(f"{name}: lost the follow: {result}", style="bold red"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
    return max(codes)
