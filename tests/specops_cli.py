"""The ``specops`` program as the tests drive it: the controller venv's entry point, run from the repo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def specops(*args, env=None, timeout=1500) -> subprocess.CompletedProcess:
    """``specops <args>`` (stdin closed, a wide console), its output captured."""
    return subprocess.run([str(Path(sys.executable).parent / "specops"), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def records(proc) -> dict:
    """The records of a ``--json`` run's document, by name (every host's)."""
    return {r["name"]: r for host in json.loads(proc.stdout)["hosts"] for r in host["records"]}
