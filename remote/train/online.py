"""``train --online``: the run's own extraction server, started beside the trainer (stdlib only at import).

speculators 0.9's trainer makes the states of a row it finds no file for itself
(``--on-missing generate``): one ``/v1/completions`` request with the row's token ids and
``max_tokens=1`` to ``--vllm-endpoint``, the file the server's connector wrote read from the
``kv_transfer_params`` of the reply, checked (token ids echo, shape, finite;
``--generation-validation-retries`` more tries), then deleted. So an online run keeps nothing
but the token dataset (:func:`remote.train.plan.link_token_dataset`).

The server is the extraction engine's own (:class:`remote.extract.engines.vllm_server.VllmServer`)
with the states run's parameters and the layer plan's ids (:func:`capture_ids`: the file's layer
axis, as the trainer reads it), loopback only, in the train run's ``server/`` dir; a child of the
supervisor that dies with it (``die_with_parent``). :class:`OnlineServer` starts it, waits for it, watches it while the
trainer runs (a server that dies stops the trainer and fails the run naming the server), and
stops it however the run ends.

Disaggregated (``--server-on``), the server runs on another host (:class:`OnlineServerHalf`; the trainer's host
joins it through :class:`RemoteServer`), or as a replica over several hosts: the head's half serves and watches
the others, each of which runs its ranks headless (:class:`OnlineServerNode`, the replica's own worker
supervisor).
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from remote.extract import replica

#: the train run's dir for the server (``storage/``, ``logs/server.log``)
SERVER_DIR = "server"
#: how often the watcher looks at the server while the trainer runs
WATCH_S = 1.0
#: how long the server may take to shut down before it is killed
STOP_GRACE_S = 4.0


def server_params(run_params: dict, params: dict, state_format: str) -> dict:
    """The server's params: the states run's own (its device, dtype, format, env-independent knobs) with the
    CPU defaults an extraction gets (:func:`~remote.extract.engines.vllm_server.command.run_defaults`); never
    its port (a fresh free one) nor a replica layout (one server on this host)."""
    from remote.extract.engines.vllm_server.command import run_defaults

    keep = {k: v for k, v in run_params.items() if k not in ("port", "replica", "replica_sets", "work_dir")}
    keep["device"] = params.get("device") or keep.get("device") or ""
    keep["format"] = state_format  # the connector that writes what the trainer's backend reads
    served = run_defaults(keep, int(keep.get("batch_size") or 1))
    # the trainer's client keeps the requests in flight, not specops: vLLM's own max_num_seqs, unless the run set one
    served.pop("concurrency", None)
    return served


def layer_plan(plan) -> dict:
    """The train plan's layer plan (:func:`remote.wire.layers.algorithm_plan` of its algorithm): the one source of
    both halves' ids."""
    from remote.wire import layers

    return plan.layer_plan or layers.algorithm_plan(plan.algorithm, plan.layer_ids, plan.num_layers)


def capture_ids(plan) -> list[int]:
    """The ids the run's server captures: the layer plan's file ids (the trainer's aux ids then the final state)."""
    return list(layer_plan(plan)["file_ids"])


class OnlineServer:
    """The extraction server of one online train run."""

    def __init__(self, run_dir, plan, run_params: dict, params: dict):
        from remote.extract.engines.vllm_server import SERVED_MODEL_NAME, VllmServer

        self.plan = plan
        served = server_params(run_params, params, plan.state_format)
        # the trainer refuses a server whose first model name is not its --verifier-name-or-path (speculators'
        # ArrowDataset._setup_client): that path first, the engine's own name beside it (vLLM takes the last flag)
        served["server_args"] = [*(served.get("server_args") or []), "--served-model-name", plan.model_path,
                                 SERVED_MODEL_NAME]
        if params.get("bind_host"):  # disaggregated: where the trainer's host reaches it (OnlineServerHalf)
            served.update(bind_host=params["bind_host"], port=int(params["bind_port"]))
        node = params.get("replica")  # a replica over several hosts: this host's ranks of it (OnlineServerNode too)
        if node:
            served["replica"] = dict(node)
        tp = (node or {}).get("tp") or params.get("tp") or run_params.get("tp") or 1  # a replica's, --tp, the states'
        self.server = VllmServer(plan.model_path, tp=int(tp),
                                 layer_ids=capture_ids(plan), work_dir=Path(run_dir) / SERVER_DIR,
                                 max_model_len=plan.seq_len + 1, params=served,
                                 python=params.get("python") or sys.executable)
        self.died: dict | None = None
        self._stop = threading.Event()

    def launch(self) -> dict:
        """Start the server's process (it loads in the background): what a leftover scan and a test need."""
        self.server.start()
        return {"pid": self.server.proc.pid, "log": str(self.server.log_path),
                "marker": self.server.marker}  # in every server process's env: what a leftover scan looks for

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until the launched server answers: seconds it took.

        :raises ServerFailed: it died or did not answer in time (its log's words)."""
        return self.server.wait_ready(timeout_s)

    @property
    def endpoint(self) -> str:
        """What the trainer's ``--vllm-endpoint`` gets: the OpenAI base URL."""
        return f"{self.server.url}/v1"

    def watch(self, on_death) -> None:
        """Call ``on_death(error)`` once if the server dies before :meth:`stop` (a thread of its own)."""
        def loop():
            while not self._stop.wait(WATCH_S):
                if not self.server.alive:
                    self.died = self.error()
                    on_death(self.died)
                    return
        threading.Thread(target=loop, daemon=True, name="online-server-watch").start()

    def error(self) -> dict:
        """The run's error for a server that died: who died of what, in the server log's words."""
        from remote.wire import status as wire_status

        failed = self.server.failure("the online extraction server died while the trainer ran")
        death = failed.death or {}
        cause = failed.exception or death.get("message") or "no cause in its log"
        return wire_status.error(
            "OnlineServerDied", f"the online extraction server (pid {self.server.proc.pid}, {self.endpoint}) died "
                                f"while the trainer ran: {cause}; the trainer was stopped. Read "
                                f"{self.server.log_path}; the same train command resumes from the last epoch "
                                f"checkpoint with a fresh server", rank=0, where="online server",
            log=str(self.server.log_path), death=death or None, log_tail=failed.log_tail[-3000:])

    def stop(self, state: str | None = None) -> list[int]:
        """Stop the server (and its engine and workers); the pids killed outright. A short grace: ``job abort``
        SIGKILLs the supervisor 10 s after its SIGTERM, and the server must be gone before."""
        self._stop.set()
        return self.server.stop(grace_s=STOP_GRACE_S)


# --------------------------------------------------------------------------- disaggregated: server and trainer apart

#: ``params["online_server"]`` of a disaggregated online run (the laptop's :func:`specops.train.disagg_blocks`):
#: ``{"role": "server" | "trainer", "server_host", "trainer_host", "address", "port", "watch_port"}``; the server
#: host's API listens on ``address:port``, its supervisor's watch (:class:`remote.extract.replica.HostWatch`, the
#: replica's own) on ``address:watch_port``, which the trainer host's supervisor joins as a replica's worker does.
#: A server that is a replica over several hosts (``--server-on REPLICA``): ``server_host`` is its head, and each
#: server host's block adds ``replica``, its place in it (:func:`specops.replica.node_block`): the head runs the API
#: and ranks ``0..k-1`` and watches the others on the replica's own watch port, each worker host runs its ranks
#: headless (:class:`OnlineServerNode`); the trainer's block names the replica (``{"name", "hosts"}``)
DISAGG_KEYS = ("role", "server_host", "trainer_host", "address", "port", "watch_port", "replica")


def node_rank(disagg: dict) -> int:
    """This server host's node in its replica (0: the head, or a server on one host)."""
    return int((disagg.get("replica") or {}).get("node_rank") or 0)


def watch_block(disagg: dict) -> dict:
    """The replica watch's view of a disaggregated run: the server host its head, the trainer host its one worker."""
    return {"name": "online", "hosts": [disagg["server_host"], disagg["trainer_host"]], "nnodes": 2,
            "ranks_per_node": 1, "node_address": disagg["address"], "master_addr": disagg["address"],
            "watch_port": int(disagg["watch_port"]), "port_setting": "pass train --server-port"}


def server_died(disagg: dict, cause: str, host: str | None = None) -> dict:
    """The trainer half's error for a server host's server (or its supervisor) gone: names the host (``host``: the
    replica's host that ended it, else the head) and the head's address."""
    from remote.wire import status as wire_status

    host = host or disagg["server_host"]
    node = disagg.get("replica") or {}
    where = (f"host {host} of replica {node.get('name')} (head {disagg['server_host']}, "
             if node else f"host {host} (") + f"{disagg['address']}:{disagg['port']})"
    return wire_status.error(
        "OnlineServerDied", f"the online extraction server on {where} died while the trainer ran: {cause}; the "
                            f"trainer was stopped. Read the server host's log (specops logs --on {host}); the same "
                            f"train command resumes from the last epoch checkpoint with a fresh server",
        rank=0, where=f"online server on host {host}", host=host)


class OnlineServerHalf:
    """The server host's half of a disaggregated online run: :class:`OnlineServer` listening on the host's address,
    and the replica's :class:`~remote.extract.replica.HostWatch` the trainer host joins; ``ready`` (with the
    endpoint) is sent once the server answers, ``end`` when the run ends."""

    def __init__(self, run_dir, plan, run_params: dict, params: dict):
        self.disagg = dict(params["online_server"])
        bound = {**params, "bind_host": self.disagg["address"], "bind_port": int(self.disagg["port"]),
                 "replica": self.disagg.get("replica")}
        self.online = OnlineServer(run_dir, plan, run_params, bound)
        self.watch = replica.HostWatch(watch_block(self.disagg), on_lost=lambda error: None)
        #: a replica's head: its worker hosts on the replica's own watch (their ranks join this server)
        self.hosts = (replica.HostWatch(self.disagg["replica"], on_lost=self._host_lost)
                      if self.disagg.get("replica") else None)
        self.ready = False

    def _host_lost(self, error: dict) -> None:
        """A worker host of the replica failed or vanished while the server loads: stop it, so the wait for it
        ends now (once it serves, :meth:`serve`'s loop sees the loss)."""
        if not self.ready:
            self.online.server.stop(grace_s=STOP_GRACE_S)

    def _ended(self, error: dict) -> tuple[str, dict]:
        """The run fails with ``error``; the trainer host hears it, naming the host that ended it."""
        from remote.wire.contract import RunState

        self.watch.close(RunState.FAILED.value, error["message"], host=error.get("host") or self.disagg["server_host"])
        return RunState.FAILED.value, error

    def serve(self, status, ready_timeout_s: float) -> tuple[str, dict | None]:
        """Start both, then hold until the trainer says bye (its state), the trainer host is lost, or the server
        dies: the run's end state and error (None: done)."""
        from remote.extract.engines.vllm_server import ServerFailed
        from remote.wire import status as wire_status
        from remote.wire.contract import RunState

        self.watch.start()
        if self.hosts is not None:
            self.hosts.start()
            node = self.disagg["replica"]
            status.update(replica={k: node.get(k) for k in ("name", "hosts", "ranks_per_node", "tp")})
        status.update(online_server=self.online.launch())
        try:
            ready = self.online.wait_ready(ready_timeout_s)
        except ServerFailed as exc:  # a worker host lost while it loaded: that host is the cause
            if self.hosts is None or self.hosts.lost is None:
                raise
            return self._ended(self.hosts.cause(wire_status.error_from(exc), time.monotonic(), 0))
        self.ready = True
        endpoint = self.online.endpoint
        record = {**status.data.get("online_server", {}), "endpoint": endpoint, "ready_s": round(ready, 1),
                  "layer_ids": self.online.server.layer_ids, "command": self.online.server.command,
                  "trainer_host": self.disagg["trainer_host"]}
        status.update(state=RunState.EXTRACTING.value, phase=f"serving the trainer on {self.disagg['trainer_host']}",
                      online_server=record)
        self.watch.broadcast("ready", endpoint=endpoint)
        if self.hosts is not None:  # the worker hosts' ranks now serve (their status says so)
            self.hosts.broadcast("ready")
        print(f"[specops] online extraction server ready in {ready:.0f}s at {endpoint} for the trainer on "
              f"{self.disagg['trainer_host']}", flush=True)
        since = time.monotonic()
        while True:
            lost = self.watch.wait_lost(WATCH_S)
            if 1 not in self.watch.nodes and time.monotonic() - since > replica.CONNECT_TIMEOUT_S:
                # a trainer half that failed before it joined (and no laptop left to abort this one)
                return RunState.FAILED.value, wire_status.error(
                    "TrainerLost", f"the trainer on host {self.disagg['trainer_host']} never joined in "
                                   f"{replica.CONNECT_TIMEOUT_S:.0f} s; the server was stopped",
                    where=f"trainer on host {self.disagg['trainer_host']}")
            if lost is not None:
                return RunState.FAILED.value, wire_status.error(
                    "TrainerLost", f"the trainer on host {self.disagg['trainer_host']} is gone: {lost['message']}; "
                                   f"the server was stopped", where=f"trainer on host {self.disagg['trainer_host']}")
            bye = (self.watch.nodes.get(1) or {}).get("bye")
            if bye:
                if bye == RunState.DONE.value:
                    return bye, None
                return (RunState.ABORTED.value if bye == RunState.ABORTED.value else RunState.FAILED.value,
                        wire_status.error("TrainerEnded", f"the trainer on host {self.disagg['trainer_host']} ended "
                                          f"{bye}; the server was stopped",
                                          where=f"trainer on host {self.disagg['trainer_host']}"))
            if self.hosts is not None and self.hosts.lost is not None:  # a worker host's ranks died, or it did
                return self._ended(self.hosts.lost)
            if not self.online.server.alive:
                error = self.online.error()
                if self.hosts is not None:  # the head's server may have died of a worker host's loss
                    from remote.extract.supervisor import WORKER_LOSS_GRACE_S

                    error = self.hosts.cause(error, time.monotonic(), WORKER_LOSS_GRACE_S)
                return self._ended(error)

    def stop(self, state: str | None = None) -> list[int]:
        killed = self.online.stop()
        ended = f"the server host {self.disagg['server_host']}'s run ended {state}"
        if self.hosts is not None:  # the worker hosts stop their ranks and end in this state
            self.hosts.close(state, ended)
        self.watch.close(state, ended)
        return killed


class RemoteServer:
    """The trainer host's view of a disaggregated run's server: the server host's supervisor joined as a replica's
    worker joins its head (hello; ``ready`` brings the endpoint; an ``end`` or a closed connection is the server
    gone), with :class:`OnlineServer`'s interface, so the supervisor runs the trainer the same either way."""

    def __init__(self, params: dict):
        self.disagg = dict(params["online_server"])
        self.died: dict | None = None
        self.sock = None
        self._endpoint: str | None = None
        self._lines = None
        self._stopping = threading.Event()

    def launch(self) -> dict:
        """Join the server host's watch (it may still be starting: retried up to its connect timeout)."""
        import os

        self.sock = replica.connect_to_head(watch_block(self.disagg), replica.CONNECT_TIMEOUT_S)
        replica.send(self.sock, "hello", host=self.disagg["trainer_host"], node_rank=1, ranks=[1], pid=os.getpid())
        self._lines = replica.Lines(self.sock)
        return {"server_host": self.disagg["server_host"], "address": self.disagg["address"],
                "port": int(self.disagg["port"]), "watch_port": int(self.disagg["watch_port"])}

    def wait_ready(self, timeout_s: float) -> float:
        """Until the server host says ``ready``: seconds it took.

        :raises ServerFailed: the server host's run ended, or went away, first."""
        from remote.extract.engines.vllm_server import ServerFailed

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            messages = self._lines.read(1.0)
            if messages is None:
                raise ServerFailed(server_died(self.disagg, "its supervisor's connection closed before the server "
                                                            "answered")["message"])
            for msg in messages:
                if msg.get("event") == "ready":
                    self._endpoint = str(msg["endpoint"])  # the server half's OnlineServer.endpoint, /v1 included
                    return time.monotonic() - t0
                if msg.get("event") == "end":
                    raise ServerFailed(server_died(self.disagg, str(msg.get("message")), msg.get("host"))["message"])
        raise ServerFailed(f"the online extraction server on host {self.disagg['server_host']} did not answer in "
                           f"{timeout_s:.0f} s")

    @property
    def endpoint(self) -> str:
        return self._endpoint or ""

    def watch(self, on_death) -> None:
        """Call ``on_death(error)`` once if the server host's run ends or goes away before :meth:`stop`."""
        def loop():
            while not self._stopping.is_set():
                messages = self._lines.read(WATCH_S)
                if self._stopping.is_set():
                    return
                end = next((m for m in messages or [] if m.get("event") == "end"), None)
                if messages is None or end is not None:
                    cause = (str(end.get("message")) if end else
                             "its supervisor's connection closed with no word (the host died or its run was killed)")
                    self.died = server_died(self.disagg, cause, (end or {}).get("host"))
                    on_death(self.died)
                    return
        threading.Thread(target=loop, daemon=True, name="online-remote-server-watch").start()

    def stop(self, state: str | None = None) -> list[int]:
        """Say bye with the trainer's state: the server host's run stops its server and ends in it."""
        self._stopping.set()
        if self.sock is not None:
            replica.send(self.sock, "bye", state=state or "failed")
            try:
                self.sock.close()
            except OSError:
                pass
        return []


class _HeadlessRanks:
    """A worker host's ranks of the online server replica, as :class:`remote.extract.replica.NodeSupervisor` drives
    an engine (``load``, ``server``, ``close``, ``error_record``): the run's own :class:`OnlineServer`, headless."""

    def __init__(self, online: OnlineServer, on_launch):
        self.online, self.server, self.params = online, online.server, {}
        self._on_launch = on_launch

    def load(self) -> None:
        self._on_launch(self.online.launch())
        self.online.wait_ready(0)  # headless: at once, or the exception its log names if it already died

    def close(self) -> None:
        self.server.stop(grace_s=float(self.params.get("stop_grace_s") or STOP_GRACE_S))

    def error_record(self, exc: BaseException) -> dict | None:
        """The ranks' server dead (``exc`` its :class:`ServerFailed`): its pid, and what killed it or what it raised,
        in its log's words (None: another failure, which the node supervisor names itself)."""
        from remote.extract.engines.vllm_server import ServerFailed
        from remote.system import signals
        from remote.wire import status as wire_status

        if not isinstance(exc, ServerFailed) or self.server.proc is None:
            return None
        death = exc.death or {}
        cause = exc.exception or death.get("message") or signals.describe_exit(self.server.proc.poll())["text"]
        return wire_status.error("OnlineServerDied", f"the online extraction server's headless ranks (pid "
                                                     f"{self.server.proc.pid}) died: {cause} (its log: "
                                                     f"{self.server.log_path})",
                                 where="online server ranks (headless)", log=str(self.server.log_path),
                                 death=death or None, log_tail=(exc.log_tail or "")[-3000:])


class OnlineServerNode(replica.NodeSupervisor):
    """A worker host of a disaggregated online run's server replica: its ranks headless, joined to the head's
    server, watched both ways exactly as an extraction replica's worker host (a dead head stops them; their death
    fails the head's run, and so the trainer's, naming this host)."""

    @staticmethod
    def replica_of(params: dict) -> dict:
        return params["online_server"]["replica"]

    def _engine(self):
        from remote.extract import samples
        from remote.train import plan as trainplan
        from remote.wire import manifest as run_manifest

        plan = trainplan.resolve(self.params)
        doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
        # the ranks stay in this supervisor's process group: an abort's SIGKILL to the group takes them
        online = OnlineServer(self.paths.run_dir, plan, {**(doc.get("params") or {}), "own_session": False},
                              {**self.params, "replica": self.replica})
        disagg = self.params["online_server"]
        self.status.update(online_server={"server_host": disagg["server_host"], "trainer_host": disagg["trainer_host"],
                                          "replica": self.replica.get("name"), "ranks": self.ranks})

        def launched(record: dict) -> None:
            self.status.update(online_server={**self.status.data.get("online_server", {}), **record,
                                              "command": online.server.command})
        return _HeadlessRanks(online, launched)


def serve_node(run_dir) -> int:
    """A worker host's run of an online server replica (:class:`OnlineServerNode`)."""
    return OnlineServerNode(Path(run_dir)).run()
