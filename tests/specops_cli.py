"""The ``specops`` program as the tests drive it: the controller venv's entry point, run from the repo."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_sigint() -> None:
    """(preexec_fn) SIGINT at its default in the child, whatever this process inherited: a test run started as a
    background job of a script (`make test &`, nohup) has SIGINT ignored, its children inherit that and Python
    then installs no KeyboardInterrupt handler, so a Ctrl-C a test sends would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def specops(*args, env=None, timeout=1500) -> subprocess.CompletedProcess:
    """``specops <args>`` (stdin closed, a wide console), its output captured."""
    return subprocess.run([str(Path(sys.executable).parent / "specops"), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def records(proc) -> dict:
    """The records of a ``--json`` run's document, by name (every host's)."""
    return {r["name"]: r for host in json.loads(proc.stdout)["hosts"] for r in host["records"]}


# --------------------------------------------------------------------------- a run's status, waited for


def run_status(inventory, run_id, env) -> tuple[int, dict]:
    """``specops status --json`` of ``run_id`` on the inventory's one host: (exit code, the run's status)."""
    proc = specops("status", "--inventory", inventory, "--run-id", run_id, "--json", env=env, timeout=120)
    doc = json.loads(proc.stdout)
    return proc.returncode, (doc["hosts"][0].get("data") or {}).get("status") or {}


def wait_status(inventory, run_id, env, until, *, timeout: float = 600, after_attempt: int = 0,
                also=lambda: True, poll_s: float = 0.25, ask_every_s: float = 10.0) -> dict:
    """The run's status, as ``specops status --json`` gives it, once ``until(status)`` holds (``also()`` too) or the
    run ended, in an attempt after ``after_attempt``.

    The wait reads the host's ``status.json`` itself (a loopback host: its work dir is this machine's) and asks the
    CLI only to confirm, and every ``ask_every_s`` (the CLI is what names a supervisor that died without a word):
    a CLI call a poll costs a second of CPU, which a 2-core box running the suite on two workers does not have."""
    import time

    import yaml

    from remote.wire.contract import FINAL_STATES

    hosts = yaml.safe_load(Path(inventory).read_text())["hosts"]
    path = Path(next(iter(hosts.values()))["work_dir"]) / "runs" / run_id / "status.json"

    def holds(st: dict) -> bool:
        return (st.get("attempt") or 0) > after_attempt and (st.get("state") in FINAL_STATES or (until(st) and also()))

    deadline = time.monotonic() + timeout
    asked = time.monotonic()
    while True:
        try:
            on_disk = json.loads(path.read_text())
        except (OSError, ValueError):
            on_disk = {}
        if holds(on_disk) or time.monotonic() - asked > ask_every_s:
            asked = time.monotonic()
            st = run_status(inventory, run_id, env)[1]
            if holds(st):
                return st
        assert time.monotonic() < deadline, on_disk
        time.sleep(poll_s)
