"""What an armed fault point (``remote/faults.py``) does: raise or pause where a test said.

Kept in the checkout with the other development tools: no wheel holds it, and only a bundle
built from a checkout carries it (``specops/bundle.py``), so tests reach it on their hosts.
"""
from __future__ import annotations

import time


class InjectedFailure(RuntimeError):
    """Raised on purpose by a test hook (never in a real run)."""


def raise_at(spec: dict, at: str, rank: int) -> None:
    """``inject_failure`` in an in-process engine: raise at ``spec["at"]`` on ``spec["rank"]``."""
    if spec.get("at") == at and int(spec.get("rank", 0)) == rank:
        raise InjectedFailure(spec.get("message") or f"injected failure at {at} on rank {rank}")


def arm_vllm_worker(spec: dict, rank: int) -> None:
    """``inject_failure`` in a vLLM worker: make this rank raise inside vLLM's own code path."""
    if int(spec.get("rank", 0)) != rank:
        return
    at = spec.get("at")
    if at not in ("load", "extract"):  # a rank's hard death (a signal) is tested by sending one
        raise ValueError(f"inject_failure.at must be 'load' or 'extract', got {at!r}")
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    message = spec.get("message") or f"injected failure at {at} on rank {rank}"

    def fail(self, *args, **kwargs):
        raise InjectedFailure(message)

    # WorkerProc.__init__ calls wrapper.load_model() (normally delegated via __getattr__)
    setattr(WorkerWrapperBase, "load_model" if at == "load" else "execute_model", fail)


def fail_after_files(written: int, fail_after: int) -> None:
    """``inject_failure_after``: fail the patcher's transaction once this many files are written."""
    if written >= fail_after:
        raise InjectedFailure(f"injected failure after {written} file(s)")


def hold(seconds: float) -> None:
    """``hold_lock_s``: keep the patcher's lock this long after its action."""
    time.sleep(seconds)
