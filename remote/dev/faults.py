"""What an armed fault point (``remote/run/faults.py``) does: raise or pause where a test said.

Kept in the checkout with the other development tools: no wheel holds it, and only a bundle
built from a checkout carries it (``specops/transport/bundle.py``), so tests reach it on their hosts.
"""
from __future__ import annotations

import threading
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


class StateSwap:
    """``swap_sample_states`` ``[i, j]``: samples i and j land with each other's states.

    Each landing thread hands in its file's path and waits for the other's; the second
    to arrive rewrites both files (their first ``min(T_i, T_j)`` positions of every layer
    exchanged, each file's ``input_ids`` its own), so the shapes and the ids echo still
    pass and only a check of the states themselves can tell.
    """

    def __init__(self, pair, timeout: float = 600.0):
        if len(pair) != 2 or pair[0] == pair[1]:
            raise ValueError(f"swap_sample_states must name two different samples, got {pair!r}")
        self.pair = [int(i) for i in pair]
        self.timeout = timeout
        self.paths: dict = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def landed(self, index: int, path: str) -> None:
        if index not in self.pair:
            return
        with self.lock:
            self.paths[index] = path
            both = len(self.paths) == 2
        if both:
            try:
                _exchange_states(*(self.paths[i] for i in self.pair))
            finally:
                self.done.set()
        elif not self.done.wait(self.timeout):
            raise InjectedFailure(f"swap_sample_states: sample {self.pair} never both landed")


def _exchange_states(path_a: str, path_b: str) -> None:
    from safetensors.torch import load_file, save_file

    from remote.wire import contract

    a, b = load_file(path_a), load_file(path_b)
    n = min(a["hidden_states"].shape[0], b["hidden_states"].shape[0])
    for key in ("hidden_states", contract.FP8_SCALES_KEY):  # fp8 scales travel with their states
        if key in a and key in b:
            head = a[key][:n].clone()
            a[key][:n] = b[key][:n]
            b[key][:n] = head
    save_file(a, path_a)
    save_file(b, path_b)
