"""The vLLM side: the target model family as the installed vLLM implements it.

A :class:`Target` is what the worker meets at run time, found in vLLM's own code: the
causal-LM class vLLM builds for an architecture (its model registry, read as data), the
inner model that class holds as ``.model`` (``DeepseekV2Model``) and that model's decoder
layer class (``DeepseekV2DecoderLayer``)::

    >>> target, why = resolve_target(index, "DeepseekV3ForCausalLM", {}, "config.json")
    >>> target.causal.name, target.inner.name, target.layer.name
    ('DeepseekV3ForCausalLM', 'DeepseekV2Model', 'DeepseekV2DecoderLayer')

Which architectures to check comes from the params or the model's own ``config.json``
(:func:`target_specs`); with neither, every family in :data:`DEFAULT_ARCHITECTURES`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from remote.drift.pyindex import PackageIndex, Ref, class_body_member
from remote.system import modelconfig

#: what to check when neither the family nor the model's config says (one per family).
DEFAULT_ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV3ForCausalLM")


@dataclass
class Target:
    """The target model family as vLLM implements it."""

    architecture: str
    causal: Ref  # e.g. DeepseekV3ForCausalLM
    inner: Ref | None  # e.g. DeepseekV2Model (what ``model.model`` is)
    layer: Ref | None  # e.g. DeepseekV2DecoderLayer
    #: config keys the model sets: {"llama_4_scaling": True/False}; absent = unknown
    uses: dict = field(default_factory=dict)
    #: where the architecture came from (params, the model's config.json, or the default set)
    source: str = ""

    def has(self, key: str):
        return self.uses.get(key)


def registry_entry(index: PackageIndex, architecture: str):
    """(module, class) of an architecture in vLLM's model registry, read from its dicts."""
    tree, _ = index.tree(f"{index.package}.model_executor.models.registry")
    if tree is None:
        return None
    for stmt in tree.body:
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, val in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and key.value == architecture and isinstance(val, ast.Tuple):
                parts = [e.value for e in val.elts if isinstance(e, ast.Constant)]
                if len(parts) == 2:
                    return parts[0], parts[1]
    return None


def registry_module(index: PackageIndex, module: str) -> str:
    """The dotted module of a registry entry: a module name under ``model_executor/models/``
    (``"llama"``) or, from vLLM 0.32, a fully qualified per-platform package
    (``"vllm.models.deepseek_v4"``, whose ``__init__`` picks ``nvidia/``, ``cpu/``... by platform)."""
    if module.startswith(f"{index.package}."):
        return module
    return f"{index.package}.model_executor.models.{module}"


def inner_model_class(index: PackageIndex, causal: Ref) -> Ref | None:
    """The class of ``causal.model``: ``model_cls = X``, ``self.model = X(...)`` or ``_init_model``."""
    for cls in index.mro(causal)[0]:
        attr = class_body_member(cls.node, "model_cls")
        if isinstance(attr, ast.Assign):
            ref = index.resolve_in(cls.module, attr.value)
            if ref is not None and ref.kind == "class":
                return ref
        for node in ast.walk(cls.node):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            if not any(isinstance(t, ast.Attribute) and t.attr == "model" for t in node.targets):
                continue
            func = node.value.func
            ref = index.resolve_in(cls.module, func)
            if ref is not None and ref.kind == "class":
                return ref
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                hit = index.class_member(causal, func.attr)
                if hit and isinstance(hit[0], ast.FunctionDef):
                    for ret in ast.walk(hit[0]):
                        if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call):
                            ref = index.resolve_in(hit[1].module, ret.value.func)
                            if ref is not None and ref.kind == "class":
                                return ref
    return None


def attribute_class(index: PackageIndex, cls: Ref, attr: str) -> Ref | None:
    """The class of ``<cls instance>.<attr>``, read from the class's own assignments.

    ``self.<attr> = X(...)`` with ``X`` a vLLM class, or a registry factory called with a
    literal ``architectures=["Name"]`` (Kimi-K2.5: ``self.language_model =
    init_vllm_registered_model(..., architectures=["DeepseekV2ForCausalLM"])``), looked up
    in vLLM's model registry. None when the code does not say.
    """
    for owner in index.mro(cls)[0]:
        for node in ast.walk(owner.node):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            if not any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                       and t.value.id == "self" for t in node.targets):
                continue
            ref = index.resolve_in(owner.module, node.value.func)
            if ref is not None and ref.kind == "class":
                return ref
            for kw in node.value.keywords:
                if kw.arg != "architectures" or not isinstance(kw.value, (ast.List, ast.Tuple)):
                    continue
                names = [e.value for e in kw.value.elts
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                entry = registry_entry(index, names[0]) if names else None
                if entry:
                    ref = index.lookup(registry_module(index, entry[0]), entry[1])
                    if ref is not None and ref.kind == "class":
                        return ref
    return None


def decoder_layer_class(index: PackageIndex, inner: Ref) -> Ref | None:
    """``<Prefix>DecoderLayer`` beside ``<Prefix>Model`` (the only one when there is one)."""
    tree, path = index.tree(inner.module)
    layers = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("DecoderLayer")]
    prefix = inner.name[: -len("Model")] if inner.name.endswith("Model") else inner.name
    preferred = [n for n in layers if n.name == f"{prefix}DecoderLayer"] or (layers if len(layers) == 1 else [])
    if not preferred:
        return None
    return Ref("class", inner.module, preferred[0].name, preferred[0], index.rel(path))


def target_specs(index: PackageIndex, params: dict) -> tuple[list, list]:
    """[(architecture, uses, source)] to check, and problems found choosing them.

    In order: ``params["architecture"]``, ``params["model_family"]``, the model's own
    ``config.json`` (``params["model_path"]``; a ``text_config`` wrapper is looked
    through, since the worker drives the language model), else every family in
    :data:`DEFAULT_ARCHITECTURES` at once, so that a clean result holds for all of them.
    """
    uses, problems, config = {}, [], None
    if params.get("model_path"):
        try:
            config = modelconfig.read(params["model_path"])
        except modelconfig.ConfigError:
            problems.append(f"{params['model_path']}/config.json is missing or unreadable")
    if config is not None:
        uses["llama_4_scaling"] = modelconfig.text_value(config, "llama_4_scaling") is not None
    for key, value in params.items():
        if key.startswith("model_has_") and value is not None:
            uses[key[len("model_has_"):]] = bool(value)
    if params.get("architecture"):
        return [(params["architecture"], uses, "params.architecture")], problems
    family = (params.get("model_family") or "").lower()
    if family:
        if modelconfig.family_architecture(family):
            return [(modelconfig.family_architecture(family), uses, f"model_family={family}")], problems
        problems.append(f"model_family {family!r} is not one of {sorted(modelconfig.FAMILY_ARCHITECTURE)}")
    if config is not None:
        text, wrapped = modelconfig.text_config(config), modelconfig.is_wrapped(config)
        where = f"{params['model_path']}/config.json"
        specs = []
        if wrapped:
            # vLLM builds the wrapper (KimiK25ForConditionalGeneration): the worker's
            # support gate and its model.model meet that class, not the text model.
            wrapper = next((a for a in config.get("architectures") or [] if registry_entry(index, a)), None)
            if wrapper:
                specs.append((wrapper, uses, f"{where} (wrapper)"))
        arch = next((a for a in text.get("architectures") or [] if registry_entry(index, a)), None)
        model_type = modelconfig.model_type(config) or ""
        if arch:
            specs.append((arch, uses, where + (" (text_config)" if wrapped else "")))
        elif modelconfig.family_architecture(model_type):
            specs.append((modelconfig.family_architecture(model_type), uses, f"{where} model_type={model_type}"))
        else:
            problems.append(f"model_type {model_type!r} maps to no family this check knows")
        if specs:
            return specs, problems
    return [(arch, uses, "every known family") for arch in DEFAULT_ARCHITECTURES], problems


def resolve_target(index: PackageIndex, architecture: str, uses: dict, source: str):
    """(Target, "") or (None, why) for one architecture of vLLM's registry."""
    entry = registry_entry(index, architecture)
    if entry is None:
        return None, f"architecture {architecture} is not in vLLM's model registry"
    module, cls_name = registry_module(index, entry[0]), entry[1]
    causal = index.lookup(module, cls_name)
    if causal is None or causal.kind != "class":
        path = index.module_file(module)
        where = index.rel(path) if path else f"{module.replace('.', '/')}.py (not in this vLLM)"
        platform = f" for platform {index.platform}" if index.platform else ""
        return None, f"class {cls_name} of {architecture} not found in {where}{platform} (nor re-exported there)"
    inner = inner_model_class(index, causal)
    layer = decoder_layer_class(index, inner) if inner else None
    return Target(architecture, causal, inner, layer, uses, source), ""


def resolve_targets(index: PackageIndex, params: dict) -> tuple[list, list]:
    specs, problems = target_specs(index, params)
    targets = []
    for arch, uses, source in specs:
        target, why = resolve_target(index, arch, uses, source)
        if target is None:
            problems.append(why)
        else:
            targets.append(target)
    return targets, problems
