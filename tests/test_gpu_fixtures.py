"""What the lent H200 printed (tests/fixtures/gpu/), parsed by the real parsing code. No GPU needed.

The fixtures were recorded by ``scripts/gpu/round.py`` on one NVIDIA H200 (driver
580.159.04, CUDA 13.0, torch 2.11.0+cu130, vLLM 0.25.0 from ../shared/gpu's kit):
nvidia-smi output, preflight over SSH on the machine's loopback, the ``vllm-server``
engine on three random models (server logs, memory, states vs transformers), the
benchmark, and the job flow (extract/status/logs/fetch/abort/smoke/verify).
``tests/fixtures/gpu/README.md`` says which call printed which file.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from remote.probes import Context, gpu, host

FIX = Path(__file__).parent / "fixtures" / "gpu"
MODELS = ("llama", "deepseek_v3", "deepseek_dense")


def read(rel: str) -> str:
    return (FIX / rel).read_text()


def cli_json(rel: str) -> dict:
    """The ``specops ... --json`` document in a captured stdout (progress lines may precede it)."""
    text = read(rel)
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


def records(rel: str) -> dict:
    doc = cli_json(rel)
    return {r["name"]: r for h in doc["hosts"] for r in h["records"]}


# ----------------------------------------------------------------------------- nvidia-smi


def test_nvidia_smi_query_and_banner_of_the_h200():
    gpus = host.parse_gpus(read("env/gpus.csv"))
    assert [(g["index"], g["name"], g["driver"], g["memory_total_mib"]) for g in gpus] == [
        (0, "NVIDIA H200", "580.159.04", 143771)]
    assert host.parse_apps(read("env/apps.csv")) == []
    banner = gpu.parse_smi_banner(read("env/nvidia-smi.txt"))
    assert banner == {"smi_version": "580.159.04", "driver_version": "580.159.04", "cuda_version": "13.0"}


def test_driver_cuda_against_torch_builds():
    banner = gpu.parse_smi_banner(read("env/nvidia-smi.txt"))
    # torch/version.py as torch 2.11.0+cu130 writes it (the machine's torch; its text, not recorded)
    build = gpu.parse_torch_version_py("__version__ = '2.11.0+cu130'\ndebug = False\n"
                                       "cuda: Optional[str] = '13.0'\ngit_version = 'abc'\n")
    assert build == {"torch_version": "2.11.0+cu130", "cuda": "13.0"}
    assert gpu.cuda_fit(banner["cuda_version"], build["cuda"])[0] == "ok"
    assert gpu.cuda_fit("12.8", "13.0")[0] == "fail"          # older major: every CUDA call fails
    assert gpu.cuda_fit("13.0", "13.2")[0] == "warn"          # older minor: minor-version compatibility
    assert gpu.cuda_fit("13.0", None)[0] == "fail"            # a CPU-only torch with device cuda
    assert gpu.parse_torch_version_py("__version__ = '2.13.0+cpu'\ncuda = None\n")["cuda"] is None


# ----------------------------------------------------------------------------- preflight over SSH


@pytest.mark.parametrize("host_name", ["gpu-llama", "gpu-wide", "gpu-deepseek"])
def test_preflight_on_cuda_passed_with_real_gpu_facts(host_name):
    recs = records(f"preflight/{host_name}.json")
    assert not [n for n, r in recs.items() if r["status"] == "fail"]
    gpus = recs["host.gpus"]
    assert gpus["status"] == "ok" and "NVIDIA H200" in gpus["summary"] and "driver 580.159.04" in gpus["summary"]
    assert recs["host.gpu_processes"]["status"] == "ok"
    assert recs["parallel.devices"]["summary"] == "TP 1 on 1 GPU(s)"
    fit = recs["checkpoint.fit"]
    assert fit["status"] == "ok" and fit["detail"]["gpus"][0]["budget_bytes"] == int(0.5 * 143771 * 2 ** 20)
    assert recs["packages.vllm"]["summary"].startswith("vllm 0.25.0")


def test_preflight_text_report_names_the_mla_model_and_the_server_drift_checks():
    text = read("preflight/gpu-deepseek.txt")
    assert "1 x NVIDIA H200" in text and "DeepseekV2 family" in text
    assert "DeepseekV3ForCausalLM implements SupportsEagle3" in text


def test_ssh_was_a_real_loopback_server_with_a_checked_host_key():
    up = json.loads(read("ssh/up.json"))
    assert up["server"] == "asyncssh" and up["openssh_found"] is False  # the lent machine has no sshd
    inventory = json.loads(read("ssh/inventory.yaml"))  # written as JSON (YAML's subset)
    for spec in inventory["hosts"].values():
        assert spec["address"] == "127.0.0.1" and spec["known_hosts"] and spec["key"]


# ----------------------------------------------------------------------------- the engine's memory


@pytest.mark.parametrize("model", MODELS)
def test_engine_log_parses_to_what_the_round_recorded(model):
    used = gpu.parse_engine_memory(read(f"engine/{model}/server.log"))
    recorded = json.loads(read(f"engine/{model}/memory.json"))["engine"]
    assert json.loads(json.dumps(used)) == recorded
    rank0 = used["ranks"][0]
    assert rank0["attention_backend"] == ("FLASH_ATTN" if model == "llama" else "FLASH_ATTN_MLA")
    # extraction forces piecewise CUDA graphs (CacheOnlyAttentionBackend supports no full graphs)
    assert used["engine"]["cudagraph_mode"] == "PIECEWISE"
    assert rank0["graph_gib"] >= 0 and used["engine"]["kv_cache_tokens"] > 1_000_000


@pytest.mark.parametrize("model", MODELS)
def test_memory_plan_per_rank_matches_what_vllm_then_used(model):
    """The preflight's plan from config + nvidia-smi, against the server's own log and nvidia-smi's peak."""
    memory = json.loads(read(f"engine/{model}/memory.json"))
    config = json.loads(read(f"engine/{model}/config.json"))
    smi = host.parse_gpus(read(f"engine/{model}/gpus_before.csv"))[0]
    plan = gpu.plan_from_config(config, gpu=smi, util=0.5, weight_bytes=memory["plan"]["weight_bytes"], tp=1,
                                n_layer_ids=4, seq_len=256)
    assert plan == memory["plan"]
    rows = gpu.compare(plan, gpu.parse_engine_memory(read(f"engine/{model}/server.log")),
                       memory["smi_peak_used_mib"]["0"])
    assert rows == memory["compare"]
    assert 0.97 <= rows["kv_room_bytes"]["ratio"] <= 1.03     # KV room: within 3 %
    assert 0.90 <= rows["tokens_fit"]["ratio"] <= 1.0          # tokens: vLLM pads pages, never more than planned
    assert 0.95 <= rows["weight_bytes"]["ratio"] <= 1.10
    assert 0.98 <= rows["gpu_used_bytes"]["ratio"] <= 1.03     # nvidia-smi's peak vs util x total
    assert 0.6 <= rows["overhead_bytes"]["ratio"] <= 1.3


def test_kv_bytes_per_token_mla_is_replicated_gqa_is_split():
    ds = json.loads(read("engine/deepseek_v3/config.json"))
    assert gpu.kv_bytes_per_token(ds, tp=1) == gpu.kv_bytes_per_token(ds, tp=8) == 8 * (512 + 64) * 2
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert gpu.kv_bytes_per_token(llama, tp=1) == 32 * 2 * 8 * 128 * 2
    assert gpu.kv_bytes_per_token(llama, tp=8) == 32 * 2 * 1 * 128 * 2
    assert gpu.kv_bytes_per_token(llama, tp=16) == 32 * 2 * 1 * 128 * 2  # fewer kv heads than ranks: replicated


def test_gpu_probe_records_from_the_h200_facts(monkeypatch, tmp_path):
    """The preflight probe itself, fed the recorded facts (no nvidia-smi, no torch here)."""
    (tmp_path / "config.json").write_text(read("engine/deepseek_v3/config.json"))
    ctx = Context({"device": "cuda", "tp": 1, "model_path": str(tmp_path), "seq_len": 256,
                   "gpu_memory_utilization": 0.5, "hidden_dtype_bytes": 2})
    ctx.host["visible_gpus"] = host.parse_gpus(read("engine/deepseek_v3/gpus_before.csv"))
    ctx.checkpoint["data_bytes"] = json.loads(read("engine/deepseek_v3/memory.json"))["plan"]["weight_bytes"]
    ctx.layers["ids"] = [2, 4, 5, 8]
    monkeypatch.setattr(gpu, "_smi_banner", lambda: (gpu.parse_smi_banner(read("env/nvidia-smi.txt")), None))
    monkeypatch.setattr(gpu, "torch_build", lambda: {"torch_version": "2.11.0+cu130", "cuda": "13.0", "path": "x"})
    cuda, memory = gpu.probe(ctx)
    assert cuda["name"] == "gpu.cuda" and cuda["status"] == "ok" and "driver 580.159.04" in cuda["summary"]
    assert memory["name"] == "gpu.memory" and memory["status"] == "ok"
    assert memory["detail"]["ranks"][0]["tokens_fit"] == 2848232  # vLLM then logged 2,678,287
    # the same GPU with seq_len far beyond what fits: fail, with the fix
    ctx.params["seq_len"] = 4_000_000
    assert gpu.probe(ctx)[1]["status"] == "fail"
    assert gpu.probe(Context({"device": "cpu"}))[0]["status"] == "skipped"


# ----------------------------------------------------------------------------- states vs transformers


def test_states_match_transformers_on_the_gpu_paths():
    llama = json.loads(read("engine/llama/hf_compare.json"))["layers"]
    dense = json.loads(read("engine/deepseek_dense/hf_compare.json"))["layers"]
    moe = json.loads(read("engine/deepseek_v3/hf_compare.json"))["layers"]
    assert max(v["rel_err_max"] for v in llama.values()) < 0.01          # FLASH_ATTN: < 1 %
    assert max(v["rel_err_max"] for v in dense.values()) < 0.02          # FLASH_ATTN_MLA, no MoE: < 2 %
    assert min(v["cos_min"] for v in dense.values()) > 0.9998
    # with MoE routing, near-tied random routers flip experts on a few tokens (bf16 vs fp32 reference):
    # the median stays small, single tokens do not; verify's routing check is the tool for that
    assert max(v["worst_token_rel_err"] for v in moe.values()) > 0.3
    assert moe["2"]["rel_err_median"] < 0.05


# ----------------------------------------------------------------------------- the benchmark


def _best(doc, kind, conc):
    return max(r["tok_per_s"] for r in doc["runs"] if r["kind"] == kind and r["concurrency"] == conc)


def test_benchmark_numbers_and_where_the_time_goes():
    r1, r2 = json.loads(read("bench/round1.json")), json.loads(read("bench/round2.json"))
    assert r2["samples"] == 512 and r2["seq_len"] == 1024 and r2["layer_ids"] == [2, 4, 5, 8]
    plain = _best(r2, "plain", 64)
    assert plain > 150_000
    # the engine + connector alone (files written by vLLM, waited for, deleted): >= 0.9 at 64 in flight
    assert _best(r2, "server_only", 64) / plain >= 0.9
    # today's client: per-file fsync dominates its thread time, the disk's ~1.5 GB/s is the limit
    specops = [r for r in r1["runs"] if r["kind"] == "specops" and r["concurrency"] == 32]
    for run in specops:
        assert run["fsync_thread_s"] > run["load_check_thread_s"] > 0
        assert run["fsync_thread_s"] > run["sha256_thread_s"]
    disk = json.loads(read("env/disk.txt").strip().replace("'", '"'))
    bytes_per_token = r2["runs"][-1]["bytes_per_file"] / 1024
    disk_bound = disk["fsync"]["GB_per_s"] * 1e9 / bytes_per_token
    durable = _best(r2, "fast_durable", 64)
    assert 0.8 * disk_bound < durable < 1.3 * disk_bound
    # one read + hash from bytes + raw-buffer check + no per-file fsync: 2.4x today's client
    assert _best(r2, "fast", 64) > 2 * _best(r2, "specops", 32)


# ----------------------------------------------------------------------------- the job flow over SSH


def test_job_flow_on_the_gpu():
    # extract: every sample extracted on the GPU, then the run failed at the end: `datasets` missing
    status = cli_json("jobs/status_llama.json")["hosts"][0]["data"]["status"]
    assert status["samples_done"] == status["samples_total"] == 24 and status["state"] == "failed"
    assert status["error"]["type"] == "ModuleNotFoundError" and "datasets" in status["error"]["message"]
    # abort: detached start, status polls, abort -> aborted (exit 103), no GPU process left behind
    aborted = cli_json("jobs/status_ds_aborted.json")["hosts"][0]["data"]["status"]
    assert aborted["state"] == "aborted" and 0 < aborted["samples_done"] < aborted["samples_total"]
    assert read("jobs/gpu_apps_after_abort.csv").strip().splitlines() == ["pid, used_gpu_memory [MiB]"]
    assert json.loads(read("jobs/run_gpu-ds-abort/status.json"))["state"] == "aborted"
    assert "FLASH_ATTN_MLA" in read("jobs/run_gpu-ds-abort/logs/server.log")
