"""The run's dataset as token ids and loss masks (stdlib only at import).

A dataset is a JSONL file, one sample a line, in one of two shapes:

* pre-tokenized: ``{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}`` (``loss_mask``
  optional: all ones);
* chat: ``{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
  "content": "hello"}]}`` (or ShareGPT's ``conversations`` with ``from``/``value``),
  rendered with the model tokenizer's chat template; the loss mask is 1 on the tokens of
  assistant turns.

With ``/data/tok.jsonl`` holding the one line ``{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}``::

    >>> load_token_samples({"dataset": "/data/tok.jsonl", "seq_len": 2}, "/models/llama")
    [([1, 2], [0, 1])]

transformers is imported only when a chat row needs the tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path


def load_token_samples(params: dict, model_path: str) -> list[tuple[list[int], list[int]]]:
    """``[(input_ids, loss_mask), ...]`` for the run, in dataset order.

    Rows are JSON objects, one a line: ``{"input_ids": [...], "loss_mask": [...]?}``
    (pre-tokenized) or ``{"messages"|"conversations": [{"role"|"from", "content"|"value"}]}``
    (chat, rendered with the model tokenizer's chat template). ``max_samples`` keeps the
    first rows; ``seq_len`` truncates each sample.

    :raises ValueError: naming the file and line of a row that cannot be used.
    """
    path = Path(params["dataset"])
    max_samples = params.get("max_samples")
    seq_len = int(params.get("seq_len") or 2048)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist on this host; set 'dataset' to a JSONL file")
    rows = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if max_samples is not None and len(rows) >= int(max_samples):
                break
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no samples (empty file or max_samples=0)")
    tokenizer = None
    out = []
    for lineno, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        if "input_ids" in row:
            ids = [int(x) for x in row["input_ids"]]
            mask = [int(x) for x in row.get("loss_mask") or [1] * len(ids)]
            if len(mask) != len(ids):
                raise ValueError(f"{path}:{lineno}: loss_mask has {len(mask)} entries for "
                                 f"{len(ids)} input_ids")
        else:
            if tokenizer is None:
                tokenizer = _load_tokenizer(model_path, params)
            ids, mask = tokenize_chat(tokenizer, _messages(row, path, lineno), where=f"{path}:{lineno}")
        ids, mask = ids[:seq_len], mask[:seq_len]
        if not ids:
            raise ValueError(f"{path}:{lineno}: the sample has no tokens")
        out.append((ids, mask))
    return out


def _load_tokenizer(model_path: str, params: dict):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=bool(params.get("trust_remote_code", True)))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {model_path} has no chat template; add one to "
                         f"tokenizer_config.json or pass a pre-tokenized dataset (rows with input_ids)")
    return tok


def _messages(row: dict, path, lineno) -> list[dict]:
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{path}:{lineno}: a row needs 'input_ids', or 'messages'/'conversations' "
                         f"as a non-empty list of turns")
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "system": "system"}
    norm = []
    for t in turns:
        role = roles.get(t.get("role", t.get("from")))
        if role is None:
            raise ValueError(f"{path}:{lineno}: unknown role {t.get('role', t.get('from'))!r}; "
                             f"use user/assistant/system")
        norm.append({"role": role, "content": t.get("content", t.get("value", ""))})
    return norm


def tokenize_chat(tokenizer, messages: list[dict], where: str = "") -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask of 1 on assistant content.

    Each assistant message's text is located in the rendered conversation (in order) and
    every token whose character span overlaps it is marked, the same rule as speculators
    0.3.0's ``_create_loss_mask_from_offsets``, without guessing role markers by regex.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    spans, cursor = [], 0
    for m in messages:
        content = m["content"]
        if not content:
            continue
        pos = text.find(content, cursor)
        if pos < 0:
            if m["role"] == "assistant":
                raise ValueError(f"{where}: the chat template does not render assistant content "
                                 f"verbatim; cannot build the loss mask")
            continue
        cursor = pos + len(content)
        if m["role"] == "assistant":
            spans.append((pos, cursor))
    mask = [int(any(s < span_end and e > span_start for span_start, span_end in spans))
            for s, e in offsets]
    return ids, mask
