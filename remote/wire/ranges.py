"""Contiguous sample ranges: how a run's samples are split into shards (a group plan's hosts on the laptop,
a Slurm job array's tasks on the login node). Standard library only."""
from __future__ import annotations

import math


def split(total: int, weights: dict[str, float]) -> dict[str, tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of ``range(total)``, in the order of ``weights``.

    Sizes follow the weights by the largest-remainder rule (the sizes add up to
    ``total`` exactly; a tie goes to the earlier host). A host whose share rounds to
    nothing gets an empty range ``(k, k)``: with more hosts than samples, the last ones
    get none.

    :raises ValueError: a negative total, no hosts, or weights that are not positive.
    """
    if total < 0:
        raise ValueError(f"total {total} is negative")
    if not weights:
        raise ValueError("no hosts to split over")
    bad = {k: w for k, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)}
    if bad:
        raise ValueError(f"weights must be positive numbers: {bad}")
    top = max(weights.values())  # ratios in (0, 1]: no sum or product of huge weights overflows
    shares = {k: w / top for k, w in weights.items()}
    whole = sum(shares.values())
    quotas = {k: total * w / whole for k, w in shares.items()}
    sizes = {k: math.floor(q) for k, q in quotas.items()}
    left = total - sum(sizes.values())
    order = sorted(weights, key=lambda k: (-(quotas[k] - sizes[k]), list(weights).index(k)))
    for k in order[:left]:
        sizes[k] += 1
    ranges, at = {}, 0
    for k in weights:
        ranges[k] = (at, at + sizes[k])
        at += sizes[k]
    return ranges
