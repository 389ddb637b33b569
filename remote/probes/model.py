"""Model probe: config.json read directly (no transformers), unwrapped, classified.

A multimodal wrapper such as Kimi-K2.5 keeps the language model under ``text_config``;
everything the engine needs (layers, hidden size, heads) is read from there, and the
record says it was wrapped. The *family* decides how a patched worker must call each
decoder layer:

``deepseek_v2``  vLLM's ``DeepseekV2DecoderLayer`` (DeepSeek-V2/V3, Kimi-K2):
                 ``layer(positions, hidden_states, residual, llama_4_scaling)``
``llama``        vLLM's Llama-style layers: ``layer(positions, hidden_states, residual)``

Whether transformers can build the config at all (a model_type it does not know needs
remote code, from ``auto_map`` files beside config.json) is first decided statically
here, by reading transformers' own auto-config table as text, and then confirmed for
real by :mod:`remote.probes.hf_load` in a subprocess.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re

from remote.protocol import FAIL, OK, WARN, record
from remote.probes import Context

DEEPSEEK_V2 = "deepseek_v2"
LLAMA = "llama"
FAMILY_TYPES = {
    DEEPSEEK_V2: {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"},
    LLAMA: {"llama", "mistral", "qwen2", "qwen3"},
}
FAMILY_ARCHS = {
    DEEPSEEK_V2: ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
    LLAMA: ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
}
CALLING_CONVENTION = {
    DEEPSEEK_V2: "layer(positions, hidden_states, residual, llama_4_scaling)",
    LLAMA: "layer(positions, hidden_states, residual)",
}
#: Head sizes vLLM 0.16's CPU attention backend accepts (cpu_attn.get_supported_head_sizes).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def _first(cfg: dict, *keys):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def read_config(model_path: str):
    """``(config dict, None)`` or ``(None, (summary, fix))`` for a missing/unreadable config.json."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path):
        return None, (f"model dir {model_path} does not exist",
                      "fix model_path in the inventory, or copy the model to the host")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        return None, (f"{path} is missing", "the model dir must hold the HF config.json; re-download it")
    except (OSError, ValueError) as exc:
        return None, (f"{path} is unreadable: {exc}", "re-download config.json")
    if not isinstance(cfg, dict):
        return None, (f"{path} is not a JSON object", "re-download config.json")
    return cfg, None


def family_of(text_cfg: dict, top_cfg: dict) -> str | None:
    """``deepseek_v2`` / ``llama`` / None, by model_type, then architectures, then routing keys."""
    types = {text_cfg.get("model_type"), top_cfg.get("model_type")}
    archs = set(text_cfg.get("architectures") or []) | set(top_cfg.get("architectures") or [])
    for family in (DEEPSEEK_V2, LLAMA):
        if types & FAMILY_TYPES[family] or archs & set(FAMILY_ARCHS[family]):
            return family
    if "scoring_func" in text_cfg and "kv_lora_rank" in text_cfg:
        return DEEPSEEK_V2
    return None


def summarize(cfg: dict) -> dict:
    """The facts an extraction run depends on, from the (possibly wrapped) config."""
    wrapped = isinstance(cfg.get("text_config"), dict)
    text = cfg["text_config"] if wrapped else cfg
    heads = _first(text, "num_attention_heads", "n_head", "n_heads")
    hidden = _first(text, "hidden_size", "d_model", "n_embd")
    head_dim = _first(text, "head_dim")
    if head_dim is None and heads and hidden:
        head_dim = hidden // heads
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    family = family_of(text, cfg)
    return {
        "model_type": cfg.get("model_type"),
        "text_model_type": text.get("model_type"),
        "wrapped_in_text_config": wrapped,
        "architectures": cfg.get("architectures") or text.get("architectures") or [],
        "family": family,
        "calling_convention": CALLING_CONVENTION.get(family),
        "num_layers": _first(text, "num_hidden_layers", "n_layers", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": _first(text, "num_key_value_heads", "num_kv_heads") or heads,
        "head_dim": head_dim,
        "mla": "kv_lora_rank" in text and text.get("kv_lora_rank") is not None,
        "num_experts": _first(text, "n_routed_experts", "num_local_experts", "num_experts",
                              "moe_num_experts"),
        "experts_per_token": _first(text, "num_experts_per_tok", "moe_top_k"),
        "llama_4_scaling": _first(text, "llama_4_scaling") or cfg.get("llama_4_scaling"),
        "max_position_embeddings": _first(text, "max_position_embeddings", "n_positions"),
        "rope_scaling": text.get("rope_scaling"),
        "vocab_size": _first(text, "vocab_size"),
        "dtype": _first(text, "torch_dtype", "dtype") or cfg.get("torch_dtype"),
        "quantization": quant.get("quant_method") if isinstance(quant, dict) else None,
        "auto_map": cfg.get("auto_map") or {},
    }


def probe(ctx: Context) -> list:
    """Read and check config.json; leaves the summary in ``ctx.model`` (empty on failure)."""
    cfg, problem = read_config(ctx.params["model_path"])
    if cfg is None:
        return [record("model.config", FAIL, problem[0], detail={"model_path": ctx.params["model_path"]},
                       fix=problem[1])]
    ctx.model = summary = summarize(cfg)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not summary[k]]
    where = "text_config" if summary["wrapped_in_text_config"] else "config.json"
    if missing:
        return [record("model.config", FAIL, f"{where} lacks {', '.join(missing)}", detail=summary,
                       fix="the model dir must hold the language model's HF config; re-download config.json")]
    wrap = (f"{summary['text_model_type']} unwrapped from text_config of {summary['model_type']}"
            if summary["wrapped_in_text_config"] else str(summary["model_type"]))
    experts = f", {summary['num_experts']} experts" if summary["num_experts"] else ""
    records = [record(
        "model.config", OK,
        f"{wrap}: {summary['num_layers']} layers, hidden {summary['hidden_size']}, "
        f"{summary['num_attention_heads']} heads / {summary['num_key_value_heads']} kv heads{experts}",
        detail=summary)]
    records.append(_family(summary))
    records.append(_llama_4_scaling(summary))
    records.append(_seq_len(ctx, summary))
    if ctx.params["device"] == "cpu":
        records.append(_cpu_attention(ctx, summary))
    records.append(remote_code_record(ctx, summary))
    return records


def _family(summary):
    family = summary["family"]
    detail = {"family": family, "calling_convention": summary["calling_convention"],
              "model_type": summary["text_model_type"], "architectures": summary["architectures"]}
    if family is None:
        return record("model.family", WARN,
                      f"{summary['text_model_type']} is neither DeepseekV2-family nor Llama-like: the "
                      f"patched worker's layer calls are unproven for it", detail=detail,
                      fix="run `fab smoke` on a tiny twin first to prove the extraction path")
    name = "DeepseekV2 family" if family == DEEPSEEK_V2 else "Llama-like"
    return record("model.family", OK, f"{name}: {summary['calling_convention']}", detail=detail)


def _llama_4_scaling(summary):
    scaling = summary["llama_4_scaling"]
    if not scaling:
        return record("model.llama_4_scaling", OK, "llama_4_scaling not set", detail={"set": False})
    detail = {"set": True, "value": scaling}
    if summary["family"] != DEEPSEEK_V2:
        return record("model.llama_4_scaling", WARN,
                      "llama_4_scaling set on a model outside the DeepseekV2 family: check vLLM uses it",
                      detail=detail)
    return record("model.llama_4_scaling", OK,
                  f"llama_4_scaling set {scaling}: every decoder layer call must pass it (dropping it "
                  f"is silent)", detail=detail)


def _seq_len(ctx, summary):
    seq_len, max_pos = ctx.params["seq_len"], summary["max_position_embeddings"]
    detail = {"seq_len": seq_len, "max_position_embeddings": max_pos, "rope_scaling": summary["rope_scaling"]}
    if not max_pos:
        return record("model.seq_len", WARN, "config has no max_position_embeddings; seq_len unchecked",
                      detail=detail)
    if seq_len > max_pos:
        return record("model.seq_len", FAIL, f"seq_len {seq_len} exceeds max_position_embeddings {max_pos}",
                      detail=detail, fix=f"set seq_len to at most {max_pos}")
    return record("model.seq_len", OK, f"seq_len {seq_len} <= max_position_embeddings {max_pos}",
                  detail=detail)


def _cpu_attention(ctx, summary):
    """vLLM's CPU build: no MLA (needs VLLM_MLA_DISABLE=1) and a fixed list of head sizes."""
    if summary["mla"]:
        flag = ctx.env("VLLM_MLA_DISABLE")
        detail = {"mla": True, "VLLM_MLA_DISABLE": flag}
        if flag != "1":
            return record("model.cpu_attention", FAIL,
                          "MLA model on the CPU engine without VLLM_MLA_DISABLE=1 ('MLA is not supported on CPU')",
                          detail=detail, fix="set VLLM_MLA_DISABLE=1 in the host's env in the inventory")
        return record("model.cpu_attention", OK, "MLA model, VLLM_MLA_DISABLE=1 for the CPU engine",
                      detail=detail)
    head_dim = summary["head_dim"]
    detail = {"head_dim": head_dim, "supported": list(CPU_ATTN_HEAD_SIZES)}
    if head_dim not in CPU_ATTN_HEAD_SIZES:
        return record("model.cpu_attention", FAIL,
                      f"head_dim {head_dim} is refused by vLLM's CPU attention ('Unsupported CPU attention "
                      f"configuration')", detail=detail,
                      fix=f"use a GPU host, or a model whose head_dim is one of {list(CPU_ATTN_HEAD_SIZES)}")
    return record("model.cpu_attention", OK, f"head_dim {head_dim} supported by the CPU engine", detail=detail)


# -- remote code ------------------------------------------------------------------------------

def _package_file(package: str, *parts) -> str | None:
    """Path of a file inside an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    return path if os.path.exists(path) else None


def _mentions_model_type(path: str | None, model_type: str, pattern: str) -> bool | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    return re.search(pattern.format(re.escape(model_type)), text) is not None


def transformers_knows(model_type: str) -> bool | None:
    """Is ``model_type`` in transformers' CONFIG_MAPPING_NAMES? (None: transformers not found)."""
    path = _package_file("transformers", "models", "auto", "configuration_auto.py")
    return _mentions_model_type(path, model_type, r'\(\s*"{}"\s*,')


def vllm_knows(model_type: str) -> bool | None:
    """Does vLLM ship its own config class for ``model_type`` (its _CONFIG_REGISTRY)?"""
    path = _package_file("vllm", "transformers_utils", "config.py")
    return _mentions_model_type(path, model_type, r'\b{}\s*=\s*"')


def remote_code_files(model_path: str, auto_map: dict) -> dict:
    """``{file: present?}`` for every module ``auto_map`` names (``repo--module.Class`` too)."""
    files = {}
    for ref in auto_map.values():
        for item in ref if isinstance(ref, (list, tuple)) else [ref]:
            if not isinstance(item, str) or "." not in item:
                continue
            module = item.split("--", 1)[-1].rsplit(".", 1)[0]
            name = module.replace(".", os.sep) + ".py"
            files[name] = os.path.isfile(os.path.join(model_path, name))
    return files


def remote_code_record(ctx: Context, summary: dict):
    """Can transformers build this config, and does that need remote code we lack or may not run?"""
    model_type = summary["model_type"]
    model_path = ctx.params["model_path"]
    allowed = ctx.params["trust_remote_code"]
    files = remote_code_files(model_path, summary["auto_map"])
    missing = sorted(f for f, ok in files.items() if not ok)
    known = transformers_knows(model_type) if model_type else None
    detail = {"model_type": model_type, "transformers_knows": known, "vllm_has_config": vllm_knows(model_type)
              if model_type else None, "auto_map": summary["auto_map"], "files": files,
              "trust_remote_code": allowed}
    note = (" (speculators 0.3.0 calls AutoConfig itself, so vLLM's own config class does not help)"
            if detail["vllm_has_config"] else "")
    if known is None and model_type:
        return record("model.remote_code", WARN, "transformers not found: cannot tell if remote code is needed",
                      detail=detail)
    if known or not model_type:
        extra = "; auto_map present but not needed" if files else ""
        return record("model.remote_code", OK, f"transformers knows model_type {model_type!r}{extra}",
                      detail=detail)
    if not files:
        return record("model.remote_code", FAIL,
                      f"model_type {model_type!r} is unknown to transformers and config.json has no auto_map",
                      detail=detail, fix="install a transformers that knows this model_type, or add the "
                                         "model's remote code files and auto_map")
    if missing:
        return record("model.remote_code", FAIL,
                      f"model_type {model_type!r} needs remote code, but {', '.join(missing)} "
                      f"{'is' if len(missing) == 1 else 'are'} not in the model dir{note}", detail=detail,
                      fix=f"download the remote code files ({', '.join(missing)}) from the model's repo into "
                          f"{model_path}" + ("" if allowed else ", and set trust_remote_code: true for this "
                                                                "host in the inventory"))
    if not allowed:
        return record("model.remote_code", FAIL,
                      f"model_type {model_type!r} needs remote code ({', '.join(sorted(files))}) and "
                      f"trust_remote_code is off", detail=detail,
                      fix="read the remote code files, then set trust_remote_code: true for this host in the "
                          "inventory")
    return record("model.remote_code", OK,
                  f"model_type {model_type!r} uses remote code {', '.join(sorted(files))} (allowed)", detail=detail)
