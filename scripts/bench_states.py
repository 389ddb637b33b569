"""Benchmark: bytes per token and extraction tok/s of bf16 vs fp8 states, same ids, one run.

On the modern test host (``specops testhost.up --stack modern``, brought up here when it is
not; ``inventory.yaml``'s ``testhost-modern``: the tiny Llama unless ``--model`` says
otherwise), alternating ``--repeat`` times, two detached ``extract`` jobs on the same
pre-tokenized random ids (written once into the host's work dir) and the engine's default
layer ids, one per state format:

1. ``bf16``: vLLM's stock hidden-states connector (here its CPU copy), states as computed;
2. ``fp8``: hs-connectors' ``FP8HiddenStatesConnector`` (here its CPU variant): float8_e4m3fn
   states with one float32 scale per token.

Each run's manifest gives the bytes on disk of every sample file and its tokens; its summary
the extraction tok/s (engine time only, load excluded) and the loop's (samples checked,
digested and in place). The canary is off in both (``canary_samples: 0``): it checks the
first samples the same way in either format. Prints medians and the fp8 / bf16 ratios
(bytes: ~0.5x, what fp8 is for; tok/s: the cost of quantizing on the connector's writer
threads, if any).

    .venv/bin/python scripts/bench_states.py [--repeat 2] [--model PATH] [--samples 48]
        [--lengths 64,128,96,120]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from specops.runs import hostjob
from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.params import run_params

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "inventory.yaml"
HOST = "testhost-modern"
FORMATS = ("bf16", "fp8")


def write_ids(path: Path, model_path: str, samples: int, lengths: list[int]) -> int:
    """``samples`` rows of random token ids (``input_ids``), lengths used in turn; the tokens written.
    The test host is this machine: the file is written where the host reads it."""
    sys.path.insert(0, str(REPO))  # remote/ is no package of the laptop's venv; its one config reader is
    from remote.system import modelconfig

    vocab = int(modelconfig.text_value(modelconfig.read(Path(model_path).expanduser()), "vocab_size"))
    rng = random.Random(7)
    rows = [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(samples)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return sum(map(len, rows))


def one_run(host: Host, params: dict, run_id: str, fmt: str) -> dict:
    """A detached extraction in ``fmt``, waited for; its bytes, tokens and rates."""
    out = f"{params['work_dir']}/bench/{run_id}"
    hostjob.job_call(host, "start", run_id, **{**params, "output_dir": out, "format": fmt, "canary_samples": 0})
    final = hostjob.wait_final(host, run_id, timeout=1800)
    if final.state != "done":
        raise SystemExit(f"extraction {run_id} ({fmt}) ended {final.state}: {final.error}")
    summary = json.loads(hostjob.read_remote(host, host.remote_path(f"{out}/summary.json")))
    manifest = json.loads(hostjob.read_remote(host, host.remote_path(f"{out}/manifest.json")))
    if manifest.get("state_format", "bf16") != fmt:
        raise SystemExit(f"run {run_id} asked for {fmt} but wrote {manifest.get('state_format')}")
    tokens = sum(f["tokens"] for f in manifest["files"])
    return {"bytes": sum(f["bytes"] for f in manifest["files"]), "tokens": tokens,
            "extract": tokens / summary["phase_seconds"]["extract"], "loop": summary["tokens_per_s"],
            "layers": manifest["layer_ids"], "hidden": manifest["model"]["config"].get("hidden_size")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--model", help="a model dir on the host (default: the inventory's tiny Llama)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--lengths", default="64,128,96,120", help="prompt lengths, used in turn")
    args = parser.parse_args()
    from specops.testhost.cli import up

    up(stack="modern")
    inv = load_inventory(INVENTORY)
    host = Host(inv.hosts[HOST], inv)
    lengths = [int(x) for x in args.lengths.split(",")]
    params = run_params(host.spec, **({"model": args.model} if args.model else {}))
    dataset = Path(params["work_dir"]).expanduser() / "bench" / "states-ids.jsonl"
    written = write_ids(dataset, params["model_path"], args.samples, lengths)
    params.update(dataset=str(dataset), max_samples=args.samples, seq_len=max(lengths),
                  batch_size=min(8, args.samples))
    results: dict[str, list[dict]] = {fmt: [] for fmt in FORMATS}
    with host:
        for i in range(args.repeat):
            for fmt in FORMATS:
                r = one_run(host, params, f"bench-states-{time.strftime('%H%M%S')}-{i}-{fmt}", fmt)
                if r["tokens"] != written:
                    raise SystemExit(f"{fmt} run extracted {r['tokens']} tokens of the {written} written")
                results[fmt].append(r)
                print(f"round {i + 1} {fmt}: {r['tokens']} tokens, {r['bytes'] / r['tokens']:.1f} bytes/token; "
                      f"extraction {r['extract']:.0f} tok/s ({r['loop']:.0f} with files checked and in place)",
                      flush=True)
    med = statistics.median
    per_token = {fmt: med(r["bytes"] / r["tokens"] for r in rows) for fmt, rows in results.items()}
    extract = {fmt: med(r["extract"] for r in rows) for fmt, rows in results.items()}
    loop = {fmt: med(r["loop"] for r in rows) for fmt, rows in results.items()}
    first = results["bf16"][0]
    print(f"model {params['model_path']} TP={params['tp']} samples={args.samples} lengths={args.lengths} "
          f"layers {first['layers']} x hidden {first['hidden']}, canary off")
    for fmt in FORMATS:
        print(f"{fmt:5s} bytes/token on disk:                {per_token[fmt]:8.1f}")
    for fmt in FORMATS:
        print(f"{fmt:5s} extraction (engine, load excluded):  {extract[fmt]:8.0f} tok/s   "
              f"(files checked and in place: {loop[fmt]:.0f} tok/s)")
    print(f"ratio fp8 / bf16 bytes per token:          {per_token['fp8'] / per_token['bf16']:8.3f}  (~0.5: what fp8 is for)")
    print(f"ratio fp8 / bf16 extraction tok/s:         {extract['fp8'] / extract['bf16']:8.2f}")
    print(f"ratio fp8 / bf16 tok/s, files in place:    {loop['fp8'] / loop['bf16']:8.2f}")


if __name__ == "__main__":
    main()
