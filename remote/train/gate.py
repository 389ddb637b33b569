"""``--min-acceptance-length``: the bar a draft's mean acceptance length must clear, overall and per category.

The thresholds are a mapping: ``{"*": 2.1}`` is the bar for every category and for the whole
set, ``{"coding": 2.0}`` the bar for one category (a category's own bar wins over ``*``).
Model-Optimizer's specdec_bench gates a new model the same way (acceptance length >= 2.1).
A failed gate is its own record, ``eval.gate``, naming every category below its bar, and the
laptop exits with its own code for it (:class:`specops.exit_codes.ExitCode.GATE_FAILED`).

    >>> judge({"all": 1.8, "coding": 2.4, "writing": 1.3}, {"*": 1.5})["status"]
    'fail'
"""
from __future__ import annotations

from remote.wire import protocol

ALL = "*"
#: the name of the whole prompt set's result beside its categories
OVERALL = "all"
RECORD = "eval.gate"


def check_thresholds(thresholds) -> dict:
    """``{category: float}`` from the parameter, each value a number above 1 (a length counts the bonus token).

    :raises ValueError: naming the category and its value.
    """
    out = {}
    for category, value in (thresholds or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"min_acceptance_length of {category!r} is {value!r}, not a number")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"min_acceptance_length of {category!r} is {value!r}, not a number") from None
        if not 1.0 <= number <= 64.0:
            raise ValueError(f"min_acceptance_length of {category!r} is {number}, outside 1..64 (a mean "
                             f"acceptance length counts the bonus token: 1 is no draft token accepted)")
        out[str(category)] = number
    return out


def judge(lengths: dict, thresholds: dict) -> dict | None:
    """The ``eval.gate`` record for ``lengths`` (category -> mean acceptance length, :data:`OVERALL` the
    whole set), or None when no bar was set. A category with a bar and no number fails too: a gate
    that passes on what was never measured would lie."""
    bars = check_thresholds(thresholds)
    if not bars:
        return None
    unknown = sorted(set(bars) - set(lengths) - {ALL})
    judged, below = {}, []
    for category, length in lengths.items():
        bar = bars.get(category, bars.get(ALL))
        if bar is None:
            continue
        judged[category] = {"length": length, "min": bar}
        if length is None or length < bar:
            below.append(category)
    for category in unknown:
        judged[category] = {"length": None, "min": bars[category]}
        below.append(category)
    detail = {"judged": judged, "below": below, "thresholds": bars}
    if below:
        shown = ", ".join(f"{c} {judged[c]['length'] if judged[c]['length'] is not None else 'not measured'} "
                          f"< {judged[c]['min']}" for c in below)
        return protocol.record(
            RECORD, protocol.FAIL, f"mean acceptance length below the bar in {len(below)} of {len(judged)}: {shown}",
            detail=detail,
            fix=f"improve the draft for {', '.join(below)} (more or closer training data for those categories, "
                f"more epochs, replies written by the target: specops train --regenerate), or lower "
                f"--min-acceptance-length" + (f"; {', '.join(unknown)} had no prompt in the set (categories: "
                                              f"{', '.join(sorted(lengths))})" if unknown else ""))
    return protocol.record(RECORD, protocol.OK, "mean acceptance length clears the bar in every category: " +
                           ", ".join(f"{c} {v['length']} >= {v['min']}" for c, v in judged.items()), detail=detail)
