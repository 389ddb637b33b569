"""Benchmark: what the canary and the layer check's pairs cost an extraction.

Two measurements, one command each:

* **the run, canary on vs off** (default; the modern test host, ``specops testhost.up --stack
  modern`` brought up here when it is not: ``inventory.yaml``'s ``testhost-modern``, the tiny
  Llama unless ``--model`` says otherwise). Alternating ``--repeat`` times, two detached
  ``extract`` jobs on the same pre-tokenized random ids and the engine's default layer ids:
  ``canary_samples: 0`` and ``canary_samples: N`` (``--canary``, default 2: the first N samples
  also ask for their prompt logprobs and are checked against the final norm and ``lm_head`` as
  they land). Prints the extraction tok/s of each over the whole run (files checked, digested
  and in place; and the engine's alone), their ratio (the issue's target: >= 0.98), and the
  canary's own seconds (``prompt_logprobs/canary.json``). Then, unless ``--no-verification-run``,
  one **verification run of the real model** (``specops smoke --real``: one more load, the
  run's ids plus a pair per kind of layer, checked one layer at a time and by logits): its wall
  time split into load, samples and checks, and its bytes -- what a run pays once to get the
  layer check's pairs.
* ``--landing``: the alternative the verification run replaces, measured on this machine's
  CPU without a server: capture one extra id in every sample and drop it as the sample lands.
  Per sample of ``--tokens`` x ``--layers`` x ``--hidden`` (bf16): the landing as it is (checks,
  statistics and digest of the file, then a rename) against the landing of a file with one more
  layer that is rewritten without it (read, write the ``[T, L, H]`` file, digest it, delete the
  server's). Prints ms per sample for both, their ratio, and the connector's bytes (``(L+1)/L``).

    .venv/bin/python scripts/bench_canary.py [--repeat 2] [--samples 48] [--canary 2] [--model PATH]
    .venv/bin/python scripts/bench_canary.py --landing [--tokens 2048] [--layers 4] [--hidden 4096] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
INVENTORY = REPO / "inventory.yaml"
HOST = "testhost-modern"

LANDING = r"""
import json, os, sys, tempfile, time
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from remote.extract import sampleread
from remote.extract.engines.vllm_server.landing import move_into_place

torch.set_num_threads(1)
args = json.loads(sys.argv[1])
T, L, H = args["tokens"], args["layers"], args["hidden"]
ids = torch.arange(T, dtype=torch.int64)
keep = list(range(L))  # the run's ids; index L is the extra one

def write(path, layers):  # what the connector writes (the page cache holds it, as a file just written)
    torch.manual_seed(1)
    save_file({"token_ids": ids, "hidden_states": torch.randn(T, layers, H).to(torch.bfloat16)}, path)
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass

def as_is(tmp):
    src, dest = f"{tmp}/req.safetensors", f"{tmp}/hs_0.safetensors"
    write(src, L)
    t = time.perf_counter()
    sampleread.digest_hs_file(src, keep, keep, token_ids=ids.tolist(), hidden_size=H)
    move_into_place(src, dest)
    return time.perf_counter() - t

def dropped(tmp):
    src, dest = f"{tmp}/req.safetensors", f"{tmp}/hs_0.safetensors"
    write(src, L + 1)
    t = time.perf_counter()
    with safe_open(src, framework="pt") as fh:
        states = fh.get_slice("hidden_states")[:, :L, :]  # the run's ids, without the extra one
        save_file({"token_ids": fh.get_tensor("token_ids"), "hidden_states": states.contiguous()}, dest)
    os.unlink(src)
    sampleread.digest_hs_file(dest, keep, keep, token_ids=ids.tolist(), hidden_size=H)
    return time.perf_counter() - t

times = {"as_is": [], "dropped": []}
with tempfile.TemporaryDirectory(dir=args.get("dir") or None) as tmp:
    for _ in range(args["repeat"]):
        times["as_is"].append(as_is(tmp))
        times["dropped"].append(dropped(tmp))
print(json.dumps({k: min(v) for k, v in times.items()}))
"""


def landing(args) -> int:
    from specops.testhost.hostenv import ensure_hostenv

    python = str(ensure_hostenv(quiet=True, stack="modern"))
    spec = {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "repeat": args.repeat}
    proc = subprocess.run([python, "-c", LANDING, json.dumps(spec)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    mb = args.tokens * args.layers * args.hidden * 2 / 1e6
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"landing one sample, one core ({cpu}): {args.tokens} tokens x {args.layers} ids x hidden {args.hidden} "
          f"bf16 = {mb:.1f} MB, best of {args.repeat}")
    print(f"as the run lands it (checks, statistics, digest, rename):          {got['as_is'] * 1e3:8.1f} ms")
    print(f"one extra id captured and dropped (rewrite without it, digest):   {got['dropped'] * 1e3:8.1f} ms")
    print(f"ratio landing time with the extra id / without:                   {got['dropped'] / got['as_is']:8.2f}x")
    print(f"bytes the connector writes with the extra id / without:           "
          f"{(args.layers + 1) / args.layers:8.2f}x  (and the run's files are written twice)")
    return 0


def write_ids(path: Path, model_path: str, samples: int, lengths: list[int]) -> int:
    from scripts.bench_states import write_ids as write

    return write(path, model_path, samples, lengths)


def one_run(host, params: dict, run_id: str, canary: int) -> dict:
    """A detached extraction with ``canary`` canary samples, waited for; its rates and the canary's own time."""
    from specops.runs import hostjob

    out = f"{params['work_dir']}/bench/{run_id}"
    hostjob.job_call(host, "start", run_id, **{**params, "output_dir": out, "canary_samples": canary})
    final = hostjob.wait_final(host, run_id, timeout=1800)
    if final.state != "done":
        raise SystemExit(f"extraction {run_id} (canary {canary}) ended {final.state}: {final.error}")
    summary = json.loads(hostjob.read_remote(host, host.remote_path(f"{out}/summary.json")))
    manifest = json.loads(hostjob.read_remote(host, host.remote_path(f"{out}/manifest.json")))
    tokens = sum(f["tokens"] for f in manifest["files"])
    checks = []
    if canary:
        run_dir = host.remote_path(f"{params['work_dir']}/runs/{run_id}/prompt_logprobs/canary.json")
        checks = json.loads(hostjob.read_remote(host, run_dir))
        bad = [c for c in checks if c["status"] != "ok"]
        if len(checks) != canary or bad:
            raise SystemExit(f"run {run_id}: {len(checks)} canary checks, not ok: {[c['summary'] for c in bad]}")
    return {"tokens": tokens, "extract": tokens / summary["phase_seconds"]["extract"], "loop": summary["tokens_per_s"],
            "canary_s": sum(c["detail"]["seconds"] for c in checks), "layers": manifest["layer_ids"],
            "bytes": sum(f["bytes"] for f in manifest["files"])}


def run(args) -> int:
    from specops.transport.host import Host
    from specops.inventory import load_inventory
    from specops.params import run_params
    from specops.smoke import smoke_step
    from specops.testhost.cli import up

    up(stack="modern")
    inv = load_inventory(INVENTORY)
    host = Host(inv.hosts[HOST], inv)
    lengths = [int(x) for x in args.lengths.split(",")]
    params = run_params(host.spec, **({"model": args.model} if args.model else {}))
    dataset = Path(params["work_dir"]).expanduser() / "bench" / "canary-ids.jsonl"
    written = write_ids(dataset, params["model_path"], args.samples, lengths)
    params.update(dataset=str(dataset), max_samples=args.samples, seq_len=max(lengths),
                  batch_size=min(8, args.samples))
    modes = {"off": 0, "on": args.canary}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with host:
        for i in range(args.repeat):
            for mode, canary in modes.items():
                r = one_run(host, params, f"bench-canary-{time.strftime('%H%M%S')}-{i}-{mode}", canary)
                if r["tokens"] != written:
                    raise SystemExit(f"canary {mode} run extracted {r['tokens']} tokens of the {written} written")
                results[mode].append(r)
                print(f"round {i + 1} canary {mode}: {r['tokens']} tokens; {r['loop']:.0f} tok/s with files checked "
                      f"and in place ({r['extract']:.0f} the engine's); canary checks {r['canary_s']:.3f} s",
                      flush=True)
        med = statistics.median
        loop = {m: med(r["loop"] for r in rows) for m, rows in results.items()}
        extract = {m: med(r["extract"] for r in rows) for m, rows in results.items()}
        first = results["off"][0]
        print(f"model {params['model_path']} TP={params['tp']} samples={args.samples} lengths={args.lengths} "
              f"layers {first['layers']}, canary samples {args.canary}")
        for mode in modes:
            print(f"canary {mode:3s}: {loop[mode]:8.0f} tok/s over the run, files in place   "
                  f"(engine alone {extract[mode]:.0f} tok/s)")
        print(f"ratio tok/s canary on / off, whole run:    {loop['on'] / loop['off']:6.3f}  (target >= 0.98)")
        print(f"ratio tok/s canary on / off, engine alone: {extract['on'] / extract['off']:6.3f}")
        print(f"canary's own checks (median per run):      {med(r['canary_s'] for r in results['on']):6.3f} s")
        if args.no_verification_run:
            return 0
        t0 = time.monotonic()
        smoked = smoke_step(host, {"model": args.model} if args.model else {}, samples=args.canary, real=True)
        wall = time.monotonic() - t0
    if smoked.failed:
        bad = [f"{r.name}: {r.summary}" for r in smoked.records if r.status == "fail"]
        raise SystemExit(f"the verification run failed: {bad}")
    target = next(r for r in smoked.records if r.name == "smoke.target")
    phases = smoked.data["status"].get("phase_seconds") or {}
    verify_s = wall - smoked.data["seconds"]
    print(f"verification run of the real model (smoke --real, {args.canary} samples, ids "
          f"{target.detail['convention']}:{target.detail['layer_ids']} = the run's + {target.detail['extra']}): "
          f"{wall:.1f} s in all = the run {smoked.data['seconds']:.1f} s (its load {phases.get('load', 0):.1f} s, "
          f"samples {phases.get('extract', 0):.1f} s) + the layer and logits checks {verify_s:.1f} s; the real run's "
          f"files and rate are untouched")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landing", action="store_true", help="the extra-id alternative on this CPU, no server")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--model", help="a model dir on the host (default: the inventory's tiny Llama)")
    parser.add_argument("--samples", type=int, default=1000,
                        help="a run long enough that its rate is the steady one (the canary is a fixed cost)")
    parser.add_argument("--lengths", default="64,128,96,120", help="prompt lengths, used in turn")
    parser.add_argument("--canary", type=int, default=2, help="canary samples of the 'on' run")
    parser.add_argument("--no-verification-run", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    if args.landing:
        args.repeat = args.repeat or 5
        return landing(args)
    args.repeat = args.repeat or 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
