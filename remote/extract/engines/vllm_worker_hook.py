"""Per-rank logs, faulthandler and root-cause capture inside vLLM's TP worker processes.

vLLM 0.16's ``MultiprocExecutor`` starts one process per rank
(``multiprocessing`` context ``Process(target=WorkerProc.worker_main, name="VllmWorker-<rank>")``,
usually with the *spawn* method), and those processes inherit the supervisor's stdout
and stderr. When one of them raises inside an RPC, vLLM logs the traceback in *that*
process and sends the driver only ``str(exc)``; when one fails at start-up the driver
sees only "WorkerProc initialization failed due to an exception in a background
process"; a rank whose peer died can also just hang in a collective.

:func:`install` (called in the supervisor before the executor starts) replaces
``WorkerProc.worker_main`` with :func:`worker_main` below. A spawned child unpickles
the target by name, imports this module (the bundle dir is on ``PYTHONPATH``), and
runs :func:`worker_main`, which, before handing over to vLLM's own ``worker_main``:

* points fds 1 and 2 at ``<run_dir>/logs/rank<k>.log`` (one file per TP rank; a data-parallel
  replica's ranks at ``logs/dp<i>/rank<k>.log``, and their errors under ``errors/dp<i>/``);
* enables ``faulthandler`` on that file (segfaults and aborts leave a stack), and
  ``SIGUSR1`` dumps every thread's stack there (for hangs);
* records the first exception this rank logs through vLLM's worker logger, or lets
  escape, as ``<run_dir>/errors/rank<k>.json`` (rank, type, message, traceback, time),
  which the supervisor reads to report the root cause instead of the generic message;
* passes the rank to its fault point (:mod:`remote.run.faults`: a test's ``inject_failure``).

Stdlib only at import: this module is imported in every worker before vLLM runs.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
import traceback

from remote.run import faults
from remote.wire import fsutil, status

ENV_RUN_DIR = "SPECOPS_RUN_DIR"
#: a data-parallel replica's name (``dp1``) in its process and its ranks: their logs and errors go in
#: ``logs/dp1/`` and ``errors/dp1/`` (:mod:`remote.extract.engines.replicas`)
ENV_REPLICA = "SPECOPS_REPLICA"
#: vLLM's logger that reports worker exceptions ("WorkerProc hit an exception." ...).
WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"

_original_worker_main = None


def install() -> None:
    """Route vLLM workers through :func:`worker_main` (idempotent; call before the executor starts)."""
    global _original_worker_main
    from vllm.v1.executor import multiproc_executor as mpe

    current = mpe.WorkerProc.__dict__["worker_main"].__func__
    if current is worker_main:
        return
    # Kept for fork-started workers, which inherit the patched class.
    _original_worker_main = current
    mpe.WorkerProc.worker_main = staticmethod(worker_main)


def worker_main(*args, **kwargs):
    """Set up this rank's log, faulthandler and error capture, then run vLLM's worker."""
    rank = int(kwargs.get("rank", 0))
    run_dir = os.environ.get(ENV_RUN_DIR)
    if run_dir:
        replica = os.environ.get(ENV_REPLICA) or ""
        _redirect_output(os.path.join(run_dir, "logs", replica, f"rank{rank}.log"))
        recorder = ErrorRecorder(os.path.join(run_dir, "errors", replica), rank)
        handler = _RecordingHandler(recorder)
        logging.getLogger(WORKER_LOGGER).addHandler(handler)
    else:
        recorder = None
    faults.rank_starts(rank)  # a test's inject_failure for this rank (remote/run/faults.py)
    original = _original_worker_main
    if original is None:
        from vllm.v1.executor import multiproc_executor as mpe

        original = mpe.WorkerProc.__dict__["worker_main"].__func__
        if original is worker_main:  # pragma: no cover - defensive
            raise RuntimeError("vLLM worker hook installed twice; the original worker_main is lost")
    try:
        return original(*args, **kwargs)
    except SystemExit:
        raise
    except BaseException as exc:
        if recorder is not None:
            recorder.record_exception(type(exc), exc, exc.__traceback__, "escaped worker_main")
        raise


class ErrorRecorder:
    """Write this rank's first error to ``errors/rank<k>.json`` (later ones are ignored)."""

    def __init__(self, errors_dir: str, rank: int):
        self.path = os.path.join(errors_dir, f"rank{rank}.json")
        self.rank = rank
        os.makedirs(errors_dir, exist_ok=True)

    def record_exception(self, etype, value, tb, where: str) -> None:
        if os.path.exists(self.path):
            return
        text = "".join(traceback.format_exception(etype, value, tb))
        self.write(status.error(etype.__name__, str(value) or repr(value), rank=self.rank, traceback=text,
                                where=where, pid=os.getpid(), time=time.time()))

    def write(self, record: dict) -> None:
        fsutil.write_json(self.path, record)  # atomic: the supervisor may read it any moment


class _RecordingHandler(logging.Handler):
    """Catches ``logger.exception(...)`` records of vLLM's worker logger."""

    def __init__(self, recorder: ErrorRecorder):
        super().__init__(level=logging.ERROR)
        self.recorder = recorder

    def emit(self, record) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            try:
                self.recorder.record_exception(*record.exc_info, where=record.getMessage())
            except Exception:  # never let error capture break the worker
                pass


_log_file = None  # kept open for faulthandler for the life of the process


def _redirect_output(path: str) -> None:
    global _log_file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    _log_file = open(path, "a", buffering=1)
    os.dup2(_log_file.fileno(), 1)
    os.dup2(_log_file.fileno(), 2)
    faulthandler.enable(file=_log_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_log_file, all_threads=True)
    import multiprocessing

    # root_cause reads who this is from here when the process dies before its parent saw it
    print(f"[specops] rank log of pid {os.getpid()} ({multiprocessing.current_process().name}) started "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}", flush=True)
