"""``specops logs``: print a run's logs, and follow them by byte offsets.

The host keeps one log per TP rank plus the supervisor's; following asks only for
bytes past the last offset, so a long run costs little per poll.
"""
from __future__ import annotations

import json
import sys
import time

from rich.text import Text

from specops import jobs
from specops.exit_codes import ExitCode
from specops.host import Host
from specops.report import console


def show_logs(hosts: list[Host], run_id: str, follow: bool = False, only: str | None = None,
              as_json: bool = False, poll: float = 1.0) -> ExitCode:
    offsets: dict[str, dict] = {h.name: {} for h in hosts}
    collected: dict[str, dict] = {h.name: {} for h in hosts}
    try:
        while True:
            states = []
            for host in hosts:
                payload = jobs.job_call(host, "logs", run_id, offsets=offsets[host.name] or None)
                data = payload.get("data") or {}
                if "logs" not in data:
                    console.print(Text(f"{host.name}: {payload['records'][0]['summary']}", style="bold red"))
                    return ExitCode.JOB_NOT_FOUND
                offsets[host.name] = data["offsets"]
                states.append(data.get("state") or "missing")
                for name, chunk in data["logs"].items():
                    if only and not name.startswith(only):
                        continue
                    collected[host.name][name] = collected[host.name].get(name, "") + chunk["text"]
                    if not as_json:
                        for line in chunk["text"].splitlines():
                            console.print(Text(f"{host.name} {name[:-4]:>10} | ", style="dim") + Text(line))
            if not follow or all(s in jobs.FINAL for s in states):
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        console.print("[yellow]stopped following; the run goes on[/]")
    if as_json:
        sys.stdout.write(json.dumps({"run_id": run_id, "logs": collected}, indent=2) + "\n")
    return ExitCode.SUCCESS
