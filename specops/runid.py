"""Run ids as a user gives them: the default one, and the host's rule checked on the laptop."""
from __future__ import annotations

import re
import time
from pathlib import Path

from specops import wire
from specops.errors import UsageError


def default_run_id(model_path: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model_path.rstrip("/")).name).strip("-.") or "run"
    return f"{name[:60]}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_id(run_id: str) -> str:
    """A run id a user gives: the host's rule, short enough for every suffix a group run appends."""
    contract = wire.contract
    problem = contract.run_id_problem(run_id, contract.USER_RUN_ID_MAX)
    if problem:
        raise UsageError(f"--run-id: {problem}",
                         f"{contract.run_id_fix(contract.USER_RUN_ID_MAX)} (the host takes {contract.RUN_ID_MAX} "
                         f"and a moved shard appends up to {contract.MOVED_SUFFIX_MAX})")
    return run_id
