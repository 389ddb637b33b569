"""Tokenizer files and chat template (static), and the dataset's rows.

The dataset is judged by the run's own reader (:mod:`remote.extract.dataset`): the same rows
(``dataset.rows``: JSON lines split on ``\\n`` only), the same checks (``dataset.check_row``:
UTF-8, one JSON object, ``input_ids`` of whole numbers inside the model's ``vocab_size``
with an optional 0/1 ``loss_mask``, or ``messages``/``conversations`` turns of
``role``/``from`` user, assistant or system with string ``content``/``value``). Every row
the run will send (the first ``max_samples``) is read, up to :data:`CHECK_BYTES`; past
that the record says how many were checked. A bad row fails naming file and line.
"""
from __future__ import annotations

import glob
import json
import os

from remote.extract import dataset as rows_reader
from remote.probes import Context
from remote.system.jsonfile import OBJECT, Malformed, expect
from remote.wire.contract import SPECULATORS_03, param
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import human_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
#: what each row kind (``dataset.check_row``'s first value) is called where a person reads it: a count of
#: rows, not of tokens ("12 pre-tokenized row(s)", never "12 tokens")
ROW_KINDS = {"tokens": "pre-tokenized", "chat": "chat"}

#: Engines that turn chat data into tokens with the tokenizer's chat template.
CHAT_ENGINES = {SPECULATORS_03}
#: speculators' hub dataset names: the run reads a local file, so these fail with a fix.
HUB_DATASETS = {"sharegpt", "ultrachat"}
#: Rows are checked until this many bytes of them are read (``params["data_check_bytes"]``
#: overrides); the rest are only counted, and the record says so.
CHECK_BYTES = 32 * 1024 * 1024
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
    if ctx.params.get("dataset"):  # the run renders chat rows only: data.records judges the rows there are
        return record("tokenizer.chat_template", WARN, "no chat template: only pre-tokenized rows (input_ids) "
                      "can be sent; data.records fails if the dataset has chat rows", detail=detail,
                      fix="add the model's chat template to the model dir to send chat rows")
    if engine in CHAT_ENGINES:
        return record("tokenizer.chat_template", FAIL,
                      f"no chat template: {engine} formats chat data with it and refuses to start without one",
                      detail=detail, fix="add the model's chat template (chat_template in tokenizer_config.json "
                                         "or a chat_template.jinja) to the model dir")
    return record("tokenizer.chat_template", WARN, "no chat template (only pre-tokenized data will work)",
                  detail=detail)


# -- dataset ----------------------------------------------------------------------------------

def probe_data(ctx: Context) -> list:
    inputs = rows_reader.inputs_of(ctx.params["dataset"])
    if not inputs:
        return [record("data.file", SKIPPED, "no dataset given", detail={})]
    dataset = str(inputs[0]) if len(inputs) == 1 else ", ".join(map(str, inputs))
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        hub = len(inputs) == 1 and dataset in HUB_DATASETS
        return [record("data.file", FAIL, f"dataset {', '.join(missing)} does not exist" + (
                       f" (speculators' hub name {dataset!r}: specops reads a local file)" if hub else ""),
                       detail={"dataset": ctx.params["dataset"], "missing": missing},
                       fix="download it ahead and pass the local .jsonl path" if hub
                       else "copy the dataset to the host, or fix the dataset path")]
    odd = [str(p) for p in inputs if p.is_dir() and not rows_reader.is_prepared_dataset(p)]
    if odd:
        return [record("data.file", FAIL, f"dataset {', '.join(odd)} is a directory, but not one `datasets` "
                       f"save_to_disk wrote (no dataset_info.json and state.json)", detail={"dataset": odd},
                       fix="give a JSONL file, or the --output directory of `speculators prepare-data`")]
    prepared = [str(p) for p in inputs if p.is_dir()]
    files = [p for p in inputs if not p.is_dir()]
    # a prepared dir's rows are Arrow (read with `datasets`, which a host may lack): the run reads and checks them
    prepared_note = (f"{', '.join(prepared)}: a prepared dataset (speculators prepare-data's Arrow input_ids / "
                     f"loss_mask, taken as they are); the run checks its rows and its manifest's dataset_report "
                     f"counts them") if prepared else ""
    if not files:
        return [record("data.file", OK, prepared_note, detail={"dataset": ctx.params["dataset"],
                                                                 "source": "prepared-arrow"})]
    size = sum(os.path.getsize(p) for p in files)
    try:
        found = _rows(ctx, files)
    except OSError as exc:  # the run would stop on it too
        return [record("data.file", FAIL, f"dataset {dataset} cannot be read: {exc.strerror or exc}",
                       detail={"dataset": ctx.params["dataset"]},
                       fix="make the dataset readable for this user on this host")]
    total = found["rows"]
    ctx.data["records"] = total  # capacity counts at most this many samples
    limited = " (the first max_samples)" if found["limited"] else ""
    shown = ", ".join(map(str, files))
    return [record("data.file", OK, f"{shown} ({size} bytes, {total} rows to send{limited})"
                   + (f"; {prepared_note}" if prepared else ""),
                   detail={"dataset": ctx.params["dataset"], "bytes": size, "records": total,
                           "max_samples": ctx.params.get("max_samples"), "prepared": prepared}),
            _records(ctx, dataset, found), _lengths(ctx, dataset, found)]


def _rows(ctx, files) -> dict:
    """Every row the run sends from the JSONL inputs (in order), through the run's reader; checked while
    under the byte budget. With several inputs a row is named ``file:line``."""
    budget = int(ctx.params.get("data_check_bytes") or CHECK_BYTES)
    vocab = ctx.model.get("vocab_size")
    vocab = vocab if type(vocab) is int and vocab > 0 else None
    limit = ctx.params.get("max_samples")
    found = {"rows": 0, "checked": 0, "checked_bytes": 0, "bad": [], "bad_count": 0, "degraded": [],
             "degraded_count": 0, "kinds": {}, "first_chat_line": None, "vocab_size": vocab, "budget_bytes": budget,
             "limited": False, "fix": None, "longest": 0, "longest_line": None, "over": 0, "over_lines": []}
    seq_len = int(param(ctx.params, "seq_len"))
    for path, lineno, raw in rows_reader.input_rows([str(p) for p in files], limit):
        where = lineno if len(files) == 1 else f"{path.name}:{lineno}"
        found["rows"] += 1
        if found["checked_bytes"] >= budget:
            continue
        found["checked"] += 1
        found["checked_bytes"] += len(raw)
        try:
            kind, turns, _ = rows_reader.check_row(rows_reader.parse_row(path, lineno, raw), path, lineno, vocab)
        except rows_reader.DatasetError as exc:
            found["bad_count"] += 1
            found["fix"] = found["fix"] or exc.fix
            if len(found["bad"]) < REPORT_LINES:
                found["bad"].append({"line": where, "problem": exc.problem})
            continue
        found["kinds"][kind] = found["kinds"].get(kind, 0) + 1
        if kind == "tokens":  # a chat row's length is known once the run renders it
            if len(turns) > found["longest"]:
                found["longest"], found["longest_line"] = len(turns), where
            if len(turns) > seq_len:
                found["over"] += 1
                if len(found["over_lines"]) < REPORT_LINES:
                    found["over_lines"].append({"line": where, "tokens": len(turns)})
        if kind == "chat":
            found["first_chat_line"] = found["first_chat_line"] or where
            if not any(t["role"] == "assistant" for t in turns):
                found["degraded_count"] += 1
                if len(found["degraded"]) < REPORT_LINES:
                    found["degraded"].append({"line": where, "problem": "no assistant turn: nothing to train on "
                                                                       "(empty loss mask)"})
    found["limited"] = limit is not None and found["rows"] >= int(limit)
    return found


def _lengths(ctx, dataset, found) -> dict:
    """``data.lengths``: the longest pre-tokenized row checked against ``seq_len``, and what the run does
    with longer ones (``long_samples``: truncate to ``seq_len``, or refuse: fail here, as the run would)."""
    seq_len, mode = int(param(ctx.params, "seq_len")), param(ctx.params, "long_samples")
    chat = found["kinds"].get("chat", 0)
    detail = {"seq_len": seq_len, "long_samples": mode, "longest": found["longest"],
              "longest_line": found["longest_line"], "over": found["over"], "over_lines": found["over_lines"],
              "chat_rows": chat, "checked": found["checked"]}
    fate = {"refuse": "refused", "drop": "left out"}.get(mode, "truncated")
    chat_note = f"; {chat} chat row(s) are measured once rendered (and {fate} past seq_len; the run's manifest " \
                f"names them)" if chat else ""
    if not found["longest"]:
        return record("data.lengths", SKIPPED if not chat else OK,
                      f"no pre-tokenized rows to measure{chat_note}", detail=detail)
    longest = f"longest row {found['longest']} tokens (line {found['longest_line']})"
    if not found["over"]:
        return record("data.lengths", OK, f"{longest} <= seq_len {seq_len}: every row is sent whole{chat_note}",
                      detail=detail)
    lines = _lines(found["over_lines"], found["over"])
    if mode == "refuse":
        return record("data.lengths", FAIL, f"{found['over']} row(s) longer than seq_len {seq_len} (lines {lines}; "
                      f"{longest}) and long_samples: refuse", detail=detail,
                      fix=f"raise seq_len to {found['longest']} (the model allows "
                          f"{ctx.model.get('max_position_embeddings') or 'its max_position_embeddings'}), drop those "
                          f"rows from {dataset}, or set long_samples: truncate")
    if mode == "drop":
        return record("data.lengths", WARN, f"{found['over']} row(s) longer than seq_len {seq_len} are left out "
                      f"(long_samples: drop; lines {lines}; {longest}){chat_note}", detail=detail,
                      fix=f"raise seq_len to {found['longest']} to keep them, or set long_samples: truncate to keep "
                          f"their first {seq_len} tokens")
    return record("data.lengths", WARN, f"{found['over']} row(s) longer than seq_len {seq_len} are truncated to "
                  f"{seq_len} tokens (lines {lines}; {longest}){chat_note}", detail=detail,
                  fix=f"raise seq_len to {found['longest']} to keep them whole, or set long_samples: refuse to stop "
                      f"on them")


def _lines(items, count) -> str:
    return ", ".join(str(b["line"]) for b in items[:10]) + (" ..." if count > 10 else "")


def _records(ctx, dataset, found):
    detail = {k: found[k] for k in ("rows", "checked", "checked_bytes", "budget_bytes", "bad", "bad_count",
                                    "degraded", "degraded_count", "kinds", "vocab_size")}
    detail["expected"] = rows_reader.SHAPES
    rows, checked = found["rows"], found["checked"]
    scope = f"all {rows} rows" if checked == rows else \
        f"the first {checked} of {rows} rows ({human_bytes(found['checked_bytes'])}; the run checks the rest " \
        f"when it starts)"
    if rows == 0:
        return record("data.records", FAIL, "dataset has no rows", detail=detail,
                      fix=f"fill the dataset with JSON lines: {rows_reader.SHAPES}")
    if found["bad_count"]:
        first = found["bad"][0]
        return record("data.records", FAIL, f"{found['bad_count']} bad row(s) in {scope} (lines "
                      f"{_lines(found['bad'], found['bad_count'])}): line {first['line']}: {first['problem']}",
                      detail=detail, fix=f"fix or drop those lines in {dataset}; {found['fix']}")
    chat_line = found["first_chat_line"]
    if chat_line is not None:
        try:
            template = chat_template_source(ctx.params["model_path"])
        except Malformed:
            template = "unreadable"  # tokenizer.chat_template fails with the cause
        if template is None:
            return record("data.records", FAIL, f"{found['kinds']['chat']} chat row(s) (line {chat_line} first) "
                          f"but the model has no chat template to render them", detail=detail,
                          fix="add the model's chat template to the model dir, or pass pre-tokenized rows "
                              "(input_ids)")
    kinds = ", ".join(f"{n} {ROW_KINDS.get(k, k)} row(s)" for k, n in sorted(found["kinds"].items()))
    if found["degraded_count"]:
        return record("data.records", WARN, f"{found['degraded_count']} row(s) in {scope} have nothing to train "
                      f"on (lines {_lines(found['degraded'], found['degraded_count'])}): "
                      f"{found['degraded'][0]['problem']}", detail=detail,
                      fix="give each row an assistant turn, or drop those rows")
    return record("data.records", OK, f"{scope} checked, as the run reads them: {kinds}", detail=detail)
