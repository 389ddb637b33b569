r"""``specops eval --prompts FILE``: the benchmark prompt sets users have on disk, one reader per format (stdlib only).

A prompt file is JSON lines (the rule of :func:`remote.extract.dataset.rows`: split on ``\n``
bytes, blank lines skipped, a BOM dropped). Its format is decided by its first row, and every
row must then be of that format; a row that is not is refused naming the file, the line and
the fields that format expects (:class:`remote.extract.dataset.DatasetError`).

=====================  ===============================================  ========================================
format                 a row                                            category
=====================  ===============================================  ========================================
``speed_bench``        ``{"question_id": "...", "category": "coding",   ``category`` (``sub_category`` kept)
                       "sub_category": ..., "turns": ["..."],
                       "source": ..., "difficulty": ..., "multiturn"}``
                       (nvidia/SPEED-Bench, exported to JSONL)
``mt_bench``           ``{"question_id": 81, "category": "writing",     ``category``
                       "turns": ["...", "..."]}`` (FastChat's
                       ``question.jsonl``)
``speculator_bench``   ``{"prompt": "..."}`` (RedHatAI/                 the file's stem (``HumanEval``,
                       speculator_benchmarks: one file per subset,       ``math_reasoning``, ...): one file is
                       the ``prompt`` column GuideLLM sends)             one subset; a row's ``category`` wins
``chat``               the training dataset's rows: ``{"messages":      a row's ``category``, else ``chat``
                       [...]}`` / ``{"conversations": [...]}``, or
                       ``{"input_ids": [...], "loss_mask": [...]}``
=====================  ===============================================  ========================================

A prompt is ``{"id", "category", "turns"}`` where ``turns`` are the user texts of a
conversation (MT-Bench's second turn is sent after the target's own reply to the first),
``{"id", "category", "messages"}`` for a chat row (its turns up to the first assistant turn),
or ``{"id", "category", "ids"}`` for a token row (its ids up to the first supervised one).

    >>> read("mt_bench.jsonl")["categories"]
    {'writing': 2, 'coding': 1}
"""
from __future__ import annotations

import json
from pathlib import Path

from remote.extract.dataset import DatasetError, check_row, parse_row, rows
from remote.system.jsonfile import describe
from remote.wire import fsutil

#: the fields that mark a SPEED-Bench row beside MT-Bench's (SPEED-Bench's dataset card lists them)
SPEED_BENCH_MARKS = ("sub_category", "source", "src_id", "difficulty", "multiturn")
#: format -> the fields a row of it must hold, for the error that names them
EXPECTED = {
    "speed_bench": '{"question_id", "category", "turns": ["..."], "sub_category", "source", ...} (SPEED-Bench)',
    "mt_bench": '{"question_id", "category", "turns": ["...", ...]} (MT-Bench question.jsonl)',
    "speculator_bench": '{"prompt": "..."} (speculator_benchmarks: one file per subset)',
    "chat": '{"messages"|"conversations": [{"role", "content"}, ...]} or {"input_ids": [...]} (a training row)',
}
FORMATS = tuple(EXPECTED)
#: the cap on rows read: a prompt set is sent whole to the host, and a benchmark is hundreds of rows
MAX_PROMPTS = 20000


def detect(row: dict) -> str | None:
    """The format one row is in, or None when it is none of :data:`FORMATS`."""
    if "turns" in row and "question_id" in row:
        return "speed_bench" if any(k in row for k in SPEED_BENCH_MARKS) else "mt_bench"
    if "prompt" in row:
        return "speculator_bench"
    if any(k in row for k in ("messages", "conversations", "input_ids")):
        return "chat"
    return None


def _category(row: dict, path, lineno: int, default: str | None) -> str:
    category = row.get("category", default)
    if not isinstance(category, str) or not category.strip():
        found = "missing" if category is None else describe(category)
        raise DatasetError(path, lineno, f"'category' is {found}, expected a non-empty string",
                           "give each row its category (results are grouped by it)")
    return category.strip()


def _turns(row: dict, path, lineno: int, fmt: str) -> list:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise DatasetError(path, lineno, f"'turns' is {'missing' if 'turns' not in row else describe(turns)}, expected a non-empty list of strings "
                           f"(the user turns)", f"each row of a {fmt} file is {EXPECTED[fmt]}")
    return list(turns)


def _read_speed_bench(row, path, lineno, stem):
    return {"id": str(row.get("question_id")), "category": _category(row, path, lineno, None),
            "sub_category": row.get("sub_category"), "turns": _turns(row, path, lineno, "speed_bench")}


def _read_mt_bench(row, path, lineno, stem):
    return {"id": str(row.get("question_id")), "category": _category(row, path, lineno, None),
            "turns": _turns(row, path, lineno, "mt_bench")}


def _read_speculator_bench(row, path, lineno, stem):
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(path, lineno, f"'prompt' is {describe(prompt)}, expected a non-empty string",
                           f"each row of a speculator benchmark file is {EXPECTED['speculator_bench']}")
    return {"id": str(row.get("id", lineno)), "category": _category(row, path, lineno, stem), "turns": [prompt]}


def _read_chat(row, path, lineno, stem):
    kind, values, mask = check_row(row, path, lineno)
    prompt = {"id": str(row.get("id", lineno)), "category": _category(row, path, lineno, "chat")}
    if kind == "tokens":  # the prompt is the tokens before the first supervised one (the reply)
        cut = mask.index(1) if 1 in mask and mask.index(1) > 0 and 0 in mask else max(1, len(values) // 2)
        return {**prompt, "ids": values[:cut]}
    first_reply = next((i for i, t in enumerate(values) if t["role"] == "assistant"), len(values))
    messages = values[:first_reply]
    if not any(t["role"] == "user" for t in messages):
        raise DatasetError(path, lineno, "no user turn before the first assistant turn: nothing to prompt with",
                           "start the conversation with a user turn")
    return {**prompt, "messages": messages}


READERS = {"speed_bench": _read_speed_bench, "mt_bench": _read_mt_bench,
           "speculator_bench": _read_speculator_bench, "chat": _read_chat}


def read(path, max_prompts: int = MAX_PROMPTS) -> dict:
    """The prompt set in ``path``: ``{"path", "format", "sha256", "prompts", "categories"}``.

    ``sha256`` is of the prompts as read (format, ids, categories, texts), so the same set
    written with other whitespace or key order hashes the same, and an edited prompt does not.

    :raises DatasetError: the file cannot be read, is empty, its first row is no known
        format, or a later row is not of the first row's format (file, line, fields expected).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(path, 0, "no such file", "pass --prompts with a JSONL file of prompts on this machine")
    fmt, prompts, stem = None, [], path.stem
    try:
        for lineno, raw in rows(path, max_prompts):
            row = parse_row(path, lineno, raw)
            found = detect(row)
            if fmt is None:
                if found is None:
                    keys = ", ".join(sorted(map(str, row))[:8]) or "none"
                    raise DatasetError(path, lineno, f"a row of no prompt format specops reads (keys: {keys})",
                                       "write one of: " + "; ".join(f"{k}: {v}" for k, v in EXPECTED.items()))
                fmt = found
            elif found != fmt:
                keys = ", ".join(sorted(map(str, row))[:8]) or "none"
                raise DatasetError(path, lineno, f"this row (keys: {keys}) is not a {fmt} row as line 1 is",
                                   f"each row of a {fmt} file is {EXPECTED[fmt]}; keep one format per file")
            prompts.append(READERS[fmt](row, path, lineno, stem))
    except OSError as exc:
        raise DatasetError(path, 0, f"cannot be read ({exc.strerror or exc})", "check the path and its mode") from None
    if not prompts:
        raise DatasetError(path, 0, "holds no prompt (no non-blank line)", "pass a JSONL file with one prompt a line")
    categories: dict[str, int] = {}
    for p in prompts:
        categories[p["category"]] = categories.get(p["category"], 0) + 1
    canon = json.dumps({"format": fmt, "prompts": prompts}, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return {"path": str(path), "format": fmt, "sha256": fsutil.sha256_bytes(canon), "prompts": prompts,
            "categories": categories}
