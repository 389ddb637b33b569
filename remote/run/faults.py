"""Fault points: the named places where a test makes a host task fail or pause on purpose.

A real run arms none. Tests arm them with the declared test-hook parameters
(:mod:`remote.wire.argspec`, ``hook=True``: ``inject_failure``, ``batch_delay_s``,
``inject_failure_after``, ``hold_lock_s``, ``swap_sample_states``) or a job's env (``SPECOPS_BATCH_DELAY_S``,
``SPECOPS_STOPPED_GRACE_S``).
What an armed point does lives in ``remote/dev/faults.py``, which no wheel holds: a host
task sent by an installed program refuses an armed point by name instead of ignoring it.

Product code calls the points below; each is one cheap check when nothing is armed.
Stdlib only: :func:`rank_starts` runs in every vLLM worker before vLLM is imported.
"""
from __future__ import annotations

import json
import os

#: the job's env carries ``inject_failure`` to the engine's worker processes
ENV_INJECT = "SPECOPS_INJECT_FAILURE"
#: a pause after each batch, set in a run's ``env`` (a resume need not repeat it)
ENV_BATCH_DELAY = "SPECOPS_BATCH_DELAY_S"
#: the test host's CPU hidden-states connector corrupts the n-th file it writes (``{"n": "nonfinite"|"ids"}``,
#: JSON): a streamed sample that fails the online trainer's checks (``specops/testhost/cpu_hidden_states_connector``)
ENV_STREAM_FAULT = "SPECOPS_STREAM_FAULT"
#: seconds a replica's stopped rank is held before the run fails, shorter than the product's wait (a test that
#: stops ranks on purpose need not sit through it): ``remote.extract.replica.STOPPED_GRACE_S``
ENV_STOPPED_GRACE = "SPECOPS_STOPPED_GRACE_S"
#: fault points armed in a run's ``env`` that are not part of what the run is
ENV_FAULTS = (ENV_BATCH_DELAY, ENV_STREAM_FAULT, ENV_STOPPED_GRACE)


def _behaviour():
    try:
        from remote.dev import faults
    except ImportError as exc:
        raise RuntimeError("a test hook is armed, but this program's bundle has no remote/dev/faults.py: "
                           "test hooks run from a source checkout, not an installed wheel") from exc
    return faults


def job_env(params: dict, env: dict) -> None:
    """Pass the job's ``inject_failure`` (if any) to its supervisor and every rank it starts."""
    if params.get("inject_failure"):
        env[ENV_INJECT] = json.dumps(params["inject_failure"])
    else:
        env.pop(ENV_INJECT, None)


def rank_starts(rank: int) -> None:
    """In a vLLM worker process before vLLM's own ``worker_main``: arm ``inject_failure`` for this rank."""
    raw = os.environ.get(ENV_INJECT)
    if raw:
        _behaviour().arm_vllm_worker(json.loads(raw), rank)


def engine_step(params: dict, at: str, rank: int = 0) -> None:
    """In an in-process engine at ``load`` / ``extract``: raise there when ``inject_failure`` says so."""
    spec = params.get("inject_failure")
    if spec:
        _behaviour().raise_at(spec, at, rank)


def swapped_states(params: dict) -> object | None:
    """``swap_sample_states`` armed: the exchange both samples' landing threads meet at (None when unarmed)."""
    pair = params.get("swap_sample_states")
    return _behaviour().StateSwap(pair) if pair else None


def resumable_as(params: dict) -> dict:
    """A run's recorded parameters as a resume compares them: a fault point armed in the run's ``env`` (the
    batch pause, a corrupted streamed sample) is not part of what the run is, so a resume need not repeat it."""
    env = params.get("env")
    if not isinstance(env, dict) or not set(ENV_FAULTS) & set(env):
        return params
    env = {k: v for k, v in env.items() if k not in ENV_FAULTS}
    return {**params, "env": env} if env else {k: v for k, v in params.items() if k != "env"}


def batch_delay_s(params: dict) -> float:
    """Seconds to pause after each batch (``batch_delay_s``, else the job's env); 0 when unarmed."""
    delay = float(params.get("batch_delay_s") or os.environ.get(ENV_BATCH_DELAY) or 0)
    if delay:
        _behaviour()
    return delay


def stopped_grace_s(default: float) -> float:
    """Seconds a stopped rank is held before its replica is lost: the job's env's, else ``default``."""
    raw = os.environ.get(ENV_STOPPED_GRACE)
    if raw:
        _behaviour()
        return float(raw)
    return default


def file_written(count: int, fail_after) -> None:
    """In the patcher's transaction before each file: fail once ``fail_after`` files are written."""
    if fail_after is not None:
        _behaviour().fail_after_files(count, int(fail_after))


def lock_held(hold_s) -> None:
    """In the patcher, still under its lock: keep it ``hold_s`` seconds (a second run must be refused)."""
    if hold_s:
        _behaviour().hold(float(hold_s))
