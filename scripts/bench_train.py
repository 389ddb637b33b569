"""Benchmark: extract -> train -> eval on the modern test host, with the commands a user types.

Runs, from this laptop over SSH against the built-in modern test host (brought up here;
``inventory.yaml``'s group ``modern``: the tiny Llama and the chat dataset):

1. ``specops extract --on modern --run-id R --max-samples N`` (the states);
2. ``specops train --on modern --run-id D --from-run R --epochs E`` (a draft, detached and followed);
3. ``specops train --on modern --run-id U --from-run R --dry-run`` (an untrained draft, the same shape);
4. ``specops train --on modern --run-id G --from-run R --epochs E --regenerate`` (the target writes its own
   replies to R's rows, their states are extracted, a draft trains on them);
5. ``specops eval --on modern --draft D -k 3`` and the same for ``U`` and ``G`` (held-out rows, acceptance
   from vLLM's own ``/metrics``).

Prints each command with its wall time, the trainer's tokens/s (its own log lines) and the
acceptance of the drafts side by side (measured in one run: the untrained draft is the
floor a trained one must clear; the one trained on the target's own replies against the one
trained on the dataset's).

    .venv/bin/python scripts/bench_train.py [--samples 8] [--epochs 20] [--prompts 8] [--regen-max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECOPS = Path(sys.executable).parent / "specops"


def specops(*args) -> tuple[dict, float, str]:
    """``specops ARGS --json``: (the report, wall seconds, the command as typed)."""
    typed = "specops " + " ".join(map(str, args))
    t0 = time.monotonic()
    proc = subprocess.run([str(SPECOPS), *map(str, args), "--json"], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{typed} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{wall:7.1f} s  {typed}", flush=True)
    return json.loads(proc.stdout), wall, typed


def records(doc: dict) -> dict:
    return {r["name"]: r for host in doc["hosts"] for r in host["records"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--regen-max-tokens", type=int, default=64)
    args = parser.parse_args()
    stamp = time.strftime("%H%M%S")
    states, draft, untrained = f"bench-train-states-{stamp}", f"bench-draft-{stamp}", f"bench-untrained-{stamp}"
    regen = f"bench-regen-{stamp}"
    subprocess.run([str(SPECOPS), "testhost.up", "--stack", "modern"], cwd=REPO, check=True, capture_output=True)
    specops("extract", "--on", "modern", "--run-id", states, "--max-samples", args.samples, "--skip-smoke")
    trained, train_s, _ = specops("train", "--on", "modern", "--run-id", draft, "--from-run", states,
                                  "--epochs", args.epochs)
    final = (trained["hosts"][0].get("data") or {}).get("final_status") or {}
    specops("train", "--on", "modern", "--run-id", untrained, "--from-run", states, "--dry-run")
    regenerated, regen_s, _ = specops("train", "--on", "modern", "--run-id", regen, "--from-run", states, "--epochs",
                                      args.epochs, "--regenerate", "--regen-max-tokens", args.regen_max_tokens)
    regen_final = (regenerated["hosts"][0].get("data") or {}).get("final_status") or {}
    acceptance = {}
    for name in (draft, untrained, regen):
        doc, wall, _ = specops("eval", "--on", "modern", "--draft", name, "-k", 3, "--prompts", args.prompts)
        acceptance[name] = {**records(doc)["eval.acceptance"]["detail"], "wall_s": wall}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\ntest host modern ({cpu}): {args.samples} samples, {args.epochs} epochs, k=3, {args.prompts} held-out prompts")
    print(f"training: {final.get('steps_total')} steps in {train_s:.0f} s (the command, followed), "
          f"trainer {final.get('tokens_per_s')} tok/s, last loss {final.get('loss')}, accuracy {final.get('accuracy')}")
    made = regen_final.get("regenerated") or {}
    print(f"--regenerate: {made.get('samples')} rows, {made.get('reply_tokens')} reply tokens written by the target in "
          f"{made.get('wall_s')} s (server ready in {made.get('ready_s')} s); regenerate + extract + train "
          f"{regen_s:.0f} s")
    for label, name in (("trained", draft), ("untrained", untrained), ("regen", regen)):
        a = acceptance[name]
        print(f"{label:9s} draft: {a['accepted']:4d} of {a['draft_tokens']:4d} draft tokens accepted "
              f"({a['acceptance_rate']:.1%}), mean acceptance length {a['mean_acceptance_length']}, "
              f"per position {a['per_position']}, {a['tokens_per_s']} output tok/s")
    t, u = acceptance[draft], acceptance[untrained]
    g = acceptance[regen]
    print(f"mean acceptance length trained / untrained: {t['mean_acceptance_length'] / u['mean_acceptance_length']:.3f}")
    print(f"mean acceptance length on the target's own replies / on the dataset's: "
          f"{g['mean_acceptance_length'] / t['mean_acceptance_length']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
