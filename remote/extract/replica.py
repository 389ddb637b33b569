"""One model replica over several hosts: vLLM's own multi-node runtime, watched by specops (stdlib only).

vLLM runs the replica (multiprocessing backend: ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``; the worker hosts ``--headless``); specops builds no
runtime of its own. What vLLM does not do, specops does here:

* **a dead worker host is seen.** vLLM notices a worker killed while idle only at the next
  request, and a stopped one holds a request for ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``. So
  every worker host's run (:class:`NodeSupervisor`, ``python -m remote.extract.replica RUN_DIR``,
  started by ``job start`` with ``replica.node_rank > 0``) keeps one TCP connection to the
  head's supervisor (:class:`HostWatch`, on ``watch_port`` of the head's ``node_address``)
  and says ``hello``, then ``failed`` with its ranks' own exception if they die. A connection
  that closes without ``bye`` is a host that died (its processes were killed, or it
  vanished: TCP keepalive). Either fails the head's run naming the host, its ranks and the cause.
* **a dead head takes every host down.** A killed head leaves vLLM's headless ranks alive;
  the worker's supervisor sees the head's connection close and stops its ranks. A stopped
  head rank (SIGSTOP) would hang every peer in a collective: the head's watch sees it
  (:meth:`HostWatch.watch_own_ranks`) and fails the run naming the head.
* **the replica ends as one.** The head sends ``ready`` when its server answers, and
  ``end`` with its final state; each worker host stops its ranks and ends in that state.

``params["replica"]`` (the laptop's :func:`specops.replica.node_params`)::

    {"name": "big", "hosts": ["a", "b"], "node_rank": 1, "nnodes": 2, "ranks_per_node": 1,
     "tp": 2, "master_addr": "10.0.0.1", "master_port": 29500, "watch_port": 29501,
     "node_address": "10.0.0.2"}

Messages are JSON lines, one object each: ``{"event": "hello", "host", "node_rank", "ranks",
"pid"}``, ``{"event": "failed", "error": {...}}`` (its ranks failed, or ``type: Aborted``: this host
was aborted, and the head ends the replica aborted), ``{"event": "bye", "state"}`` (worker to
head); ``{"event": "ready"}``, ``{"event": "end", "state", "message"}`` (head to worker).
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from remote.run import faults
from remote.wire import status
from remote.wire.contract import RunState

#: keepalive on every watch connection: a host that vanishes (no FIN, no RST) is lost after
#: about IDLE + INTERVAL * COUNT seconds.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
#: how long a worker host tries to reach the head's watch before it gives up.
CONNECT_TIMEOUT_S = 900.0
#: a rank process of a worker host stopped (SIGSTOP, a debugger) this long fails the run: vLLM would
#: hold the head's request for VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS and then name no host.
STOPPED_GRACE_S = 10.0
#: ``/proc/<pid>/stat`` states of a stopped process.
STOPPED_STATES = ("T", "t")
#: how long a worker host whose ranks died waits for the head's ``end`` before it reports its own
#: failure (the head stops its server after sending ``end``: those ranks die of that, not of a fault).
LOSS_GRACE_S = 2.0


def stopped_grace_s() -> float:
    """:data:`STOPPED_GRACE_S`, or the shorter one a test armed in the run's env (:mod:`remote.run.faults`)."""
    return faults.stopped_grace_s(STOPPED_GRACE_S)


def ranks_of(replica: dict, node_rank: int) -> list[int]:
    k = int(replica["ranks_per_node"])
    return list(range(node_rank * k, (node_rank + 1) * k))


def host_of(replica: dict, node_rank: int) -> str:
    hosts = replica.get("hosts") or []
    return hosts[node_rank] if node_rank < len(hosts) else f"node {node_rank}"


def keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send(sock: socket.socket, event: str, **fields) -> bool:
    """One message; False when the other end is gone."""
    try:
        # MSG_NOSIGNAL: a peer that closed gives EPIPE here, never a SIGPIPE (a library vLLM's engine imports
        # may have restored SIGPIPE's default, which kills the process without a word)
        sock.sendall((json.dumps({"event": event, **fields}, default=str) + "\n").encode(),
                     getattr(socket, "MSG_NOSIGNAL", 0))
        return True
    except OSError:
        return False


class Lines:
    """JSON messages off one socket, a line each; ``None`` at EOF."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def read(self, timeout: float | None) -> list[dict] | None:
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):  # closed under us (the watch stopping): the connection is over
            return None
        if not ready:
            return []
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


# --------------------------------------------------------------------------- the head's side

def killed_by_signal(error: dict) -> bool:
    """Whether a run's error is its server's API process ended by a signal (``waitpid`` said so: the
    death record of :meth:`remote.extract.engines.vllm_server.process.VllmServer.own_death`)."""
    return (error.get("death") or {}).get("source") == "waitpid"


def names_host(message: str, host: str) -> bool:
    """Whether ``message`` names ``host`` as a whole word (``h1`` is not named by "h10 died")."""
    return re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w-]|\.\w)", message) is not None


class HostWatch:
    """The head supervisor's watch of its replica's worker hosts (see the module doc).

    :param on_lost: called once, from a watch thread, with the error record of the first
        worker host that failed or vanished.
    """

    #: how long :meth:`start` waits for a taken watch port (a closed connection holds it up to 60 s)
    bind_wait_s = 65.0

    def __init__(self, replica: dict, on_lost):
        self.replica, self.on_lost = replica, on_lost
        self.nodes: dict[int, dict] = {}
        self.lost: dict | None = None
        self.lost_at: float | None = None
        self._lost_event = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closing = False
        self.server: socket.socket | None = None

    def start(self) -> None:
        """Listen on the head's ``node_address``:``watch_port``, waiting out a connection that still holds it.

        :raises ports.PortTaken: the port stayed taken (preflight checks it first, but anything may take it
            after); it names the holders and carries the fix.
        """
        from remote.system import ports

        addr, port = str(self.replica["node_address"]), int(self.replica["watch_port"])
        try:
            self.server = ports.bind_listening(addr, port, what="the replica's watch port", wait_s=self.bind_wait_s,
                                               on_wait=self._told_taken)
        except ports.PortTaken as exc:
            how = self.replica.get("port_setting") or \
                f"set master_port of replica {self.replica.get('name')} in the inventory"
            exc.fix = ports.fix_for(how, port - 1, exc)
            raise
        threading.Thread(target=self._accept, daemon=True, name="specops-host-watch").start()

    def _told_taken(self, users: list[dict]) -> None:
        from remote.system import ports

        held = "; ".join(map(ports.describe, users)) or "holder unknown"
        print(f"[specops] replica: the watch port {self.replica['node_address']}:{self.replica['watch_port']} is "
              f"taken ({held}); waiting for it", flush=True)

    def missing(self) -> list[str]:
        """The worker hosts that have not said hello."""
        return [host_of(self.replica, n) for n in range(1, int(self.replica["nnodes"])) if n not in self.nodes]

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, peer = self.server.accept()
            except OSError:
                return
            keepalive(sock)
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True, name="specops-host-watch-peer").start()

    def _serve(self, sock: socket.socket, peer) -> None:
        lines, node = Lines(sock), None
        with self._lock:
            self._socks.append(sock)
        while True:
            messages = lines.read(None)
            if messages is None:
                break
            for msg in messages:
                event = msg.get("event")
                if event == "hello":
                    node = int(msg.get("node_rank") or 0)
                    self.nodes[node] = {**msg, "peer": list(peer)[:2], "since": time.time(), "sock": sock}
                    print(f"[specops] replica: {msg.get('host')} (node {node}, ranks {msg.get('ranks')}) joined "
                          f"from {peer[0]}", flush=True)
                elif event == "failed" and node is not None:
                    error = dict(msg.get("error") or {})
                    self._lose(node, error)
                elif event == "bye" and node is not None:
                    self.nodes[node]["bye"] = msg.get("state")
        if node is None or self._closing or self.nodes.get(node, {}).get("bye"):
            return
        host = host_of(self.replica, node)
        self._lose(node, status.error(
            "HostLost", f"host {host} (node {node}, ranks {ranks_of(self.replica, node)}) is gone: its specops "
                        f"connection closed with no word from it (the host died, its processes were killed, or it "
                        f"dropped off the network)", where=f"host {host}"))

    def lose_node(self, node: int, error: dict) -> None:
        """Node ``node`` is lost for a cause seen outside its connection (its Slurm job step ended): as a host that
        said it failed, once."""
        self._lose(node, error)

    def _lose(self, node: int, error: dict) -> None:
        host = host_of(self.replica, node)
        if error.get("rank") is None:  # the host as a whole: its first rank stands for it
            error["rank"] = ranks_of(self.replica, node)[0]
        error.update(host=host, node_rank=node, ranks=ranks_of(self.replica, node))
        message = str(error.get("message") or "")
        if not names_host(message, host):
            error["message"] = f"on host {host} (node {node}): {message}"
        with self._lock:
            if self.lost is not None or self._closing:
                return
            self.lost = error
            self.lost_at = time.monotonic()  # this host's clock: compared with when the head saw its own failure
        print(f"[specops] replica: lost {host}: {error.get('type')}: {error['message']}", flush=True)
        self._lost_event.set()
        try:
            self.on_lost(error)
        except Exception:  # noqa: BLE001 -- the watch must never die of its callback
            traceback.print_exc()

    def watch_own_ranks(self, server_of) -> None:
        """Watch the head's own vLLM processes (``server_of()``: its server, None before one starts)
        for a stop (SIGSTOP, a debugger): held :func:`stopped_grace_s`, the head is lost as a
        worker host would be (``RanksStopped``), so the run fails naming it instead of hanging
        in a collective its peers wait on."""
        threading.Thread(target=self._watch_own_ranks, args=(server_of,), daemon=True,
                         name="specops-head-ranks").start()

    def _watch_own_ranks(self, server_of) -> None:
        stopped_since: dict[int, float] = {}
        head = host_of(self.replica, 0)
        grace = stopped_grace_s()
        while not self._closing and self.lost is None:
            time.sleep(1.0)
            server = server_of()
            proc = getattr(server, "proc", None)
            if proc is None or proc.poll() is not None:
                stopped_since = {}
                continue
            # the server's own session (its retitled ranks hide the marker in /proc), else this group
            group = proc.pid if server.params.get("own_session", True) else os.getpgid(0)
            now = time.monotonic()
            stopped_since = {pid: stopped_since.get(pid, now) for pid in stopped_pids(server.marker, group)}
            held = sorted(pid for pid, since in stopped_since.items() if now - since >= grace)
            if held:
                ranks = ranks_of(self.replica, 0)
                self._lose(0, status.error(
                    "RanksStopped", f"process(es) {held} of ranks {ranks} on {head} (the head) are stopped (SIGSTOP or "
                                    f"a debugger) for {grace:.0f} s: the replica's requests hang on them",
                    where=f"host {head}"))
                return

    def wait_lost(self, timeout: float) -> dict | None:
        """The first lost host's error, waiting up to ``timeout`` for one."""
        self._lost_event.wait(timeout)
        return self.lost

    def broadcast(self, event: str, **fields) -> None:
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            send(sock, event, **fields)

    def cause(self, error: dict, seen_at: float, grace_s: float) -> dict:
        """The run's error, given the head's own ``error`` seen at ``seen_at`` (monotonic), waiting up to
        ``grace_s`` for a worker host's word.

        A worker host is the cause when its connection closed (the host died: nothing else closes
        it), when its server was killed by a signal and the head's was not (a kill is no
        consequence of a peer's failure, and its ranks' peers on the head may fail in a collective
        before the worker's word arrives), or when its failure reached the watch before the head saw
        its own (a dead worker fails the head's request within seconds, after its word). A worker
        whose ranks died after the head failed died of it: its error is kept beside the head's
        (``other_errors``).
        """
        lost = self.wait_lost(grace_s)
        if lost is None:
            return error
        head = {k: error.get(k) for k in ("rank", "type", "message", "where")}
        killed = killed_by_signal(lost) and not killed_by_signal(error)
        # a host that died, or was aborted by request, is the cause whenever the head saw its own failure
        if lost.get("type") in ("HostLost", "Aborted") or killed or (self.lost_at or 0) <= seen_at:
            return {**lost, "head_error": head}
        return {**error, "other_errors": [*(error.get("other_errors") or []), lost]}

    def close(self, state: str | None, message: str = "", **fields) -> None:
        """Tell every worker host how the run ended (``fields``: more of the ``end`` message, such as the
        ``host`` that ended it), and stop watching."""
        with self._lock:
            self._closing = True
        self.broadcast("end", state=state or RunState.FAILED.value, message=message, **fields)
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.server is not None:
            self.server.close()


# --------------------------------------------------------------------------- a Slurm job's nodes

#: how long the head waits for its job step's worker nodes to stop their ranks after the run's ``end``
STEP_STOP_S = 30.0


class JobStep:
    """A replica over the nodes of the Slurm batch job its head runs in (``slurm.nodes`` > 1): node 0 (the batch
    host, this supervisor) is the head; nodes ``1..N-1`` are one ``srun`` job step, a task a node, each a
    :class:`NodeSupervisor` of ``RUN_DIR/nodes/K`` (:func:`remote.run.slurm.node_dir`), their headless ranks joined
    to the head's as a worker host's are. The nodes, their addresses and the ports are the job's
    (:func:`remote.run.slurm.job_replica_block`), asked again at each start (a requeued job may hold other nodes).

    A task that fails ends the step (``--kill-on-bad-exit``): the head's watch loses the node srun names
    (:func:`remote.run.slurm.failed_step_task`) unless the node's own word came first.
    """

    def __init__(self, run_dir: Path, params: dict):
        from remote.run import slurm
        from remote.wire import fsutil
        from remote.wire.contract import param

        self.run_dir, self.params = Path(run_dir), params
        self.replica = slurm.job_replica_block(int(param(params, "tp")), params.get("env"))
        for node in range(1, int(self.replica["nnodes"])):  # the one writer of the nodes' params
            where = slurm.node_dir(self.run_dir, node)
            (where / "logs").mkdir(parents=True, exist_ok=True)
            (where / "errors").mkdir(exist_ok=True)
            block = {**self.replica, "node_rank": node, "node_address": self.replica["addresses"][node]}
            fsutil.write_json(where / "params.json", {**params, "replica": block}, temp_prefix=fsutil.TEMP_PREFIX)
        self.proc = None
        self.log = self.run_dir / "logs" / "nodes.log"
        self._closing = False

    def start(self, watch: HostWatch) -> list[str]:
        """Start the worker nodes' step; its end before the run's is the loss of the node srun names."""
        import shlex
        import subprocess

        from remote.run import slurm
        from remote.run.rundir import SUPERVISOR_MODULES

        python = self.params.get("python") or sys.executable
        argv = slurm.node_step([python, "-m", SUPERVISOR_MODULES["replica"], str(self.run_dir), slurm.NODE_RANK_FLAG,
                                "1"], int(self.replica["nnodes"]) - 1, python, first=1,
                               setup=(slurm.job_of(self.run_dir) or {}).get("setup"))
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:  # srun's own words and the nodes' supervisors' output, every attempt's
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=str(self.run_dir))
        print(f"[specops] replica over the Slurm job's nodes {', '.join(self.replica['hosts'])}: head "
              f"{self.replica['hosts'][0]} (here), worker node(s) as one job step: {shlex.join(argv)}", flush=True)
        threading.Thread(target=self._watch, args=(watch, offset), daemon=True, name="specops-job-step").start()
        return argv

    def _watch(self, watch: HostWatch, offset: int) -> None:
        from remote.run import slurm
        from remote.run.rundir import tail_text

        code = self.proc.wait()
        if code == 0 or self._closing:
            return
        time.sleep(LOSS_GRACE_S)  # srun writes its word on the task as the step ends
        size = self.log.stat().st_size if self.log.exists() else 0
        task = slurm.failed_step_task(tail_text(self.log, min(200_000, max(0, size - offset))))
        node = int(task["rank"]) + 1 if task else 1  # the step's task k is the job's node k + 1
        said = task["said"] if task else f"srun exited with code {code} naming no task"
        host = host_of(self.replica, node)
        watch.lose_node(node, status.error(
            "NodeStepFailed", f"node {node} ({host}) of the job's {self.replica['nnodes']}: {said} (the job step "
                              f"of the worker nodes ended: {self.log})", where=f"host {host}"))

    def close(self) -> None:
        """After the run's ``end`` went to the nodes: their step ends by itself, else it is stopped."""
        self._closing = True
        if self.proc is None:
            return
        try:
            self.proc.wait(STEP_STOP_S)
        except Exception:  # noqa: BLE001 -- a step that does not end is stopped (srun passes SIGTERM on)
            self.proc.terminate()
            try:
                self.proc.wait(STEP_STOP_S)
            except Exception:  # noqa: BLE001
                self.proc.kill()


# --------------------------------------------------------------------------- a worker host's side

class Aborted(BaseException):
    """SIGTERM reached this host's supervisor (``job abort``)."""


def connect_to_head(replica: dict, timeout: float) -> socket.socket:
    """A worker host's connection to the head's :class:`HostWatch` (``master_addr:watch_port``), retried while the
    head's run may still be starting.

    :raises ConnectionError: no answer within ``timeout`` seconds, naming the head and the address."""
    addr = (str(replica["master_addr"]), int(replica["watch_port"]))
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(addr, timeout=5)
            sock.settimeout(None)
            keepalive(sock)
            return sock
        except OSError as exc:
            last = exc
            time.sleep(1.0)
    raise ConnectionError(f"the head {host_of(replica, 0)}'s supervisor did not answer on "
                          f"{addr[0]}:{addr[1]} for {timeout:.0f} s ({last}); is its run started?")


class NodeSupervisor:
    """A worker host's run: its headless ranks, joined to the head, watched both ways."""

    def __init__(self, run_dir):
        from remote.run.lifecycle import StatusFile
        from remote.run.rundir import RunPaths

        self.paths = RunPaths(run_dir)
        self.params = json.loads(self.paths.params.read_text())
        self.replica = self.replica_of(self.params)
        self.node = int(self.replica["node_rank"])
        self.host = host_of(self.replica, self.node)
        self.ranks = ranks_of(self.replica, self.node)
        self.run_id = self.params.get("run_id") or self.paths.run_dir.name
        self.status = StatusFile.begin(
            self.paths.status, self.run_id, samples_done=None, samples_total=None,
            replica={"name": self.replica.get("name"), "head": host_of(self.replica, 0), "host": self.host,
                     "node_rank": self.node, "ranks": self.ranks})
        self.engine = None
        self.sock: socket.socket | None = None

    @staticmethod
    def replica_of(params: dict) -> dict:
        """This host's place in its replica (an extraction's ``params["replica"]``)."""
        return params["replica"]

    def _connect(self, timeout: float) -> socket.socket:
        return connect_to_head(self.replica, timeout)

    def _engine(self):
        """The same engine the head runs (same plan, same server flags), started headless here."""
        from remote.extract import runplan
        from remote.extract.engines import engine_class
        from remote.system import modelconfig

        p = dict(self.params)
        engine_name = runplan.resolve_engine(p.get("engine"))
        config = modelconfig.read(p["model_path"])
        plan = runplan.resolve(p, config, run_dir=self.paths.run_dir, engine=engine_name).require()
        if plan.engine != "vllm-server":
            raise ValueError(f"a replica over several hosts needs the vllm-server engine (vLLM's multi-node "
                             f"runtime); this host resolved {plan.engine}")
        # the ranks stay in this supervisor's process group: an abort's SIGKILL to the group takes them
        # (vLLM retitles them, VLLM::Worker_TP1, which hides the run's marker in /proc)
        p.update(work_dir=str(self.paths.run_dir), python=sys.executable, own_session=False)
        p.setdefault("enforce_eager", p.get("device") == "cpu")
        return engine_class(plan.engine)(p["model_path"], int(self.replica["tp"]), plan.layer_ids, p, plan=plan)

    def run(self) -> int:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_aborted)
        signal.signal(signal.SIGINT, _raise_aborted)
        head = host_of(self.replica, 0)
        try:
            self.status.update(phase=f"waiting for the head {head}")
            self.sock = self._connect(float(self.params.get("ready_timeout_s") or CONNECT_TIMEOUT_S))
            send(self.sock, "hello", host=self.host, node_rank=self.node, ranks=self.ranks, pid=os.getpid())
            self.status.update(state=RunState.LOADING.value, phase=f"loading ranks {self.ranks} (headless)")
            self.engine = self._engine()
            self.engine.load()
            print(f"[specops] ranks {self.ranks} of replica {self.replica.get('name')} started headless; head "
                  f"{head}", flush=True)
            state, message = self._watch(head)
            if state == RunState.DONE.value:
                self.status.finish(error=None)
            elif state == RunState.ABORTED.value:
                self.status.abort(self.status.data.get("error"))
            else:  # failed, or a state no head sends: the replica did not finish
                self.status.fail(self.status.data.get("error") or status.error(
                    "HeadFailed", f"the head {head} ended the run {state!r}: {message}", where=f"host {head}"))
            send(self.sock, "bye", state=state)
            return 0 if state == RunState.DONE.value else 1
        except Aborted:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            error = status.error("Aborted", f"ranks {self.ranks} on {self.host} aborted by request (SIGTERM)",
                                 where=f"host {self.host}")
            self.status.end(error, aborted=True)
            if self.sock is not None:
                # the head cannot go on without these ranks: it ends the replica as aborted, naming this
                # host (an abort that reached only this host, the head unreachable from the laptop)
                send(self.sock, "failed", error={**error, "host": self.host, "node_rank": self.node,
                                                 "ranks": self.ranks})
                send(self.sock, "bye", state=RunState.ABORTED.value)
            return 143
        except BaseException as exc:  # noqa: BLE001 -- every failure ends in status.json, and at the head
            traceback.print_exc()
            error = self._error(exc)
            self.status.end(error)
            if self.sock is not None:
                send(self.sock, "failed", error=error)
            return 1
        finally:
            # an abort arriving now must not cut the stop short: the ranks' process group is killed here
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if self.engine is not None:
                # headless ranks hold no request of their own: a short stop, well inside abort's grace
                self.engine.params["stop_grace_s"] = 3.0
                try:
                    self.engine.close()
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
            _kill_own_group()
            print(f"[specops] supervisor exits ({self.status.data.get('state')})", flush=True)

    def _error(self, exc: BaseException) -> dict:
        """This host's failure as the run's error: the ranks' own exception where the server log has one."""
        record = None
        if self.engine is not None:
            try:
                record = self.engine.error_record(exc)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        if record is None:
            record = status.error_from(exc, where=f"host {self.host}")
        record.update(host=self.host, node_rank=self.node, ranks=self.ranks)
        return record

    def _watch(self, head: str) -> tuple[str, str]:
        """Until the head ends the run, the head vanishes, or this host's ranks die."""
        lines = Lines(self.sock)
        server = self.engine.server
        died_at = None
        stopped_since: dict[int, float] = {}
        grace = stopped_grace_s()
        while True:
            messages = lines.read(1.0)
            if messages is None:
                raise HeadLost(f"the head {head}'s supervisor is gone (its connection closed without an end): "
                               f"the head host died or its run was killed; this host's ranks {self.ranks} were "
                               f"stopped")
            for msg in messages:
                if msg.get("event") == "ready":
                    self.status.update(state=RunState.EXTRACTING.value,
                                       phase=f"serving ranks {self.ranks} for the head {head}")
                elif msg.get("event") == "end":
                    state = str(msg.get("state") or RunState.FAILED.value)
                    if state == RunState.FAILED.value:
                        self.status.update(error=status.error(
                            "HeadFailed", f"the head {head}'s run failed: {msg.get('message')}", where=f"host {head}"))
                    return state, str(msg.get("message") or "")
            now = time.monotonic()
            # the ranks' process group: this supervisor's (own_session False, see _engine), else the server's
            group = server.proc.pid if server.params.get("own_session", True) and server.proc else os.getpgid(0)
            stopped_since = {pid: stopped_since.get(pid, now) for pid in stopped_pids(server.marker, group)}
            held = sorted(pid for pid, since in stopped_since.items() if now - since >= grace)
            if held:
                raise RanksStopped(f"process(es) {held} of ranks {self.ranks} on {self.host} are stopped (SIGSTOP or a "
                                   f"debugger) for {grace:.0f} s: the replica's requests hang on them")
            if not server.alive:
                # the head's end may be on its way (its server stopped first): wait for its word a moment
                died_at = died_at or time.monotonic()
                if time.monotonic() - died_at > LOSS_GRACE_S:
                    raise server.failure(f"the vLLM ranks {self.ranks} on {self.host} exited")


class HeadLost(RuntimeError):
    """The head's supervisor went away without ending the run."""


class RanksStopped(RuntimeError):
    """A rank process of this host is stopped (SIGSTOP): the replica cannot go on."""


def stopped_pids(marker: str, pgrp: int | None = None) -> list[int]:
    """The processes of one vLLM server that are stopped: those with its marker in their environment,
    and those of its process group (``pgrp``: vLLM retitles its workers, ``VLLM::Worker_TP1``, which
    overwrites the environment ``/proc`` shows)."""
    from remote.extract.engines.vllm_server import MARKER_ENV
    from remote.system import procscan

    found = []
    pids = set(procscan.live_pids(env_any={f"{MARKER_ENV}={marker}".encode()}))
    if pgrp is not None:
        pids.update(procscan.live_pids(pgrp=pgrp))
    for pid in sorted(pids):
        fields = procscan.stat_fields(pid)
        if fields and fields[0] in STOPPED_STATES:
            found.append(pid)
    return found


def _kill_own_group() -> None:
    """SIGKILL every other process of this supervisor's process group (its ranks, whatever a stop left)."""
    from remote.system import procscan

    if os.getpgid(0) != os.getpid():  # not a group of our own (job start makes one): touch nothing
        return
    for pid in procscan.live_pids(pgrp=os.getpgid(0)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _raise_aborted(signum, frame):
    raise Aborted()


def main(argv: list[str]) -> int:
    """``RUN_DIR`` (a worker host's run, started by ``job start``), or ``RUN_DIR --node-rank K`` (node ``K`` of a
    Slurm job's replica: its run dir ``RUN_DIR/nodes/K``, written by the head's supervisor; see
    :func:`remote.run.slurm.job_replica_block`)."""
    import faulthandler

    faulthandler.enable()
    run_dir = Path(argv[0])
    if len(argv) == 3 and argv[1] == "--node-rank":
        from remote.run.slurm import node_dir

        run_dir = node_dir(run_dir, int(argv[2]))
    return NodeSupervisor(run_dir).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
