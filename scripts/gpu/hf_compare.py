#!/usr/bin/env python3
"""Compare ``hs_{i}.safetensors`` files against transformers on the same weights (GPU).

    python3 scripts/gpu/hf_compare.py --model DIR --files DIR --layer-ids 2,4,5,8 [--max 8] [--dtype float32]

Layer id ``k`` (vLLM's input convention) is the residual stream entering 0-based
decoder layer ``k``: transformers' ``hidden_states[k]`` for ``k < N`` and, for ``k = N``,
the last layer's output *before* the final norm (taken with a forward pre-hook on the
norm, since transformers' last hidden state is after it). Prints one JSON object:
per layer id the relative error ``|x - ref| / |ref|`` (median and max over samples)
and the cosine, plus the worst token's error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--files", required=True)
    parser.add_argument("--layer-ids", required=True, help="the ids in the order of the file's layer axis")
    parser.add_argument("--max", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids_in_file = [int(x) for x in args.layer_ids.split(",")]
    files = sorted(Path(args.files).glob("hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))[:args.max]
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
    inner = model.model
    n_layers = len(inner.layers)
    captured = {}
    inner.norm.register_forward_pre_hook(lambda mod, inp: captured.__setitem__("pre_norm", inp[0].detach()))
    per_layer = {lid: {"rel": [], "cos": [], "worst_token_rel": []} for lid in ids_in_file}
    for path in files:
        data = load_file(str(path))
        ids = data["token_ids"].tolist()
        states = data["hidden_states"].float()
        with torch.no_grad():
            out = model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        for j, lid in enumerate(ids_in_file):
            ref = (captured["pre_norm"] if lid == n_layers else out.hidden_states[lid])[0].float().cpu()
            got = states[:, j, :]
            per_layer[lid]["rel"].append(float((got - ref).norm() / ref.norm()))
            per_layer[lid]["cos"].append(float(torch.nn.functional.cosine_similarity(
                got.flatten(), ref.flatten(), dim=0)))
            tok = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
            per_layer[lid]["worst_token_rel"].append(float(tok.max()))
    result = {"model": args.model, "files": len(files), "reference_dtype": args.dtype, "num_layers": n_layers,
              "layers": {str(lid): {"rel_err_median": round(statistics.median(v["rel"]), 5),
                                    "rel_err_max": round(max(v["rel"]), 5),
                                    "cos_min": round(min(v["cos"]), 6),
                                    "worst_token_rel_err": round(max(v["worst_token_rel"]), 5)}
                         for lid, v in per_layer.items() if v["rel"]}}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
