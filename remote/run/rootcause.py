"""Which rank failed a run, and why: the one error to report, out of many (stdlib only).

When one rank of a tensor-parallel run dies, every other rank and the driver fail too,
each with its own message ("connection reset by peer", vLLM's generic "Worker failed
with error ..."). Those are consequences. The cause is found in, best first:

0. a process of the run that died by a signal (SIGILL, SIGKILL, SIGSEGV, ...), as its
   parent saw it (``waitpid``: the engine's :meth:`process_deaths`) or its parent's log
   line said, named with the signal and what it means (:mod:`remote.system.signals`), with
   faulthandler's dump from its log as the traceback when there is one;
1. a rank's log ending in faulthandler's ``Fatal Python error`` (a hard crash: no
   exception was raised anywhere);
2. ``RUN_DIR/errors/rank<k>.json``, which the worker hook writes inside the failing
   worker, with its own traceback;
3. the last traceback in ``RUN_DIR/logs/rank<k>.log`` of a rank that recorded nothing;
4. errors that only say a peer went away;
5. the supervisor's own exception.

:func:`root_cause` returns the first of these and keeps the rest as context;
:func:`last_traceback` reads a traceback out of a log (also used by ``job status`` on a
supervisor that died).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from remote.run.rundir import RunPaths
from remote.system import signals
from remote.wire import status

TRACEBACK_HEAD = "Traceback (most recent call last):"
# vLLM prefixes each worker's output with "(Worker_TP1 pid=123) "; dropped before parsing.
_PREFIX_RE = re.compile(r"^\((?:\w|[-.])+ pid=\d+\) ")
_FATAL_RE = re.compile(r"^Fatal Python error: (.*)$")
#: the first line of a rank log (remote/extract/engines/vllm_worker_hook.py)
_RANK_LOG_HEAD_RE = re.compile(r"\[specops\] rank log of pid (\d+)(?: \(([\w.-]+)\))? started")


def error_record(exc: BaseException, rank=None, where: str = "supervisor") -> dict:
    """``exc`` as the error dict a failed run reports: rank, type, message, full traceback, where."""
    return status.error_from(exc, rank=rank, where=where)


def worker_errors(errors_dir: Path) -> list[dict]:
    """Errors recorded inside worker processes, earliest first."""
    found = []
    for path in sorted(Path(errors_dir).glob("rank*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: r.get("time", 0.0))


def last_traceback(text: str):
    """The last Python traceback (or faulthandler fatal error) in a log, as an error dict.

    vLLM prefixes worker lines with ``(Worker_TP1 pid=123)``; the prefix is dropped.
    Returns None when the text holds neither.
    """
    lines = [_PREFIX_RE.sub("", ln) for ln in text.splitlines()]
    start = max((i for i, ln in enumerate(lines) if ln.strip().endswith(TRACEBACK_HEAD)), default=None)
    fatal = max((i for i, ln in enumerate(lines) if _FATAL_RE.match(ln.strip())), default=None)
    if fatal is not None and (start is None or fatal > start):
        # faulthandler dumps every thread, the crashing one ("Current thread") last,
        # then "Extension modules: ..."; keep the whole dump (bounded).
        block = []
        for ln in lines[fatal:fatal + 600]:
            block.append(ln)
            if ln.startswith("Extension modules:"):
                break
        return {"type": "FatalError", "message": _FATAL_RE.match(lines[fatal].strip()).group(1),
                "traceback": "\n".join(block)}
    if start is None:
        return None
    block = [lines[start].strip()]
    # Frames are indented; the exception line is the first unindented one after them.
    exc_line = None
    for ln in lines[start + 1:]:
        block.append(ln)
        if ln and not ln[0].isspace() and not ln.startswith("Traceback"):
            exc_line = ln
            break
    if exc_line is None:
        return None
    etype, _, msg = exc_line.partition(":")
    return {"type": etype.strip().rsplit(".", 1)[-1], "message": msg.strip() or etype.strip(),
            "traceback": "\n".join(block)}


#: Messages of a rank that lost a *peer* (the consequence, not the cause).
PEER_LOSS_RE = re.compile(r"connection reset|connection closed|broken pipe|peer|"
                          r"remote process (has )?exited|gloo|nccl.*(abort|timeout)", re.I)


#: signals a process gets from its own fault or its own abort(), never from a peer's
#: shutdown (vLLM and the supervisor stop the survivors with SIGTERM, then SIGKILL): a
#: second death by one of these is a failure of its own, named beside the first
FAULT_SIGNALS = frozenset({"SIGILL", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE"})


def first_signal_death(deaths) -> dict | None:
    """The first process death of ``deaths`` when a signal caused it; None otherwise.

    Only the first one counts: when one worker dies, vLLM stops the others (their exits,
    SIGTERM included, are consequences), and a first death by a plain exit code is a
    process that raised (its own recorded exception says more than its exit code).
    """
    deaths = [d for d in deaths or [] if d.get("exit_code") not in (None, 0)]
    if not deaths:
        return None
    first = min(deaths, key=lambda d: d.get("died_at", 0.0))
    return first if signals.describe_exit(first["exit_code"])["signal"] else None


def root_cause(paths: RunPaths, exc: BaseException | None, exc_rank=None, deaths=None) -> dict:
    """The one error to report for a failed attempt, with the rest kept as context.

    Candidates, best first: a rank that died hard (faulthandler's "Fatal Python error"
    in its log: no exception was raised anywhere); a rank's own recorded exception
    (``errors/rank<k>.json``, earliest first) unless it only says a peer went away
    (connection reset, gloo/NCCL errors); the last traceback in the log of a rank that
    recorded nothing; the peer-loss errors; finally the supervisor's exception. The
    driver's view (often vLLM's generic "Worker failed with error ...") is kept as
    ``reported_as``; the other candidates as ``other_errors``.

    :param exc_rank: the rank ``exc`` belongs to when it was raised by an in-process
        engine (rank 0); None for the supervisor's own errors.
    :param deaths: processes of the engine that ended (``name``, ``rank``, ``pid``,
        ``exit_code``, ``died_at``); the first one, when a signal ended it, is the cause.
    """
    seen = error_record(exc, rank=exc_rank, where="supervisor" if exc_rank is None else "engine") \
        if exc is not None else None
    fatal, own, from_logs, peer_loss = [], [], [], []
    recorded = worker_errors(paths.errors)
    for rec in recorded:
        rec = dict(rec, source=f"errors/rank{rec['rank']}.json")
        (peer_loss if PEER_LOSS_RE.search(rec.get("message", "")) else own).append(rec)
    recorded_ranks = {rec["rank"] for rec in recorded}
    for log in sorted(paths.logs.glob("rank*.log")):
        with open(log, "rb") as fh:
            fh.seek(paths.log_offsets.get(log.name, 0))
            text = fh.read().decode(errors="replace")
        found = last_traceback(text)
        if not found:
            continue
        rank = int(re.search(r"rank(\d+)", log.name).group(1))
        found.update(rank=rank, where=f"logs/{log.name}", source=f"logs/{log.name}")
        head = _RANK_LOG_HEAD_RE.search(text)
        if head:
            found.update(pid=int(head.group(1)), process=head.group(2))
        if found["type"] == "FatalError":
            fatal.append(found)
        elif rank not in recorded_ranks:
            from_logs.append(found)
    death = first_signal_death(deaths)
    if death is not None:
        # the first death is the cause; another process that faulted too (every rank of a
        # wheel built for another CPU dies by SIGILL) is named as well, never as a consequence
        faulted = [d for d in deaths if d is not death and d.get("exit_code") not in (None, 0)
                   and signals.describe_exit(d["exit_code"])["signal"] in FAULT_SIGNALS]
        named = []
        for dead in [death] + sorted(faulted, key=lambda d: d.get("died_at", 0.0)):
            rank = dead.get("rank")
            dump = next((f for f in fatal if f["rank"] == rank), None) if rank is not None else None
            source = dump["source"] if dump else dead.get("source") or "waitpid"
            named.append(signals.death_record(dead.get("name"), dead["exit_code"], pid=dead.get("pid"), rank=rank,
                                              source=source, fatal=dump))
            fatal = [f for f in fatal if f is not dump]
        # a rank whose faulthandler dumped a fault signal but whose end its parent had not
        # seen yet (it died a moment after the first): named from its own log
        for dump in [f for f in fatal if signals.FAULTHANDLER_NAMES.get(f["message"].strip()) in FAULT_SIGNALS]:
            named.append(signals.death_record(dump.get("process"), signals.exit_code_of_fatal(dump["message"]),
                                              pid=dump.get("pid"), rank=dump["rank"], source=dump["source"],
                                              fatal=dump))
            fatal = [f for f in fatal if f is not dump]
        fatal = named + fatal
    ranked = fatal + own + from_logs + peer_loss
    if not ranked:
        if seen is None:
            seen = status.error("UnknownError", "the run failed without an exception")
        seen.setdefault("source", "supervisor")
        return seen
    best = dict(ranked[0])
    if seen:
        best["reported_as"] = {k: seen[k] for k in ("type", "message")}
    others = [{k: r.get(k) for k in ("rank", "type", "message", "source", "signal", "pid") if k in r}
              for r in ranked[1:]]
    if others:
        best["other_errors"] = others
    return best


def note_in_rank_log(paths: RunPaths, error: dict | None) -> Path | None:
    """Append each death by signal (the run's error, and other ranks that faulted beside
    it: ``other_errors``) to the dead rank's own log (``logs/rank<k>.log``).

    A rank killed by a signal writes nothing itself (SIGKILL) or only faulthandler's
    dump; the line says, where a person reads that rank's log, who killed it and why
    that usually happens. :returns: the first log written to, or None.
    """
    written = None
    for dead in [error or {}] + list((error or {}).get("other_errors") or []):
        if not dead.get("signal") or dead.get("rank") is None:
            continue
        path = paths.logs / f"rank{int(dead['rank'])}.log"
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"[specops] {dead['message']}\n")
        except OSError:
            continue
        written = written or path
    return written
