"""The eval history on this laptop: one line per ``specops eval``, and ``specops evals`` to list and compare them.

Every eval that measured something appends one record to ``runs/evals.jsonl`` (the laptop's
run store, ``$SPECOPS_RUNS``; :func:`append` is its one writer, under a lock): the draft by the
sha256 of its config and weights, the target, vLLM's version and the model runner, ``k``, the
temperatures and concurrencies, the prompts by hash, and the numbers (acceptance overall and per
category, the per-position counts, output tok/s, the gate's verdict).

``specops evals`` lists them (``--draft``: a run id or dir as given to eval, or a hash prefix) and
compares each eval with the one before it **on the same draft, target and prompts**: what else
changed (vLLM, runner, k, temperature, concurrency, max tokens) is named, and a drop beyond noise is
flagged.

**Noise.** Acceptance is compared position by position, on the conditional rate
``accepted[i] / accepted[i-1]`` (``accepted[-1]``: the draft steps), each a binomial count the
server's ``..._per_pos`` counters give exactly. A position's drop counts when a two-proportion
z-test gives ``z >= DROP_Z`` (3.0, not 1.96: the steps of one request are not independent, and
several positions are tested at once). The mean acceptance lengths are shown beside it.

    >>> [c["changed"] for c in compare(history())]
    [{'engine.runner': ['v1', 'v2']}]
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from specops import wire
from specops.runs.hostjob import local_runs_root

HISTORY = "evals.jsonl"
#: z of a two-proportion test on one position's conditional acceptance beyond which a drop is not noise
DROP_Z = 3.0
#: what may differ between two evals that are compared: each names what changed
SETUP = ("engine.vllm", "engine.distribution", "engine.runner", "k", "temperature", "concurrency", "max_tokens",
         "force")
#: what must be the same for two evals to be compared at all
SAME = ("draft_sha256", "target", "prompts.sha256")


def history_path() -> Path:
    return local_runs_root() / HISTORY


def entry_of(host: str, draft: str, detail: dict, gate: dict | None = None, force: bool = False) -> dict:
    """The history's record of one eval from its ``eval.acceptance`` detail (what the host measured)."""
    engine = detail.get("engine") or {}
    prompt_set = detail.get("prompt_set") or {}
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host, "draft": draft,
        "draft_sha256": detail.get("draft_sha256"), "draft_dir": detail.get("draft"), "target": detail.get("target"),
        "engine": {"vllm": engine.get("vllm"), "distribution": engine.get("distribution"),
                   "runner": engine.get("runner")},
        "k": detail.get("k"), "temperature": detail.get("temperature"), "concurrency": detail.get("concurrency"),
        "max_tokens": detail.get("max_tokens"), "force": bool(force),
        "prompts": {k: prompt_set.get(k) for k in ("format", "sha256", "path", "rows", "categories")},
        "numbers": {k: detail.get(k) for k in ("mean_acceptance_length", "acceptance_rate", "drafts",
                                               "draft_tokens", "accepted", "per_position", "per_position_accepted",
                                               "tokens_per_s", "baseline_tokens_per_s")},
        "categories": {c: {k: v.get(k) for k in ("mean_acceptance_length", "acceptance_rate", "drafts",
                                                 "per_position_accepted")}
                       for c, v in (detail.get("categories") or {}).items()},
        "cells": [{"temperature": c.get("temperature"), "concurrency": c.get("concurrency"),
                   "mean_acceptance_length": (c.get("all") or {}).get("mean_acceptance_length"),
                   "tokens_per_s": c.get("tokens_per_s"), "speedup": c.get("speedup")}
                  for c in detail.get("cells") or []],
        "gate": None if gate is None else {"status": gate.get("status"),
                                           "below": (gate.get("detail") or {}).get("below")},
    }


def append(entry: dict, path: Path | None = None) -> Path:
    """Add one eval to the history (one JSON line, appended under the history's lock: the one writer)."""
    path = path or history_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with wire.fsutil.FileLock(path.with_name(path.name + ".lock")):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()
    return path


def history(path: Path | None = None) -> list[dict]:
    """Every eval recorded, oldest first; a line that is not a JSON object (a write cut short) is skipped."""
    path = path or history_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def select(entries: list[dict], draft: str | None) -> list[dict]:
    """The evals of ``draft``: the name eval was given, the dir it resolved to, or a prefix of its hash (4+)."""
    if not draft:
        return entries
    return [e for e in entries if draft in (e.get("draft"), e.get("draft_dir"))
            or (len(draft) >= 4 and str(e.get("draft_sha256") or "").startswith(draft))]


def _get(entry: dict, dotted: str):
    value = entry
    for part in dotted.split("."):
        value = (value or {}).get(part) if isinstance(value, dict) else None
    return value


def position_drops(old: list, old_drafts: int, new: list, new_drafts: int, z_limit: float = DROP_Z) -> list[dict]:
    """The positions whose conditional acceptance fell beyond noise (see the module docstring), each
    ``{"position", "old", "new", "z"}``; positions past the shorter ``k`` are not compared."""
    drops = []
    old_base, new_base = old_drafts, new_drafts
    for i in range(min(len(old), len(new))):
        if not old_base or not new_base:
            break
        p1, p2 = old[i] / old_base, new[i] / new_base
        pooled = (old[i] + new[i]) / (old_base + new_base)
        se = math.sqrt(pooled * (1 - pooled) * (1 / old_base + 1 / new_base))
        z = (p1 - p2) / se if se else (math.inf if p1 > p2 else 0.0)
        if z >= z_limit:
            drops.append({"position": i, "old": round(p1, 4), "new": round(p2, 4), "z": round(z, 2)})
        old_base, new_base = old[i], new[i]
    return drops


def compare(entries: list[dict]) -> list[dict]:
    """Each eval against the one before it on the same draft, target and prompts: ``{"before", "after",
    "changed": {key: [old, new]}, "drops": [...], "drop": bool}``."""
    out, last = [], {}
    for index, entry in enumerate(entries):
        if not entry.get("draft_sha256"):
            continue
        key = tuple(json.dumps(_get(entry, k), sort_keys=True) for k in SAME)
        if key in last:
            before_index, before = last[key]
            changed = {k: [_get(before, k), _get(entry, k)] for k in SETUP if _get(before, k) != _get(entry, k)}
            a, b = before.get("numbers") or {}, entry.get("numbers") or {}
            drops = position_drops(a.get("per_position_accepted") or [], int(a.get("drafts") or 0),
                                   b.get("per_position_accepted") or [], int(b.get("drafts") or 0))
            out.append({"before": before_index, "after": index, "changed": changed, "drops": drops,
                        "drop": bool(drops), "length": [a.get("mean_acceptance_length"),
                                                        b.get("mean_acceptance_length")]})
        last[key] = (index, entry)
    return out


def describe_change(comparison: dict) -> str:
    """One line: what changed and whether acceptance fell beyond noise."""
    changed = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in comparison["changed"].items()) or "nothing recorded"
    old, new = comparison["length"]
    if comparison["drop"]:
        where = ", ".join(f"position {d['position']} {d['old']:.1%} -> {d['new']:.1%} (z {d['z']})"
                          for d in comparison["drops"])
        return f"DROP beyond noise, mean acceptance length {old} -> {new} ({where}); changed: {changed}"
    return f"no drop beyond noise ({old} -> {new}); changed: {changed}"


def listing(draft: str | None = None, path: Path | None = None) -> dict:
    """``specops evals``'s document: the evals of ``draft`` and each comparison of them."""
    entries = select(history(path), draft)
    comparisons = compare(entries)
    for c in comparisons:
        c["summary"] = describe_change(c)
    return {"history": str(path or history_path()), "evals": entries, "comparisons": comparisons,
            "drop": any(c["drop"] for c in comparisons)}


def show(draft: str | None = None, as_json: bool = False, path: Path | None = None) -> int:
    """Print the history (a table, or ``--json``: :func:`listing`'s document); the exit code: 1 when a drop beyond
    noise is flagged, else 0."""
    import sys

    from rich.table import Table
    from rich.text import Text

    from specops.exit_codes import ExitCode
    from specops.report import console

    doc = listing(draft, path)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return int(ExitCode.FAILED if doc["drop"] else ExitCode.SUCCESS)
    if not doc["evals"]:
        console.print(Text(f"no eval recorded{' of ' + draft if draft else ''} in {doc['history']}"))
        return int(ExitCode.SUCCESS)
    table = Table(title=f"evals ({doc['history']})")
    for column in ("#", "time", "host", "draft", "sha256", "vLLM", "runner", "k", "temp", "conc", "prompts",
                   "accept len", "tok/s", "gate"):
        table.add_column(column)
    for i, e in enumerate(doc["evals"]):
        engine, numbers, prompts = e.get("engine") or {}, e.get("numbers") or {}, e.get("prompts") or {}
        table.add_row(str(i), str(e.get("time")), str(e.get("host")), str(e.get("draft")),
                      str(e.get("draft_sha256") or "")[:12], str(engine.get("vllm")), str(engine.get("runner")),
                      str(e.get("k")), str(e.get("temperature")), str(e.get("concurrency")),
                      f"{prompts.get('format')} {str(prompts.get('sha256') or '')[:8]}",
                      str(numbers.get("mean_acceptance_length")), str(numbers.get("tokens_per_s")),
                      str((e.get("gate") or {}).get("status") or "-"))
    console.print(table)
    for c in doc["comparisons"]:
        style = "bold red" if c["drop"] else "green"
        console.print(Text(f"#{c['before']} -> #{c['after']}: ", style=style) + Text(c["summary"]))
    return int(ExitCode.FAILED if doc["drop"] else ExitCode.SUCCESS)


ACCEPTANCE_PNG, CONCURRENCY_PNG, EVAL_JSON = "acceptance.png", "concurrency.png", "eval.json"


def eval_dir(host: str, detail: dict) -> Path:
    """Where the laptop keeps one eval's pictures and numbers: ``runs/<host>/evals/<name>`` (the host's own name
    of the eval), beside a run's fetched dirs (``runs/<host>/<run-id>``, where a train run's curve is)."""
    return local_runs_root() / host / "evals" / Path(str(detail.get("eval_dir") or "eval")).name


def draw(detail: dict, dest: Path) -> tuple[list[str], str | None]:
    """The eval's numbers (``eval.json``) and two pictures in ``dest``: acceptance per position per category (the
    first cell of the sweep), and output tok/s against concurrency per temperature (the plain server's dashed,
    with --baseline). ``(files written, why the pictures were not drawn or None)``."""
    dest.mkdir(parents=True, exist_ok=True)
    wire.fsutil.atomic_write(dest / EVAL_JSON, json.dumps(detail, indent=2, sort_keys=True))
    written = [EVAL_JSON]
    cells = detail.get("cells") or []
    if not cells:
        return written, "no cell measured"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a laptop's ssh session or in CI
        import matplotlib.pyplot as plt
    except ImportError:
        return written, "matplotlib is not installed: pip install 'specops[plot]'"
    first = cells[0]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, acc in [("all", first["all"])] + sorted((first.get("categories") or {}).items()):
        rates = acc.get("per_position") or []
        ax.plot(range(len(rates)), [r if r is not None else float("nan") for r in rates], marker="o",
                label=f"{name} ({acc.get('mean_acceptance_length')})", linewidth=2.5 if name == "all" else 1.2)
    ax.set_xticks(range(len(first["all"].get("per_position") or [])))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / draft steps")
    ax.set_ylim(0, 1)
    ax.set_title(f"k={detail.get('k')}, t={first['temperature']}, c={first['concurrency']}: acceptance per position "
                 f"(mean acceptance length)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest / ACCEPTANCE_PNG, dpi=100)
    plt.close(fig)
    written.append(ACCEPTANCE_PNG)
    fig, ax = plt.subplots(figsize=(7, 4))
    for temperature in dict.fromkeys(c["temperature"] for c in cells):
        row = sorted((c for c in cells if c["temperature"] == temperature), key=lambda c: c["concurrency"])
        line, = ax.plot([c["concurrency"] for c in row], [c.get("tokens_per_s") or float("nan") for c in row],
                        marker="o", label=f"draft, t={temperature}")
        if any(c.get("baseline_tokens_per_s") for c in row):
            ax.plot([c["concurrency"] for c in row], [c.get("baseline_tokens_per_s") or float("nan") for c in row],
                    linestyle="--", color=line.get_color(), label=f"plain, t={temperature}")
    levels = sorted({c["concurrency"] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("output tokens/s against concurrency", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest / CONCURRENCY_PNG, dpi=100)
    plt.close(fig)
    written.append(CONCURRENCY_PNG)
    return written, None
