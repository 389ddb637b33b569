"""The supervisor of a training run: ``python -m remote.train.supervisor RUN_DIR`` (stdlib only at import).

Started detached by :mod:`remote.run.job` (``remote/train/task.py`` passes it as the run's entry),
like :mod:`remote.extract.supervisor` for an extraction, and keeps the same run dir contract:
``status.json`` (state, phase, heartbeat, error with traceback), ``logs/``, the pid file.
It resolves the plan from the states run's manifest (:func:`remote.train.plan.resolve`),
runs speculators' trainer as its child and reads the trainer's own log lines:

* each step's metrics line (``train/loss_0=..., train/full_acc_0=..., ..., epoch=E,
  global_step=S``) becomes the status's ``step``, ``epoch``, ``loss``, per-position
  ``accuracy`` and tokens/s (the trainer's ``profile/tokens_per_s``), and one line of
  ``metrics.jsonl`` in the run dir; each validation line (``val/...``) the same, marked ``val``;
* its progress bar (``N/M``) gives the steps per epoch, so the total and an ETA;
* the line goes to ``logs/train.log`` with its padding and bars shortened (the trainer
  is given a wide terminal so that no record wraps).

Meanwhile :class:`remote.train.memuse.MemorySampler` samples what the trainer's process tree holds
(GPU memory on a CUDA run, else resident) into the status's ``memory``, beside the
``train.memory`` preflight's estimate; final before done, failed or aborted is written.

The trainer is ``python -m speculators.train`` on a GPU host, or the test host's CPU
launcher shim where the env carries it and torch sees no CUDA device. On SIGTERM (``job
abort``) the trainer, in the same process group, gets it too: speculators saves an
``interrupted`` checkpoint and exits; the supervisor waits for that, then records
``aborted``. Starting the same run again resumes: speculators loads the last numbered
checkpoint in its save path (:func:`remote.train.plan.last_checkpoint`); the status says which
(``resumed_from``: epoch, global step).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from remote.extract import samples
from remote.run import slurm
from remote.run.lifecycle import StatusFile
from remote.run.rootcause import last_traceback
from remote.run.rundir import RunPaths, tail_text
from remote.system import modelconfig, signals
from remote.train import memory as trainmem, memuse, plan as trainplan
from remote.wire import status as wire_status
from remote.wire.contract import RunState

HEARTBEAT_S = 5.0
#: the terminal width the trainer's rich console is given: a metrics record stays on one line.
TRAINER_COLUMNS = "4000"
#: how long an aborted trainer may take to save its ``interrupted`` checkpoint
#: (job abort SIGKILLs the group 10 s after its SIGTERM).
ABORT_WAIT_S = 8.0
_METRIC_RE = re.compile(r"([A-Za-z_][\w/]*)=([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))")
_PROGRESS_RE = re.compile(r"(\d+)/(\d+)\s+\[")
_BAR_RE = re.compile(r"━{8,}")
_PAD_RE = re.compile(r" {8,}")


#: speculators' own lines for a streamed sample that failed (``train/recovery.py``): each failed round trip
#: (fetched again up to ``--generation-validation-retries`` more times), the last one of a sample given up
#: ("consecutive failures=c/max": dropped, never trained on)
_STREAM_FAIL_RE = re.compile(r"Hidden-state round trip failed for dataset index (\d+), file index (\d+) "
                             r"\(attempt (\d+)/(\d+)(?:, consecutive failures=(\d+)/(\d+))?\): (.*)")
#: the longest error text a status keeps of one failed round trip (a token ids mismatch prints every id)
STREAM_ERROR_CHARS = 300


def stream_failure(line: str) -> dict | None:
    """One failed round trip of an online run's sample (the trainer's log line), else None; ``row``: the token
    dataset's row (speculators' file index), ``dropped``: its last attempt failed too (the sample is skipped).

    >>> stream_failure("WARNING  Hidden-state round trip failed for dataset index 1, file index 1 (attempt 2/3): "
    ...                "APIConnectionError: Connection error.    recovery.py:99")
    {'row': 1, 'attempt': 2, 'attempts': 3, 'dropped': False, 'error': 'APIConnectionError: Connection error.'}
    """
    found = _STREAM_FAIL_RE.search(line)
    if not found or "TrainingInterruptedError" in found.group(7):  # a stop (abort, the server's death), no sample's
        return None
    error = re.split(r" {4,}", found.group(7).strip())[0]  # the log's padding (shortened) then its source
    return {"row": int(found.group(2)), "attempt": int(found.group(3)), "attempts": int(found.group(4)),
            "dropped": found.group(5) is not None, "error": error[:STREAM_ERROR_CHARS]}


def count_stream_failure(stream: dict | None, failed: dict) -> dict:
    """The run's ``online_stream`` record with one more failed round trip: every failure counted, the rows
    named, the samples given up (never trained on) counted and named apart."""
    stream = dict(stream or {"failed_round_trips": 0, "retried": 0, "dropped": 0, "rows": [], "dropped_rows": []})
    stream["failed_round_trips"] += 1
    stream["rows"] = sorted(set(stream["rows"]) | {failed["row"]})
    if failed["dropped"]:
        stream["dropped"] += 1
        stream["dropped_rows"] = sorted(set(stream["dropped_rows"]) | {failed["row"]})
    else:
        stream["retried"] += 1
    stream["last"] = failed
    return stream


def parse_metrics(line: str) -> dict | None:
    """The numbers of one trainer metrics line (``train/...`` or ``val/...``), else None.

    >>> parse_metrics("[12:00:01] INFO train/loss_0=0.004, train/full_acc_0=0.419, epoch=19, global_step=88  trainer.py:587")
    {'train/loss_0': 0.004, 'train/full_acc_0': 0.419, 'epoch': 19.0, 'global_step': 88.0}
    """
    if "train/" not in line and "val/" not in line:
        return None
    found = {k: float(v) for k, v in _METRIC_RE.findall(line)}
    return found if any(k.startswith(("train/", "val/")) for k in found) else None


def summarize(metrics: dict) -> dict:
    """Status fields from one metrics record: step, epoch, loss, per-position accuracy, tokens/s."""
    kind = "val" if any(k.startswith("val/") for k in metrics) else "train"
    suffix = "_epoch" if kind == "val" else ""
    accs = sorted((int(m.group(1)), v) for k, v in metrics.items()
                  if (m := re.fullmatch(rf"{kind}/full_acc_(\d+){suffix}", k)))
    out = {"kind": kind, "epoch": int(metrics.get("epoch", 0)),
           "loss": metrics.get(f"{kind}/loss{suffix}"), "accuracy": [round(v, 4) for _, v in accs]}
    if kind == "train":
        out["step"] = int(metrics.get("global_step", 0))
        out["tokens_per_s"] = metrics.get("profile/tokens_per_s")
    return out


def trainer_processes(params: dict, launcher: str) -> int:
    """Trainer processes to start: one per GPU the job sees (``CUDA_VISIBLE_DEVICES``, the job's env first)
    when the trainer's own module runs on a CUDA host, else one; ``gpus`` (a train parameter) caps it. Behind the
    CPU test host's launcher, ``gpus`` N starts N ranks under torchrun (gloo): how several ranks run with no GPU."""
    if launcher == trainplan.CPU_LAUNCHER_MODULE:
        return max(1, int(params.get("gpus") or 1))
    if launcher != trainplan.TRAINER_MODULE or str(params.get("device") or "cuda") != "cuda":
        return 1
    import shutil

    from remote.system import devices

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 1
    found = devices.query_nvidia_smi(smi)
    if found["error"]:
        return 1
    cvd = (params.get("env") or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    visible = len(devices.visible_gpus(found["gpus"], cvd))
    asked = params.get("gpus")
    return max(1, min(visible, int(asked)) if asked else visible)


def pick_launcher() -> str:
    """The CPU launcher shim where this env carries it and torch sees no CUDA device, else the trainer's own module."""
    import importlib.util

    if importlib.util.find_spec(trainplan.CPU_LAUNCHER_MODULE) is None:
        return trainplan.TRAINER_MODULE
    from remote.extract.engines.vllm_server.command import cuda_available

    return trainplan.TRAINER_MODULE if cuda_available() else trainplan.CPU_LAUNCHER_MODULE


class TrainSupervisor:
    def __init__(self, run_dir):
        self.paths = RunPaths(run_dir)
        self.params = json.loads(self.paths.params.read_text())
        # the last attempt's step and total stand until this one trains
        self.status = StatusFile.begin(self.paths.status, self.params.get("run_id"), kind="train",
                                       step=lambda previous: previous.get("step"),
                                       steps_total=lambda previous: previous.get("steps_total"))
        self.proc: subprocess.Popen | None = None
        #: ``train --online``: the run's extraction server (remote.train.online.OnlineServer)
        self.online = None
        self.aborted = False
        self._stop = threading.Event()
        self.steps_per_epoch = None
        self.in_validation = False
        self.epoch_seen, self.epoch_start = None, 0
        #: this attempt's training losses by step, and the first non-finite one ({"step", "epoch", "loss"})
        self.losses: dict[int, float] = {}
        self.diverged: dict | None = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.status.heartbeat()

    def run(self) -> int:
        threading.Thread(target=self._heartbeat, daemon=True).start()
        try:
            return self._run()
        except Aborted:
            self.status.end(wire_status.error(
                "Aborted", f"aborted by request (SIGTERM); the trainer saved {self.status.data.get('checkpoints')}"
                           f"/interrupted; the same train command resumes from the last epoch checkpoint"), aborted=True)
            return 143
        except BaseException as exc:  # every failure ends in status.json
            traceback.print_exc()
            self.status.end(wire_status.error_from(exc))
            return 1
        finally:
            self._stop.set()

    def _run(self) -> int:
        plan = trainplan.resolve(self.params)
        if self.params.get("regenerate"):
            plan = self._regenerate(plan)
        try:
            if (self.params.get("online_server") or {}).get("role") == "server":
                return self._serve_online(plan)
            if plan.online:
                self._start_online(plan)
            return self._train(plan)
        finally:
            if self.online is not None and not self.status.is_final:  # however the run ends, its server goes with it
                self.status.update(**self._stop_online("aborted" if self.aborted else "failed"))

    def _stop_online(self, ending: str) -> dict:
        """The run's online server stopped, told the run ends ``ending``: the status fields that say so."""
        self.status.before_final = None
        return {"online_server": {**self.status.data.get("online_server", {}),
                                  "stopped": True, "killed": self.online.stop(ending)}}

    def _serve_online(self, plan: trainplan.TrainPlan) -> int:
        """The server host's half of a disaggregated online run: its extraction server on the host's address, held
        until the trainer host's half ends; a server that dies fails both halves naming it
        (:class:`remote.train.online.OnlineServerHalf`)."""
        from remote.train import online
        from remote.wire import manifest as run_manifest

        doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
        half = online.OnlineServerHalf(self.paths.run_dir, plan, doc.get("params") or {}, self.params)
        self.status.update(state=RunState.LOADING.value, plan=plan.as_dict(),
                           phase=f"starting the online extraction server for the trainer on "
                                 f"{half.disagg['trainer_host']}")
        self.online = half  # however the run ends from here, it is stopped before the status says so
        self.status.before_final = self._stop_online
        state, error = half.serve(self.status, float(self.params.get("ready_timeout_s") or 900.0))
        if state == RunState.DONE.value:
            self.status.finish(eta_s=0)
            return 0
        print(f"[specops] {error['message']}", flush=True)
        if state == RunState.ABORTED.value:
            self.status.end(error, aborted=True)
            return 143
        self.status.fail(error)
        return 1

    def _start_online(self, plan: trainplan.TrainPlan):
        """``train --online``: the token dataset linked without its states, the extraction server started
        and answering; the plan then points the trainer at it (:mod:`remote.train.online`)."""
        from remote.train import online
        from remote.wire import manifest as run_manifest

        trainplan.link_token_dataset(plan)
        doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
        if self.params.get("online_server"):  # disaggregated: the server host's half serves, this host trains
            server = online.RemoteServer(self.params)
        else:
            server = online.OnlineServer(self.paths.run_dir, plan, doc.get("params") or {}, self.params)
        self.status.update(state=RunState.LOADING.value, phase="starting the online extraction server",
                           plan=plan.as_dict())
        # however the run ends from here (an abort while it loads too), it is stopped before the status says so
        self.online = server
        self.status.before_final = self._stop_online
        record = server.launch()
        self.status.update(online_server=record)  # its pid and marker while it loads
        ready = server.wait_ready(float(self.params.get("ready_timeout_s") or 900.0))
        plan.vllm_endpoint = server.endpoint
        local = getattr(server, "server", None)  # None: the server host's (its own status has its ids and command)
        record.update(endpoint=server.endpoint, ready_s=round(ready, 1), trainer_layer_ids=plan.trainer_layer_ids,
                      **({"layer_ids": local.layer_ids, "command": local.command} if local else {}))
        self.status.update(online_server=record)
        print(f"[specops] online extraction server ready in {ready:.0f}s at {server.endpoint} (ids "
              f"{local.layer_ids if local else online.capture_ids(plan)}; the trainer's aux ids "
              f"{plan.trainer_layer_ids})", flush=True)

    def _on_server_death(self, error: dict) -> None:
        """The online server died: the trainer is stopped (its read loop then ends) and the run fails naming it."""
        print(f"[specops] {error['message']}", flush=True)
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM first (speculators saves at its next step); a trainer stuck retrying the dead server's
            # requests (speculators' own backoff) never reaches one: killed after the abort's wait
            self.proc.terminate()
            try:
                self.proc.wait(timeout=ABORT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _train(self, plan: trainplan.TrainPlan) -> int:
        launcher = pick_launcher()
        nproc = trainer_processes(self.params, launcher)
        nodes = self.params.get("nodes") or None  # a run over several hosts: this host's place in it
        python = self.params.get("python") or sys.executable
        if nodes is None and slurm.job_of(self.paths.run_dir) and slurm.job_node_count() > 1:
            nodes = slurm.job_nodes_block(self.params.get("env"))  # a batch job over several nodes: one step
        head = trainplan.is_head(nodes)
        argv = plan.launch_argv(python, launcher, nproc,
                                # torchrun's per-rank dir beside logs/, whose plain files a fetch brings
                                self.paths.run_dir / trainplan.RANK_LOGS, nodes=nodes)
        step = (nodes or {}).get("slurm_step")
        if step:  # each node's torchrun, its rank Slurm's node id: the trainer is srun's, node 0 this batch host
            argv = slurm.node_step(argv, nodes["nnodes"], python,
                                   setup=(slurm.job_of(self.paths.run_dir) or {}).get("setup"))
        # an epoch dir the last attempt left half written (killed mid-save) would be what speculators resumes from
        set_aside = trainplan.set_aside_partial(plan.save_path) if not plan.dry_run else []
        for moved in set_aside:
            print(f"[specops] epoch {moved['epoch']}'s checkpoint lacks {', '.join(moved['missing'])} (the last "
                  f"attempt stopped while saving it): moved to {moved['to']}", flush=True)
        found = trainplan.last_checkpoint(plan.save_path)
        resumed = found if found and found["epoch"] is not None and not plan.dry_run else None
        self.status.update(state=RunState.LOADING.value, phase="starting the trainer", plan=plan.as_dict(),
                           launcher=launcher, processes=nproc, command=argv, resumed_from=resumed, set_aside=set_aside,
                           checkpoints=plan.save_path, epochs=plan.epochs, nodes=nodes)
        print(f"[specops] train run {plan.run_id}: {' '.join(argv)}" +
              (f"; resumes after epoch {resumed['epoch']} (global step {resumed['global_step']})" if resumed else ""),
              flush=True)
        # faulthandler: a trainer that faults leaves its stacks in train.log
        env = dict(os.environ, COLUMNS=TRAINER_COLUMNS, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        log_path = self.paths.log(trainplan.TRAIN_LOG)
        attempt_from = log_path.stat().st_size if log_path.exists() else 0  # train.log keeps every attempt's lines
        t0 = time.monotonic()
        with open(log_path, "a", encoding="utf-8") as log, \
                open(self.paths.run_dir / trainplan.METRICS_FILE if head else os.devnull, "a",
                     encoding="utf-8") as metrics_out:  # the one curve is the head's (rank 0 prints the metrics)
            # online: the trainer dies with the supervisor, as the server does (a dead supervisor leaves neither)
            started = argv
            if self.online is not None:
                from remote.extract.engines.vllm_server.process import die_with_parent

                started = die_with_parent(argv, self.params.get("python") or sys.executable)
            self.proc = subprocess.Popen(started, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=env, cwd=str(self.paths.run_dir),
                                         text=True, errors="replace", bufsize=1)
            sampler = self._memory_sampler(plan, self.proc.pid, by_marker=bool(step))
            if self.online is not None:
                self.online.watch(self._on_server_death)
            try:
                for raw in self.proc.stdout:
                    line = _PAD_RE.sub("    ", _BAR_RE.sub("━━━", raw.rstrip()))
                    log.write(line + "\n")
                    log.flush()
                    self._on_line(line, metrics_out, t0)
                code = self.proc.wait()
            finally:  # the final peak is in the status before done, failed or aborted is
                self.status.update(memory=sampler.stop())
        if self.online is not None and self.online.died and not self.aborted:
            self.status.fail({**self.online.died, "trainer_exit_code": code})
            return 1
        if self.diverged:
            self.status.fail(diverged_error(self.diverged))
            return 1
        if self.aborted:
            raise Aborted("SIGTERM")
        if code != 0:
            tail = tail_text(log_path, 20000)
            rank = trainplan.failing_rank(tail) if nproc > 1 else None
            found = last_traceback(trainplan.rank_lines(tail, rank) if rank is not None else tail) or {}
            error = wire_status.error(found.get("type") or "TrainerExited",
                                      found.get("message") or f"the trainer exited with code {code}", rank=rank or 0,
                                      where="trainer" if nproc == 1 else f"trainer rank {rank} (torchrun)",
                                      traceback=found.get("traceback") or "", exit_code=code)
            if step:  # the node srun says ended badly (the step's other tasks were killed for it)
                this_attempt = min(200_000, max(0, log_path.stat().st_size - attempt_from))
                lost = slurm.failed_step_task(tail_text(log_path, this_attempt))
                if lost:
                    error["node"] = {"rank": lost["rank"], "host": lost["host"]}
                    error["message"] = (f"node {lost['rank']} ({lost['host']}) of the job's {nodes['nnodes']}: "
                                        f"{lost['said']}; {error['message']}")
            elif nodes:  # which host of a run over several this is (the laptop names the lost one)
                error["node"] = {"rank": int(nodes["node_rank"]), "host": nodes["hosts"][int(nodes["node_rank"])]}
            if code < 0:  # killed by a signal (an OOM kill, a preemption, a fault): say which, and what it means
                error = {**signals.death_record("trainer", code, pid=self.proc.pid, rank=0, source=str(log_path)),
                         "where": "trainer"}
                error["message"] += "; the same train command resumes from the last epoch checkpoint"
            full = disk_full(plan.save_path, tail)
            if full:  # torch's save says "file write failed", not why: the cause first
                error = {**error, "cause": "ENOSPC", "message": f"{full}; the trainer's own error: {error['message']}"}
            self.status.fail({**error, "log_tail": tail[-4000:]})
            return 1
        if not head:  # a headless node: the head (node 0) holds the run's curve and its checkpoints
            self.status.finish(eta_s=0, wall_s=round(time.monotonic() - t0, 1),
                               headless=f"node {nodes['node_rank']} of {nodes['nnodes']} (the curve and "
                                     f"the checkpoints are on {nodes['hosts'][0]})")
            return 0
        final = trainplan.last_checkpoint(plan.save_path)
        if final is None:
            raise RuntimeError(f"the trainer exited 0 but left no checkpoint in {plan.save_path}")
        learned = learned_nothing(self.losses, plan.dry_run, resumed is not None)
        if learned:
            self.status.fail(learned, checkpoint=final)
            return 1
        # a resume that found the last epoch already saved trains nothing and prints no metrics: the final
        # epoch and step are the checkpoint's then
        reached = {key: value for key, value in (("epoch", final["epoch"]), ("step", final["global_step"]))
                   if value is not None and self.status.data.get(key) is None}
        step = self.status.data.get("step") or reached.get("step")
        done = {"steps_total": step} if step else {}
        if plan.online and plan.keep_states == "all":  # the streamed states, kept: an extraction run of their own
            from remote.train import keepstates

            done["kept_states"] = keepstates.write_kept_run(plan, self.params["work_dir"])
            print(f"[specops] the streamed states kept as extraction run {done['kept_states']['run_id']} "
                  f"({done['kept_states']['samples']} samples)", flush=True)
        self.status.finish(eta_s=0, checkpoint=final,
                           wall_s=round(time.monotonic() - t0, 1), **reached, **done)
        return 0

    def _memory_sampler(self, plan: trainplan.TrainPlan, pid: int, by_marker: bool = False) -> memuse.MemorySampler:
        """Samples what the trainer's processes hold (GPU memory on a CUDA run, else resident), beside the
        preflight's estimate; status.json's ``memory`` shows the peak so far. ``by_marker``: the trainer is a
        job step's (slurmstepd's children, not srun's): the processes here that carry the run's marker."""
        import shutil

        from remote.system import devices

        try:  # the preflight's own estimate; a draft it cannot size is measured without one
            estimate = trainmem.plan_estimate(plan, modelconfig.read(plan.model_path))[0]["need_bytes"]
        except Exception:  # measuring never fails the run
            estimate = None
        smi = shutil.which("nvidia-smi") if plan.device == "cuda" else None
        gpus, where = [], None
        if smi:
            found = devices.query_nvidia_smi(smi)
            gpus = found["gpus"]
            where = trainmem.free_memory("cuda", self.params.get("env"), gpus=gpus).get("where")

        def marked(run_dir=self.paths.run_dir, me=os.getpid(),
                   node=f"SLURM_NODEID={os.environ.get('SLURM_NODEID', '0')}".encode()) -> list:
            from remote.run.rundir import run_processes
            from remote.system import procscan

            # this node's: where the nodes share a kernel (a test cluster), the other node's ranks are not this one's
            return [p for p in run_processes(run_dir) if p != me and node in procscan.environ(p)]

        sampler = memuse.MemorySampler(pid, estimate_bytes=estimate, smi=smi, gpus=gpus, where=where,
                                       on_update=lambda memory: self.status.update(memory=memory),
                                       pids_of=marked if by_marker else None)
        self.status.update(memory=sampler.as_dict())
        return sampler.start()

    def _regenerate(self, plan: trainplan.TrainPlan) -> trainplan.TrainPlan:
        """``train --regenerate``: the target's own replies to ``from_run``'s rows, then their states
        (an extraction run with ``from_run``'s parameters), waited for; the plan of those states."""
        from remote.run import job
        from remote.train import regenerate
        from remote.wire import manifest as run_manifest

        doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
        self.status.update(state=RunState.LOADING.value, phase="regenerating: the target writes its own replies")
        record = regenerate.regenerate(self.paths.run_dir, doc=doc, model_path=plan.model_path,
                                       params={**self.params, "tp": (doc.get("params") or {}).get("tp")},
                                       seq_len=plan.sample_tokens, log=lambda line: print(line, flush=True))
        source = samples.read_json_quietly(Path(plan.states_run_dir) / "params.json") or doc.get("params") or {}
        start = regenerate.states_params(source, doc, work_dir=self.params["work_dir"], run_id=plan.run_id,
                                         rows_file=record["file"], samples=record["samples"])
        start["python"] = self.params.get("python") or sys.executable
        states = start["run_id"]
        made = {**{k: v for k, v in record.items() if k != "command"}, "states_run": states, "from_run": plan.from_run}
        self.status.update(phase=f"extracting the regenerated text (run {states})", states_run=states,
                           regenerated=made)
        print(f"[specops] extracting the states of the regenerated text: run {states}", flush=True)
        started = job.main(start)
        failed = [r for r in started["records"] if r["status"] == "fail"]
        if failed:
            raise RuntimeError(f"the extraction of the regenerated text (run {states}) did not start: "
                               f"{failed[0]['summary']}")
        try:
            final = regenerate.wait_run({"work_dir": self.params["work_dir"], "run_id": states})
        except BaseException:  # aborted while it runs: it goes down with this run
            job.main({"action": "abort", "work_dir": self.params["work_dir"], "run_id": states})
            raise
        if final.get("state") != RunState.DONE.value:
            err = final.get("error") or {}
            raise RuntimeError(f"the extraction of the regenerated text (run {states}) ended {final.get('state')}: "
                               f"{err.get('type')}: {err.get('message')} (specops logs --run-id {states})")
        regen_plan = trainplan.resolve({**self.params, "from_run": states})
        regen_plan.regenerated = made
        from remote.train.task import check_data  # the regenerated states' own dataset, bound to them as any run's

        self.status.update(data_check=check_data(regen_plan))
        return regen_plan

    def _on_line(self, line: str, metrics_out, t0: float) -> None:
        failed = stream_failure(line) if self.online is not None else None
        if failed:  # the run's record counts every failed round trip and names the rows
            self.status.update(online_stream=count_stream_failure(self.status.data.get("online_stream"), failed))
        progress = _PROGRESS_RE.search(line)
        if progress and "Epoch" in line and not self.in_validation:
            self.steps_per_epoch = int(progress.group(2))  # the epoch's bar, printed as it ends
        if "Validation epoch" in line:
            self.in_validation = "started" in line
        found = parse_metrics(line)
        if not found:
            if "Training epoch" in line and "started" in line:
                self.status.update(state=RunState.TRAINING.value, phase=line.split("INFO", 1)[-1].split("  ")[0].strip())
            return
        summary = summarize(found)
        metrics_out.write(json.dumps({"t": round(time.monotonic() - t0, 3), **summary, "metrics": found}) + "\n")
        metrics_out.flush()
        if summary["kind"] == "val":
            self.status.update(val_loss=summary["loss"], val_accuracy=summary["accuracy"])
            return
        loss = summary["loss"]
        if loss is not None:
            self.losses[summary["step"]] = loss
            if not math.isfinite(loss) and self.diverged is None:  # every later step is nan too: stop now
                self.diverged = {"step": summary["step"], "epoch": summary["epoch"], "loss": loss}
                print(f"[specops] the training loss is {loss} at step {summary['step']}: stopping the trainer",
                      flush=True)
                if self.proc is not None and self.proc.poll() is None:
                    self.proc.terminate()
        epochs = int(self.status.data.get("epochs") or 1)
        step = summary["step"] + 1
        if summary["epoch"] != self.epoch_seen:  # batches per epoch vary a little (packing): estimate per epoch
            self.epoch_seen, self.epoch_start = summary["epoch"], step - 1
        total = (max(step, self.epoch_start + self.steps_per_epoch * (epochs - summary["epoch"]))
                 if self.steps_per_epoch else None)
        rate = summary.get("tokens_per_s")
        elapsed = time.monotonic() - t0
        first = self.status.data.get("first_step_this_attempt") or step
        eta = (total - step) * elapsed / max(1, step - first + 1) if total else None
        self.status.update(state=RunState.TRAINING.value, phase=f"training (epoch {summary['epoch'] + 1}/{epochs})",
                           step=step, steps_total=total, epoch=summary["epoch"], loss=summary["loss"],
                           accuracy=summary["accuracy"], tokens_per_s=rate, first_step_this_attempt=first,
                           eta_s=round(eta, 1) if eta is not None else None,
                           samples_done=step, samples_total=total)


#: what a write to a full disk leaves in a trainer's log (errno 28; torch's writer says only "file write failed")
_NO_SPACE_RE = re.compile(r"No space left on device|Errno 28\b|ENOSPC")
#: free bytes below which the save path's disk counts as full once a trainer failed
FULL_BELOW_BYTES = 64 << 20


def disk_full(save_path, log_tail: str) -> str | None:
    """The cause of a failed trainer when its checkpoint disk is full (its log says ENOSPC, or the disk has
    under :data:`FULL_BELOW_BYTES` free), in words with the numbers and what to do; else None."""
    import shutil

    where = Path(save_path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        usage = None
    said = bool(_NO_SPACE_RE.search(log_tail or ""))
    if not said and (usage is None or usage.free >= FULL_BELOW_BYTES):
        return None
    free = f"{usage.free / 2**20:.0f} MiB free of {usage.total / 2**30:.1f} GiB" if usage else "its size unknown"
    return (f"the disk holding the checkpoints ({where}) is full (ENOSPC: {free}): free space there (or train "
            f"under a work_dir with room), then run the same train command to resume from the last whole epoch")


def diverged_error(found: dict) -> dict:
    """The run's error when the training loss became nan/inf (``found``: its first such step)."""
    return wire_status.error(
        "LossNotFinite", f"the training loss is {found['loss']} at step {found['step']} (epoch {found['epoch']}): the "
                         f"run diverged and its draft is useless; train again under a new --run-id with a lower "
                         f"learning rate (--trainer-arg=--lr=...), or check the states (specops verify)",
        rank=0, where="trainer", step=found["step"], epoch=found["epoch"])


def learned_nothing(losses: dict, dry_run: bool, resumed: bool) -> dict | None:
    """The run's error when a trainer that exited 0 cannot have learned anything, else None: no training
    step at all (a fresh run), a loss of 0 at every step (no token supervised: every sample skipped or
    masked), or one loss that never moved over several steps. A dry run trains nothing by design."""
    if dry_run:
        return None
    values = [losses[k] for k in sorted(losses)]
    why = None
    if not values and not resumed:
        why = "the trainer exited 0 without a single training step"
    elif values and all(v == 0 for v in values):
        why = (f"the training loss was 0 at every one of {len(values)} step(s): no token was supervised (every "
               f"sample skipped, or every loss_mask 0)")
    elif len(values) > 2 and len(set(values)) == 1:
        why = f"the training loss stayed {values[0]} over {len(values)} steps: the draft learned nothing"
    if why is None:
        return None
    return wire_status.error(
        "NothingLearned", f"{why}; its checkpoint is not a trained draft. Check the states and their token dataset "
                          f"(specops train runs train.data first; specops verify), then train under a new --run-id",
        rank=0, where="trainer")


class Aborted(BaseException):
    """SIGTERM/SIGINT reached the supervisor (``job abort``)."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m remote.train.supervisor RUN_DIR", file=sys.stderr)
        return 2
    params = json.loads(RunPaths(argv[0]).params.read_text())
    from remote.train import online

    if online.node_rank(params.get("online_server") or {}) > 0:  # a worker host of the online server's replica
        return online.serve_node(argv[0])
    sup = TrainSupervisor(argv[0])
    os.environ["SPECOPS_RUN_DIR"] = str(sup.paths.run_dir)

    def on_signal(signum, _frame):
        # the trainer is in our process group and got the same signal from job abort; it saves
        # its interrupted checkpoint and exits, which ends the read loop
        sup.aborted = True
        if sup.proc is not None and sup.proc.poll() is None:
            try:
                sup.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                sup.proc.wait(timeout=ABORT_WAIT_S)
            except subprocess.TimeoutExpired:
                sup.proc.kill()
        else:
            raise Aborted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = sup.run()
    print(f"[specops] supervisor exits {code} (state {sup.status.data.get('state')})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
