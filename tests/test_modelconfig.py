"""remote/system/modelconfig.py: config.json read once, the text config unwrapped the same way everywhere.

Runs the stdlib-only module in the controller's python on the real tiny models (a plain
Llama, and a Kimi-K2.5-style wrapper whose language model is DeepSeek-V3) and on broken
copies of their config.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.system import modelconfig  # noqa: E402


def test_wrapper_and_plain_model(tiny_models):
    kimi = modelconfig.read(tiny_models["kimi_k25"])
    assert modelconfig.is_wrapped(kimi) and kimi["model_type"] == "kimi_k25"
    assert modelconfig.model_type(kimi) == "deepseek_v3"
    assert modelconfig.num_layers(kimi) == kimi["text_config"]["num_hidden_layers"]
    assert modelconfig.architectures(kimi) == ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]
    llama = modelconfig.read(tiny_models["llama"])
    assert not modelconfig.is_wrapped(llama) and modelconfig.text_config(llama) is llama
    assert modelconfig.num_layers(llama) == llama["num_hidden_layers"]
    assert modelconfig.family_architecture(modelconfig.model_type(llama)) == "LlamaForCausalLM"


def test_read_once_but_every_caller_gets_its_own_copy(tiny_models, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], model)
    first = modelconfig.read(model)
    first["num_hidden_layers"] = -1  # a caller editing its copy (a twin builder does)
    assert modelconfig.read(model)["num_hidden_layers"] != -1
    edited = dict(first, num_hidden_layers=3)
    (model / "config.json").write_text(json.dumps(edited))
    os.utime(model / "config.json", ns=(1, 1))  # a new file: another key, read again
    assert modelconfig.read(model)["num_hidden_layers"] == 3


def test_text_value_prefers_the_language_model():
    config = {"max_position_embeddings": 8, "text_config": {"max_position_embeddings": 4096, "model_type": "x"}}
    assert modelconfig.text_value(config, "max_position_embeddings") == 4096
    assert modelconfig.text_value({"text_config": {}, "llama_4_scaling": {"beta": 1}}, "llama_4_scaling")
    assert modelconfig.text_value({"text_config": "not-an-object", "k": 1}, "k") == 1


@pytest.mark.parametrize("case, content, says", [
    ("no-dir", None, "model dir"),
    ("no-file", "", "is missing"),
    ("not-json", "{", "is unreadable"),
    ("a-list", "[1]", "expected an object"),
])
def test_unreadable_config_is_one_error_with_a_fix(tmp_path, case, content, says):
    model = tmp_path / "model"
    if content is not None:
        model.mkdir()
        if content:
            (model / "config.json").write_text(content)
    with pytest.raises(modelconfig.ConfigError) as refused:
        modelconfig.read(model)
    assert says in refused.value.summary and refused.value.fix
    assert (refused.value.value == [1]) == (case == "a-list")


#: a DeepSeek-VL2-style wrapper: the language model under ``language_config``, and a layer
#: count of the wrapper's own that is not the language model's
VL2_CONFIG = {
    "model_type": "deepseek_vl_v2", "architectures": ["DeepseekVLV2ForCausalLM"], "num_hidden_layers": 12,
    "language_config": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                        "num_hidden_layers": 30, "hidden_size": 64, "num_attention_heads": 4,
                        "vocab_size": 512},
}


@pytest.mark.parametrize("engine", ["speculators-0.3", "vllm-server"])
def test_preflight_default_ids_are_the_runs_for_a_language_config_wrapper(tmp_path, engine):
    """Preflight (model probe -> layers probe) and the run (the shard probe's and the supervisor's
    rule) count the language model's 30 layers, never the wrapper's 12."""
    from remote.wire import layers
    from remote.extract import runplan, shard
    from remote.probes import Context, layer_ids, model as model_probe

    model = tmp_path / "vl2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(VL2_CONFIG))
    config = modelconfig.read(model)
    params = {"model_path": str(model), "engine": engine, "layer_ids": None, "layer_convention": None}

    ctx = Context(params)
    ctx.model, problems = model_probe.summarize(config)
    assert problems == [] and ctx.model["config_keys"]["num_layers"] == "language_config.num_hidden_layers"
    (preflight,) = layer_ids.probe(ctx)
    assert preflight["status"] == "ok", preflight

    run = shard._stack(params, {})
    assert run["status"] == "ok", run
    expected, _ = layers.default_layer_ids(engine, 30)
    assert ctx.layers["ids"] == run["detail"]["layer_ids"] == runplan.resolve(params, config).layer_ids \
        == expected
    assert modelconfig.num_layers(config) == modelconfig.decoder_layers(config) == 30
    assert modelconfig.summary(config)["language_config"]["num_hidden_layers"] == 30


def test_run_refuses_a_config_without_a_layer_count():
    """The run's accessor never answers None: it names the key it looked for."""
    for config in ({"hidden_size": 8}, {"language_config": {"num_hidden_layers": "8"}}):
        with pytest.raises(ValueError, match="num_hidden_layers"):
            modelconfig.decoder_layers(config)


def test_a_language_config_wrapper_is_shrunk_inside_and_stays_a_wrapper():
    """DeepSeek-VL2 keeps its language model under ``language_config``: the twin builder
    shrinks that model as it shrinks a ``text_config`` one, and names its weights as vLLM loads them."""
    from remote.extract import tinymodel

    real = {"model_type": "deepseek_vl_v2", "architectures": ["DeepseekVLV2ForCausalLM"], "num_hidden_layers": 12,
            "language_config": {"model_type": "deepseek_v2", "hidden_size": 2560, "num_hidden_layers": 30,
                                "num_attention_heads": 20, "num_key_value_heads": 20, "vocab_size": 129280,
                                "intermediate_size": 6848}}
    tiny = tinymodel.shrink_config(real)
    assert tiny["model_type"] == "deepseek_vl_v2" and "text_config" not in tiny
    assert tiny["language_config"]["num_hidden_layers"] == tinymodel.MIN_LAYERS
    assert tiny["language_config"]["hidden_size"] < real["language_config"]["hidden_size"]
    assert modelconfig.num_layers(tiny) == tinymodel.MIN_LAYERS
    assert tinymodel.WRAPPED_WEIGHT_PREFIX[modelconfig.wrapper_key(tiny)] == "language."
