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
