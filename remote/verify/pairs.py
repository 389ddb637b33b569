"""The ids a short verification run captures so that the layer check reaches every kind of layer.

A run's own ids rarely hold a consecutive pair (the EAGLE-3 defaults ``[2, N//2, N-3, N]``
hold none), and the layer-local check (:mod:`remote.verify.layer`) needs decoder layer
``j``'s input and output for the same tokens. The server captures one set of ids for every
request, so the pairs cannot be asked for a few samples only: capturing an extra id in the
real run and dropping it as each sample lands costs every sample its bytes and a rewrite.
Instead a short run of the real model, its own ids, a handful of samples -- ``specops smoke
--real`` -- captures the run's ids plus one pair per kind of layer the model has, chosen here:

* the first layer, 0, on its tokens' embedding rows (read from the checkpoint) where the model
  type takes them plain (:data:`~remote.verify.layerload.PLAIN_EMBEDDING_TYPES`): one extra id,
  ``input:1``; otherwise layer 1 (``input:0`` is not captured by every engine);
* the last layer, ``N-1`` (``input:N-1`` -> ``input:N``, the final state);
* for each other kind still missing (dense, MoE, each attention type of ``layer_types``), the
  layer of that kind nearest the middle.

Everything is read from ``config.json`` and the checkpoint's index or headers; stdlib only.
"""
from __future__ import annotations

from remote.system import modelconfig
from remote.verify.layerload import PLAIN_EMBEDDING_TYPES, Checkpoint, layer_kinds
from remote.wire import layers


def choose_layers(kinds: dict, num_layers: int, plain_embedding: bool) -> list:
    """Decoder layers whose check covers every kind in ``kinds`` (layer -> kinds), sorted."""
    chosen = [0 if plain_embedding or num_layers == 1 else 1, num_layers - 1]
    covered = {k for j in chosen for k in kinds[j]}
    middle = num_layers // 2
    for kind in sorted({k for ks in kinds.values() for k in ks} - covered):
        have = [j for j in range(num_layers) if kind in kinds[j] and (j > 0 or plain_embedding)]
        if have and kind not in covered:
            j = min(have, key=lambda x: (abs(x - middle), x))
            chosen.append(j)
            covered.update(kinds[j])
    return sorted(set(chosen))


def pair_of(j: int, convention: str, embedded: bool) -> list:
    """The ids (in ``convention``) that give decoder layer ``j`` its input and output; layer 0's input
    is the embedding rows when ``embedded``."""
    if convention == layers.OUTPUT:
        return [j] if j == 0 else [j - 1, j]
    return [1] if j == 0 and embedded else [j, j + 1]


def verification_ids(model_path, config: dict, convention: str, run_ids) -> dict:
    """What a verification run of ``model_path`` captures: ``layer_ids`` (in ``convention``: the run's
    ``run_ids`` and a pair per chosen layer, sorted), ``layers`` (decoder layer -> its kinds),
    ``extra`` (the ids the run itself does not capture) and ``convention``."""
    num_layers = modelconfig.decoder_layers(config)
    embedded = modelconfig.model_type(config) in PLAIN_EMBEDDING_TYPES
    kinds = layer_kinds(Checkpoint(model_path, num_layers), modelconfig.text_config(config), num_layers)
    chosen = choose_layers(kinds, num_layers, embedded)
    run_ids = [int(x) for x in (run_ids or [])]
    ids = set(run_ids)
    for j in chosen:
        ids.update(pair_of(j, convention, embedded))
    top = layers.top_id(convention, num_layers)
    ids = sorted(i for i in ids if 0 <= i <= top)
    return {"layer_ids": ids, "convention": convention, "layers": {j: kinds[j] for j in chosen},
            "extra": [i for i in ids if i not in run_ids], "num_layers": num_layers}
