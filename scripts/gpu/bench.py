#!/usr/bin/env python3
"""Extraction tok/s of specops's ``vllm-server`` engine vs plain prefill of the same vLLM, same ids.

    python3 scripts/gpu/bench.py --model DIR --dataset ids.jsonl --out DIR [--n 512] [--reps 2]
        [--concurrency 32,64] [--kinds plain,server_only,fast] [--once specops@32,fast_durable@64,sustained@64]
        [--util 0.4] [--kv-gib 24] [--eager] [--batched-tokens 16384] [--device cuda]

Two servers of the same vLLM with the same flags (``remote.engines.vllm_server.server_command``)
start side by side on the one GPU, so one start-up pays for both: the *extraction* server
(extract_hidden_states + the hidden-states connector, driven by ``VllmServerEngine``) and
the *plain* server (the same argv minus ``--speculative-config`` and ``--kv-transfer-config``).
Both get the same fixed KV cache (``--kv-cache-memory-bytes``: memory profiling of two
servers starting together would see each other). They are then measured one at a time
(the other idles), on the same token ids. Kinds of pass:

* ``plain``: the same client requests (``/v1/completions``, ids as prompt, ``max_tokens`` 1,
  ``concurrency`` in flight): prefill tok/s;
* ``server_only``: extraction requests, waiting for each file's lock, then deleting it:
  what the engine + connector can do, our file handling left out;
* ``specops``: ``engine.extract_files`` exactly as a run does it today: request, wait, load and
  check (ids, shape, NaN/Inf), fsync + rename into the output dir, sha256 -- writes included;
* ``no_fsync`` / ``no_sha256`` / ``no_check``: ``specops`` with one of our per-file costs removed;
* ``fast``: the proposed client path (:func:`fast_extract_one`: one read, sha256 of those bytes,
  ids/shape/NaN checked on the raw buffer, rename without a per-file fsync);
  ``fast_durable``: the same plus one ``syncfs`` of the output filesystem at the end;
  ``sustained``: ``fast_durable`` over ``--sustained-n`` samples (past the kernel's dirty-page limit).

Time inside each step of ``extract_one`` is summed over threads (``*_thread_s``); divided by
the wall time and the concurrency it says how busy the client's threads were with it.
Prints one JSON object and writes it to ``OUT/bench.json``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from remote import fsutil  # noqa: E402
from remote.engines import vllm_server as vs  # noqa: E402

_ORIGINAL_COMMAND = vs.server_command


def _plain_aware_command(*args, **kwargs):
    """``server_command``, minus the extraction flags when ``params["_plain"]`` is set."""
    argv = _ORIGINAL_COMMAND(*args, **kwargs)
    if not kwargs["params"].get("_plain"):
        return argv
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("--speculative-config", "--kv-transfer-config"):
            skip = True
            continue
        out.append(word)
    return out


vs.server_command = _plain_aware_command


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


@contextlib.contextmanager
def variant(name):
    """Remove one of our per-file costs for the duration (measurement only)."""
    saved = []
    if name == "no_fsync":
        saved.append((vs, "_fsync_file", vs._fsync_file))
        vs._fsync_file = lambda path: None
    elif name == "no_sha256":
        saved.append((fsutil, "sha256_file", fsutil.sha256_file))
        fsutil.sha256_file = lambda path: ""
    elif name in ("fast", "fast_durable", "sustained"):
        saved.append((vs.VllmServerEngine, "extract_one", vs.VllmServerEngine.extract_one))
        vs.VllmServerEngine.extract_one = fast_extract_one
    elif name == "no_check":
        saved.append((vs.VllmServerEngine, "_load_checked", vs.VllmServerEngine._load_checked))
        vs.VllmServerEngine._load_checked = lambda self, index, ids, path: {
            "hidden_states": _FakeStates()}
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


# ---------------------------------------------------------------------------- the proposed client path
#: What ``VllmServerEngine.extract_one`` does per file today: ``load_file`` (read #1 + copy),
#: ``torch.isfinite`` (torch intra-op threads x our request threads), fsync, rename,
#: ``sha256_file`` (read #2). ``fast_extract_one`` below reads the file once, hashes those
#: bytes, checks ids/shape/finiteness on the raw buffer (numpy, no copy, GIL released) and
#: renames without a per-file fsync; durability is one sync of the output filesystem per
#: chunk (``sync_output``), measured apart as ``fast_durable``.

_FINITE_MASK = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}
_TORCH_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def check_raw(raw: bytes, token_ids, num_layers: int, hidden_size) -> tuple[list, list, str]:
    """``(problems, shape, dtype)`` of a connector file given as bytes (safetensors layout)."""
    import numpy as np

    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    base = 8 + header_len
    problems = []
    missing = {"token_ids", "hidden_states"} - set(header)
    if missing:
        return [f"file lacks {sorted(missing)} (has {sorted(k for k in header if k != '__metadata__')})"], [], ""
    tid, hs = header["token_ids"], header["hidden_states"]
    if tid["dtype"] != "I64" or len(tid["shape"]) != 1:
        problems.append(f"token_ids is {tid['dtype']} {tid['shape']}, expected int64 [T]")
    else:
        a, b = tid["data_offsets"]
        got = np.frombuffer(raw, dtype="<i8", count=(b - a) // 8, offset=base + a)
        if got.shape[0] != len(token_ids) or not np.array_equal(got, np.asarray(token_ids, dtype=np.int64)):
            problems.append(f"token_ids do not echo the request ({got.shape[0]} ids back, {len(token_ids)} sent)")
    shape, dtype = list(hs["shape"]), hs["dtype"]
    want = [len(token_ids), num_layers]
    if len(shape) != 3 or shape[:2] != want or (hidden_size and shape[2] != hidden_size):
        problems.append(f"hidden_states shape {shape}, expected {want + [hidden_size or 'H']} [T, L, H]")
    elif dtype in _FINITE_MASK:
        np_dtype, mask = _FINITE_MASK[dtype]
        a, b = hs["data_offsets"]
        words = np.frombuffer(raw, dtype=np_dtype, count=(b - a) // np.dtype(np_dtype).itemsize, offset=base + a)
        bad = int(np.count_nonzero((words & mask) == mask))  # exponent all ones: NaN or Inf
        if bad:
            problems.append(f"hidden_states has {bad} NaN/Inf values")
    return problems, shape, _TORCH_DTYPE.get(dtype, dtype.lower())


def fast_extract_one(self, index: int, token_ids, out_dir) -> dict:
    """``extract_one`` with one read, hash-from-bytes, raw-buffer check, and no per-file fsync."""
    import hashlib

    t0 = time.monotonic()
    try:
        path = self._request(token_ids)
    except vs.SampleRejected as exc:
        raise vs.SampleRejected(index, exc.problems) from None
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        digest = hashlib.sha256(raw).hexdigest()
        problems, shape, dtype = check_raw(raw, token_ids, len(self.file_layer_ids), self.hidden_size)
        if problems:
            raise vs.SampleRejected(index, problems)
    except BaseException:
        os.unlink(path)
        raise
    dest = Path(out_dir) / vs.SAMPLE_FILE.format(index=index)
    os.replace(path, dest)
    return {"index": index, "file": dest.name, "tokens": len(token_ids), "shape": shape, "dtype": dtype,
            "bytes": len(raw), "sha256": digest, "seconds": round(time.monotonic() - t0, 4)}


def sync_output(out_dir) -> float:
    """Make every file under ``out_dir``'s filesystem durable at once (Linux ``syncfs``); seconds."""
    import ctypes

    t = time.perf_counter()
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
    return time.perf_counter() - t


class _FakeStates:
    shape = (0, 0, 0)
    dtype = "unchecked"


def specops_pass(engine, ids_list, out_dir, concurrency, timers, durable=False):
    engine.params["concurrency"] = concurrency
    shutil.rmtree(out_dir, ignore_errors=True)
    samples = list(enumerate(ids_list))
    t = time.perf_counter()
    records = engine.extract_files(samples, out_dir)
    sync_s = sync_output(str(out_dir)) if durable else None
    wall = time.perf_counter() - t
    tokens = sum(r["tokens"] for r in records)
    out = {"tokens": tokens, "files": len(records), "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
           "bytes_per_file": records[0]["bytes"] if records else None}
    if durable:
        out["sync_s"] = round(sync_s, 3)
    out.update(timers.take())
    shutil.rmtree(out_dir, ignore_errors=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--kinds", default="plain,server_only,specops",
                        help="passes repeated --reps times at each concurrency (plain, server_only, specops, fast)")
    parser.add_argument("--once", default="no_fsync@32,no_sha256@32,no_check@32",
                        help="NAME@C passes run once after them (no_fsync, no_sha256, no_check, fast, fast_durable, "
                             "sustained, specops)")
    parser.add_argument("--sustained-n", type=int, default=1024)
    parser.add_argument("--util", type=float, default=0.4)
    parser.add_argument("--kv-gib", type=float, default=24)
    parser.add_argument("--batched-tokens", type=int, default=16384)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--layer-ids", default="")
    parser.add_argument("--device", default="cuda", help="cpu: rehearse on a CPU host (test-host env)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids_list = load_ids(args.dataset, args.n)
    seq_len = max(len(x) for x in ids_list)
    config = vs.modelconfig.read(args.model)
    n_layers = vs.modelconfig.num_layers(config)
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids
                 else vs.layers.default_layer_ids("vllm-server", n_layers)[0])
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    server_args = ["--kv-cache-memory-bytes", str(int(args.kv_gib * (1 << 30))),
                   "--max-num-batched-tokens", str(args.batched_tokens)]
    common = {"device": args.device, "gpu_memory_utilization": args.util, "seq_len": seq_len,
              "enforce_eager": args.eager, "server_args": server_args, "ready_timeout_s": 600}
    result = {"model": args.model, "samples": len(ids_list), "seq_len": seq_len, "layer_ids": layer_ids,
              "eager": args.eager, "server_args": server_args, "util": args.util, "runs": []}

    engine = vs.VllmServerEngine(args.model, 1, layer_ids, dict(common, work_dir=str(out / "extract_server")))
    plain = vs.VllmServer(args.model, tp=1, layer_ids=sorted(layer_ids), work_dir=out / "plain_server",
                          max_model_len=seq_len + 1, params=dict(common, _plain=True))
    timers = Timers()
    for owner, name, label in ((vs.VllmServerEngine, "_request", "request"),
                               (vs.VllmServerEngine, "_load_checked", "load_check"),
                               (vs, "move_into_place", "fsync_rename"),
                               (vs, "_fsync_file", "fsync"),
                               (fsutil, "sha256_file", "sha256")):
        timers.wrap(owner, name, label)

    t0 = time.perf_counter()
    plain.start()
    try:
        engine.load()  # starts and waits for the extraction server
        result["extract_server_ready_s"] = round(engine.server.ready_after_s, 2)
        plain.wait_ready(timeout=600)
        result["plain_server_ready_s"] = round(plain.ready_after_s, 2)
        result["both_ready_s"] = round(time.perf_counter() - t0, 2)
        result["plain_command"] = plain.command
        result["extract_command"] = engine.server.command
        warm = ids_list[:16]
        plain_pass(plain, warm, 8)
        specops_pass(engine, warm, out / "warm", 8, timers)
        result["dirty_limits"] = {k: Path(f"/proc/sys/vm/{k}").read_text().strip()
                                  for k in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes")
                                  if Path(f"/proc/sys/vm/{k}").exists()}
        kinds = [k for k in args.kinds.split(",") if k]
        for rep in range(args.reps):
            for c in concurrencies:
                for kind in kinds:
                    if kind == "plain":
                        run = plain_pass(plain, ids_list, c)
                    elif kind == "server_only":
                        run = server_only_pass(engine, ids_list, c)
                        timers.take()
                    else:
                        with variant(kind):
                            run = specops_pass(engine, ids_list, out / "samples", c, timers)
                    result["runs"].append(dict(kind=kind, rep=rep, concurrency=c, **run))
                    print(json.dumps(result["runs"][-1]), flush=True)
        for entry in [v for v in args.once.split(",") if v]:
            name, _, c = entry.partition("@")
            c = int(c or max(concurrencies))
            ids = ids_list
            if name == "sustained":
                ids = load_ids(args.dataset, args.sustained_n)
            with variant(name):
                result["runs"].append(dict(kind=name, rep=0, concurrency=c, **specops_pass(
                    engine, ids, out / "samples", c, timers, durable=name in ("fast_durable", "sustained"))))
            print(json.dumps(result["runs"][-1]), flush=True)
    finally:
        engine.close()
        plain.stop()
    best = {}
    for run in result["runs"]:
        key = (run["kind"], run["concurrency"])
        best[key] = max(best.get(key, 0), run["tok_per_s"])
    table = {f"{k}@{c}": v for (k, c), v in sorted(best.items())}
    plain_best = max(v for (k, _), v in best.items() if k == "plain")
    result["best_tok_per_s"] = table
    result["ratios_vs_best_plain"] = {k: round(v / plain_best, 3) for k, v in table.items()}
    result["ratios_same_concurrency"] = {
        f"{k}@{c}": round(v / best[("plain", c)], 3) for (k, c), v in sorted(best.items())
        if k != "plain" and ("plain", c) in best}
    result["median_tok_per_s"] = {
        f"{k}@{c}": statistics.median(r["tok_per_s"] for r in result["runs"] if (r["kind"], r["concurrency"]) == (k, c))
        for (k, c) in sorted(best)}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
