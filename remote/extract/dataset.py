r"""The run's dataset: one reader of its rows, used by the run, preflight and the group plan.

A dataset is a JSON-lines file, one sample a line, in one of two shapes:

* pre-tokenized: ``{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}`` (``loss_mask``
  optional: all ones);
* chat: ``{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
  "content": "hello"}]}`` (or ShareGPT's ``conversations`` with ``from``/``value``),
  rendered with the model tokenizer's chat template; the loss mask is 1 on the tokens of
  assistant turns.

What a row is, is decided here once (:func:`rows`), the JSON-lines rule: the file is
split on ``\n`` bytes only (never on ``\r``, ``\x1c``, ``\u2028`` ... as text-mode
reading or ``str.splitlines`` would), a line holding nothing but JSON whitespace (space,
tab, CR, LF) is skipped, every other line is a row (a UTF-8 BOM before line 1 is
dropped). What a row must hold is decided once too (:func:`check_row`): the run
(:func:`load_token_samples`), preflight (``remote/probes/tokenizer_data.py``) and the
shard probe (``remote/extract/shard.py``) all call these, so they count and accept the same rows.

With ``/data/tok.jsonl`` holding the one line ``{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}``::

    >>> load_token_samples({"dataset": "/data/tok.jsonl", "seq_len": 2}, "/models/llama")
    [([1, 2], [0, 1])]

transformers is imported only when a chat row needs the tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

from remote.system.jsonfile import describe
from remote.wire.contract import param

#: JSON's own whitespace (RFC 8259): a line of only these is blank; \x1c or \u2028 are not.
JSON_WHITESPACE = b" \t\r\n"
BOM = b"\xef\xbb\xbf"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
#: what a row must look like, for messages and fixes
SHAPES = ('{"input_ids": [ints], "loss_mask": [0|1, ...]?} or {"messages"|"conversations": '
          '[{"role"|"from": "user"|"assistant"|"system", "content"|"value": "..."}, ...]}')
TO_JSONL = ("python -c 'import json,sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]' "
            "data.json > data.jsonl")


class DatasetError(ValueError):
    """A row the run cannot use: the message names the file and line (and the sample index
    when the run hit it), what is wrong, and :attr:`fix` says what to do."""

    def __init__(self, path, lineno: int, problem: str, fix: str, sample: int | None = None):
        self.path, self.lineno, self.problem, self.fix, self.sample = str(path), lineno, problem, fix, sample
        where = f"{path}:{lineno}" if sample is None else f"sample {sample}, {path}:{lineno}"
        super().__init__(f"{where}: {problem}; {fix}")

    def at_sample(self, index: int) -> "DatasetError":
        return DatasetError(self.path, self.lineno, self.problem, self.fix, sample=index)


def _limit(max_samples):
    return None if max_samples in (None, "") else int(max_samples)


def rows(path, max_samples=None):
    r"""``(line number, raw bytes)`` of each row a run reads, in order: the first ``max_samples``.

    Lines are split on ``b"\n"`` only and never decoded here, so counting rows parses
    nothing; :func:`parse_row` decodes one.
    """
    limit, seen = _limit(max_samples), 0
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno == 1 and line.startswith(BOM):
                line = line[len(BOM):]
            if not line.strip(JSON_WHITESPACE):
                continue
            if limit is not None and seen >= limit:
                return
            seen += 1
            yield lineno, line


def inputs_of(dataset) -> list:
    """The run's dataset inputs, in the order given: ``dataset`` is one path or a list of them."""
    given = dataset if isinstance(dataset, (list, tuple)) else [dataset] if dataset else []
    return [Path(item) for item in given]


def input_rows(dataset, max_samples=None):
    r"""``(path, line number, raw bytes)`` of each row a run reads across its inputs, in order (the first
    ``max_samples`` in all); a prepared Arrow input yields each row as the JSON bytes of its ``input_ids`` and
    ``loss_mask`` (line number: its 1-based row number), so a digest of the rows covers its tokens too."""
    limit, seen = _limit(max_samples), 0
    for path in inputs_of(dataset):
        left = None if limit is None else limit - seen
        if left is not None and left <= 0:
            return
        if path.is_dir():
            found = ((lineno, json.dumps({"input_ids": ids, "loss_mask": mask}).encode())
                     for _, lineno, _, ids, mask in prepared_rows(path, left))
        else:
            found = rows(path, left)
        for lineno, raw in found:
            seen += 1
            yield path, lineno, raw


def parse_row(path, lineno: int, raw: bytes) -> dict:
    """One row as a JSON object. :raises DatasetError: not UTF-8, not JSON, or not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(path, lineno, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of "
                           f"the line)", "re-encode the file as UTF-8 (iconv -f <its encoding> -t UTF-8)") from None
    try:
        row = json.loads(text)
    except ValueError as exc:
        array = lineno == 1 and text.lstrip().startswith("[")
        raise DatasetError(path, lineno, f"not JSON ({getattr(exc, 'msg', exc)} at column "
                           f"{getattr(exc, 'colno', '?')})",
                           f"the file looks like one JSON array: write one object per line ({TO_JSONL})"
                           if array else "fix or drop the line; each line is one JSON object") from None
    if not isinstance(row, dict):
        raise DatasetError(path, lineno, f"a row is a JSON object, found {describe(row)}",
                           f"one object per line ({TO_JSONL})" if isinstance(row, list)
                           else f"each line is one object: {SHAPES}")
    return row


def _token_ids(path, lineno, key: str, values, vocab_size, mask: bool = False) -> list:
    if not isinstance(values, list) or not values:
        raise DatasetError(path, lineno, f"'{key}' is {describe(values)}, expected a non-empty list of "
                           f"{'0/1 flags' if mask else 'token ids'}", f"each row is {SHAPES}")
    if set(map(type, values)) == {int}:  # the common case at C speed; the loop names the first bad entry
        if (set(values) <= {0, 1}) if mask else (min(values) >= 0 and not (vocab_size and max(values) >= vocab_size)):
            return values
    for pos, value in enumerate(values):
        if type(value) is not int:  # 3.7 would be truncated to 3, true taken for 1: neither is a token
            raise DatasetError(path, lineno, f"{key}[{pos}] is {describe(value)}, expected "
                               f"{'0 or 1' if mask else 'a whole number (a JSON integer)'}",
                               f"write {key} as JSON integers")
        if mask and value not in (0, 1):
            raise DatasetError(path, lineno, f"{key}[{pos}] is {value}, expected 0 or 1",
                               "loss_mask marks each token 1 (trained on) or 0")
        if not mask and value < 0:
            raise DatasetError(path, lineno, f"token id {value} ({key}[{pos}]) is negative",
                               "re-tokenize the row with this model's tokenizer")
        if not mask and vocab_size and value >= vocab_size:
            raise DatasetError(path, lineno, f"token id {value} ({key}[{pos}]) is out of vocabulary (the "
                               f"model's vocab_size is {vocab_size}: ids 0..{vocab_size - 1})",
                               "re-tokenize the row with this model's tokenizer")
    return values


def chat_turns(row: dict, path, lineno: int) -> list:
    """The row's turns as ``[{"role": user|assistant|system, "content": str}]``.

    :raises DatasetError: no turns, a turn that is not an object, an unknown role, or
        content that is not a string.
    """
    key = "messages" if "messages" in row else "conversations"
    turns = row.get(key)
    if key not in row:
        keys = ", ".join(sorted(map(str, row))[:5]) or "none"
        raise DatasetError(path, lineno, f"no 'input_ids', 'messages' or 'conversations' key (keys: {keys})",
                           f"each row is {SHAPES}")
    if not isinstance(turns, list) or not turns:
        raise DatasetError(path, lineno, f"'{key}' is {describe(turns)}, expected a non-empty list of turns",
                           f"each row is {SHAPES}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DatasetError(path, lineno, f"{key}[{i}] is {describe(turn)}, expected an object with "
                               "role and content", 'each turn is {"role": ..., "content": ...}')
        role = turn.get("role", turn.get("from"))
        if not isinstance(role, str) or role not in ROLES:
            found = "missing" if role is None else describe(role)
            raise DatasetError(path, lineno, f"{key}[{i}] role is {found}, expected one of "
                               f"{', '.join(ROLES)}", "map those roles to user/assistant/system")
        content = turn.get("content", turn.get("value"))
        if not isinstance(content, str):
            found = "missing" if content is None else describe(content)
            raise DatasetError(path, lineno, f"{key}[{i}] content is {found}, expected a string",
                               "give each turn its text as a string in 'content' (or 'value')")
        out.append({"role": ROLES[role], "content": content})
    return out


def check_row(row: dict, path, lineno: int, vocab_size=None) -> tuple:
    """``("tokens", input_ids, loss_mask)`` or ``("chat", turns, None)``: what one row holds, checked.

    The one judge of a row, for the run and for preflight alike (the run also renders
    chat rows through the chat template, which preflight leaves to its tokenizer check).
    :raises DatasetError: naming the file, line and what is wrong.
    """
    if "input_ids" in row:
        ids = _token_ids(path, lineno, "input_ids", row["input_ids"], vocab_size)
        mask = row.get("loss_mask")
        if mask is None:
            return "tokens", ids, [1] * len(ids)
        mask = _token_ids(path, lineno, "loss_mask", mask, None, mask=True)
        if len(mask) != len(ids):
            raise DatasetError(path, lineno, f"loss_mask has {len(mask)} entries for {len(ids)} input_ids",
                               "give loss_mask one 0/1 per input id, or leave it out (all ones)")
        return "tokens", ids, mask
    return "chat", chat_turns(row, path, lineno), None


#: how many truncated or dropped samples a report names one by one (the counts cover them all)
REPORT_ITEMS = 20


def installed_speculators() -> dict:
    """``{"version", "per_turn"}`` of the speculators this python would import, read from its files
    (nothing imported): ``per_turn`` when its ``prepare-data`` derives masks at render boundaries
    (``_render_boundary_rows``: one row per assistant turn, end-of-turn supervised, 0.9) rather than
    from the assistant text's character spans (0.3)."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec("speculators")
        version = importlib.metadata.version("speculators")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return {"version": None, "per_turn": False}
    preprocessing = Path(next(iter(spec.submodule_search_locations or [""]), "")) / "data_generation" / \
        "preprocessing.py"
    try:
        per_turn = "_render_boundary_rows" in preprocessing.read_text(encoding="utf-8", errors="replace")
    except OSError:
        per_turn = False
    return {"version": version, "per_turn": per_turn}


def chat_rule(params: dict) -> dict:
    """The rule chat rows are rendered and masked by (``turns``), as the manifest records it."""
    turns = param(params, "turns")
    if turns == "auto":
        found = installed_speculators()
        turns = "per-turn" if found["per_turn"] else "whole"
        source = (f"auto: the installed speculators {found['version']}'s prepare-data rule" if found["version"]
                  else "auto: no speculators installed here; speculators 0.3's rule")
    else:
        source = f"turns: {turns}"
    supervised = ("one sample per assistant turn (an assistant turn with no context before it is skipped): "
                  "the conversation up to that turn, rendered by the chat template; supervised from the end of "
                  "the generation prompt of that turn to the end of the render (the reply, its end-of-turn "
                  "token and what the template writes after it); earlier replies are context"
                  if turns == "per-turn" else
                  "one sample per row: the whole conversation rendered by the chat template; supervised the "
                  "tokens overlapping the text of each assistant reply (not the role markers, not the "
                  "end-of-turn token)")
    return {"turns": turns, "end_of_turn_supervised": turns == "per-turn", "source": source,
            "supervised": supervised}


def is_prepared_dataset(path) -> bool:
    """Whether ``path`` is a ``datasets`` ``save_to_disk`` directory (what speculators' prepare-data writes)."""
    path = Path(path)
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def prepared_rows(path, max_samples=None, vocab_size=None) -> list:
    """``[(index, row number, "tokens", input_ids, loss_mask), ...]`` of a prepared Arrow dataset, as
    speculators' prepare-data wrote them (taken as they are: no re-render), each checked as a JSONL
    token row is (row number: 1-based, in the table's order).

    :raises DatasetError: not a ``save_to_disk`` directory, or the ``input_ids`` / ``loss_mask`` column missing.
    """
    path = Path(path)
    if not is_prepared_dataset(path):  # prepare_samples says so first, naming the field
        raise DatasetError(path, 0, "a directory, but not one `datasets` save_to_disk wrote (no dataset_info.json "
                           "and state.json)", "set 'dataset' to a JSONL file or to the --output directory of "
                           "`speculators prepare-data`")
    from datasets import load_from_disk  # heavy: only for a prepared dataset

    table = load_from_disk(str(path)).with_format(None)  # prepare-data saves it torch-formatted: plain ints here
    missing = [c for c in ("input_ids", "loss_mask") if c not in table.column_names]
    if missing:
        raise DatasetError(path, 0, f"the prepared dataset has no {' / '.join(missing)} column (columns: "
                           f"{', '.join(table.column_names)})", "give the output of `speculators prepare-data` "
                           "(columns input_ids and loss_mask), or a JSONL file")
    limit = _limit(max_samples)
    count = len(table) if limit is None else min(limit, len(table))
    out = []
    for index, row in enumerate(table.select(range(count)).select_columns(["input_ids", "loss_mask"])):
        try:
            out.append((index, index + 1) + check_row({"input_ids": list(row["input_ids"]),
                                                       "loss_mask": list(row["loss_mask"])}, path, index + 1,
                                                      vocab_size))
        except DatasetError as exc:
            raise exc.at_sample(index) from None
    return out


def load_token_samples(params: dict, model_path: str, vocab_size: int | None = None) -> list:
    """``[(input_ids, loss_mask), ...]`` for the run, in dataset order: :func:`prepare_samples`'s samples."""
    return prepare_samples(params, model_path, vocab_size)[0]


def prepare_samples(params: dict, model_path: str, vocab_size: int | None = None) -> tuple:
    """``([(input_ids, loss_mask), ...], report)``: the run's samples, in dataset order, and what
    became of the rows.

    ``dataset`` is one input or a list of them, concatenated in the order given: a JSONL file, or
    the directory speculators' ``prepare-data`` wrote (its ``input_ids`` / ``loss_mask`` taken as
    they are, :func:`prepared_rows`). Every input is found before a row is read; ``report["inputs"]``
    names each, its source kind, its row count and the ``[start, stop)`` range of samples it gave.

    Rows as :func:`rows` reads them and :func:`check_row` judges them; chat rows rendered with
    the model tokenizer's chat template by :func:`chat_rule` (``turns``: a sample per assistant
    turn, or per row). ``max_samples`` keeps the first rows and at most that many samples. A
    sample longer than ``seq_len`` is cut to it (``long_samples: truncate``), stops the run (``refuse``) or is left out
    (``drop``); a sample with fewer supervised tokens than ``minimum_valid_tokens`` (default 1)
    is left out. ``report`` names each (file, line, sample, turn, tokens lost, first
    :data:`REPORT_ITEMS`) and counts them all. Ids at or past ``vocab_size`` (the model's, when
    given) are refused before any of them reaches an engine.

    :raises DatasetError: naming the sample index, the file and the line of a row that
        cannot be used.
    """
    inputs = inputs_of(params["dataset"])
    if not inputs:
        raise ValueError("dataset is an empty list; give one or more JSONL files or prepare-data directories")
    seq_len = int(param(params, "seq_len"))
    long_mode = param(params, "long_samples")
    minimum = int(param(params, "minimum_valid_tokens"))
    vocab_size = vocab_size if type(vocab_size) is int and vocab_size > 0 else None  # a bad config: preflight's
    for number, path in enumerate(inputs):  # every input found before a row is read
        field = "dataset" if len(inputs) == 1 else f"dataset[{number}]"
        if path.is_dir() and not is_prepared_dataset(path):
            raise DatasetError(path, 0, f"{field} is a directory, but not one `datasets` save_to_disk wrote (no "
                               f"dataset_info.json and state.json)", f"set {field} to a JSONL file or to the "
                               f"--output directory of `speculators prepare-data`")
        if not path.is_dir() and not path.is_file():
            raise FileNotFoundError(f"{field} {path} does not exist on this host; set {field} to a JSONL file or "
                                    f"a directory speculators' prepare-data wrote")
    limit, checked, sources = _limit(params.get("max_samples")), [], []
    for number, path in enumerate(inputs):  # concatenated in the order given; max_samples counts them all
        left, first = None if limit is None else max(limit - len(checked), 0), len(checked)
        if path.is_dir():
            source = "prepared-arrow"
            found = [(first + index, lineno, *rest) for index, lineno, *rest in prepared_rows(path, left, vocab_size)]
        else:
            source, found = "jsonl", []  # every row judged before a tokenizer loads: a bad line fails in seconds
            for index, (lineno, raw) in enumerate(rows(path, left), first):
                try:
                    found.append((index, lineno) + check_row(parse_row(path, lineno, raw), path, lineno, vocab_size))
                except DatasetError as exc:
                    raise exc.at_sample(index) from None
        checked.extend(row + (path, number) for row in found)
        sources.append({"file": str(path), "source": source, "rows": len(found), "sample_range": None})
    path = inputs[0] if len(inputs) == 1 else ", ".join(map(str, inputs))
    if not checked:
        raise ValueError(f"{path}: no samples (empty file or max_samples=0)")
    rule = chat_rule(params) if any(row[2] == "chat" for row in checked) else None
    report = {"file": str(path), "source": "+".join(sorted({i["source"] for i in sources})), "inputs": sources,
              "rows": len(checked), "samples": 0, "seq_len": seq_len, "long_samples": long_mode,
              "minimum_valid_tokens": minimum, "chat_rule": rule, "truncated_count": 0, "truncated": [],
              "dropped_count": 0, "dropped": [], "tokens_lost": 0}

    def note(kind: str, item: dict) -> None:
        report[kind + "_count"] += 1
        report["tokens_lost"] += item.get("tokens_lost", 0)
        if len(report[kind]) < REPORT_ITEMS:
            report[kind].append(item)

    tokenizer = None
    out = []
    for index, lineno, kind, ids, mask, path, number in checked:
        where = {"file": str(path), "line": lineno, "row": index}
        if sources[number]["sample_range"] is None:
            sources[number]["sample_range"] = [len(out), len(out)]
        try:
            if kind == "chat":
                if tokenizer is None:
                    tokenizer = _load_tokenizer(model_path, params)
                text = f"row {index}, {path}:{lineno}"
                if rule["turns"] == "per-turn":
                    candidates = []
                    for turn, t_ids, t_mask in tokenize_chat_turns(tokenizer, ids, where=text):
                        # the context alone fills the window: the peer skips the turn
                        if len(t_mask) - sum(t_mask) >= seq_len:
                            note("dropped", dict(where, turn=turn, tokens=len(t_ids), tokens_lost=len(t_ids),
                                                 reason=f"the context before the turn fills seq_len {seq_len}"))
                            continue
                        candidates.append((turn, t_ids, t_mask))
                else:
                    candidates = [(None, *tokenize_chat(tokenizer, ids, where=text))]
            else:
                candidates = [(None, ids, mask)]
            for turn, c_ids, c_mask in candidates:
                if kind == "chat" and c_ids:
                    _token_ids(path, lineno, "the chat template's token ids", c_ids, vocab_size)
                item, cut = dict(where, sample=len(out), **({"turn": turn} if turn is not None else {})), None
                if not c_ids:
                    raise DatasetError(path, lineno, "the sample has no tokens", "drop the row")
                if len(c_ids) > seq_len:
                    lost = len(c_ids) - seq_len
                    if long_mode == "refuse":
                        raise DatasetError(path, lineno, f"the sample{'' if turn is None else f' (turn {turn})'} "
                                           f"has {len(c_ids)} tokens, more than seq_len {seq_len} "
                                           f"(long_samples: refuse)", f"raise seq_len to {len(c_ids)} or more, drop "
                                           f"the row, or set long_samples: truncate (keep its first {seq_len} "
                                           f"tokens) or drop (leave it out)")
                    if long_mode == "drop":
                        item.pop("sample")
                        note("dropped", dict(item, tokens=len(c_ids), tokens_lost=len(c_ids),
                                             reason=f"longer than seq_len {seq_len} (long_samples: drop)"))
                        continue
                    cut = dict(item, tokens=len(c_ids), kept=seq_len, tokens_lost=lost,
                               supervised_lost=sum(c_mask[seq_len:]))
                    note("truncated", cut)
                    c_ids, c_mask = c_ids[:seq_len], c_mask[:seq_len]
                valid = sum(c_mask)
                if valid < minimum:
                    item.pop("sample")
                    if cut is not None:  # cut, then left out: no sample has that index
                        cut.pop("sample")
                        cut["then_dropped"] = True
                    note("dropped", dict(item, tokens=len(c_ids), tokens_lost=len(c_ids), supervised=valid,
                                         reason=f"{valid} supervised token(s), fewer than minimum_valid_tokens "
                                                f"{minimum}"))
                    continue
                out.append((c_ids, c_mask))
        except DatasetError as exc:
            raise exc.at_sample(index) from None
        sources[number]["sample_range"][1] = len(out)
    if limit is not None and len(out) > limit:  # a row's turns past the cap: max_samples counts samples, as the peer's
        report["over_max_samples"] = len(out) - limit
        out = out[:limit]
    for item in sources:  # [start, stop) of the samples each input gave, in the run's sample order
        start, stop = item["sample_range"] or [len(out), len(out)]
        item["sample_range"] = [min(start, len(out)), min(stop, len(out))]
    report["samples"] = len(out)
    if not out:
        first = (report["dropped"] or [{}])[0]
        raise ValueError(f"{path}: no sample left of {len(checked)} row(s): {report['dropped_count']} left out "
                         f"(line {first.get('line')}: {first.get('reason')}); lower minimum_valid_tokens, raise "
                         f"seq_len, or give the rows assistant replies")
    return out, report


def dataset_warnings(report: dict) -> list:
    """One line per kind of loss in :func:`prepare_samples`' report (empty when nothing was cut or left out)."""
    lines = []
    for kind, verb in (("truncated", "cut to seq_len"), ("dropped", "left out")):
        count = report.get(kind + "_count") or 0
        if count:
            named = "; ".join(f"{i['file']}:{i['line']}" + (f" turn {i['turn']}" if "turn" in i else "") +
                              (f" sample {i['sample']}" if "sample" in i else "") +
                              f" ({i.get('reason') or str(i['tokens_lost']) + ' tokens lost'})"
                              for i in report[kind][:3])
            lines.append(f"{count} sample(s) {verb}: {named}{' ...' if count > 3 else ''}")
    return lines


def _load_tokenizer(model_path: str, params: dict):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=bool(params.get("trust_remote_code", True)))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {model_path} has no chat template; add one to "
                         f"tokenizer_config.json or pass a pre-tokenized dataset (rows with input_ids)")
    return tok


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


def _render_ids(tokenizer, messages: list, generation_prompt: bool) -> list:
    """The chat template's token ids, as vLLM's render endpoint makes them (no special tokens added)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_chat_turns(tokenizer, messages: list[dict], where: str = "") -> list:
    """``[(turn, input_ids, loss_mask), ...]``: one sample per assistant turn ``j`` (``j > 0``), whole.

    speculators 0.9's rule (``_render_boundary_rows``): the sample is ``messages[:j+1]``
    rendered; the boundary is where that render extends the render of ``messages[:j]`` with
    the generation prompt: before it context (0), from it on supervised (1: the reply, its
    end-of-turn token, what the template adds after). A generation prompt the full render does
    not extend (a pre-filled reasoning scaffold) falls back to their common prefix, valid only
    when the history itself renders the same. Rendered with the tokenizer here, the way the
    peer's vLLM render endpoint renders it; truncation is the caller's.
    """
    out = []
    for j, turn in enumerate(messages):
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt = _render_ids(tokenizer, messages[:j], True)
        full = _render_ids(tokenizer, messages[:j + 1], False)
        if full[:len(prompt)] == prompt:
            boundary = len(prompt)
        else:
            boundary = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            history = _render_ids(tokenizer, messages[:j], False)
            if full[:len(history)] != history or boundary < len(history):
                raise ValueError(f"{where}: the chat template renders the history differently at assistant turn "
                                 f"{j}; cannot find where the reply starts (set turns: whole)")
        out.append((j, full, [0] * boundary + [1] * (len(full) - boundary)))
    return out
