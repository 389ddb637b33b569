"""Known-bad engine x model pairs of the vllm-server engine, as preflight rules (stdlib only).

Each :class:`KnownBad` names the upstream report, what goes wrong, the fix, and the vLLM
versions it holds for. Where the installed source shows whether the bug is there, a probe
reads it (the range then *is* the source: a release with the fix passes whatever its
version); where it cannot be read, the rule is keyed on the version and says so.

=====================  =================================================  ================
rule                   what goes wrong                                    range from
=====================  =================================================  ================
prefix-caching         prefix caching on: a request's hidden_states and   source (no release
                       token_ids lengths differ (vLLM #44485)             turns it off)
hybrid-zero-states     hybrid (Mamba / linear-attention) targets give     version (>=0.17)
                       all-zero captured states (vLLM #46301)
final-aux-dropped      the final state (id N) is never captured: the      source (the target's
                       forward has no capture after its last layer         forward)
                       (DeepSeek/Kimi/GLM before vLLM PR 46973)
kimi-k3-final-layer    Kimi-K3 captures the attention-residual prefix,    source (the model
                       not the stream the next layer reads, unless         reads the env var)
                       VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1
mla-memory-admission   DeepSeek-V4 / hybrid-MLA targets: the server's     version (>=0.25)
                       start-up memory admission is inflated by the
                       hidden-state cache (vLLM #53243, #56774)
draft-aux-count        an eagle3 draft whose config lists other than 3    source (the draft
                       aux ids at top level cannot load (vLLM #54526,     class's reader)
                       fix #54598 unreleased)
dflash-fc-count        a DSpark draft whose aux ids count differs from    source (the DFlash
                       its draft layers cannot load: the DFlash model     model's fc sizing and
                       sizes its fc from its layers (vLLM PR 48524, in    the converter)
                       0.27)
=====================  =================================================  ================
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from remote.drift.pyindex import PackageIndex, dotted
from remote.system import modelconfig, versions
from remote.wire import layers, protocol

AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
#: the environment switch of Kimi-K3's aux capture (vLLM 0.27+, ``vllm/envs.py``)
KIMI_K3_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
#: model types whose decoder mixes attention with Mamba / linear-attention layers
HYBRID_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h", "jamba",
                                "falcon_h1", "granitemoehybrid", "bamba", "zamba2", "minimax_m1", "lfm2"})
#: ``layer_types`` entries that are not plain attention
HYBRID_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "recurrent")


@dataclass(frozen=True)
class KnownBad:
    id: str
    issue: str
    what: str
    fix: str
    #: vLLM versions it holds for as a specifier; with a source probe the probe decides
    vllm: str
    #: "source" (a probe reads the fix) or "version" (keyed on ``vllm``: the source cannot show it)
    range_from: str
    level: str = protocol.FAIL


RULES = {r.id: r for r in (
    KnownBad("prefix-caching", "vLLM #44485",
             "with prefix caching on, a request's saved hidden_states and token_ids lengths differ (cached "
             "prefix tokens are not recomputed, so their states are never captured)",
             "drop --enable-prefix-caching from server_args (the engine passes --no-enable-prefix-caching)",
             ">=0.17", "source"),
    KnownBad("hybrid-zero-states", "vLLM #46301",
             "a hybrid (Mamba / linear-attention) target's captured states came back all zeros",
             "run specops verify (its canary compares states against the model) before training on them, or "
             "extract with a release known to capture this family",
             ">=0.17", "version", protocol.WARN),
    KnownBad("final-aux-dropped", "vLLM PR 46973",
             "the final state (id N, after the last decoder layer) is silently dropped: the target's forward "
             "captures aux states only at the input of a layer",
             "use a vLLM whose target forward captures the final state (DeepSeek/Kimi-K2.5 from 0.25), or leave "
             "N out of layer_ids",
             "<0.25", "source"),
    KnownBad("kimi-k3-final-layer", "vLLM Kimi-K3 aux capture (vllm/models/kimi_k3)",
             f"with {KIMI_K3_STREAM_ENV} unset Kimi-K3 captures the attention-residual prefix ('prefix_only'), "
             f"not the stream the next layer (or the final norm, for id N) reads",
             f"set env {KIMI_K3_STREAM_ENV}=1 in the run's env (params.env)",
             ">=0.27", "source", protocol.WARN),
    KnownBad("mla-memory-admission", "vLLM #53243, #56774",
             "DeepSeek-V4 / hybrid-MLA targets: the hidden-state cache inflates the memory the server admits at "
             "start-up, so a start that fits without extraction is refused (or over-commits)",
             "start with the canary first (specops extract --canary), lower max_num_seqs / max_model_len, or "
             "raise gpu_memory_utilization",
             ">=0.25", "version", protocol.WARN),
    KnownBad("draft-aux-count", "vLLM #54526 (fix #54598, not released)",
             "an eagle3 draft whose config lists other than 3 aux layer ids at top level does not load: the "
             "draft class sizes its fc for 3 aux states unless num_aux_hidden_states (or eagle_config) says "
             "otherwise",
             "add \"num_aux_hidden_states\": <count> to transformer_layer_config in the draft's config.json "
             "(the draft class reads it), or train the draft on 3 aux ids",
             "<=0.34", "source"),
    KnownBad("dflash-fc-count", "vLLM PR 48524, first in 0.27",
             "a DSpark draft whose aux ids count differs from its draft layers does not load: the DFlash model "
             "sizes its fc from dflash_config's target_layer_ids, else the draft's num_hidden_layers, and the "
             "dspark converter writes target_layer_ids at the config's top level",
             "train the draft with as many layers as aux ids (--trainer-arg=--num-layers=<count>), or serve it "
             "with vLLM >= 0.27 (its fc follows the aux ids)",
             "<0.27", "source"),
)}
#: the rules about a draft's own config (eval), not the extraction run's vLLM x model pair
DRAFT_RULES = ("draft-aux-count", "dflash-fc-count")


def in_range(rule: KnownBad, version: str | None) -> bool | None:
    if not version:
        return None
    return versions.version_matches(version, rule.vllm)


# ---------------------------------------------------------------------------- what the run asks


def sent_layer_ids(params: dict, num_layers: int | None) -> list[int] | None:
    """The aux ids the engine sends vLLM (input convention): the run's ``layer_ids`` (``output:i`` is
    ``input:i+1``), else the engine's default, which ends with the final state N."""
    ids = params.get("layer_ids")
    if ids:
        shift = 1 if params.get("layer_convention") == layers.OUTPUT else 0
        return [int(i) + shift for i in ids]
    if num_layers:
        return layers.default_layer_ids("vllm-server", num_layers)[0]
    return None


def is_hybrid(config: dict) -> str | None:
    """Why the model's decoder is hybrid (Mamba / linear attention), or None."""
    model_type = modelconfig.model_type(config) or ""
    if model_type in HYBRID_MODEL_TYPES:
        return f"model_type {model_type}"
    types = modelconfig.text_value(config, "layer_types") or []
    odd = sorted({t for t in types if isinstance(t, str) and t.startswith(HYBRID_LAYER_TYPES)})
    return f"layer_types has {', '.join(odd)}" if odd else None


def is_mla_v4(config: dict, architecture: str) -> str | None:
    model_type = modelconfig.model_type(config) or ""
    if architecture.startswith("DeepseekV4") or model_type.startswith("deepseek_v4"):
        return f"{architecture} (DeepSeek-V4)"
    if modelconfig.text_value(config, "kv_lora_rank") and is_hybrid(config):
        return f"{architecture}: MLA with hybrid layers"
    return None


# ---------------------------------------------------------------------------- source probes


def _final_capture(index: PackageIndex, inner) -> str | None:
    """``file:line`` where the inner model's forward captures the final state: a test
    ``<end_layer | idx + 1 | len(...)> in ...aux_hidden_state_layers`` or
    ``_maybe_add_hidden_state(..., idx + 1, ...)``; None when it captures only layer inputs."""
    hit = index.class_member(inner, "forward")
    if hit is None:
        return None

    def final(expr) -> bool:
        return (dotted(expr) or "").endswith("end_layer") or (
            isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)
            and isinstance(expr.right, ast.Constant) and expr.right.value == 1) or (
            isinstance(expr, ast.Call) and dotted(expr.func) == "len")

    for node in ast.walk(hit[0]):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and final(node.left) \
                and (dotted(node.comparators[0]) or "").endswith("aux_hidden_state_layers"):
            return f"{hit[1].path}:{node.lineno}"
        if isinstance(node, ast.Call) and (dotted(node.func) or "").endswith("_maybe_add_hidden_state") \
                and any(final(a) for a in node.args):
            return f"{hit[1].path}:{node.lineno}"
    return None


def _layers_holder(index: PackageIndex, target):
    """The class whose forward runs the decoder layers: the target's ``.model``, or its language
    model's (a multimodal wrapper such as Kimi-K2.5/K3)."""
    from remote.drift.targets import attribute_class, inner_model_class

    if target.inner is not None:
        return target.inner
    language = attribute_class(index, target.causal, "language_model")
    return inner_model_class(index, language) if language is not None else None


def _reads_env(index: PackageIndex, cls, name: str) -> str | None:
    """``file:line`` where class ``cls`` (or a base) reads ``envs.<name>``."""
    for owner in index.mro(cls)[0]:
        for node in ast.walk(owner.node):
            if isinstance(node, ast.Attribute) and node.attr == name:
                return f"{owner.path}:{node.lineno}"
    return None


def _prefix_caching_forced_off(index: PackageIndex, method_modules) -> str | None:
    """``file:line`` where the extraction code sets ``enable_prefix_caching = False`` itself."""
    for module in method_modules:
        for path in index.files(module):
            for node in ast.walk(_parse(path)):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is False \
                        and any((dotted(t) or "").endswith("enable_prefix_caching") for t in node.targets):
                    return f"{index.rel(path)}:{node.lineno}"
    return None


def _parse(path):
    from remote.drift.pyindex import parse

    return parse(path)


# ---------------------------------------------------------------------------- the check


def findings(index: PackageIndex, targets: list, params: dict, version: str | None,
             method_modules=()) -> tuple[list[dict], list[dict]]:
    """(fired, checked): each rule's verdict for this vLLM, these targets and the run's params."""
    config = {}
    if params.get("model_path"):
        try:
            config = modelconfig.read(params["model_path"])
        except modelconfig.ConfigError:
            config = {}
    num_layers = modelconfig.text_value(config, "num_hidden_layers") if config else None
    ids = sent_layer_ids(params, num_layers)
    env = params.get("env") or {}
    fired, checked = [], []

    def verdict(rule: KnownBad, applies: str | None, evidence: str | None, bad: bool | None):
        row = {"id": rule.id, "issue": rule.issue, "range_from": rule.range_from, "vllm": rule.vllm,
               "applies": applies, "evidence": evidence, "in_range": in_range(rule, version)}
        checked.append(row)
        if applies and bad:
            fired.append(dict(row, level=rule.level, what=rule.what, fix=rule.fix))

    server_args = [str(a) for a in params.get("server_args") or []]
    rule = RULES["prefix-caching"]
    forced = _prefix_caching_forced_off(index, method_modules)
    verdict(rule, "server_args enable prefix caching" if "--enable-prefix-caching" in server_args else None,
            f"turned off at {forced}" if forced else
            f"the extraction code never sets enable_prefix_caching = False (searched "
            f"{', '.join(m.replace('.', '/') for m in method_modules) or 'nothing: no extraction code'})",
            forced is None)

    for target in targets:
        arch = target.architecture
        rule = RULES["hybrid-zero-states"]
        why = is_hybrid(config) if config else None
        verdict(rule, why and f"{arch}: {why}", f"keyed on the version (vLLM {version})", in_range(rule, version))

        rule = RULES["mla-memory-admission"]
        why = is_mla_v4(config, arch) if params.get("device") != "cpu" else None
        verdict(rule, why, f"keyed on the version (vLLM {version})", in_range(rule, version))

        holder = _layers_holder(index, target)
        rule = RULES["final-aux-dropped"]
        wants_final = ids is not None and num_layers is not None and num_layers in ids
        where = _final_capture(index, holder) if holder is not None else None
        verdict(rule, wants_final and f"{arch}: layer ids {ids} include the final state {num_layers}",
                f"final state captured at {where}" if where else
                f"{holder.name} ({holder.where}).forward captures no final state" if holder else "no inner model found",
                holder is not None and where is None)

        rule = RULES["kimi-k3-final-layer"]
        reads = _reads_env(index, holder, KIMI_K3_STREAM_ENV) if holder is not None else None
        on = str(env.get(KIMI_K3_STREAM_ENV, "0")) not in ("", "0")
        verdict(rule, reads and f"{arch}: {holder.name} reads {KIMI_K3_STREAM_ENV} ({reads})",
                f"{KIMI_K3_STREAM_ENV}={'1' if on else 'unset'} in the run's env", not on)
    return fired, checked


def record(index: PackageIndex, targets: list, params: dict, version: str | None, method_modules=()) -> dict:
    """``drift.server-known-bad``: fail (or warn) naming each known-bad pair this run meets."""
    fired, checked = findings(index, targets, params, version, method_modules)
    detail = {"checked": checked, "fired": fired}
    if not fired:
        return protocol.record("drift.server-known-bad", protocol.OK,
                               f"none of {len(RULES) - len(DRAFT_RULES)} known-bad vLLM x model pairs applies "
                               f"({', '.join(sorted(set(c['id'] for c in checked)))})", detail=detail)
    worst = protocol.FAIL if any(f["level"] == protocol.FAIL for f in fired) else protocol.WARN
    first = fired[0]
    more = f" (+{len(fired) - 1} more)" if len(fired) > 1 else ""
    return protocol.record("drift.server-known-bad", worst,
                           f"{first['id']} ({first['issue']}): {first['applies']}: {first['what']}{more}",
                           detail=detail, fix="; ".join(f"{f['id']}: {f['fix']}" for f in fired))


# ---------------------------------------------------------------------------- the draft (eval)


def draft_aux_count_problem(index: PackageIndex, draft: dict, where: str) -> dict | None:
    """Why vLLM cannot load this eagle3 draft's config (#54526), read from the draft class's source;
    None when it can. ``draft`` is the draft's config.json (speculators format)."""
    ids = draft.get(AUX_IDS_KEY)
    layer_config = draft.get("transformer_layer_config") or {}
    if not isinstance(ids, list) or len(ids) == 3 or layer_config.get("num_aux_hidden_states") == len(ids) \
            or (layer_config.get("eagle_config") or {}).get(AUX_IDS_KEY):
        return None
    model_type = layer_config.get("model_type") or "llama"
    names = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}
    classes = index.find_classes(names.get(model_type, "Eagle3LlamaForCausalLM"), "vllm.model_executor.models")
    if not classes:
        return None
    cls = classes[0]
    # the draft reads the top-level key itself (getattr(self.config, KEY)): it loads
    for owner in index.mro(cls)[0]:
        tree_path = index.module_file(owner.module)
        if tree_path and any(r.startswith(index.rel(tree_path) + ":")
                             for r in index.key_readers(AUX_IDS_KEY, owner.module)
                             if _reads_top_level(index, tree_path, r)):
            return None
    rule = RULES["draft-aux-count"]
    return {"rule": rule.id, "issue": rule.issue, "ids": ids, "class": cls.where,
            "summary": f"the draft's config lists {len(ids)} aux layer ids {ids} at top level; vLLM's {cls.name} "
                       f"({cls.where}) sizes its fc for 3 unless transformer_layer_config has num_aux_hidden_states "
                       f"({rule.issue}): the load would fail",
            "fix": f"add \"num_aux_hidden_states\": {len(ids)} to transformer_layer_config in {where}/config.json, "
                   f"or train the draft on 3 aux ids"}


#: the DFlash draft model every DFlash-family method loads (DSpark's ``Qwen3DSparkModel`` subclasses it)
DFLASH_MODEL = "DFlashQwen3Model"
#: vLLM 0.27+'s reader of the speculative config's aux ids (PR 48524 sizes the DFlash fc with it)
AUX_IDS_READER = "get_eagle3_aux_layers_from_config"


def draft_fc_count_problem(index: PackageIndex, draft: dict, where: str) -> dict | None:
    """Why vLLM cannot load this DFlash-family draft's fc, read from source; None when it can.

    vLLM 0.25-0.26 size the DFlash model's fc from ``target_layer_ids`` in the draft's ``dflash_config`` (or
    ``eagle_config``), else from the draft's ``num_hidden_layers``. The dflash converter writes the ids there; the
    dspark one writes them at the config's top level, so a DSpark draft of 3 aux ids and speculators' default 5
    draft layers gets an fc for 5 states and its 3-state weights do not load (GPU round 22: "Tried to load weights
    of size [4096, 12288] to a parameter of size [4096, 20480]"). 0.27 reads the aux ids themselves (PR 48524)."""
    from remote.drift import algorithms

    algorithm = draft.get("speculators_model_type")
    facts = layers.ALGORITHMS.get(algorithm)
    ids = draft.get(facts.config_ids) if facts and facts.config_ids else None
    draft_layers = (draft.get("transformer_layer_config") or {}).get("num_hidden_layers")
    if not isinstance(ids, list) or not isinstance(draft_layers, int) or len(ids) == draft_layers:
        return None
    classes = index.find_classes(DFLASH_MODEL, "vllm.model_executor.models")
    if not classes:
        return None
    cls = classes[0]
    module = _parse(index.module_file(cls.module))
    if any(isinstance(n, ast.Name) and n.id == AUX_IDS_READER for n in ast.walk(module)):
        return None
    reads_nested = any(isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant)
                       and n.left.value == "target_layer_ids" and isinstance(n.ops[0], ast.In)
                       for n in ast.walk(cls.node))
    if not reads_nested or algorithms.converter_nests_ids(index.root, algorithm) is not False:
        return None
    rule = RULES["dflash-fc-count"]
    return {"rule": rule.id, "issue": rule.issue, "ids": ids, "draft_layers": draft_layers, "class": cls.where,
            "summary": f"the {algorithm} draft has {len(ids)} aux layer ids {ids} and {draft_layers} draft layers; "
                       f"vLLM's {cls.name} ({cls.where}) sizes its fc from dflash_config's target_layer_ids, else "
                       f"its {draft_layers} layers, and this vLLM's {algorithm} converter writes target_layer_ids "
                       f"at the top level ({'/'.join(algorithms.VLLM_ALGOS)}): an fc for {draft_layers} states, "
                       f"so the load would fail (fixed by {rule.issue})",
            "fix": f"train the draft with {len(ids)} layers (specops train --algorithm {algorithm} "
                   f"--trainer-arg=--num-layers={len(ids)}), or serve {where} with vLLM >= 0.27 (its fc follows "
                   f"the aux ids)"}


def draft_config_problem(index: PackageIndex, draft: dict, where: str) -> dict | None:
    """The first known-bad form of the draft's config for this vLLM (:data:`DRAFT_RULES`), or None."""
    return draft_aux_count_problem(index, draft, where) or draft_fc_count_problem(index, draft, where)


def planned_draft_problem(index: PackageIndex, algorithm: str, aux_ids, draft_layers: int,
                          where: str = "the draft") -> dict | None:
    """:func:`draft_config_problem` for a draft not trained yet: the config speculators would write for
    ``algorithm`` with these aux ids and draft layers (train's and extract's preflight)."""
    facts = layers.ALGORITHMS.get(algorithm)
    if facts is None or not facts.config_ids:
        return None
    draft = {"speculators_model_type": algorithm, facts.config_ids: list(aux_ids),
             "transformer_layer_config": {"num_hidden_layers": int(draft_layers)}}
    return draft_config_problem(index, draft, where)


def _reads_top_level(index: PackageIndex, path, where: str) -> bool:
    """Whether the read at ``where`` is ``getattr(self.config, KEY...)`` (the draft's own top level)."""
    line = int(where.rsplit(":", 1)[1])
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Call) and node.lineno == line and dotted(node.func) == "getattr" and node.args \
                and (dotted(node.args[0]) or "").endswith("config") \
                and not (dotted(node.args[0]) or "").endswith("eagle_config"):
            return True
    return False
