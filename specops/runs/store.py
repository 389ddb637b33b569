"""A group run's shard map on the laptop: ``runs/<run-id>/fleet.json``, read and written atomically.

Its presence is what makes a run id a group run for every command (``status``, ``logs``,
``abort``, ``fetch``, ``verify``, ``extract`` again).
"""
from __future__ import annotations

import threading
from pathlib import Path

from specops import jobs
from specops.runs import shardmap
from specops import wire
from specops.errors import SpecopsError, UsageError
from specops.runs.shardmap import FleetManifest

#: the name of the group's own report (its plan, merge and verdict records), beside the shards'.
GROUP = "fleet"

_save_lock = threading.Lock()


def run_root(run_id: str) -> Path:
    return jobs.local_runs_root() / run_id


def manifest_path(run_id: str) -> Path:
    return run_root(run_id) / "fleet.json"


def load_manifest(run_id: str) -> FleetManifest | None:
    """The group run's map, or None when this laptop has no fleet run of that id."""
    path = manifest_path(run_id)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return FleetManifest.model_validate_json(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not a readable fleet manifest: {str(exc).splitlines()[0]}",
                         "restore it from a backup, or start the run under a new run id") from None


def save_manifest(manifest: FleetManifest) -> None:
    """Write ``fleet.json`` atomically; a map that does not cover every sample exactly once is a bug."""
    problems = shardmap.coverage_problems(manifest)
    if problems:
        raise SpecopsError(f"internal error: the shard map of run {manifest.run_id} is broken: {problems[0]}",
                           "report this as a specops bug, with runs/<run-id>/fleet.json")
    path = manifest_path(manifest.run_id)
    with _save_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        wire.fsutil.atomic_write(path, manifest.model_dump_json(indent=2), mode=0o644)


def is_fleet_run(run_id: str | None) -> bool:
    return bool(run_id) and manifest_path(run_id).is_file()
