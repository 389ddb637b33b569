"""A hidden-states connector's source as this python has it, read with :mod:`ast` (nothing imported).

The drift check (:mod:`remote.drift.server`), the chunked-prefill verdict
(:mod:`remote.extract.engines.vllm_server.chunking`) and the options a run records
(:mod:`remote.extract.engines.vllm_server.command`) all read the same class chain: the connector's
class and its bases, across vLLM, hs-connectors and a test host's overlay.
"""
from __future__ import annotations

import ast
import importlib.machinery
from pathlib import Path

from remote.drift.pyindex import PackageIndex, dotted, parse
from remote.drift.source import site_packages

#: where vLLM registers its connectors by name.
CONNECTOR_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def module_file(module: str, roots=()) -> Path | None:
    """The file of a dotted module, found without running any package's ``__init__``: under
    ``roots`` first (the source tree a check reads), then on this python's import path."""
    for root in roots:
        base = Path(root).joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    head, _, rest = module.partition(".")
    try:
        spec = importlib.machinery.PathFinder.find_spec(head)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for root in spec.submodule_search_locations or ():
        base = Path(root).joinpath(*rest.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def class_chain(module: str, cls_name: str, depth: int = 0, seen=None, roots=()) -> list:
    """``[(path, ast.ClassDef), ...]`` of ``module.cls_name`` and its bases, nearest first
    (depth first, as Python's MRO for the single-inheritance chains connectors have), read
    from the installed files across packages (vLLM, hs-connectors, a test host's overlay).
    A base that cannot be found ends its branch."""
    seen = set() if seen is None else seen
    path = module_file(module, roots) if module else None
    if path is None or (path, cls_name) in seen or depth > 8:
        return []
    seen.add((path, cls_name))
    tree = parse(path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        return []
    imported = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            imported.update({a.asname or a.name: (stmt.module, a.name) for a in stmt.names})
    chain = [(path, cls)]
    for base in cls.bases:
        text = dotted(base) or ""
        head, _, attr = text.partition(".")
        if text in imported:
            chain += class_chain(*imported[text], depth + 1, seen, roots)
        elif attr and head in imported:  # a module imported under a name: module.Class
            chain += class_chain(".".join(imported[head]), attr, depth + 1, seen, roots)
        elif text:
            chain += class_chain(module, text, depth + 1, seen, roots)
    return chain


def connector_module(connector: tuple, index: PackageIndex | None = None) -> str | None:
    """The module of a connector ``(class name, module path or None)``: the given path, or where
    vLLM's factory registers the name."""
    name, module = connector
    if module is None and index is not None:
        entry = registered_connectors(index).get(name)
        module = entry[0] if entry else None
    return module


def installed_connector_chain(connector: tuple) -> tuple[str | None, list]:
    """``(module, class chain)`` of a connector ``(class name, module or None)`` as this python has it (a name
    without a module is looked up in the installed vLLM's connector factory); ``[]`` when it is not found."""
    name, module = connector
    if module is None:
        root = site_packages({})[1]
        module = connector_module(connector, PackageIndex(root) if root else None)
    return module, class_chain(module, name) if module else []


def registered_connectors(index: PackageIndex) -> dict:
    """``{name: (module, class)}`` of ``KVConnectorFactory.register_connector(...)`` calls in the factory."""
    tree, _ = index.tree(CONNECTOR_FACTORY)
    found = {}
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and (dotted(node.func) or "").endswith("register_connector"):
            values = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if len(values) == 3:
                found[values[0]] = (values[1], values[2])
    return found
