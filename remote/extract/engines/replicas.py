"""Data-parallel replicas of an in-process engine: one child process per device set.

The seed stack's generator (speculators 0.3) computes in the process that builds it and has no server,
so on a host whose layout holds ``dp > 1`` replicas (:mod:`remote.extract.layout`) the engine starts one
process per device set (:class:`Replicas`). Each is spawned (a fresh interpreter), takes its devices
before torch or vLLM loads (:func:`remote.extract.layout.device_env`: ``CUDA_VISIBLE_DEVICES`` with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` on a GPU host, its slice of the cores on a CPU host, the one writer
the vllm-server engine's servers read too), builds the engine there and answers batches over a pipe.
Its output goes to ``logs/dp<i>/replica.log``, its ranks' to ``logs/dp<i>/rank<k>.log`` and their
errors to ``errors/dp<i>/`` (:mod:`remote.extract.engines.vllm_worker_hook`); a failure comes back
as the replica's own root cause (:func:`remote.run.rootcause.root_cause` over its dirs), named
``dp<i>`` (:func:`replica_error`).

How the rows are split: each supervisor batch (``batch_size`` x dp samples) is cut into dp
contiguous parts, one per replica, sent at once and gathered in order. Every sample index goes to
exactly one replica by construction, each replica runs batches of ``batch_size`` as a one-replica
run does (the same batch composition: the same states), and the supervisor checks, writes and
resumes exactly as for one replica (files, names and manifest unchanged). The price is that the
faster replica waits for the slower one at the end of each batch, small on equal devices with
batches of similar token counts. A dynamic queue would hand the
supervisor's writer batches out of order and leave gaps to resume around, for nothing on equal devices.

A replica that dies (or raises) fails the run naming it; with ``on_replica_loss: continue`` and
another replica alive, its part goes to the others, the log says so and ``describe()`` lists it in
``replicas_lost``. A replica's process dies with its parent (``PR_SET_PDEATHSIG``), so a dead
supervisor leaves none; its ranks are in the supervisor's process group, which abort and the
supervisor's own end stop (:mod:`remote.system.procgroup`).

Stdlib only at import; the child imports torch (to pass states as bytes) and the engine.
"""
from __future__ import annotations

import ctypes
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

#: the replica process's own log, beside its ranks' (``logs/dp<i>/``)
REPLICA_LOG = "replica.log"
#: how long a replica's worker error may go unanswered by its driver (as the supervisor's watchdog)
WORKER_ERROR_GRACE_S = 20.0
PR_SET_PDEATHSIG = 1


class ReplicaFailed(RuntimeError):
    """A replica raised or died; ``record`` is its root cause (:mod:`remote.wire.status` error shape),
    already named for the replica (:func:`replica_error`)."""

    def __init__(self, replica: str, record: dict):
        super().__init__(record.get("message") or f"{replica} failed")
        self.replica = replica
        self.record = record


def replica_error(replica: str, record: dict) -> dict:
    """``record`` (a replica's own error, as its process saw it) named for the run: its message starts with
    ``dp<i>: ``, ``where`` is ``dp<i>/rank<j>`` (or ``dp<i>/<where>``), its sources lie under the replica's dirs.

    >>> r = replica_error("dp1", {"type": "E", "message": "boom", "rank": 0, "source": "errors/rank0.json"})
    >>> r["message"], r["where"], r["source"], r["replica"]
    ('dp1: boom', 'dp1/rank0', 'errors/dp1/rank0.json', 'dp1')
    >>> replica_error("dp0", {"type": "E", "message": "x", "rank": None, "where": "replica process"})["where"]
    'dp0/replica process'
    """
    out = dict(record)
    message = str(out.get("message") or "")
    out["message"] = message if message.startswith(f"{replica}: ") else f"{replica}: {message}"
    rank = out.get("rank")
    out["where"] = f"{replica}/rank{rank}" if rank is not None else f"{replica}/{out.get('where') or 'replica'}"
    for key in ("source",):
        value = out.get(key)
        if isinstance(value, str) and value.split("/", 1)[0] in ("errors", "logs") and "/" in value:
            head, rest = value.split("/", 1)
            out[key] = f"{head}/{replica}/{rest}"
    out["replica"] = replica
    return out


def split_parts(batch: list, ways: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``ways`` contiguous parts of ``batch`` as equal in count as can be (the first ones
    one longer): every index in exactly one part, none empty; fewer parts than ``ways`` for a shorter batch.

    >>> split_parts(list(range(6)), 2)
    [(0, 3), (3, 6)]
    >>> split_parts(list(range(5)), 2)
    [(0, 3), (3, 5)]
    >>> split_parts([0], 2)
    [(0, 1)]
    """
    n = len(batch)
    ways = max(1, min(ways, n))
    bounds = [0]
    for k in range(ways):
        bounds.append(bounds[-1] + n // ways + (1 if k < n % ways else 0))
    return list(zip(bounds, bounds[1:]))


class Replicas:
    """The parent's side: ``dp`` replica processes of ``engine_name``, one per device set.

    :param sets: each replica's device ids (:attr:`remote.extract.layout.Layout.sets`).
    :param params: the run's params as the engine sees them (without ``replica_sets``).
    """

    def __init__(self, engine_name: str, model_path: str, tp: int, layer_ids, params: dict, plan, sets):
        self.engine_name, self.model_path, self.tp = engine_name, str(model_path), int(tp)
        self.layer_ids, self.params, self.plan = list(layer_ids), dict(params), plan
        self.sets = [list(s) for s in sets]
        self.names = [f"dp{i}" for i in range(len(self.sets))]
        self.run_dir = Path(os.environ.get("SPECOPS_RUN_DIR") or params.get("work_dir") or ".")
        self.procs: list = []
        self.conns: list = []
        self.ready: list[dict | None] = [None] * len(self.sets)
        self.samples = [0] * len(self.sets)
        self.lost: list[dict] = []

    # -- life cycle
    def start(self) -> None:
        """Spawn every replica (they load at once); from the main thread (their death signal follows it)."""
        ctx = multiprocessing.get_context("spawn")
        for i, (name, devices) in enumerate(zip(self.names, self.sets)):
            parent, child = ctx.Pipe()
            spec = {"name": name, "devices": devices, "engine": self.engine_name, "model_path": self.model_path,
                    "tp": self.tp, "layer_ids": self.layer_ids, "params": self.params, "plan": self.plan,
                    "run_dir": str(self.run_dir), "on_cpu": str(self.params.get("device") or "") == "cpu",
                    "parent_pid": os.getpid()}
            # non-daemonic: a replica's engine starts rank processes of its own
            proc = ctx.Process(target=replica_main, args=(child, spec), name=f"specops-{name}", daemon=False)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until every replica has loaded; the first that fails (or, with ``timeout``, is not ready by then)
        raises :class:`ReplicaFailed` at once, whatever the others still do."""
        t0 = time.monotonic()
        waiting = set(range(len(self.procs)))
        while waiting:
            handles = {h: i for i in waiting for h in (self.conns[i], self.procs[i].sentinel)}
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
            ready = multiprocessing.connection.wait(list(handles), left)
            if not ready:
                name = self.names[min(waiting)]
                raise ReplicaFailed(name, replica_error(name, {
                    "type": "TimeoutError", "rank": None, "where": "replica process",
                    "message": f"not loaded after {timeout:.0f} s (ready_timeout_s)"}))
            for i in sorted({handles[h] for h in ready}):
                kind, info = self._receive(i, 5.0)
                if kind != "ready":
                    raise ReplicaFailed(self.names[i], replica_error(self.names[i], {
                        "type": "ProtocolError", "message": f"said {kind!r} before it was ready", "rank": None}))
                self.ready[i] = dict(info, ready_s=round(time.monotonic() - t0, 2))
                waiting.discard(i)

    def alive(self) -> list[int]:
        lost = {x["replica_index"] for x in self.lost}
        return [i for i in range(len(self.procs)) if i not in lost]

    def extract(self, batch: list) -> list:
        """Per sample of ``batch``, its layers' states, each sample computed by one replica."""
        out: list = [None] * len(batch)
        made = [0] * len(self.procs)  # counted once the batch is whole (a failed one is made again on resume)
        pending = [(0, len(batch))]
        while pending:
            alive = self.alive()
            work = []  # (replica, start, stop)
            for lo, hi in pending:
                for (a, b), r in zip(split_parts(batch[lo:hi], len(alive)), alive):
                    work.append((r, lo + a, lo + b))
            pending = []
            for r, lo, hi in work:
                try:
                    self.conns[r].send(("extract", [list(ids) for ids in batch[lo:hi]]))
                except (OSError, ValueError):
                    pass  # its death is read below
            first_error = None
            for r, lo, hi in work:
                try:
                    kind, states = self._receive(r, None)
                    if kind != "states" or len(states) != hi - lo:
                        raise ReplicaFailed(self.names[r], replica_error(self.names[r], {
                            "type": "ProtocolError", "rank": None,
                            "message": f"answered {kind!r} with {len(states or [])} sample(s) for {hi - lo}"}))
                except ReplicaFailed as exc:
                    if self._lose(r, exc):
                        pending.append((lo, hi))
                    elif first_error is None:
                        first_error = exc
                    continue
                out[lo:hi] = states
                made[r] += hi - lo
            if first_error is not None:
                raise first_error
        self.samples = [n + m for n, m in zip(self.samples, made)]
        return out

    def _lose(self, r: int, exc: ReplicaFailed) -> bool:
        """Whether replica ``r``'s failure leaves the run going (``on_replica_loss: continue``, another alive)."""
        if (self.params.get("on_replica_loss") or "fail") != "continue":
            return False
        others = [i for i in self.alive() if i != r]
        if not others:
            return False
        self.lost.append({"replica": self.names[r], "replica_index": r, "devices": self.sets[r],
                          "error": str(exc)[:2000], "samples_made": self.samples[r]})
        self._stop(r, 2.0)
        print(f"[specops] replica {self.names[r]} lost ({str(exc).splitlines()[0][:300]}); on_replica_loss: "
              f"continue: its rows go to {', '.join(self.names[i] for i in others)}", flush=True)
        return True

    def _receive(self, r: int, timeout: float | None):
        """The next message of replica ``r``; :class:`ReplicaFailed` when it reports an error or dies."""
        conn, proc, name = self.conns[r], self.procs[r], self.names[r]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = multiprocessing.connection.wait([conn, proc.sentinel],
                                                    None if deadline is None else max(0.0, deadline - time.monotonic()))
            if conn in ready:
                try:
                    kind, info = conn.recv()
                    if kind == "states":
                        import torch

                        info = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=True)
                except (EOFError, OSError):
                    raise self._death(r) from None
                if kind == "error":
                    raise ReplicaFailed(name, replica_error(name, info))
                return kind, info
            if proc.sentinel in ready:
                raise self._death(r)
            if deadline is not None and time.monotonic() >= deadline:
                raise ReplicaFailed(name, replica_error(name, {
                    "type": "TimeoutError", "rank": None, "where": "replica process",
                    "message": f"no answer in {timeout:.0f} s"}))

    def _death(self, r: int) -> ReplicaFailed:
        """A replica process that ended without a word: how (its exit code, a signal named)."""
        from remote.system import signals

        proc = self.procs[r]
        proc.join(5)
        record = signals.death_record(proc.name, proc.exitcode, pid=proc.pid, source="waitpid")
        record.update(rank=None, where="replica process", log=f"logs/{self.names[r]}/{REPLICA_LOG}")
        return ReplicaFailed(self.names[r], replica_error(self.names[r], record))

    def _stop(self, r: int, grace: float) -> None:
        proc, conn = self.procs[r], self.conns[r]
        if proc.is_alive():
            try:
                conn.send(("close", None))
            except (OSError, ValueError):
                pass
            proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    def close(self, grace: float = 20.0) -> None:
        """Each replica closes its engine (its ranks stop) within ``grace``; then it is killed."""
        stopping = [threading.Thread(target=self._stop, args=(r, grace), daemon=True) for r in range(len(self.procs))]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        for conn in self.conns:
            conn.close()

    def describe(self) -> list[dict]:
        return [{"name": name, "devices": devices, "samples": n,
                 "log": str(self.run_dir / "logs" / name / REPLICA_LOG),
                 "ready_s": (ready or {}).get("ready_s")}
                for name, devices, n, ready in zip(self.names, self.sets, self.samples, self.ready)]


# --------------------------------------------------------------------------- the replica's own process

def replica_main(conn, spec: dict) -> None:
    """A replica process: take the devices, build and load the engine, answer batches until told to close."""
    from remote.extract import layout
    from remote.extract.engines import vllm_worker_hook

    _die_with_parent(int(spec["parent_pid"]))
    name, run_dir = spec["name"], Path(spec["run_dir"])
    # its devices before torch or vLLM is imported (CUDA and OpenMP read them once)
    env = layout.device_env(dict(os.environ), tp=int(spec["tp"]), on_cpu=spec["on_cpu"], devices=spec["devices"])
    env[vllm_worker_hook.ENV_REPLICA] = name
    os.environ.clear()
    os.environ.update(env)
    # (this process itself is not pinned: its ranks compute, on the cores vLLM binds their threads to, as a
    # server's ranks do; a pinned driver only loaded slower on a busy host)
    _redirect_output(run_dir / "logs" / name / REPLICA_LOG)
    print(f"[specops] replica {name} (pid {os.getpid()}) on {'cores' if spec['on_cpu'] else 'GPUs'} "
          f"{spec['devices']}", flush=True)

    from remote.extract.engines import engine_class
    from remote.run.rundir import RunPaths

    paths = RunPaths(run_dir)
    paths.logs, paths.errors = paths.logs / name, paths.errors / name
    for stale in paths.errors.glob("rank*.json"):  # this attempt's errors only
        stale.unlink()
    paths.log_offsets = {p.name: p.stat().st_size for p in paths.logs.glob("rank*.log")}
    engine = None
    busy = threading.Event()
    lock = threading.Lock()  # one sender at a time: the loop or the watchdog

    def report(exc: BaseException | None) -> None:
        from remote.run.rootcause import root_cause

        deaths = engine.process_deaths() if engine is not None else []
        record = root_cause(paths, exc, deaths=deaths)
        with lock:
            try:
                conn.send(("error", record))
            except (OSError, ValueError):
                pass

    def watchdog() -> None:
        """A rank's recorded error its driver never answers (a peer hangs in a collective): report, end."""
        from remote.run.rootcause import worker_errors

        first_seen = None
        grace = float(spec["params"].get("worker_error_grace_s", WORKER_ERROR_GRACE_S))
        while True:
            time.sleep(1.0)
            if not busy.is_set() or not paths.errors.exists() or not worker_errors(paths.errors):
                first_seen = None
                continue
            first_seen = first_seen or time.monotonic()
            if time.monotonic() - first_seen >= grace:
                print(f"[specops] {name}: a rank failed and the driver still waits after {grace:.0f} s", flush=True)
                report(None)
                os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name=f"specops-{name}-watchdog").start()
    try:
        engine = engine_class(spec["engine"])(spec["model_path"], spec["tp"], spec["layer_ids"], spec["params"],
                                              plan=spec["plan"])
        busy.set()
        engine.load()
        busy.clear()
        with lock:
            conn.send(("ready", {"pid": os.getpid(), "describe": engine.describe()}))
        import torch

        while True:
            kind, batch = conn.recv()
            if kind == "close":
                break
            busy.set()
            states = engine.extract(batch)
            busy.clear()
            buf = io.BytesIO()
            torch.save([[h.contiguous() for h in layers] for layers in states], buf)
            with lock:
                conn.send(("states", None))
                conn.send_bytes(buf.getbuffer())
    except (EOFError, KeyboardInterrupt):
        pass  # the parent went away or stopped us: nothing to report to
    except BaseException as exc:  # noqa: BLE001 -- every failure goes back as the replica's root cause
        traceback.print_exc()
        report(exc)
    finally:
        if engine is not None:
            try:
                engine.close()
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
        sys.stdout.flush()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (the supervisor) dies: a dead supervisor leaves no replica."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before the call
        os._exit(1)


_log_file = None  # kept open for faulthandler for the life of the process


def _redirect_output(path: Path) -> None:
    import faulthandler

    global _log_file
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    _log_file = open(path, "a", buffering=1)
    os.dup2(_log_file.fileno(), 1)
    os.dup2(_log_file.fileno(), 2)
    faulthandler.enable(file=_log_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_log_file, all_threads=True)
