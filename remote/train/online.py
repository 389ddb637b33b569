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
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

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
        self.server = VllmServer(plan.model_path, tp=int(run_params.get("tp") or 1),
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

    def stop(self) -> list[int]:
        """Stop the server (and its engine and workers); the pids killed outright. A short grace: ``job abort``
        SIGKILLs the supervisor 10 s after its SIGTERM, and the server must be gone before."""
        self._stop.set()
        return self.server.stop(grace_s=STOP_GRACE_S)
