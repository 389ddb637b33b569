"""``python -m remote.extract.engines.vllm_server``: the engine as a program, without the supervisor.

For numbers that need no run dir (the GPU rounds, the engine's own tests): start a
server, extract a JSONL of token ids into a dir, stop, print one JSON result.
"""
from __future__ import annotations

import json
import time

from remote.extract import runplan
from remote.system import modelconfig
from remote.wire import layers, status
from remote.wire.contract import VLLM_SERVER

from .engine import VllmServerEngine
from .landing import SampleRejected
from .logs import ServerFailed


def main(argv=None) -> int:
    """Start a server, extract a JSONL of token ids into a dir, stop; print one JSON result.

    ``python -m remote.extract.engines.vllm_server --model DIR --samples FILE.jsonl --out DIR
    [--tp N] [--layer-ids 2,4,5,8] [--work-dir DIR] [--params JSON]``; each JSONL line is
    ``{"token_ids": [...]}`` with an optional ``"index"`` (default: the line number).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m remote.extract.engines.vllm_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layer-ids", default="")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--params", default="{}", help="JSON object of engine params")
    args = parser.parse_args(argv)

    params = json.loads(args.params)
    if args.work_dir:
        params["work_dir"] = args.work_dir
    samples = []
    with open(args.samples, encoding="utf-8") as handle:
        for n, line in enumerate(handle):
            if line.strip():
                row = json.loads(line)
                samples.append((int(row.get("index", n)), row["token_ids"]))
    given = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None  # None: the engine's default
    plan = runplan.resolve({**params, "layer_ids": given}, modelconfig.read(args.model), engine=(VLLM_SERVER, "given"))
    layer_ids = plan.layer_ids
    engine = VllmServerEngine(args.model, args.tp, layer_ids, params, plan=plan)
    result = {"layer_ids": layer_ids, "layer_convention": layers.INPUT}
    try:
        t0 = time.monotonic()
        engine.load()
        result["start_s"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        result["samples"] = engine.extract_files(samples, args.out)
        seconds = time.monotonic() - t1
        tokens = sum(r["tokens"] for r in result["samples"])
        result.update(extract_s=round(seconds, 3), tokens=tokens, tok_per_s=round(tokens / seconds, 1))
    except (ServerFailed, SampleRejected, ValueError, RuntimeError) as exc:
        result["error"] = status.error(type(exc).__name__, str(exc), rank=getattr(exc, "rank", None),
                                      exception=getattr(exc, "exception", None),
                                      traceback=getattr(exc, "traceback", None), where="vllm-server cli")
    finally:
        engine.close()
        result["engine"] = engine.describe()
    print(json.dumps(result))
    return 1 if "error" in result else 0
