"""A model's ``config.json``, read once: the language model's config, its layers, its family (stdlib only).

A multimodal wrapper (Kimi-K2.5: ``KimiK25ForConditionalGeneration``) keeps the
language model's config under ``text_config`` (DeepSeek-VL2 and others under
``language_config``); the engine drives that language model, so every question about
layers, heads or positions is asked of the *text config*, which for a plain model is
the file itself::

    >>> config = read("/models/kimi-k2.5")
    >>> is_wrapped(config), config["model_type"], model_type(config), num_layers(config)
    (True, 'kimi_k25', 'deepseek_v3', 61)
    >>> architectures(config)                 # the text model first: it runs the layers
    ['DeepseekV3ForCausalLM', 'KimiK25ForConditionalGeneration']

Every reader on the host asks this module, so a wrapper is unwrapped the same way
everywhere: preflight, the shard probe, the engines and the supervisor count the layers
with :func:`num_layers`, so preflight's default layer ids are the run's. :func:`read`
parses a file once per process (keyed by path, size and mtime) and hands each caller
its own copy.
"""
from __future__ import annotations

import copy
import json
import os

CONFIG_FILE = "config.json"
#: Keys that give the decoder-layer count, first non-null wins (HF, GPT-style, others).
LAYER_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
#: Where a multimodal wrapper keeps its language model's config, first object wins:
#: ``text_config`` (the Hugging Face name, Kimi-K2.5) or ``language_config`` (DeepSeek-VL2).
LANGUAGE_CONFIG_KEYS = ("text_config", "language_config")
#: A model family (``model_family`` param, or a config's ``model_type``) -> the
#: architecture in vLLM's model registry that runs it.
FAMILY_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}

_PARSED: dict = {}


class ConfigError(Exception):
    """``config.json`` is missing, unreadable, or not a JSON object.

    :ivar summary: one line naming the file and what is wrong.
    :ivar fix: what to do about it.
    :ivar path: the file.
    :ivar value: the parsed value when the file is valid JSON but not an object, else None.
    """

    def __init__(self, path, summary, fix, value=None):
        super().__init__(summary)
        self.path, self.summary, self.fix, self.value = str(path), summary, fix, value


def read(model_path) -> dict:
    """The parsed ``<model_path>/config.json`` (a fresh copy each call; the file is read once).

    :raises ConfigError: when the model dir or the file is missing, the file is not
        valid JSON, or it holds something other than an object.
    """
    model_path = str(model_path)
    path = os.path.join(model_path, CONFIG_FILE)
    if not os.path.isdir(model_path):
        raise ConfigError(path, f"model dir {model_path} does not exist",
                          "fix model_path in the inventory, or copy the model to the host")
    try:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in _PARSED:
            with open(path, encoding="utf-8") as fh:
                _PARSED[key] = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, f"{path} is missing",
                          "the model dir must hold the HF config.json; re-download it") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(path, f"{path} is unreadable: {exc}", "re-download config.json") from None
    config = _PARSED[key]
    if not isinstance(config, dict):
        raise ConfigError(path, f"{path} holds a JSON {type(config).__name__}, expected an object",
                          "re-download config.json", value=config)
    return copy.deepcopy(config)


def wrapper_key(config: dict):
    """The key of :data:`LANGUAGE_CONFIG_KEYS` that holds the language model's config, or None (a plain model)."""
    return next((key for key in LANGUAGE_CONFIG_KEYS if isinstance(config.get(key), dict)), None)


def is_wrapped(config: dict) -> bool:
    """Whether the language model's config sits under a key of its own (a multimodal wrapper)."""
    return wrapper_key(config) is not None


def text_config(config: dict) -> dict:
    """The language model's config: ``config[wrapper_key(config)]`` for a wrapper, else ``config`` itself."""
    key = wrapper_key(config)
    return config[key] if key else config


def text_value(config: dict, key: str):
    """``key`` from the text config, else from the wrapper around it; None when neither sets it."""
    value = text_config(config).get(key)
    return value if value is not None else config.get(key)


def num_layers(config: dict):
    """The decoder-layer count of the language model (the first of :data:`LAYER_KEYS` set), or None.

    The one rule: a wrapper's own count (the whole model's) never stands in for its
    language model's::

        >>> num_layers({"num_hidden_layers": 2})
        2
        >>> num_layers({"language_config": {"num_hidden_layers": 30}, "num_hidden_layers": 2})
        30
    """
    text = text_config(config)
    for key in LAYER_KEYS:
        if text.get(key) is not None:
            return text[key]
    return None


def architectures(config: dict) -> list:
    """Architecture names to look up in vLLM's registry: the text model's, then the wrapper's."""
    text = text_config(config)
    names = []
    for holder in ((text, config) if text is not config else (config,)):
        value = holder.get("architectures")
        if isinstance(value, list):
            names += [a for a in value if isinstance(a, str)]
    return list(dict.fromkeys(names))


def model_type(config: dict):
    """The language model's ``model_type`` (``deepseek_v3`` inside Kimi-K2.5's wrapper), or None."""
    value = text_config(config).get("model_type")
    return value if isinstance(value, str) else None


def family_architecture(family):
    """The vLLM architecture a family name (or ``model_type``) runs as, or None when unknown."""
    return FAMILY_ARCHITECTURE.get(str(family or "").lower())


def decoder_layers(config: dict) -> int:
    """:func:`num_layers` for a run, which cannot go on without one: never None.

    :raises ValueError: when the language model's config names no layer count, or one
        that is not a positive integer.
    """
    count = num_layers(config)
    if type(count) is not int or count < 1:
        where = f"{wrapper_key(config)}." if is_wrapped(config) else ""
        raise ValueError(f"config.json: {where}num_hidden_layers is {count!r}, not a positive integer "
                         f"(the language model's decoder-layer count)")
    return count


#: The keys a run's summary copies from config.json (and from its language model's config).
SUMMARY_KEYS = ("model_type", "architectures", "num_hidden_layers", "hidden_size", "vocab_size",
                "torch_dtype", "dtype", "num_attention_heads", "num_key_value_heads")


def summary(config: dict) -> dict:
    """The few config keys a run's summary keeps: the file's own, its text config's, and the
    quantization method (``{"quant_method": "fp8"}``) when the model is quantized."""
    out = {k: config[k] for k in SUMMARY_KEYS if k in config}
    if is_wrapped(config):
        text = text_config(config)
        out[wrapper_key(config)] = {k: text[k] for k in SUMMARY_KEYS if k in text}
    if isinstance(config.get("quantization_config"), dict):
        out["quant_method"] = config["quantization_config"].get("quant_method")
    return out
