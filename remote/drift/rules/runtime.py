"""What the calls do at run time on this vLLM: four rules that a signature cannot show.

* :func:`two_phase`: vLLM >= 0.12 executes in two phases; ``execute_model`` without a
  later ``sample_tokens`` stalls the batch.
* :func:`block_hasher`: with prefix caching on, vLLM's KV block pool asserts on requests
  built without a ``block_hasher``.
* :func:`cuda_only`: ``torch.cuda.*`` calls that raise on a host without CUDA (``fail``
  on a ``device: cpu`` host, ``warn`` elsewhere), unless guarded by a cuda test or a try.
* :func:`unique_reply`: ``collective_rpc(..., unique_reply_rank=r)`` returns the one
  reply itself; indexing it like the list of replies takes element 0 of that reply.
"""
from __future__ import annotations

import ast

from remote.drift.pyindex import ancestors, class_signature, dotted, enclosing_function, parent, supplied_params
from remote.drift.rules import Context, slug
from remote.wire import protocol

#: torch calls that raise on a host without CUDA -> stable id (generic ids for the rest).
CUDA_ONLY_CALLS = {
    "torch.cuda.mem_get_info": "cuda-mem-get-info",
    "torch.cuda.synchronize": None,
    "torch.cuda.current_device": None,
    "torch.cuda.get_device_properties": None,
    "torch.cuda.set_device": None,
}


def two_phase(ctx: Context) -> list:
    calls = ctx.spec.method_calls()
    called = {name for _c, _cls, name in calls}
    found = []
    for call, cls, method in calls:
        if method == "execute_model" and "sample_tokens" not in called:
            if ctx.index.class_member(cls, "sample_tokens") is not None:
                found.append(ctx.finding(
                    call, "two-phase-execute-model",
                    f"{cls.name}.execute_model is phase one; vLLM expects sample_tokens after it (never called)",
                    hint="call executor.sample_tokens(None) after execute_model"))
    return found


def block_hasher(ctx: Context) -> list:
    caching = prefix_caching(ctx)
    found = []
    for call in ctx.spec.calls():
        ref = ctx.spec.resolve(call.func)
        if ref is None or ref.kind != "class":
            continue
        sig = class_signature(ctx.index, ref)
        if sig is None or "block_hasher" not in sig.keywords:
            continue
        names, open_ended = supplied_params(sig, call, enclosing_function(call))
        if "block_hasher" in names or open_ended or caching is False:
            continue
        found.append(ctx.finding(call, "request-block-hasher",
                                 f"{ref.name}(...) without block_hasher while prefix caching is on: "
                                 "the KV block pool asserts on its missing block hashes",
                                 hint="pass block_hasher=get_request_block_hasher(...) or disable prefix caching"))
    return found


def prefix_caching(ctx: Context) -> bool:
    """False when speculators turns prefix caching off (in any checked file), else vLLM's CacheConfig default."""
    default = True
    for spec in ctx.files:
        for call in spec.calls():
            ref = spec.resolve(call.func)
            if ref is None or ref.kind != "class":
                continue
            hit = ctx.index.class_member(ref, "enable_prefix_caching")
            if hit is None or not isinstance(hit[0], ast.AnnAssign):
                continue
            if isinstance(hit[0].value, ast.Constant):
                default = bool(hit[0].value.value)
            for kw in call.keywords:
                if kw.arg == "enable_prefix_caching" and isinstance(kw.value, ast.Constant):
                    return bool(kw.value.value)
    return default


def cuda_only(ctx: Context) -> list:
    device = (ctx.params.get("device") or "cuda").lower()
    found = []
    for call in ctx.spec.calls():
        name = dotted(call.func) or ""
        head, _, rest = name.partition(".")
        if head not in ctx.spec.torch_names or f"torch.{rest}" not in CUDA_ONLY_CALLS:
            continue
        full = f"torch.{rest}"
        if cuda_guarded(call):
            continue
        drift_id = CUDA_ONLY_CALLS[full] or f"cuda-only-{slug(rest.rsplit('.', 1)[-1])}"
        status = protocol.FAIL if device == "cpu" else protocol.WARN
        found.append(ctx.finding(call, drift_id,
                                 f"{full}() needs a CUDA device: it raises on a CPU host"
                                 + ("" if device == "cpu" else " (fine on this cuda host)"),
                                 status=status, hint="ask the executor instead (determine_available_memory())"))
    return found


def cuda_guarded(call) -> bool:
    """True inside ``if torch.cuda.is_available()`` (or any test naming cuda), or a try."""
    child = call
    for anc in ancestors(call):
        if isinstance(anc, ast.If) and child in anc.body and "cuda" in ast.unparse(anc.test).lower():
            return True
        if isinstance(anc, ast.Try) and child in anc.body and anc.handlers:
            return True
        child = anc
    return False


def unique_reply(ctx: Context) -> list:
    spec, found = ctx.spec, []
    for call in spec.calls():
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "collective_rpc"):
            continue
        rank = next((k for k in call.keywords if k.arg == "unique_reply_rank"), None)
        if rank is None or (isinstance(rank.value, ast.Constant) and rank.value.value is None):
            continue
        cls = spec.receiver_class(call.func.value)
        if cls is not None:
            hit = ctx.index.class_member(cls, "collective_rpc")
            if hit is None or "unique_reply_rank" not in ast.unparse(hit[0].args):
                continue  # the signature check reports an unknown keyword instead
        holder = parent(call)
        if isinstance(holder, ast.Subscript) and holder.value is call and int_index(holder):
            found.append(ctx.finding(holder, "collective-rpc-unique-reply",
                                     "collective_rpc(..., unique_reply_rank=...) returns the reply itself; "
                                     "indexing it takes element 0 of that reply",
                                     hint="use the result directly, without [0]"))
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
                    and int_index(node) and not isinstance_guarded(node, var)):
                found.append(ctx.finding(node, "collective-rpc-unique-reply",
                                         f"{var} = collective_rpc(..., unique_reply_rank=...) is the reply itself, "
                                         f"but is indexed as a list of replies ({var}[...])",
                                         hint=f"use {var} directly, without [0]", rpc_line=call.lineno))
                break
    return found


def isinstance_guarded(node, var) -> bool:
    for anc in ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp)):
            text = ast.unparse(anc.test)
            if "isinstance" in text and var in text:
                return True
    return False


def int_index(sub: ast.Subscript) -> bool:
    """``x[0]`` / ``x[-1]``: indexing a list by position (``x[key]`` is some other use)."""
    index = sub.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
    return isinstance(index, ast.Constant) and type(index.value) is int
