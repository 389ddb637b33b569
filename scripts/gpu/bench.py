#!/usr/bin/env python3
"""Extraction tok/s of specops's ``vllm-server`` engine vs plain prefill of the same vLLM, same ids.

    python3 scripts/gpu/bench.py --model DIR --dataset ids.jsonl --out DIR [--n 512] [--reps 2]
        [--concurrency 32,64] [--kinds plain,server_only,specops] [--once keep@64,specops+dw8@64,sustained@64]
        [--profile-digest 48] [--util 0.4] [--kv-gib 24] [--eager] [--batched-tokens N] [--device cuda]

Two servers of the same vLLM with the same flags (``remote.extract.engines.vllm_server.server_command``)
start side by side on the one GPU, so one start-up pays for both: the *extraction* server
(extract_hidden_states + the hidden-states connector, driven by ``VllmServerEngine``) and
the *plain* server (the same builder with the run parameter ``plain``: the same argv minus
``--speculative-config`` and ``--kv-transfer-config``).
Both get the same fixed KV cache (``--kv-cache-memory-bytes``: memory profiling of two
servers starting together would see each other). They are then measured one at a time
(the other idles), on the same token ids.

The engine runs what ``specops extract`` runs (:func:`engine_params`): its params are run
parameters (``remote/wire/argspec.py`` RUN_ARGS), completed by the supervisor's own rule
(``command.run_defaults``: concurrency = the run's batch_size), and the engine resolves the
step budget (``command.batched_tokens``: 2048 with chunked prefill), the digest pool and the
connector's threads from them as in a run. ``--concurrency`` and ``--batched-tokens`` override;
the ``settings`` line (and ``bench.json``) says what ran and where it differs from the CLI's
defaults (the shared GPU's KV cache and utilization always). Kinds of pass:

* ``plain``: the same client requests (``/v1/completions``, ids as prompt, ``max_tokens`` 1,
  ``concurrency`` in flight): prefill tok/s;
* ``server_only``: extraction requests, waiting for each file's lock, then deleting it:
  what the engine + connector can do, our file handling left out;
* ``specops``: what a run does, writes included: ``engine.extract_files`` (request, wait,
  one memory-mapped read per file for the checks, sha256 and layer statistics, rename into
  the output dir), then the manifest's file list and statistics from those digests
  (``tok_per_s``: samples written, manifest done), then one ``syncfs`` of the output
  (``durable_tok_per_s``: the samples on disk for good);
* ``sustained``: ``specops`` over ``--sustained-n`` samples (past the kernel's dirty-page limit);
* ``keep``: extraction requests whose files are renamed into the output dir and kept, not
  digested, then one ``syncfs``: ``server_only`` plus what keeping 33 MB per sample costs
  the page cache and the disk, without our per-file CPU work. ``specops`` vs ``keep`` is
  our client's own cost; ``keep`` vs ``server_only`` is the kernel's (dirty pages, writeback);
* ``specops+dwN``: ``specops`` with ``digest_workers`` N (the engine's default: half the cores, at least 4);
* ``specops_canary``: ``specops`` with the canary as a run has it (the first ``canary_samples`` samples
  ask for their prompt logprobs and are checked as they land, the final norm and lm_head loaded
  afresh): beside ``specops`` (the canary spent in the warm-up) it is the canary's whole cost;
* ``plain_v1``: ``plain`` on a third server that runs vLLM's V1 model runner
  (``VLLM_USE_V2_MODEL_RUNNER=0``; the extraction server runs V1 because V2 lacks
  ``extract_hidden_states``), started only when ``--kinds`` names it.

Every server gets the chunked-prefill setting the extraction engine resolves (``--chunked-prefill``,
default ``auto``: on where the connector allows it), so plain and extraction prefill alike.
``--format fp8`` makes the extraction server write fp8 states (hs-connectors' fp8 connector).

``--profile-digest N`` then lands N files and times, per file and single-threaded, each part
of :func:`remote.extract.samples.digest_hs_file` (sha256 of the mapping, the layer statistics, the
whole digest) and the whole digest with 1/4/8/16 threads at once (files in the page cache),
again with torch's intra-op pool at one thread: the client's digest throughput in GB/s
against what prefill speed would need (33.5 MB per 1024 tokens: 5.5 GB/s at 166k tok/s).

Time inside each step of a sample (request, digest, rename) is summed over threads (``*_thread_s``); divided by
the wall time and the concurrency it says how busy the client's threads were with it.
``client_cpu_s`` is this process's CPU time in the pass (user + system), ``dirty_peak_mib`` /
``writeback_peak_mib`` the kernel's dirty and under-writeback page cache during it.
Prints one JSON object and writes it to ``OUT/bench.json``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import mmap
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from remote.wire import fsutil  # noqa: E402
from remote.extract import samples as hs_samples  # noqa: E402
from remote.extract.engines import vllm_server as vs  # noqa: E402
from remote.extract.engines.vllm_server import chunking as vs_chunking  # noqa: E402

from remote.extract.engines.vllm_server import command as vs_command  # noqa: E402
from remote.wire import contract  # noqa: E402


class Timers:
    """Seconds spent inside wrapped functions, summed over all threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sums: dict[str, float] = {}

    def wrap(self, owner, name, label):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with self.lock:
                    self.sums[label] = self.sums.get(label, 0.0) + time.perf_counter() - t

        setattr(owner, name, timed)
        return original

    def take(self) -> dict:
        with self.lock:
            out = {f"{k}_thread_s": round(v, 3) for k, v in sorted(self.sums.items())}
            self.sums.clear()
        return out


class PassMeter:
    """Per pass: this process's CPU seconds, and the peak of the kernel's Dirty/Writeback pages."""

    def __init__(self, interval=0.2):
        self.interval = interval
        self.peak = {"Dirty": 0, "Writeback": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def meminfo() -> dict:
        out = {}
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    if key in ("Dirty", "Writeback"):
                        out[key] = int(rest.split()[0]) // 1024  # kB -> MiB
        except OSError:
            pass
        return out

    def _run(self):
        while not self._stop.is_set():
            for key, value in self.meminfo().items():
                self.peak[key] = max(self.peak[key], value)
            self._stop.wait(self.interval)

    def __enter__(self):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu0 = usage.ru_utime + usage.ru_stime
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.result = {"client_cpu_s": round(usage.ru_utime + usage.ru_stime - self.cpu0, 2),
                       "dirty_peak_mib": self.peak["Dirty"], "writeback_peak_mib": self.peak["Writeback"]}


def load_ids(path, n):
    rows = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line)["input_ids"])
            if len(rows) >= n:
                break
    return rows


def plain_pass(server, ids_list, concurrency):
    def one(ids):
        reply = server.post_json("/v1/completions", {"model": vs.SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1,
                                                     "temperature": 0.0})
        return len(ids) if reply.get("choices") else 0

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, ids_list))
    wall = time.perf_counter() - t
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1)}


def server_only_pass(engine, ids_list, concurrency):
    def one(ids):
        path = engine._request(ids)
        os.unlink(path)
        return len(ids)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, ids_list))
    wall = time.perf_counter() - t
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1)}


def fresh_canary(engine) -> None:
    """Let the next pass's first samples be the canary again, its head loaded afresh (as a new run's)."""
    engine.logprobs._claimed = 0
    engine.canary = None


def specops_pass(engine, ids_list, out_dir, concurrency, timers, digest_workers=None, keep_files=False):
    """One run's worth of work on ``ids_list``: files in place, manifest data, then durable.

    :param digest_workers: the engine's ``digest_workers`` for this pass (None: its default).
    :param keep_files: leave the files in ``out_dir/hidden_states`` (for the digest profile).
    """
    engine.params["concurrency"] = concurrency
    saved_workers = engine.params.get("digest_workers")
    if digest_workers:
        engine.params["digest_workers"] = digest_workers
    shutil.rmtree(out_dir, ignore_errors=True)
    samples_ = list(enumerate(ids_list))
    digests = {}

    def landed(record):
        digests[record["index"]] = record.pop("digest")

    try:
        with PassMeter() as meter:
            t = time.perf_counter()
            records = engine.extract_files(samples_, out_dir / "hidden_states", on_done=landed)
            landed_s = time.perf_counter() - t
            hs_samples.scan_samples(out_dir, range(len(samples_)), engine.layer_ids, hs_samples.HS,
                                    file_layer_ids=engine.file_layer_ids, known=digests)
            wall = time.perf_counter() - t
            fsutil.sync_filesystem(out_dir / "hidden_states")
            durable = time.perf_counter() - t
    finally:
        engine.params["digest_workers"] = saved_workers
    tokens = sum(r["tokens"] for r in records)
    out = {"tokens": tokens, "files": len(records), "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
           "landed_s": round(landed_s, 3), "durable_wall_s": round(durable, 3),
           "durable_tok_per_s": round(tokens / durable, 1),
           "bytes_per_file": records[0]["bytes"] if records else None,
           "digest_workers": digest_workers or engine.params.get("digest_workers") or vs.default_digest_workers()}
    out.update(meter.result)
    out.update(timers.take())
    if not keep_files:
        shutil.rmtree(out_dir, ignore_errors=True)
    return out


def canary_record(engine) -> dict:
    """What the canary checked in the last pass (``canary.json`` of the engine's prompt logprobs dir)."""
    path = Path(engine.logprobs.dir) / "canary.json" if engine.logprobs.dir else None
    try:
        return json.loads(path.read_text()) if path and path.exists() else {"none": str(path)}
    except ValueError as exc:
        return {"unreadable": str(exc)}


def keep_pass(engine, ids_list, out_dir, concurrency):
    """Extraction requests whose files are renamed into ``out_dir`` and kept (no digest), then one syncfs."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)

    def one(item):
        index, ids = item
        path = engine._request(ids)
        vs.move_into_place(path, out_dir / vs.SAMPLE_FILE.format(index=index))
        return len(ids)

    with PassMeter() as meter:
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, enumerate(ids_list)))
        wall = time.perf_counter() - t
        fsutil.sync_filesystem(out_dir)
        durable = time.perf_counter() - t
    shutil.rmtree(out_dir, ignore_errors=True)
    return dict({"tokens": tokens, "files": len(ids_list), "wall_s": round(wall, 3),
                 "tok_per_s": round(tokens / wall, 1), "durable_wall_s": round(durable, 3),
                 "durable_tok_per_s": round(tokens / durable, 1)}, **meter.result)


def digest_profile(engine, ids_list, out_dir, timers) -> dict:
    """Where a file's digest time goes, single-threaded, and the digest's throughput with more threads."""
    import torch

    specops_pass(engine, ids_list, out_dir, 32, timers, keep_files=True)
    timers.take()
    files = sorted((out_dir / "hidden_states").glob("*.safetensors"))
    size = files[0].stat().st_size
    layer_ids, file_ids = engine.layer_ids, engine.file_layer_ids

    def sha_only(path):
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return hashlib.sha256(mapped).hexdigest()
        finally:
            mapped.close()

    def stats_only(path):
        from safetensors import safe_open

        with safe_open(str(path), "pt") as fh:
            states = fh.get_tensor("hidden_states")
        return [hs_samples.layer_partial(states[:, file_ids.index(lid)]) for lid in layer_ids]

    def whole(path):
        return hs_samples.digest_hs_file(path, layer_ids, file_ids)

    result = {"files": len(files), "bytes_per_file": size, "torch_threads": torch.get_num_threads(),
              "single_thread_ms_per_file": {}, "parallel_GB_per_s": {}}
    for name, fn in (("sha256", sha_only), ("layer_stats_incl_load", stats_only), ("digest", whole)):
        t = time.perf_counter()
        for path in files:
            fn(path)
        result["single_thread_ms_per_file"][name] = round((time.perf_counter() - t) / len(files) * 1e3, 2)
    def parallel(threads):
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(whole, files))
        return round(len(files) * size / (time.perf_counter() - t) / 1e9, 2)

    for threads in (1, 4, 8, 16):
        result["parallel_GB_per_s"][str(threads)] = parallel(threads)
    # each digesting thread's torch ops fan out over torch's intra-op pool: the same with that pool at 1
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result["parallel_GB_per_s_torch_threads_1"] = {str(n): parallel(n) for n in (4, 8, 16)}
    finally:
        torch.set_num_threads(torch_threads)
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    """The bench's arguments; what the engine runs with is left unset unless given (the CLI's defaults)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--concurrency", default="",
                        help="comma-separated requests in flight (default: what specops extract runs, the run's "
                             "batch_size)")
    parser.add_argument("--kinds", default="plain,server_only,specops",
                        help="passes repeated --reps times at each concurrency (plain, server_only, specops)")
    parser.add_argument("--once", default="",
                        help="NAME@C passes run once after them (sustained, specops, keep, specops+dwN)")
    parser.add_argument("--profile-digest", type=int, default=0, help="files for the digest profile (0: none)")
    parser.add_argument("--sustained-n", type=int, default=1024)
    # the servers share one GPU: a fixed KV cache each, and a utilization that lets them start side by side
    parser.add_argument("--util", type=float, default=0.4)
    parser.add_argument("--kv-gib", type=float, default=24)
    parser.add_argument("--batched-tokens", type=int, default=None,
                        help="the run's max_num_batched_tokens (default: the engine's own step budget, as "
                             "specops extract)")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--layer-ids", default="")
    parser.add_argument("--device", default="cuda", help="cpu: rehearse on a CPU host (test-host env)")
    parser.add_argument("--chunked-prefill", default=None, choices=contract.CHUNKED_PREFILL,
                        help="the run's chunked_prefill (default: unset, auto as in specops extract); the plain "
                             "servers get what it resolves to")
    parser.add_argument("--format", default="bf16", choices=contract.STATE_FORMATS,
                        help="the extraction's state format")
    return parser.parse_args(argv)


def engine_params(args, seq_len: int) -> dict:
    """The params the bench's engine gets: the run parameters its arguments name (``RUN_ARGS`` keys), with
    what ``specops extract``'s supervisor adds (:func:`~remote.extract.engines.vllm_server.command.run_defaults`:
    the concurrency of the run's batch_size, eager on a CPU host); the engine then resolves the step budget,
    the digest pool and the connector's threads as in a run."""
    params = {"device": args.device, "seq_len": seq_len, "gpu_memory_utilization": args.util,
              "server_args": ["--kv-cache-memory-bytes", str(int(args.kv_gib * (1 << 30)))],
              "format": args.format, "ready_timeout_s": 600}
    if args.eager:
        params["enforce_eager"] = True
    if args.chunked_prefill:
        params["chunked_prefill"] = args.chunked_prefill
    if args.batched_tokens:
        params["max_num_batched_tokens"] = args.batched_tokens
    sweep = [int(c) for c in args.concurrency.split(",") if c]
    once = [int(v.rpartition("@")[2]) for v in getattr(args, "once", "").split(",") if "@" in v]
    if sweep:
        params["concurrency"] = sweep[0]
    if sweep or once:
        # the server admits the most requests any pass keeps in flight (a run's max_num_seqs is its concurrency)
        params["max_num_seqs"] = max(sweep + once)
    return vs_command.run_defaults(params, contract.param(params, "batch_size"))


def settings(params: dict, concurrencies: list[int], chunked: dict, digest_in: dict | None) -> dict:
    """What the bench ran (``chunked`` and ``digest_in``: the engine's own, once loaded), and where that is not
    what a default ``specops extract`` of the same model and seq_len runs (``differs_from_cli``)."""
    cli = vs_command.run_defaults({"device": params["device"]}, contract.param({}, "batch_size"))
    ran = {"max_num_batched_tokens": chunked["max_num_batched_tokens"], "chunked_prefill_on": chunked["on"],
           "concurrency": concurrencies, "digest_in": digest_in,
           "digest_workers": params.get("digest_workers") or vs.default_digest_workers(),
           "writer_threads": vs_command.writer_threads(params), "enforce_eager": bool(params.get("enforce_eager")),
           "gpu_memory_utilization": params["gpu_memory_utilization"], "server_args": params["server_args"],
           "format": params["format"]}
    differs = {}
    if params.get("max_num_batched_tokens"):
        differs["max_num_batched_tokens"] = "--batched-tokens (the CLI's: the engine's own budget)"
    if concurrencies != [cli["concurrency"]]:
        differs["concurrency"] = f"--concurrency (the CLI's: {cli['concurrency']}, the run's batch_size)"
    if params["gpu_memory_utilization"] != contract.DEFAULTS["gpu_memory_utilization"]:
        differs["gpu_memory_utilization"] = (f"--util (the CLI's: {contract.DEFAULTS['gpu_memory_utilization']}; "
                                             f"the bench's servers share the GPU)")
    differs["server_args"] = "--kv-gib: a fixed KV cache per server (they share the GPU)"
    if bool(params.get("enforce_eager")) != cli["enforce_eager"]:
        differs["enforce_eager"] = "--eager"
    return {**ran, "differs_from_cli": differs}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids_list = load_ids(args.dataset, args.n)
    seq_len = max(len(x) for x in ids_list)
    config = vs.modelconfig.read(args.model)
    n_layers = vs.modelconfig.num_layers(config)
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids
                 else vs.layers.default_layer_ids("vllm-server", n_layers)[0])
    params = engine_params(args, seq_len)
    concurrencies = ([int(x) for x in args.concurrency.split(",")] if args.concurrency
                     else [params["concurrency"]])
    kinds = [k for k in args.kinds.split(",") if k]
    result = {"model": args.model, "samples": len(ids_list), "seq_len": seq_len, "layer_ids": layer_ids,
              "eager": bool(params["enforce_eager"]), "server_args": params["server_args"], "util": args.util,
              "format": args.format, "runs": []}

    engine = vs.VllmServerEngine(args.model, 1, layer_ids, dict(params, work_dir=str(out / "extract_server")))
    # the plain servers: the same builder and params without extraction (RUN_ARGS' ``plain``), prefilling as the
    # extraction server will (its chunked-prefill verdict, read first, as its load reads it)
    chunked = vs_chunking.resolve(params.get("chunked_prefill"),
                                  vs_chunking.installed_verdict(vs.pick_connector(params)))
    result["chunked_prefill"] = chunked
    plain_params = dict(params, plain=True, chunked_prefill_on=chunked["on"])
    max_model_len = engine.model_len(config)
    plain = vs.VllmServer(args.model, tp=1, layer_ids=sorted(layer_ids), work_dir=out / "plain_server",
                          max_model_len=max_model_len, params=plain_params)
    plain_v1 = None
    if "plain_v1" in kinds:  # a third server, on the V1 model runner (the env is read when it starts)
        plain_v1 = vs.VllmServer(args.model, tp=1, layer_ids=sorted(layer_ids), work_dir=out / "plain_v1_server",
                                 max_model_len=max_model_len, params=dict(plain_params))
    timers = Timers()
    for owner, name, label in ((vs.VllmServerEngine, "_request", "request"),
                               (hs_samples, "digest_hs_file", "digest"),
                               (vs.landing, "move_into_place", "rename")):
        timers.wrap(owner, name, label)

    t0 = time.perf_counter()
    plain.start()
    if plain_v1 is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        try:
            plain_v1.start()
        finally:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        engine.load()  # starts and waits for the extraction server
        result["extract_server_ready_s"] = round(engine.server.ready_after_s, 2)
        result["settings"] = settings(engine.params, concurrencies, engine.chunked, engine.digest_in)
        print(json.dumps({"settings": result["settings"]}), flush=True)
        plain.wait_ready(timeout=600)
        result["plain_server_ready_s"] = round(plain.ready_after_s, 2)
        if plain_v1 is not None:
            plain_v1.wait_ready(timeout=600)
            result["plain_v1_server_ready_s"] = round(plain_v1.ready_after_s, 2)
            result["plain_v1_command"] = plain_v1.command
        result["both_ready_s"] = round(time.perf_counter() - t0, 2)
        result["plain_command"] = plain.command
        result["extract_command"] = engine.server.command
        warm = ids_list[:16]
        plain_pass(plain, warm, 8)
        specops_pass(engine, warm, out / "warm", 8, timers)
        result["dirty_limits"] = {k: Path(f"/proc/sys/vm/{k}").read_text().strip()
                                  for k in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes")
                                  if Path(f"/proc/sys/vm/{k}").exists()}
        if plain_v1 is not None:
            plain_pass(plain_v1, warm, 8)
        for rep in range(args.reps):
            for c in concurrencies:
                for kind in kinds:
                    if kind == "plain":
                        run = plain_pass(plain, ids_list, c)
                    elif kind == "plain_v1":
                        run = plain_pass(plain_v1, ids_list, c)
                    elif kind == "server_only":
                        run = server_only_pass(engine, ids_list, c)
                        timers.take()
                    else:
                        if kind == "specops_canary":
                            fresh_canary(engine)
                        run = specops_pass(engine, ids_list, out / "samples", c, timers)
                        if kind == "specops_canary":
                            run["canary"] = canary_record(engine)
                    result["runs"].append(dict(kind=kind, rep=rep, concurrency=c, **run))
                    print(json.dumps(result["runs"][-1]), flush=True)
        for entry in [v for v in args.once.split(",") if v]:
            name, _, c = entry.partition("@")
            c = int(c or max(concurrencies))
            ids = ids_list
            if name == "sustained":
                ids = load_ids(args.dataset, args.sustained_n)
            try:  # an extra pass that fails must not cost the numbers already measured
                if name == "keep":
                    run = keep_pass(engine, ids, out / "samples", c)
                    timers.take()
                elif name == "specops_threads":  # the digests on the engine's threads, as before round 9
                    pool, engine.digest_pool = engine.digest_pool, None
                    try:
                        run = specops_pass(engine, ids, out / "samples", c, timers)
                    finally:
                        engine.digest_pool = pool
                else:
                    _, _, workers = name.partition("+dw")
                    run = specops_pass(engine, ids, out / "samples", c, timers, digest_workers=int(workers or 0))
            except Exception as exc:
                result.setdefault("errors", []).append(f"{entry}: {type(exc).__name__}: {exc}")
                continue
            result["runs"].append(dict(kind=name, rep=0, concurrency=c, **run))
            print(json.dumps(result["runs"][-1]), flush=True)
        if args.profile_digest:
            try:
                result["digest_profile"] = digest_profile(engine, ids_list[:args.profile_digest],
                                                          out / "profile", timers)
            except Exception as exc:
                result.setdefault("errors", []).append(f"digest profile: {type(exc).__name__}: {exc}")
            print(json.dumps({"digest_profile": result.get("digest_profile")}), flush=True)
    finally:
        engine.close()
        plain.stop()
        if plain_v1 is not None:
            plain_v1.stop()
    best = {}
    for run in result["runs"]:
        key = (run["kind"], run["concurrency"])
        best[key] = max(best.get(key, 0), run["tok_per_s"])
    for run in result["runs"]:
        if "durable_tok_per_s" in run:
            key = (run["kind"] + "_durable", run["concurrency"])
            best[key] = max(best.get(key, 0), run["durable_tok_per_s"])
    table = {f"{k}@{c}": v for (k, c), v in sorted(best.items())}
    plain_best = max(v for (k, _), v in best.items() if k == "plain")
    result["best_tok_per_s"] = table
    result["ratios_vs_best_plain"] = {k: round(v / plain_best, 3) for k, v in table.items()}
    result["ratios_same_concurrency"] = {
        f"{k}@{c}": round(v / best[("plain", c)], 3) for (k, c), v in sorted(best.items())
        if k != "plain" and ("plain", c) in best}
    if any(k == "plain_v1" for k, _ in best):
        result["ratios_vs_plain_v1"] = {
            f"{k}@{c}": round(v / best[("plain_v1", c)], 3) for (k, c), v in sorted(best.items())
            if k != "plain_v1" and ("plain_v1", c) in best}
    result["median_tok_per_s"] = {
        f"{k}@{c}": statistics.median(r["tok_per_s"] for r in result["runs"] if (r["kind"], r["concurrency"]) == (k, c))
        for (k, c) in sorted(best) if not k.endswith("_durable")}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
