#!/usr/bin/env python3
"""Random-weight models and datasets for the GPU rounds, built on the GPU in seconds.

    python3 scripts/gpu/models.py --out /tmp/gpu-models [--only llama,llama_wide,deepseek_v3]

Writes (each a real checkpoint dir: sharded bf16 safetensors + index, config.json, the
reference tokenizer of ``specops/testhost/reference_models.py``):

* ``llama/``: the test host's tiny Llama (hidden 256, 8 layers), same config as on CPU;
* ``llama_wide/``: a Llama of real width (hidden 4096, 32/8 heads, head_dim 128,
  intermediate 14336) with 8 layers: about 1.3B parameters, the benchmark model;
* ``llama_8b/``: llama_wide with 32 layers (Llama-3-8B's shape, about 7B parameters);
* ``llama_8b_std01/``: the same with weights at std 0.01: the draft rounds' target (a draft can learn it);
* ``llama_mid/``: hidden 1024, 8 layers, for the CPU benchmark (``scripts/bench_modern.py``);
* ``deepseek_dense/``: the same with every layer dense (MLA without MoE routing);
* ``deepseek_v3_wide/``, ``llama_8b_vocab/``: DeepSeek-V3's layer and vocab at its real width (4 layers, 32
  experts) and Llama-3-8B's shape with its vocab: the memory plan's real-width fixtures (``round.py memory_width``);
* ``deepseek_v3/``: DeepSeek-V3 architecture with the real MLA dims (kv_lora_rank 512,
  qk_rope 64, qk_nope 128, v_head 128: what the GPU MLA kernels are built for), 16 heads,
  hidden 2048, 8 layers (the first dense), 16 routed experts top-4 in 4 groups, sigmoid
  scoring with noaux_tc, 1 shared expert. No ``llama_4_scaling``: transformers' DeepSeek-V3
  does not implement it, and this model is compared against transformers.

All are written with ``save_pretrained`` (:func:`build_saved`), as real checkpoints are,
and ``chat.jsonl`` (24 chat records, the test host's) and ``bench_<n>x<len>.jsonl``
(pre-tokenized random ids) for the benchmark. Prints one JSON line of paths and seconds.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from remote.extract import tinymodel  # noqa: E402
from specops.testhost import reference_models  # noqa: E402

VOCAB = tinymodel.REFERENCE_VOCAB


def configs() -> dict:
    ids = reference_models.token_ids()
    ref = reference_models.reference_configs()
    wide = dict(reference_models.LLAMA_LIKE, num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=4096, **ids)
    ds = copy.deepcopy(reference_models.DEEPSEEK_V3_LIKE)
    ds.pop("llama_4_scaling")
    ds.update(hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16, num_experts_per_tok=4,
              n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=768, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=VOCAB,
              num_nextn_predict_layers=0, max_position_embeddings=4096, **ids)
    # the same MLA attention with every layer dense: isolates MLA from MoE routing in comparisons
    dense = dict(ds, first_k_dense_replace=ds["num_hidden_layers"])
    # CPU benchmarks (scripts/bench_modern.py): wide enough that prefill is compute, small enough for 2 cores
    mid = dict(reference_models.LLAMA_LIKE, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
               num_key_value_heads=8, num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=4096, **ids)
    # Llama-3-8B's shape (32 layers of llama_wide's width): the benchmark's deep model
    llama_8b = dict(wide, num_hidden_layers=32)
    # the draft rounds' target: the same shape with its weights at std 0.01, not transformers' flat 0.02. A random
    # target's next token is learnable only between two extremes (CPU scan, 32 layers of width 256:
    # scripts/gpu/target_gain_scan.py): at 0.02 x sqrt(4096/256) = 0.08 (the 8B's gain per projection at 0.02) a
    # draft stays at chance, as round 10's did on llama_8b; at 0.02 the replies collapse into repeats (87 %).
    # 0.01 here is that scan's 0.04 (half the 8B's default gain): 67 distinct reply tokens, 72 % repeats.
    llama_8b_std01 = dict(llama_8b, initializer_range=0.01)
    # the memory plan at real width (issue 43): what drives vLLM's profile peak is the widest layer and the vocab
    # (the sampler's logits), not the depth. DeepSeek-V3's own layer (hidden 7168, 128 MLA heads, top-8 of
    # moe_intermediate 2048, 1 shared expert, dense intermediate 18432) and vocab (129280), 4 layers (the first
    # dense) and 32 routed experts so it fits one GPU (about 7.3B parameters, 14.7 GB)
    ds_wide = copy.deepcopy(reference_models.DEEPSEEK_V3_LIKE)
    ds_wide.pop("llama_4_scaling")
    ds_wide.update(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=32, num_nextn_predict_layers=0,
                   max_position_embeddings=16384, **ids)
    # Llama-3-8B's shape with its vocab (128256): the dense counterpart, at 8192-token samples
    llama_8b_vocab = dict(llama_8b, vocab_size=128256, max_position_embeddings=16384)
    return {"llama": ref["llama"], "llama_wide": wide, "llama_8b": llama_8b, "llama_8b_std01": llama_8b_std01,
            "deepseek_v3": ds, "deepseek_dense": dense, "llama_mid": mid, "deepseek_v3_wide": ds_wide,
            "llama_8b_vocab": llama_8b_vocab}


def build_saved(config: dict, out_dir: Path, seed: int = 0) -> Path:
    """Random weights for ``config`` written by transformers' ``save_pretrained``.

    Unlike ``tinymodel.build_model`` (which writes ``state_dict()``), this keeps one tensor
    per routed expert under transformers 5, as real DeepSeek/Kimi checkpoints do:
    transformers 5 fuses experts in memory (``mlp.experts.gate_up_proj``) and splits
    them again on save.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    config_cls = tinymodel._hf_config_class(config)
    hf_config = config_cls(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(str(out_dir), max_shard_size="400MB")
    written = json.loads((out_dir / "config.json").read_text())
    written.update({k: v for k, v in config.items() if k not in written})  # family keys survive
    (out_dir / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    reference_models.reference_tokenizer().save_pretrained(str(out_dir), save_jinja_files=False)
    return out_dir


def bench_dataset(path: Path, n: int, length: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"input_ids": [rng.randrange(3, VOCAB) for _ in range(length)]}) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="llama,llama_wide,deepseek_v3,deepseek_dense")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bench", default="1024x1024", help="NxLEN of the benchmark ids (comma: several)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"seconds": {}}
    all_configs = configs()
    for name in args.only.split(","):
        t = time.monotonic()
        with torch.device(args.device):
            path = build_saved(all_configs[name], out / name)
        result[name] = str(path)
        result["seconds"][name] = round(time.monotonic() - t, 2)
    result["dataset"] = str(tinymodel.write_chat_dataset(out / "chat.jsonl"))
    # the draft rounds: 4096 rows to train on, the rest held out for eval (round 10's 512 rows gave a draft that
    # memorized its batches: 27 % top-1 there, 0.3 % held out)
    result["dataset_draft"] = str(tinymodel.write_chat_dataset(out / "chat_4600.jsonl", num_records=4600, seed=1))
    for shape in args.bench.split(","):
        n, length = (int(x) for x in shape.split("x"))
        result.setdefault("bench_datasets", []).append(str(bench_dataset(out / f"bench_{n}x{length}.jsonl", n, length)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
