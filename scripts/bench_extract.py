"""Benchmark: extraction tokens/s against plain vLLM prefill tokens/s, same model, one run.

On the built-in test host (``specops testhost.up``; the inventory's tiny DeepSeek-V3 at
TP=2 unless --model/--tp say otherwise), alternating ``--repeat`` times:

1. ``specops extract`` runs the real patched speculators 0.3.0 generator (detached job,
   the supervisor writes every sample), twice: writing samples on the writer thread
   while the next batch runs (as every run does), and writing each batch before the
   next one starts (``write_queue_batches=0``, the way it was done before); we read the
   extraction phase's tokens/s from each run's summary (model load excluded), with and
   without the time spent writing samples;
2. ``remote/dev/bench_prefill.py`` (from this checkout) runs vLLM's own engine with the generator's settings on
   exactly the same token ids, ``max_tokens=1`` (load excluded).

Prints medians and the ratios; the targets are extraction / prefill >= 0.9, with writes
too. Writing can only overlap a *next* batch: give ``--batch-size`` below ``--samples``
to see it (one batch of everything leaves nothing to overlap with).

    .venv/bin/python scripts/bench_extract.py [--repeat 2] [--model PATH] [--tp 2] [--batch-size 6]
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import time
from pathlib import Path

from specops.runs import hostjob
from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.params import run_params
from specops.patch import patch_step
from specops.transport.remote_task import shell_word

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "inventory.yaml"


def baseline_failure(stderr: str, run_id: str) -> str:
    """What to print when the plain-prefill baseline dies: the causes vLLM logged above its
    final "EngineCore encountered an issue. See stack trace (above)", and where the whole log is."""
    log = Path("runs") / "bench" / f"prefill-{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(stderr)
    causes = []
    for line in stderr.splitlines():
        text = re.sub(r"^\(\S+ pid=\d+\)\s*", "", line).strip()
        if (re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", text) or "died unexpectedly" in text
                or "exit code" in text) and text not in causes:
            causes.append(text)
    shown = "\n  ".join(causes[-12:]) or "(no exception line; see the log)"
    return f"prefill baseline failed; causes in its log:\n  {shown}\nwhole log: {log}\n{stderr[-1500:]}"


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
        extract_engine, with_writes, inline_writes, prefill = [], [], [], []
        for i in range(args.repeat):
            tokens = None
            for depth, rates in ((1, with_writes), (0, inline_writes)):
                run_id = f"bench-{time.strftime('%H%M%S')}-{i}-q{depth}"
                out = f"{params['work_dir']}/bench/{run_id}"
                job = {**params, "output_dir": out, "write_queue_batches": depth}
                hostjob.job_call(host, "start", run_id, **job)
                final = hostjob.wait_final(host, run_id, timeout=1200)
                if final.state != "done":
                    raise SystemExit(f"extraction {run_id} ended {final.state}: {final.error}")
                summary = json.loads(hostjob.read_remote(host, host.remote_path(f"{out}/summary.json")))
                tokens = summary["tokens_this_attempt"]
                extract_engine.append(tokens / summary["phase_seconds"]["extract"])
                # the extraction loop's own rate: engine calls and writing samples, as the run saw them
                rates.append(summary["tokens_per_s"])
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in params["env"].items())
            # remote/dev travels in no bundle: the test host is this machine, so it runs from the checkout
            cmd = (f"cd {shell_word(str(REPO))} && env {env} {shell_word(params['python'])} -m remote.dev.bench_prefill"
                   f" --model {shell_word(params['model_path'])} --tp {params['tp']}"
                   f" --samples {shell_word(out)} --max-model-len {params['seq_len']}")
            result = host.run(cmd, timeout=1200)
            if not result.ok:
                raise SystemExit(baseline_failure(result.stderr, run_id))
            base = json.loads(result.stdout.strip().splitlines()[-1])
            if base["tokens"] != tokens:
                raise SystemExit(f"token counts differ: extraction {tokens}, prefill {base['tokens']}")
            prefill.append(base["tokens_per_s"])
            print(f"round {i + 1}: {tokens} tokens; extraction {extract_engine[-1]:.0f} tok/s "
                  f"({with_writes[-1]:.0f} writing on the writer thread, {inline_writes[-1]:.0f} writing "
                  f"between batches); vLLM prefill {prefill[-1]:.0f} tok/s", flush=True)
    med = statistics.median
    print(f"model {params['model_path']} TP={params['tp']} samples={args.samples} seq_len={params['seq_len']} "
          f"batch_size={params['batch_size']}")
    print(f"extraction (engine, load excluded):          {med(extract_engine):8.0f} tok/s")
    print(f"incl. writing, on the writer thread:         {med(with_writes):8.0f} tok/s")
    print(f"incl. writing, between batches (before):     {med(inline_writes):8.0f} tok/s")
    print(f"plain vLLM prefill (same ids/settings):      {med(prefill):8.0f} tok/s")
    print(f"ratio extraction / prefill:                  {med(extract_engine) / med(prefill):8.2f}  (target >= 0.9)")
    print(f"ratio incl. writes / prefill, writer thread: {med(with_writes) / med(prefill):8.2f}  (target >= 0.9)")
    print(f"ratio incl. writes / prefill, before:        {med(inline_writes) / med(prefill):8.2f}")
    print(f"writer thread / between batches:             {med(with_writes) / med(inline_writes):8.2f}")


if __name__ == "__main__":
    main()
