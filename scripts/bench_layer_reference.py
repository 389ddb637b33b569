#!/usr/bin/env python3
"""``verify --reference layer``'s memory and time per sample length: the old dense forward (a ``[T, T]``
mask, transformers' own attention on all tokens at once) beside the bounded one (query chunks with the
prefix's keys, :func:`remote.verify.layerload.forward`).

Run it with a python that has torch + transformers (a host env; the repo root on ``PYTHONPATH``)::

    PYTHONPATH=. python scripts/bench_layer_reference.py --shape deepseek_cpu --tokens 1024,2048,4096,8192
    PYTHONPATH=. python scripts/bench_layer_reference.py --shape deepseek_v3 --tokens 4096,8192 --paths new \\
        --json /tmp/layer_reference.json

Each shape is one decoder layer of random weights written as a bf16 checkpoint (``save_pretrained``, as
real checkpoints are); each (path, tokens) is measured in a fresh process: the step that ``verify`` runs
per layer (:meth:`remote.verify.layer.LayerCheck.run_layer`: the float32 layer read from the checkpoint,
its forward on the captured input, the engine's experts at router near-ties, the bf16 rounding floor) on
one sample whose captured output is the layer's own output in bf16. Peak = the process's peak RSS above
its start (``VmHWM`` after ``clear_refs``, what ``verify.reference`` reports); bound = one layer in float32
+ the sample (its input and output streams, bf16). ``old`` swaps only the forward (the rest of the step --
the input converted a chunk at a time, comparisons by token rows -- is today's in both, so old's peak is
if anything below what the dense check peaked at). ``--paths old`` is skipped where its ``[heads, T, T]``
scores alone would pass ``--old-limit-gib``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024 ** 3

_DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 1,
             "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 512,
             "num_nextn_predict_layers": 0, "max_position_embeddings": 16384, "rope_interleave": True}
#: one decoder layer each (the layer is MoE where the model has experts)
SHAPES = {
    # DeepSeek-V3 at its real width (hidden 7168, 128 MLA heads, its MLA dims), 32 routed experts of its size:
    # 6.1 GiB in float32, about the layer of issue 43's H200 target (6.3 GiB)
    "deepseek_v3": dict(_DEEPSEEK, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=32, num_experts_per_tok=8,
                        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128),
    # the same kind of layer for a 2-core CPU (the test's): MLA + MoE, wide enough that the layer outweighs one
    # token's activations as at real width (the layer's bytes / one float32 token state: 102k here, 228k there)
    "deepseek_cpu": dict(_DEEPSEEK, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                         num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=4,
                         n_group=4, topk_group=2, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                         qk_rope_head_dim=32, v_head_dim=64),
    # a dense GQA layer (Llama-3-8B's width)
    "llama_8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                 "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "vocab_size": 512, "max_position_embeddings": 16384, "rope_theta": 500000.0,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"},
}


def make_checkpoint(shape: str, out: Path) -> Path:
    """One decoder layer of ``shape`` with random weights, written by ``save_pretrained`` in bf16 (once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from remote.extract.tinymodel import _hf_config_class

    config = SHAPES[shape]
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config_class(config)(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="2GB")
    written = json.loads((out / "config.json").read_text())
    written.update({k: v for k, v in config.items() if k not in written})
    (out / "config.json").write_text(json.dumps(written, indent=2))
    return out


def measure(model_dir: Path, tokens: int, path: str) -> dict:
    """One (path, tokens) measurement in this process (see the module docstring)."""
    import torch

    from remote.system import modelconfig
    from remote.verify import layer as layer_check
    from remote.verify import layerload
    from remote.verify.memory import PeakMemory, heap_returns_memory, trim_heap, warm_up

    heap_returns_memory()
    config = modelconfig.read(model_dir)
    check = layer_check.LayerCheck(model_dir, config, 1)
    warm_up(check.factory.hf_config)
    hidden = check.factory.hf_config.hidden_size
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    layer, _facts = check.factory.build(0, check.checkpoint)
    captured = layerload.forward(check.factory, layer, x.float()).to(torch.bfloat16)  # the "engine": bf16 out
    del layer
    sample = layer_check.Sample("bench", list(range(tokens)), {0: x, 1: captured}, "bfloat16",
                                x.numel() * 2 + captured.numel() * 2)
    timed = {"forward_s": 0.0, "forwards": 0}
    chosen = layerload.dense_forward if path == "old" else layerload.forward

    def timed_forward(factory, one, h, dtype=None):
        t = time.monotonic()
        try:
            return chosen(factory, one, h, dtype=dtype)
        finally:
            timed["forward_s"] += time.monotonic() - t
            timed["forwards"] += 1

    layer_check.forward = timed_forward  # what LayerCheck.run_layer (and its floor) calls
    trim_heap()
    peak = PeakMemory()
    t0, cpu0 = time.monotonic(), cpu_seconds()
    facts, rows, _computed, flips, _routing, floor, routed = check.run_layer(0, [sample])
    seconds, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
    memory = peak.report(facts["fp32_bytes"], sample.nbytes, 0)
    return {"path": path, "tokens": tokens, "seconds": round(seconds, 2), "cpu_s": round(cpu, 2),
            "forward_s": round(timed["forward_s"], 2),
            "forwards": timed["forwards"], "peak_rss_bytes": memory["peak_rss_bytes"],
            "layer_fp32_bytes": memory["layer_fp32_bytes"], "sample_bytes": memory["samples_bytes"],
            "bound_bytes": memory["bound_bytes"], "ratio_to_bound": memory["ratio_to_bound"], "how": memory["how"],
            "nrmse": rows[0]["nrmse"], "floor_nrmse": floor["nrmse"], "routed": routed, "flips": len(flips),
            "attention": check.factory.attention if path == "new"
            else f"a dense [T, T] mask, {check.factory.stock_attention} on all tokens at once",
            "threads": torch.get_num_threads()}


def cpu_seconds() -> float:
    """This process's CPU time, all threads (steadier than wall time on a shared machine)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def old_scores_bytes(shape: str, tokens: int) -> int:
    """What the dense path's attention scores alone take: heads x T x T in float32."""
    return SHAPES[shape]["num_attention_heads"] * tokens * tokens * 4


def run(shape: str, tokens: list, paths: list, workdir: Path, old_limit: float, keep: str = "") -> list:
    """Every (tokens, path) measured in a child process; ``keep``: a json file rewritten as each row ends."""
    model_dir = make_checkpoint(shape, workdir / shape)
    rows = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for n in tokens:
        for path in paths:
            if path == "old" and old_scores_bytes(shape, n) > old_limit * GiB:
                rows.append({"path": path, "tokens": n, "skipped": f"[heads, T, T] scores alone "
                             f"{old_scores_bytes(shape, n) / GiB:.1f} GiB > --old-limit-gib {old_limit:g}"})
                continue
            proc = subprocess.run([sys.executable, __file__, "--child", str(model_dir), str(n), path],
                                  capture_output=True, text=True, env=env, cwd=REPO)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                rows.append({"path": path, "tokens": n, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"})
            else:
                rows.append(json.loads(lines[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if keep:
                Path(keep).write_text(json.dumps({"shape": shape, "config": SHAPES[shape], "rows": rows}, indent=1))
    return rows


def table(shape: str, rows: list) -> str:
    out = [f"{shape}: peak RSS above the start / (one layer in float32 + the sample), wall and CPU seconds per "
           f"sample", f"{'tokens':>7} | {'old peak GiB':>12} {'x bound':>7} {'s':>7} {'cpu s':>7} | "
           f"{'new peak GiB':>12} {'x bound':>7} {'s':>7} {'cpu s':>7} {'cpu ms/token':>12}"]
    by = {(r["tokens"], r["path"]): r for r in rows}
    for n in sorted({r["tokens"] for r in rows}):
        cells = []
        for path in ("old", "new"):
            r = by.get((n, path))
            if r is None or "peak_rss_bytes" not in r:
                cells.append(f"{(r or {}).get('skipped', (r or {}).get('error', '-'))[:36]:>36}")
            else:
                cells.append(f"{r['peak_rss_bytes'] / GiB:12.3f} {r['ratio_to_bound']:7.2f} {r['seconds']:7.1f} "
                             f"{r['cpu_s']:7.1f}")
        new = by.get((n, "new"))
        per = f"{1000 * new['cpu_s'] / n:12.2f}" if new and "cpu_s" in new else f"{'-':>12}"
        out.append(f"{n:>7} | {cells[0]} | {cells[1]} {per}")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(measure(Path(argv[1]), int(argv[2]), argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek_cpu", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--paths", default="old,new", help="old (dense mask), new (bounded), or both")
    parser.add_argument("--workdir", default="/tmp/bench-layer-reference", help="where the checkpoints are written")
    parser.add_argument("--old-limit-gib", type=float, default=8.0)
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = run(args.shape, tokens, args.paths.split(","), Path(args.workdir), args.old_limit_gib, args.json)
    print(table(args.shape, rows))
    print(json.dumps({"shape": args.shape, "config": SHAPES[args.shape], "rows": rows}))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
