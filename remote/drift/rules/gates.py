"""``supports_*(model)`` gates that raise, evaluated against the target model's class.

The worker refuses a model that fails ``if not supports_eagle3(model): raise ...``. The
gate function is read from vLLM (the protocol class it tests with ``isinstance``) and
evaluated for the class ``model`` holds at the gate, after any unwrap: DeepSeek's
causal LM implements ``SupportsEagle`` only, so ``supports_eagle3`` is False for it and
the worker raises; ``supports_eagle3(model) or supports_eagle(model)`` passes.
"""
from __future__ import annotations

import ast

from remote.drift.pyindex import dotted, enclosing_function
from remote.drift.rules import Context, slug
from remote.drift.rules.unwrap import argument_class

#: support gate function -> stable id.
GATE_IDS = {"supports_eagle3": "eagle3-support-check"}


def rule(ctx: Context) -> list:
    spec, causal, found = ctx.spec, ctx.target.causal, []
    for node in ast.walk(spec.tree):
        if not isinstance(node, ast.If) or not any(isinstance(s, ast.Raise) for s in node.body):
            continue
        failed = []  # gate calls that are False for the target
        if evaluate(ctx, node.test, causal, failed) is not True or not failed:
            continue
        call, _proto, cls = failed[0]
        fn_name = spec.resolve(call.func).name
        gates = " and ".join(sorted({f"{spec.resolve(c.func).name}(model)" for c, _, _ in failed}))
        protocols = " nor ".join(sorted({p.name for _, p, _ in failed}))
        drift_id = GATE_IDS.get(fn_name, f"support-check-{slug(fn_name)}")
        implements = (f"implements neither {protocols}" if " nor " in protocols
                      else f"does not implement {protocols}")
        found.append(ctx.finding(call, drift_id,
                                 f"{gates} {'are' if ' and ' in gates else 'is'} False for {cls.name} "
                                 f"(it {implements}), so the worker raises",
                                 hint="accept the interfaces the target family implements",
                                 protocols=sorted({p.name for _, p, _ in failed}), model_class=cls.name))
    return found


def gate_protocol(ctx: Context, call):
    """The protocol class a ``supports_x(model)`` function tests with isinstance, or None."""
    ref = ctx.spec.resolve(call.func)
    if ref is None or ref.kind != "function":
        return None
    for node in ast.walk(ref.node):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and \
                dotted(node.value.func) == "isinstance" and len(node.value.args) == 2:
            proto = ctx.index.resolve_in(ref.module, node.value.args[1])
            if proto is not None and proto.kind == "class":
                return proto
    return None


def implements(index, causal, proto) -> bool:
    order, _ = index.mro(causal)
    if any((c.module, c.name) == (proto.module, proto.name) for c in order):
        return True
    # A runtime-checkable protocol with a ClassVar flag: the flag defined as True counts.
    flags = [s.target.id for s in proto.node.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and "ClassVar" in ast.unparse(s.annotation)]
    for flag in flags:
        hit = index.class_member(causal, flag)
        if hit is not None and hit[1] != proto and isinstance(getattr(hit[0], "value", None), ast.Constant) \
                and hit[0].value.value is True:
            return True
    return False


def evaluate(ctx: Context, expr, causal, failed, depth=0):
    """Three-valued truth of a gate expression for the target: True, False or None.

    Understands ``not``/``and``/``or``, ``supports_x(model)`` calls (evaluated
    against the target class), ``name is (not) None`` for a name imported from
    vLLM (it exists), and a local name assigned once from such an expression.
    Gate calls that come out False are appended to ``failed``.
    """
    if depth > 8:
        return None
    again = lambda e: evaluate(ctx, e, causal, failed, depth + 1)  # noqa: E731
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        inner = again(expr.operand)
        return None if inner is None else not inner
    if isinstance(expr, ast.BoolOp):
        values = [again(v) for v in expr.values]
        if isinstance(expr.op, ast.And):
            return False if False in values else (None if None in values else True)
        return True if True in values else (None if None in values else False)
    if isinstance(expr, ast.Call):
        proto = gate_protocol(ctx, expr)
        if proto is not None:
            cls = argument_class(ctx.index, expr, causal)
            ok = implements(ctx.index, cls, proto)
            if not ok:
                failed.append((expr, proto, cls))
            return ok
        return None
    if (isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], (ast.Is, ast.IsNot))
            and isinstance(expr.comparators[0], ast.Constant) and expr.comparators[0].value is None):
        ref = ctx.spec.resolve(expr.left) if isinstance(expr.left, ast.Name) else None
        if ref is None:
            return None
        return isinstance(expr.ops[0], ast.IsNot)
    if isinstance(expr, ast.Name):
        fn = enclosing_function(expr)
        values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)] if fn else []
        return again(values[0]) if len(values) == 1 else None
    return None
