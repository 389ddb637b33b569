"""Remote preflight (``remote/probes/preflight.py``) against the real host env and real tiny models.

Every test copies a tiny model into ``tmp_path``, breaks one thing in the copy, runs
``remote.probes.preflight.main`` in the host env's python (the controller env has no torch or
transformers) and checks that exactly that thing fails, with its cause and a fix.
The nvidia-smi parsers are tested on output recorded on a real H200
(``tests/fixtures/nvidia-smi/record.sh`` says how).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hostcall

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
MARK = "@@PREFLIGHT-TEST@@"
RUNNER = f"""
import json, sys
sys.path.insert(0, sys.argv[1])
from remote.probes import preflight
print({MARK!r} + json.dumps(preflight.main(json.loads(sys.argv[2])), default=str))
"""
#: What a CPU test host needs in the job env (FACTS.md); healthy runs pass these.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_MLA_DISABLE": "1"}


class Result:
    """A preflight payload with lookups by record name."""

    def __init__(self, payload: dict):
        self.payload = payload
        self.records = payload["records"]
        self.data = payload["data"]
        self.by_name = {r["name"]: r for r in self.records}

    def __getitem__(self, name: str) -> dict:
        assert name in self.by_name, f"no record {name!r}; have {sorted(self.by_name)}"
        return self.by_name[name]

    def failed(self, *, ignore_areas=()) -> dict:
        return {r["name"]: r["summary"] for r in self.records
                if r["status"] == "fail" and r["area"] not in ignore_areas}


def checked(payload: dict) -> Result:
    """The payload as a :class:`Result`, after checking the result contract on every record."""
    result = Result(payload)
    for r in result.records:  # the result contract holds for every record
        assert r["status"] in ("ok", "changed", "skipped", "warn", "fail"), r
        assert r["status"] != "fail" or r["fix"], f"fail without fix: {r}"
    return result


def run_preflight(python: Path, params: dict, *, bundle: Path = REPO, env: dict | None = None) -> Result:
    """``remote.probes.preflight.main(params)`` in a fresh process of ``python`` (for tests where a fresh
    interpreter is the point, such as a never-imported env); :func:`host_preflight` otherwise."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    proc = subprocess.run([str(python), "-c", RUNNER, str(bundle), json.dumps(params)], capture_output=True,
                          text=True, timeout=240, env=full_env, cwd=str(bundle))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert line, f"no payload; stdout tail: {proc.stdout[-2000:]} stderr tail: {proc.stderr[-2000:]}"
    return checked(json.loads(line[-1][len(MARK):]))


def host_preflight(python: Path, params: dict, *, env: dict | None = None) -> Result:
    """:func:`run_preflight`, answered by the env's long-lived host python (``tests/hostcall.py``):
    the same call, the same process environment, without a new interpreter and import per call."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    return checked(hostcall.call(python, "remote.probes.preflight:main", params, env=full_env, timeout=240))


def base_params(model_dir: Path, tmp_path: Path, **overrides) -> dict:
    """Params of a healthy CPU run; most tests skip the slow transformers child and drift."""
    params = {"model_path": str(model_dir), "output_dir": str(tmp_path / "out"), "work_dir": str(tmp_path / "work"),
              "device": "cpu", "tp": 1, "engine": "speculators-0.3", "layer_ids": None, "dataset": None,
              "max_samples": 8, "seq_len": 128, "gpu_memory_utilization": 0.9, "trust_remote_code": False,
              "autoconfig_timeout": 180, "skip_autoconfig": True, "hidden_dtype_bytes": 2,
              "env": dict(CPU_ENV), "skip_drift": True}
    params.update(overrides)
    return params


@pytest.fixture
def llama_copy(tiny_models, tmp_path) -> Path:
    dst = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], dst)
    return dst


def _shards(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


# -- a healthy host ---------------------------------------------------------------------------

def test_healthy_llama_passes_with_no_fail(hostenv_python, tiny_models, llama_copy, tmp_path):
    params = base_params(llama_copy, tmp_path, tp=min(2, len(os.sched_getaffinity(0))),
                         dataset=str(tiny_models["dataset"]), skip_autoconfig=False, skip_drift=False)
    res = host_preflight(hostenv_python, params)
    # drift findings on the unpatched env are expected fails (the drift check's own tests cover them)
    assert res.failed(ignore_areas=("drift", "patch")) == {}
    areas = {r["area"] for r in res.records}
    assert {"host", "packages", "model", "layers", "parallel", "checkpoint", "tokenizer", "data", "capacity",
            "drift", "patch"} <= areas
    assert res["model.autoconfig"]["status"] == "ok"
    assert res["model.autoconfig"]["detail"]["class"] == "LlamaConfig"
    assert res["model.autoconfig"]["detail"]["seconds"] >= 0
    assert res["tokenizer.load"]["status"] == "ok" and res["tokenizer.load"]["detail"]["template_renders"]
    assert res["layers.ids"]["detail"]["layer_ids"] == [2, 4, 5, 7]
    assert res["layers.ids"]["detail"]["convention"] == "output"
    assert res["model.family"]["detail"]["family"] == "llama"
    assert res["checkpoint.headers"]["detail"]["tensors"] > 0
    assert res["packages.speculators"]["detail"]["version"] == "0.3.0"
    assert res["packages.vllm"]["detail"]["cpu_build"] is True
    seconds = res.data["seconds"]
    assert seconds["static"] < 3.0, seconds  # the static checks, timed apart from the transformers child
    assert {"autoconfig", "hf_child_wall", "drift", "patch", "total"} <= set(seconds)
    assert res.data["model"]["num_layers"] == 8 and res.data["host"]["cpus"]["usable"] >= 1


# -- checkpoint -------------------------------------------------------------------------------

def test_missing_shard_fails(hostenv_python, llama_copy, tmp_path):
    gone = _shards(llama_copy)[1]
    gone.unlink()
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    rec = res["checkpoint.files"]
    assert rec["status"] == "fail"
    assert rec["detail"]["missing"] == [gone.name] and gone.name in rec["summary"]
    assert "download" in rec["fix"]
    assert set(res.failed()) == {"checkpoint.files"}


def test_extra_shard_warns(hostenv_python, llama_copy, tmp_path):
    shutil.copy(_shards(llama_copy)[0], llama_copy / "stray.safetensors")
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    assert res["checkpoint.files"]["status"] == "warn"
    assert res["checkpoint.files"]["detail"]["extra"] == ["stray.safetensors"]


@pytest.mark.parametrize("keep", ["most", "header-only", "4-bytes"])
def test_truncated_shard_fails(hostenv_python, llama_copy, tmp_path, keep):
    shard = _shards(llama_copy)[-1]
    size = shard.stat().st_size
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    new_size = {"most": size - 1000, "header-only": 8 + header_len, "4-bytes": 4}[keep]
    with open(shard, "r+b") as fh:
        fh.truncate(new_size)
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    rec = res["checkpoint.headers"]
    assert rec["status"] == "fail"
    assert shard.name in rec["detail"]["bad"]
    assert "truncated" in rec["detail"]["bad"][shard.name]
    assert shard.name in rec["fix"]
    assert res["checkpoint.files"]["status"] == "ok"  # the file is there; only its size gives it away


def test_index_pointing_at_wrong_shard_fails(hostenv_python, llama_copy, tmp_path):
    shards = [p.name for p in _shards(llama_copy)]

    def move_one(index):
        tensor = next(t for t, s in index["weight_map"].items() if s == shards[0])
        index["weight_map"][tensor] = shards[1]
    _edit_json(llama_copy / "model.safetensors.index.json", move_one)
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    assert res["checkpoint.headers"]["status"] == "fail"
    assert "not in the shard the index names" in res["checkpoint.headers"]["summary"]


def rewrite_shard(shard: Path, keep, add=None) -> list:
    """Rewrite a safetensors shard with only the tensors ``keep(name)`` accepts (plus ``add``:
    ``{name: (dtype, shape, raw bytes)}``), offsets recomputed; returns the names dropped."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", None)
    out, blobs, dropped, offset = {}, [], [], 0
    items = [(k, v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()]
    items += [(k, d, shp, b) for k, (d, shp, b) in (add or {}).items()]
    for name, dtype, shape, blob in items:
        if not keep(name):
            dropped.append(name)
            continue
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if meta is not None:
        out["__metadata__"] = meta
    head = json.dumps(out).encode()
    shard.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    return dropped


def _drop_everywhere(model_dir: Path, doomed) -> list:
    """Drop tensors from every shard and from the index (a layer missing from both)."""
    dropped = []
    for shard in _shards(model_dir):
        dropped += rewrite_shard(shard, lambda name: not doomed(name))
    _edit_json(model_dir / "model.safetensors.index.json",
               lambda index: [index["weight_map"].pop(t) for t in dropped])
    return dropped


def test_a_layer_missing_from_shards_and_index_fails_naming_it(hostenv_python, llama_copy, tmp_path):
    """vLLM would load the rest and fail after the load ("weights were not initialized from checkpoint")."""
    dropped = _drop_everywhere(llama_copy, lambda name: name.startswith("model.layers.3."))
    assert dropped
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    rec = res["checkpoint.layers"]
    assert rec["status"] == "fail" and "1 of 8 decoder layers" in rec["summary"] and "layers 3)" in rec["summary"]
    assert "model.layers.3.input_layernorm.weight" in rec["summary"]
    assert sorted(rec["detail"]["incomplete"]["3"]) == sorted(dropped)
    assert "re-download" in rec["fix"]
    assert {n for n in res.failed()} == {"checkpoint.layers"}  # the files, headers and index agree


def test_a_layer_missing_one_module_fails_naming_its_tensors(hostenv_python, tiny_models, tmp_path):
    model = tmp_path / "ds"
    shutil.copytree(tiny_models["deepseek_v3"], model)  # dense layer 0, MoE layers after it: both kinds
    dropped = _drop_everywhere(model, lambda name: name.startswith("model.layers.5.self_attn.kv_b_proj.")
                               or name.startswith("model.layers.6.mlp.experts.1."))
    res = host_preflight(hostenv_python, base_params(model, tmp_path, env=dict(CPU_ENV)))
    rec = res["checkpoint.layers"]
    assert rec["status"] == "fail" and "2 of 8 decoder layers" in rec["summary"], rec["summary"]
    assert rec["detail"]["incomplete"]["5"] == ["model.layers.5.self_attn.kv_b_proj.weight"]
    assert sorted(rec["detail"]["incomplete"]["6"]) == sorted(n for n in dropped if ".layers.6." in n)


@pytest.mark.parametrize("model", ["llama", "deepseek_v3", "kimi_k25"])
def test_whole_checkpoints_pass_the_layer_check(hostenv_python, tiny_models, tmp_path, model):
    res = host_preflight(hostenv_python, base_params(Path(tiny_models[model]), tmp_path,
                                                    trust_remote_code=model == "kimi_k25"))
    rec = res["checkpoint.layers"]
    assert rec["status"] == "ok" and "all 8 decoder layers" in rec["summary"], rec
    assert rec["detail"]["prefix"] == ("language_model.model.layers" if model == "kimi_k25" else "model.layers")


def test_a_layer_left_unquantized_or_past_the_count_is_no_gap(hostenv_python, llama_copy, tmp_path):
    """Scales on every layer but 0 (an ignore list) and an extra layer 8 (an MTP head) are fine."""
    shard = _shards(llama_copy)[0]
    scales = {f"model.layers.{i}.self_attn.q_proj.weight_scale": ("F32", [1], b"\0\0\x80?") for i in range(1, 8)}
    scales["model.layers.8.eh_proj.weight"] = ("F32", [1], b"\0\0\x80?")
    rewrite_shard(shard, lambda name: True, add=scales)
    _edit_json(llama_copy / "model.safetensors.index.json",
               lambda index: index["weight_map"].update({k: shard.name for k in scales}))
    rec = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))["checkpoint.layers"]
    assert rec["status"] == "ok", rec


# -- model config -----------------------------------------------------------------------------

def test_text_config_wrapped_model_is_unwrapped_and_reported(hostenv_python, tiny_models, tmp_path):
    kimi = tmp_path / "kimi_k25"
    shutil.copytree(tiny_models["kimi_k25"], kimi)
    res = host_preflight(hostenv_python, base_params(kimi, tmp_path, tp=1))
    rec = res["model.config"]
    assert rec["status"] == "ok"
    assert rec["detail"]["wrapped_in_text_config"] is True
    assert rec["detail"]["model_type"] == "kimi_k25" and rec["detail"]["text_model_type"] == "deepseek_v3"
    assert "unwrapped from text_config" in rec["summary"]
    wrapped = json.loads((kimi / "config.json").read_text())["text_config"]
    assert rec["detail"]["num_layers"] == wrapped["num_hidden_layers"]
    assert rec["detail"]["hidden_size"] == wrapped["hidden_size"]
    assert res["model.family"]["detail"]["family"] == "deepseek_v2"
    assert "llama_4_scaling" in res["model.family"]["detail"]["calling_convention"]
    # everything that reads the unwrapped numbers works from them
    assert res["layers.ids"]["status"] == "ok" and res["parallel.heads"]["status"] == "ok"
    assert res["capacity.output"]["detail"]["hidden_size"] == wrapped["hidden_size"]


def test_llama_4_scaling_and_mla_reported(hostenv_python, tiny_models, tmp_path):
    res = host_preflight(hostenv_python, base_params(tiny_models["deepseek_v3"], tmp_path, env={}))
    assert res["model.llama_4_scaling"]["detail"]["set"] is True
    assert res["model.family"]["detail"]["family"] == "deepseek_v2"
    # CPU engine without VLLM_MLA_DISABLE: vLLM says "MLA is not supported on CPU"
    assert res["model.cpu_attention"]["status"] == "fail"
    assert "VLLM_MLA_DISABLE=1" in res["model.cpu_attention"]["fix"]
    assert res["host.cpu_kvcache"]["status"] == "warn"


def _make_remote_code_model(model_dir: Path, with_code: bool) -> None:
    """Turn the tiny Llama into a model_type transformers does not know, served by remote code."""
    def edit(cfg):
        cfg["model_type"] = "specops_tiny"
        cfg["auto_map"] = {"AutoConfig": "configuration_specops_tiny.SpecopsTinyConfig"}
    _edit_json(model_dir / "config.json", edit)
    if with_code:
        (model_dir / "configuration_specops_tiny.py").write_text(
            "from transformers import LlamaConfig\n\n\n"
            "class SpecopsTinyConfig(LlamaConfig):\n"
            "    model_type = 'specops_tiny'\n")


def test_remote_code_model_type_without_code_fails(hostenv_python, llama_copy, tmp_path):
    _make_remote_code_model(llama_copy, with_code=False)
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, skip_autoconfig=False,
                                                    trust_remote_code=True),
                        env={"HF_MODULES_CACHE": str(tmp_path / "hf_modules")})
    rec = res["model.remote_code"]
    assert rec["status"] == "fail"
    assert rec["detail"]["transformers_knows"] is False
    assert rec["detail"]["files"] == {"configuration_specops_tiny.py": False}
    assert "configuration_specops_tiny.py" in rec["summary"] and "download" in rec["fix"]
    auto = res["model.autoconfig"]
    assert auto["status"] == "fail" and auto["detail"]["error"]  # the real AutoConfig, failing, not crashing
    assert auto["detail"]["seconds"] >= 0


def test_remote_code_present_but_not_allowed_fails_then_allowed_passes(hostenv_python, llama_copy, tmp_path):
    _make_remote_code_model(llama_copy, with_code=True)
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, skip_autoconfig=False), env=env)
    assert res["model.remote_code"]["status"] == "fail"
    assert "trust_remote_code" in res["model.remote_code"]["fix"]
    assert res["model.autoconfig"]["status"] == "fail"
    assert "trust_remote_code" in res["model.autoconfig"]["fix"]

    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, skip_autoconfig=False,
                                                    trust_remote_code=True), env=env)
    assert res["model.remote_code"]["status"] == "ok"
    assert res["model.autoconfig"]["status"] == "ok"
    assert res["model.autoconfig"]["detail"]["class"] == "SpecopsTinyConfig"


def test_seq_len_beyond_max_positions_fails(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, seq_len=4096))
    assert res["model.seq_len"]["status"] == "fail"
    assert "2048" in res["model.seq_len"]["fix"]


def test_missing_config_fails_and_dependent_checks_skip(hostenv_python, llama_copy, tmp_path):
    (llama_copy / "config.json").unlink()
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    assert res["model.config"]["status"] == "fail"
    assert res["layers.ids"]["status"] == "skipped" and res["parallel.heads"]["status"] == "skipped"


# -- parallelism and layers -------------------------------------------------------------------

def test_tp_that_does_not_divide_heads_fails(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, tp=3))
    rec = res["parallel.heads"]
    assert rec["status"] == "fail"
    assert "4 attention heads do not divide by TP 3" in rec["summary"]
    assert rec["detail"]["valid_tp"] == [1, 2, 4]


def test_more_tp_than_cpu_cores_fails(hostenv_python, llama_copy, tmp_path):
    cores = len(os.sched_getaffinity(0))
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, tp=cores * 2))
    rec = res["parallel.devices"]
    assert rec["status"] == "fail" and f"at most {cores}" in rec["fix"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has a GPU")
def test_cuda_without_gpus_fails(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, device="cuda", tp=2))
    assert res["host.gpus"]["status"] == "fail" and "nvidia-smi" in res["host.gpus"]["summary"]
    assert res["parallel.devices"]["status"] == "fail"
    assert "TP 2 needs 2 GPUs, 0 usable" in res["parallel.devices"]["summary"]
    # the test host's vLLM is the CPU build: wrong for device=cuda
    assert res["packages.vllm"]["status"] == "fail" and "CPU build" in res["packages.vllm"]["summary"]


@pytest.mark.parametrize("ids,why", [([2, 4, 8], "out of range 0..7"), ([2, 4, 4, 7], "duplicate layer ids"),
                                     ([2, "4", 7], "not an integer")])
def test_bad_layer_ids_fail(hostenv_python, llama_copy, tmp_path, ids, why):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, layer_ids=ids))
    rec = res["layers.ids"]
    assert rec["status"] == "fail" and why in rec["summary"]
    assert rec["detail"]["source"] == "given" and rec["detail"]["convention"] == "output"


@pytest.mark.parametrize("num_layers,engine,ids", [(6, None, [2, 3, 4, 5]), (5, None, [1, 2, 3, 4]),
                                                   (6, "vllm-server", [2, 3, 4, 6]),
                                                   (5, "vllm-server", [2, 3, 4, 5])])
def test_engine_default_ids_of_a_shallow_model_are_distinct_and_pass(hostenv_python, llama_copy, tmp_path,
                                                                     num_layers, engine, ids):
    """The EAGLE-3 rule collides below 7 layers (6: [2, 3, 3, 5] output, [2, 3, 3, 6] input), and preflight
    used to refuse its own default: the default moves a taken id to the nearest free one instead."""
    _edit_json(llama_copy / "config.json", lambda cfg: cfg.update(num_hidden_layers=num_layers))
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, **({"engine": engine} if engine else {})))
    rec = res["layers.ids"]
    assert rec["status"] == "ok" and rec["detail"]["layer_ids"] == ids, rec
    assert rec["detail"]["source"] == "engine default"


# -- tokenizer and data -----------------------------------------------------------------------

def test_tokenizer_without_chat_template_fails(hostenv_python, llama_copy, tmp_path):
    _edit_json(llama_copy / "tokenizer_config.json", lambda cfg: cfg.pop("chat_template", None))
    for name in ("chat_template.jinja", "chat_template.json"):
        (llama_copy / name).unlink(missing_ok=True)
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    rec = res["tokenizer.chat_template"]
    assert rec["status"] == "fail" and "chat template" in rec["summary"]
    assert "chat_template" in rec["fix"]


def test_missing_tokenizer_files_fail(hostenv_python, llama_copy, tmp_path):
    (llama_copy / "tokenizer.json").unlink()
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path))
    assert res["tokenizer.files"]["status"] == "fail"


def test_dataset_with_bad_records_fails_with_line_numbers(hostenv_python, llama_copy, tiny_models, tmp_path):
    good = Path(tiny_models["dataset"]).read_text().splitlines()[0]
    lines = [
        good,                                                           # 1 ok
        '{"conversations": [{"role": "user", "content": "hi"}',         # 2 broken JSON
        '{"messages": [{"role": "user", "content": "hi"}]}',            # 3 ok: the run reads 'messages' too
        '{"conversations": [{"role": "user"}]}',                        # 4 turn without content
        "",                                                             # blank lines are skipped
        '["not", "an", "object"]',                                      # 6 not an object
        good,                                                           # 7 ok
    ]
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, dataset=str(dataset)))
    rec = res["data.records"]
    assert rec["status"] == "fail"
    assert [b["line"] for b in rec["detail"]["bad"]] == [2, 4, 6]
    problems = {b["line"]: b["problem"] for b in rec["detail"]["bad"]}
    assert "not JSON" in problems[2] and "content is missing" in problems[4] and "a list of 3" in problems[6]
    assert "lines 2, 4, 6" in rec["summary"] and "all 6 rows" in rec["summary"]
    assert res["data.file"]["status"] == "ok" and res["data.file"]["detail"]["records"] == 6


def test_dataset_roles_from_value_format_pass_and_unknown_roles_fail_as_in_the_run(hostenv_python, llama_copy,
                                                                                    tmp_path):
    """The run refuses a role it cannot map (tokenizing it would guess): preflight says so first."""
    dataset = tmp_path / "sharegpt.jsonl"
    dataset.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}) + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "tool", "value": "b"}]}) + "\n")
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, dataset=str(dataset)))
    rec = res["data.records"]
    assert rec["status"] == "fail" and [d["line"] for d in rec["detail"]["bad"]] == [2]
    assert "'tool'" in rec["summary"] and "user/assistant/system" in rec["fix"]
    dataset.write_text(dataset.read_text().splitlines()[0] + "\n"
                       + json.dumps({"conversations": [{"from": "human", "value": "a"}]}) + "\n")
    rec = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, dataset=str(dataset)))["data.records"]
    assert rec["status"] == "warn" and [d["line"] for d in rec["detail"]["degraded"]] == [2]
    assert "no assistant turn" in rec["summary"]


def test_missing_dataset_file_fails(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, dataset=str(tmp_path / "nope.jsonl")))
    assert res["data.file"]["status"] == "fail" and "does not exist" in res["data.file"]["summary"]


# -- capacity ---------------------------------------------------------------------------------

def test_output_larger_than_free_disk_fails(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, max_samples=10 ** 9, seq_len=2048))
    rec = res["capacity.output"]
    assert rec["status"] == "fail"
    assert rec["detail"]["bytes"] > rec["detail"]["free_bytes"]
    # samples x seq_len x hidden x layers x dtype bytes, plus the int64 ids and loss mask
    assert rec["detail"]["bytes"] >= 10 ** 9 * 2048 * (256 * 4 * 2 + 16)


def test_capacity_counts_no_more_samples_than_the_dataset_has(hostenv_python, llama_copy, tiny_models, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, max_samples=10 ** 9,
                                                    dataset=str(tiny_models["dataset"])))
    rec = res["capacity.output"]
    assert rec["status"] == "ok" and rec["detail"]["samples"] == res["data.file"]["detail"]["records"]


# -- params, composition ----------------------------------------------------------------------

def test_bad_params_are_a_fail_not_a_crash(hostenv_python, llama_copy, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, tp="two", device="tpu"))
    rec = res["params.values"]
    assert rec["status"] == "fail" and len(rec["detail"]["problems"]) == 2
    assert res["parallel.heads"]["detail"]["tp"] == 1  # the checks go on with the default


def test_a_crashing_drift_check_is_one_fail_record(hostenv_python, llama_copy, tmp_path):
    """A damaged vLLM (its model registry no longer parses) crashes the drift check: preflight
    reports that as ``drift.crash`` with the traceback, and every other check still reports."""
    models = tmp_path / "vllm-copy" / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    for package in (models.parents[1], models.parent, models):
        (package / "__init__.py").write_text("")
    (models / "registry.py").write_text("_TEXT_GENERATION_MODELS = {\n")  # truncated mid-file
    params = base_params(llama_copy, tmp_path, skip_drift=False, skip_patch=True,
                         site_packages=str(tmp_path / "vllm-copy"))
    res = host_preflight(hostenv_python, params)
    crash = res["drift.crash"]
    assert crash["status"] == "fail" and "SyntaxError" in crash["summary"], crash
    assert "registry.py" in crash["detail"]["traceback"] and crash["fix"]
    assert res["model.config"]["status"] == "ok" and res["checkpoint.headers"]["status"] == "ok"


# -- nvidia-smi, parsed from output recorded on a real H200 -----------------------------------

def _devices():
    sys.path.insert(0, str(REPO))
    from remote.system import devices
    return devices


def test_nvidia_smi_gpu_fixtures_parse():
    devices = _devices()
    idle = devices.parse_gpus((FIXTURES / "gpus_idle.csv").read_text())
    busy = devices.parse_gpus((FIXTURES / "gpus_busy.csv").read_text())
    assert len(idle) == 1 and idle[0]["name"] == "NVIDIA H200" and idle[0]["index"] == 0
    assert idle[0]["uuid"].startswith("GPU-") and idle[0]["driver"] == "580.159.04"
    assert idle[0]["memory_total_mib"] == 143771 and idle[0]["memory_used_mib"] == 0
    assert busy[0]["memory_used_mib"] > 4096 and busy[0]["memory_free_mib"] < idle[0]["memory_free_mib"]


def test_nvidia_smi_apps_fixtures_parse_and_flag_busy_gpus():
    devices = _devices()
    gpus = devices.parse_gpus((FIXTURES / "gpus_busy.csv").read_text())
    assert devices.parse_apps((FIXTURES / "apps_idle.csv").read_text()) == []
    apps = devices.parse_apps((FIXTURES / "apps_busy.csv").read_text())
    assert len(apps) == 1 and apps[0]["gpu_uuid"] == gpus[0]["uuid"] and apps[0]["used_memory_mib"] > 4000
    from remote.probes import host
    busy = host.summarize_gpu_use(gpus, apps)
    assert busy[0]["index"] == 0 and busy[0]["processes"][0]["pid"] == apps[0]["pid"]
    idle_gpus = devices.parse_gpus((FIXTURES / "gpus_idle.csv").read_text())
    assert host.summarize_gpu_use(idle_gpus, []) == []
    # memory held by a process this PID namespace cannot see is still flagged
    assert host.summarize_gpu_use(gpus, [])[0]["processes"] == []


def test_nvidia_smi_odd_cells_and_visible_devices():
    devices = _devices()
    text = ("0, GPU-aaaa, 550.54.15, 81559, [N/A], 81000, [Not Supported], NVIDIA A100-SXM4-80GB\n"
            "1, GPU-bbbb, 550.54.15, 81559, 10, 81000, 0, NVIDIA A100-SXM4-80GB\n")
    gpus = devices.parse_gpus(text)
    assert gpus[0]["memory_used_mib"] is None and gpus[0]["utilization_pct"] is None
    assert [g["index"] for g in devices.visible_gpus(gpus, "1")] == [1]
    assert [g["index"] for g in devices.visible_gpus(gpus, "GPU-bbbb,0")] == [1, 0]
    assert devices.visible_gpus(gpus, "") == []
    with pytest.raises(ValueError):
        devices.parse_gpus("0, GPU-aaaa\n")


def test_host_probe_ran_on_the_real_gpu_host():
    """The host probe's own output on the H200 (record.sh): the GPU found, the holder flagged."""
    recorded = json.loads((FIXTURES / "host_probe_busy.json").read_text())
    by_name = {r["name"]: r for r in recorded["records"]}
    assert by_name["host.gpus"]["status"] == "ok" and "NVIDIA H200" in by_name["host.gpus"]["summary"]
    assert by_name["host.gpu_processes"]["status"] == "warn"
    assert recorded["host"]["gpus"] == _devices().parse_gpus((FIXTURES / "gpus_busy.csv").read_text())


def test_cuda_host_end_to_end_on_recorded_nvidia_smi(hostenv_python, llama_copy, tmp_path):
    """device=cuda through the whole preflight, nvidia-smi replaying the H200's recorded answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=*) cat "{FIXTURES / 'gpus_busy.csv'}" ;;
  --query-compute-apps=*) cat "{FIXTURES / 'apps_busy.csv'}" ;;
  *) exit 9 ;;
esac
""")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, device="cuda", tp=1, env={}), env=env)
    assert res["host.gpus"]["status"] == "ok" and res["host.gpus"]["detail"]["visible"] == [0]
    assert res["host.gpu_processes"]["status"] == "warn"
    assert res["parallel.devices"]["status"] == "ok"
    # 138534 MiB free < 0.99 x 143771 MiB asked: vLLM would refuse to start
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, device="cuda", tp=2,
                                                    gpu_memory_utilization=0.99, env={}), env=env)
    assert res["checkpoint.fit"]["status"] == "fail" and "gpu_memory_utilization" in res["checkpoint.fit"]["fix"]
    assert res["parallel.devices"]["status"] == "fail" and "TP 2 needs 2 GPUs, 1 usable" in \
        res["parallel.devices"]["summary"]


HANGS = "test_autoconfig_that_hangs_times_out_as_a_fail"


@pytest.fixture(scope="module", autouse=True)
def hanging_autoconfig(request, hostenv_python, tiny_models, tmp_path_factory):
    """The preflight of :func:`test_autoconfig_that_hangs_times_out_as_a_fail`, started before this
    module's first test in a process of its own: its AutoConfig child sleeps out the 30-s timeout
    while the other tests run, and the test collects it. None when that test is not selected."""
    if not any(item.name == HANGS and item.module is request.module for item in request.session.items):
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("hangs")
    llama_copy = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], llama_copy)
    _make_remote_code_model(llama_copy, with_code=True)
    with open(llama_copy / "configuration_specops_tiny.py", "a") as fh:
        fh.write("\nimport time\ntime.sleep(3600)\n")
    params = base_params(llama_copy, tmp_path, skip_autoconfig=False, trust_remote_code=True,
                         autoconfig_timeout=30, env=dict(CPU_ENV, HF_MODULES_CACHE=str(tmp_path / "hf_modules")))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(run_preflight, hostenv_python, params)


def test_autoconfig_that_hangs_times_out_as_a_fail(hanging_autoconfig):
    """Remote code that blocks (a network call, a huge import) costs the timeout, not the preflight."""
    res = hanging_autoconfig.result(timeout=300)
    rec = res["model.autoconfig"]
    assert rec["status"] == "fail" and "did not finish in 30 s" in rec["summary"]
    assert "autoconfig_timeout" in rec["fix"]
    assert 30 <= res.data["seconds"]["hf_child_wall"] < 60
    assert res["tokenizer.load"]["status"] == "skipped"
    assert res["checkpoint.headers"]["status"] == "ok"  # the static checks still ran and reported


def test_json_array_dataset_fails_at_line_1_with_the_jsonl_fix(hostenv_python, llama_copy, tmp_path):
    """The run reads JSON lines only; a JSON array file fails preflight as it would fail the run."""
    good = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    dataset = tmp_path / "chat.json"
    dataset.write_text(json.dumps([good, {"text": "no conversations"}, good], indent=1))
    res = host_preflight(hostenv_python, base_params(llama_copy, tmp_path, dataset=str(dataset)))
    rec = res["data.records"]
    assert rec["status"] == "fail" and rec["detail"]["bad"][0]["line"] == 1
    assert "one JSON array" in rec["fix"] and "json.dumps" in rec["fix"]
