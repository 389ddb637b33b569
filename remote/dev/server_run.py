"""A finished ``vllm-server`` run dir, made without the supervisor: the engine's own files
plus the ``status.json`` and ``manifest.json`` that ``specops verify`` reads.

For measuring the engine against the reference (TP=1 vs TP=2, eager vs compiled, with
or without a test-host fix) on chosen token ids, where a whole ``extract`` (chat
dataset, supervisor) would add nothing but time::

    python -m remote.dev.server_run --model DIR --run-dir DIR [--tp 2] [--samples 6] \\
        [--lengths 40,96,128] [--seed 3] [--layer-ids 2,4,5,8] [--params JSON]

Token ids are random ids of the model's vocabulary (seeded), or the ``token_ids`` rows
of ``--samples-file``. The layout is the one an ``extract`` run leaves:
``<run-dir>/output/hidden_states/hs_{i}.safetensors``, ``<run-dir>/manifest.json``
(:func:`remote.wire.manifest.build`: ``layer_convention: input``, the engine's
``file_layer_ids``, one ``files`` entry per sample), and
``<run-dir>/status.json`` in state ``done``. Prints one JSON object: the engine's
description, start and extraction seconds, tokens/s, or the error.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from remote.extract import samples
from remote.run.lifecycle import StatusFile
from remote.system import modelconfig
from remote.wire import contract, layers, manifest as run_manifest

OUTPUT = "output"
HS_DIR = "hidden_states"


def token_samples(vocab_size: int, count: int, lengths, seed: int) -> list[tuple[int, list[int]]]:
    """``count`` random samples cycling through ``lengths``; ids avoid the first 3 (special tokens)."""
    rng = random.Random(seed)
    return [(i, [rng.randrange(3, vocab_size) for _ in range(lengths[i % len(lengths)])]) for i in range(count)]


def write_run(run_dir: Path, model: str, layer_ids, engine_info: dict, records: list[dict]) -> dict:
    """``status.json`` (done) and ``manifest.json`` for the ``hs`` files in ``run_dir/output``."""
    output = run_dir / OUTPUT
    doc = run_manifest.build(
        run_id=run_dir.name, fmt=samples.HS, engine=engine_info,
        model={"path": str(model), "config": modelconfig.summary(modelconfig.read(model))},
        layer_ids=layer_ids, convention=layers.INPUT, sample_range=[0, len(records)], dataset_samples=len(records),
        tokens=sum(r["tokens"] for r in records),
        files=[{"path": f"{HS_DIR}/{r['file']}", "index": r["index"],
                **samples.file_digest(output / HS_DIR / r["file"]),
                "bytes": r["bytes"], "tokens": r["tokens"]} for r in records],
        params={"trust_remote_code": False}, file_layer_ids=engine_info.get("file_layer_ids"))
    for target in (run_dir, output):
        run_manifest.write_atomic(target / samples.MANIFEST, doc)
    StatusFile(run_dir / contract.STATUS_FILE, {}).update(state="done", phase="done", output_dir=str(output))
    return doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.dev.server_run")
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--lengths", default="48,96,128")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--samples-file", default="")
    parser.add_argument("--layer-ids", default="")
    parser.add_argument("--params", default="{}", help="JSON object of engine params")
    args = parser.parse_args(argv)

    from remote.extract.engines.vllm_server import VllmServerEngine

    run_dir = Path(args.run_dir)
    config = modelconfig.read(args.model)
    if args.samples_file:
        with open(args.samples_file, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        todo = [(int(r.get("index", n)), list(r["token_ids"])) for n, r in enumerate(rows)]
    else:
        vocab = int(modelconfig.text_value(config, "vocab_size"))
        todo = token_samples(vocab, args.samples, [int(x) for x in args.lengths.split(",")], args.seed)
    if args.layer_ids:
        layer_ids = [int(x) for x in args.layer_ids.split(",")]
    else:
        layer_ids, _ = layers.default_layer_ids("vllm-server", modelconfig.num_layers(config))
    params = {"work_dir": str(run_dir / "server"), "seq_len": max(len(ids) for _, ids in todo),
              **json.loads(args.params)}
    engine = VllmServerEngine(args.model, args.tp, layer_ids, params)
    result = {"run_dir": str(run_dir), "layer_ids": layer_ids}
    try:
        t0 = time.monotonic()
        engine.load()
        result["start_s"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        records = engine.extract_files(todo, run_dir / OUTPUT / HS_DIR)
        seconds = time.monotonic() - t1
        tokens = sum(r["tokens"] for r in records)
        result.update(extract_s=round(seconds, 3), tokens=tokens, tok_per_s=round(tokens / seconds, 1))
    except Exception as exc:  # one JSON line either way; the caller reads "error"
        result["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "exception": getattr(exc, "exception", None), "rank": getattr(exc, "rank", None)}
    finally:
        engine.close()
        result["engine"] = engine.describe()
    if "error" not in result:
        write_run(run_dir, args.model, layer_ids, result["engine"], records)
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
