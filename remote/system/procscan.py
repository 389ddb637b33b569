"""The one reader of ``/proc`` for "which processes are still there" (stdlib only, Linux).

A run finds its own processes in three ways, all through :func:`live_pids`: by its
process group (:mod:`remote.system.procgroup`: the supervisor's workers), by a marker in their
environment (:mod:`remote.run.rundir`: every process of a run dir, a vLLM server in a
session of its own included; :mod:`remote.extract.engines.vllm_server.process`: one server's).
Zombies are never counted: they run nothing and only their parent can reap them.
A process's tree and the memory each holds (:func:`process_tree`, :func:`memory_status`) are
what the train supervisor samples (:mod:`remote.train.memuse`).
Without ``/proc`` (macOS) nothing is found.
"""
from __future__ import annotations

import os

#: process states of ``/proc/<pid>/stat`` that are no longer running.
DEAD_STATES = ("Z", "X")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, pgrp third); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def environ(pid: int) -> set[bytes]:
    """The ``NAME=value`` entries of ``pid``'s environment (empty when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return set(fh.read().split(b"\0"))
    except OSError:
        return set()


def ignores(pid: int, signum: int) -> bool:
    """Whether ``pid`` ignores ``signum`` (its ``SigIgn`` mask in ``/proc/<pid>/status``); False when gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def live_pids(*, pgrp: int | None = None, env_any: set[bytes] | None = None) -> list[int]:
    """Live processes of this user other than this one that are in process group ``pgrp``
    and/or carry one of the ``NAME=value`` entries ``env_any`` in their environment."""
    if not os.path.isdir("/proc"):
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        if env_any is not None and not env_any & environ(pid):
            continue
        fields = stat_fields(pid)
        if fields is None or fields[0] in DEAD_STATES:
            continue
        if pgrp is not None and int(fields[2]) != pgrp:
            continue
        found.append(pid)
    return found


def children(pid: int) -> list[int]:
    """The child processes of ``pid``: ``/proc/<pid>/task/<tid>/children`` of each of its threads (a
    child started from another thread is listed under that thread); empty when ``pid`` is gone."""
    found, listed = [], False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                found += [int(c) for c in fh.read().split()]
            listed = True
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    if not listed and os.path.isdir(f"/proc/{pid}"):  # a kernel without the children files: by parent pid
        found = [int(e) for e in os.listdir("/proc")
                 if e.isdigit() and (stat_fields(int(e)) or ["", ""])[1] == str(pid)]
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (children, grandchildren, ...), parents first."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        if current in tree:
            continue
        tree.append(current)
        todo += children(current)
    return tree


def memory_status(pid: int) -> dict:
    """The ``Vm*`` lines of ``/proc/<pid>/status`` in bytes (``VmRSS``, ``VmHWM``: the resident peak);
    empty when the process is gone or a zombie (it holds no memory then)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key.startswith("Vm") and len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out
