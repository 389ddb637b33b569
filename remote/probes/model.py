"""Model probe: config.json read directly (no transformers), unwrapped, classified.

A multimodal wrapper such as Kimi-K2.5 keeps the language model under ``text_config``;
everything the engine needs (layers, hidden size, heads) is read from there, and the
record says it was wrapped. Every value used is checked for its shape first (a layer
count given as ``"8"``, a ``text_config`` that is a string): a fail record naming the
key and what was expected, never a crash further down.

The *family* decides how a patched worker must call each decoder layer. It is read
from the installed vLLM itself, not from a list of names: the config's architectures
are looked up in vLLM's model registry, and the decoder layer's ``forward`` (and what
the model's own ``forward`` passes it) is read with :mod:`ast` from
``vllm/model_executor/models/<module>.py`` (the static index of
:mod:`remote.drift.pyindex`; vLLM is never imported):

``deepseek_v2``  ``layer(positions, hidden_states, residual, llama_4_scaling)``
                 (vLLM's ``DeepseekV2DecoderLayer``: DeepSeek-V2/V3, Kimi-K2)
``llama``        ``layer(positions, hidden_states, residual)`` (Llama, Qwen3, Qwen3-MoE, ...)

Whether transformers can build the config at all (a model_type it does not know needs
remote code, from ``auto_map`` files beside config.json) is first decided statically
here, by reading transformers' own auto-config table as text, and then confirmed for
real by :mod:`remote.probes.hf_load` in a subprocess.
"""
from __future__ import annotations

import importlib.util
import os
import re

from remote.drift import pyindex, source, targets
from remote.probes import Context
from remote.system import modelconfig
from remote.system.jsonfile import (NON_NEGATIVE_INT, NUMBER, OBJECT, POSITIVE_INT, STRING, STRING_LIST, Malformed,
                                    describe, expect, field)
from remote.wire import contract
from remote.wire.contract import VLLM_SERVER
from remote.wire.protocol import FAIL, OK, WARN, record

CONFIG = modelconfig.CONFIG_FILE
DEEPSEEK_V2 = "deepseek_v2"
LLAMA = "llama"
#: What every layer call passes, in this order (vLLM's decoder layers since 0.6).
BASE_LAYER_ARGS = ("positions", "hidden_states", "residual")
#: The extra arguments each family's model passes its layers beyond :data:`BASE_LAYER_ARGS`.
FAMILY_EXTRA_ARGS = {LLAMA: (), DEEPSEEK_V2: ("llama_4_scaling",)}
CALLING_CONVENTION = {family: f"layer({', '.join(BASE_LAYER_ARGS + extra)})"
                      for family, extra in FAMILY_EXTRA_ARGS.items()}
FAMILY_NAMES = {DEEPSEEK_V2: "DeepseekV2 family", LLAMA: "Llama-like"}
#: Head sizes vLLM 0.16's CPU attention backend accepts (cpu_attn.get_supported_head_sizes).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

#: summary field -> (config keys that may hold it, first non-null wins; what it must be).
COUNTS = {
    "num_layers": (modelconfig.LAYER_KEYS, POSITIVE_INT),
    "hidden_size": (("hidden_size", "d_model", "n_embd"), POSITIVE_INT),
    "num_attention_heads": (("num_attention_heads", "n_head", "n_heads"), POSITIVE_INT),
    "num_key_value_heads": (("num_key_value_heads", "num_kv_heads"), POSITIVE_INT),
    "head_dim": (("head_dim",), POSITIVE_INT),
    "num_experts": (("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"),
                    NON_NEGATIVE_INT),
    "experts_per_token": (("num_experts_per_tok", "moe_top_k"), NON_NEGATIVE_INT),
    "max_position_embeddings": (("max_position_embeddings", "n_positions"), POSITIVE_INT),
    "vocab_size": (("vocab_size",), POSITIVE_INT),
}
#: The keys vLLM's DeepseekV2Model reads from ``llama_4_scaling`` (``deepseek_v2.py``, vLLM 0.16 and 0.32).
LLAMA_4_SCALING_KEYS = ("original_max_position_embeddings", "beta")


def _pick(cfg: dict, *keys):
    """``(key, value)`` of the first key whose value is not null, or ``(None, None)``."""
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None, None


def read_config(model_path: str):
    """``(config dict, None)`` or ``(None, (summary, fix))`` for a missing/unreadable config.json."""
    try:
        return modelconfig.read(model_path), None
    except modelconfig.ConfigError as exc:
        if exc.value is not None:  # valid JSON, wrong shape: say what it is, as every shape error does
            return None, (f"{exc.path} is {describe(exc.value)}, expected an object", exc.fix)
        return None, (exc.summary, exc.fix)


def summarize(cfg: dict) -> tuple:
    """``(summary, problems)``: the facts an extraction run depends on, from the (possibly
    wrapped) config, and a :class:`~remote.system.jsonfile.Malformed` for every value of the wrong shape.

    A malformed value is left out of the summary (None), so later probes skip what
    depends on it instead of computing with it.

    :raises Malformed: when ``text_config`` is there but not an object (nothing can be read).
    """
    problems = []

    def checked(mapping, key, kind, where=""):
        try:
            return field(mapping, key, kind, CONFIG, where=where)
        except Malformed as exc:
            problems.append(exc)
            return None

    if cfg.get("text_config") is not None:
        expect(cfg["text_config"], OBJECT, CONFIG, "text_config",
               fix="text_config must be the language model's config object; re-download config.json")
    wrapped = modelconfig.is_wrapped(cfg)
    text = modelconfig.text_config(cfg)
    where = modelconfig.wrapper_key(cfg) or ""
    summary = {
        "model_type": checked(cfg, "model_type", STRING),
        "text_model_type": checked(text, "model_type", STRING, where) if wrapped else None,
        "wrapped_in_text_config": wrapped,
    }
    if not wrapped:
        summary["text_model_type"] = summary["model_type"]
    top_archs = checked(cfg, "architectures", STRING_LIST) or []
    text_archs = (checked(text, "architectures", STRING_LIST, where) or []) if wrapped else []
    summary["architectures"] = top_archs or text_archs
    #: tried in this order against vLLM's registry: the text model first (it runs the layers)
    summary["vllm_architectures"] = list(dict.fromkeys(text_archs + top_archs))
    sources = {}
    for name, (keys, kind) in COUNTS.items():
        key, _ = _pick(text, *keys)
        summary[name] = checked(text, key, kind, where) if key else None
        if key:
            sources[name] = f"{where}.{key}" if where else key
    heads, hidden = summary["num_attention_heads"], summary["hidden_size"]
    if summary["head_dim"] is None and heads and hidden and "head_dim" not in sources:
        summary["head_dim"] = hidden // heads
    if summary["num_key_value_heads"] is None and "num_key_value_heads" not in sources:
        summary["num_key_value_heads"] = heads
    summary["config_keys"] = sources
    summary["mla"] = text.get("kv_lora_rank") is not None

    in_text = cfg.get("quantization_config") is None and text.get("quantization_config") is not None
    quant = checked(text if in_text else cfg, "quantization_config", OBJECT, where if in_text else "")
    summary["quantization"] = quant.get("quant_method") if quant else None
    in_text = text.get("llama_4_scaling") is not None
    scaling_where = where if in_text else ""
    scaling = checked(text if in_text else cfg, "llama_4_scaling", OBJECT, scaling_where)
    if scaling:
        for key in LLAMA_4_SCALING_KEYS:
            try:
                field(scaling, key, NUMBER, CONFIG, where=f"{scaling_where}.llama_4_scaling".lstrip("."),
                      required=True)
            except Malformed as exc:
                problems.append(exc)
                scaling = None
                break
    summary["llama_4_scaling"] = scaling
    summary["rope_scaling"] = text.get("rope_scaling")
    summary["dtype"] = _pick(text, "torch_dtype", "dtype")[1] or cfg.get("torch_dtype")
    auto_map = checked(cfg, "auto_map", OBJECT) or {}
    for key, ref in auto_map.items():
        try:
            expect(ref if isinstance(ref, list) else [ref], STRING_LIST, CONFIG, f"auto_map.{key}")
        except Malformed:
            problems.append(Malformed(CONFIG, f"auto_map.{key}", "a string or a list of strings", ref))
            auto_map = {}
            break
    summary["auto_map"] = auto_map
    summary["family"] = summary["calling_convention"] = None  # filled from vLLM's code by the probe
    return summary, problems


def probe(ctx: Context) -> list:
    """Read and check config.json; leaves the summary in ``ctx.model`` (empty on failure)."""
    model_path = ctx.params["model_path"]
    cfg, problem = read_config(model_path)
    if cfg is None:
        return [record("model.config", FAIL, problem[0], detail={"model_path": model_path}, fix=problem[1])]
    try:
        summary, problems = summarize(cfg)
    except Malformed as exc:
        return [record("model.config", FAIL, exc.summary, detail=dict(exc.detail(), model_path=model_path),
                       fix=exc.fix)]
    ctx.model = summary
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        detail = dict(summary, model_path=model_path, problems=[p.detail() for p in problems],
                      **{k: v for k, v in first.detail().items()})
        return [record("model.config", FAIL, first.summary + more, detail=detail, fix=first.fix)]
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not summary[k]]
    where = modelconfig.wrapper_key(cfg) or "config.json"
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
    layer_call = vllm_layer_call(summary["vllm_architectures"], ctx.params)
    summary["family"], summary["calling_convention"] = layer_call.get("family"), layer_call.get("calling_convention")
    records.append(_family(summary, layer_call))
    records.append(_llama_4_scaling(summary))
    records.append(_seq_len(ctx, summary))
    if ctx.params["device"] == "cpu":
        records.append(_cpu_attention(ctx, summary))
    records.append(remote_code_record(ctx, summary))
    return records


# -- the family, from vLLM's own code ----------------------------------------------------------

def vllm_layer_call(architectures: list, params: dict) -> dict:
    """How the installed vLLM calls the decoder layers of the first of ``architectures`` it knows.

    :returns: ``{"architecture", "layer_class", "layer_forward" (file:line), "parameters",
        "passed" (what the model's own forward passes, None when it cannot be told),
        "family" (``llama`` | ``deepseek_v2`` | None), "calling_convention"}``, or
        ``{"error": why, "tried": [...]}`` when vLLM, its registry or the layer is not found.
    """
    _, vllm_root = source.site_packages(params)
    if vllm_root is None:
        return {"error": "vLLM is not installed in this python", "tried": []}
    index = pyindex.PackageIndex(vllm_root)
    if index.module_file("vllm.model_executor.models.registry") is None:
        return {"error": f"vLLM's model registry is not at {vllm_root}/vllm/model_executor/models/registry.py",
                "tried": []}
    tried = []
    for arch in architectures:
        try:
            if targets.registry_entry(index, arch) is None:
                tried.append(f"{arch}: not in vLLM's model registry")
                continue
            target, why = targets.resolve_target(index, arch, {}, CONFIG)
            if target is None or target.layer is None:
                tried.append(f"{arch}: {why or 'no decoder layer class found beside its model class'}")
                continue
            hit = index.class_member(target.layer, "forward")
            if hit is None or not hasattr(hit[0], "args"):
                tried.append(f"{arch}: {target.layer.name} has no forward")
                continue
            return dict(_classify(index, target, hit), architecture=arch, tried=tried)
        except SyntaxError as exc:  # a damaged install: the model config itself is still fine
            tried.append(f"{arch}: vLLM's {exc.filename} does not parse (line {exc.lineno}: {exc.msg})")
    if not architectures:
        return {"error": "config.json names no architectures to look up in vLLM's registry", "tried": []}
    return {"error": "; ".join(tried), "tried": tried}


def _classify(index, target, hit) -> dict:
    """The family whose call the layer's forward takes, from its signature and its model's calls."""
    fn, owner = hit
    sig = pyindex.Signature.of_function(fn, bound=True, where=f"{owner.path}:{fn.lineno}")
    accepted = list(sig.positional) + sorted(sig.keywords - set(sig.positional))
    passed = None
    own = index.class_member(target.inner, "forward") if target.inner is not None else None
    if own is not None and hasattr(own[0], "args"):
        names, open_ended = set(), False
        calls = pyindex.layer_calls(own[0])
        for call in calls:
            got, more = pyindex.supplied_params(sig, call, own[0])
            names |= got
            open_ended |= more
        if calls and not open_ended:  # in the layer's own parameter order
            passed = [p for p in accepted if p in names] + sorted(names - set(accepted))
    info = {"module": owner.module, "layer_class": target.layer.name, "layer_forward": sig.where,
            "parameters": accepted, "required": list(sig.required),
            "model_class": target.inner.name if target.inner is not None else None, "passed": passed,
            "family": None, "calling_convention": None}
    base_ok = tuple(sig.positional[:len(BASE_LAYER_ARGS)]) == BASE_LAYER_ARGS
    extra_required = [r for r in sig.required if r not in BASE_LAYER_ARGS]
    if not base_ok or extra_required:
        return info
    # What the model itself passes decides. When that cannot be read (it forwards
    # **kwargs, or calls its parent's forward), a family's own extra argument counts as
    # passed whenever the layer takes it, and other optional ones are taken as left at
    # their defaults (Mistral's t_cond, set only by the Voxtral wrapper).
    family_extras = {arg for extra in FAMILY_EXTRA_ARGS.values() for arg in extra}
    if passed is not None:
        extras = set(passed) - set(BASE_LAYER_ARGS)
    elif sig.var_keyword:
        return info
    else:
        extras = set(accepted) & family_extras
        info["assumed_defaults"] = sorted(set(accepted) - set(BASE_LAYER_ARGS) - family_extras)
    for family, extra in FAMILY_EXTRA_ARGS.items():
        if extras == set(extra):
            info.update(family=family, calling_convention=CALLING_CONVENTION[family])
    return info


def _family(summary, layer_call):
    family = layer_call.get("family")
    detail = dict({"family": None, "calling_convention": None}, **layer_call)
    detail.update(model_type=summary["text_model_type"], architectures=summary["architectures"])
    smoke = "run `specops smoke` on a tiny twin first to prove the extraction path"
    if "error" in layer_call:
        return record("model.family", WARN, f"calling convention unknown: {layer_call['error']}", detail=detail,
                      fix=smoke)
    where = f"vLLM's {layer_call['layer_class']}.forward ({layer_call['layer_forward']})"
    if family is None:
        args = ", ".join(layer_call["passed"] or layer_call["parameters"])
        return record("model.family", WARN,
                      f"{layer_call['architecture']}: {where} is called as layer({args}), neither the Llama-like "
                      f"nor the DeepseekV2 call the patched worker makes: its layer calls are unproven",
                      detail=detail, fix=smoke)
    return record("model.family", OK, f"{FAMILY_NAMES[family]} per {where}: {layer_call['calling_convention']}",
                  detail=detail)


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
    top = contract.seq_len_limit(ctx.params["engine"], max_pos)
    if seq_len > top:
        # vLLM's server caps --max-model-len at the model's positions (longer needs VLLM_ALLOW_LONG_MAX_MODEL_LEN,
        # which vLLM warns may give wrong outputs), and each request asks for one generated token: a sample of
        # max_position_embeddings tokens is refused after the load ("max_tokens must be at least 1, got 0")
        return record("model.seq_len", FAIL,
                      f"seq_len {seq_len} leaves no room for the one token each vllm-server request generates "
                      f"(max_position_embeddings {max_pos}): a full-length sample would be refused by the server "
                      f"after the load", detail=dict(detail, limit=top),
                      fix=f"set seq_len to at most {top} (max_position_embeddings - 1)")
    if top < max_pos:
        return record("model.seq_len", OK, f"seq_len {seq_len} <= {top} (max_position_embeddings {max_pos}, less "
                      f"the one token each request generates)", detail=detail)
    return record("model.seq_len", OK, f"seq_len {seq_len} <= max_position_embeddings {max_pos}", detail=detail)



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


#: where transformers keeps its model-type table (CONFIG_MAPPING_NAMES): transformers 5
#: generates it into ``auto_mappings.py`` and ``configuration_auto.py`` only adds a few
#: entries; transformers 4 has it all in ``configuration_auto.py``.
TRANSFORMERS_MODEL_TYPE_FILES = ("auto_mappings.py", "configuration_auto.py")


def transformers_knows(model_type: str) -> bool | None:
    """Is ``model_type`` in transformers' CONFIG_MAPPING_NAMES? (None: transformers not found)."""
    found = None
    for name in TRANSFORMERS_MODEL_TYPE_FILES:
        path = _package_file("transformers", "models", "auto", name)
        known = _mentions_model_type(path, model_type, r'\(\s*"{}"\s*,')
        if known:
            return True
        found = found or known
    return found


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
    server = ctx.params["engine"] == VLLM_SERVER
    note = (" (speculators 0.3.0 calls AutoConfig itself, so vLLM's own config class does not help)"
            if detail["vllm_has_config"] and not server else "")
    if known is None and model_type:
        return record("model.remote_code", WARN, "transformers not found: cannot tell if remote code is needed",
                      detail=detail)
    if known or not model_type:
        extra = "; auto_map present but not needed" if files else ""
        return record("model.remote_code", OK, f"transformers knows model_type {model_type!r}{extra}",
                      detail=detail)
    if server and detail["vllm_has_config"] and (missing or not files or not allowed):
        # vLLM's server builds the config with its own class (its _CONFIG_REGISTRY), so the
        # extraction runs; only a transformers-side reference (smoke/verify, AutoConfig) needs the code.
        return record("model.remote_code", WARN,
                      f"model_type {model_type!r} is unknown to transformers but vLLM has its own config class for "
                      f"it: the vllm-server engine needs no remote code; a transformers reference (verify, "
                      f"AutoConfig) does", detail=detail,
                      fix="for verify, put the model's remote code files beside config.json and set "
                          "trust_remote_code: true")
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
