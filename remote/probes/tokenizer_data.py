"""Tokenizer files and chat template (static), and the dataset's first records.

What the dataset must look like is what speculators 0.3.0's preprocessing reads
(``speculators/data_generation/preprocessing.py``): a local ``.json``/``.jsonl`` file
whose records hold ``conversations``, a list of turns, each with ``from``/``value`` or
``role``/``content``; roles ``human``/``user``, ``gpt``/``assistant`` and ``system``
(other turns are dropped with a warning). A record without ``conversations`` -- say one
that uses ``messages`` -- is skipped without error, so a whole file of them yields
nothing: here it is a failure. The loss mask needs at least one assistant turn.
"""
from __future__ import annotations

import glob
import json
import os

from remote.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.probes import OBJECT, Context, Malformed, describe, expect

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
#: Engines that turn chat data into tokens with the tokenizer's chat template.
CHAT_ENGINES = {"speculators-0.3"}
#: speculators 0.3.0 ships these names as hub datasets (DATASET_CONFIGS); they download at run time.
HUB_DATASETS = {"sharegpt", "ultrachat"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHECK_RECORDS = 200
#: Files up to this size are counted whole (line count), larger ones only sampled.
COUNT_LIMIT_BYTES = 256 * 1024 * 1024
REPORT_LINES = 20


def probe_tokenizer(ctx: Context) -> list:
    path = ctx.params["model_path"]
    if not os.path.isdir(path):
        return [record("tokenizer.files", SKIPPED, f"model dir {path} does not exist", detail={})]
    found = tokenizer_files(path)
    detail = {"found": found, "tokenizer_config": os.path.isfile(os.path.join(path, "tokenizer_config.json"))}
    if not found:
        records = [record("tokenizer.files", FAIL, f"no tokenizer files in {path}", detail=detail,
                          fix=f"download the tokenizer ({' or '.join(TOKENIZER_FILES[:3])}, tokenizer_config.json) "
                              f"into the model dir")]
    else:
        records = [record("tokenizer.files", OK, f"tokenizer files: {', '.join(found)}", detail=detail)]
    records.append(_chat_template(ctx, path))
    return records


def tokenizer_files(model_path: str) -> list:
    """The tokenizer files in ``model_path`` (names), empty for a config-only model dir."""
    found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, f))]
    return found + sorted(os.path.basename(p) for p in glob.glob(os.path.join(model_path, "*.tiktoken")))


def chat_template_source(model_path: str) -> str | None:
    """Where the chat template lives (tokenizer_config.json key, or its own file), or None.

    :raises Malformed: tokenizer_config.json that is not a JSON object, or whose
        ``chat_template`` is neither a string nor a list of ``{"name", "template"}`` objects
        (the two forms transformers reads).
    """
    name = "tokenizer_config.json"
    try:
        with open(os.path.join(model_path, name), encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        config = {}
    except OSError:
        config = {}  # unreadable here; the tokenizer.load child reports what transformers says
    except ValueError as exc:
        raise Malformed(name, "", "valid JSON", found=f"not valid JSON ({exc})",
                        fix=f"re-download {name}") from None
    expect(config, OBJECT, name, "", fix=f"re-download {name}")
    template = config.get("chat_template")
    if template is not None:
        named = isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template)
        if not (isinstance(template, str) or named):
            raise Malformed(name, "chat_template", "a string (a Jinja template) or a list of "
                            "{\"name\", \"template\"} objects", template,
                            fix=f"fix chat_template in {name}, or re-download it")
        if template:
            return name
    for name in CHAT_TEMPLATE_FILES:
        if os.path.isfile(os.path.join(model_path, name)):
            return name
    if os.path.isdir(os.path.join(model_path, "additional_chat_templates")):
        return "additional_chat_templates/"
    return None


def _chat_template(ctx, path):
    engine = ctx.params["engine"]
    try:
        source = chat_template_source(path)
    except Malformed as exc:
        return record("tokenizer.chat_template", FAIL, exc.summary, detail=dict(exc.detail(), engine=engine),
                      fix=exc.fix)
    detail = {"source": source, "engine": engine, "engine_needs_template": engine in CHAT_ENGINES}
    if source:
        return record("tokenizer.chat_template", OK, f"chat template in {source}", detail=detail)
    if engine in CHAT_ENGINES:
        return record("tokenizer.chat_template", FAIL,
                      f"no chat template: {engine} formats chat data with it and refuses to start without one",
                      detail=detail, fix="add the model's chat template (chat_template in tokenizer_config.json "
                                         "or a chat_template.jinja) to the model dir")
    return record("tokenizer.chat_template", WARN, "no chat template (only pre-tokenized data will work)",
                  detail=detail)


# -- dataset ----------------------------------------------------------------------------------

def record_problems(rec) -> tuple:
    """``(fatal, degraded)`` reasons for one record, as speculators 0.3.0 would treat it."""
    if not isinstance(rec, dict):
        return [f"record is {describe(rec)}, not an object with 'conversations'"], []
    conv = rec.get("conversations")
    if conv is None:
        if "messages" in rec:
            return ["has 'messages' but no 'conversations' (speculators 0.3.0 reads only 'conversations': "
                    "rename the key)"], []
        return [f"no 'conversations' key (keys: {', '.join(sorted(map(str, rec))[:5])})"], []
    if not isinstance(conv, list) or not conv:
        return [f"'conversations' is {describe(conv)}, expected a non-empty list of turns"], []
    fatal, degraded, roles = [], [], []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            fatal.append(f"turn {i} is {describe(turn)}, not an object")
            continue
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role is None:
            fatal.append(f"turn {i} has neither 'from' nor 'role'")
        elif not isinstance(role, str):
            fatal.append(f"turn {i} role is {describe(role)}, expected a string")
            role = None
        elif role not in ROLES:
            degraded.append(f"turn {i} role {role!r} is dropped (known: {', '.join(ROLES)})")
        if not isinstance(content, str):
            fatal.append(f"turn {i} has no string 'value'/'content'")
        roles.append(ROLES.get(role))
    if not fatal and "assistant" not in roles:
        degraded.append("no assistant turn: nothing to train on (empty loss mask)")
    return fatal, degraded


def iter_records(path: str, limit: int):
    """``(line number, parsed record or exception)`` for the first ``limit`` records."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        first = fh.read(1)
        while first and first.isspace():
            first = fh.read(1)
        fh.seek(0)
        if first == "[" and os.path.getsize(path) <= COUNT_LIMIT_BYTES:
            try:
                items = json.load(fh)
            except ValueError as exc:
                yield getattr(exc, "lineno", 1), exc
                return
            for i, item in enumerate(items[:limit]):
                yield i + 1, item  # a JSON array: report the record number
            return
        seen = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as exc:
                yield lineno, exc
            seen += 1
            if seen >= limit:
                return


def count_records(path: str) -> int | None:
    """Non-empty lines of a JSON-lines file, when it is small enough to count quickly."""
    if os.path.getsize(path) > COUNT_LIMIT_BYTES:
        return None
    with open(path, "rb") as fh:
        head = fh.read(64).lstrip()
        if head.startswith(b"["):
            return None
        fh.seek(0)
        return sum(1 for line in fh if line.strip())


def probe_data(ctx: Context) -> list:
    dataset = ctx.params["dataset"]
    if not dataset:
        return [record("data.file", SKIPPED, "no dataset given", detail={})]
    if dataset in HUB_DATASETS:
        return [record("data.file", WARN, f"{dataset!r} is a hub dataset speculators downloads at run time: "
                       "not checked here", detail={"dataset": dataset},
                       fix="download it ahead and pass the local .jsonl path")]
    if not os.path.isfile(dataset):
        return [record("data.file", FAIL, f"dataset {dataset} does not exist", detail={"dataset": dataset},
                       fix="copy the dataset to the host, or fix the dataset path")]
    if not dataset.endswith((".json", ".jsonl")):
        return [record("data.file", FAIL, f"{os.path.basename(dataset)}: speculators 0.3.0 reads only local "
                       f".json/.jsonl files (other names are taken as hub dataset names)",
                       detail={"dataset": dataset}, fix="rename the file to *.jsonl (JSON lines)")]
    total = count_records(dataset)
    size = os.path.getsize(dataset)
    records = [record("data.file", OK, f"{dataset} ({size} bytes"
                      + (f", {total} records)" if total is not None else ")"),
                      detail={"dataset": dataset, "bytes": size, "records": total})]
    if total is not None:
        ctx.data["records"] = total  # capacity counts at most this many samples
    records.append(_records(ctx, dataset))
    return records


def _records(ctx, dataset):
    bad, degraded, checked = [], [], 0
    for lineno, rec in iter_records(dataset, CHECK_RECORDS):
        checked += 1
        if isinstance(rec, Exception):
            bad.append({"line": lineno, "problem": f"not valid JSON: {rec}"})
            continue
        fatal, weak = record_problems(rec)
        if fatal:
            bad.append({"line": lineno, "problem": "; ".join(fatal)})
        elif weak:
            degraded.append({"line": lineno, "problem": "; ".join(weak)})
    detail = {"checked": checked, "bad": bad[:REPORT_LINES], "bad_count": len(bad),
              "degraded": degraded[:REPORT_LINES], "degraded_count": len(degraded),
              "expected": "conversations: [{from|role, value|content}, ...]"}
    if checked == 0:
        return record("data.records", FAIL, "dataset has no records", detail=detail,
                      fix="fill the dataset with JSON lines of {\"conversations\": [...]}")
    if bad:
        lines = ", ".join(str(b["line"]) for b in bad[:10]) + (" ..." if len(bad) > 10 else "")
        return record("data.records", FAIL, f"{len(bad)} of the first {checked} records are bad (lines {lines}): "
                      f"{bad[0]['problem']}", detail=detail,
                      fix="fix or drop those lines; each needs conversations: [{from|role, value|content}, ...]")
    if degraded:
        lines = ", ".join(str(d["line"]) for d in degraded[:10])
        return record("data.records", WARN, f"{len(degraded)} of the first {checked} records lose turns (lines "
                      f"{lines}): {degraded[0]['problem']}", detail=detail,
                      fix="map those roles to user/assistant/system")
    return record("data.records", OK, f"first {checked} records parse with conversations of role/content turns",
                  detail=detail)
