"""EAGLE-3 layer ids and their two conventions (stdlib only).

Mixing the conventions is silent, so every id list specops writes carries its
convention name:

``output``  the OUTPUT of 0-based decoder layer ``i`` (residual stream after layer ``i``).
            speculators 0.3.0 captures ``[2, N//2, N-3, N-1]`` this way. SpecForge and
            Model-Optimizer use output-of-layer ``[1, N//2-1, N-4]``.
``input``   the INPUT of decoder layer ``i``; ``N`` names the final state.
            vLLM / EAGLE / speculators >= 0.5 use ``[2, N//2, N-3]`` (+ ``N``).

In HF ``output_hidden_states`` terms (``hs[0]`` = embeddings, ``hs[k]`` = output of
layer ``k-1``), ``output:i`` is ``hs[i+1]`` and ``input:i`` is ``hs[i]``.

.. note:: HF applies the final norm to ``hs[N]``; vLLM's last layer output (the
   residual sum) is taken *before* that norm. Compare layer ``N-1`` (output) or ``N``
   (input) against the pre-norm residual, not against ``hs[N]``.
"""
from __future__ import annotations

from . import contract

OUTPUT, INPUT = contract.OUTPUT, contract.INPUT
CONVENTIONS = {
    OUTPUT: "output of 0-based decoder layer i (HF hidden_states[i+1])",
    INPUT: "input of 0-based decoder layer i; N = final state (HF hidden_states[i])",
}

#: engine name -> convention of its layer ids (the engine table of :mod:`remote.wire.contract`).
ENGINE_CONVENTION = {name: facts.convention for name, facts in contract.ENGINES.items()}


def default_layer_ids(engine: str, num_layers: int) -> tuple[list[int], str]:
    """The engine's own default ids for a model of ``num_layers`` decoder layers: the EAGLE-3 rule
    (output ``[2, N//2, N-3, N-1]``, input ``[2, N//2, N-3, N]``), made distinct where it collides
    (:func:`distinct_ids`; unchanged from N=7 up)."""
    if type(num_layers) is not int or num_layers < 1:
        raise ValueError(f"layer count {num_layers!r} is not a positive integer")
    n = num_layers
    convention = ENGINE_CONVENTION.get(engine)
    if convention is None:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(ENGINE_CONVENTION)}")
    top = top_id(convention, n)
    return distinct_ids([2, n // 2, n - 3], top), convention


def distinct_ids(wanted: list[int], top: int) -> list[int]:
    """``wanted`` (the lower ids of the EAGLE-3 rule) plus ``top``, made distinct for shallow models.

    From N=7 up the rule's ids are distinct and kept as they are. Below, they
    collide (N=6: ``[2, 3, 3, 5]``; N=5: ``[2, 2, 2, 4]``) and the engine would keep a set: each id already
    taken moves to the nearest free id below ``top``, upward first, then downward; ids are kept ascending.
    A model with fewer ids than asked (output N<=3, input N<=2) gets every id it has.

    >>> distinct_ids([2, 3, 3], 5), distinct_ids([2, 2, 2], 4), distinct_ids([2, 3, 3], 6), distinct_ids([2, 2, 2], 5)
    ([2, 3, 4, 5], [1, 2, 3, 4], [2, 3, 4, 6], [2, 3, 4, 5])
    """
    taken = {top}
    out = []
    for lid in wanted:
        lid = min(max(lid, 0), top - 1)
        if lid in taken or lid < 0:
            free = [x for x in range(lid + 1, top) if x not in taken] or \
                   [x for x in range(lid - 1, -1, -1) if x not in taken]
            if not free:
                continue
            lid = free[0]
        taken.add(lid)
        out.append(lid)
    return sorted(out) + [top]


def top_id(convention: str, num_layers: int) -> int:
    """The highest id ``convention`` has for ``num_layers`` layers: ``N-1`` (output), ``N`` (input, the final state)."""
    return num_layers - 1 if convention == OUTPUT else num_layers


def layer_id_problems(layer_ids, num_layers: int, convention: str) -> list[str]:
    """Every reason the ids cannot be captured as asked; empty when they are fine.

    Duplicates are an error: speculators keeps a *set* of ids, so fewer layers than
    asked come back, silently (the plain rule gives 2, 3, 3, 5 for N=6: :func:`distinct_ids`).
    """
    problems = []
    if convention not in CONVENTIONS:
        return [f"unknown layer convention {convention!r}; use one of {sorted(CONVENTIONS)}"]
    if type(num_layers) is not int or num_layers < 1:
        return [f"the model's layer count {num_layers!r} is not a positive integer"]
    if not isinstance(layer_ids, (list, tuple)):
        return [f"layer ids {layer_ids!r} are not a list of integers"]
    if not layer_ids:
        problems.append("no layer ids given")
    top = top_id(convention, num_layers)
    ints = []
    for lid in layer_ids:
        if type(lid) is not int:  # True is an int to python, never a layer
            problems.append(f"layer id {lid!r} is not an integer")
            continue
        ints.append(lid)
        if lid < 0 or lid > top:
            problems.append(f"layer id {lid} is out of range 0..{top} ({convention} convention, "
                            f"{num_layers} layers)")
    dupes = sorted({x for x in ints if ints.count(x) > 1})
    if dupes:
        problems.append(f"duplicate layer ids {dupes}: the engine keeps a set and would silently "
                        f"return fewer layers")
    return problems


def translate(ids: list, src: str, dst: str, num_layers: int) -> tuple[list, list, list]:
    """``(translated ids, mapping lines, refused lines)`` of ``ids`` from ``src`` to ``dst``.

    Each id is range-checked in ``src``, the convention it was typed in, before it is
    translated: ``output:-1`` would otherwise become ``input:0``, the embeddings.

    >>> translate([2, 4, 5, 7], "output", "input", 8)
    ([3, 5, 6, 8], ['output:2=input:3', 'output:4=input:5', 'output:5=input:6', 'output:7=input:8'], [])
    >>> translate([0, 4], "input", "output", 8)[2]
    ['input:0 (the embeddings) has no output id']
    >>> translate([-1], "output", "input", 8)[2]
    ['output:-1 is out of range 0..7 (8 layers)']
    """
    out, mapping, refused = [], [], []
    top = {c: top_id(c, num_layers) for c in CONVENTIONS}
    for lid in ids:
        if type(lid) is not int:
            out.append(lid)  # layer_id_problems names it
            continue
        (new,) = convert([lid], src, dst)
        if not 0 <= lid <= top[src]:
            refused.append(f"{src}:{lid} is out of range 0..{top[src]} ({num_layers} layers)")
        elif not 0 <= new <= top[dst]:  # only input:0, the embeddings, which no layer outputs
            refused.append(f"{src}:{lid} (the embeddings) has no {dst} id")
        else:
            out.append(new)
            mapping.append(f"{src}:{lid}={dst}:{new}")
    return out, mapping, refused


def resolve(given, asked, engine: str, num_layers: int) -> dict:
    """The layer ids a run captures, decided once for preflight, the shard probe and the supervisor.

    :param given: the ids the user gave (None: the engine's default).
    :param asked: the convention they are written in (None: the engine's own).
    :returns: ``{"ids", "convention", "source", "default", "mapping", "refused", "problems"}``;
        the ids are usable when ``refused`` and ``problems`` are empty. Ids in the other
        convention are range-checked as typed, then translated (:func:`translate`).
    """
    convention = ENGINE_CONVENTION.get(engine)
    out = {"ids": given, "convention": convention, "source": "given", "default": None, "mapping": [],
           "refused": [], "problems": []}
    if convention is None:
        out["problems"] = [f"unknown engine {engine!r}; known: {sorted(ENGINE_CONVENTION)}"]
        return out
    if type(num_layers) is not int or num_layers < 1:
        out["problems"] = [f"the model's layer count {num_layers!r} is not a positive integer"]
        return out
    out["default"], _ = default_layer_ids(engine, num_layers)
    if given is None:
        out.update(ids=list(out["default"]), source="engine default")
    elif not isinstance(given, (list, tuple)):
        out["problems"] = [f"layer ids {given!r} are not a list of integers"]
        return out
    elif asked is not None and asked not in CONVENTIONS:
        out["problems"] = [f"layer_convention {asked!r} is not a layer convention; use one of "
                           f"{sorted(CONVENTIONS)}"]
        return out
    elif asked and asked != convention:
        ids, mapping, refused = translate(list(given), asked, convention, num_layers)
        out.update(ids=ids, mapping=mapping, refused=refused, source=f"given as {asked}:{list(given)}")
        if refused:
            return out
    else:
        out["ids"] = list(given)
    out["problems"] = layer_id_problems(out["ids"], num_layers, convention)
    return out


def hf_hidden_state_index(layer_id: int, convention: str) -> int:
    """Index into HF ``output_hidden_states`` for a layer id in ``convention``."""
    return layer_id + 1 if convention == OUTPUT else layer_id


def convert(layer_ids, src: str, dst: str) -> list[int]:
    """Name the same tensors in the other convention (output:i == input:i+1)."""
    if src == dst:
        return list(layer_ids)
    shift = 1 if (src, dst) == (OUTPUT, INPUT) else -1
    return [i + shift for i in layer_ids]
