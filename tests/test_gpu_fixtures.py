"""What the lent H200 printed (tests/fixtures/gpu/), parsed by the real parsing code. No GPU needed.

The fixtures were recorded by ``scripts/gpu/round.py`` on one NVIDIA H200 (driver
580.159.04, CUDA 13.0, torch 2.11.0+cu130, vLLM 0.25.0 from ../shared/gpu's kit):
nvidia-smi output, preflight over SSH on the machine's loopback, the ``vllm-server``
engine on three random models (server logs, memory, states vs transformers), the
benchmark, and the job flow (extract/status/logs/fetch/abort/smoke/verify). Round 3
(``*/round3*``, ``engine/deepseek_twin_tiny_mla``) re-measured the benchmark with the
digesting client, ran the job flow to done, and smoke + verify on the real-width Llama
and on DeepSeek-V3 with MLA on the GPU path (the twin keeps the target's MLA head dims).
``tests/fixtures/gpu/README.md`` says which call printed which file.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from remote.probes import Context, gpu
from remote.system import devices

FIX = Path(__file__).parent / "fixtures" / "gpu"
MODELS = ("llama", "deepseek_v3", "deepseek_dense")


def read(rel: str) -> str:
    return (FIX / rel).read_text()


def cli_json(rel: str) -> dict:
    """The ``specops ... --json`` document in a captured stdout (progress lines may precede it)."""
    text = read(rel)
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


def test_no_fixture_is_ignored_by_git():
    """A fixture under a name .gitignore matches (``runs/``, ``build/``) reads here and is missing from every clone:
    caught on the machine that recorded it, not by CI's clean checkout."""
    import shutil
    import subprocess
    root = Path(__file__).resolve().parents[1]
    if not shutil.which("git") or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--", "tests/fixtures"],
                             cwd=root, capture_output=True, text=True, check=True).stdout.split()
    ignored = [p for p in ignored if "__pycache__" not in p]
    assert not ignored, f"fixtures git ignores (rename their dir or add a '!' rule to .gitignore): {ignored[:10]}"


def records(rel: str) -> dict:
    doc = cli_json(rel)
    return {r["name"]: r for h in doc["hosts"] for r in h["records"]}


# ----------------------------------------------------------------------------- nvidia-smi


def test_nvidia_smi_query_and_banner_of_the_h200():
    gpus = devices.parse_gpus(read("env/gpus.csv"))
    assert [(g["index"], g["name"], g["driver"], g["memory_total_mib"]) for g in gpus] == [
        (0, "NVIDIA H200", "580.159.04", 143771)]
    assert devices.parse_apps(read("env/apps.csv")) == []
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


def assert_parsed_as_recorded(used: dict, recorded: dict) -> None:
    """What the round recorded is parsed again; the facts parsed since (the step budget, the CUDA graph
    estimate) come on top: vLLM's default budget then, 8192 (the engine passed none)."""
    parsed = json.loads(json.dumps(used))
    for part in ("ranks", "engine"):
        for key, facts in ({"0": parsed[part]["0"]} if part == "ranks" else {"": parsed[part]}).items():
            want = recorded[part]["0"] if part == "ranks" else recorded[part]
            assert {k: v for k, v in facts.items() if k in want} == want
    assert used["engine"]["max_num_batched_tokens"] == 8192


@pytest.mark.parametrize("model", MODELS)
def test_engine_log_parses_to_what_the_round_recorded(model):
    used = gpu.parse_engine_memory(read(f"engine/{model}/server.log"))
    recorded = json.loads(read(f"engine/{model}/memory.json"))["engine"]
    assert_parsed_as_recorded(used, recorded)
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
    smi = devices.parse_gpus(read(f"engine/{model}/gpus_before.csv"))[0]
    # what the round planned then (1 GiB + 24 B x hidden per token at 8192): today's calibrated plan is held
    # against every fixture by tests/test_memory_plan.py
    plan = memory["plan"]
    assert plan["total_bytes"] == smi["memory_total_mib"] * 2 ** 20 and config["hidden_size"] in (256, 2048)
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
    ctx.host["visible_gpus"] = devices.parse_gpus(read("engine/deepseek_v3/gpus_before.csv"))
    ctx.checkpoint["data_bytes"] = json.loads(read("engine/deepseek_v3/memory.json"))["plan"]["weight_bytes"]
    ctx.layers["ids"] = [2, 4, 5, 8]
    monkeypatch.setattr(gpu, "_smi_banner", lambda: (gpu.parse_smi_banner(read("env/nvidia-smi.txt")), None))
    monkeypatch.setattr(gpu, "torch_build", lambda: {"torch_version": "2.11.0+cu130", "cuda": "13.0", "path": "x"})
    cuda, memory = gpu.probe(ctx)
    assert cuda["name"] == "gpu.cuda" and cuda["status"] == "ok" and "driver 580.159.04" in cuda["summary"]
    assert memory["name"] == "gpu.memory" and memory["status"] == "ok"
    # planned at the budget the engine passes for seq_len 256 (2048: command.batched_tokens), where that
    # server ran vLLM's default 8192 and logged 2,678,287 tokens: a little more room at the smaller step
    assert memory["detail"]["max_num_batched_tokens"] == 2048 and "2,048 batched tokens" in memory["summary"]
    assert 1.0 < memory["detail"]["ranks"][0]["tokens_fit"] / 2_678_287 < 1.03
    # no batch size known: vLLM's own max_num_seqs on this card; a run's batch size is what its server admits
    assert memory["detail"]["max_num_seqs"] == 1024 and "1,024 sequences" in memory["summary"]
    # what binds is named: MLA's profile workspace, 64 Ki tokens wide at 1,024 sequences
    assert "(its peak: the attention call)" in memory["summary"]
    ctx.params["batch_size"] = 8
    assert gpu.probe(ctx)[1]["detail"]["max_num_seqs"] == 8
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


# ============================================================================= round 3
R3 = "jobs/round3"
BYTES_PER_TOKEN = 33562792 / 1024  # one llama_wide sample file (4 layers x 4096 bf16 + ids) per prompt token


def _layer_records(rel: str) -> dict:
    return {n: r for n, r in records(rel).items() if n.startswith("verify.layer.")}


def test_round3_h200_facts():
    gpus = devices.parse_gpus(read("env/round3/gpus.csv"))
    assert [(g["name"], g["driver"], g["memory_total_mib"]) for g in gpus] == [("NVIDIA H200", "580.159.04", 143771)]
    assert gpu.parse_smi_banner(read("env/round3/nvidia-smi.txt"))["cuda_version"] == "13.0"


# ----------------------------------------------------------------------------- the benchmark, round 3


def _run(doc, kind, conc, rep=None):
    runs = [r for r in doc["runs"] if r["kind"] == kind and r["concurrency"] == conc and rep in (None, r["rep"])]
    assert runs, (kind, conc)
    return max(runs, key=lambda r: r["tok_per_s"])


def test_round3_benchmark_where_the_time_goes():
    """Keeping the files is free; the digest (sha256 + layer stats, 4 workers) is what caps the client."""
    doc = json.loads(read("bench/round3.json"))
    assert doc["samples"] == 512 and doc["seq_len"] == 1024 and doc["layer_ids"] == [2, 4, 5, 8]
    plain, server_only = _best(doc, "plain", 64), _best(doc, "server_only", 64)
    keep, specops = _best(doc, "keep", 64), _best(doc, "specops", 64)
    assert plain > 150_000 and server_only / plain > 0.85
    assert keep / server_only > 0.97          # renamed and kept in the page cache: as fast as deleted
    assert specops / server_only < 0.6         # the default client: digest-bound
    for conc in (32, 64):
        for run in (r for r in doc["runs"] if r["kind"] == "specops" and r["concurrency"] == conc):
            busy = run["digest_thread_s"] / run["landed_s"]
            assert busy > 0.85 * run["digest_workers"] == 0.85 * 4   # every digest worker busy all the time
            assert run["rename_thread_s"] < 0.01 * run["digest_thread_s"]
            assert run["bytes_per_file"] == 33562792 and run["files"] == 512
    # more digest workers: faster, but far from linear (the server's processes and torch's threads compete)
    assert _best(doc, "specops+dw8", 64) > 1.3 * specops
    assert _best(doc, "specops+dw12", 64) < 1.1 * _best(doc, "specops+dw8", 64)


def test_round3_durable_speed_is_the_disk():
    doc = json.loads(read("bench/round3.json"))
    disk = json.loads(read("env/round3/disk.txt").strip().replace("'", '"'))
    disk_bound = disk["fsync"]["GB_per_s"] * 1e9 / BYTES_PER_TOKEN
    for kind in ("keep", "specops", "specops+dw8"):
        durable = max(r["durable_tok_per_s"] for r in doc["runs"] if r["kind"] == kind)
        assert 0.8 * disk_bound < durable < 1.3 * disk_bound, (kind, durable, disk_bound)
        assert durable < 0.3 * _best(doc, "plain", 64)


def test_round3_digest_profile():
    profile = json.loads(read("bench/round3.json"))["digest_profile"]
    single = profile["single_thread_ms_per_file"]
    assert single["sha256"] > 0.5 * single["digest"]            # hashing is most of a file's digest
    need = _best(json.loads(read("bench/round3.json")), "plain", 64) * BYTES_PER_TOKEN / 1e9
    assert profile["parallel_GB_per_s"]["4"] < 0.6 * need        # 4 workers cannot keep up with prefill
    # torch's intra-op pool per digesting thread oversubscribes the cores: one thread each scales further
    assert profile["parallel_GB_per_s_torch_threads_1"]["16"] > 1.3 * profile["parallel_GB_per_s"]["16"]


def test_round4_the_fixed_client():
    """Round 4 (same H200 kind, after round 3's findings): digests on half the cores (8 of 16),
    one torch thread each. The client's own cost fell; files kept without a digest still run at
    vLLM's own speed, and what is left is our hashing + statistics, then the disk."""
    r3, r4 = json.loads(read("bench/round3.json")), json.loads(read("bench/round4.json"))
    assert r4["samples"] == 512 and r4["seq_len"] == 1024 and r4["layer_ids"] == [2, 4, 5, 8]
    plain = _best(r4, "plain", 64)
    assert plain > 150_000
    assert _best(r4, "keep", 64) / _best(r4, "server_only", 64) > 0.97
    specops = _best(r4, "specops", 64) / plain
    assert specops > 0.6 and specops > 1.4 * (_best(r3, "specops", 64) / _best(r3, "plain", 64))
    assert _best(r4, "specops", 64) < _best(r4, "server_only", 64)   # the digest is still not free
    assert r4["digest_profile"]["torch_threads"] == 1
    for run in (r for r in r4["runs"] if r["kind"].startswith("specops")):
        assert run["durable_tok_per_s"] < 0.35 * plain       # durable: the disk's ~1.3-1.5 GB/s, whatever we do
        assert run["rename_thread_s"] < 0.02 * run["digest_thread_s"]


# ----------------------------------------------------------------------------- job flow and runs, round 3


def test_round3_job_flow_runs_to_done_with_token_dataset_jsonl():
    status = cli_json(f"{R3}/status_llama.json")["hosts"][0]["data"]["status"]
    assert status["state"] == "done" and status["samples_done"] == status["samples_total"] == 24
    assert status["error"] is None
    assert "done" in read(f"{R3}/extract_llama.txt") and "24/24" in read(f"{R3}/extract_llama.txt")
    assert "25 sample file(s) verified by sha256" in read(f"{R3}/fetch_llama.txt")
    run = f"{R3}/run_gpu-llama-3"
    manifest = json.loads(read(f"{run}/manifest.json"))
    assert manifest["dataset_files"] == ["token_dataset.jsonl"] and manifest["samples"] == 24
    rows = [json.loads(line) for line in read(f"{run}/samples/token_dataset.jsonl").splitlines()]
    assert len(rows) == 24 and sum(len(r["input_ids"]) for r in rows) == manifest["tokens"] == 1436
    # the files fetch brought back are the ones the manifest (digested as they landed) describes
    fetched = dict(line.split() for line in read(f"{run}/tensors.txt").splitlines())
    for entry in manifest["files"]:
        assert int(fetched["samples/" + entry["path"]]) == entry["bytes"]
        assert entry["tensors"]["hidden_states"]["shape"] == [entry["tokens"], 4, 256]


@pytest.mark.parametrize("name, hidden", [("llama", 256), ("wide", 4096), ("deepseek", 2048)])
def test_round3_verify_on_the_gpu_runs(name, hidden):
    doc = cli_json(f"{R3}/verify_{name}.json")
    assert doc["exit_code"] == 0
    layers = _layer_records(f"{R3}/verify_{name}.json")
    assert sorted(layers) == [f"verify.layer.{i}" for i in (2, 4, 5, 8)]
    for rec in layers.values():
        assert rec["detail"]["nrmse"] < 0.03 and rec["detail"]["floor_ratio"] < 1.3
        assert rec["status"] == "ok" or (name == "deepseek" and rec["status"] == "warn")
    manifest = json.loads(read(f"{R3}/run_gpu-{name}-3/manifest.json"))
    assert {tuple(f["tensors"]["hidden_states"]["shape"][1:]) for f in manifest["files"]} == {(4, hidden)}


def test_round3_deepseek_verify_explains_its_one_warn_by_routing():
    recs = records(f"{R3}/verify_deepseek.json")
    assert recs["verify.routing"]["status"] == "ok"
    warn = [r for n, r in recs.items() if r["status"] == "warn"]
    assert [r["name"] for r in warn] == ["verify.layer.8"] and warn[0]["detail"]["agree"] == 329
    assert warn[0]["detail"]["raw"]["nrmse"] > 5 * warn[0]["detail"]["nrmse"]  # with fp32's own experts: 11 %


@pytest.mark.parametrize("name, model", [("llama", "llama"), ("wide", "llama_wide"), ("deepseek", "deepseek_v3")])
def test_round3_memory_plan_vs_what_the_runs_used(name, model):
    memory = json.loads(read(f"{R3}/memory_{name}.json"))
    log = read(f"{R3}/run_gpu-{name}-3/logs/server.log")
    used = gpu.parse_engine_memory(log)
    assert_parsed_as_recorded(used, memory["engine"])
    assert used["engine"]["cudagraph_mode"] == "PIECEWISE"
    assert used["ranks"][0]["attention_backend"] == ("FLASH_ATTN_MLA" if name == "deepseek" else "FLASH_ATTN")
    rows = gpu.compare(memory["plan"], used, memory["smi_peak_used_mib"]["0"])
    assert rows == memory["compare"]
    assert 0.98 <= rows["kv_room_bytes"]["ratio"] <= 1.02
    assert 0.93 <= rows["tokens_fit"]["ratio"] <= 1.0
    assert 0.99 <= rows["gpu_used_bytes"]["ratio"] <= 1.02
    assert 0.6 <= rows["overhead_bytes"]["ratio"] <= 1.3


# ----------------------------------------------------------------------------- smoke, and the MLA twin on a GPU


def test_round2_smoke_failure_was_the_twins_mla_head_size():
    """Round 2's DeepSeek smoke died at its first request: the twin's tiny MLA dims, rejected on the GPU."""
    config = json.loads(read("engine/deepseek_twin_tiny_mla/config.json"))
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 96
    log = read("engine/deepseek_twin_tiny_mla/server.log")
    assert "Using TRITON_MLA attention backend out of potential backends: ['TRITON_MLA']" in log
    assert "ValueError: Head dimension 96 is not supported by MLA." in log
    result = json.loads(read("engine/deepseek_twin_tiny_mla/result.json"))
    assert result["error"]["type"] == "ServerFailed" and "HTTP 500" in result["error"]["message"]


def test_log_failure_names_the_engine_core_root_cause_at_tp1():
    from remote.extract.engines import vllm_server

    failure = vllm_server.log_failure(read("engine/deepseek_twin_tiny_mla/server.log"))
    assert failure["exception"] == "ValueError: Head dimension 96 is not supported by MLA."


def test_twin_for_cuda_keeps_the_targets_mla_head_dims():
    """CPU-only: a cuda twin of an MLA model keeps the head dims (its own hash); other twins are unchanged."""
    from remote.extract import smoke, tinymodel

    target = json.loads(read("engine/deepseek_v3/config.json"))
    cuda, notes = smoke.twin_config(target, 8, "cuda")
    cpu, cpu_notes = smoke.twin_config(target, 8, "cpu")
    assert cpu == smoke.twin_config(target, 8)[0] == tinymodel.shrink_config(target, num_layers=8)
    assert not cpu_notes and {k: cpu[k] for k in tinymodel.MLA_DIMS} == tinymodel.MLA_DIMS
    assert {k: cuda[k] for k in tinymodel.MLA_HEAD_DIM_KEYS} == {k: target[k] for k in tinymodel.MLA_HEAD_DIM_KEYS}
    assert cuda["kv_lora_rank"] + cuda["qk_rope_head_dim"] == 576              # a head size vLLM's MLA accepts
    assert cuda["hidden_size"] == cpu["hidden_size"] == 256 and cuda["q_lora_rank"] == 64
    assert notes and "kv_lora_rank 512" in notes[0]
    # the twin the GPU round built: the same choice, noted in twin.json
    (twin_dir,) = [p for p in (FIX / R3 / "smoke_twins").iterdir()
                   if json.loads((p / "config.json").read_text())["model_type"] == "deepseek_v3"]
    built = json.loads((twin_dir / "config.json").read_text())
    assert {k: built[k] for k in tinymodel.MLA_HEAD_DIM_KEYS} == {k: cuda[k] for k in tinymodel.MLA_HEAD_DIM_KEYS}
    assert json.loads((twin_dir / "twin.json").read_text())["notes"][0] == notes[0]
    # the hash changes only where the twin does
    from specops.testhost.reference_models import reference_configs

    llama = reference_configs()["llama"]
    assert smoke.twin_config(llama, 8, "cuda") == smoke.twin_config(llama, 8, "cpu")
    assert smoke.keeps_mla_head_dims(target, "cuda") and not smoke.keeps_mla_head_dims(target, "cpu")
    assert not smoke.keeps_mla_head_dims(llama, "cuda") and not smoke.keeps_mla_head_dims(target, None)


@pytest.mark.parametrize("host_name, backend", [("gpu-deepseek", "FLASH_ATTN_MLA"), ("gpu-wide", "FLASH_ATTN")])
def test_round3_smoke_passes_on_the_gpu(host_name, backend):
    doc = cli_json(f"{R3}/smoke_{host_name}.json")
    assert doc["exit_code"] == 0
    recs = records(f"{R3}/smoke_{host_name}.json")
    assert recs["smoke.run"]["status"] == "ok" and "vllm-server, tp=1" in recs["smoke.run"]["summary"]
    layers = [r for n, r in recs.items() if n.startswith("verify.layer.")]
    assert len(layers) == 4 and all(r["status"] == "ok" and r["detail"]["nrmse"] < 0.02 for r in layers)
    run_id = recs["verify.run"]["summary"].split()[1].rstrip(":")
    log = read(f"{R3}/smoke_runs/{run_id}/logs/server.log")
    assert f"Using {backend} attention backend" in log
    assert json.loads(read(f"{R3}/smoke_runs/{run_id}/status.json"))["state"] == "done"


# ---------------------------------------------------------------------------- round 5: the canary on the H200

ROUND5 = {"wide": "llama_wide", "deepseek": "deepseek_v3"}  # fixture dir -> model


@pytest.mark.parametrize("name", sorted(ROUND5))
def test_round5_vllm_025_gives_prompt_logprobs_with_extract_hidden_states(name):
    """vLLM 0.25 on the H200 answered ``prompt_logprobs`` in the same request that captured the
    states: each canary sample's file, read by the engine's own reader, holds one entry per prompt
    position after the first (own logprob, rank, the top 5), consistent with its own top list."""
    from remote.wire import contract
    from remote.extract.engines.vllm_server import prompt_logprobs

    for index in range(contract.CANARY_SAMPLES):
        kept = prompt_logprobs.read(FIX / "round5" / name / contract.prompt_logprobs_name(index))
        assert kept["engine"] == contract.VLLM_SERVER and kept["top"] == contract.PROMPT_LOGPROBS_TOP
        assert len(kept["positions"]) == len(kept["token_ids"]) - 1 > 40
        for (own, rank, top), token in zip(kept["positions"], kept["token_ids"][1:]):
            assert len(top) == kept["top"] and own <= 0 and rank >= 1
            best = top[0][1]
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))  # ranked
            assert own <= best + 1e-6 and (rank > 1 or own == pytest.approx(best, abs=1e-6))
            if rank <= kept["top"]:
                assert [t for t, _ in top][rank - 1] == token


@pytest.mark.parametrize("name", sorted(ROUND5))
def test_round5_canary_and_the_bounded_references_pass_on_the_gpu(name):
    """The canary checked both canary samples as they landed (within the bf16 floor), and
    ``verify --reference logits`` / ``layer`` read only the head / one layer of the real run."""
    model = ROUND5[name]
    canary = json.loads(read(f"round5/{name}/canary.json"))
    assert [r["status"] for r in canary] == ["ok", "ok"] and {r["name"] for r in canary} == {"canary.logits"}
    for rec in canary:
        (sample,) = rec["detail"]["samples"].values()
        assert sample["floor_ratio"] < 2 and sample["top1_agree"] + sample["top1_near_ties"] == sample["positions"]
    logits = records(f"round5/{name}/verify_logits_{name}.json")
    assert logits["verify.logits"]["status"] == "ok" and "only those tensors read" in logits["verify.reference"]["summary"]
    layer = records(f"round5/{name}/verify_layer_{name}.json")
    assert layer["verify.layer.4"]["status"] == "ok" and layer["verify.layer.4"]["detail"]["floor_ratio"] < 1
    memory = layer["verify.reference"]["detail"]["memory"]
    assert memory["peak_rss_bytes"] < memory["whole_model_fp32_bytes"] / 1.5, memory
    assert model in layer["verify.reference"]["summary"]


def test_the_digest_on_the_h200_hosts_cpu_is_linear_and_blake3_outruns_sha256():
    """``scripts/bench_digest.py --here`` on the H200 host (Intel Xeon, AVX-512/AMX): the block-wise statistics cost
    the same per byte at 4096 tokens as at 1024, the old whole-layer pass did not; blake3 (vLLM's own dependency)
    hashes ~3x faster than sha256 on one core, the case for it as the manifest's hash (issue 25)."""
    import re

    text = read("bench/digest-h200.txt")
    assert "Intel(R) Xeon(R)" in text
    rows = {int(t): dict(zip(("digest", "sha256", "stats", "before", "blake3"), map(float, vals)))
            for t, *vals in re.findall(r"(\d+) tokens .*?digest +([\d.]+) GB/s +\(sha256 +([\d.]+), statistics +([\d.]+);"
                                       r" statistics before +([\d.]+) GB/s\); blake3 +([\d.]+)", text)}
    assert sorted(rows) == [1024, 2048, 4096]
    assert rows[4096]["stats"] >= 0.9 * rows[1024]["stats"]      # linear now
    assert rows[4096]["before"] < 0.5 * rows[1024]["before"]     # it was not
    assert all(r["blake3"] > 3 * r["sha256"] for r in rows.values())


def test_the_h200_bench_of_the_three_shapes_with_the_blake3_digest():
    """Round 7 (``round.py main --steps bench_wide,bench_8b_4ids,bench_8b_8ids``, the manifest's hash
    BLAKE3): where specops' own digest keeps up (the 8B-like model, 4 ids) and where it still does not."""
    ratios = {}
    for shape in ("bench_wide", "bench_8b_4ids", "bench_8b_8ids"):
        bench = json.loads(read(f"bench/round7/{shape}.json"))
        ratios[shape] = bench["ratios_same_concurrency"]
        specops = next(r for r in bench["runs"] if r["kind"] == "specops")
        assert specops["files"] == bench["samples"] and specops["digest_workers"] == 8
    assert ratios["bench_8b_4ids"]["specops@32"] >= 0.9           # manifest done, 8B-like, 4 ids
    assert ratios["bench_8b_8ids"]["specops@32"] < 0.9 and ratios["bench_wide"]["specops@32"] < 0.9  # not yet
    # durable within 5 % of kept-and-durable with 4 ids; the digest is what the rest is short of
    assert ratios["bench_8b_4ids"]["specops_durable@32"] >= 0.95 * ratios["bench_8b_4ids"]["keep_durable@32"]


# ----------------------------------------------------------------------------- round 8 (issues 22, 24, 25)

def round8_bench(shape: str) -> dict:
    return json.loads(read(f"round8/bench/{shape}.json"))


def test_round8_digest_in_one_pass_does_not_lift_the_h200_hosts_plateau():
    """``bench_digest.py --here --threads 1,4,8,16 --files 48`` on the H200 host: hashing each block while it is in
    cache (one pass) costs the same as hashing the file after the statistics (two passes), on one thread and on
    many, and both stop near 5 GB/s from 8 threads on: the plateau is not the second read of the bytes."""
    import re

    text = read("round8/digest-h200.txt")
    assert "Intel(R) Xeon(R)" in text
    par = {int(t): (float(a), float(b)) for t, a, b in
           re.findall(r"(\d+) threads: one pass +([\d.]+) +two passes +([\d.]+)", text)}
    assert sorted(par) == [1, 4, 8, 16]
    assert all(0.85 <= one / two <= 1.15 for one, two in par.values()), par
    assert par[16][0] < 1.1 * par[8][0] and par[8][0] < 5 * par[1][0], par  # no gain past 8 threads


def test_round8_bench_both_plain_runners_the_same_chunking_and_what_keeps_up():
    """Round 8 on the H200 (``round.py main --steps bench_wide,bench_8b_4ids,bench_8b_8ids``, 2 reps, concurrency 32):
    the plain baselines on vLLM's V2 and V1 model runners are printed beside each other (within 3 %), every
    server prefilled in chunks as the extraction engine resolved (``auto`` -> on), and the issue's target holds
    on the 8B-like shape with 4 ids (manifest done >= 0.9 of plain, durable within 5 % of kept-durable)."""
    ratios = {}
    for shape in ("bench_wide", "bench_8b_4ids", "bench_8b_8ids"):
        bench = round8_bench(shape)
        r = ratios[shape] = bench["ratios_same_concurrency"]
        assert 0.97 <= r["plain_v1@32"] <= 1.03, (shape, r)
        assert bench["chunked_prefill"]["on"] and "--enable-chunked-prefill" in bench["plain_command"]
        assert "--enable-chunked-prefill" in bench["plain_v1_command"] and "--enable-chunked-prefill" in bench["extract_command"]
        assert "ratios_vs_plain_v1" in bench
    four, eight, wide = ratios["bench_8b_4ids"], ratios["bench_8b_8ids"], ratios["bench_wide"]
    assert four["specops@32"] >= 0.9 and four["specops_durable@32"] >= 0.95 * four["keep_durable@32"]
    assert eight["specops_durable@32"] >= 0.95 * eight["keep_durable@32"]
    # not met: 8 ids at 0.87, and llama_wide, where the extraction server alone is 0.82 of plain with the
    # same chunking (the states land at ~5.5 GB/s, more than the digest's plateau)
    assert eight["specops@32"] < 0.9 and wide["server_only@32"] < 0.9 and wide["specops@32"] < wide["keep@32"]


def test_round8_the_canary_costs_under_two_percent_of_a_pass():
    """``specops_canary``: the same pass with the canary as a new run has it (the first two samples' prompt
    logprobs, the head loaded afresh, both checked as they land) against ``specops`` without it."""
    for shape in ("bench_wide", "bench_8b_4ids", "bench_8b_8ids"):
        best = round8_bench(shape)["best_tok_per_s"]
        assert best["specops_canary@32"] >= 0.98 * best["specops@32"], (shape, best)
        canaries = [r["canary"] for r in round8_bench(shape)["runs"] if r["kind"] == "specops_canary"]
        assert all([c["status"] for c in recs] == ["ok", "ok"] for recs in canaries), canaries


def test_round8_fp8_states_on_the_h200_half_the_bytes_and_what_their_digest_cost():
    """fp8 states of the 8B-like shape (hs-connectors' FP8HiddenStatesConnector on vLLM 0.25): half the bytes of
    bf16 per sample; the server and connector alone 0.89 of plain, and specops 0.73 with the digest as it was
    then (torch widening fp8 element by element: 212 ms a 33.6 MB file on one core against 54 ms for a 67 MB bf16
    one), which the table lookup in remote/extract/sampleread.py replaces."""
    fp8, bf16 = round8_bench("bench_8b_fp8"), round8_bench("bench_8b_4ids")
    assert fp8["format"] == "fp8" and fp8["layer_ids"] == bf16["layer_ids"] == [2, 16, 29, 32]
    per_file = lambda b: next(r["bytes_per_file"] for r in b["runs"] if r["kind"] == "specops")  # noqa: E731
    assert 0.49 <= per_file(fp8) / per_file(bf16) <= 0.51
    r = fp8["ratios_same_concurrency"]
    assert 0.85 <= r["server_only@32"] < 0.95 and r["specops@32"] < 0.8
    ms = fp8["digest_profile"]["single_thread_ms_per_file"]["digest"]
    assert ms > 3 * bf16["digest_profile"]["single_thread_ms_per_file"]["digest"]


def test_round8_the_canary_stops_planted_faults_on_a_real_width_model():
    """The 8B-like model (hidden 4096, 32 layers), 256 samples of 2048 tokens, the canary on its first two: the
    healthy run passes; a server that captures layer 31 where the run says 32 (the final id shifted) and one
    that computes another model (norm eps overridden) fail with ``canary.logits`` ~20 s after the server was
    ready, half their samples not spent. The shifted run was not named "shifted" then (one more decoder layer
    recomputed in float32 did not land within the head's 4x floor): remote/verify/logits.py now also takes
    a 5x reduction within 16x the floor as the explanation."""
    from datetime import datetime

    ok = json.loads(read("round8/canary/ok/status.json"))
    assert ok["state"] == "done" and ok["samples_done"] == 48
    assert [r["status"] for r in json.loads(read("round8/canary/ok/canary.json"))] == ["ok", "ok"]
    for name in ("shifted", "other"):
        status = json.loads(read(f"round8/canary/{name}/status.json"))
        assert status["state"] == "failed" and status["error"]["check"] == "canary.logits"
        assert status["samples_done"] < status["samples_total"] / 2 + 1
        stamp = lambda key: datetime.strptime(status[key], "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
        after_ready = (stamp("updated_at") - stamp("started_at")).total_seconds() - status["phase_seconds"]["load"]
        assert after_ready < 60, after_ready
        (record,) = json.loads(read(f"round8/canary/{name}/canary.json"))
        (sample,) = record["detail"]["samples"].values()
        assert sample["status"] == "fail" and sample["floor_ratio"] > 4
    shifted = json.loads(read("round8/canary/shifted/canary.json"))[0]["detail"]["samples"]["hs_0.safetensors"]
    assert shifted["floor_ratio"] > 40 and shifted["top1_agree"] < 0.8 * shifted["positions"]


def test_round8_bounded_references_on_the_8b_like_run():
    """``verify --reference logits`` on the healthy 8B-like run reads the head only (peak host memory far below
    the whole model in float32); ``--reference layer`` says why it cannot run on ids without a consecutive pair."""
    logits = {r["name"]: r for r in json.loads(read("round8/canary/verify_logits_8b.json"))["records"]}
    assert logits["verify.logits"]["status"] == "ok"
    memory = logits["verify.reference"]["detail"]["memory"]
    assert memory["peak_rss_bytes"] < memory["whole_model_fp32_bytes"] / 50, memory
    layer = {r["name"]: r for r in json.loads(read("round8/canary/verify_layer_8b.json"))["records"]}
    assert layer["verify.layers"]["status"] == "fail" and "no consecutive pair" in layer["verify.layers"]["summary"]


def test_round8_extract_train_eval_through_the_cli_on_the_h200():
    """#24 on the GPU: ``specops extract`` -> ``train`` (speculators 0.9 on CUDA, detached and followed; its
    GPU memory preflight read nvidia-smi) -> ``fetch`` -> ``eval --baseline`` (vLLM 0.25 serving the 8B-like
    target with the draft as eagle3, acceptance from /metrics); 16 rows, 4 epochs: a random target's draft
    barely accepts, and the eagle3 server is then slower than plain."""
    train = records("round8/train/train_8b.json")
    assert train["train.run"]["status"] == "ok" and train["train.plan"]["status"] == "ok"
    mem = train["train.memory"]
    assert mem["status"] == "ok" and "NVIDIA H200" in mem["summary"], mem["summary"]
    assert "--target-layer-ids [2, 16, 29]" in train["train.plan"]["summary"]
    evals = cli_json("round8/train/eval_8b.json")
    (host,) = evals["hosts"]
    got = {r["name"]: r for r in host["records"]}
    assert got["eval.baseline"]["status"] == "ok"
    base = got["eval.baseline"]["detail"]
    assert 0 < base["speedup"] < 1 and base["plain"] > 100
    assert "metrics.csv" in read("round8/train/fetch_train_8b.txt")


def round9_bench(shape: str) -> dict:
    return json.loads(read(f"round9/bench/{shape}.json"))


def test_round9_the_digest_plateau_is_the_interpreter_lock_not_the_memory():
    """``round.py main --steps digest_cpu`` on the H200 host (``bench_digest.py --here --threads 1,4,8,16 --files
    48``): 16 cores of one thread each (lscpu), so the round-8 plateau was not hyper-threads; files digested on
    threads of one process stop near 4.4 GB/s from 8 threads while as many processes keep scaling (13.3 GB/s on
    16): the memory has the bandwidth, one interpreter lock is the limit. A reused block per thread changes
    little on its own (0.97-1.14x)."""
    import re

    lscpu = read("round9/digest/lscpu.txt")
    assert re.search(r"Thread\(s\) per core:\s+1\n", lscpu) and re.search(r"^CPU\(s\):\s+16$", lscpu, re.M)
    text = read("round9/digest/digest_bf16.txt")
    rows = {int(n): (float(now), float(fresh), float(procs)) for n, now, fresh, procs in re.findall(
        r"(\d+) threads: now +([\d.]+) +fresh blocks \(before\) +([\d.]+) .*?\d+ processes +([\d.]+)", text)}
    assert sorted(rows) == [1, 4, 8, 16], rows
    threads = {n: r[0] for n, r in rows.items()}
    procs = {n: r[2] for n, r in rows.items()}
    assert threads[16] < 1.1 * threads[8] < 1.3 * threads[4], threads  # threads stop scaling
    assert procs[16] > 1.4 * procs[8] > 1.4 * procs[4] * 1.2 and procs[16] > 3 * threads[16], procs
    assert all(0.9 <= now / fresh <= 1.2 for now, fresh, _ in rows.values()), rows
    # the statistics are linear in the bytes (per-byte cost of a 2048-token file over a 1024-token one)
    per_byte = re.search(r"per-byte cost 2048 / 1024 tokens: digest ([\d.]+), statistics ([\d.]+)", text)
    assert all(0.9 <= float(v) <= 1.1 for v in per_byte.groups()), per_byte.groups()


def test_round9_bench_with_digest_processes_at_the_issues_sample_counts():
    """Round 9 (``round.py main --steps bench_8b_8ids,bench_8b_4ids`` then ``bench_wide``; 192 / 256 / 512 samples,
    2 reps, concurrency 32; both plain runners printed, within 3 %):

    * 8B-like, 4 ids: manifest done 0.97 of plain, durable 0.99x kept-durable -- the target holds;
    * 8B-like, 8 ids: 0.88, where vLLM writing the same files with no digest at all (``keep``) is 0.87: at
      134 MB a sample the page cache is the limit, not specops (durable 0.56 vs kept-durable 0.47);
    * ``llama_wide``: vLLM's extraction alone (``server_only``, the connector's files deleted unread) is 0.74 of
      plain: below the 0.9 target before specops reads a byte; specops 0.68 with its digests in processes vs 0.65
      on threads in the same run, 0.92 of vLLM's own extraction; durable within 5 % of kept-durable.
    """
    eight, four, wide = (round9_bench(s) for s in ("bench_8b_8ids", "bench_8b_4ids", "bench_wide"))
    assert (eight["samples"], four["samples"], wide["samples"]) == (192, 256, 512)
    for bench in (eight, four, wide):
        r = bench["ratios_same_concurrency"]
        assert 0.97 <= r["plain_v1@32"] <= 1.03, r
        assert bench["chunked_prefill"]["on"]
    r4, r8, rw = (b["ratios_same_concurrency"] for b in (four, eight, wide))
    assert r4["specops@32"] >= 0.9 and r4["specops_durable@32"] >= 0.95 * r4["keep_durable@32"], r4
    assert r8["specops@32"] >= 0.98 * r8["keep@32"] and r8["specops_durable@32"] >= 0.95 * r8["keep_durable@32"], r8
    assert rw["server_only@32"] < 0.8 and rw["specops@32"] >= 0.9 * rw["server_only@32"], rw
    assert rw["specops@32"] > rw["specops_threads@32"], rw
    assert rw["specops_durable@32"] >= 0.95 * rw["keep_durable@32"], rw


def test_round9_the_shifted_final_id_is_named_on_a_real_width_model():
    """The 8B-like run whose server captures layer 31 where the run says 32 (``round.py main --steps
    canary_shifted``): stopped by the canary with 126 of 256 samples done, and now named: one more decoder layer
    run on the recorded state brings 46x the bf16 floor down to 4.7x (the rule of e203b92: a 5x reduction, within
    16x the floor), so the record says the file holds ``input:31``."""
    status = json.loads(read("round9/canary/shifted_status.json"))
    assert status["state"] == "failed" and status["error"]["check"] == "canary.logits"
    failed = [r for r in json.loads(read("round9/canary/shifted_canary.json")) if r["status"] == "fail"]
    assert failed
    sample = next(iter(failed[0]["detail"]["samples"].values()))
    assert sample["cause"]["kind"] == "shifted" and sample["cause"]["holds"] == "input:31"
    assert sample["floor_ratio"] > 16 and sample["one_more_layer"]["floor_ratio"] < sample["floor_ratio"] / 5
    assert "shifted by one" in status["error"]["fix"]


# --------------------------------------------------------------------------- round 10 (2026-12-03)

def test_round10_a_swapped_pair_of_samples_is_stopped_by_the_canary_and_named_on_the_h200():
    """``round.py main --steps canary_swapped``: the 8B-like run whose samples 0 and 1 land with each other's
    states (the ``swap_sample_states`` hook; each file keeps its own ids, so the landing's checks pass) fails
    ``canary.logits`` with 17 of 256 samples done, and names the other sample: its states reproduce sample 0's
    prompt logprobs."""
    got = json.loads(read("round10/summary-r10c5.json"))["steps"]["canary_swapped"]["result"]
    assert got["state"] == "failed" and got["samples_done"] < got["samples_total"] / 10, got
    error = got["error"]
    assert error["type"] == "CanaryFailed" and error["check"] == "canary.logits", error
    assert "hs_1.safetensors's states reproduce sample 0's prompt logprobs" in error["message"], error["message"]
    assert "re-run the extraction" in error["fix"]
    cause = error["detail"]["samples"]["hs_1.safetensors"]["cause"]
    assert cause["kind"] == "swapped" and cause["with"] == 0, cause
    assert got["wall_s"] < 120, got["wall_s"]  # the run's whole life, server start included


def test_round10_fp8_states_with_the_table_lookup_and_digest_processes_keep_up():
    """fp8 states of the 8B-like shape again (256 x 2048, ids 2,16,29,32), after round 9's digest processes
    and the fp8 table lookup: specops 0.91 of plain (round 8: 0.73), the thread path 0.83 in the same run;
    durable above vLLM's kept-durable; half the bytes of bf16 per sample (round 9's 4-id bench)."""
    fp8 = json.loads(read("round10/bench/bench_8b_fp8.json"))
    bf16 = round9_bench("bench_8b_4ids")
    assert fp8["format"] == "fp8" and fp8["samples"] == 256 and fp8["layer_ids"] == bf16["layer_ids"]
    per_file = lambda b: next(r["bytes_per_file"] for r in b["runs"] if r["kind"] == "specops")  # noqa: E731
    assert 0.49 <= per_file(fp8) / per_file(bf16) <= 0.51
    r = fp8["ratios_same_concurrency"]
    assert r["specops@32"] >= 0.9 and r["specops@32"] > r["specops_threads@32"] + 0.05, r
    assert r["specops_durable@32"] >= 0.95 * r["keep_durable@32"], r
    assert json.loads(read("round8/bench/bench_8b_fp8.json"))["ratios_same_concurrency"]["specops@32"] < 0.8


def test_round10_the_trainers_gpu_memory_measured_and_the_estimate_that_now_covers_it():
    """``round.py main --steps draft_train``: the train supervisor sampled the trainer's process tree on the H200
    (nvidia-smi --query-compute-apps): 13.0 GB peak, 1.22x the estimate it ran with (10.7 GB). The estimate's
    activations now carry the factor that measurement gave (remote.train.memory.ACTIVATION_FACTOR): the same shape
    is estimated at or just above the measured peak. The trainer packed 8192 tokens a step (CUDA's default
    now): a median step of 57.7k tok/s against round 8's 2.5k with one 256-token sample a step (23x)."""
    from remote.train import memory as trainmem

    status = json.loads(read("round10/train/status.json"))
    mem = status["memory"]
    assert mem["source"] == "nvidia-smi --query-compute-apps" and mem["where"] == "GPU 0 (NVIDIA H200)", mem
    assert mem["samples"] > 100 and mem["peak_over_estimate"] == round(mem["peak_bytes"] / mem["estimate_bytes"], 3)
    assert 1.15 < mem["peak_over_estimate"] < 1.3, mem
    assert "--total-seq-len" in status["command"] and status["command"][status["command"].index(
        "--total-seq-len") + 1] == "8192"
    shape = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 512, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128}  # the 8B-like target (round 8's train.memory shape)
    now = trainmem.estimate(shape, total_seq_len=8192)["need_bytes"]
    assert 0.9 <= mem["peak_bytes"] / now <= 1.0, (mem["peak_bytes"], now)
    rounds8 = [float(line.split(",")[4]) for line in read("round8/train/metrics.csv").splitlines()[2:]
               if line.startswith("train,")]
    steps = [json.loads(line) for line in read("round10/train/metrics.jsonl").splitlines()]
    speeds = [s["tokens_per_s"] for s in steps if s["kind"] == "train" and s["step"] > 0]
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    assert median(speeds) > 10 * median(rounds8), (median(rounds8), median(speeds))


def test_round10_train_and_eval_on_the_h200_regenerated_replies_a_draft_at_chance_and_the_off_by_one_refused():
    """``draft_train``, ``draft_eval``, ``draft_shifted``: the 8B-like random target wrote its own replies to 512
    chat rows (549 samples, 53.7k reply tokens), their states were extracted and a draft trained 3 epochs (24
    steps of 8192 tokens): 27 % top-1 on its training batches but 0.3 % on speculators' held-out tenth -- it
    memorized -- and served as eagle3 on 16 held-out rows it is at chance (mean acceptance length 1.0025), as
    is the copy whose aux ids are off by one (refused first, then forced: 1.003); the eagle3 server makes 0.84x
    the plain server's output tokens/s. Not the budget: this target's weights (transformers' flat std 0.02 at
    width 4096) make its next token chaotic; round 11 trained the same flow on one drawn at std 0.01."""
    steps = [json.loads(line) for line in read("round10/train/metrics.jsonl").splitlines()]
    last_train = [s for s in steps if s["kind"] == "train"][-1]
    last_val = [s for s in steps if s["kind"] == "val"][-1]
    assert last_train["step"] == 23 and last_train["accuracy"][0] > 0.2 and last_val["accuracy"][0] < 0.01
    regen = json.loads(read("round10/train/regenerated.json"))
    assert regen["samples"] == 549 and regen["rows"] == [0, 512] and regen["sampling_params"] == {"temperature": 0.0}
    trained = {r["name"]: r for r in cli_json("round10/eval/eval_8b_r.json")["hosts"][0]["records"]}
    acc = trained["eval.acceptance"]["detail"]
    assert acc["rows"] == [512, 528] and acc["draft_tokens"] > 6000 and acc["mean_acceptance_length"] < 1.01, acc
    assert trained["eval.acceptance"]["status"] == "warn" and "at chance" in trained["eval.acceptance"]["summary"]
    base = trained["eval.baseline"]["detail"]
    assert base["plain"] > 200 and 0.8 < base["speedup"] < 0.9, base
    refused = {r["name"]: r for r in cli_json("round10/eval/eval_8b_shifted_refused.json")["hosts"][0]["records"]}
    assert refused["eval.draft_layer_ids"]["status"] == "fail" and refused["eval.draft_layer_ids"]["detail"] == {
        "draft": [3, 17, 30], "states": [2, 16, 29], "extraction_ids": [2, 16, 29, 32]}
    forced = {r["name"]: r for r in cli_json("round10/eval/eval_8b_shifted.json")["hosts"][0]["records"]}
    assert forced["eval.draft_layer_ids"]["status"] == "warn"
    assert forced["eval.acceptance"]["detail"]["rows"] == acc["rows"]
    assert forced["eval.acceptance"]["detail"]["mean_acceptance_length"] < 1.01


# --------------------------------------------------------------------------- round 11 (2026-12-03)

def test_round11_a_draft_for_the_8b_shaped_target_is_accepted_and_speeds_it_up_on_the_h200():
    """``draft_train``, ``draft_eval``, ``draft_shifted``, ``draft_untrained`` on ``llama_8b_std01`` (Llama-3-8B's
    shape, weights at std 0.01: a random target a draft can learn, scripts/gpu/target_gain_scan.py): it regenerated
    its replies to 4096 chat rows, their states were extracted and a draft trained 4 epochs (76 steps of 8192
    tokens), 44 % top-1 on speculators' held-out tenth. Served as eagle3 on 16 held-out rows: mean acceptance
    length 1.63 and 1.37x the plain server's output tokens/s; an untrained draft of the same shape: 0 accepted.
    The copy with its aux ids off by one is refused, then forced: on this target the neighbouring layers carry
    the same signal (the same 785 tokens accepted), so the refusal is what protects."""
    regen = json.loads(read("round11/train/regenerated.json"))
    assert regen["rows"] == [0, 4096] and regen["model"].endswith("llama_8b_std01") and regen["samples"] == 2371
    replies = json.loads(read("round11/train/reply_stats.json"))
    assert replies["distinct"] > 300 and replies["repeat_fraction"] < 0.7 and replies["bigram_held_out"] < 0.7, replies
    status = json.loads(read("round11/train/status.json"))
    assert status["state"] == "done" and status["steps_total"] == 76 and status["plan"]["total_seq_len"] == 8192
    assert status["val_accuracy"][0] > 0.4, status["val_accuracy"]
    # the estimate calibrated by round 10's measurement held on a second run: 0.97x of what the trainer took
    assert status["memory"]["where"] == "GPU 0 (NVIDIA H200)" and 0.9 < status["memory"]["peak_over_estimate"] <= 1.0

    trained = {r["name"]: r for r in cli_json("round11/eval/eval_8b_r.json")["hosts"][0]["records"]}
    acc = trained["eval.acceptance"]
    assert acc["status"] == "ok" and acc["detail"]["rows"] == [4096, 4112], acc
    assert acc["detail"]["mean_acceptance_length"] > 1.5 and acc["detail"]["per_position"][0] > 0.25, acc["detail"]
    base = trained["eval.baseline"]["detail"]
    assert base["plain"] > 200 and base["speedup"] > 1.3, base
    untrained = {r["name"]: r for r in cli_json("round11/eval/eval_8b_u.json")["hosts"][0]["records"]}
    chance = untrained["eval.acceptance"]
    assert chance["status"] == "warn" and chance["detail"]["accepted"] == 0 and chance["detail"]["draft_tokens"] > 6000
    assert chance["detail"]["rows"] == acc["detail"]["rows"]
    refused = {r["name"]: r for r in cli_json("round11/eval/eval_8b_shifted_refused.json")["hosts"][0]["records"]}
    assert refused["eval.draft_layer_ids"]["status"] == "fail" and "eval.acceptance" not in refused
    forced = {r["name"]: r for r in cli_json("round11/eval/eval_8b_shifted.json")["hosts"][0]["records"]}
    assert forced["eval.draft_layer_ids"]["status"] == "warn"
    shifted = forced["eval.acceptance"]["detail"]
    assert abs(shifted["mean_acceptance_length"] - acc["detail"]["mean_acceptance_length"]) < 0.05, shifted


def test_round12_vllm_026_on_the_h100_preflight_extract_with_the_canary_and_verify_through_the_cli():
    """vLLM 0.26.0 (it pins the device's torch 2.11, as 0.25 does) staged like the 0.25 kit, on an H100 (the
    device gave no H200 that hour): the unchanged CLI over SSH ran preflight, extract with the canary, status,
    fetch and verify on the tiny Llama. Extraction was served by the V1 model runner: 0.26's server says V2
    does not yet support extract_hidden_states and falls back; the aux ids it took are the run's."""
    from remote.extract.engines.vllm_server import logs as server_log

    pre = records("round12/cli/preflight_gpu-llama.json")
    for name in ("drift.server-method", "drift.server-connector", "drift.server-args", "drift.server-eagle3",
                 "drift.server-chunking", "drift.server-known-bad"):
        assert pre[name]["status"] == "ok", pre[name]
    assert "vllm/v1/spec_decode/extract_hidden_states.py:" in pre["drift.server-method"]["summary"]
    manifest = json.loads(read("round12/cli/fetched_gpu-llama-3/manifest.json"))
    assert manifest["versions"]["vllm"] == "0.26.0" and manifest["versions"]["torch"] == "2.11.0"
    log = read("round12/cli/fetched_gpu-llama-3/logs/server.log")
    runner = server_log.model_runner(log)
    assert runner["runner"] == "V1" and "extract_hidden_states" in runner["why"], runner
    assert server_log.aux_ids_used(log)["ids"] == manifest["layer_ids"] == [2, 4, 5, 8]
    assert manifest["engine"]["aux_ids_used"]["ids"] == [2, 4, 5, 8]
    assert manifest["canary"]["status"] == "ok" and manifest["canary"]["checked"] == 2, manifest["canary"]
    status = records("round12/cli/status_llama.json")
    assert status["job.status"]["status"] == status["job.canary"]["status"] == "ok"
    verify = records("round12/cli/verify_llama.json")["verify.run"]
    assert verify["status"] == "ok" and "every state is finite" in verify["summary"], verify


def test_the_model_runner_line_of_each_vllm():
    """The V2 runner's own line (vLLM 0.26-0.33 and the CPU build log it when it serves), the fall-back to V1
    (round 12's log), and a log that names neither."""
    from remote.extract.engines.vllm_server import logs as server_log

    assert server_log.model_runner("(EngineCore pid=9) INFO 12-05 [gpu_worker.py:378] Using V2 Model Runner\n") == {
        "runner": "V2", "why": "the server chose the V2 runner",
        "line": "(EngineCore pid=9) INFO 12-05 [gpu_worker.py:378] Using V2 Model Runner"}
    assert server_log.model_runner("INFO loading\nINFO ready\n") is None


def test_round13_the_layout_on_one_h100_dp_default_one_and_dp_two_refused_before_the_load():
    """Issue 42 on a GPU (round 13, H100, vLLM 0.26, the unchanged CLI over SSH): preflight's layout defaults to
    GPUs // tp = 1 replica, ``--dp 2`` fails preflight naming the GPUs it needs, and the run through the layout
    path is a one-replica run: done, its canary checked, the manifest's ``engine.dp`` 1 with the GPU env written
    by the one writer (``layout.device_env``) and the server's aux ids the run's."""
    from remote.extract.engines.vllm_server import logs as server_log

    default = records("round13/dp/preflight_dp_default.json")["parallel.layout"]
    assert default["status"] == "ok" and default["summary"].startswith("dp 1 x tp 1 over 1 GPU(s)"), default
    refused = cli_json("round13/dp/preflight_dp2.json")
    layout = {r["name"]: r for h in refused["hosts"] for r in h["records"]}["parallel.layout"]
    assert refused["exit_code"] != 0 and layout["status"] == "fail", layout
    assert "dp 2 x tp 1 needs 2 GPU(s), 1 usable" in layout["summary"] and "dp" in layout["fix"]
    manifest = json.loads(read("round13/dp/fetched_gpu-dp-1/manifest.json"))
    assert manifest["engine"]["dp"] == 1 and manifest["engine"]["replicas"] is None
    assert manifest["versions"]["vllm"] == "0.26.0"
    assert server_log.aux_ids_used(read("round13/dp/fetched_gpu-dp-1/logs/server.log"))["ids"] == [2, 4, 5, 8]
    status = records("round13/dp/status_dp_default.json")
    assert status["job.status"]["status"] == status["job.canary"]["status"] == "ok"
    assert "24/24 samples" in status["job.status"]["summary"]


def test_round13_layer_reference_is_one_layer_of_memory_at_deepseek_v3_width():
    """Issue 43 item 2 on the GPU host's CPU (round 13: 16 threads, 125 GiB): one DeepSeek-V3 layer at its real
    width (6.1 GiB in float32) on a 4096-token sample. The bounded forward peaks at 1.04x one layer + the sample;
    the old dense one at 4.27x (issue 43 saw 4.3x); both give the same error against the bf16 output, below
    the rounding floor, with no router flips."""
    rows = {r["path"]: r for r in json.loads(read("round13/layer_reference/layer_reference.json"))["rows"]
            if r.get("tokens") == 4096 and "skipped" not in r}
    new, old = rows["new"], rows["old"]
    assert new["layer_fp32_bytes"] > 6 * 2**30 and new["threads"] == 16
    assert new["ratio_to_bound"] <= 1.2 < 4 < old["ratio_to_bound"], (new, old)
    assert new["peak_rss_bytes"] == pytest.approx(new["bound_bytes"], rel=0.2)
    for row in (new, old):
        assert row["nrmse"] < row["floor_nrmse"] and row["flips"] == 0 and row["routed"]
    assert new["nrmse"] == pytest.approx(old["nrmse"], rel=1e-3)


def test_round14_layer_reference_stays_one_layer_of_memory_at_8192_tokens():
    """Issue 43 item 2 at both lengths it asks for (round 14, the H100 host's CPU, 16 threads): one DeepSeek-V3
    layer in float32 on 4096- and 8192-token samples, the bounded forward at 1.04x and 1.05x one layer + the
    sample. Its time per token grows by 1.25x for twice the tokens (causal attention's own T^2 share), not
    the 2x a dense [T, T] forward adds; both below the rounding floor, no router flips."""
    doc = json.loads(read("round14/layer_reference/layer_reference.json"))
    rows = {r["tokens"]: r for r in doc["rows"] if r["path"] == "new"}
    assert sorted(rows) == [4096, 8192] and doc["config"]["hidden_size"] == 7168
    for row in rows.values():
        assert row["layer_fp32_bytes"] > 6 * 2**30 and row["threads"] == 16
        assert row["ratio_to_bound"] <= 1.2, row
        assert row["nrmse"] < row["floor_nrmse"] and row["flips"] == 0 and row["routed"], row
    per_token = {t: r["cpu_s"] / t for t, r in rows.items()}
    assert per_token[8192] / per_token[4096] < 1.5, per_token
    assert "8192 |" in read("round14/layer_reference/bench.txt")


def _log_clock(line: str) -> float | None:
    """Seconds into the day of a vLLM log line (``INFO 12-06 05:19:34 [...]``)."""
    m = re.search(r"\b\d\d-\d\d (\d\d):(\d\d):(\d\d) \[", line)
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)) if m else None


@pytest.mark.parametrize("model", ["deepseek_v3_wide", "llama_8b_vocab"])
def test_round14_the_gpu_peak_above_util_times_total_appears_in_the_engines_warm_up_after_the_kv_cache(model):
    """Issue 43's open finding (round 13: nvidia-smi's peak 1.12x util x total at DeepSeek-V3 width), sampled per
    process twice a second in round 14: one process holds the GPU; once the KV cache is allocated the GPU holds
    less than util x total, and the ~4 GiB above it appears while vLLM captures CUDA graphs (between its
    "Torch profiler disabled for CUDA graph capture" and "Graph capturing finished" lines, which count only
    ~0.3 GiB) or right after it, in the engine's warm-up, before any request, and stays. The KV plan itself
    holds (test_memory_plan); the cause of the ~4 GiB is not found yet."""
    base = f"round14/memory/{model}"
    timeline = json.loads(read(f"{base}/smi_timeline.json"))
    memory = json.loads(read(f"{base}/memory.json"))
    log = read(f"{base}/server.log").splitlines()
    budget_mib = memory["compare"]["gpu_used_bytes"]["predicted"] / 2**20

    def clock(pattern):
        return next(_log_clock(line) for line in log if pattern in line)

    kv_at, capture_at, captured_at = (clock("GPU KV cache size"), clock("CUDA graph capture"),
                                      clock("Graph capturing finished"))
    took = float(re.search(r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB",
                           next(line for line in log if "Graph capturing finished" in line)).group(1))
    samples = [(s["t"] % 86400, s["used_mib"].get("0")) for s in timeline if s["used_mib"].get("0")]
    assert {len(s["apps_mib"]) for s in timeline if s["apps_mib"]} == {1}  # one process: the engine core
    peak = max(used for _, used in samples)
    # the GPU first goes over the budget in the engine's warm-up after the KV cache is allocated: while the graphs
    # are captured (DeepSeek-V3 width) or right after (the Llama), before "init engine ... took" and any request
    init_done = clock("init engine (profile, create kv cache, warmup model) took")
    over = next(t for t, used in samples if used > budget_mib)
    assert capture_at <= captured_at <= init_done and capture_at <= over <= init_done + 1, (over, capture_at, init_done)
    # ... ~4 GiB above the KV-allocated level, which was under the budget (the plan's part holds)
    level = max(used for t, used in samples if kv_at <= t < over)
    assert 0.9 * budget_mib < level < budget_mib, (level, budget_mib)
    assert 3 * 1024 < peak - level < 5 * 1024 and took < 0.5, (peak, level, took)
    assert 1.02 <= peak / budget_mib <= 1.12, peak / budget_mib


def test_round14_fp8_speed_the_stock_connector_at_a_third_of_bf16s_rate():
    """Issue 43 item 3 (round 14, H100, vLLM 0.26, DeepSeek-V3 width, 64 x 4096 tokens, the CLI's step budget and
    concurrency): hs-connectors' fp8 connector lands 0.29 of plain prefill where bf16 lands 0.84 (manifest done);
    made durable 0.22 vs 0.29. The fp8_specops kind did not measure specops' own connector: its GPU gate fell
    back to the stock one (recorded), so both fp8 rows are the stock connector and equal within noise; the
    script now names specops' connector in ``kv_connector`` for that kind."""
    doc = json.loads(read("round14/fp8_speed/fp8_speed.json"))
    ratio, durable = doc["ratio_vs_plain"], doc["durable_ratio_vs_plain"]
    assert doc["seq_len"] == 4096 and doc["samples"] == 64 and doc["settings"]["max_num_batched_tokens"] == 2048
    assert ratio["bf16"] > 2.5 * ratio["fp8_stock"] and durable["bf16"] > durable["fp8_stock"], (ratio, durable)
    fallback = doc["connectors"]["fp8_specops"]
    assert fallback["connector"] == doc["connectors"]["fp8_stock"]["connector"] and fallback["fp8_connector_fallback"]
    assert doc["files_equal"]["bytes_equal"] and not doc.get("errors")
    from remote.extract.engines.vllm_server import SPECOPS_FP8_CONNECTOR_CLASS
    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "fp8_speed.py").read_text()
    # the kind that measures specops' connector now asks for it by name
    assert '("fp8_specops", {"format": "fp8", "kv_connector": SPECOPS_FP8})' in script
    assert f'SPECOPS_FP8 = "remote.extract.engines.vllm_server.fp8_connector:{SPECOPS_FP8_CONNECTOR_CLASS}"' in script


def test_round15_specops_fp8_connector_lands_at_bf16s_rate_and_writes_the_stock_file():
    """Issue 43 item 3 (round 15, H100, vLLM 0.26, DeepSeek-V3 width, 64 x 4096 tokens, the CLI's step budget and
    concurrency, four servers side by side in one call): specops' fp8 connector (quantized on the GPU) lands 0.835
    of plain prefill where bf16 lands 0.863 and hs-connectors' own fp8 connector 0.284; made durable it is the
    fastest (0.41 vs bf16's 0.31: half the bytes). Its sample file has the stock one's keys, dtypes and shapes,
    the same token ids, scales within float32 rounding and the values within one fp8 step (the GPU's rounding
    of the same quantizer)."""
    doc = json.loads(read("round15/fp8_speed/fp8_speed.json"))
    ratio, durable = doc["ratio_vs_plain"], doc["durable_ratio_vs_plain"]
    assert doc["seq_len"] == 4096 and doc["samples"] == 64 and doc["settings"]["max_num_batched_tokens"] == 2048
    assert not doc.get("errors") and set(ratio) == {"plain", "bf16", "fp8_stock", "fp8_specops"}
    assert ratio["fp8_specops"] >= 0.95 * ratio["bf16"] and durable["fp8_specops"] > durable["bf16"], (ratio, durable)
    assert ratio["fp8_specops"] > 2.5 * ratio["fp8_stock"], ratio
    ours = doc["connectors"]["fp8_specops"]
    assert ours["connector"].endswith(":SpecopsFP8HiddenStatesConnector") and ours["fp8_connector_fallback"] is None
    same = doc["files_equal"]
    assert same["dtypes_equal"] and same["shapes_equal"] and same["token_ids_equal"], same
    assert same["keys"][0] == same["keys"][1] == ["hidden_states", "hidden_states_scales", "token_ids"]
    assert same["scales_max_rel"] < 1e-6 and same["within_one_ulp"] > 0.9999, same
    # the call before it: the server could not import specops' connector (the script ran its engine without the
    # repo on the server's path, as a job's bundle is); the script now puts it there
    first = json.loads(read("round15/fp8_speed_first/fp8_speed.json"))
    assert any("No module named 'remote'" in e for e in first["errors"]), first["errors"]
    assert 'os.environ["PYTHONPATH"]' in (Path(__file__).resolve().parents[1] / "scripts" / "gpu" /
                                          "fp8_speed.py").read_text()


@pytest.mark.parametrize("model", ["deepseek_v3_wide", "llama_8b_vocab"])
def test_round15_max_num_seqs_at_the_runs_concurrency_keeps_the_gpu_at_its_budget(model):
    """Issue 43's GPU peak above util x total (round 14: 1.06x / 1.02x, appearing in the engine's warm-up after
    the KV cache): round 15 ran the engine's new ``--max-num-seqs`` (the run's concurrency, 8, not vLLM's 1024 on
    an 80 GB card). vLLM's profile peak fell by 2.0 / 2.8 GiB (its sampler warm-up over 1024 requests x a 128k
    vocabulary), the KV cache grew by 11 % / 15 %, and nvidia-smi's peak came to 1.016x / 0.99x util x total."""
    def read_run(rnd):
        base = f"{rnd}/memory/{model}"
        log = read(f"{base}/server.log")
        timeline = json.loads(read(f"{base}/smi_timeline.json"))
        budget_mib = json.loads(read(f"{base}/memory.json"))["compare"]["gpu_used_bytes"]["predicted"] / 2**20
        peak = max(s["used_mib"]["0"] for s in timeline if s["used_mib"].get("0"))
        seqs = re.search(r"'max_num_seqs': (\d+)", log)
        return {"seqs": int(seqs.group(1)) if seqs else None, "peak_of_budget": peak / budget_mib,
                "activation_gib": float(re.search(r"([\d.]+) GiB for peak activation", log).group(1)),
                "kv_tokens": int(re.search(r"GPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))}

    before, after = read_run("round14"), read_run("round15")
    assert before["seqs"] is None and after["seqs"] == 8  # vLLM's default then, the run's concurrency now
    assert before["activation_gib"] - after["activation_gib"] > 1.9, (before, after)
    assert after["kv_tokens"] > 1.1 * before["kv_tokens"], (before, after)
    assert after["peak_of_budget"] < 1.02 < before["peak_of_budget"], (before, after)
    from remote.extract.engines.vllm_server import command
    argv = command.server_command("python", "/m", port=1, tp=1, layer_ids=[1], storage_dir="/s",
                                  connector=("C", None), max_model_len=4097, params={"concurrency": 8})
    assert argv[argv.index("--max-num-seqs") + 1] == "8"


def _sweep(model: str) -> dict:
    """Round 16's sweep of one model: ``{budget: bench.json}`` (plain and a run's extraction side by side per step
    budget, one pass per concurrency)."""
    return {budget: json.loads(read(f"round16/defaults_sweep/{model}/bt{budget}.json")) for budget in (2048, 4096, 8192)}


@pytest.mark.parametrize("model", ["deepseek_v3_wide", "llama_8b_vocab"])
def test_round16_the_gpu_step_budget_is_the_sweeps_choice_at_the_clis_concurrency(model):
    """Issue 43 item 4 (round 16, H100, vLLM 0.26, 64 x 4096-token samples): the step budget a GPU run gets with
    chunked prefill is the one the sweep found fastest at the CLI's concurrency, landed (manifest done) and on
    disk. DeepSeek-V3 width: 80.7k tok/s at 4096 vs 71.1k at 2048 (1.14x; faster at every concurrency from 4 to 32);
    the Llama-8B shape within 3 % at every budget; 8192 no faster at 8 in flight."""
    from remote.extract.engines.vllm_server import command
    from remote.wire import contract

    sweep, at = _sweep(model), contract.param({}, "batch_size")
    chosen = command.batched_tokens({"chunked_prefill_on": True, "device": "cuda"}, 4097)
    assert chosen == command.GPU_BATCHED_TOKENS == 4096 and at == 8
    assert command.batched_tokens({"chunked_prefill_on": True, "device": "cpu"}, 4097) == 2048  # not measured there
    for budget, doc in sweep.items():
        assert doc["settings"]["max_num_batched_tokens"] == budget and doc["settings"]["concurrency"] == [4, 8, 16, 32]
        assert doc["seq_len"] == 4096 and doc["samples"] == 64 and doc["settings"]["chunked_prefill_on"]
    landed = {b: doc["best_tok_per_s"][f"specops@{at}"] for b, doc in sweep.items()}
    durable = {b: doc["best_tok_per_s"][f"specops_durable@{at}"] for b, doc in sweep.items()}
    assert landed[chosen] >= 0.95 * max(landed.values()) and landed[chosen] >= landed[2048], landed
    assert durable[chosen] >= 0.95 * max(durable.values()), durable
    if model == "deepseek_v3_wide":  # where the budget matters: faster than 2048 at every concurrency swept
        assert landed[chosen] > 1.1 * landed[2048], landed
        assert all(sweep[chosen]["best_tok_per_s"][f"specops@{c}"] > sweep[2048]["best_tok_per_s"][f"specops@{c}"]
                   for c in (4, 8, 16, 32))


def test_round16_fp8_at_the_gpu_step_budget_lands_at_0_9_of_bf16_and_reaches_the_disk_1_3x_faster():
    """Issue 43 item 3 at the new step budget (round 16, H100, DeepSeek-V3 width, 64 x 4096 tokens, 4096 batched
    tokens, concurrency 8): plain prefill rose to 89.0k tok/s and bf16 with it (0.864 of plain); specops' fp8
    connector stays at its ~69k (0.78 of plain, 0.90x bf16) landed, and made durable it is 1.31x bf16 (0.391 vs
    0.298: half the bytes). hs-connectors' own fp8 connector: 0.249. What preflight and ``--format``'s help say is
    this measurement."""
    from remote.wire import contract

    doc = json.loads(read("round16/fp8_speed/fp8_speed.json"))
    ratio, durable = doc["ratio_vs_plain"], doc["durable_ratio_vs_plain"]
    assert doc["settings"]["max_num_batched_tokens"] == 4096 and doc["concurrency"] == 8 and not doc.get("errors")
    assert "max_num_batched_tokens" not in doc["settings"]["differs_from_cli"]  # the CLI's own budget now
    assert 0.85 * ratio["bf16"] <= ratio["fp8_specops"] < ratio["bf16"], ratio
    assert durable["fp8_specops"] > 1.25 * durable["bf16"], durable
    assert ratio["fp8_specops"] > 2.5 * ratio["fp8_stock"], ratio
    same = doc["files_equal"]
    assert same["dtypes_equal"] and same["shapes_equal"] and same["token_ids_equal"] and same["within_one_ulp"] > 0.9999
    assert contract.FP8_SPEED["fp8_of_plain"] > ratio["fp8_specops"]  # the digest's bit widening came after


def test_round17_fp8_with_the_digests_bit_widening_lands_with_bf16_and_reaches_the_disk_1_3x_faster():
    """Issue 43 item 3 after the landing digest widens fp8 by its bits (round 17, H100, DeepSeek-V3 width, 64 x
    4096 tokens, 4096 batched tokens, concurrency 8, the four servers side by side): specops' fp8 lands at 0.872
    of plain against bf16's 0.884 (0.99x; round 16, with the table lookup: 0.90x), durable 0.492 vs 0.371 (1.33x).
    hs-connectors' own fp8 connector rose with it (0.249 -> 0.43: the digest was its limit too). What preflight
    and ``--format``'s help say is this measurement."""
    from remote.wire import contract

    doc = json.loads(read("round17/fp8_speed/fp8_speed.json"))
    ratio, durable = doc["ratio_vs_plain"], doc["durable_ratio_vs_plain"]
    assert doc["settings"]["max_num_batched_tokens"] == 4096 and doc["concurrency"] == 8 and not doc.get("errors")
    assert doc["settings"]["digest_in"]["where"] == "processes"
    assert ratio["fp8_specops"] >= 0.98 * ratio["bf16"], ratio  # the bench's spread between rounds: ~2 %
    assert durable["fp8_specops"] > 1.3 * durable["bf16"], durable
    before = json.loads(read("round16/fp8_speed/fp8_speed.json"))["ratio_vs_plain"]
    assert ratio["fp8_specops"] / ratio["bf16"] > before["fp8_specops"] / before["bf16"] + 0.05
    same = doc["files_equal"]
    assert same["dtypes_equal"] and same["shapes_equal"] and same["token_ids_equal"] and same["within_one_ulp"] > 0.9999
    assert contract.FP8_SPEED["fp8_of_plain"] != ratio["fp8_specops"]  # round 22 (the fused kernel) is what it says


def test_round22_fp8_quantized_by_vllms_fused_kernel_lands_with_bf16_and_reaches_the_disk_1_4x_faster():
    """Issue 43 item 3 with the connector quantizing through vLLM's fused per-token fp8 kernel on the GPU (round 22,
    H100, vLLM 0.26, DeepSeek-V3 width, 64 x 4096 tokens, 4096 batched tokens, concurrency 8, four servers side by
    side, three passes each): specops' fp8 landed at 0.869 of plain against bf16's 0.875, medians of passes whose
    ranges overlap (fp8 76.6-77.6k tok/s, bf16 75.2-77.9k: the means 1.003x), durable 0.426 vs 0.306 (1.39x);
    hs-connectors' own connector 0.293. The connector ran (no fallback) and its sample file is the stock one's
    within fp8 rounding. What preflight and ``--format``'s help say is this measurement."""
    from statistics import mean

    from remote.wire import contract

    doc = json.loads(read("round22/fp8_speed/fp8_speed.json"))
    ratio, durable = doc["ratio_vs_plain"], doc["durable_ratio_vs_plain"]
    assert doc["settings"]["max_num_batched_tokens"] == 4096 and doc["concurrency"] == 8 and not doc.get("errors")
    ours = doc["connectors"]["fp8_specops"]
    assert ours["connector"].endswith(":SpecopsFP8HiddenStatesConnector") and ours["fp8_connector_fallback"] is None
    fp8 = [p["tok_per_s"] for p in doc["runs"]["fp8_specops"]["passes"]]
    bf16 = [p["tok_per_s"] for p in doc["runs"]["bf16"]["passes"]]
    assert len(fp8) == len(bf16) == 3 and min(bf16) <= min(fp8) and max(fp8) >= sorted(bf16)[1] * 0.99
    assert mean(fp8) >= mean(bf16), (fp8, bf16)
    assert ratio["fp8_specops"] >= 0.99 * ratio["bf16"], ratio
    assert durable["fp8_specops"] > 1.35 * durable["bf16"], durable
    assert ratio["fp8_specops"] > 2.5 * ratio["fp8_stock"], ratio
    same = doc["files_equal"]
    assert same["dtypes_equal"] and same["shapes_equal"] and same["token_ids_equal"] and same["within_one_ulp"] > 0.9999
    assert {k: contract.FP8_SPEED[k] for k in ("fp8_of_plain", "bf16_of_plain", "stock_fp8_of_plain",
                                               "fp8_durable_of_plain", "bf16_durable_of_plain")} == {
        "fp8_of_plain": ratio["fp8_specops"], "bf16_of_plain": ratio["bf16"], "stock_fp8_of_plain": ratio["fp8_stock"],
        "fp8_durable_of_plain": durable["fp8_specops"], "bf16_durable_of_plain": durable["bf16"]}


def test_round22_a_dspark_draft_of_5_layers_on_3_aux_ids_did_not_load_on_026_and_the_rule_now_says_so():
    """Issue 45 on the GPU (round 22, H100, vLLM 0.26): speculators' default dspark draft (5 layers) on the 8B shape's
    3 aux ids failed at vLLM's load ("Tried to load weights of size [4096, 12288] to a parameter of size [4096,
    20480]"): 0.26's DFlash model sizes its fc from dflash_config's target_layer_ids, else its layers, and the dspark
    converter writes the ids at the top level. Read from 0.26.0's source, eval.draft_loadable now refuses that draft
    before the load with the sizes the log names, and passes the 3-layer one that then served."""
    from remote.drift.pyindex import PackageIndex
    from remote.drift.rules import known_bad
    from remote.train import evaluate as draft_eval
    from specops.testhost.sourcetree import source_of

    draft = json.loads(read("round22/drafts/dspark5/best/config.json"))
    ids, layers = draft["aux_hidden_state_layer_ids"], draft["transformer_layer_config"]["num_hidden_layers"]
    hidden = draft["transformer_layer_config"]["hidden_size"]
    log = read("round22/drafts/dspark5/server_spec.log")
    found = re.search(r"Tried to load weights of size torch.Size\(\[(\d+), (\d+)\]\)\s*to a parameter of size "
                      r"torch.Size\(\[(\d+), (\d+)\]\)", log)
    assert found and [int(g) for g in found.groups()] == [hidden, hidden * len(ids), hidden, hidden * layers]
    assert (len(ids), layers) == (3, 5)
    # eval's checks passed it then (the rule is new): it failed at the server's start, after the load
    failed = records("round22/cli/eval_8b_dspark.json")["eval.server"]
    assert failed["status"] == "fail" and "exited with code 1 before it was ready" in failed["summary"]
    root = source_of("vllm", "0.26.0")
    rec = draft_eval.draft_loadable_record(draft, "/d", root)
    assert rec["status"] == "fail" and rec["detail"]["rule"] == "dflash-fc-count", rec
    assert f"{len(ids)} aux layer ids {ids} and {layers} draft layers" in rec["summary"]
    assert "qwen3_dflash.py:" in rec["summary"] and "vLLM PR 48524" in rec["summary"]
    assert f"--trainer-arg=--num-layers={len(ids)}" in rec["fix"] and "vLLM >= 0.27" in rec["fix"]
    three = {**draft, "transformer_layer_config": {**draft["transformer_layer_config"], "num_hidden_layers": 3}}
    assert draft_eval.draft_loadable_record(three, "/d", root)["status"] == "ok"
    assert known_bad.draft_fc_count_problem(PackageIndex(source_of("vllm", "0.27.1")), draft, "/d") is None
    # the 3-layer draft (--trainer-arg=--num-layers=3) served with the ids the states carry, and accepted
    served = records("round22/drafts/dspark3/eval.json")
    assert served["eval.aux_ids_used"]["status"] == "ok" and "[2, 16, 29]" in served["eval.aux_ids_used"]["summary"]
    data = cli_json("round22/drafts/dspark3/eval.json")["hosts"][0]["data"]
    assert data["k"] == 8 and data["accepted"] > 0 and data["mean_acceptance_length"] > 1.0
    assert json.loads(read("round22/drafts/dspark3/params.json"))["train_args"] == ["--num-layers", "3"]
    assert '"method": "dspark"' in read("round22/drafts/dspark3/server_spec.log").splitlines()[0]


def _train_rows(run: str) -> tuple[dict, list[dict]]:
    """A round-19 train run's training steps (by step) and its validation rows, from its own metrics.jsonl."""
    rows = [json.loads(line) for line in read(f"round19/on_host/{run}/metrics.jsonl").splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}, [r for r in rows if r["kind"] == "val"]


def test_round19_online_training_on_the_gpu_follows_the_offline_curve_step_by_step_with_no_states_on_disk():
    """Issue 44 on an H100 (round 19, vLLM 0.26, the 8B shape at std 0.01, 512 chat rows, seed 42, 4 epochs): the
    same rows trained offline (``--from-run``: 960 MB of states on disk) and online (``--online``, colocated: the
    run's own extraction server and the trainer on the one GPU, ``--keep-states none``). The call's time ended with
    the online run in its third epoch (12 of 16 steps, kept as it stood); on every step both reached, the loss and
    the per-position accuracy agree to the trainer's rounding, and the validation of each epoch too."""
    offline = json.loads(read("round19/on_host/gpu-8b-t/status.json"))
    online = json.loads(read("round19/on_host/gpu-8b-on/status.json"))
    assert offline["state"] == "done" and offline["step"] == offline["steps_total"] == 16, offline["state"]
    assert online["state"] == "training" and online["steps_total"] == 16 and online["error"] is None
    params = json.loads(read("round19/on_host/gpu-8b-on/params.json"))
    assert params["online"] is True and params["keep_states"] == "none"
    # the server the run started extracts the offline run's ids; the trainer reads all but the last
    server = online["online_server"]
    assert server["layer_ids"] == offline["plan"]["layer_ids"] == [2, 16, 29, 32]
    assert server["trainer_layer_ids"] == offline["plan"]["trainer_layer_ids"] == [2, 16, 29]
    assert "--on-missing generate" in read("round19/on_host/gpu-8b-on/checkpoints/train_command.txt")

    steps_off, val_off = _train_rows("gpu-8b-t")
    steps_on, val_on = _train_rows("gpu-8b-on")
    assert sorted(steps_on) == list(range(12)) and sorted(steps_off) == list(range(16))
    worst = max(abs(steps_on[s]["loss"] - steps_off[s]["loss"]) for s in steps_on)
    assert steps_on[0]["loss"] == steps_off[0]["loss"] == 1.28 and worst <= 0.002, worst
    for s in steps_on:
        assert all(abs(a - b) <= 0.01 for a, b in zip(steps_on[s]["accuracy"], steps_off[s]["accuracy"])), s
    assert len(val_on) == 2 and all(abs(a - b) <= 0.005 for on, off in zip(val_on, val_off)
                                    for a, b in zip(on["accuracy"], off["accuracy"])), (val_on, val_off)
    # the trainer's measured GPU peak is inside its estimate in both modes (the server beside it is not its own)
    assert offline["memory"]["peak_over_estimate"] <= 1.0 and online["memory"]["peak_over_estimate"] <= 1.0

    # disk: the offline states (tokens x 4 ids x hidden, bf16) against everything the online run wrote but its
    # checkpoints (the token dataset, logs, status)
    extract = read("round19/cli/extract_8b_x.txt")
    tokens, hidden = (int(x) for x in re.search(r"│\s+2 │ (\d+)x(\d+) │ bfloat16", extract).groups())
    states_bytes = tokens * 4 * hidden * 2
    online_bytes = json.loads(read("round19/summary-r19a.json"))["steps"]["drafts_train"]["result"]["online_disk_bytes"]
    assert tokens == offline["plan"]["tokens"] == 29291 and states_bytes > 900e6
    assert online_bytes < 1e6 and online_bytes < states_bytes / 1000, online_bytes


def _round20_rows(run: str) -> tuple[dict, list[dict]]:
    """A round-20 train run's training steps (by step) and validation rows, from the metrics fetch brought back."""
    rows = [json.loads(line) for line in read(f"round20/cli/fetched_{run}/metrics.jsonl").splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}, [r for r in rows if r["kind"] == "val"]


def test_round20_online_and_offline_drafts_train_the_same_curve_and_accept_alike_on_the_gpu():
    """Issue 44 on an H100 (round 20, vLLM 0.26, the 8B shape at std 0.01, 512 chat rows, seed 42, 4 epochs): the
    online run (colocated, ``--keep-states none``) to its end this time, then the offline run, both served with the
    target on the same 8 held-out rows (``round.py`` ``drafts_pair``). The curves agree step by step over all 16
    steps, the validation of every epoch too, and the two drafts' acceptance is the same within its noise."""
    online = json.loads(read("round20/cli/fetched_gpu-8b-on/status.json"))
    offline = json.loads(read("round20/cli/fetched_gpu-8b-t/status.json"))
    for st in (online, offline):
        assert st["state"] == "done" and st["step"] == st["steps_total"] == 16 and st["error"] is None
        assert st["memory"]["peak_over_estimate"] <= 1.0
    assert json.loads(read("round20/cli/fetched_gpu-8b-on/params.json"))["keep_states"] == "none"
    assert online["online_server"]["layer_ids"] == offline["plan"]["layer_ids"] == [2, 16, 29, 32]

    steps_on, val_on = _round20_rows("gpu-8b-on")
    steps_off, val_off = _round20_rows("gpu-8b-t")
    assert sorted(steps_on) == sorted(steps_off) == list(range(16))
    assert max(abs(steps_on[s]["loss"] - steps_off[s]["loss"]) for s in steps_on) <= 0.002
    assert all(abs(a - b) <= 0.011 for s in steps_on for a, b in zip(steps_on[s]["accuracy"], steps_off[s]["accuracy"]))
    assert steps_on[15]["loss"] < steps_on[0]["loss"] / 5  # it learned: 1.28 -> 0.185 both ways
    assert len(val_on) == len(val_off) == 4
    assert all(abs(a - b) <= 0.006 for on, off in zip(val_on, val_off) for a, b in zip(on["accuracy"], off["accuracy"]))

    served = {}
    for name in ("online", "offline"):
        doc = cli_json(f"round20/cli/eval_8b_{name}.json")
        assert doc["exit_code"] == 0
        host = doc["hosts"][0]
        status = {r["name"]: r["status"] for r in host["records"]}
        assert status["eval.aux_ids_used"] == status["eval.draft_layer_ids"] == status["eval.acceptance"] == "ok"
        served[name] = host["data"]
    assert served["online"]["rows"] == served["offline"]["rows"] == [512, 520]  # rows no train step read
    # acceptance: a binomial count each; the two rates within two standard errors of their difference
    p_on = served["online"]["accepted"] / served["online"]["draft_tokens"]
    p_off = served["offline"]["accepted"] / served["offline"]["draft_tokens"]
    pooled = (p_on + p_off) / 2
    se = (pooled * (1 - pooled) * (1 / served["online"]["draft_tokens"] + 1 / served["offline"]["draft_tokens"])) ** 0.5
    assert abs(p_on - p_off) <= 2 * se, (p_on, p_off, se)
    assert (served["online"]["accepted"], served["offline"]["accepted"]) == (72, 70)

    # what the online run left beside its checkpoints against the offline states
    online_bytes = json.loads(read("round20/summary-r20b.json"))["steps"]["drafts_train"]["result"]["online_disk_bytes"]
    assert online_bytes < 1e6 and offline["plan"]["tokens"] * 4 * 4096 * 2 > 900e6


def test_round20_a_second_train_beside_a_running_one_is_refused_and_a_full_disk_before_the_load():
    """Round 20's first try trained offline while the online run held the GPU: ``train`` refused it by name (the
    round now runs them one after the other); the dflash2 draft asked for 11.2 GiB of checkpoints on a disk with 8.3
    free and was refused before anything loaded, naming both numbers."""
    beside = {r["name"]: r for r in cli_json("round20/cli/train_8b_beside_online.json")["hosts"][0]["records"]}
    assert beside["train.start"]["status"] == "fail" and "already running gpu-8b-on" in beside["train.start"]["summary"]
    assert "specops abort --run-id gpu-8b-on" in beside["train.start"]["fix"]
    disk = {r["name"]: r for r in cli_json("round20/cli/train_8b_dflash2.json")["hosts"][0]["records"]}["train.disk"]
    assert disk["status"] == "fail" and disk["detail"]["need_bytes"] > disk["detail"]["free_bytes"]
    assert "8.3 GiB free" in disk["summary"] and "11.2 GiB" in disk["summary"]


def test_round20_the_sweep_at_real_width_two_temperatures_two_concurrencies_a_gate_and_the_history():
    """Issue 46 on an H100 (round 20): the offline draft on an MT-Bench file (two categories, a two-turn question),
    temperature 0 and 0.8 x concurrency 1 and 4, the plain target measured in the same run, gated at 1.0."""
    doc = cli_json("round20/cli/eval_8b_sweep.json")
    assert doc["exit_code"] == 0
    host = doc["hosts"][0]
    status = {r["name"]: r["status"] for r in host["records"]}
    assert all(status[n] == "ok" for n in ("eval.prompts", "eval.sweep", "eval.baseline", "eval.gate", "eval.files"))
    data = host["data"]
    assert data["prompt_set"]["format"] == "mt_bench"
    assert data["prompt_set"]["categories"] == {"writing": 2, "coding": 2}
    cells = {(c["temperature"], c["concurrency"]): c for c in data["cells"]}
    assert set(cells) == {(0.0, 1), (0.0, 4), (0.8, 1), (0.8, 4)}
    for (temperature, _), cell in cells.items():
        assert cell["baseline_tokens_per_s"] > 0 and cell["speedup"] == pytest.approx(
            cell["tokens_per_s"] / cell["baseline_tokens_per_s"], abs=0.001)
    # four requests in flight give more tokens a second than one, with the draft and without
    assert cells[(0.0, 4)]["tokens_per_s"] > 1.4 * cells[(0.0, 1)]["tokens_per_s"]
    assert cells[(0.0, 4)]["baseline_tokens_per_s"] > 1.4 * cells[(0.0, 1)]["baseline_tokens_per_s"]
    # greedy drafts are accepted more often than sampled ones at 0.8 (the draft was trained on greedy states)
    assert cells[(0.0, 1)]["all"]["accepted"] > cells[(0.8, 1)]["all"]["accepted"]
    assert data["engine"]["vllm"] == "0.26.0" and data["engine"]["per_request"]["available"] is False
    history = cli_json("round20/cli/evals.json")
    assert [e["draft"] for e in history["evals"]] == ["gpu-8b-on", "gpu-8b-t", "gpu-8b-t"]


def test_round20_vllm_refused_a_dspark_draft_at_its_default_sequences_and_eval_now_sizes_the_step():
    """Round 20: the dspark draft (k = its block size, 8) served at vLLM's default ``max_num_seqs`` (1024 on an 80 GB
    card) and the eval's 2048-token step: vLLM refused to start, ``max_num_scheduled_tokens`` -5120. The eval's own
    arithmetic gives vLLM's number from the same flags, and the flags it now passes leave a whole prompt a step."""
    from remote.train import evaluate

    log = read("round20/cli/eval_8b_dspark_server.log")
    argv = log.splitlines()[0]
    spec = json.loads(argv[argv.index("--speculative-config ") + len("--speculative-config "):])
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 8 and "--max-num-seqs" not in argv
    refused = int(re.search(r"max_num_scheduled_tokens is set to (-?\d+)", log).group(1))
    budget = int(re.search(r"--max-num-batched-tokens (\d+)", argv).group(1))
    # vLLM 0.26's arithmetic: k - 1 slots a sequence for a parallel draft, at its default sequences
    assert budget - (spec["num_speculative_tokens"] - 1) * gpu.MAX_NUM_SEQS_BIG_GPU == refused == -5120
    max_len = int(re.search(r"--max-model-len (\d+)", argv).group(1))
    step = evaluate.server_step({"device": "cuda", "concurrency": [1, 8]}, spec, max_len, "dspark")
    assert step["max_num_seqs"] == 8 and step["draft_slots"] == 8 * 8  # k a sequence: the most any release takes
    assert step["max_num_batched_tokens"] == budget and step["room"] >= max_len
    # a sweep so wide that its slots would leave less than a prompt: the budget is raised, not refused by vLLM
    wide = evaluate.server_step({"device": "cuda", "concurrency": [512]}, spec, max_len, "dspark")
    assert wide["room"] == max_len and wide["max_num_batched_tokens"] == 8 * 512 + max_len
    # serial eagle3 takes no extra slots; P-EAGLE (served as eagle3, drafting in parallel) does
    eagle = {"method": "eagle3", "num_speculative_tokens": 8}
    assert evaluate.draft_slots(eagle, "eagle3") == 0 and evaluate.draft_slots(eagle, "peagle") == 8
