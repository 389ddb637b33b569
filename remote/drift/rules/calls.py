"""Every call speculators makes to a vLLM callable binds against that callable's signature.

The callee is an imported function or class, a static or class method called on an
imported class, or a method on an object built from an imported class
(``self.executor = MultiprocExecutor(...)`` then ``self.executor.collective_rpc(...)``).
Its signature is its ``__init__`` or its dataclass fields (a field without a default is
required; ``init=False`` fields are not parameters). A missing required argument, an
unknown keyword or surplus positional arguments are drift; a method the class no longer
has is drift too, when the whole class hierarchy is in vLLM's tree.
"""
from __future__ import annotations

import ast

from remote.drift.pyindex import Ref, callable_signature, enclosing_function, field_line
from remote.drift.rules import Context, slug

#: (callee, parameter) -> stable id for signature findings; "*" matches any parameter.
CALL_IDS = {
    ("SchedulerConfig", "is_encoder_decoder"): "scheduler-config-is-encoder-decoder",
    ("get_kv_cache_config_from_groups", "*"): "kv-cache-config-from-groups",
    ("Scheduler", "block_size"): "scheduler-block-size",
}


def rule(ctx: Context) -> list:
    found = []
    for call in ctx.spec.calls():
        ref = ctx.spec.resolve(call.func)
        if ref is not None and ref.kind in ("class", "function", "classmethod", "staticmethod"):
            ctx.site(call)
            found += bind(ctx, call, ref, ref.name, callable_signature(ctx.index, ref))
    for call, cls, method in ctx.spec.method_calls():
        ctx.site(call)
        hit = ctx.index.class_member(cls, method)
        if hit is None:
            _order, external = ctx.index.mro(cls)
            if not external:
                found.append(ctx.finding(call, f"method-{slug(cls.name)}-{slug(method)}",
                                         f"{cls.name} has no method {method} in the installed vLLM ({cls.where})",
                                         hint=f"replace the call with {cls.name}'s current API"))
            continue
        node, owner = hit
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sig = callable_signature(ctx.index, Ref("function", owner.module, method, node, owner.path),
                                     bound_method=True)
            found += bind(ctx, call, cls, f"{cls.name}.{method}", sig)
    return found


def bind(ctx: Context, call, ref, callee: str, sig) -> list:
    """Findings for ``call`` bound against ``sig`` (``ref``: the callee, for a field's line)."""
    if sig is None:
        return []
    found = []
    missing, unknown, surplus = sig.bind(call, enclosing_function(call))
    short = callee.rsplit(".", 1)[-1] if "." in callee else callee
    for name in missing:
        where = (field_line(ctx.index, ref, name) if ref.kind == "class" else None) or sig.where
        drift_id = CALL_IDS.get((short, name)) or CALL_IDS.get((short, "*")) or f"call-{slug(callee)}-{slug(name)}"
        found.append(ctx.finding(call, drift_id, f"{callee}(...) misses required argument {name!r} ({where})",
                                 hint=f"pass {name}=... to {callee}", callee=callee, missing=name, vllm=where))
    for name in unknown:
        drift_id = CALL_IDS.get((short, name)) or CALL_IDS.get((short, "*")) or f"call-{slug(callee)}-{slug(name)}"
        found.append(ctx.finding(call, drift_id,
                                 f"{callee}(...) passes {name!r}, which vLLM no longer accepts ({sig.where})",
                                 hint=f"drop {name}= from the {callee} call", callee=callee, unknown=name,
                                 vllm=sig.where))
    if surplus:
        found.append(ctx.finding(call, f"call-{slug(callee)}-positional",
                                 f"{callee}(...) passes {surplus} positional argument(s) too many ({sig.where})",
                                 hint=f"match {callee}'s current signature", callee=callee, vllm=sig.where))
    return found
