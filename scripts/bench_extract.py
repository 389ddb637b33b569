"""Benchmark: extraction tokens/s against plain vLLM prefill tokens/s, same model, one run.

On the built-in test host (``specops testhost.up``; the inventory's tiny DeepSeek-V3 at
TP=2 unless --model/--tp say otherwise), alternating ``--repeat`` times:

1. ``specops extract`` runs the real patched speculators 0.3.0 generator (detached job,
   the supervisor writes every sample); we read the extraction phase's tokens/s from
   the run's summary (model load excluded), with and without the time spent writing
   samples;
2. ``remote/bench_prefill.py`` runs vLLM's own engine with the generator's settings on
   exactly the same token ids, ``max_tokens=1`` (load excluded).

Prints medians and the ratios; the target is extraction / prefill >= 0.9.

    .venv/bin/python scripts/bench_extract.py [--repeat 2] [--model PATH] [--tp 2]
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

from specops import jobs
from specops.host import Host, current_bundle, shell_word
from specops.inventory import load_inventory
from specops.params import run_params
from specops.patch import patch_step

INVENTORY = Path(__file__).resolve().parents[1] / "inventory.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--model")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=0,
                        help="prompts per generator call (default: all samples in one call, as vLLM gets them)")
    args = parser.parse_args()
    inv = load_inventory(INVENTORY)
    host = Host(inv.hosts["testhost"], inv)
    overrides = {k: v for k, v in {"model": args.model, "tp": args.tp, "max_samples": args.samples,
                                   "batch_size": args.batch_size or args.samples}.items() if v}
    params = run_params(host.spec, **overrides)
    with host:
        patched = patch_step(host, "apply")
        if patched.failed:
            raise SystemExit(f"patch failed: {[r.summary for r in patched.records if r.status == 'fail']}")
        bundle_dir = host.bundle_dir(current_bundle())
        extract_engine, extract_all, prefill = [], [], []
        for i in range(args.repeat):
            run_id = f"bench-{time.strftime('%H%M%S')}-{i}"
            out = f"{params['work_dir']}/bench/{run_id}"
            job = {**params, "output_dir": out}
            jobs.job_call(host, "start", run_id, **job)
            final = jobs.wait_final(host, run_id, timeout=1200, poll=2)
            if final.get("state") != "done":
                raise SystemExit(f"extraction {run_id} ended {final.get('state')}: {final.get('error')}")
            summary = json.loads(jobs.read_remote(host, host.remote_path(f"{out}/summary.json")))
            ph = summary["phase_seconds"]
            tokens = summary["tokens_this_attempt"]
            extract_engine.append(tokens / ph["extract"])
            extract_all.append(tokens / (ph["extract"] + ph.get("write", 0.0)))
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in params["env"].items())
            cmd = (f"cd {shell_word(bundle_dir)} && env {env} {shell_word(params['python'])} -m remote.bench_prefill"
                   f" --model {shell_word(params['model_path'])} --tp {params['tp']}"
                   f" --samples {shell_word(out)} --max-model-len {params['seq_len']}")
            result = host.run(cmd, timeout=1200)
            if not result.ok:
                raise SystemExit(f"prefill baseline failed:\n{result.stderr[-3000:]}")
            base = json.loads(result.stdout.strip().splitlines()[-1])
            if base["tokens"] != tokens:
                raise SystemExit(f"token counts differ: extraction {tokens}, prefill {base['tokens']}")
            prefill.append(base["tokens_per_s"])
            print(f"round {i + 1}: {tokens} tokens; extraction {extract_engine[-1]:.0f} tok/s "
                  f"({extract_all[-1]:.0f} with writes); vLLM prefill {prefill[-1]:.0f} tok/s", flush=True)
    med = statistics.median
    print(f"model {params['model_path']} TP={params['tp']} samples={args.samples} seq_len={params['seq_len']} "
          f"batch_size={params['batch_size']}")
    print(f"extraction (engine, load excluded):       {med(extract_engine):8.0f} tok/s")
    print(f"extraction incl. writing samples:         {med(extract_all):8.0f} tok/s")
    print(f"plain vLLM prefill (same ids/settings):   {med(prefill):8.0f} tok/s")
    print(f"ratio extraction / prefill:               {med(extract_engine) / med(prefill):8.2f}  (target >= 0.9)")
    print(f"ratio incl. writes / prefill:             {med(extract_all) / med(prefill):8.2f}")


if __name__ == "__main__":
    main()
