"""``model.<attr>`` on the object vLLM builds must exist on its class.

Checked in every function that gates ``model`` with ``supports_*``: the gate argument is
the causal-LM object vLLM built (``model_runner.model``). A wrapper such as Kimi-K2.5's
keeps its text model in ``language_model`` and has no ``model`` attribute at all; after
an unwrap the attribute is checked on the class the variable then holds.
"""
from __future__ import annotations

import ast

from remote.drift.rules import Context, slug
from remote.drift.rules.gates import gate_protocol
from remote.drift.rules.unwrap import attributes, branch_runs, class_at, fallback_only


def rule(ctx: Context) -> list:
    causal, found = ctx.target.causal, []
    for fn in ast.walk(ctx.spec.tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        gated = {c.args[0].id for c in ast.walk(fn) if isinstance(c, ast.Call) and c.args
                 and isinstance(c.args[0], ast.Name) and gate_protocol(ctx, c) is not None}
        reported = set()
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in gated and isinstance(node.ctx, ast.Load)):
                continue
            cls = class_at(ctx.index, node, node.value.id, causal) or causal
            known = attributes(ctx.index, cls)
            if branch_runs(ctx.index, node, fn, node.value.id, cls) is False:
                continue  # under ``if not hasattr(model, ...)``: never runs for this class
            if node.attr in known or node.attr in reported or fallback_only(node, node.value.id, known):
                continue
            reported.add(node.attr)
            found.append(ctx.finding(node, f"model-attr-{slug(node.attr)}",
                                     f"{cls.name} has no attribute {node.attr!r} ({cls.where})",
                                     hint=f"reach the text model the way {cls.name} holds it",
                                     model_class=cls.name, attribute=node.attr))
    return found
