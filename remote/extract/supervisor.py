"""The supervisor around an extraction engine: ``python -m remote.extract.supervisor RUN_DIR``.

Started detached by :mod:`remote.run.job` (new session, stdin closed, output to
``RUN_DIR/logs/supervisor.log``). It reads ``RUN_DIR/params.json`` and:

0. resolves the run's plan once (:func:`remote.extract.runplan.resolve`: engine, layer ids and
   their convention, format, the model's layer count, output dir, sample range), records
   it in ``status.json`` (``plan``) and hands it to the engine;
1. turns the dataset into token ids (chat JSONL through the model's chat template,
   with a loss mask of 1 on assistant tokens; or pre-tokenized JSONL with
   ``input_ids``), honouring ``max_samples`` and ``seq_len`` (:mod:`remote.extract.dataset`);
2. resumes after the last complete sample already in the output dir;
3. runs the engine in batches and writes every sample atomically (``remote.extract.samples``) on
   a writer thread, so the engine works on the next batch while the last one is written
   (:class:`remote.extract.samplewriter.SampleWriter`; a bounded queue keeps memory in check, and progress and the
   resume point count only samples already on disk);
4. keeps ``RUN_DIR/status.json`` current (state, phase, samples, tokens/s, ETA,
   seconds per phase; a heartbeat every few seconds even while a model loads);
5. at the end writes ``manifest.json`` and ``summary.json`` (output dir and run dir).

Whatever goes wrong ends in ``state: failed`` with ``error`` = rank, exception type,
message and full traceback. For multi-process engines the root cause is the failing
rank's own exception (``RUN_DIR/errors/rank<k>.json`` written inside the worker, or
the last traceback in ``logs/rank<k>.log``), not the driver's generic "worker died"
(:mod:`remote.run.rootcause` picks it).
NaN or Inf in any captured layer is a failure too.

Only the standard library is imported at module import; vLLM spawns workers that
re-import this module as ``__mp_main__``, hence the ``__main__`` guard.
"""
from __future__ import annotations

import concurrent.futures
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from remote.extract import runplan, samples
from remote.extract.dataset import dataset_warnings, prepare_samples
from remote.extract.engines import engine_class
from remote.extract.sampleread import MAX_NONFINITE_LISTED, non_finite
from remote.extract.samplewriter import WRITE_QUEUE_BATCHES, SampleWriter
from remote.run import faults
from remote.run.lifecycle import StatusFile
from remote.run.rootcause import note_in_rank_log, root_cause, worker_errors
from remote.run.rundir import RunPaths
from remote.system import modelconfig
from remote.system.procgroup import kill_own_group_and_exit, stop_leftovers
from remote.verify import canary
from remote.wire import fsutil, manifest as run_manifest, status as wire_status
from remote.wire.contract import RunState, param

HEARTBEAT_S = 5.0
#: how long an aborted run gives its engine's processes to stop before they are killed:
#: well inside abort's own grace (10 s), which SIGKILLs the supervisor after it
ABORT_STOP_GRACE_S = 3.0
#: how long a worker's recorded error may go unanswered by the driver before the
#: supervisor stops waiting (a peer of a dead rank can hang in a collective forever).
WORKER_ERROR_GRACE_S = 20.0
#: after this host's server failed, how long to wait for a replica's worker host to say it was
#: the cause (:mod:`remote.extract.replica`).
WORKER_LOSS_GRACE_S = 10.0


class Aborted(BaseException):
    """SIGTERM/SIGINT reached the supervisor (``job abort``)."""


class NonFiniteStates(RuntimeError):
    """A captured layer holds NaN or Inf."""


# --------------------------------------------------------------------------- model facts

def model_config(model_path: str) -> dict:
    """The model's ``config.json``, read through :mod:`remote.system.modelconfig`.

    :raises FileNotFoundError: when the model dir or its config.json is missing.
    :raises ValueError: when config.json is not a JSON object.
    """
    try:
        return modelconfig.read(model_path)
    except modelconfig.ConfigError as exc:
        if not os.path.isfile(exc.path):
            raise FileNotFoundError(f"{exc.path} not found: model_path must be a local model directory") from None
        raise ValueError(f"{exc.summary}; {exc.fix}") from None


# --------------------------------------------------------------------------- the run

class Supervisor:
    """One attempt at a run: resume point, engine life cycle, progress, final files."""

    def __init__(self, run_dir):
        self.paths = RunPaths(run_dir)
        self.params = json.loads(self.paths.params.read_text())
        self.run_id = self.params.get("run_id") or self.paths.run_dir.name
        self.output_dir = Path(runplan.output_dir(self.params, self.paths.run_dir))
        self.status = StatusFile.begin(
            self.paths.status, self.run_id, samples_done=0, samples_total=None, tokens_done=0, tokens_per_s=None,
            eta_s=None, phase_seconds={}, output_dir=str(self.output_dir))
        # This attempt's root cause only: older worker errors go, rank logs are read from here on.
        for stale in self.paths.errors.glob("rank*.json"):
            stale.unlink()
        self.paths.log_offsets = {p.name: p.stat().st_size for p in self.paths.logs.glob("rank*.log")}
        self.phase_seconds: dict[str, float] = {}
        self._timing_lock = threading.Lock()  # the writer thread adds its time too
        self.engine = None
        self._busy_since = None  # set while the engine is inside load()/extract()
        self._stop = threading.Event()
        #: hs files digested as they landed in this attempt (index -> digest): not read again
        self.digests: dict[int, dict] = {}
        #: a replica over several hosts: the watch of its worker hosts (remote.extract.replica), and the
        #: error of the first one lost, which becomes the run's error
        self.watch = None
        self.lost_host: dict | None = None
        #: a replica over a Slurm job's nodes: the job step of its worker nodes (remote.extract.replica.JobStep)
        self.job_step = None

    # -- helpers
    def _timed(self, phase: str, seconds: float) -> None:
        with self._timing_lock:
            self.phase_seconds[phase] = round(self.phase_seconds.get(phase, 0.0) + seconds, 3)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.status.heartbeat(phase_seconds=dict(self.phase_seconds))

    def _watchdog(self) -> None:
        """Fail the run when a worker recorded an error the driver never answers."""
        first_seen = None
        while not self._stop.wait(1.0):
            if self._busy_since is None or not self.paths.errors.exists():
                first_seen = None
                continue
            if not worker_errors(self.paths.errors):
                continue
            first_seen = first_seen or time.monotonic()
            grace = float(self.params.get("worker_error_grace_s", WORKER_ERROR_GRACE_S))
            if time.monotonic() - first_seen < grace:
                continue
            error = root_cause(self.paths, None, deaths=self._deaths())
            error["note"] = (f"the driver was still waiting {grace:.0f}s after rank {error.get('rank')} "
                             f"failed (peers hang in collectives); the supervisor stopped the run")
            self.status.fail(error, phase_seconds=dict(self.phase_seconds))
            print(f"[specops] watchdog: {error['type']}: {error['message']}", flush=True)
            note_in_rank_log(self.paths, error)
            kill_own_group_and_exit(1)

    # -- the run
    def run(self) -> int:
        threading.Thread(target=self._heartbeat, daemon=True, name="specops-heartbeat").start()
        threading.Thread(target=self._watchdog, daemon=True, name="specops-watchdog").start()
        try:
            self._run()
            return 0
        except Aborted:
            # the cleanup below (stopping a server) must finish inside abort's grace, uninterrupted
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.engine is not None:
                self.engine.params["stop_grace_s"] = ABORT_STOP_GRACE_S
            return self._end(wire_status.error("Aborted", "aborted by request (SIGTERM)"), aborted=True)
        except BaseException as exc:  # every failure ends in status.json, with its root cause
            seen_at = time.monotonic()
            traceback.print_exc()
            in_engine = self._busy_since is not None and getattr(self.engine, "in_process", False)
            error = (self.engine.error_record(exc) if self.engine is not None else None) or \
                root_cause(self.paths, exc, exc_rank=0 if in_engine else None, deaths=self._deaths())
            if isinstance(exc, NonFiniteStates):
                error = wire_status.error_from(exc)
            error = self._lost_host(error, seen_at)
            # a replica's worker host aborted (the head unreachable from the laptop): the replica is aborted
            return self._end(error, aborted=error.get("type") == "Aborted")
        finally:
            self._stop.set()
            self._release_replica(self.status.data.get("state"),
                                  str((self.status.data.get("error") or {}).get("message") or ""))
            self._close_engine()
            # after the engine is closed: a server engine writes the rank logs as it stops
            note_in_rank_log(self.paths, self.status.data.get("error"))

    def _end(self, error: dict, *, aborted: bool) -> int:
        """The run's last word, written once what it holds is stopped: a status that says failed or aborted
        never stands beside a server still holding the devices (the same command run again would start a second)."""
        state = (RunState.ABORTED if aborted else RunState.FAILED).value
        self._release_replica(state, str(error.get("message") or ""))
        self._close_engine()
        return self.status.end(error, aborted=aborted, phase_seconds=dict(self.phase_seconds))

    # -- a replica over several hosts (remote.extract.replica)
    def _watch_replica(self) -> None:
        """On a replica's head: watch its worker hosts before the server starts (they join it)."""
        replica = self.params.get("replica")
        if not replica or int(replica.get("node_rank") or 0) != 0:
            return
        from remote.extract.replica import HostWatch

        self.watch = HostWatch(replica, self._on_host_lost)
        self.watch.start()
        self.watch.watch_own_ranks(lambda: getattr(self.engine, "server", None))
        step = self.job_step.start(self.watch) if self.job_step is not None else None
        self.status.update(replica={"name": replica.get("name"), "hosts": replica.get("hosts"),
                                    "ranks_per_node": replica.get("ranks_per_node"), "tp": replica.get("tp"),
                                    **({"addresses": replica["addresses"], "command": step} if step else {})})

    def _job_replica(self, engine_name: str) -> None:
        """A Slurm batch job over several nodes (``slurm.nodes``): the run is one replica over them, this batch host
        its head, the others a job step of headless ranks (:class:`remote.extract.replica.JobStep`)."""
        from remote.run import slurm

        if self.params.get("replica") or slurm.job_of(self.paths.run_dir) is None or slurm.job_node_count() < 2:
            return
        if engine_name != "vllm-server":
            raise ValueError(f"this Slurm job holds {slurm.job_node_count()} nodes (slurm.nodes), and one replica "
                             f"over several nodes is vLLM's multi-node runtime: the vllm-server engine, not "
                             f"{engine_name}; set engine: vllm-server, or slurm.nodes: 1")
        from remote.extract.replica import JobStep

        self.job_step = JobStep(self.paths.run_dir, self.params)
        self.params["replica"] = self.job_step.replica

    def _on_host_lost(self, error: dict) -> None:
        """A worker host failed or vanished: stop this host's server, so the request or the wait
        for readiness it holds fails now, and the run's error is that host's (:meth:`_lost_host`)."""
        self.lost_host = error
        engine = self.engine
        server = getattr(engine, "server", None)
        if server is not None:
            server.stop(ABORT_STOP_GRACE_S)

    def _lost_host(self, error: dict, seen_at: float) -> dict:
        """The run's error, given this host's own ``error`` seen at ``seen_at`` (monotonic): a worker host's
        when it is the cause (:meth:`remote.extract.replica.HostWatch.cause`)."""
        if self.watch is None:
            return error
        return self.watch.cause(error, seen_at, WORKER_LOSS_GRACE_S)

    def _release_replica(self, state: str | None, message: str) -> None:
        """Tell the worker hosts how the run ended (they stop their ranks), once."""
        if self.watch is not None:
            self.watch.close(state, message)
            self.watch_closed, self.watch = self.watch, None
        if self.job_step is not None:
            self.job_step.close()

    def _deaths(self) -> list[dict]:
        """The engine's processes that ended, as it saw them (an in-process engine is their parent)."""
        try:
            return self.engine.process_deaths() if self.engine is not None else []
        except Exception:  # never let the post-mortem hide the failure itself
            traceback.print_exc()
            return []

    def _close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except BaseException:
                traceback.print_exc()
            self.engine = None

    def _run(self) -> None:
        p = self.params
        t0 = time.monotonic()
        engine = runplan.resolve_engine(p.get("engine"))  # an engine that does not fit fails before any read
        model_path = p["model_path"]
        config = model_config(model_path)
        self.plan = plan = runplan.resolve(p, config, run_dir=self.paths.run_dir, engine=engine).require()
        engine_name, fmt, layer_ids, convention = plan.engine, plan.format, plan.layer_ids, plan.convention
        self.status.update(phase="tokenizing", layer_ids=layer_ids, layer_convention=convention,
                           engine=engine_name, engine_why=plan.engine_why, format=fmt, plan=plan.as_dict())

        t = time.monotonic()
        dataset, self.dataset_report = prepare_samples(p, model_path,
                                                       vocab_size=modelconfig.text_value(config, "vocab_size"))
        for line in dataset_warnings(self.dataset_report):
            print(f"[specops] warning: {line}", flush=True)
        self._timed("tokenize", time.monotonic() - t)
        if plan.sample_range is not None and len(dataset) != self.dataset_report["rows"]:
            # a group plan shards rows (remote/extract/shard.py counts them unparsed): another count shifts every range
            raise ValueError(
                f"this shard's group run planned {self.dataset_report['rows']} samples (one per row) but the rows "
                f"make {len(dataset)} ({self.dataset_report['dropped_count']} left out; turns: "
                f"{(self.dataset_report.get('chat_rule') or {}).get('turns', '-')}); for a run over several hosts "
                f"set turns: whole, long_samples: truncate and minimum_valid_tokens: 0, or give the rows one sample "
                f"each (pre-tokenized), or run on one host")
        lo, hi = plan.bounds(len(dataset))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.identity = samples.run_identity(dataset, model=modelconfig.summary(config), fmt=fmt,
                                             layer_ids=layer_ids, layer_convention=convention,
                                             state_format=plan.state_format)
        # the dir may be shared with the other shards of this run (one filesystem on every node)
        claimed = samples.claim_output_dir(
            self.output_dir, self.run_id, self.identity, (lo, hi),
            who={"host": socket.gethostname(), "run_dir": str(self.paths.run_dir), "pid": os.getpid()},
            legacy_fingerprint=samples.dataset_fingerprint(
                dataset, layer_ids=layer_ids, model_path=str(model_path), engine=engine_name,
                **({"sample_range": [lo, hi]} if p.get("sample_range") is not None else {})))
        if claimed["shared"]:
            print(f"[specops] output dir {self.output_dir} is shared with sample range(s) "
                  f"{', '.join(claimed['shared'])} of this run; this one writes [{lo}, {hi})", flush=True)
        removed = samples.remove_partials(self.output_dir, fmt, sample_range=(lo, hi), sole=not claimed["shared"])
        if removed:
            print(f"[specops] removed {len(removed)} partial file(s) of an earlier attempt: {removed}", flush=True)
        present = samples.present_indices(self.output_dir, fmt)
        todo = [i for i in range(lo, hi) if i not in present]
        done = (hi - lo) - len(todo)
        total_tokens = sum(len(ids) for ids, _ in dataset[lo:hi])
        tokens_before = total_tokens - sum(len(dataset[i][0]) for i in todo)
        self.status.update(samples_total=hi - lo, samples_done=done, tokens_done=tokens_before,
                           tokens_total=total_tokens, resumed_from=todo[0] if todo else hi,
                           sample_range=[lo, hi], dataset_samples=len(dataset),
                           phase_seconds=dict(self.phase_seconds))
        shard = f" (samples {lo}..{hi - 1} of {len(dataset)})" if (lo, hi) != (0, len(dataset)) else ""
        print(f"[specops] run {self.run_id}: {hi - lo} samples{shard}, {total_tokens} tokens; "
              f"{done} already on disk; engine {engine_name} ({plan.engine_why}); layers {layer_ids} ({convention})",
              flush=True)

        if todo:
            self._extract_all(engine_name, model_path, layer_ids, dataset, todo, fmt, done, tokens_before,
                              total_tokens)
        self._release_replica(RunState.DONE.value, "every sample of the shard is written")
        self._close_engine()
        self._finalize(engine_name, model_path, config, layer_ids, convention, dataset, (lo, hi), fmt, t0)

    def _engine_params(self, engine_name: str) -> dict:
        """The run params as the engine sees them (a server engine gets its run-scoped dirs)."""
        p = dict(self.params)
        if engine_name == "vllm-server":
            # storage/ and logs/ (server.log, split into rank<k>.log at the end) inside the run dir,
            # where `specops logs` and the root-cause reader look
            from remote.extract.engines.vllm_server.command import run_defaults

            p = run_defaults(p, self.plan.batch_size)
            p.update(work_dir=str(self.paths.run_dir), python=sys.executable)
        layout = self.layout
        if layout.dp > 1:  # one server per replica, each on its own devices (remote/extract/layout.py)
            if layout.problem:  # (one replica runs as it always did: the devices are preflight's to judge)
                raise ValueError(f"{layout.problem}; set dp so that dp x tp fits the host (or leave it out)")
            p["replica_sets"] = layout.sets
        return p

    @property
    def layout(self):
        """The host's ``dp x tp`` layout for this run (:mod:`remote.extract.layout`)."""
        if getattr(self, "_layout", None) is None:
            from remote.extract import layout

            self._layout = layout.of_host(self.params, int(param(self.params, "tp")), self.plan.engine)
        return self._layout

    def _extract_all(self, engine_name, model_path, layer_ids, dataset, todo, fmt, done, tokens_before,
                     total_tokens):
        p = self.params
        tp = int(param(p, "tp"))
        self.status.update(state=RunState.LOADING.value, phase=f"loading model ({engine_name}, tp={tp})")
        cls = engine_class(engine_name)
        self._job_replica(engine_name)
        self.engine = cls(model_path, tp, layer_ids, self._engine_params(engine_name), plan=self.plan)
        self._watch_replica()
        t = time.monotonic()
        self._busy_since = t
        try:
            self.engine.load()
        except BaseException:
            if self.watch is not None and self.watch.missing() and self.watch.lost is None:
                print(f"[specops] replica: host(s) {', '.join(self.watch.missing())} never joined", flush=True)
            raise
        self._busy_since = None
        if self.watch is not None:
            self.watch.broadcast("ready")
        self._timed("load", time.monotonic() - t)
        self.engine_info = self.engine.describe()

        batch_size = self.plan.batch_size
        delay = faults.batch_delay_s(p)  # a test's pause after each batch widens the mid-run window
        if delay:  # said once a start: a resume takes the pause of the call that starts it
            print(f"[specops] test pause: {delay:g} s after each batch", flush=True)
        progress = {"done": done, "tokens_done": tokens_before, "run_tokens": 0}
        loop_t0 = time.monotonic()
        samples_total = self.status.data["samples_total"]

        def written(n_samples: int, n_tok: int) -> None:  # once samples are on disk
            progress["done"] += n_samples
            progress["tokens_done"] += n_tok
            progress["run_tokens"] += n_tok
            self.loop_s = time.monotonic() - loop_t0
            rate = progress["run_tokens"] / max(self.loop_s, 1e-9)
            self.status.update(samples_done=progress["done"], tokens_done=progress["tokens_done"],
                               tokens_per_s=round(rate, 1),
                               eta_s=round((total_tokens - progress["tokens_done"]) / rate, 1) if rate else None,
                               phase=f"extracting ({progress['done']}/{samples_total})",
                               phase_seconds=dict(self.phase_seconds))

        self.status.update(state=RunState.EXTRACTING.value, phase="extracting",
                           phase_seconds=dict(self.phase_seconds))
        if fmt == samples.HS:
            self._extract_files(dataset, todo, batch_size, delay, written)
        else:
            self._extract_batches(dataset, todo, batch_size, delay, layer_ids, written, p)
        self.loop_s = time.monotonic() - loop_t0  # the last batch's write included
        self.run_tokens = progress["run_tokens"]
        self.engine_info = self.engine.describe()  # what each replica made (and lost) is known now

    def _extract_files(self, dataset, todo, batch_size, delay, written) -> None:
        """Engines that write each sample file themselves (a server): hand them chunks of indices.

        ``batch_size`` requests are in flight; a chunk is several times that so the
        server stays busy, except with the test pause, where a chunk is one batch. Each
        file's digest (sha256, statistics) is kept for the manifest, so no file is read
        twice. Files land without a per-file fsync: after each chunk one ``syncfs``
        makes the chunk durable, on a thread of its own so the server never waits on
        the disk; the last one finishes before the manifest is written.
        """
        chunk = (batch_size if delay else batch_size * 8) * len(getattr(self.engine, "servers", None) or [None])
        sample_dir = samples.sample_dir(self.output_dir, samples.HS)
        syncer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncfs")
        pending = None

        def landed(record):
            self.digests[record["index"]] = record.pop("digest")
            written(1, record["tokens"])

        try:
            for c0 in range(0, len(todo), chunk):
                part = [(i, dataset[i][0]) for i in todo[c0:c0 + chunk]]
                t = time.monotonic()
                self._busy_since = t
                self.engine.extract_files(part, sample_dir, on_done=landed)
                self._busy_since = None
                self._timed("extract", time.monotonic() - t)
                if pending is None or pending.done():  # at most one sync queued behind the running one
                    pending = syncer.submit(fsutil.sync_filesystem, sample_dir)
                if delay:
                    time.sleep(delay)
        finally:
            syncer.shutdown(wait=True)
        t = time.monotonic()
        fsutil.sync_filesystem(sample_dir)
        self._timed("sync", time.monotonic() - t)

    def _extract_batches(self, dataset, todo, batch_size, delay, layer_ids, written, p) -> None:
        """Engines that return states in memory: the supervisor writes them, on a writer thread."""
        # an engine of dp replica processes splits each batch among them (remote/extract/engines/replicas.py):
        # each replica computes batch_size samples per call, as one replica does
        batch_size *= max(1, int(getattr(self.engine, "dp", 1) or 1))
        writer = SampleWriter(self.output_dir, self._save,
                              lambda first, batch: written(len(batch), sum(len(ids) for ids, _ in batch)),
                              self._timed, depth=int(p.get("write_queue_batches", WRITE_QUEUE_BATCHES)))
        try:
            for run in _contiguous_runs(todo):
                for b0 in range(run[0], run[-1] + 1, batch_size):
                    batch = dataset[b0:min(b0 + batch_size, run[-1] + 1)]
                    t = time.monotonic()
                    self._busy_since = t
                    states = self.engine.extract([ids for ids, _ in batch])
                    self._busy_since = None
                    self._timed("extract", time.monotonic() - t)
                    self._check_batch(states, batch, layer_ids, b0)
                    writer.put(b0, batch, states)
                    if delay:
                        time.sleep(delay)
        except BaseException:
            # what was extracted before the failure is still written: a resume starts after it
            writer.close(raise_error=False)
            raise
        writer.close()

    def _check_batch(self, states, batch, layer_ids, b0) -> None:
        if len(states) != len(batch):
            raise RuntimeError(f"engine returned {len(states)} samples for a batch of {len(batch)} "
                               f"(samples {b0}..{b0 + len(batch) - 1})")
        for j, ((ids, _), layer_states) in enumerate(zip(batch, states)):
            if len(layer_states) != len(layer_ids):
                raise RuntimeError(f"sample {b0 + j}: engine returned {len(layer_states)} layers, "
                                   f"expected {len(layer_ids)} ({layer_ids})")
            for lid, h in zip(layer_ids, layer_states):
                if h.dim() != 2 or h.shape[0] != len(ids):
                    raise RuntimeError(f"sample {b0 + j}, layer {lid}: shape {list(h.shape)}, expected "
                                       f"[{len(ids)}, hidden]")
            places = non_finite(layer_states, layer_ids)
            if places:
                by_layer: dict = {}
                for place in places:
                    by_layer.setdefault(place["layer"], []).append(place)
                exc = NonFiniteStates(f"sample {b0 + j}: non-finite hidden states: " + ", ".join(
                    f"layer {lid}: {len(hit)} token(s), first {hit[0]['what']} at token {hit[0]['token']}"
                    for lid, hit in by_layer.items()))
                exc.detail = {"sample": b0 + j, "count": len(places), "places": places[:MAX_NONFINITE_LISTED],
                              "layers": [{"layer_id": lid, "tokens": len(hit), "first": hit[0]["what"],
                                          "first_token": hit[0]["token"]} for lid, hit in by_layer.items()]}
                raise exc

    def _save(self, idx, ids, mask, layer_states) -> None:
        """Write one sample (on the writer thread)."""
        import torch

        samples.save_sample(self.output_dir, idx,
                            torch.tensor(ids, dtype=torch.long),
                            [h.cpu() for h in layer_states],
                            torch.tensor(mask, dtype=torch.long))

    def _finalize(self, engine_name, model_path, config, layer_ids, convention, dataset, bounds, fmt, t0) -> None:
        lo, hi = bounds
        count = hi - lo
        self.status.update(state=RunState.WRITING.value, phase="writing manifest and summary")
        t = time.monotonic()
        engine_info = getattr(self, "engine_info", {"name": engine_name, "tp": param(self.params, "tp")})
        file_layer_ids = engine_info.get("file_layer_ids") or sorted(layer_ids)
        files, stats, tokens = samples.scan_samples(self.output_dir, range(lo, hi), layer_ids, fmt,
                                                    file_layer_ids=file_layer_ids, known=self.digests,
                                                    state_format=self.plan.state_format if fmt == samples.HS else None)
        token_dataset = samples.publish_token_dataset(self.output_dir, dataset, bounds,
                                                      self.identity["dataset_sha256"]) if fmt == samples.HS else {}
        dataset_files = token_dataset.get("files") or []
        self._timed("finalize", time.monotonic() - t)
        wall = time.monotonic() - t0
        run_tokens = getattr(self, "run_tokens", 0)
        extract_s = self.phase_seconds.get("extract", 0.0)
        loop_s = getattr(self, "loop_s", 0.0)
        layer_summaries = [s.as_dict() for s in stats]
        non_finite = [s for s in layer_summaries if s["nan"] or s["inf"]]
        # a canary that passed leaves its verdict and numbers where a user and the next step look
        # every data-parallel replica's first canary_samples asked
        asked = self.plan.canary_samples * max(1, int(engine_info.get("dp") or 1))
        canary_found = canary.summarize_run(self.paths.run_dir, asked, engine_name)
        manifest = run_manifest.build(
            run_id=self.run_id, fmt=fmt, engine=engine_info,
            model={"path": str(model_path), "config": modelconfig.summary(config)},
            layer_ids=layer_ids, convention=convention, sample_range=[lo, hi], dataset_samples=len(dataset),
            tokens=tokens, files=files, dataset_files=dataset_files, identity=self.identity,
            versions=dict(samples.package_versions(), python=sys.version.split()[0]), params=self.params,
            file_layer_ids=file_layer_ids, dataset_writer=token_dataset.get("writer"),
            state_format=self.plan.state_format, canary=canary_found,
            dataset_report=getattr(self, "dataset_report", None))
        summary = {
            "run_id": self.run_id,
            "ok": not non_finite,
            "samples": count,
            "tokens": tokens,
            "layers": layer_summaries,
            "layer_convention": convention,
            "state_format": self.plan.state_format,
            "sample_range": [lo, hi],
            "tokens_this_attempt": run_tokens,
            # engine time only / extraction loop (engine + writes) / whole attempt (load included)
            "extract_tokens_per_s": round(run_tokens / extract_s, 1) if extract_s else None,
            "tokens_per_s": round(run_tokens / loop_s, 1) if loop_s else None,
            "end_to_end_tokens_per_s": round(run_tokens / wall, 1) if run_tokens else None,
            "phase_seconds": dict(self.phase_seconds),
            "wall_s": round(wall, 3),
            "attempt": self.status.data.get("attempt"),
            **({"canary": canary_found} if canary_found is not None else {}),
        }
        # this range's own files never collide with another shard's on a shared dir; the dir's
        # own manifest.json is this run's only while no other range claims the dir (else the
        # host-side merge, remote/extract/merge.py, writes it once every range is done)
        targets = [self.paths.run_dir, samples.shard_dir(self.output_dir, lo, hi)]
        if not [t for t in samples.read_claims(self.output_dir) if t != samples.shard_tag(lo, hi)]:
            targets.append(self.output_dir)
        for target in targets:
            run_manifest.write_atomic(target / samples.MANIFEST, manifest, temp_prefix=samples.TEMP_PREFIX)
            samples.write_json_atomic(target / samples.SUMMARY, summary)
        if non_finite:
            exc = NonFiniteStates("non-finite hidden states in the written samples: " + ", ".join(
                f"layer {s['layer_id']}: {s['nan']} NaN, {s['inf']} Inf" for s in non_finite))
            exc.detail = {"layers": non_finite}
            raise exc
        self.status.finish(samples_done=count, eta_s=0,
                           tokens_per_s=summary["tokens_per_s"], phase_seconds=dict(self.phase_seconds),
                           **({"canary": canary_found} if canary_found is not None else {}))


def _contiguous_runs(indices) -> list[list[int]]:
    """``[0, 1, 2, 5, 6]`` -> ``[[0, 1, 2], [5, 6]]`` (batches never span a gap)."""
    runs = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _on_signal(signum, _frame):
    raise Aborted(signal.Signals(signum).name)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m remote.extract.supervisor RUN_DIR", file=sys.stderr)
        return 2
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    sup = Supervisor(argv[0])
    os.environ["SPECOPS_RUN_DIR"] = str(sup.paths.run_dir)  # read by the vLLM worker hook
    code = sup.run()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on nothing may interrupt the cleanup
    left = stop_leftovers()
    if left:
        print(f"[specops] stopped {len(left)} leftover process(es) of this run: {left}", flush=True)
    print(f"[specops] supervisor exits {code} (state {sup.status.data.get('state')})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
