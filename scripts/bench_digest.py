"""Benchmark: the landing digest's cost per byte, for 1024- and 4096-token sample files, on one core.

Every sample file the vllm-server engine lands is read once for its checks, its digest and
its per-layer statistics (``remote.extract.sampleread.digest_hs_file``). On the H200 the digest was
the limit of the run, and its cost per byte grew with the sample's length (a 2048-token
file cost 3x per byte what a 1024-token one did). This prints, per core (one torch thread),
for files of the ``llama_wide`` shape (4 layers x hidden 4096, bf16: 32 MB per 1024 tokens),
measured side by side in one run (interleaved), best of ``--repeat``:

* the whole digest (``digest_hs_file``: checks, statistics and the manifest's hash, BLAKE3
  where the python has ``blake3``, else sha256: the hash is named on its own line), its
  sha256 alone, its statistics alone;
* the statistics as they were computed before (one float32 copy of the whole layer, then
  three passes over it), for the ratio;
* ``per-byte cost 4096 / 1024``: 1.0 is linear in the bytes.

Run on the test host's modern env (torch and safetensors; brought up here when missing)::

    .venv/bin/python scripts/bench_digest.py [--repeat 5] [--tokens 1024,4096] [--hidden 4096] [--layers 4]
    python3 scripts/bench_digest.py --here     # a python with torch and safetensors (a GPU host's)

With ``blake3`` importable (every host with vLLM has it), its one-thread GB/s is printed beside sha256's,
and the digest line's GB/s is the one a run lands files at: statistics + BLAKE3.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MEASURE = r"""
import hashlib, json, math, os, sys, tempfile, time
import torch
from safetensors.torch import save_file
from remote.wire import fsutil
from remote.extract import sampleread

torch.set_num_threads(1)
args = json.loads(sys.argv[1])

def stats_before(x):
    # the previous layer_partial: one float32 copy of the whole layer, three passes over it
    f = x.float().reshape(-1)
    return float(f.sum()), float(torch.dot(f, f)), [float(v) for v in torch.aminmax(f)]

class FreshBlocks:
    # the digest before the reused block: every block of every layer a new float32 tensor (a 2 MiB
    # allocation, which glibc serves by mmap and returns by munmap)
    def __init__(self, rows, width):
        self.width = width
    def __getitem__(self, rows):
        return torch.empty(rows.stop, self.width)

def digest_with(name, replacement, path, layer_ids):
    # the digest with one of sampleread's parts replaced by what it was before
    kept = getattr(sampleread, name)
    setattr(sampleread, name, replacement)
    try:
        return sampleread.digest_hs_file(path, layer_ids, layer_ids)
    finally:
        setattr(sampleread, name, kept)

def fresh_blocks(path, layer_ids):
    return digest_with("_block_buffer", FreshBlocks, path, layer_ids)

def table_widener(states):
    # the fp8 widening before: numpy's take of the byte codes from a 256-entry float32 table
    import numpy as np
    table = torch.arange(256, dtype=torch.uint8).view(states.dtype).float().numpy()
    codes = states.view(torch.uint8).numpy()
    def widen(start, stop, pos, out):
        np.take(table, codes[start:stop, pos], out=out.numpy(), mode="clip")
        # what the bit widener hands back, value / 256 (exact): one pass more than before, ~5 % of the table's cost
        out.div_(sampleread.FP8_AS_HALF_FACTOR)
        return out
    return widen

def fp8_by_table(path, layer_ids):
    return digest_with("_fp8_widener", table_widener, path, layer_ids)

def digest_now(path, layer_ids):
    return sampleread.digest_hs_file(path, layer_ids, layer_ids)

def best_of(fns):
    # each of fns (name -> callable) `repeat` times, interleaved (a noisy box slows them alike); the best
    times = {name: [] for name in fns}
    for _ in range(args["repeat"]):
        for name, fn in fns.items():
            t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}

out = {"hash": fsutil.default_hash()}
with tempfile.TemporaryDirectory() as tmp:
    for tokens in args["tokens"]:
        torch.manual_seed(tokens)
        states = torch.randn(tokens, args["layers"], args["hidden"]).to(torch.bfloat16)
        ids = torch.arange(tokens, dtype=torch.int64)
        path = f"{tmp}/hs_{tokens}.safetensors"
        tensors = {"token_ids": ids, "hidden_states": states}
        layer_ids = list(range(args["layers"]))
        fp8_fns = {}
        if args["format"] == "fp8":  # hs-connectors' layout: fp8 states, one float32 scale per token
            bf16_path = f"{tmp}/hs_{tokens}_bf16.safetensors"  # the same tokens in bf16, digested side by side
            save_file(dict(tensors), bf16_path)
            tensors = {"token_ids": ids, "hidden_states": states.to(torch.float8_e4m3fn),
                       "hidden_states_scales": torch.rand(tokens, 1, 1) + 0.5}
            states = tensors["hidden_states"]
            fp8_fns = {"digest_bf16_s": lambda: sampleread.digest_hs_file(bf16_path, layer_ids, layer_ids),
                       "digest_table_s": lambda: fp8_by_table(path, layer_ids)}
        save_file(tensors, path)
        raw = open(path, "rb").read()  # the page cache holds it, as it does a file the connector just wrote
        size = len(raw)
        cols = [states[:, j] for j in layer_ids]
        fns = {"digest_s": lambda: sampleread.digest_hs_file(path, layer_ids, layer_ids),
               "digest_fresh_blocks_s": lambda: fresh_blocks(path, layer_ids),
               "sha256_s": lambda: hashlib.sha256(raw).hexdigest(),
               "stats_s": lambda: [sampleread.layer_partial(c) for c in cols],
               "stats_before_s": lambda: [stats_before(c) for c in cols], **fp8_fns}
        try:  # the hash every vLLM host has (a vLLM dependency): one thread, as a digest worker would run it
            import blake3
            fns["blake3_s"] = lambda: blake3.blake3(raw).hexdigest()
        except ImportError:
            pass
        row = {"bytes": size, **best_of(fns)}
        out[tokens] = row
    if args["threads"]:
        # several files digested at once, each on one thread (as a run's landing threads do): GB/s of
        # the one-pass digest and of the two-pass one, interleaved, over files in the page cache
        import concurrent.futures, multiprocessing, shutil
        tokens = args["tokens"][0]
        src = f"{tmp}/hs_{tokens}.safetensors"
        files = []
        for i in range(args["files"]):
            files.append(f"{tmp}/p_{i}.safetensors")
            shutil.copy(src, files[-1])
        layer_ids = list(range(args["layers"]))
        size = os.path.getsize(src)
        par = {}
        procs = {}
        for threads in args["threads"]:
            # processes: one digest per process, no lock shared between them (the GIL, the address
            # space's); started and warmed before the clock runs
            # (OMP_NUM_THREADS=1 is inherited; a function of a module, since this script is `python -c`)
            procs[threads] = concurrent.futures.ProcessPoolExecutor(
                threads, mp_context=multiprocessing.get_context("spawn"))
            list(procs[threads].map(sampleread.digest_hs_file, files[:threads], [layer_ids] * threads,
                                    [layer_ids] * threads))
        for threads in args["threads"]:
            def on_threads(one, threads=threads):
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    list(pool.map(one, files, [layer_ids] * len(files)))
            fns = {"now": lambda: on_threads(digest_now), "fresh_blocks": lambda: on_threads(fresh_blocks),
                   "processes": lambda threads=threads: list(procs[threads].map(
                       sampleread.digest_hs_file, files, [layer_ids] * len(files), [layer_ids] * len(files)))}
            best = best_of(fns)
            par[threads] = {k: len(files) * size / v / 1e9 for k, v in best.items()}
        for pool in procs.values():
            pool.shutdown()
        out["parallel"] = {"tokens": tokens, "files": len(files), "bytes": size, "GB_per_s": par}
print(json.dumps(out))
"""


def host_python() -> str:
    from specops.testhost.hostenv import ensure_hostenv

    return str(ensure_hostenv(quiet=True, stack="modern"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", default="",
                        help="also digest --files files at once on 1,4,8,... threads (now, and with a fresh block per layer as before) and as many processes, GB/s")
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--format", default="bf16", choices=("bf16", "fp8"),
                        help="fp8: hs-connectors' files")
    parser.add_argument("--here", action="store_true",
                        help="measure in this python (it has torch and safetensors), not the test host's env")
    args = parser.parse_args()
    spec = {"repeat": args.repeat, "tokens": [int(t) for t in args.tokens.split(",")], "hidden": args.hidden,
            "layers": args.layers, "files": args.files, "format": args.format,
            "threads": [int(t) for t in args.threads.split(",") if t]}
    python = sys.executable if args.here else host_python()
    proc = subprocess.run([python, "-c", MEASURE, json.dumps(spec)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    hashed_with = measured.pop("hash")
    parallel = measured.pop("parallel", None)
    rows = {int(k): v for k, v in measured.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"digest of one sample file, one core ({cpu}), {args.layers} layers x hidden {args.hidden} {args.format}, "
          f"best of {args.repeat}")
    print(f"digest = the manifest's path: checks + statistics + {hashed_with} (the hash a run's manifest names on "
          f"this python{'' if hashed_with == 'blake3' else '; blake3 is not installed'})")
    gbps = lambda row, key: row["bytes"] / row[key] / 1e9  # noqa: E731
    for tokens, row in rows.items():
        print(f"{tokens:5d} tokens ({row['bytes'] / 1e6:6.1f} MB): digest {gbps(row, 'digest_s'):5.2f} GB/s  "
              f"(sha256 {gbps(row, 'sha256_s'):5.2f}, statistics {gbps(row, 'stats_s'):5.2f}; "
              f"statistics before {gbps(row, 'stats_before_s'):5.2f} GB/s)"
              + (f"; blake3 {gbps(row, 'blake3_s'):5.2f} GB/s" if "blake3_s" in row else ""))
    for tokens, row in rows.items():
        print(f"ratio statistics now / before, {tokens} tokens:        {row['stats_before_s'] / row['stats_s']:.2f}x")
    for tokens, row in rows.items():
        if "digest_bf16_s" in row:  # the same tokens: time ratios are tokens-a-second ratios
            print(f"ratio fp8 digest / bf16 digest of the same tokens, {tokens} tokens, tokens a second: "
                  f"{row['digest_bf16_s'] / row['digest_s']:.2f}x; fp8 widened by bits / by a 256-entry table "
                  f"(before): {row['digest_table_s'] / row['digest_s']:.2f}x")
    for tokens, row in rows.items():
        print(f"ratio digest now / fresh blocks (before), {tokens} tokens, one thread: "
              f"{row['digest_fresh_blocks_s'] / row['digest_s']:.2f}x")
    if parallel:
        print(f"{parallel['files']} files of {parallel['tokens']} tokens digested at once ({os.cpu_count()} cores here), "
              f"GB/s, best of {args.repeat}:")
        for threads, got in parallel["GB_per_s"].items():
            print(f"  {int(threads):3d} threads: now {got['now']:6.2f}  fresh blocks (before) {got['fresh_blocks']:6.2f}  "
                  f"ratio {got['now'] / got['fresh_blocks']:.2f}x;  {int(threads):3d} processes {got['processes']:6.2f}  "
                  f"ratio threads / processes {got['now'] / got['processes']:.2f}x")
    lo, hi = min(rows), max(rows)
    if lo != hi:
        per_byte = lambda key: (rows[hi][key] / rows[hi]["bytes"]) / (rows[lo][key] / rows[lo]["bytes"])  # noqa: E731
        print(f"per-byte cost {hi} / {lo} tokens: digest {per_byte('digest_s'):.2f}, statistics "
              f"{per_byte('stats_s'):.2f}, statistics before {per_byte('stats_before_s'):.2f}  (1.0 = linear)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
