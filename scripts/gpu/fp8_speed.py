#!/usr/bin/env python3
"""fp8 vs bf16 extraction speed side by side, through the CLI's engine (issue 43, item 3).

    python3 scripts/gpu/fp8_speed.py --model DIR --dataset ids.jsonl --out DIR [--n 64] [--kv-gib 16 on a card over 100 GiB, else 8] [--util 0.4] [--reps 3]

Four vLLM starts, one at a time but the first two: the plain server and the bf16 extraction engine start side
by side (as ``bench.py`` does), then hs-connectors' stock fp8 connector (``kv_connector`` given: host-side
quantization after a bf16 copy), then specops' own fp8 connector (named too: quantized on the device before
the copy). Each engine runs what ``specops extract`` runs
(:func:`bench.engine_params`) and ``--reps`` ``specops`` passes of ``bench.py`` (files landed and digested,
manifest done, then durable) at the CLI's concurrency after a warm-up, the median kept; plain prefill is
measured on the same ids the same number of times.

Then the first sample of the stock fp8 run and of specops' fp8 run are compared: keys, dtypes, shapes, scales,
dequantized values within one fp8 ulp, bytes equal. Prints one JSON object and writes ``OUT/fp8_speed.json``:
``tok_per_s`` and ``ratio_vs_plain`` (manifest done and durable) per kind, ``files_equal``, ``settings``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/gpu/bench.py: its passes and the CLI's params)

vs = bench.vs
#: hs-connectors' own fp8 connector, asked for by name (``kv_connector``): the stock fp8 path
STOCK_FP8 = "hs_connectors.fp8_hidden_states_connector:FP8HiddenStatesConnector"
#: specops' own fp8 connector (the engine's default for ``format: fp8``), asked for by name: a host where it cannot
#: run would otherwise fall back to the stock one and measure stock twice
SPECOPS_FP8 = "remote.extract.engines.vllm_server.fp8_connector:SpecopsFP8HiddenStatesConnector"
KINDS = (("bf16", {"format": "bf16"}), ("fp8_stock", {"format": "fp8", "kv_connector": STOCK_FP8}),
         ("fp8_specops", {"format": "fp8", "kv_connector": SPECOPS_FP8}))


def compare_files(stock: Path, ours: Path) -> dict:
    """Two fp8 files of the same sample: the same tensors, and the states within one fp8 ulp."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(stock)), load_file(str(ours))
    out = {"keys": [sorted(a), sorted(b)], "bytes_equal": stock.read_bytes() == ours.read_bytes(),
           "dtypes_equal": {k: str(v.dtype) for k, v in a.items()} == {k: str(v.dtype) for k, v in b.items()},
           "shapes_equal": {k: list(v.shape) for k, v in a.items()} == {k: list(v.shape) for k, v in b.items()}}
    if out["keys"][0] == out["keys"][1] and out["shapes_equal"] and "hidden_states_scales" in a:
        sa, sb = a["hidden_states_scales"].float(), b["hidden_states_scales"].float()
        da, db = a["hidden_states"].float() * sa, b["hidden_states"].float() * sb
        mag = torch.maximum(da.abs(), db.abs())
        ulp = torch.maximum(torch.exp2(torch.floor(torch.log2(mag.clamp(min=1e-30)))) * 2.0 ** -3, sa * 2.0 ** -9)
        out.update(scales_max_rel=float(((sa - sb).abs() / sa.abs().clamp(min=1e-30)).max()),
                   within_one_ulp=float(((da - db).abs() <= ulp).float().mean()),
                   token_ids_equal=torch.equal(a["token_ids"], b["token_ids"]))
    return out


def measure(name, engine, ids_list, out, concurrency, timers, reps=1) -> dict:
    """The median of ``reps`` passes by manifest-done rate (each pass's rates kept as ``passes``), after a
    warm-up; the last pass's first file kept for the comparison."""
    bench.specops_pass(engine, ids_list[:8], out / "warm", min(8, concurrency), timers)
    passes = [bench.specops_pass(engine, ids_list, out / f"samples_{name}", concurrency, timers,
                                 keep_files=i == reps - 1) for i in range(reps)]
    run = dict(sorted(passes, key=lambda r: r["tok_per_s"])[len(passes) // 2])
    run["passes"] = [{"tok_per_s": r["tok_per_s"], "durable_tok_per_s": r["durable_tok_per_s"]} for r in passes]
    first = out / f"samples_{name}" / "hidden_states" / "hs_0.safetensors"
    if first.exists():
        shutil.copy(first, out / f"{name}_hs_0.safetensors")
    shutil.rmtree(out / f"samples_{name}", ignore_errors=True)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    for flag, kw in (("--model", {"required": True}), ("--dataset", {"required": True}), ("--out", {"required": True}),
                     ("--n", {"type": int, "default": 64}), ("--util", {"type": float, "default": 0.4}),
                     ("--kv-gib", {"type": float, "default": None}), ("--device", {"default": "cuda"}),
                     ("--layer-ids", {"default": ""}), ("--reps", {"type": int, "default": 3}),
                     # a kind starts only with this much time left of the caller's budget (a start + a pass)
                     ("--budget-s", {"type": float, "default": 540}), ("--kind-s", {"type": float, "default": 150})):
        parser.add_argument(flag, **kw)
    args = parser.parse_args(argv)
    # the server imports specops' connector by module path, as a job's server does with the bundle on its path
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    if args.kv_gib is None:  # the plain and bf16 servers run side by side: an 80 GB card holds two at 8 GiB of KV
        import torch
        args.kv_gib = 16 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids_list = bench.load_ids(args.dataset, args.n)
    seq_len = max(len(x) for x in ids_list)
    config = vs.modelconfig.read(args.model)
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids
                 else vs.layers.default_layer_ids("vllm-server", vs.modelconfig.num_layers(config))[0])
    bench_args = argparse.Namespace(device=args.device, util=args.util, kv_gib=args.kv_gib, eager=False,
                                    chunked_prefill=None, batched_tokens=None, concurrency="", format="bf16")
    base = bench.engine_params(bench_args, seq_len)  # what specops extract runs (bench.py's rule)
    result = {"model": args.model, "samples": len(ids_list), "seq_len": seq_len, "layer_ids": layer_ids,
              "concurrency": base["concurrency"], "runs": {}, "ready_s": {}, "connectors": {}}
    timers = bench.Timers()
    t0 = time.perf_counter()
    engines = {name: vs.VllmServerEngine(args.model, 1, layer_ids, dict(base, **extra,
                                                                       work_dir=str(out / f"server_{name}")))
               for name, extra in KINDS}
    first = engines["bf16"]
    # the plain server prefills as the extraction servers will (bench.py's rule)
    chunked = bench.vs_chunking.resolve(base.get("chunked_prefill"),
                                        bench.vs_chunking.installed_verdict(vs.pick_connector(base)))
    plain = vs.VllmServer(args.model, tp=1, layer_ids=sorted(layer_ids), work_dir=out / "server_plain",
                          max_model_len=first.model_len(config), params=dict(base, plain=True,
                                                                              chunked_prefill_on=chunked["on"]))
    plain.start()
    try:
        first.load()
        plain.wait_ready(timeout=600)
        result["ready_s"]["plain_and_bf16"] = round(time.perf_counter() - t0, 1)
        result["settings"] = bench.settings(first.params, [base["concurrency"]], first.chunked, first.digest_in)
        bench.plain_pass(plain, ids_list[:8], 8)
        passes = [bench.plain_pass(plain, ids_list, base["concurrency"]) for _ in range(args.reps)]
        result["runs"]["plain"] = dict(sorted(passes, key=lambda r: r["tok_per_s"])[len(passes) // 2],
                                       passes=[{"tok_per_s": r["tok_per_s"]} for r in passes])
        print(json.dumps({"plain": result["runs"]["plain"]}), flush=True)
    finally:
        plain.stop()
    for name, _ in KINDS:
        engine = engines[name]
        if engine is not first and time.perf_counter() - t0 + args.kind_s > args.budget_s:
            result.setdefault("errors", []).append(f"{name}: skipped, no time left in --budget-s {args.budget_s}")
            continue
        try:
            if engine is not first:
                t = time.perf_counter()
                engine.load()
                result["ready_s"][name] = round(time.perf_counter() - t, 1)
            result["connectors"][name] = {"connector": engine.describe().get("connector"),
                                          "fp8_connector_fallback": getattr(engine, "fp8_fallback", None)}
            result["runs"][name] = measure(name, engine, ids_list, out, base["concurrency"], timers, args.reps)
        except Exception as exc:  # one kind failing keeps the others' numbers
            result.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            engine.close()
        print(json.dumps({name: result["runs"].get(name), "connector": result["connectors"].get(name)}), flush=True)
    (out / "fp8_speed.json").write_text(json.dumps(result, indent=1))  # kept should the comparison fail
    plain_tps = result["runs"]["plain"]["tok_per_s"]
    result["tok_per_s"] = {k: r["tok_per_s"] for k, r in result["runs"].items()}
    result["ratio_vs_plain"] = {k: round(r["tok_per_s"] / plain_tps, 3) for k, r in result["runs"].items()}
    result["durable_ratio_vs_plain"] = {k: round(r["durable_tok_per_s"] / plain_tps, 3)
                                        for k, r in result["runs"].items() if "durable_tok_per_s" in r}
    stock, ours = out / "fp8_stock_hs_0.safetensors", out / "fp8_specops_hs_0.safetensors"
    if stock.exists() and ours.exists():
        result["files_equal"] = compare_files(stock, ours)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "fp8_speed.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
