"""Names speculators imports from vLLM must still exist where it imports them from.

``from vllm.x.y import Z``: ``vllm/x/y.py`` (or the package ``__init__``) must still
define ``Z``, following re-exports and star imports. An import inside a ``try`` that
catches import errors is a compatibility shim, not drift.
"""
from __future__ import annotations

import ast

from remote.drift.pyindex import ancestors
from remote.drift.rules import Context, slug


def rule(ctx: Context) -> list:
    found = []
    for node in ctx.spec.import_nodes:
        if guarded_by_import_error(node):
            continue
        if ctx.index.module_file(node.module) is None:
            found.append(ctx.finding(node, f"import-{slug(node.module)}",
                                     f"module {node.module} no longer exists in the installed vLLM",
                                     hint="import from the module that now holds these names"))
            continue
        for alias in node.names:
            if alias.name != "*" and ctx.index.lookup(node.module, alias.name) is None:
                found.append(ctx.finding(node, f"import-{slug(alias.name)}",
                                         f"{alias.name} is no longer defined in {node.module}",
                                         hint=f"find where vLLM moved {alias.name} and import it from there"))
    return found


def guarded_by_import_error(node) -> bool:
    """True when ``node`` sits in a ``try`` whose handlers catch import errors (compat shims)."""
    for anc in ancestors(node):
        if isinstance(anc, ast.Try):
            for h in anc.handlers:
                caught = ast.unparse(h.type) if h.type is not None else "Exception"
                if "Import" in caught or "Exception" in caught or "AttributeError" in caught:
                    return True
    return False
