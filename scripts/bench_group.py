"""Benchmark: many hosts from one controller, ratios printed (no targets asserted anywhere).

1. **preflight, 1 host vs 8 hosts** at once from one controller. Every "host" is an sshd
   on this machine, so the 8 hosts' remote work shares this machine's cores: the floor
   for 8 hosts is 8 x (one host's remote CPU seconds) / cores, printed beside the walls.
   One host's remote CPU is measured exactly: the sshd listener's reaped-children CPU
   time (``cutime + cstime``) before and after, once every session has ended. Target:
   8-host wall <= 1.5 x max(1-host wall, floor).
2. **sharded extract on 1, 2 and 4 hosts**, one group run each over the same dataset
   (the real patched speculators 0.3.0 generator on vLLM, TP=1, the tiny DeepSeek-V3;
   each host's vLLM bound to one core, host i to core i % cores). Each host's extraction
   tok/s (from its own summary, model load excluded) is compared with the 1-host run's,
   after the core limit: with more single-core hosts than cores, each can have at most
   cores / hosts of one. Target: every host within 10 % of that.

    .venv/bin/python scripts/bench_group.py [--repeat 2] [--samples 384] [--skip-extract] [--skip-preflight]

Brings up its own test sshd (``<cache>/testhost/bench-group``) and its own patched env;
run after ``make bootstrap``. The machine is shared and noisy: read the ratios, not the
seconds.
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

from specops.inventory import load_inventory  # noqa: E402
from specops.preflight import preflight  # noqa: E402
from specops.testhost.hostenv import cache_root, ensure_hostenv, make_overlay_env  # noqa: E402
from specops.testhost.models import ensure_models  # noqa: E402
from specops.testhost.sshd import TestHost  # noqa: E402

BIN = Path(sys.executable).parent
TICK = os.sysconf("SC_CLK_TCK")


def children_cpu_s(pid: int) -> float:
    """CPU seconds of every reaped descendant of ``pid`` (``cutime + cstime``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK


def settle(pid: int, quiet_s: float = 1.0, timeout: float = 30.0) -> float:
    """Wait until the sshd's children CPU stops growing (every session reaped); return it."""
    deadline = time.monotonic() + timeout
    last = children_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = children_cpu_s(pid)
        if now == last:
            return now
        last = now
    return last


def inventory(root: Path, info: dict, python: Path, models: dict, names: list[str], **fields) -> Path:
    hosts = {}
    dataset = fields.pop("dataset", None) or models["dataset"]
    for i, name in enumerate(names):
        hosts[name] = {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
                       "known_hosts": info["known_hosts"], "python": str(python),
                       "work_dir": str(root / name / "work"), "output_dir": str(root / name / "out"),
                       "model_path": str(models["deepseek_v3"]), "dataset": str(dataset),
                       "device": "cpu", "tp": 1, **fields}
        hosts[name]["env"] = {**fields.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
    path = root / f"inventory-{len(names)}.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    return path


def bench_preflight(root: Path, sshd: TestHost, info: dict, python: Path, models: dict, repeat: int,
                    skip_autoconfig: bool) -> None:
    names = [f"h{i}" for i in range(8)]
    inv = load_inventory(inventory(root, info, python, models, names, env={"VLLM_MLA_DISABLE": "1"}))
    pid = int(sshd.pid_file.read_text())
    preflight(inv, "h0", {}, skip_autoconfig=skip_autoconfig)  # warm: bundle on the host, page cache
    one, eight, cpu_one, cpu_eight, laptop_eight, load = [], [], [], [], [], []
    for _ in range(repeat):
        before = settle(pid)
        t0 = time.perf_counter()
        preflight(inv, "h0", {}, skip_autoconfig=skip_autoconfig)
        one.append(time.perf_counter() - t0)
        cpu_one.append(settle(pid) - before)
        load.append(os.getloadavg()[0])
        before, mine = cpu_one[-1] + before, time.process_time()
        t0 = time.perf_counter()
        reports = preflight(inv, ",".join(names), {}, skip_autoconfig=skip_autoconfig)
        eight.append(time.perf_counter() - t0)
        laptop_eight.append(time.process_time() - mine)
        assert len(reports) == 8 and all(r.error is None for r in reports), [r.error for r in reports]
        cpu_eight.append(settle(pid) - before)
    med = statistics.median
    cores = len(os.sched_getaffinity(0))
    floor = 8 * med(cpu_one) / cores
    what = "static checks" if skip_autoconfig else "every check, AutoConfig child included"
    print(f"preflight ({what}), median of {repeat}:")
    print(f"  1 host:   {med(one):6.2f} s wall, {med(cpu_one):.2f} CPU-s on the host side")
    print(f"  8 hosts:  {med(eight):6.2f} s wall, {med(cpu_eight):.2f} CPU-s on the host side, "
          f"{med(laptop_eight):.2f} CPU-s in the controller")
    print(f"  load average before the 8-host run (other work on this machine): {med(load):.1f}")
    print(f"  floor for 8 hosts on this machine's {cores} cores: 8 x {med(cpu_one):.2f} / {cores} = {floor:.2f} s")
    bound = max(med(one), floor)
    print(f"  8-host wall / max(1-host wall, floor) = {med(eight) / bound:.2f} "
          f"(target <= 1.5: {'met' if med(eight) <= 1.5 * bound else 'MISSED'}); "
          f"8-host wall / 1-host wall = {med(eight) / med(one):.2f}")


def run_group(inv: Path, names: list[str], run_id: str, runs: Path) -> dict:
    extra = ["--shard-by", "equal"] if len(names) == 1 else []  # one host still runs as a group
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "specops"), "extract", "--inventory", str(inv), "--on", ",".join(names),
                           "--run-id", run_id, "--skip-preflight", "--skip-smoke", "--json", *extra],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, "SPECOPS_RUNS": str(runs)}, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"group run {run_id} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    group_doc = json.loads((runs / run_id / "group.json").read_text())
    rates = {}
    for shard in group_doc["shards"]:
        if shard["stop"] > shard["start"]:
            summary = json.loads((runs / run_id / "hosts" / shard["hosts"][0] / shard["run_id"] /
                                  "summary.json").read_text())
            rates[shard["hosts"][0]] = summary["extract_tokens_per_s"]
    return {"wall": wall, "rates": rates}


def bench_extract(root: Path, info: dict, python: Path, models: dict, samples: int, repeat: int) -> None:
    rows = [line for line in Path(models["dataset"]).read_text().splitlines() if line.strip()]
    dataset = root / "bench.jsonl"
    dataset.write_text("\n".join((rows * (samples // len(rows) + 1))[:samples]) + "\n")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    names = [f"h{i}" for i in range(4)]
    inv = inventory(root, info, python, models, names, engine="speculators-0.3", max_samples=samples, seq_len=128,
                    batch_size=16, env=env, dataset=dataset)
    cores = len(os.sched_getaffinity(0))
    results = {1: [], 2: [], 4: []}
    # a first run pays for cold caches (kernels built on first use, pages read from disk): not timed
    warm = inventory(root, info, python, models, ["warm"], engine="speculators-0.3", max_samples=16, seq_len=128,
                     batch_size=16, env=env, dataset=dataset)
    run_group(warm, ["warm"], f"bench-warm-{time.strftime('%H%M%S')}", root / "runs")
    for i in range(repeat):
        for n in (1, 2, 4):  # alternating, so drift in the machine's load touches each alike
            results[n].append(run_group(inv, names[:n], f"bench-{n}-{time.strftime('%H%M%S')}-{i}", root / "runs"))
    alone = statistics.median(r["rates"]["h0"] for r in results[1])
    print(f"sharded extract, {samples} samples x <=128 tokens, TP=1 per host, one core per host, median of {repeat}:")
    wall_one = statistics.median(r["wall"] for r in results[1])
    print(f"  1 host alone: {alone:.0f} tok/s (extraction, load excluded), wall {wall_one:.1f} s")
    for n in (2, 4):
        share = min(1.0, cores / n)
        per_host = {h: statistics.median(r["rates"][h] for r in results[n]) for h in names[:n]}
        ratios = {h: rate / (alone * share) for h, rate in per_host.items()}
        worst = min(ratios.values())
        print(f"  {n} hosts: per host {', '.join(f'{h} {r:.0f}' for h, r in per_host.items())} tok/s; "
              f"after the {cores}-core limit each may have {share:.2f} of a core -> ratio to alone "
              f"{', '.join(f'{r:.2f}' for r in ratios.values())} (worst {worst:.2f}; target >= 0.90: "
              f"{'met' if worst >= 0.9 else 'MISSED'}); wall {statistics.median(r['wall'] for r in results[n]):.1f} s "
              f"(1 host: {statistics.median(r['wall'] for r in results[1]):.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--samples", type=int, default=384,
                        help="dataset rows (the 24-row chat set repeated); fewer make the extraction window so short "
                             "that one host's extraction overlaps another's model load")
    parser.add_argument("--skip-extract", action="store_true")
    parser.add_argument("--skip-preflight", action="store_true")
    parser.add_argument("--skip-autoconfig", action="store_true", help="preflight's static checks only")
    args = parser.parse_args()
    base = ensure_hostenv(quiet=True)
    models = ensure_models(base)
    sshd = TestHost(name="bench-group")
    info = sshd.up()
    python = make_overlay_env(base, sshd.root / "env")
    with tempfile.TemporaryDirectory(prefix="bench-group-", dir=cache_root()) as tmp:
        root = Path(tmp)
        if not args.skip_preflight:
            bench_preflight(root, sshd, info, python, models, args.repeat, args.skip_autoconfig)
        if not args.skip_extract:
            patch = subprocess.run([str(python), "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                                    "from remote import patcher; print(json.dumps(patcher.main({'action': 'apply', "
                                    "'patches_root': sys.argv[1] + '/patches'})))", str(REPO)],
                                   capture_output=True, text=True, timeout=300)
            if patch.returncode != 0 or '"fail"' in patch.stdout:
                raise SystemExit(f"patching the bench env failed:\n{patch.stdout}\n{patch.stderr}")
            bench_extract(root, info, python, models, args.samples, args.repeat)
    sshd.down()


if __name__ == "__main__":
    main()
