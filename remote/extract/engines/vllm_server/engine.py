"""The ``vllm-server`` engine: the supervisor's plug for :class:`~.process.VllmServer`.

``load`` starts the server and waits until it answers, ``extract_files`` sends the
samples as ``/v1/completions`` requests (several in flight) and lands each file the
connector writes (:func:`~.landing.land_sample`), ``close`` stops the server, and
``error_record`` turns a dead server's own exception into the run's error.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import sys
import threading
import time
from pathlib import Path

from remote.extract import samples
from remote.extract.engines import Engine
from remote.run import faults
from remote.system import modelconfig
from remote.wire import contract, layers
from remote.wire.contract import VLLM_SERVER

from . import chunking
from .command import (SERVED_MODEL_NAME, SPECOPS_FP8_CONNECTOR_CLASS, batched_tokens,
                      connector_options, fp8_fallback, kv_transfer_config, pick_connector, writer_threads)
from .landing import (THREADS_UP_TO, DigestPool, DigestSlots, SampleRejected, default_digest_workers, land_sample,
                      usable_cores, wait_for_file)
from .logs import ServerFailed
from .process import VllmServer
from .prompt_logprobs import PromptLogprobs

#: tokens of the prompt-logprobs warm-up request (:meth:`VllmServerEngine._warm_up_logprobs`)
WARM_UP_TOKENS = 8
#: how long a missing file waits for the server's log to name why (a worker's traceback follows its reply)
LOG_GRACE_S = 5.0


class VllmServerEngine(Engine):
    """The supervisor's plug for :class:`~.process.VllmServer` (see the package docstring).

    ``params``: ``work_dir`` (run-scoped; default a fresh dir under the system temp
    dir), ``device``, ``seq_len``, ``concurrency`` (requests in flight, default 8),
    ``ready_timeout_s``, ``request_timeout_s``, plus what :func:`~.command.server_command` reads.
    """

    name = VLLM_SERVER
    in_process = False

    def load(self) -> None:
        """Start the server and wait until it answers; one retry if another process took the port."""
        self.config = modelconfig.read(self.model_path)
        self.num_model_layers = self.plan.num_layers  # the run's N (remote.extract.runplan)
        self.hidden_size = modelconfig.text_value(self.config, "hidden_size")
        problems = layers.layer_id_problems(self.layer_ids, self.num_model_layers, layers.INPUT)
        if problems:
            raise ValueError("; ".join(problems))
        #: vLLM captures a sorted set of ids: the order of the file's layer axis.
        self.file_layer_ids = sorted(self.layer_ids)
        #: bf16 or fp8 (the run's ``format``): the connector the server loads, what each file must hold.
        self.state_format = self.plan.state_format
        self.params["format"] = self.state_format
        work_dir = self.params.get("work_dir")
        if not work_dir:
            import tempfile
            work_dir = tempfile.mkdtemp(prefix="specops-vllm-server-")
        if "language_model_only" not in self.params and modelconfig.is_wrapped(self.config):
            # a multimodal wrapper (Kimi-K2.5): extraction feeds text only
            self.params["language_model_only"] = True
        #: data-parallel replicas (the supervisor's ``replica_sets``, remote/extract/layout.py): one server each
        sets = self.params.get("replica_sets") or [None]
        #: the canary samples' prompt logprobs (each replica's first few samples), and their check as they land
        self.logprobs = PromptLogprobs(self.params, work_dir, self.plan.canary_samples, replicas=len(sets))
        self.canary, self._canary_lock = None, threading.Lock()
        #: chunked prefill: on where the installed connector writes once a request is done (chunking.py)
        connector = pick_connector(self.params)  # once: the server loads the one its verdict read
        #: format fp8 on hs-connectors' own connector: why specops' (quantized on the device) could not run
        self.fp8_fallback = ((fp8_fallback(self.params) or None)
                             if self.params.get("format") == contract.FP8
                             and connector[0] != SPECOPS_FP8_CONNECTOR_CLASS and not self.params.get("kv_connector")
                             else None)
        self.chunked = self._chunked_prefill(connector)
        self.params["chunked_prefill_on"] = self.chunked["on"]
        self.servers = [VllmServer(self.model_path, tp=self.tp, layer_ids=self.file_layer_ids,
                                   work_dir=work_dir, max_model_len=self._max_model_len(),
                                   params=self.params if len(sets) == 1 else {
                                       k: v for k, v in self.params.items() if k != "port"},
                                   python=self.params.get("python") or sys.executable,
                                   devices=devices, replica=None if len(sets) == 1 else f"dp{i}")
                        for i, devices in enumerate(sets)]
        self.server = self.servers[0]
        #: samples each replica made, and the replicas lost on the way (``on_replica_loss: continue``)
        self.replica_samples = [0] * len(self.servers)
        self.replicas_lost: list[dict] = []
        for server in self.servers:
            server.connector = connector
        timeout = float(self.params.get("ready_timeout_s") or 900)
        self._start_digest_pool()
        try:
            for server in self.servers:  # every replica loads at once
                server.start()
            for server in self.servers:
                self._wait_ready(server, timeout)
            self.aux_ids_used = self._aux_ids_used()
            self.connector_options = self._connector_options()
            for server in self.servers:
                self._warm_up_logprobs(server)
            self._digest_pool_started()
        except BaseException:
            for server in self.servers:
                server.stop()
            raise

    @staticmethod
    def _wait_ready(server: VllmServer, timeout: float) -> None:
        """Wait until ``server`` answers; one restart on another port if another process took its port."""
        try:
            server.wait_ready(timeout=timeout)
        except ServerFailed as exc:
            if "address already in use" not in (exc.log_tail or "").lower():
                raise
            server.stop()
            server.params.pop("port", None)
            server.start()
            server.wait_ready(timeout=timeout)

    def _aux_ids_used(self) -> dict | None:
        """The aux ids vLLM logged taking (:mod:`.aux_ids`); a ServerFailed naming both lists when they are
        not the ids this run sent (its states would hold other layers under these ids' names)."""
        from remote.extract.engines.vllm_server import logs as server_log

        first = None
        for server in self.servers:
            log_text = server_log.read_log(server.log_path)
            used = server_log.aux_ids_used(log_text)
            if server is self.server:
                self.model_runner, first = server_log.model_runner(log_text), used
            if used is not None and used["ids"] != list(self.file_layer_ids):
                raise ServerFailed(f"{server.replica + ': ' if server.replica else ''}vLLM took aux layer ids "
                                   f"{used['ids']} (from its {used['source']}), not the run's "
                                   f"{list(self.file_layer_ids)}: '{used['line']}'", server.log_path)
        return first

    def _start_digest_pool(self) -> None:
        """The digest processes (:class:`~.landing.DigestPool`, one per usable core), started while
        the server loads, where the host has more than :data:`~.landing.THREADS_UP_TO` cores or the
        run says ``digest_in: processes``; otherwise, or with ``digest_in: threads``, or where
        processes cannot start, the digests run on this process's threads (the manifest's
        ``engine.digest_in`` says which, and why)."""
        self.digest_pool = None
        asked, cores = self.params.get("digest_in") or "auto", usable_cores()
        if self.server.headless:
            self.digest_in = {"where": None, "why": "a replica's worker host lands no file"}
            return
        if asked == "threads" or (asked == "auto" and cores <= THREADS_UP_TO):
            why = "digest_in: threads" if asked == "threads" else (
                f"{cores} usable core(s): threads, which contend only past {THREADS_UP_TO}")
            self.digest_in = {"where": "threads", "why": why}
            return
        try:
            self.digest_pool = DigestPool(cores)
            self.digest_pool.start()
        except (OSError, ImportError, RuntimeError) as exc:
            self.digest_pool = None
            self.digest_in = {"where": "threads", "why": f"digest processes could not start: {type(exc).__name__}: {exc}"}

    def _digest_pool_started(self) -> None:
        if self.digest_pool is None:
            return
        try:
            self.digest_in = {"where": "processes", **self.digest_pool.wait_started()}
        except Exception as exc:  # a process that died importing torch: digest here instead
            self.digest_pool.close()
            self.digest_pool = None
            self.digest_in = {"where": "threads", "why": f"digest processes failed to start: {type(exc).__name__}: {exc}"}

    def _warm_up_logprobs(self, server: VllmServer) -> None:
        """Pay the server's first prompt-logprobs request while loading: its one-time set-up (measured
        1.75 s on the 2-core CPU test host with the tiny Llama, every later request as fast as one
        without logprobs) would otherwise land in the extraction's time with the first canary sample.
        A few tokens, their file deleted; a server that refuses the field is found here, before any
        sample (``unavailable.json`` says why, as when a canary sample's request is refused)."""
        if not self.logprobs.count or self.logprobs.dir is None or self.logprobs.unavailable:
            return
        if server.headless:  # a replica's worker host: no API server here (the head's engine pays it)
            return
        vocab = int(modelconfig.text_value(self.config, "vocab_size") or 2)
        body = {"model": SERVED_MODEL_NAME, "prompt": [1 + i % (vocab - 1) for i in range(WARM_UP_TOKENS)],
                "max_tokens": 1, "temperature": 0.0, **self.logprobs.fields()}
        timeout = float(self.params.get("request_timeout_s") or 600)
        t0 = time.monotonic()
        log_at = server.log_size()
        try:
            reply = server.post_json("/v1/completions", body, timeout=timeout)
        except RuntimeError as exc:
            if " HTTP 4" not in str(exc):
                raise
            self.logprobs.refused(f"the server refused prompt_logprobs: {exc}")
            return
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            self._wait_for_file(path, timeout, log_at, "the prompt-logprobs warm-up request", server)
            os.unlink(path)
        self.logprobs_warm_up_s = max(getattr(self, "logprobs_warm_up_s", 0) or 0, round(time.monotonic() - t0, 3))

    def _chunked_prefill(self, connector: tuple) -> dict:
        """What the run asked (``chunked_prefill``: auto|on|off) against what the connector this host
        loads allows, read from its source; ``{"on", "asked", "why", "writes_in", "max_num_batched_tokens"}``.

        :raises ValueError: ``on`` against a connector that writes every step (naming the field).
        """
        try:
            verdict = chunking.installed_verdict(connector)
        except Exception as exc:  # noqa: BLE001 -- unreadable source: the one-shot path, said
            verdict = {"safe": False, "writes_in": [],
                       "why": f"the connector's source could not be read ({type(exc).__name__}: {exc}): "
                              f"chunked prefill stays off"}
        chunked = chunking.resolve(self.params.get("chunked_prefill"), verdict)
        budget = batched_tokens({**self.params, "chunked_prefill_on": chunked["on"]}, self._max_model_len())
        return {**chunked, "writes_in": verdict["writes_in"], "max_num_batched_tokens": budget}

    def _connector_options(self) -> dict:
        """The connector the server loaded and the options it runs with (:func:`~.command.connector_options`);
        what cannot be read is said, never the run's failure."""
        given = kv_transfer_config(self.server.storage_dir, self.server.connector,
                                   writer_threads(self.params))["kv_connector_extra_config"]
        try:
            return connector_options(self.server.connector, given)
        except Exception as exc:  # noqa: BLE001 -- a record of the run, not a step of it
            name, module = self.server.connector
            return {"class": name, "module": module, "options": dict(given), "given": sorted(given),
                    "error": f"the connector's own options could not be read: {type(exc).__name__}: {exc}"}

    def _max_model_len(self) -> int:
        """seq_len + 1 (each request generates one token); refused before the server starts when the model
        has fewer positions (preflight's ``model.seq_len`` says the same)."""
        seq_len = self.plan.seq_len
        limit = modelconfig.text_value(self.config, "max_position_embeddings")
        if limit and seq_len > contract.seq_len_limit(self.name, int(limit)):
            raise ValueError(f"seq_len {seq_len} leaves no room for the one token each request generates "
                             f"(max_position_embeddings {limit}); set seq_len to at most "
                             f"{contract.seq_len_limit(self.name, int(limit))}")
        return self.model_len(self.config)

    def _request(self, token_ids, index: int | None = None, logprobs: bool = False,
                 server: VllmServer | None = None) -> str:
        """One request (to ``server``, default the first replica's); the path of the (complete) file the server
        wrote for it. ``logprobs``: a canary sample, which also asks for its prompt logprobs (:mod:`.prompt_logprobs`)."""
        server = server or self.server
        ids = [int(t) for t in token_ids]
        body = {"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        timeout = float(self.params.get("request_timeout_s") or 600)
        reply = None
        log_at = server.log_size()
        if logprobs and not self.logprobs.unavailable:
            try:
                reply = server.post_json("/v1/completions", dict(body, **self.logprobs.fields()), timeout=timeout)
            except RuntimeError as exc:
                if " HTTP 4" not in str(exc):
                    raise
                self.logprobs.refused(f"the server refused prompt_logprobs: {exc}")
            if reply is not None:
                self.logprobs.keep(index, ids, reply)
        if reply is None:
            reply = server.post_json("/v1/completions", body, timeout=timeout)
        choices = reply.get("choices") or [{}]
        echoed = choices[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != ids:
            raise SampleRejected(-1, [f"the server read other token ids ({len(echoed)} back, "
                                      f"{len(ids)} sent)"])
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"the reply names no hidden_states_path (kv_transfer_params="
                               f"{reply.get('kv_transfer_params')!r}); is the KV connector configured?")
        self._wait_for_file(path, timeout, log_at, "sample" if index is None else f"sample {index}", server)
        return path

    def _wait_for_file(self, path: str, timeout: float, log_at: int, what: str,
                       server: VllmServer | None = None) -> None:
        """:func:`~.landing.wait_for_file`; a file that never comes is the server's failure when its log
        says so after ``log_at`` (a worker whose writer raised: the reply came, the file never will), raised
        as that instead of "never wrote it"."""
        server = server or self.server
        try:
            wait_for_file(path, timeout)
        except (FileNotFoundError, TimeoutError) as exc:
            deadline = time.monotonic() + LOG_GRACE_S  # the worker's traceback may reach the log just after
            while True:
                if server.failed_since(log_at) or not server.alive:
                    raise server.failure(f"vLLM failed writing the hidden states of {what}") from exc
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _load_checked(self, index: int, token_ids, path: str) -> dict:
        from safetensors.torch import load_file

        # the one checker of a connector file (structure, ids echo, [T, L, H], NaN/Inf), as a run lands it
        problems = samples.digest_hs_file(path, self.file_layer_ids, self.file_layer_ids, token_ids=token_ids,
                                          hidden_size=self.hidden_size, state_format=self.state_format)["problems"]
        if problems:
            raise SampleRejected(index, problems)
        data = load_file(path)
        scales = data.pop(contract.FP8_SCALES_KEY, None)
        if scales is not None:  # fp8: what the fp8 read backend gives (float32 here: no second rounding)
            data["hidden_states"] = data["hidden_states"].float() * scales
        return data

    def _land(self, index: int, token_ids, path: str, out_dir) -> dict:
        """Check, digest and rename the server's file into ``out_dir`` (:func:`~.landing.land_sample`)."""
        return land_sample(index, token_ids, path, out_dir, layer_ids=self.layer_ids,
                           file_layer_ids=self.file_layer_ids, hidden_size=self.hidden_size,
                           state_format=self.state_format, pool=getattr(self, "digest_pool", None))

    def extract_files(self, samples_, out_dir, on_done=None) -> list[dict]:
        """Extract ``samples_`` (``(index, token_ids)`` pairs) into ``out_dir``, several in flight.

        Each file appears in ``out_dir`` only once it is complete and checked (token
        ids echo, shape ``[T, L, H]``, no NaN/Inf). ``on_done(record)`` is called as
        each sample lands (from a worker thread); ``record["digest"]`` is what
        :func:`remote.extract.samples.scan_samples` would read back.

        ``concurrency`` requests are in flight; a thread whose file is ready gives its
        request slot to the next sample before it digests the file, and at most
        ``digest_workers`` (default: half the host's cores, at least 4) files are digested
        at once while requests remain, each by one digest process (:class:`~.landing.DigestPool`)
        or thread (hashing and statistics are CPU work that must not starve the server's own
        processes); once every request is answered, the files left are digested on every core
        (:class:`~.landing.DigestSlots`).

        :returns: the records in index order.
        :raises SampleRejected: for the first bad sample; :class:`~.logs.ServerFailed` when the
            server died (its log's exception named). Samples in flight are abandoned.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        records = []
        workers = max(1, int(self.params.get("concurrency") or self.plan.batch_size))
        digesters = max(1, int(self.params.get("digest_workers") or default_digest_workers()))
        import torch

        # each digest is one thread's work; torch's intra-op pool on top of several digesters
        # only spins (measured on the H200 host: 4.1 vs 3.1 GB/s digested with 8 vs 4 threads)
        torch.set_num_threads(1)
        samples_ = list(samples_)
        digesting = DigestSlots(digesters, requests=len(samples_))
        replicas = len(self.servers)
        # one request slot per request in flight, each a replica's: a replica takes the next sample as soon as
        # one of its slots frees, so the replicas split the rows by their speed and every sample goes to one
        slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            for r in range(replicas):
                if self.servers[r] not in self._lost_servers():
                    slots.put(r)
        canary = self.logprobs.claim(int(i) for i, _ in samples_) if replicas == 1 else None
        planted_swap = faults.swapped_states(self.params)

        def request(index, ids) -> tuple[str, bool]:
            try:
                while True:
                    r = slots.get()
                    server = self.servers[r]
                    if server in self._lost_servers():
                        continue  # a lost replica's slot: dropped
                    asks = index in canary if canary is not None else self.logprobs.ask(r)
                    try:
                        path = self._request(ids, index, asks, server)
                    except SampleRejected as exc:
                        slots.put(r)
                        raise SampleRejected(index, exc.problems) from None
                    except BaseException as exc:
                        if self._replica_lost(server, exc):
                            continue  # the sample goes to another replica
                        slots.put(r)
                        raise
                    slots.put(r)
                    with self._canary_lock:  # request threads count at once: += is no atomic step
                        self.replica_samples[r] += 1
                    return path, asks
            finally:
                digesting.request_done()

        def one(index, ids):
            t0 = time.monotonic()
            path, asked = request(index, ids)
            if planted_swap is not None:
                planted_swap.landed(index, path)
            with digesting:
                record = self._land(index, ids, path, out_dir)
            if asked:
                self._check_canary(index, out_dir / record["file"])
            record["seconds"] = round(time.monotonic() - t0, 4)
            return record

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers * replicas + digesting.drained,
                                                     thread_name_prefix="hs-request")
        try:
            futures = [pool.submit(one, int(i), list(ids)) for i, ids in samples_]
            for future in concurrent.futures.as_completed(futures):
                try:
                    record = future.result()
                except BaseException as exc:
                    if not isinstance(exc, ServerFailed):
                        dead = [s for s in self.servers
                                if s not in self._lost_servers() and (not s.alive or s.death_in_log())]
                        if dead:
                            raise dead[0].failure("vLLM server died during extraction") from exc
                    raise
                records.append(record)
                if on_done:
                    on_done(record)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return sorted(records, key=lambda r: r["index"])

    def _lost_servers(self) -> list:
        return [self.servers[lost["replica_index"]] for lost in self.replicas_lost]

    def _replica_lost(self, server: VllmServer, exc: BaseException) -> bool:
        """Whether ``exc`` lost its replica and the run goes on without it (``on_replica_loss: continue``, another
        replica alive): the loss is recorded (the manifest's ``engine.replicas_lost``) and said in the log."""
        if len(self.servers) == 1 or (self.params.get("on_replica_loss") or "fail") != "continue":
            return False
        with self._canary_lock:
            if server in self._lost_servers():
                return True
            if server.alive and not server.death_in_log():
                return False  # the request failed, the replica did not
            alive = [s for s in self.servers if s is not server and s not in self._lost_servers() and s.alive]
            if not alive:
                return False
            failure = exc if isinstance(exc, ServerFailed) else server.failure("vLLM server died during extraction")
            index = self.servers.index(server)
            self.replicas_lost.append({"replica": server.replica, "replica_index": index,
                                       "devices": server.devices, "error": str(failure)[:2000],
                                       "samples_made": self.replica_samples[index]})
        print(f"[specops] replica {server.replica} lost ({str(failure).splitlines()[0][:300]}); on_replica_loss: "
              f"continue: its rows go to {', '.join(s.replica for s in alive)}", flush=True)
        return True

    def _check_canary(self, index: int, path) -> None:
        """The logits check of a landed canary sample (:mod:`remote.verify.canary`); raises
        :class:`remote.verify.canary.CanaryFailed` to stop the run."""
        from remote.verify import canary

        with self._canary_lock:  # one canary (one head in memory, one canary.json) for every landing thread
            if self.canary is None:
                self.canary = canary.Canary(self.model_path, self.layer_ids, layers.INPUT, self.params,
                                            self.logprobs.dir, expected=self.logprobs.count)
        self.canary.check(index, path)

    def extract(self, batch):
        """The base contract: per sample, per layer (order of ``layer_ids``) a ``[T, H]`` tensor.

        For smoke and verify, which compare states in memory; nothing is kept on disk.
        """
        results = []
        for ids in batch:
            path = self._request(ids)
            try:
                data = self._load_checked(-1, ids, path)
            finally:
                os.unlink(path)
            states = data["hidden_states"]
            results.append([states[:, self.file_layer_ids.index(lid)].clone() for lid in self.layer_ids])
        return results

    def close(self) -> None:
        pool = getattr(self, "digest_pool", None)
        if pool is not None:
            pool.close()
            self.digest_pool = None
        # an aborted run stops the servers sooner (the supervisor sets stop_grace_s)
        grace = float(self.params.get("stop_grace_s") or 20.0)
        servers = getattr(self, "servers", None) or []
        if len(servers) > 1:
            stopping = [threading.Thread(target=s.stop, args=(grace,), daemon=True) for s in servers]
            for thread in stopping:
                thread.start()
            for thread in stopping:
                thread.join()
        elif servers:
            servers[0].stop(grace)

    def error_record(self, exc: BaseException) -> dict | None:
        """A dead server's own exception (from its log, with the rank that raised it) as the run's error."""
        failure = exc if isinstance(exc, ServerFailed) else exc.__cause__ if isinstance(
            exc.__cause__, ServerFailed) else None
        if failure is None and getattr(exc, "record", None) is not None:  # remote.verify.canary.CanaryFailed
            return exc.error()
        if failure is None:
            return None
        if failure.death:
            death = dict(failure.death, reported_as={"type": type(exc).__name__, "message": str(exc)})
            replica = getattr(failure, "replica", None)
            if replica:  # which replica's process died (dp1/rank0, dp1/API server), in its message too
                rank = death.get("rank")
                where = f"{replica}/rank{rank}" if rank is not None else f"{replica}/{death.get('where')}"
                message = str(death.get("message", ""))
                death.update(replica=replica, where=where, source=f"logs/{replica}/server.log",
                             message=message if message.startswith(f"{replica}: ") else f"{replica}: {message}")
            return death
        etype, _, message = (failure.exception or "").partition(": ")
        from remote.wire import status

        replica = getattr(failure, "replica", None)
        where = failure.process or "vLLM server"
        if replica:  # ranks of a data-parallel replica: dp<i>/rank<j>
            where = f"{replica}/rank{failure.rank if failure.rank is not None else 0} ({where})"
        record = status.error(etype or type(failure).__name__, message or str(failure), rank=failure.rank,
                              traceback=failure.traceback or "", where=where,
                              source=f"logs/{replica}/server.log" if replica else "logs/server.log",
                              reported_as={"type": type(exc).__name__, "message": str(exc)})
        return dict(record, replica=replica) if replica else record

    def describe(self) -> dict:
        server = getattr(self, "server", None)
        return {"name": self.name, "tp": self.tp, "layer_convention": layers.INPUT,
                "file_layer_ids": getattr(self, "file_layer_ids", None),
                "state_format": getattr(self, "state_format", None),
                "connector": ":".join(filter(None, reversed(server.connector))) if server and server.connector else None,
                # the connector's class, module and every option it ran with (given or its own default)
                "connector_options": getattr(self, "connector_options", None),
                "fp8_connector_fallback": getattr(self, "fp8_fallback", None),
                "canary_samples": self.logprobs.count if getattr(self, "logprobs", None) else None,
                # the server's one-time prompt-logprobs set-up, paid while loading (None: no canary)
                "logprobs_warm_up_s": getattr(self, "logprobs_warm_up_s", None),
                "chunked_prefill": getattr(self, "chunked", None),
                # the aux ids vLLM's log says it took (checked equal to file_layer_ids at load)
                "aux_ids_used": getattr(self, "aux_ids_used", None),
                # which model runner served (V1 / V2), as the server's log says (None: it says none)
                "model_runner": getattr(self, "model_runner", None),
                # where landed files are digested: worker processes, or this process's threads (and why)
                "digest_in": getattr(self, "digest_in", None),
                "server_ready_s": round(server.ready_after_s, 2) if server and server.ready_after_s else None,
                # data-parallel replicas (dp > 1): each one's devices, samples and log; the ones lost on the way
                "dp": len(getattr(self, "servers", None) or [None]),
                "replicas": [{"name": s.replica, "devices": s.devices, "samples": n, "log": str(s.log_path),
                              "ready_s": round(s.ready_after_s, 2) if s.ready_after_s else None}
                             for s, n in zip(self.servers, self.replica_samples)]
                if len(getattr(self, "servers", None) or []) > 1 else None,
                "replicas_lost": getattr(self, "replicas_lost", None) or None,
                "command": server.command if server else None,
                "log": str(server.log_path) if server else None}
