"""The ``vllm-server`` engine: the supervisor's plug for :class:`~.process.VllmServer`.

``load`` starts the server and waits until it answers, ``extract_files`` sends the
samples as ``/v1/completions`` requests (several in flight) and lands each file the
connector writes (:func:`~.landing.land_sample`), ``close`` stops the server, and
``error_record`` turns a dead server's own exception into the run's error.
"""
from __future__ import annotations

import concurrent.futures
import os
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
from .command import (SERVED_MODEL_NAME, batched_tokens, connector_options, kv_transfer_config, pick_connector,
                      writer_threads)
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
        #: the canary samples' prompt logprobs (the first few samples), and their check as they land
        self.logprobs = PromptLogprobs(self.params, work_dir, self.plan.canary_samples)
        self.canary, self._canary_lock = None, threading.Lock()
        #: chunked prefill: on where the installed connector writes once a request is done (chunking.py)
        connector = pick_connector(self.params)  # once: the server loads the one its verdict read
        self.chunked = self._chunked_prefill(connector)
        self.params["chunked_prefill_on"] = self.chunked["on"]
        self.server = VllmServer(self.model_path, tp=self.tp, layer_ids=self.file_layer_ids,
                                 work_dir=work_dir, max_model_len=self._max_model_len(),
                                 params=self.params, python=self.params.get("python") or sys.executable)
        self.server.connector = connector
        timeout = float(self.params.get("ready_timeout_s") or 900)
        self._start_digest_pool()
        for attempt in (1, 2):
            self.server.start()
            try:
                self.server.wait_ready(timeout=timeout)
                self.aux_ids_used = self._aux_ids_used()
                self.connector_options = self._connector_options()
                self._warm_up_logprobs()
                self._digest_pool_started()
                return
            except ServerFailed as exc:
                if attempt == 1 and "address already in use" in (exc.log_tail or "").lower():
                    self.server.stop()
                    self.server.params.pop("port", None)
                    continue
                self.server.stop()
                raise

    def _aux_ids_used(self) -> dict | None:
        """The aux ids vLLM logged taking (:mod:`.aux_ids`); a ServerFailed naming both lists when they are
        not the ids this run sent (its states would hold other layers under these ids' names)."""
        from remote.extract.engines.vllm_server import logs as server_log

        log_text = server_log.read_log(self.server.log_path)
        self.model_runner = server_log.model_runner(log_text)
        used = server_log.aux_ids_used(log_text)
        if used is not None and used["ids"] != list(self.file_layer_ids):
            raise ServerFailed(f"vLLM took aux layer ids {used['ids']} (from its {used['source']}), not the run's "
                               f"{list(self.file_layer_ids)}: '{used['line']}'", self.server.log_path)
        return used

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
            pids = self.digest_pool.wait_started()
            self.digest_in = {"where": "processes", "processes": len(pids)}
        except Exception as exc:  # a process that died importing torch: digest here instead
            self.digest_pool.close()
            self.digest_pool = None
            self.digest_in = {"where": "threads", "why": f"digest processes failed to start: {type(exc).__name__}: {exc}"}

    def _warm_up_logprobs(self) -> None:
        """Pay the server's first prompt-logprobs request while loading: its one-time set-up (measured
        1.75 s on the 2-core CPU test host with the tiny Llama, every later request as fast as one
        without logprobs) would otherwise land in the extraction's time with the first canary sample.
        A few tokens, their file deleted; a server that refuses the field is found here, before any
        sample (``unavailable.json`` says why, as when a canary sample's request is refused)."""
        if not self.logprobs.count or self.logprobs.dir is None or self.logprobs.unavailable:
            return
        if self.server.headless:  # a replica's worker host: no API server here (the head's engine pays it)
            return
        vocab = int(modelconfig.text_value(self.config, "vocab_size") or 2)
        body = {"model": SERVED_MODEL_NAME, "prompt": [1 + i % (vocab - 1) for i in range(WARM_UP_TOKENS)],
                "max_tokens": 1, "temperature": 0.0, **self.logprobs.fields()}
        timeout = float(self.params.get("request_timeout_s") or 600)
        t0 = time.monotonic()
        log_at = self.server.log_size()
        try:
            reply = self.server.post_json("/v1/completions", body, timeout=timeout)
        except RuntimeError as exc:
            if " HTTP 4" not in str(exc):
                raise
            self.logprobs.refused(f"the server refused prompt_logprobs: {exc}")
            return
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            self._wait_for_file(path, timeout, log_at, "the prompt-logprobs warm-up request")
            os.unlink(path)
        self.logprobs_warm_up_s = round(time.monotonic() - t0, 3)

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

    def _request(self, token_ids, index: int | None = None, logprobs: bool = False) -> str:
        """One request; the path of the (complete) file the server wrote for it. ``logprobs``: a
        canary sample, which also asks for its prompt logprobs (:mod:`.prompt_logprobs`)."""
        ids = [int(t) for t in token_ids]
        body = {"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        timeout = float(self.params.get("request_timeout_s") or 600)
        reply = None
        log_at = self.server.log_size()
        if logprobs and not self.logprobs.unavailable:
            try:
                reply = self.server.post_json("/v1/completions", dict(body, **self.logprobs.fields()), timeout=timeout)
            except RuntimeError as exc:
                if " HTTP 4" not in str(exc):
                    raise
                self.logprobs.refused(f"the server refused prompt_logprobs: {exc}")
            if reply is not None:
                self.logprobs.keep(index, ids, reply)
        if reply is None:
            reply = self.server.post_json("/v1/completions", body, timeout=timeout)
        choices = reply.get("choices") or [{}]
        echoed = choices[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != ids:
            raise SampleRejected(-1, [f"the server read other token ids ({len(echoed)} back, "
                                      f"{len(ids)} sent)"])
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"the reply names no hidden_states_path (kv_transfer_params="
                               f"{reply.get('kv_transfer_params')!r}); is the KV connector configured?")
        self._wait_for_file(path, timeout, log_at, "sample" if index is None else f"sample {index}")
        return path

    def _wait_for_file(self, path: str, timeout: float, log_at: int, what: str) -> None:
        """:func:`~.landing.wait_for_file`; a file that never comes is the server's failure when its log
        says so after ``log_at`` (a worker whose writer raised: the reply came, the file never will), raised
        as that instead of "never wrote it"."""
        try:
            wait_for_file(path, timeout)
        except (FileNotFoundError, TimeoutError) as exc:
            deadline = time.monotonic() + LOG_GRACE_S  # the worker's traceback may reach the log just after
            while True:
                if self.server.failed_since(log_at) or not self.server.alive:
                    raise self.server.failure(f"vLLM failed writing the hidden states of {what}") from exc
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
        in_flight = threading.BoundedSemaphore(workers)
        digesting = DigestSlots(digesters, requests=len(samples_))
        canary = self.logprobs.claim(int(i) for i, _ in samples_)
        planted_swap = faults.swapped_states(self.params)

        def one(index, ids):
            t0 = time.monotonic()
            with in_flight:
                try:
                    path = self._request(ids, index, index in canary)
                except SampleRejected as exc:
                    raise SampleRejected(index, exc.problems) from None
                finally:
                    digesting.request_done()
            if planted_swap is not None:
                planted_swap.landed(index, path)
            with digesting:
                record = self._land(index, ids, path, out_dir)
            if index in canary:
                self._check_canary(index, out_dir / record["file"])
            record["seconds"] = round(time.monotonic() - t0, 4)
            return record

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers + digesting.drained,
                                                     thread_name_prefix="hs-request")
        try:
            futures = [pool.submit(one, int(i), list(ids)) for i, ids in samples_]
            for future in concurrent.futures.as_completed(futures):
                try:
                    record = future.result()
                except BaseException as exc:
                    if not isinstance(exc, ServerFailed) and (not self.server.alive or self.server.death_in_log()):
                        raise self.server.failure("vLLM server died during extraction") from exc
                    raise
                records.append(record)
                if on_done:
                    on_done(record)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return sorted(records, key=lambda r: r["index"])

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
        server = getattr(self, "server", None)
        if server is not None:
            # an aborted run stops the server sooner (the supervisor sets stop_grace_s)
            server.stop(float(self.params.get("stop_grace_s") or 20.0))

    def error_record(self, exc: BaseException) -> dict | None:
        """A dead server's own exception (from its log, with the rank that raised it) as the run's error."""
        failure = exc if isinstance(exc, ServerFailed) else exc.__cause__ if isinstance(
            exc.__cause__, ServerFailed) else None
        if failure is None and getattr(exc, "record", None) is not None:  # remote.verify.canary.CanaryFailed
            return exc.error()
        if failure is None:
            return None
        if failure.death:
            return dict(failure.death, reported_as={"type": type(exc).__name__, "message": str(exc)})
        etype, _, message = (failure.exception or "").partition(": ")
        from remote.wire import status

        return status.error(etype or type(failure).__name__, message or str(failure), rank=failure.rank,
                            traceback=failure.traceback or "", where=failure.process or "vLLM server",
                            source="logs/server.log", reported_as={"type": type(exc).__name__, "message": str(exc)})

    def describe(self) -> dict:
        server = getattr(self, "server", None)
        return {"name": self.name, "tp": self.tp, "layer_convention": layers.INPUT,
                "file_layer_ids": getattr(self, "file_layer_ids", None),
                "state_format": getattr(self, "state_format", None),
                "connector": ":".join(filter(None, reversed(server.connector))) if server and server.connector else None,
                # the connector's class, module and every option it ran with (given or its own default)
                "connector_options": getattr(self, "connector_options", None),
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
                "command": server.command if server else None,
                "log": str(server.log_path) if server else None}
