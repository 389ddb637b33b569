"""A group run's shard map on the laptop: ``runs/<run-id>/group.json``, read and written atomically.

Its presence is what makes a run id a group run for every command (``status``, ``logs``,
``abort``, ``fetch``, ``verify``, ``extract`` again).
"""
from __future__ import annotations

import threading
from pathlib import Path

from specops import wire
from specops.errors import SpecopsError, UsageError
from specops.runs import hostjob, shardmap
from specops.runs.shardmap import GroupMap

#: the name of the group's own report (its plan, merge and verdict records), beside the shards'.
GROUP = "group"

_save_lock = threading.Lock()


def run_root(run_id: str) -> Path:
    return hostjob.local_runs_root() / run_id


#: the group run's map on the laptop, and its name where an earlier specops (before "group run" was the
#: one word) planned the run: such a run is still found, followed and fetched, its map kept where it is.
MAP_NAME, EARLIER_MAP_NAME = "group.json", "fleet.json"


def manifest_path(run_id: str) -> Path:
    root = run_root(run_id)
    earlier = root / EARLIER_MAP_NAME
    return earlier if earlier.is_file() and not (root / MAP_NAME).is_file() else root / MAP_NAME


def load_manifest(run_id: str) -> GroupMap | None:
    """The group run's map, or None when this laptop has no group run of that id."""
    path = manifest_path(run_id)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return GroupMap.model_validate_json(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not a readable group run map: {str(exc).splitlines()[0]}",
                         "restore it from a backup, or start the run under a new run id") from None


def save_manifest(manifest: GroupMap) -> None:
    """Write ``group.json`` atomically; a map that does not cover every sample exactly once is a bug."""
    problems = shardmap.coverage_problems(manifest)
    if problems:
        raise SpecopsError(f"internal error: the shard map of run {manifest.run_id} is broken: {problems[0]}",
                           "report this as a specops bug, with runs/<run-id>/group.json")
    path = manifest_path(manifest.run_id)
    with _save_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        wire.fsutil.atomic_write(path, manifest.model_dump_json(indent=2), mode=0o644)


def is_group_run(run_id: str | None) -> bool:
    return bool(run_id) and manifest_path(run_id).is_file()
