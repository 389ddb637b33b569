"""Run one step on many hosts at once; every host ends with a report, never a crash, never a wait forever.

Like fabric's ``GroupResult``, a host that cannot be reached is a result
(``HostReport.error``), not an exception that hides the other hosts. Each host's step
is bounded by a timeout: a host that hangs (a stuck mount, a silent network) is
reported as such when its time is up, its connection is closed, and the other hosts'
results come back without waiting for it.

(The group extraction built on this -- one run sharded over many hosts -- is
:mod:`specops.runs`.)
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Callable

from specops.errors import SpecopsError, UsageError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.result import HostReport, Record
from specops.transport.host import Host
from specops.transport.pool import HostPool

#: at most this many hosts are worked on at once (fabric's ThreadingGroup has no cap).
MAX_PARALLEL = int(os.environ.get("SPECOPS_MAX_PARALLEL", "16"))
#: per task, the longest one host's step may take before that host is reported as hung
#: (seconds). Generous: a preflight's AutoConfig child has 60 s of its own. ``quick`` is a
#: group run's short steps on one shard (start a job, look at it, abort it, read its logs,
#: list its files). Tasks not named here (smoke, verify, extract, fetch) are long by nature
#: and bound themselves (their own run timeouts, a follow's silence limit, a download's idle
#: limit).
TASK_TIMEOUTS = {"facts": 120.0, "preflight": 600.0, "patch": 600.0, "status": 120.0, "abort": 120.0,
                 "quick": 180.0}
#: ``SPECOPS_STEP_TIMEOUT=<seconds>`` replaces every limit of :data:`TASK_TIMEOUTS` (a slow
#: link, or a test that wants a hung host reported sooner); the steps that bound themselves
#: stay unbounded here. Its one reader is :func:`step_timeout`.
STEP_TIMEOUT_ENV = "SPECOPS_STEP_TIMEOUT"


def step_timeout(task: str) -> float:
    """``task``'s per-host limit in seconds (0: none): :data:`TASK_TIMEOUTS`, or :data:`STEP_TIMEOUT_ENV`.

    :raises UsageError: ``SPECOPS_STEP_TIMEOUT`` is set to something other than a positive number.
    """
    limit = TASK_TIMEOUTS.get(task, 0.0)
    text = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
    if not text or not limit:
        return limit
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError(f"{STEP_TIMEOUT_ENV}={text!r} is not a number of seconds",
                         f"set {STEP_TIMEOUT_ENV} to a positive number (e.g. 300), or unset it")
    return seconds


def report_from_payload(host: str, task: str, payload: dict) -> HostReport:
    return HostReport(host=host, task=task, records=[Record(**r) for r in payload.get("records", [])],
                      data=payload.get("data", {}))


def timed_out_report(host: str, task: str, seconds: float) -> HostReport:
    """The report of a host whose step did not end in time."""
    return HostReport(host=host, task=task, error_code=int(ExitCode.UNREACHABLE),
                      error=f"no answer within {seconds:g}s (the host hangs, or the step is slower than the "
                            f"limit); the other hosts went on without it. Set SPECOPS_STEP_TIMEOUT (seconds) "
                            f"higher if it is only slow")


def run_steps(items: list, step: Callable[[object], HostReport], *, name_of: Callable[[object], str],
              task: str, timeout: float | None = None, on_timeout: Callable[[object], None] | None = None
              ) -> list[HostReport]:
    """``step(item)`` for every item in parallel (at most :data:`MAX_PARALLEL` at once), in order.

    Each item gets at most ``timeout`` seconds (None: :func:`step_timeout` of ``task``;
    0: no limit) from the moment its step starts. An item still running then gets a
    :func:`timed_out_report` and ``on_timeout(item)`` (close its connection, so the
    stuck thread ends); the caller never waits for it. Steps run on daemon threads, so a
    hung one cannot keep the program from exiting either.
    """
    limit = step_timeout(task) if timeout is None else timeout
    results: list[HostReport | None] = [None] * len(items)
    started: list[float | None] = [None] * len(items)
    done = [threading.Event() for _ in items]
    slots = threading.Semaphore(max(1, MAX_PARALLEL))

    def one(i: int, item) -> None:
        with slots:
            started[i] = time.monotonic()
            try:
                report = step(item)
            except SpecopsError as exc:
                report = HostReport(host=name_of(item), task=task, error=str(exc), error_code=int(exc.code))
            except Exception as exc:  # a bug of ours: keep the traceback, go on with other hosts
                report = HostReport(host=name_of(item), task=task, error_code=int(ExitCode.INTERNAL),
                                    error=f"internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if results[i] is None:  # a report given after the deadline is dropped: the timeout was said
                results[i] = report
            done[i].set()

    for i, item in enumerate(items):
        threading.Thread(target=one, args=(i, item), daemon=True, name=f"{task}-{name_of(item)}").start()
    for i, item in enumerate(items):
        while not done[i].is_set():
            if limit and started[i] is not None and time.monotonic() - started[i] > limit:
                results[i] = timed_out_report(name_of(item), task, limit)
                done[i].set()
                if on_timeout is not None:
                    try:
                        on_timeout(item)
                    except Exception:  # closing a dead connection may fail; the report already says it
                        pass
                break
            done[i].wait(0.2)
    return [r for r in results if r is not None]


def run_on_hosts(inventory: Inventory, selector: str | None, task: str,
                 step: Callable[[Host], HostReport], accept_new_host_key: bool = False,
                 timeout: float | None = None) -> list[HostReport]:
    """Call ``step(host)`` for every selected host in parallel, in inventory order.

    :param timeout: seconds one host's step may take (default: :func:`step_timeout` of ``task``).
    """
    hosts = HostPool(inventory, accept_new_host_key).selected(selector)

    def one(host: Host) -> HostReport:
        try:
            return step(host)
        finally:
            host.close()

    return run_steps(hosts, one, name_of=lambda h: h.name, task=task, timeout=timeout,
                     on_timeout=lambda h: h.close())
