"""Functions the worker binds onto the inner model run as that model: check them as its methods.

The worker replaces the inner model's forward (``types.MethodType(fn, model.model)``), so
``fn`` runs as ``LlamaModel`` / ``DeepseekV2Model``:

* every ``self.<name>`` it reads must exist on that class (``get_input_embeddings`` became
  ``embed_input_ids``);
* its ``layer(...)`` calls are bound against the decoder layer's ``forward``, and compared
  with what the model's own ``forward`` passes each layer: an argument the model passes
  that the worker drops (``llama_4_scaling``) runs fine and silently computes wrong
  states (``fail`` when the model's config sets it, ``warn`` otherwise).
"""
from __future__ import annotations

import ast
import difflib

from remote.drift.pyindex import Ref, Signature, layer_calls, supplied_params
from remote.drift.rules import Context, slug
from remote.drift.rules.calls import bind
from remote.drift.rules.unwrap import NN_MODULE_API, fallback_only
from remote.wire import protocol

#: model attribute the worker uses -> stable id.
MODEL_ATTR_IDS = {"get_input_embeddings": "embed-input-ids"}
#: dropped decoder-layer argument -> stable id.
LAYER_ARG_IDS = {"llama_4_scaling": "deepseek-llama4-scaling"}


def rule(ctx: Context) -> list:
    inner = ctx.target.inner
    if inner is None:
        return []
    found = []
    known = ctx.index.instance_attributes(inner)
    external = ctx.spec.externally_assigned_attrs()
    for fn in ctx.spec.bound_functions():
        self_name = fn.args.args[0].arg if fn.args.args else "self"
        reported = set()
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == self_name and isinstance(node.ctx, ast.Load)):
                continue
            name = node.attr
            if name in known or name in external or name in NN_MODULE_API or name in reported:
                continue
            if fallback_only(node, self_name, known | external):
                continue
            reported.add(name)
            similar = similar_name(name, known)
            drift_id = MODEL_ATTR_IDS.get(name, f"model-attr-{slug(name)}")
            found.append(ctx.finding(node, drift_id,
                                     f"{inner.name} has no {name}" + (f" (it has {similar})" if similar else "")
                                     + f" ({inner.where})",
                                     hint=f"use {similar}" if similar else f"use {inner.name}'s current API",
                                     model_class=inner.name, attribute=name))
        found += layer_call_findings(ctx, fn)
    return found


def similar_name(name: str, known: set) -> str:
    """The attribute ``name`` most likely became (shared words first, then spelling), or ''."""
    words = [w for w in name.split("_") if len(w) > 3]
    for cand in sorted(known):
        cwords = [w for w in cand.split("_") if len(w) > 3]
        shared = sum(1 for w in words for c in cwords if w.startswith(c) or c.startswith(w))
        if shared >= 2:
            return cand
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
    return close[0] if close else ""


def layer_call_findings(ctx: Context, fn) -> list:
    """The decoder-layer calls in ``fn``: bound against ``forward``, and held to the model's own call."""
    calls = layer_calls(fn)
    layer, inner = ctx.target.layer, ctx.target.inner
    if not calls or layer is None:
        return []
    hit = ctx.index.class_member(layer, "forward")
    if hit is None or not isinstance(hit[0], ast.FunctionDef):
        return []
    found = []
    sig = Signature.of_function(hit[0], bound=True, where=f"{hit[1].path}:{hit[0].lineno}")
    for call in calls:
        ctx.site(call)
        found += bind(ctx, call, Ref("function", layer.module, f"{layer.name}.forward", hit[0], hit[1].path),
                      f"{layer.name}.forward", sig)
    # What the model's own forward passes each layer is the convention to follow.
    own = ctx.index.class_member(inner, "forward")
    if own is None or not isinstance(own[0], ast.FunctionDef):
        return found
    expected = set()
    for call in layer_calls(own[0]):
        expected |= supplied_params(sig, call, own[0])[0]
    supplied, open_ended = set(), False
    for call in calls:
        names, more = supplied_params(sig, call, fn)
        supplied |= names
        open_ended |= more
    if open_ended:
        return found
    for name in sorted(expected - supplied):
        if name in sig.required:
            continue  # already reported as a missing required argument
        has_it = bool(ctx.target.has(name))
        drift_id = LAYER_ARG_IDS.get(name, f"layer-call-{slug(name)}")
        status = protocol.FAIL if has_it else protocol.WARN
        cause = (f"worker calls {layer.name} without {name}, which {inner.name}.forward passes "
                 f"({own[1].path}:{own[0].lineno}): runs, but states are silently wrong")
        cause += (" for this model (its config sets it)" if has_it
                  else " when a model config sets it (this one does not)" if ctx.target.has(name) is False
                  else " when a model config sets it")
        found.append(ctx.finding(calls[0], drift_id, cause, status=status,
                                 hint=f"compute {name} as {inner.name}.forward does and pass it to every layer",
                                 layer_forward=sig.where))
    return found
