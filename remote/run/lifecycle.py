"""A run's life as ``status.json`` tells it: the one writer of that file (stdlib only).

Every write of a run's ``status.json`` goes through :class:`StatusFile`: the supervisors
(extraction, a replica's worker host, train) through its life-cycle moves (:meth:`StatusFile.begin`,
:meth:`~StatusFile.update`, :meth:`~StatusFile.fail`, :meth:`~StatusFile.abort`,
:meth:`~StatusFile.finish`), the job verbs (``start``'s restart, ``status``'s dead-supervisor
correction, ``abort``'s account) through :meth:`StatusFile.load`. Each write is checked against the
wire's schema (:func:`remote.wire.status.check`) and each change of state against its moves
(:func:`remote.wire.status.check_move`): a wrong one raises, naming the field or the from/to.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from remote.wire import fsutil, status as wire_status
from remote.wire.contract import RunState

#: a supervisor's exit code by the run's final state.
SUPERVISOR_EXIT = {RunState.DONE.value: 0, RunState.FAILED.value: 1, RunState.ABORTED.value: 143}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_previous(path: Path) -> dict:
    """The status an earlier attempt left at ``path`` ({} when none, or not JSON)."""
    return fsutil.read_json_quietly(path) or {}


class StatusFile:
    """``status.json``, rewritten atomically on every change and on a heartbeat: its one writer.

    :param initial: the status as it stands (not written until the first change).
    :param beats: every write stamps ``heartbeat_unix`` (the supervisor's own writes: it lives); a job
        verb's write of a run it does not run leaves the supervisor's last heartbeat as it was.
    """

    def __init__(self, path: Path, initial: dict, beats: bool = True):
        self.path = Path(path)
        self.data = dict(initial)
        self.beats = beats
        self.lock = threading.Lock()
        #: called once, with the final state, before the write that ends the run; the fields it returns are
        #: written with that state (what the run holds is stopped before anyone reads it ended)
        self.before_final = None

    # -- opening one
    @classmethod
    def begin(cls, path: Path, run_id: str, **fields) -> "StatusFile":
        """A supervisor's first status of this attempt: pending, its pid, the attempt's number, the last
        attempt's error kept as ``previous_error`` (``job start`` moved it there), and the kind's ``fields``."""
        previous = read_previous(path)
        initial = {
            "run_id": run_id, "state": RunState.PENDING.value, "phase": "starting", "started_at": utc_now(),
            "error": None, "pid": os.getpid(), "attempt": int(previous.get("attempt") or 0) + 1,
            "previous_error": wire_status.kept_error(previous.get("error") or previous.get("previous_error")),
        }
        for name, value in fields.items():
            initial[name] = value(previous) if callable(value) else value
        return cls(path, initial)

    @classmethod
    def load(cls, path: Path) -> "StatusFile | None":
        """The status as the file holds it, to change it from outside the supervisor (the job verbs); None: no file."""
        data = fsutil.read_json_quietly(path)
        return cls(path, data, beats=False) if isinstance(data, dict) else None

    @classmethod
    def of_job(cls, path: Path, data: dict | None = None) -> "StatusFile":
        """A job verb's writer of ``data`` (default: the file as it is; {} when there is none)."""
        if data is None:
            return cls.load(path) or cls(path, {}, beats=False)
        return cls(path, data, beats=False)

    # -- writing
    def update(self, *, moves=(), **fields) -> dict:
        """Set ``fields`` and write; a ``state`` among them moves the run (:func:`remote.wire.status.check_move`).

        :param moves: the explicit moves this write takes (``restart``, ``abort_by_request``).
        :raises remote.wire.status.StatusError: a field that does not fit the schema, or a move not allowed.
        """
        ending = fields.get("state") in wire_status.FINAL_STATES and not self.is_final
        if ending and self.before_final is not None:
            hook, self.before_final = self.before_final, None
            fields = {**hook(fields["state"]), **fields}
        with self.lock:
            if "state" in fields:
                wire_status.check_move(self.data.get("state"), fields["state"], named=moves, where=self.path)
            data = {**self.data, **fields, "updated_at": utc_now()}
            # job start's restart beats too: the grace before the new supervisor's pid shows counts from it
            if self.beats or "restart" in moves or data.get("heartbeat_unix") is None:
                data["heartbeat_unix"] = time.time()
            data.setdefault("run_id", self.path.parent.name)  # a run dir is named by its run id
            if data["run_id"] is None:
                data["run_id"] = self.path.parent.name
            data.pop("alive", None)  # job status's liveness is never written
            # checked as the file will hold it (tuples as lists, paths as strings)
            doc = json.loads(json.dumps(data, default=str))
            wire_status.check(doc, require=wire_status.FOR_WRITE, where=self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fsutil.write_json(self.path, doc, temp_prefix=fsutil.TEMP_PREFIX)
            self.data = data
            return dict(data)

    def heartbeat(self, **fields) -> dict:
        """A write that says the supervisor lives (``fields``: what changed meanwhile, never the state)."""
        if "state" in fields:
            raise ValueError("a heartbeat does not move the run: use update(state=...)")
        return self.update(**fields)

    def finish(self, **fields) -> dict:
        return self.update(state=RunState.DONE.value, phase="done", **fields)

    def fail(self, error: dict, *, ended_by_slurm: bool = False, **fields) -> dict:
        """``failed``, with ``error`` saying why. ``ended_by_slurm``: Slurm's state of the run's job, which replaces
        an abort its supervisor recorded for Slurm's SIGTERM (a time limit is no user's abort)."""
        return self.update(state=RunState.FAILED.value, phase="failed", error=wire_status.with_known_fix(error),
                           moves=("ended_by_slurm",) if ended_by_slurm else (), **fields)

    def abort(self, error: dict, *, by_request: bool = False, **fields) -> dict:
        """``aborted``, with ``error`` saying how. ``by_request``: job abort's own account, which
        replaces the supervisor's (failed or aborted) last word."""
        return self.update(state=RunState.ABORTED.value, phase="aborted", error=error,
                           moves=("abort_by_request",) if by_request else (), **fields)

    def end(self, error: dict, *, aborted: bool = False, **fields) -> int:
        """A supervisor's last word on a run stopped by ``error`` (``aborted``: by SIGTERM): failed or
        aborted, and its exit code (:data:`SUPERVISOR_EXIT`). A run already final keeps its state (done
        before the signal came stays done, as job abort keeps it); a failed one takes a later failure's error."""
        if not self.is_final or (self.state == RunState.FAILED and not aborted):
            (self.abort if aborted else self.fail)(error, **fields)
        return SUPERVISOR_EXIT[self.state]

    def restart(self, run_id: str) -> dict:
        """``job start``: the run pending again, its last error kept as ``previous_error``."""
        return self.update(run_id=run_id, state=RunState.PENDING.value, phase="starting", error=None,
                           previous_error=wire_status.kept_error(self.data.get("error")), moves=("restart",))

    @property
    def state(self):
        return self.data.get("state")

    @property
    def is_final(self) -> bool:
        return self.state in wire_status.FINAL_STATES
