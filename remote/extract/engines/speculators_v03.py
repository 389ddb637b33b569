"""The speculators 0.3.0 in-process generator as an engine (``speculators-0.3``).

Wraps the real ``speculators.data_generation.VllmHiddenStatesGenerator``: it builds a
vLLM ``MultiprocExecutor`` with one worker process per TP rank, patches the model's
forward in the workers, and captures the OUTPUT of the 0-based layer ids (``output``
convention, ``remote/wire/layers.py``) during prefill. On vLLM >= 0.12 the package must be
patched first (``fab patch``; patches/speculators-0.3.0_vllm-0.12-0.16/); the engine
says so when the constructor fails on an unpatched copy.

Before the executor starts, :func:`remote.extract.engines.vllm_worker_hook.install` routes
every worker through our hook, so each rank writes ``logs/rank<k>.log`` and records
its own exception in ``errors/rank<k>.json`` (the supervisor reports that, not the
driver's generic "Worker failed with error ..."), and ``inject_failure`` can make one
rank fail inside vLLM's own code path.

The supervisor is the parent of the rank processes here, so the engine watches them
itself (:class:`WorkerWatch`): each one's death time and exit code (``-4`` = SIGILL)
come from ``waitpid``, and :meth:`SpeculatorsV03Engine.process_deaths` hands them to the
root-cause reader; vLLM 0.16 itself only logs "Worker proc VllmWorker-1 died
unexpectedly" and the driver raises ``RuntimeError: cancelled``.

With ``dp > 1`` (the supervisor's ``replica_sets``, :mod:`remote.extract.layout`) this engine runs
in none of those ways itself: it starts one process per device set, each building this engine
on its own devices (:mod:`remote.extract.engines.replicas`), and splits every batch among them.

The generator returns layers in ascending id order (the worker walks the layers in
order); this engine hands them back in the order of ``layer_ids``. Every sample is
checked to come back whole (same token ids, one row per token).
"""
from __future__ import annotations

import os
import threading
import time

from remote.run import faults
from remote.system import cpu, modelconfig
from remote.wire.contract import SPECULATORS_03

from . import Engine

#: the warm-up prompt: ids every vocabulary has
WARMUP_IDS = list(range(1, 9))


class SpeculatorsV03Engine(Engine):
    name = SPECULATORS_03
    #: data-parallel replicas this engine computes on (each a process of its own when more than one)
    dp = 1
    replicas = None

    def load(self) -> None:
        sets = self.params.get("replica_sets") or []
        if len(sets) > 1:
            self._load_replicas(sets)
            return
        from remote.extract.engines import vllm_worker_hook

        faults.job_env(self.params, os.environ)  # its ranks read it (a run outside a job too)
        vllm_worker_hook.install()
        self.watch = WorkerWatch.install()
        if str(self.params.get("device") or "").lower() == "cpu":
            # an AMX CPU: this process and every rank it spawns ask Linux for AMX tile state (remote/system/cpu.py)
            os.environ.update(cpu.amx_env(dict(os.environ)))
            cpu.request_amx_permission()
            # vLLM 0.16's ranks spin (sched_yield) on their shared-memory queue while idle: on a
            # CPU host that is a core per rank taken from the next step's compute (and from
            # anything else on the host) whenever the driver is busy elsewhere. After 3 s idle
            # they poll every 0.1 s instead; a step that keeps them busy is unchanged.
            os.environ.setdefault(cpu.IDLE_SLEEP_ENV, "1")

        import speculators.data_generation.vllm_hidden_states_generator as gen_module

        self.generator_file = gen_module.__file__
        self.patched = _is_patched(self.generator_file)
        self.max_model_len = self._max_model_len()
        try:
            self.generator = gen_module.VllmHiddenStatesGenerator(
                model_path=self.model_path,
                layer_ids=sorted(self.layer_ids),
                max_model_len=self.max_model_len,
                gpu_memory_utilization=float(self.params.get("gpu_memory_utilization") or 0.8),
                tensor_parallel_size=self.tp,
            )
        except Exception as exc:
            if not self.patched:
                raise RuntimeError(
                    f"speculators 0.3.0 at {self.generator_file} is not patched for this vLLM "
                    f"({type(exc).__name__}: {exc}); run `fab patch` on this host first"
                ) from exc
            raise
        # ascending capture order -> position of each requested id
        order = sorted(self.layer_ids)
        self._pick = [order.index(lid) for lid in self.layer_ids]
        # One short prompt through the whole capture path while still "loading": a broken
        # capture (unpatched hook, wrong layer ids) fails here, before any sample, and the
        # first batch of the run does not pay the engine's first-call set-up.
        self.generator.generate([WARMUP_IDS])

    def _load_replicas(self, sets) -> None:
        """One replica process per device set (:class:`~.replicas.Replicas`), every one loaded."""
        from .replicas import Replicas

        params = {k: v for k, v in self.params.items() if k != "replica_sets"}
        self.dp = len(sets)
        self.replicas = Replicas(self.name, self.model_path, self.tp, self.layer_ids, params, self.plan, sets)
        self.replicas.start()
        try:
            # as one replica's load, no time limit unless the run sets one
            timeout = self.params.get("ready_timeout_s")
            self.replicas.wait_ready(float(timeout) if timeout else None)
        except BaseException:
            self.replicas.close(float(self.params.get("stop_grace_s") or 20.0))
            raise
        first = self.replicas.ready[0]["describe"]
        self.generator_file, self.patched = first.get("generator_file"), first.get("patched")
        self.max_model_len = first.get("max_model_len")

    def _max_model_len(self) -> int:
        try:
            cfg = modelconfig.read(self.model_path)
        except modelconfig.ConfigError:
            cfg = {}
        return self.model_len(cfg)

    def extract(self, batch):
        if self.replicas is not None:
            return self.replicas.extract(batch)
        results = self.generator.generate([list(ids) for ids in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"generator returned {len(results)} results for {len(batch)} prompts")
        out = []
        for j, (ids, result) in enumerate(zip(batch, results)):
            got = result["input_ids"].tolist()
            if got != list(ids):
                raise RuntimeError(
                    f"batch item {j}: the generator ran {len(got)} tokens for a {len(ids)}-token "
                    f"sample (max_model_len {self.max_model_len}); lower seq_len below the model's "
                    f"max_position_embeddings")
            layer_states = result["hidden_states"]
            if len(layer_states) != len(self.layer_ids):
                raise RuntimeError(f"batch item {j}: {len(layer_states)} layers captured, asked for "
                                   f"{len(self.layer_ids)} ({sorted(self.layer_ids)})")
            out.append([layer_states[k] for k in self._pick])
        return out

    def close(self) -> None:
        if self.replicas is not None:
            # an aborted run stops them sooner (the supervisor sets stop_grace_s)
            self.replicas.close(float(self.params.get("stop_grace_s") or 20.0))
            return
        generator = getattr(self, "generator", None)
        self.generator = None
        if generator is not None and hasattr(generator, "executor"):
            executor = generator.executor
            del generator.executor  # its __del__ would shut down a second time
            executor.shutdown()

    def process_deaths(self) -> list[dict]:
        """Rank processes that ended, first death first (see :class:`WorkerWatch`)."""
        watch = getattr(self, "watch", None)
        return watch.deaths() if watch is not None else []

    def error_record(self, exc: BaseException) -> dict | None:
        """A replica's own root cause, named ``dp<i>`` (:func:`~.replicas.replica_error`)."""
        from .replicas import ReplicaFailed

        return exc.record if isinstance(exc, ReplicaFailed) else None

    def describe(self) -> dict:
        replicas = self.replicas
        return {"name": self.name, "tp": self.tp, "generator_file": getattr(self, "generator_file", None),
                "patched": getattr(self, "patched", None),
                "max_model_len": getattr(self, "max_model_len", None),
                # data-parallel replicas (dp > 1): each one's devices, samples and log; the ones lost on the way
                # (the vllm-server engine's keys, so status, fetch and verify read both alike)
                "dp": self.dp,
                "replicas": replicas.describe() if replicas is not None else None,
                "replicas_lost": (replicas.lost or None) if replicas is not None else None}


class WorkerWatch:
    """Every vLLM rank process this process starts, and when and how each one ended.

    Wraps ``WorkerProc.make_worker_process`` (0.16: it returns a handle whose ``proc``
    is the ``multiprocessing`` process ``VllmWorker-<rank>``), so workers are known from
    their start, a death during the load included. A thread per worker waits on its
    sentinel (a pipe: it neither reaps nor disturbs vLLM's own monitor) and stamps the
    time of death; the exit code is read later from the process object (``waitpid``).
    """

    _installed: "WorkerWatch | None" = None

    def __init__(self):
        self.procs: list[tuple[int, object]] = []
        self.died_at: dict[int, float] = {}
        self.lock = threading.Lock()

    @classmethod
    def install(cls) -> "WorkerWatch":
        if cls._installed is not None:
            return cls._installed
        from vllm.v1.executor import multiproc_executor as mpe

        watch = cls._installed = cls()
        original = mpe.WorkerProc.__dict__["make_worker_process"].__func__

        def make_worker_process(*args, **kwargs):
            handle = original(*args, **kwargs)
            watch.add(int(getattr(handle, "rank", kwargs.get("rank", len(watch.procs)))), handle.proc)
            return handle

        mpe.WorkerProc.make_worker_process = staticmethod(make_worker_process)
        return watch

    def add(self, rank: int, proc) -> None:
        with self.lock:
            self.procs.append((rank, proc))
        threading.Thread(target=self._wait, args=(id(proc), proc), daemon=True,
                         name=f"specops-watch-rank{rank}").start()

    def _wait(self, key: int, proc) -> None:
        import multiprocessing.connection

        try:
            multiprocessing.connection.wait([proc.sentinel])
        except (OSError, ValueError):
            return
        with self.lock:
            self.died_at.setdefault(key, time.time())

    def deaths(self) -> list[dict]:
        """``{name, rank, pid, exit_code, died_at}`` of every worker that ended, earliest first."""
        out = []
        with self.lock:
            procs, died_at = list(self.procs), dict(self.died_at)
        for rank, proc in procs:
            if id(proc) not in died_at:
                try:  # ended, but its watch thread has not stamped it yet (two ranks dying at once)
                    if proc.exitcode is None:
                        continue
                except ValueError:
                    continue
                died_at[id(proc)] = time.time()
            try:
                code = proc.exitcode
                if code is None:  # ended, not yet reaped by anyone: waitpid it now
                    proc.join(2)
                    code = proc.exitcode
            except ValueError:  # the process object was closed
                code = None
            out.append({"name": proc.name, "rank": rank, "pid": proc.pid, "exit_code": code,
                        "died_at": died_at[id(proc)], "source": "waitpid"})
        return sorted(out, key=lambda d: d["died_at"])


def _is_patched(path: str) -> bool:
    """The patch set marks every hunk with ``specops``; a pristine 0.3.0 file has none."""
    try:
        with open(path) as fh:
            return "specops" in fh.read()
    except OSError:
        return False
