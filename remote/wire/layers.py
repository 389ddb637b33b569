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


# --------------------------------------------------------------------------- draft algorithms

class Algorithm:
    """What one draft algorithm needs of the states, and how its serving engine counts their ids.

    Which algorithms a host *trains* and *serves* is read from its installed packages
    (:mod:`remote.drift.algorithms`); this table holds what those sources cannot say about
    themselves: how the layer ids line up, and the first releases that have each one (read in
    every released wheel's source, ``tests/test_algorithms.py`` holds them to it).

    :param config_ids: the draft config's field holding the aux ids (speculators' config class).
    :param engine_shift: vLLM's own ``target_layer_ids`` are the config's aux ids plus this
        (``vllm/transformers_utils/configs/speculators/algos.py``: DFlash/DSpark ``i - 1``).
    :param engine_field: where vLLM keeps those shifted ids in the draft's hf config.
    :param context: the drafter reads aux states (MTP reads the final state only).
    :param first_speculators: / :param first_vllm: the first release that trains / serves it
        as a speculators draft (None: none up to the newest read).
    :param method: vLLM's ``--speculative-config`` method for it (its ``base.py``: peagle is served as eagle3,
        dflash2 as dflash); the host reads it from its own vLLM, the laptop's serve line from here.
    """

    __slots__ = ("name", "config_ids", "engine_shift", "engine_field", "context", "first_speculators", "first_vllm",
                 "method")

    def __init__(self, name, config_ids, engine_shift, engine_field, context, first_speculators, first_vllm,
                 method=None):
        self.name, self.config_ids, self.engine_shift, self.engine_field = name, config_ids, engine_shift, engine_field
        self.context, self.first_speculators, self.first_vllm = context, first_speculators, first_vllm
        self.method = method or name

    def __repr__(self) -> str:
        return f"Algorithm({self.name!r})"


_EAGLE_IDS, _DFLASH_IDS = "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids"
#: the newest vLLM whose source the first-release column was read in
NEWEST_VLLM_READ = "0.34.0"
#: algorithm name (speculators' ``SpeculatorModel.register`` name, its config's ``speculators_model_type``)
#: -> its facts. specops' own default is :data:`DEFAULT_ALGORITHM`.
ALGORITHMS = {a.name: a for a in (
    Algorithm("eagle3", _EAGLE_IDS, 0, _EAGLE_IDS, True, "0.3", "0.16"),
    Algorithm("peagle", _EAGLE_IDS, 0, _EAGLE_IDS, True, "0.6", "0.22", method="eagle3"),
    Algorithm("dflash", _DFLASH_IDS, -1, "dflash_config.target_layer_ids", True, "0.5", "0.20"),
    Algorithm("dflash2", _DFLASH_IDS, -1, "dflash_config.target_layer_ids", True, "0.8", "0.29", method="dflash"),
    Algorithm("dspark", _DFLASH_IDS, -1, "target_layer_ids", True, "0.7", "0.25"),
    Algorithm("xpress", _DFLASH_IDS, -1, None, True, "0.9", None),
    Algorithm("mtp", None, 0, None, False, "0.6", None),
)}
DEFAULT_ALGORITHM = contract.DEFAULTS["algorithm"]
#: speculators 0.9's draft layers where ``--num-layers`` is not given (``speculators/train/config/schema.py``:
#: ``num_layers = 5 if is_dflash_family else 1``)
DFLASH_FAMILY_DRAFT_LAYERS = {"dflash": 5, "dflash2": 5, "dspark": 5, "xpress": 5}


def default_draft_layers(algorithm: str) -> int:
    """The draft layers speculators trains for ``algorithm`` unless told otherwise."""
    return DFLASH_FAMILY_DRAFT_LAYERS.get(algorithm, 1)


def algorithm_plan(algorithm: str, state_ids, num_layers: int) -> dict:
    """How states captured at ``state_ids`` (input convention, as an extraction records them) serve ``algorithm``.

    speculators >= 0.5 trains every algorithm on the same files: each file's last layer is the verifier's
    final state (``train/data.py``: ``hidden_states[:, -1]``, the targets of every loss) and the rest are
    the drafter's aux states. The draft's config names those aux ids (:attr:`Algorithm.config_ids`), and
    the serving vLLM counts them its own way (:attr:`Algorithm.engine_shift`: DFlash/DSpark ``aux - 1``,
    so aux id 0, the embeddings, has no target layer there).

    >>> p = algorithm_plan("dspark", [2, 4, 5, 8], 8)
    >>> p["trainer_ids"], p["engine_ids"], p["file_ids"], p["problems"]
    ([2, 4, 5], [1, 3, 4], [2, 4, 5, 8], [])
    >>> algorithm_plan("dspark", [2, 4, 5], 8)["problems"][0][:60]
    'dspark needs the final state (input:8) last: speculators rea'
    >>> algorithm_plan("dflash", [0, 4, 8], 8)["problems"]
    ['dflash counts target layers as aux - 1 in vLLM: aux id 0 (the embeddings) would be layer -1']

    :returns: ``{"algorithm", "state_ids", "final_state", "trainer_ids", "file_ids", "config_ids_field",
        "engine_ids", "engine_field", "needs", "problems"}``; ``file_ids``: a states file's layer axis as the trainer
        reads it (its aux ids ascending, the final state last: what an online run's server captures); ``needs``:
        the ids this algorithm's default extraction captures.
    """
    facts = ALGORITHMS.get(algorithm)
    out = {"algorithm": algorithm, "state_ids": list(state_ids or []), "final_state": num_layers, "trainer_ids": [],
           "file_ids": [], "config_ids_field": None, "engine_ids": [], "engine_field": None, "needs": None,
           "problems": []}
    if facts is None:
        out["problems"] = [f"specops has no layer-id plan for algorithm {algorithm!r}; it plans "
                           f"{', '.join(ALGORITHMS)}"]
        return out
    out["needs"], _ = default_layer_ids(contract.VLLM_SERVER, num_layers)
    ids = [i for i in out["state_ids"] if type(i) is int]
    aux = sorted(i for i in ids if i != num_layers)
    out.update(trainer_ids=aux, file_ids=[*aux, num_layers], config_ids_field=facts.config_ids,
               engine_field=facts.engine_field,
               engine_ids=[i + facts.engine_shift for i in aux])
    if num_layers not in ids or max(ids) != num_layers:
        out["problems"].append(
            f"{algorithm} needs the final state (input:{num_layers}) last: speculators reads each file's last "
            f"layer as the verifier's final state (the targets of its loss), and these states hold {ids}")
    if facts.context and not aux:
        out["problems"].append(f"{algorithm} drafts from aux states and these hold none besides the final state")
    below = [i for i in aux if i + facts.engine_shift < 0]
    if below:
        out["problems"].append(
            f"{algorithm} counts target layers as aux - {-facts.engine_shift} in vLLM: aux id "
            f"{', '.join(map(str, below))} (the embeddings) would be layer "
            f"{', '.join(str(i + facts.engine_shift) for i in below)}")
    return out
