"""The one schema of a run's ``status.json`` and of its ``error``, and the moves between run states (stdlib only).

``status.json`` is what a run's supervisor says of the run as it goes (state, phase, progress,
heartbeat, error); ``job status`` folds liveness in, the laptop reads it (``specops.result.RunState``).
One writer writes it (:class:`remote.run.lifecycle.StatusFile`); every write is checked here
(:func:`check`), and so is every state it moves to (:func:`check_move`). Built like
:mod:`remote.wire.manifest`: :data:`FIELDS` and :data:`ERROR_FIELDS` say each field's kind and
meaning; a field that is absent or null counts as missing (a status of an older specops, with
fewer fields, still reads); unknown fields are kept as they are::

    >>> check({"state": "extracting", "samples_done": "3"})
    Traceback (most recent call last):
    StatusError: status.json: field 'samples_done' is "3", expected a whole number >= 0
    >>> check({"state": "failed", "error": {"type": "ValueError"}})
    Traceback (most recent call last):
    StatusError: status.json: field 'error.message' is missing
    >>> check_move("done", "extracting")
    Traceback (most recent call last):
    TransitionError: status.json: no move from 'done' to 'extracting' (a final state is left only by a restart: job start)

The laptop imports this very module as ``specops.wire.status``.
"""
from __future__ import annotations

import re
import traceback as _traceback
from typing import NamedTuple

from . import contract, manifest

STATES, FINAL_STATES = contract.STATES, contract.FINAL_STATES
#: the states a run works in, in the order it passes through them (a run never goes back).
LIVE_STATES = tuple(s for s in STATES if s not in FINAL_STATES)


_int = manifest._int


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: kind -> (test, what a value of it is, said in a refusal): the manifest's kinds, and the status's own.
KINDS = {
    **{kind: manifest.KINDS[kind] for kind in ("text", "int", "flag", "object", "list", "ids", "names", "range",
                                               "convention")},
    "number": (_number, "a number"),
    "numbers": (lambda v: isinstance(v, list) and all(_number(x) for x in v), "a list of numbers"),
    "seconds": (lambda v: isinstance(v, dict) and all(_number(x) for x in v.values()),
                "an object of phase -> seconds"),
    "state": (lambda v: v in STATES, f"one of {list(STATES)}"),
    "rank": (_int, "a rank (a whole number)"),
    "int_or_object": (lambda v: _int(v) or isinstance(v, dict), "a whole number or an object"),
    "error": (lambda v: isinstance(v, dict), "an error object (ERROR_FIELDS)"),
    "any": (lambda v: True, "anything"),
}


#: a field: its kind (:data:`KINDS`), what it holds, and (manifest's ``docs``) the run kinds whose status
#: carries it: extract (an extraction, a replica's head included), replica (a replica's worker host), train;
#: ``job`` (the job verbs add it).
ALL_KINDS = "extract replica train"


def Field(kind: str, what: str, docs: str = ALL_KINDS) -> manifest.Field:
    return manifest.Field(kind, what, docs)


#: every top-level field of ``status.json``, what it holds, and which run kinds write it.
FIELDS = {
    "run_id": Field("text", "the run id"),
    "kind": Field("text", "the run's kind where it is not an extraction: train", "train"),
    "state": Field("state", "where the run is (contract.RunState): pending .. done, failed, aborted"),
    "phase": Field("text", "what it does now, in words"),
    "updated_at": Field("text", "the last write (UTC, ISO 8601)"),
    "heartbeat_unix": Field("number", "the last write (unix seconds): a live supervisor rewrites it every few seconds"),
    "started_at": Field("text", "when this attempt's supervisor started (UTC)"),
    "pid": Field("int", "the supervisor's pid"),
    "attempt": Field("int", "1 for the first start, +1 for every restart"),
    "error": Field("error", "why the run failed or was aborted (ERROR_FIELDS); null while it goes well"),
    "previous_error": Field("error", "the last attempt's error (job start moves it here)"),
    "samples_done": Field("int", "samples on disk (train: the step)"),
    "samples_total": Field("int", "samples to make (train: the steps)"),
    "tokens_done": Field("int", "tokens of the samples on disk", "extract"),
    "tokens_total": Field("int", "tokens of every sample of the range", "extract"),
    "tokens_per_s": Field("number", "this attempt's rate", "extract train"),
    "eta_s": Field("number", "seconds left, estimated", "extract train"),
    "phase_seconds": Field("seconds", "phase -> seconds spent in it", "extract"),
    "output_dir": Field("text", "where the samples go", "extract"),
    "plan": Field("object", "the run's resolved plan", "extract train"),
    "engine": Field("text", "the engine that runs", "extract"),
    "engine_why": Field("text", "why that engine", "extract"),
    "format": Field("text", "the sample format: pt or hs", "extract"),
    "layer_ids": Field("ids", "the layers captured", "extract"),
    "layer_convention": Field("convention", "what the layer ids count", "extract"),
    "sample_range": Field("range", "[lo, hi) of the dataset this run makes", "extract"),
    "dataset_samples": Field("int", "samples the dataset makes", "extract"),
    "resumed_from": Field("int_or_object", "extract: the first index made this attempt; train: the checkpoint "
                                           "resumed (epoch, global step)", "extract train"),
    "canary": Field("object", "the canary's verdict (remote.verify.canary.summarize)", "extract"),
    "replica": Field("object", "a replica over several hosts: its name, hosts, this host's ranks", "extract replica"),
    "memory": Field("object", "the measured memory, peak so far (remote.wire.words)", "train"),
    "step": Field("int", "the training step", "train"),
    "steps_total": Field("int", "the steps of the whole run, estimated", "train"),
    "epoch": Field("int", "the epoch", "train"),
    "epochs": Field("int", "the epochs asked for", "train"),
    "loss": Field("number", "the last training loss", "train"),
    "accuracy": Field("numbers", "the last per-position accuracy", "train"),
    "val_loss": Field("number", "the last validation loss", "train"),
    "val_accuracy": Field("numbers", "the last validation accuracy", "train"),
    "first_step_this_attempt": Field("int", "the first step this attempt trained", "train"),
    "launcher": Field("text", "the trainer's module", "train"),
    "processes": Field("int", "trainer processes", "train"),
    "command": Field("list", "the trainer's command line", "train"),
    "set_aside": Field("list", "half-written epoch dirs moved aside", "train"),
    "checkpoints": Field("text", "the checkpoints' dir", "train"),
    "checkpoint": Field("object", "the last checkpoint (epoch, global step, path)", "train"),
    "wall_s": Field("number", "seconds the trainer ran", "train"),
    "states_run": Field("text", "--regenerate: the extraction run of the regenerated text", "train"),
    "regenerated": Field("object", "--regenerate: what was regenerated", "train"),
    "data_check": Field("object", "--regenerate: the regenerated states' data check", "train"),
    "online_server": Field("object", "train --online: its extraction server (command, endpoint, pid, log, ready_s, "
                                     "layer ids; a disaggregated run: server and trainer hosts)", "train"),
    "nodes": Field("object", "a run over several hosts: this host's place in it (remote.train.plan.NODE_KEYS); "
                             "null on one host", "train"),
    "alive": Field("flag", "job status: whether the supervisor runs (never written to the file)", "job"),
}
#: the fields of ``error`` (and ``previous_error``); ``type`` and ``message`` are always there.
ERROR_FIELDS = {
    "type": Field("text", "the exception's type, or a name of ours (Aborted, SupervisorDied, HostLost, ...)"),
    "message": Field("text", "what happened, in words"),
    "rank": Field("rank", "the failing rank (null: the supervisor, or the host as a whole)"),
    "where": Field("text", "where it happened: supervisor, engine, trainer, job.abort, host <name>, logs/rank<k>.log"),
    "traceback": Field("text", "the full traceback ('' when there is none)"),
    "source": Field("text", "where the root cause was read: errors/rank<k>.json, logs/rank<k>.log, waitpid"),
    "log_tail": Field("text", "the end of the log that tells of it"),
    "note": Field("text", "what the supervisor did about it"),
    "fix": Field("text", "what to do"),
    "detail": Field("any", "structured detail of the failed check"),
    "reported_as": Field("object", "the driver's own view of the failure (type, message)"),
    "other_errors": Field("list", "the other candidates, consequences or faults beside it"),
    "signal": Field("any", "the signal that ended the process (name), or abort's: SIGTERM, SIGKILL"),
    "pid": Field("int", "the process that died"),
    "time": Field("number", "when a worker recorded it (unix seconds; errors/rank<k>.json)"),
    "exception": Field("text", "the server log's exception line"),
    "process": Field("text", "that process's name (VllmWorker-1, EngineCore_DP0, trainer)"),
    "signal_meaning": Field("text", "what that signal usually means"),
    "check": Field("text", "the failed check's record name (the canary's)"),
    "exit_code": Field("number", "the process's exit code (negative: killed by a signal)"),
    "oom": Field("object", "what the kernel says of an OOM kill"),
    "host": Field("text", "a replica: the host it happened on"),
    "node_rank": Field("int", "a replica: that host's node rank"),
    "ranks": Field("ids", "a replica: that host's ranks"),
    "head_error": Field("object", "a replica: the head's own error beside a worker host's"),
    "cause": Field("text", "a cause named beside the trainer's own error (ENOSPC)"),
    "step": Field("int", "train: the step it happened at"),
    "epoch": Field("int", "train: the epoch it happened in"),
    "killed_after_grace": Field("flag", "job abort: SIGKILL was needed"),
    "swept": Field("ids", "job abort: leftover processes killed"),
    "left": Field("ids", "job abort: processes still alive"),
    "supervisor_error": Field("text", "job abort: what the supervisor had said"),
}
#: what a reader needs (the laptop and ``job status``), and what every write holds.
FOR_READ = ("state",)
FOR_WRITE = ("run_id", "state", "phase", "updated_at", "heartbeat_unix")
ERROR_REQUIRED = ("type", "message")


class StatusError(ValueError):
    """A status (or its error) that does not fit the schema: ``field`` (None: the whole) is missing or wrong."""

    def __init__(self, where, field: str | None, problem: str, value=None):
        self.where, self.field, self.problem, self.value = str(where), field, problem, value
        super().__init__(f"{where}: " + (f"field {field!r} {problem}" if field else problem))


class TransitionError(StatusError):
    """A move between run states the life cycle does not allow (``from``/``to`` named)."""

    def __init__(self, where, old, new, why: str):
        self.old, self.new = old, new
        super().__init__(where, None, f"no move from {old!r} to {new!r} ({why})")


def _check_value(where, name: str, value, field) -> None:
    manifest.check_value(where, name, value, field, KINDS, StatusError)


def check_error(error, name: str = "error", where="status.json") -> dict:
    """``error`` itself when it fits :data:`ERROR_FIELDS` (``type`` and ``message`` present).

    :raises StatusError: the first field missing or wrong, named (``error.message``).
    """
    if not isinstance(error, dict):
        raise StatusError(where, name, f"is {type(error).__name__}, expected an error object")
    for key in ERROR_REQUIRED:
        if error.get(key) is None:
            raise StatusError(where, f"{name}.{key}", "is missing")
    for key, field in ERROR_FIELDS.items():
        _check_value(where, f"{name}.{key}", error.get(key), field)
    return error


def check(doc, require=FOR_READ, where="status.json") -> dict:
    """``doc`` itself when it fits the schema and has every field of ``require``.

    :raises StatusError: the first field that is missing or wrong, named.
    """
    if not isinstance(doc, dict):
        raise StatusError(where, None, f"holds {type(doc).__name__}, expected a JSON object")
    for name in require:
        if doc.get(name) is None:
            raise StatusError(where, name, "is missing")
    for name, field in FIELDS.items():
        _check_value(where, name, doc.get(name), field)
    for name in ("error", "previous_error"):
        if doc.get(name) is not None:
            check_error(doc[name], name, where)
    return doc


# --------------------------------------------------------------------------- the error record


def error(type: str, message: str, *, rank=None, where: str = "supervisor", traceback: str = "", **extra) -> dict:
    """The run's ``error``, checked: every module that reports a failure or an abort builds it here.

    >>> error("Aborted", "aborted by request (SIGTERM)")
    {'rank': None, 'type': 'Aborted', 'message': 'aborted by request (SIGTERM)', 'traceback': '', 'where': 'supervisor'}
    """
    record = {"rank": rank, "type": type, "message": message, "traceback": traceback, "where": where, **extra}
    return check_error(record, where="the built error")


#: a port a process could not listen on, as torch's TCPStore says it (vLLM's ranks, torchrun):
#: "... port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
PORT_TAKEN_RE = re.compile(r"port: (\d+)\b[^\n]*EADDRINUSE")


def with_known_fix(error: dict) -> dict:
    """``error`` with the fix of a cause its message names that has one wherever it comes from (a rank's own
    exception, a server log's line); a fix it carries already is kept."""
    if error.get("fix"):
        return error
    taken = PORT_TAKEN_RE.search(str(error.get("message") or ""))
    if taken:
        port = taken.group(1)
        return {**error, "fix": f"port {port} of that host is taken (a process listens on it, or a connection "
                                f"holds it: ss -tanp 'sport = :{port}' names it). If it is the run's master port "
                                f"(replicas: master_port in the inventory; train over nodes: --master-port), give a "
                                f"port P with P + 1 free below the kernel's ephemeral range (cat "
                                f"/proc/sys/net/ipv4/ip_local_port_range), or stop what holds it; if vLLM chose it, "
                                f"run the same command again"}
    return error


def error_from(exc: BaseException, rank=None, where: str = "supervisor", **extra) -> dict:
    """``exc`` as the run's ``error``: its type, message and full traceback, and the ``fix`` and ``detail`` the
    exception carries (a check that knows what to do says it where it raises)."""
    for name, kinds in (("fix", str), ("detail", dict)):
        carried = getattr(exc, name, None)
        if extra.get(name) is None and isinstance(carried, kinds):
            extra[name] = carried
    return error(type(exc).__name__, str(exc) or repr(exc), rank=rank, where=where,
                 traceback="".join(_traceback.format_exception(type(exc), exc, exc.__traceback__)), **extra)


def kept_error(old) -> dict | None:
    """An earlier attempt's ``error`` as the next attempt keeps it (``previous_error``): as it was where it
    fits :data:`ERROR_FIELDS`, else its text in an error that does (an odd old error never stops a restart)."""
    if old is None:
        return None
    try:
        return check_error(old, "previous_error")
    except StatusError as exc:
        return error("UnreadableError", f"{str(old)[:2000]} (field {exc.field!r} {exc.problem})",
                     where="an earlier attempt")


# --------------------------------------------------------------------------- moves between states


class Move(NamedTuple):
    #: the states it leaves (None: no status yet) and the states it reaches
    sources: tuple
    targets: tuple
    what: str
    #: taken only when the writer names it (a final state is left only so)
    explicit: bool = False


#: every move between run states, by name. A live state goes forward (or stays), a final state
#: stays where it is; ``restart``, ``abort_by_request`` and ``ended_by_slurm`` are the only ways out of one,
#: and only when the writer names them.
MOVES = {
    "begin": Move((None,), STATES, "a status written where there was none"),
    "advance": Move(LIVE_STATES, LIVE_STATES, "the run goes on (forward only: pending, loading, extracting, "
                                              "training, writing)"),
    "finish": Move(LIVE_STATES, (contract.RunState.DONE.value,), "every sample (or step) is made"),
    "fail": Move(LIVE_STATES, (contract.RunState.FAILED.value,), "the run failed"),
    "abort": Move(LIVE_STATES, (contract.RunState.ABORTED.value,), "SIGTERM reached the supervisor"),
    "restart": Move((None, *STATES), (contract.RunState.PENDING.value,),
                    "job start: a new run, or a failed, aborted (or done but with samples gone) one again", True),
    "abort_by_request": Move((contract.RunState.FAILED.value, contract.RunState.ABORTED.value, *LIVE_STATES),
                             (contract.RunState.ABORTED.value,),
                             "job abort: its account of how it stopped the run is the run's last word", True),
    "ended_by_slurm": Move((contract.RunState.ABORTED.value,), (contract.RunState.FAILED.value,),
                           "Slurm ended the job (its time limit, a node failure, memory): the SIGTERM its supervisor "
                           "took for an abort was Slurm's, and Slurm's state is the run's end", True),
}


def check_move(old, new, named=(), where="status.json") -> str:
    """The name of the move from state ``old`` (None: no status yet) to ``new``; the same state is no move.

    :param named: the explicit moves (:data:`MOVES` ``explicit``) the writer takes here.
    :raises TransitionError: no move leads there, naming from and to.
    """
    if new not in STATES:
        raise StatusError(where, "state", f"is {new!r}, expected one of {list(STATES)}", new)
    if old == new:
        return "stay"
    for name, move in MOVES.items():
        if move.explicit and name not in named:
            continue
        if old in move.sources and new in move.targets:
            if name == "advance" and LIVE_STATES.index(new) < LIVE_STATES.index(old):
                continue
            return name
    why = ("a final state is left only by a restart: job start" if old in FINAL_STATES
           else "a run never goes back" if new in LIVE_STATES else "not a move of the run's life cycle")
    raise TransitionError(where, old, new, why)
