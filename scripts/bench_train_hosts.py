"""Benchmark: training on two test hosts vs one (issue 42, item 3), steps/s side by side in one run.

From this laptop over SSH against the built-in modern test host (brought up here; ``inventory.yaml``'s
``testhost-modern``: the tiny Llama and the chat dataset):

1. ``specops extract --on one --run-id R --max-samples N`` (the states, once);
2. alternating ``--repeat`` times: ``specops train --on one`` (one host, one trainer process) and
   ``specops train --on one,two`` (two hosts, one trainer process each: torchrun's nodes, gloo), the same
   states and epochs. Host ``two`` is the same machine under another work_dir, the states run linked into
   it (a shared output_dir), so the two "hosts" share its cores: on a 2-core test machine the ratio says what
   the gloo all-reduce and a second process cost there, not what a second machine brings.

Prints, per run, the trainer's steps/s and samples/s over its training window (the head's ``metrics.jsonl``:
first to last step, the trainer's start and load left out; a step of two nodes is one sample per node), and
the two-host / one-host ratios of their medians.

    .venv/bin/python scripts/bench_train_hosts.py [--samples 16] [--epochs 3] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SPECOPS = Path(sys.executable).parent / "specops"
HOST = "testhost-modern"


def specops(*args, env: dict) -> dict:
    typed = "specops " + " ".join(map(str, args))
    t0 = time.monotonic()
    proc = subprocess.run([str(SPECOPS), *map(str, args), "--json"], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env={**os.environ, **env})
    if proc.returncode != 0:
        raise SystemExit(f"{typed} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{time.monotonic() - t0:7.1f} s  {typed}", flush=True)
    return json.loads(proc.stdout)


def inventory(tmp: Path) -> tuple[Path, Path]:
    """Hosts ``one`` (the modern test host) and ``two`` (the same, its own work_dir); the head's work_dir."""
    from specops.inventory import load_inventory

    inv = load_inventory(REPO / "inventory.yaml")
    spec = inv.hosts[HOST].model_dump(exclude_none=True, exclude={"name"})
    spec["node_address"] = "127.0.0.1"  # the alias is the loopback sshd: the rendezvous address
    work = Path(os.path.expanduser(spec["work_dir"]))
    two = {**spec, "work_dir": str(tmp / "work-two")}
    doc = {"ssh_config": inv.ssh_config, "hosts": {"one": spec, "two": two}}
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, work


def window(metrics: Path) -> dict:
    """Steps, seconds from the first to the last step, steps/s of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    seconds = train[-1]["t"] - train[0]["t"]
    return {"steps": len(train), "seconds": seconds, "steps_per_s": (len(train) - 1) / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--master-port", type=int, default=29611)
    args = parser.parse_args()
    subprocess.run([str(SPECOPS), "testhost.up", "--stack", "modern"], cwd=REPO, check=True, capture_output=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-hosts-"))
    inv, work = inventory(tmp)
    env = {"SPECOPS_RUNS": str(tmp / "runs")}
    stamp = time.strftime("%H%M%S")
    states = f"bench-hosts-states-{stamp}"
    specops("extract", "--inventory", inv, "--on", "one", "--run-id", states, "--max-samples", args.samples,
            "--skip-smoke", env=env)
    (tmp / "work-two" / "runs").mkdir(parents=True)
    (tmp / "work-two" / "runs" / states).symlink_to(work / "runs" / states)
    got: dict[int, list[dict]] = {1: [], 2: []}
    for i in range(args.repeat):
        for nodes, on in ((1, "one"), (2, "one,two")):
            run_id = f"bench-hosts-{nodes}-{stamp}-{i}"
            extra = ["--master-port", args.master_port] if nodes > 1 else []
            specops("train", "--inventory", inv, "--on", on, "--run-id", run_id, "--from-run", states,
                    "--epochs", args.epochs, *extra, env=env)
            found = window(tmp / "runs" / "one" / run_id / "metrics.jsonl")
            found["samples_per_s"] = found["steps_per_s"] * nodes
            got[nodes].append(found)
            print(f"          {nodes} host(s): {found['steps']} steps in {found['seconds']:.1f} s: "
                  f"{found['steps_per_s']:.3f} steps/s, {found['samples_per_s']:.3f} samples/s", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    median = {n: {k: statistics.median(r[k] for r in rows) for k in ("steps_per_s", "samples_per_s")}
              for n, rows in got.items()}
    print(f"\n{os.cpu_count()} cores ({cpu}); {args.samples} samples, {args.epochs} epochs, {args.repeat} run(s) each")
    for n in (1, 2):
        print(f"{n} host(s): {median[n]['steps_per_s']:.3f} steps/s, {median[n]['samples_per_s']:.3f} samples/s")
    print(f"two hosts / one host: steps/s {median[2]['steps_per_s'] / median[1]['steps_per_s']:.3f}, "
          f"samples/s {median[2]['samples_per_s'] / median[1]['samples_per_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
