"""The supervisor's own process group: stop what is left of a run, from inside it (stdlib only).

``job start`` makes the supervisor a session leader, so its process group is the run's
workers, their resource tracker and whatever they started; nothing outside it is touched.
From outside the run, :func:`remote.run.rundir.kill_run_processes` finds the run's processes
by their environment instead.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from remote.system import procscan


def kill_own_group_and_exit(code: int) -> None:
    """Stop every process of this run (workers included) and exit, without touching others.

    Only when this supervisor leads its own process group (``job start`` makes it a
    session leader); otherwise just its child processes are killed.
    """
    try:
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(code)


def group_members() -> list[int]:
    """Other live processes of this supervisor's process group (workers, resource tracker)."""
    return procscan.live_pids(pgrp=os.getpid())


def stop_leftovers(grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, whatever of this run is still running besides us.

    A worker that is still loading when its peer failed does not notice that the driver
    is gone until it finishes; it must not outlive the run. Only this supervisor's own
    process group is touched (it leads one when started by ``job start``); otherwise
    only its multiprocessing children.
    """
    if os.getpgid(0) != os.getpid():
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
        return []
    left = group_members()
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    # a process that ignores SIGTERM (multiprocessing's resource tracker does) is not waited for
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and [pid for pid in group_members() if not procscan.ignores(pid, signal.SIGTERM)]:
        time.sleep(0.1)
    for pid in group_members():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
