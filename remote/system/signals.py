"""How a process ended, in words: exit codes and signals decoded once for every reader (stdlib only).

Python reports a child killed by signal N as exit code ``-N`` (``subprocess.Popen.returncode``,
``multiprocessing.Process.exitcode``; vLLM 0.32 prints it as ``died unexpectedly (exit code:
-4)``); a shell reports ``128 + N``. :func:`describe_exit` turns either into the signal's
name and what it usually means on a GPU/CPU host; :func:`death_record` makes that the
run's error for a named process (rank k, engine core, API server), and for SIGKILL says
whether the kernel's OOM killer left evidence we can read (:func:`oom_evidence`).

    >>> describe_exit(-4)["signal"], describe_exit(132, shell=True)["signal"]
    ('SIGILL', 'SIGILL')
    >>> death_record("VllmWorker-1", -11, pid=42)["message"].split(":")[0]
    'rank 1 (VllmWorker-1, pid 42) was killed by SIGSEGV (segmentation fault)'
"""
from __future__ import annotations

import errno
import os
import re
import signal

#: signal -> (short name a person knows, what it usually means for a run of ours)
MEANINGS = {
    "SIGILL": ("illegal instruction",
               "an instruction this CPU or VM does not allow, typically a wheel built for another ISA "
               "(AVX-512/AMX kernels on a CPU or VM without them); check the CPU flags against the build"),
    "SIGKILL": ("killed outright",
                "the kernel's OOM killer (the host ran out of memory) or a kill -9 by a person, a "
                "scheduler or a supervisor; it cannot be caught, so the process left no trace of its own"),
    "SIGSEGV": ("segmentation fault",
                "native code (a kernel, a C/C++ extension) touched memory it does not own: often "
                "extensions built against another torch, or a bug in the kernel"),
    "SIGBUS": ("bus error",
               "memory that exists in the address space but cannot be read: typically a memory-mapped "
               "file (weights, safetensors) truncated under the process, or /dev/shm full"),
    "SIGABRT": ("aborted",
                "the process aborted itself: a failed C/C++ assertion, std::terminate or a fatal runtime "
                "error in native code (glibc, CUDA, NCCL, oneDNN); its log usually holds the reason"),
    "SIGFPE": ("arithmetic fault", "native code divided an integer by zero or hit a similar fault"),
    "SIGTERM": ("asked to stop", "an abort, the shutdown of its parent, or a scheduler's time limit"),
    "SIGINT": ("interrupted", "Ctrl-C, or a parent passing an interrupt on"),
    "SIGHUP": ("hang-up", "its terminal or SSH session closed"),
    "SIGPIPE": ("broken pipe", "it wrote to a pipe or socket nobody reads any more"),
}
#: vLLM's process names -> how a person calls them (rank k is added from the name)
_ENGINE_CORE = re.compile(r"^EngineCore", re.I)
_API_SERVER = re.compile(r"^(APIServer|api[_ ]server)", re.I)
_WORKER = re.compile(r"^(?:Vllm)?Worker(?:[-_](?:TP)?(\d+))?", re.I)


#: faulthandler's words for the fatal signals it catches ("Fatal Python error: Illegal instruction")
FAULTHANDLER_NAMES = {"Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Illegal instruction": "SIGILL",
                      "Aborted": "SIGABRT", "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE"}


def exit_code_of_fatal(message: str | None):
    """The exit code (``-N``) of a process whose faulthandler said ``message``; None when it names no signal."""
    name = FAULTHANDLER_NAMES.get((message or "").strip())
    return -int(getattr(signal, name)) if name and hasattr(signal, name) else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code, shell: bool = False) -> dict:
    """An exit code in words: ``{exit_code, signal, signum, short, meaning, text}``.

    :param code: ``-N`` for signal N (Python's convention), ``N >= 0`` for an exit;
        None while the process runs.
    :param shell: also read ``128 + N`` as signal N (a shell's convention).
    """
    out = {"exit_code": code, "signal": None, "signum": None, "short": None, "meaning": None}
    if code is None:
        out["text"] = "still running"
        return out
    code = int(code)
    signum = -code if code < 0 else code - 128 if shell and 128 < code < 128 + 65 else None
    if signum is None:
        out["text"] = "exited normally (code 0)" if code == 0 else f"exited with code {code}"
        return out
    name = signal_name(signum)
    short, meaning = MEANINGS.get(name, (None, None))
    out.update(signal=name, signum=signum, short=short, meaning=meaning,
               text=f"killed by {name}" + (f" ({short})" if short else ""))
    return out


def from_wait_status(status: int) -> int:
    """An ``os.waitpid`` status as Python's exit code (``-N`` for a signal)."""
    return os.waitstatus_to_exitcode(status)


def process_label(name: str | None, rank=None) -> tuple[str, int | None]:
    """``("rank 1", 1)``, ``("engine core", None)`` or ``("API server", None)`` for a vLLM process name."""
    name = name or ""
    if _ENGINE_CORE.match(name) and rank is None:  # an engine core that runs a rank (TP=1) is that rank
        return "engine core", None
    if _API_SERVER.match(name):
        return "API server", None
    found = _WORKER.match(name)
    if found or rank is not None:
        if rank is None:
            rank = int(found.group(1)) if found and found.group(1) else 0
        return f"rank {rank}", int(rank)
    return name or "a process", None


def oom_evidence(pid: int | None = None, max_bytes: int = 1 << 21) -> dict:
    """What the kernel tells of the OOM killer, cheaply: ``{readable, found, lines, cgroup_oom_kills, text}``.

    Reads the kernel log (``/dev/kmsg``, non-blocking, at most ``max_bytes``) for
    "Killed process <pid>" / "oom-kill" lines, and this process's cgroup v2
    ``memory.events`` for its ``oom_kill`` count. Either may be unreadable (no
    CAP_SYSLOG, no cgroup v2): ``readable`` says whether anything could be read.
    """
    lines, readable, sources = [], False, []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        fd = None
    if fd is not None:
        try:
            got = 0
            while got < max_bytes:
                try:
                    rec = os.read(fd, 8192)
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # a record overwritten while reading: go on
                        continue
                    readable = readable or exc.errno == errno.EAGAIN
                    break
                if not rec:
                    break
                readable = True
                got += len(rec)
                text = rec.decode("utf-8", "replace").split(";", 1)[-1].strip()
                if re.search(r"out of memory|oom-kill|oom_reaper|Killed process", text, re.I) and (
                        pid is None or f"process {pid} " in text or "oom-kill" in text.lower()):
                    lines.append(text)
            sources.append("kernel log")
        finally:
            os.close(fd)
    cgroup_kills = None
    try:
        with open("/proc/self/cgroup") as fh:
            rel = next((ln.split("::", 1)[1].strip() for ln in fh if ln.startswith("0::")), None)
        if rel is not None:
            with open(f"/sys/fs/cgroup{rel.rstrip('/')}/memory.events") as fh:
                events = dict(ln.split() for ln in fh if len(ln.split()) == 2)
            cgroup_kills = int(events.get("oom_kill", 0))
            readable = True
            sources.append("cgroup memory.events")
    except (OSError, ValueError, StopIteration):
        pass
    found = bool(lines) or bool(cgroup_kills)
    if not readable:
        text = "no OOM evidence readable here (the kernel log needs CAP_SYSLOG; no cgroup v2 memory.events)"
    elif found:
        shown = lines[-1] if lines else f"oom_kill={cgroup_kills} in this cgroup's memory.events"
        text = f"the OOM killer acted: {shown}"
    else:
        text = f"no OOM kill in the {' and '.join(sources)}: more likely a kill by someone"
    return {"readable": readable, "found": found, "lines": lines[-5:], "cgroup_oom_kills": cgroup_kills,
            "sources": sources, "text": text}


def death_record(process: str | None, exit_code, *, pid=None, rank=None, source: str | None = None,
                 fatal: dict | None = None) -> dict:
    """The run's error for a process that died: who (rank k / engine core / API server), how, what it means.

    :param process: vLLM's name of the process (``VllmWorker-1``, ``EngineCore_DP0``,
        ``APIServer``); ``rank`` wins over a rank read from the name.
    :param fatal: faulthandler's dump from the process's own log (``{message,
        traceback}``), kept as the traceback; the record's type is then ``FatalError``.
    """
    label, rank = process_label(process, rank)
    how = describe_exit(exit_code)
    who = ", ".join(str(x) for x in (process, f"pid {pid}" if pid else None) if x)
    head = f"{label} ({who})" if who and who != label else label
    if how["signal"]:
        message = f"{head} was {how['text']}: {how['meaning'] or 'no usual meaning known'}"
        etype = "KilledBySignal"
    elif exit_code is None:
        message = (f"{head} died unexpectedly; its parent logged no exit code and it left no fatal-error dump, "
                   f"so most likely SIGKILL (the kernel's OOM killer or a kill -9; a caught signal would "
                   f"have left one)")
        etype = "ProcessDied"
    else:
        message = f"{head} {how['text']}"
        etype = "ProcessExited"
    from remote.wire import status  # the run's error has one builder

    record = status.error(etype, message, rank=rank, where=label, process=process, pid=pid, exit_code=exit_code,
                          signal=how["signal"], signal_meaning=how["meaning"], source=source)
    if how["signal"] == "SIGKILL" or (exit_code is None and not fatal):
        oom = oom_evidence(pid)
        record["oom"] = oom
        record["message"] += f"; {oom['text']}"
    if fatal:
        record.update(type="FatalError", traceback=fatal.get("traceback") or "")
        record["message"] += f" (faulthandler: {fatal.get('message')})"
    return record


#: the line both vLLM versions log when a worker or engine core process vanished:
#: 0.16 "Worker proc VllmWorker-1 died unexpectedly, shutting down executor." (no code);
#: 0.32 adds "(exit code: -4)"; engine cores: "Engine core proc EngineCore_DP0 died unexpectedly".
DIED_RE = re.compile(r"(?P<kind>Worker|Engine core) proc (?P<name>[\w.-]+) died unexpectedly"
                     r"(?:\s*\(exit code:?\s*(?P<code>-?\d+|None)\))?")


def deaths_in_log(text: str) -> list[dict]:
    """Every "... proc X died unexpectedly (exit code: N)" line of a vLLM log: ``{name, exit_code, line}``."""
    found = []
    for line in text.splitlines():
        hit = DIED_RE.search(line)
        if hit:
            code = hit.group("code")
            found.append({"name": hit.group("name"), "exit_code": int(code) if code not in (None, "None") else None,
                          "line": line.strip()})
    return found
