"""Layers probe: which decoder layers the run captures, and in which convention.

The engine's default ids are computed from the model's layer count; ids the user gave
are validated with :func:`remote.layers.layer_id_problems`. Either way the record
names the convention (output-of-layer vs input-of-layer), since mixing them is silent.
"""
from __future__ import annotations

from remote import layers
from remote.protocol import FAIL, OK, SKIPPED, record
from remote.probes import Context


def probe(ctx: Context) -> list:
    """Leaves ``{"ids", "convention", "source"}`` in ``ctx.layers`` when the ids are usable."""
    n = ctx.model.get("num_layers")
    engine, given = ctx.params["engine"], ctx.params["layer_ids"]
    if not n:
        return [record("layers.ids", SKIPPED, "no layer count (model config unreadable)", detail={})]
    convention = layers.ENGINE_CONVENTION.get(engine)
    if convention is None:
        return [record("layers.ids", FAIL, f"unknown engine {engine!r}", detail={"engine": engine},
                       fix=f"set engine to one of {sorted(layers.ENGINE_CONVENTION)}")]
    default, _ = layers.default_layer_ids(engine, n)
    ids, source = (list(given), "given") if given is not None else (default, "engine default")
    detail = {"layer_ids": ids, "source": source, "convention": convention,
              "convention_meaning": layers.CONVENTIONS[convention], "engine": engine, "num_layers": n,
              "engine_default": default,
              "hf_hidden_states_index": [layers.hf_hidden_state_index(i, convention)
                                         for i in ids if isinstance(i, int)]}
    problems = layers.layer_id_problems(ids, n, convention)
    if problems:
        detail["problems"] = problems
        fix = ("pass layer_ids explicitly: distinct ids in range for this model" if source == "engine default"
               else f"give distinct integer ids within the range (engine default for {n} layers: {default})")
        return [record("layers.ids", FAIL, f"layer ids {ids} ({source}): {problems[0]}", detail=detail, fix=fix)]
    ctx.layers = {"ids": ids, "convention": convention, "source": source}
    return [record("layers.ids", OK, f"layers {ids} ({source}, {convention} of layer i, {n} layers)",
                   detail=detail)]
