"""A static index of an installed package's source, read with :mod:`ast` (nothing is imported).

:class:`PackageIndex` answers "what is ``vllm.v1.core.sched.scheduler.Scheduler``?" from
the files under one site-packages dir: it resolves modules, follows re-exports and star
imports, linearises in-tree base classes, and reads constructor signatures (``__init__``,
or dataclass / pydantic-dataclass / msgspec fields). :class:`Signature` then binds a call
written in some other file against such a signature::

    >>> index = PackageIndex(Path("/venv/lib/python3.11/site-packages"))
    >>> ref = index.lookup("vllm.config", "SchedulerConfig")
    >>> ref.kind, ref.where                      # vLLM 0.16
    ('class', 'vllm/config/scheduler.py:26')
    >>> class_signature(index, ref).required      # dataclass fields without a default
    ['max_model_len', 'is_encoder_decoder']

Parsed trees are cached per process by path, size and mtime, so a file changed on disk
(``specops patch`` in the same python) is parsed again.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

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


def forget_trees(root) -> None:
    """Drop the parsed trees of the files under ``root`` (a checker that reads many releases in one
    process keeps one release's trees at a time)."""
    prefix = str(Path(root)) + "/"
    for key in [k for k in _TREES if k[0].startswith(prefix)]:
        del _TREES[key]


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


#: ``current_platform.is_<x>()`` answers per platform (vLLM's ``Platform`` methods); a platform
#: not listed answers False to every one of them but ``is_cuda_alike`` for cuda and rocm.
PLATFORM_TESTS = {"cuda": {"is_cuda", "is_cuda_alike"}, "rocm": {"is_rocm", "is_cuda_alike"},
                  "cpu": {"is_cpu"}, "xpu": {"is_xpu"}, "tpu": {"is_tpu"}}


def platform_test(test, platform: str | None):
    """What an ``if`` on vLLM's platform answers on ``platform`` (``"cuda"``, ``"cpu"``...):
    True, False, or None when the test is about something else (both branches may run).

    Reads ``current_platform.is_rocm()``, ``current_platform.device_type == "cpu"``,
    ``TYPE_CHECKING`` (False at run time) and ``not``/``and``/``or`` of those: a per-platform
    package's ``__init__`` (vLLM 0.32+: ``vllm/models/deepseek_v4``) picks its implementation so.
    """
    if platform is None:
        return None
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return False
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = platform_test(test.operand, platform)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [platform_test(v, platform) for v in test.values]
        if isinstance(test.op, ast.Or):
            return True if True in values else (None if None in values else False)
        return False if False in values else (None if None in values else True)
    if isinstance(test, ast.Call) and not test.args and isinstance(test.func, ast.Attribute) \
            and (dotted(test.func.value) or "").endswith("current_platform") and test.func.attr.startswith("is_"):
        return test.func.attr in PLATFORM_TESTS.get(platform, {f"is_{platform}"})
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq)) \
            and (dotted(test.left) or "").endswith("current_platform.device_type") \
            and isinstance(test.comparators[0], ast.Constant):
        same = test.comparators[0].value == platform
        return same if isinstance(test.ops[0], ast.Eq) else not same
    return None


def module_level_statements(body, platform: str | None = None):
    """Statements of a module or class body, descending into if/try/with but not defs.

    With ``platform``, an ``if`` on vLLM's platform (:func:`platform_test`) yields only the
    branch that platform runs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            verdict = platform_test(stmt.test, platform)
            if verdict is not False:
                yield from module_level_statements(stmt.body, platform)
            if verdict is not True:
                yield from module_level_statements(stmt.orelse, platform)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from module_level_statements(block, platform)
            for handler in stmt.handlers:
                yield from module_level_statements(handler.body, platform)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from module_level_statements(stmt.body, platform)


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

    def __init__(self, root: Path, package: str = "vllm", platform: str | None = None):
        self.root = Path(root)
        self.package = package
        #: the host's platform ("cuda", "cpu"...): per-platform imports resolve to its branch
        self.platform = platform

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
        for stmt in module_level_statements(tree.body, self.platform):
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

    # ---- found by name, wherever the release put it

    def files(self, under: str = "") -> list[Path]:
        """The ``.py`` files under the dotted package ``under`` (default: the whole package), sorted."""
        base = self.root.joinpath(*(under or self.package).split("."))
        cache = self.__dict__.setdefault("_files", {})
        if base not in cache:  # a package's files, or a module's one file
            cache[base] = sorted(base.rglob("*.py")) if base.is_dir() else \
                [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else []
        return cache[base]

    def module_of(self, path: Path) -> str:
        parts = list(Path(path).relative_to(self.root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _texts(self, under: str, needle: str):
        """(path, text) of the files under ``under`` whose text holds ``needle`` (a cheap filter
        before parsing: a release has ~3,600 files and a name is in a handful)."""
        for path in self.files(under):
            text = path.read_text(encoding="utf-8", errors="replace")
            if needle in text:
                yield path, text

    def find_classes(self, names, under: str = "") -> list[Ref]:
        """Every class named one of ``names`` defined under ``under``, wherever the release put it."""
        names = (names,) if isinstance(names, str) else tuple(names)
        found = []
        for name in names:
            for path, _text in self._texts(under, f"class {name}"):
                for stmt in module_level_statements(parse(path).body):
                    if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                        found.append(Ref("class", self.module_of(path), name, stmt, self.rel(path)))
        return found

    def key_readers(self, key: str, under: str = "", attributes: bool = True) -> list[str]:
        """``file:line`` of each place under ``under`` that reads the config key ``key``:
        ``getattr(x, key...)``, ``x.get(key)``, ``x[key]`` or ``key in x`` (a docstring or a
        message naming the key is no reader); ``attributes=False``: dict reads only."""
        where = []
        for path, _text in self._texts(under, key):
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.Call):
                    args = node.args[1:2] if attributes and dotted(node.func) in ("getattr", "hasattr") else \
                        node.args[:1] if isinstance(node.func, ast.Attribute) and node.func.attr in (
                            "get", "pop", "setdefault") else []
                elif isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Store):
                    args = [node.slice]
                elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                    args = [node.left]
                else:
                    continue
                if any(isinstance(a, ast.Constant) and a.value == key for a in args):
                    where.append(f"{self.rel(path)}:{node.lineno}")
        return where

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


# ------------------------------------------------------- calls and their arguments


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
