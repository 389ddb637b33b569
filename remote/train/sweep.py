"""The spec-decode counters of vLLM's /metrics and the eval sweep's arithmetic (stdlib only).

``eval`` reads the server's counters before and after each category of prompts at each temperature and
concurrency (:func:`read_metrics`); the difference is that share's acceptance (:func:`acceptance`), each
cell of the sweep is summarized with its per-request histograms (:func:`cell_results`), the categories
pooled over the sweep (:func:`pooled_categories`), and the gate judges each category's worst cell
(:func:`gate_lengths`).
"""
from __future__ import annotations

import re

from remote.train import gate
from remote.wire import protocol

#: the spec-decode counters of vLLM >= 0.10's /metrics (a counter's samples end in ``_total``).
METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_SAMPLE_RE = re.compile(r'^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)')
_POS_RE = re.compile(r'position="(\d+)"')


def read_metrics(text: str) -> dict:
    """The spec-decode counters of a /metrics page, summed over label sets; ``per_pos``: position -> count."""
    out = {name: 0.0 for name in METRICS}
    per_pos: dict[int, float] = {}
    seen = False
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        base = name[:-6] if name.endswith("_total") else name
        if base in out:
            out[base] += value
            seen = True
        elif base == PER_POS:
            pos = _POS_RE.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    return {"found": seen, **out, "per_pos": per_pos}


def acceptance(before: dict, after: dict, k: int) -> dict:
    """Mean acceptance length and rates from two /metrics readings (the prompts' share alone)."""
    delta = {name: after[name] - before[name] for name in METRICS}
    drafts, draft_tokens, accepted = (delta[n] for n in METRICS)
    per_pos = [after["per_pos"].get(i, 0.0) - before["per_pos"].get(i, 0.0) for i in range(k)]
    return {"drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted": int(accepted),
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
            "per_position": [round(a / drafts, 4) if drafts else None for a in per_pos],
            "per_position_accepted": [int(a) for a in per_pos]}


def cell_results(cells: list, k: int) -> list:
    """Each cell of the sweep (temperature x concurrency): acceptance over the whole set and per category, output
    tokens/s, and the per-request histograms where the server gave them."""
    from remote.train import specmetrics

    out = []
    for cell in cells:
        cats = cell["categories"]
        firsts, lasts = next(iter(cats.values())), list(cats.values())[-1]
        categories = {}
        for name, c in cats.items():
            categories[name] = {**acceptance(c["before"], c["after"], k), "output_tokens": c["output_tokens"],
                                "tokens_per_s": round(c["output_tokens"] / c["seconds"], 1) if c["seconds"] else None}
            per_request = specmetrics.summarize(c["spec"])
            if per_request:
                categories[name]["per_request"] = per_request
        whole = {**acceptance(firsts["before"], lasts["after"], k)}
        per_request = specmetrics.summarize([m for c in cats.values() for m in c["spec"]])
        if per_request:
            whole["per_request"] = per_request
        out.append({"temperature": cell["temperature"], "concurrency": cell["concurrency"],
                    "tokens_per_s": cell["tokens_per_s"], "output_tokens": cell["output_tokens"],
                    "all": whole, "categories": categories})
    return out


def pooled_categories(cells: list, k: int) -> dict:
    """Per category, the counters summed over every cell: its acceptance over the whole sweep."""
    out = {}
    for name in cells[0]["categories"]:
        zero = {n: 0.0 for n in METRICS} | {"per_pos": {}}
        before, after = dict(zero, per_pos={}), dict(zero, per_pos={})
        for cell in cells:
            c = cell["categories"][name]
            for n in METRICS:
                before[n] += c["before"][n]
                after[n] += c["after"][n]
            for pos in set(c["before"]["per_pos"]) | set(c["after"]["per_pos"]):
                before["per_pos"][pos] = before["per_pos"].get(pos, 0.0) + c["before"]["per_pos"].get(pos, 0.0)
                after["per_pos"][pos] = after["per_pos"].get(pos, 0.0) + c["after"]["per_pos"].get(pos, 0.0)
        out[name] = acceptance(before, after, k)
    return out


def gate_lengths(cells: list) -> dict:
    """``{category: mean acceptance length}`` for the gate: each category's WORST cell of the sweep (a draft must
    clear its bar at every temperature and concurrency measured), ``all``: the worst cell's whole set."""
    lengths: dict = {}
    for cell in cells:
        for name, acc in [(gate.OVERALL, cell["all"])] + list(cell["categories"].items()):
            length = acc.get("mean_acceptance_length")
            if name not in lengths or length is None or (lengths[name] is not None and length < lengths[name]):
                lengths[name] = length
    return lengths


def sweep_record(cells: list) -> dict:
    """``eval.sweep``: mean acceptance length per category and output tok/s at each temperature and concurrency."""
    lines = []
    for cell in cells:
        cats = ", ".join(f"{n} {a['mean_acceptance_length']}" for n, a in cell["categories"].items())
        lines.append(f"t={cell['temperature']} c={cell['concurrency']}: {cell['all']['mean_acceptance_length']} "
                     f"({cats}), {cell['tokens_per_s']} tok/s")
    return protocol.record("eval.sweep", protocol.OK, "; ".join(lines), detail={"cells": cells})
