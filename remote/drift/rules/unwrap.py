"""What a variable of the worker holds, as it unwraps the model vLLM built (no rule of its own).

The worker receives the causal-LM object vLLM built and may unwrap it before use:
the patched worker's ``model = model if hasattr(model, "model") else model.language_model``
is the text model for Kimi-K2.5's wrapper and the model itself for Llama. The gate and
model-attribute rules ask these functions which class a name holds at a given line,
evaluated for one target class at a time. Every answer is three-valued: a step that
cannot be decided gives None, and the caller then checks the object vLLM built, which
may report too much but never hides drift.
"""
from __future__ import annotations

import ast

from remote.drift.pyindex import ancestors, dotted, enclosing_function
from remote.drift.targets import attribute_class

#: torch.nn.Module API a model inherits from outside vLLM (not drift when "missing").
NN_MODULE_API = frozenset(
    "forward to parameters named_parameters modules named_modules children named_children "
    "buffers named_buffers state_dict load_state_dict register_buffer register_module "
    "add_module register_forward_hook register_forward_pre_hook apply eval train cpu cuda "
    "half float bfloat16 get_submodule get_parameter requires_grad_ zero_grad training "
    "__call__ __class__ __dict__".split()
)


def attributes(index, cls) -> set:
    """What ``hasattr`` finds on an instance of ``cls`` (its own names and nn.Module's)."""
    return index.instance_attributes(cls) | NN_MODULE_API


def argument_class(index, call: ast.Call, start):
    """The class of a gate call's first argument at the call (``start`` when unknown)."""
    if call.args and isinstance(call.args[0], ast.Name):
        return class_at(index, call, call.args[0].id, start) or start
    return start


def class_at(index, node, var: str, start):
    """The class ``var`` holds at ``node``, given that it starts as the object vLLM built.

    Follows the assignments to ``var`` before ``node`` in its function, in order. One
    that does not read ``var`` (``model = self.model_runner.model``) starts over at
    ``start``; one that reads it is an unwrap, evaluated for the class it has then:
    ``var.attr``, ``getattr(var, "a", default)``, ``x if hasattr(var, "a") else y``,
    ``getattr(var, "a", None) or y``, and an assignment under ``if [not] hasattr(var,
    "a"):``. ``attr``'s class is read from the class
    (:func:`remote.drift.targets.attribute_class`). None when some step cannot be decided.
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
        runs = branch_runs(index, stmt, fn, var, cls)
        if runs is None:
            return None
        if not runs:
            continue
        reads_var = any(isinstance(n, ast.Name) and n.id == var for n in ast.walk(stmt.value))
        cls = unwrap(index, stmt.value, var, cls) if reads_var else start
        if cls is None:
            return None
    return cls


def branch_runs(index, stmt, fn, var, cls):
    """Whether the ``if`` branches around ``stmt`` run for ``cls``: True, False or None."""
    child = stmt
    for anc in ancestors(stmt):
        if anc is fn:
            return True
        if isinstance(anc, ast.If) and child is not anc.test:
            truth = holds(index, anc.test, var, cls)
            if truth is None:
                return None
            if truth != (child in anc.body):
                return False
        elif isinstance(anc, (ast.For, ast.While, ast.Try, ast.With)) and anc is not fn:
            return None  # a loop or handler: order and count unknown
        child = anc
    return True


def has(index, expr, var, cls):
    """``hasattr(var, "a")`` / ``getattr(var, "a", None)``: whether ``cls`` has ``a``; else None."""
    if (isinstance(expr, ast.Call) and dotted(expr.func) in ("hasattr", "getattr")
            and len(expr.args) >= 2 and isinstance(expr.args[0], ast.Name) and expr.args[0].id == var
            and isinstance(expr.args[1], ast.Constant) and isinstance(expr.args[1].value, str)):
        return expr.args[1].value in attributes(index, cls)
    return None


def holds(index, test, var, cls):
    """Three-valued truth of an ``if`` test about ``var``'s attributes for ``cls``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = holds(index, test.operand, var, cls)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [holds(index, v, var, cls) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in values else (None if None in values else True)
        return True if True in values else (None if None in values else False)
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        found = has(index, test.left, var, cls)
        return None if found is None else found == isinstance(test.ops[0], ast.IsNot)
    return has(index, test, var, cls)


def unwrap(index, expr, var, cls):
    """The class of ``expr`` (which reads ``var``, an instance of ``cls``), or None."""
    if isinstance(expr, ast.Name) and expr.id == var:
        return cls
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == var:
        return attribute_class(index, cls, expr.attr)
    if isinstance(expr, ast.Call) and dotted(expr.func) == "getattr":
        found = has(index, expr, var, cls)
        if found:
            return attribute_class(index, cls, expr.args[1].value)
        if found is False and len(expr.args) == 3:
            return unwrap(index, expr.args[2], var, cls)
        return None
    if isinstance(expr, ast.IfExp):
        truth = holds(index, expr.test, var, cls)
        return None if truth is None else unwrap(index, expr.body if truth else expr.orelse, var, cls)
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
        for value in expr.values:  # the first operand that is there (an object is truthy)
            if has(index, value, var, cls) is False:
                continue
            return unwrap(index, value, var, cls)
    return None


def fallback_only(node, self_name: str, known: set) -> bool:
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
