"""Benchmark: online training (``train --online``) against offline (extract, then train) on the modern test host.

Runs, from this laptop over SSH against the built-in modern test host (brought up here; ``inventory.yaml``'s
group ``modern``: the tiny Llama and the chat dataset), the commands a user types, side by side in one run:

1. offline: ``specops extract --on modern --run-id R --max-samples N`` (the states on disk), then
   ``specops train --on modern --run-id F --from-run R --epochs E``;
2. online: ``specops train --on modern --run-id O --from-run R --epochs E --online`` (R gives the plan and the
   token dataset; its states are never read: the run's own server makes them again for every row).

Prints each command's wall time, each way's training tokens a second (the epochs' tokens over the wall time of
the whole way: offline = extraction + training, online = its one run, the server's load included) and the
trainer's own rate, the disk each way keeps for its data (measured on the host's disk, links not followed: offline the states
run's output dir; online the token dataset it links plus the files of its ``online-data/`` and the server's
``storage/``), and the ratios online / offline.

    .venv/bin/python scripts/bench_online.py [--samples 8] [--epochs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_train import REPO, SPECOPS, records, specops  # the commands as a user types them, timed

sys.path.insert(0, str(REPO))
from remote.train.online import SERVER_DIR  # noqa: E402
from remote.train.plan import ONLINE_DATA  # noqa: E402

#: where an online run keeps data of its own: its linked token dataset and the server's files not yet read
DATA_DIRS = (ONLINE_DATA, f"{SERVER_DIR}/storage")


def disk_bytes(root: Path, skip=()) -> int:
    """Bytes of the plain files under ``root`` (links are not followed: a linked file is counted where it lives)."""
    total = 0
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (Path(top) == root and d in skip)]
        total += sum(os.lstat(Path(top) / f).st_size for f in files if not os.path.islink(Path(top) / f))
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    stamp = time.strftime("%H%M%S")
    states, offline, online = f"bench-online-states-{stamp}", f"bench-offline-{stamp}", f"bench-online-{stamp}"
    subprocess.run([str(SPECOPS), "testhost.up", "--stack", "modern"], cwd=REPO, check=True, capture_output=True)
    _, extract_s, _ = specops("extract", "--on", "modern", "--run-id", states, "--max-samples", args.samples,
                              "--skip-smoke")
    off_doc, train_s, _ = specops("train", "--on", "modern", "--run-id", offline, "--from-run", states,
                                  "--epochs", args.epochs)
    on_doc, online_s, _ = specops("train", "--on", "modern", "--run-id", online, "--from-run", states,
                                  "--epochs", args.epochs, "--online")
    off_final = (off_doc["hosts"][0].get("data") or {}).get("final_status") or {}
    on_final = (on_doc["hosts"][0].get("data") or {}).get("final_status") or {}
    plan = records(on_doc)["train.plan"]["detail"]
    priced = records(on_doc)["train.online"]
    work = Path(os.path.expanduser(os.environ.get("SPECOPS_CACHE", "~/.cache/specops"))) / "testhost/modern/work"
    states_out = Path(json.loads((work / "runs" / states / "status.json").read_text())["output_dir"])
    offline_bytes = disk_bytes(states_out)
    token_dataset = disk_bytes(states_out, skip=("hidden_states",))
    online_run = work / "runs" / online
    online_bytes = token_dataset + sum(disk_bytes(online_run / d) for d in DATA_DIRS if (online_run / d).is_dir())
    tokens = int(plan["tokens"]) * args.epochs
    off_tps, on_tps = tokens / (extract_s + train_s), tokens / online_s
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\ntest host modern ({cpu}, {os.cpu_count()} cores): {plan['samples']} samples, {plan['tokens']} tokens, "
          f"{args.epochs} epochs ({tokens} training tokens)")
    print(f"offline: extract {extract_s:.0f} s + train {train_s:.0f} s = {extract_s + train_s:.0f} s, "
          f"{off_tps:.1f} tok/s of training; the trainer {off_final.get('tokens_per_s')} tok/s; "
          f"disk {offline_bytes} B (states and token dataset)")
    print(f"online:  train --online {online_s:.0f} s (server ready in "
          f"{(on_final.get('online_server') or {}).get('ready_s')} s), {on_tps:.1f} tok/s of training; the trainer "
          f"{on_final.get('tokens_per_s')} tok/s; disk {online_bytes} B (the token dataset)")
    print(f"ratios online / offline: tok/s {on_tps / off_tps:.2f}, disk {online_bytes / offline_bytes:.3f}")
    print(f"preflight's estimate: {priced['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
