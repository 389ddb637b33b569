"""The one schema of a run's ``manifest.json``: build, write, read and merge (stdlib only).

A manifest says what a run's output dir holds: one ``files`` entry per sample file
(path relative to the output dir, index, digest, bytes, tokens), the model, the layer
ids and their convention, the sample format, the engine, versions and parameters.

An entry's digest is one key named by its algorithm (:data:`remote.wire.fsutil.HASHES`):
``"blake3": "<hex>"`` where the host that hashed it has the ``blake3`` package (every host
with vLLM), else ``"sha256": "<hex>"``, as in every manifest before BLAKE3. Each entry is
checked in its own algorithm (:func:`file_matches`), so a merge of ranges or shards hashed
on different hosts keeps each file's digest as it was made, mixed algorithms and all.
Three documents share the schema (:data:`FIELDS`, :data:`ENTRY_FIELDS`):

``run``    a run's own (or a range's: ``.specops-shards/<lo>-<hi>/``), made by :func:`build`
           in the supervisor and in ``remote/dev`` tools;
``merged`` the ranges of one output dir that several hosts share, made on a host of it
           (``remote/extract/merge.py``) by :func:`merge` over the ranges' own manifests;
``group``  a group run's on the laptop (``runs/<run-id>/manifest.json``), made by
           :func:`merge` over every shard's file listing (``specops/runs/merge.py``).

Every reader goes through :func:`read` (or :func:`check` on a parsed object), which
checks each field present against the schema and the fields the caller needs, and
names the first that is missing or wrong. A field that is absent or null counts as
missing, so a manifest of an older specops (fewer fields) still reads::

    >>> check({"files": [{"path": "data_0.pt", "bytes": 3}]}, require=("files", "layer_ids"))
    Traceback (most recent call last):
    ManifestError: manifest: field 'layer_ids' is missing
    >>> check({"files": [{"path": "data_0.pt", "bytes": "3"}]})
    Traceback (most recent call last):
    ManifestError: manifest: field 'files[0].bytes' is "3", expected a whole number >= 0

The laptop imports this very module as ``specops.wire.manifest``; it imports only its wire
siblings (stdlib only) at import time.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

from . import contract, fsutil

PT, HS = contract.PT, contract.HS
#: format -> how a manifest's ``format`` field describes its sample files.
FORMAT_TEXT = {
    PT: "speculators-0.3 data_{idx}.pt: {input_ids: long[T], hidden_states: [dtype[T, hidden] per layer id], "
        "loss_mask: long[T]}",
    HS: "speculators offline hidden_states/hs_{idx}.safetensors: {token_ids: int64[T], hidden_states: "
        "dtype[T, L, H] (layers in ascending id order)} + Arrow dataset {input_ids, loss_mask, seq_len}",
}

#: what an fp8 run's ``format`` text adds.
FP8_TEXT = ("; fp8: hidden_states float8_e4m3fn [T, L, H] + hidden_states_scales float32 [T, 1, 1] per token "
            "(value = fp8 x scale); read it through hs_connectors' FP8Transfer (speculators train "
            "--hidden-states-backend fp8): the default file backend ignores the scales")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: kind -> (test, what a value of it is, said in a refusal).
KINDS = {
    "text": (lambda v: isinstance(v, str), "a string"),
    "int": (lambda v: _int(v) and v >= 0, "a whole number >= 0"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "ids": (lambda v: isinstance(v, list) and all(_int(x) for x in v), "a list of integers"),
    "names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "range": (lambda v: isinstance(v, list) and len(v) == 2 and all(_int(x) for x in v) and 0 <= v[0] <= v[1],
              "[start, stop] with 0 <= start <= stop"),
    "ranges": (lambda v: isinstance(v, list) and all(KINDS["range"][0](r) for r in v), "a list of [start, stop]"),
    "format": (lambda v: v in FORMAT_TEXT, f"one of {sorted(FORMAT_TEXT)}"),
    "convention": (lambda v: v in contract.LAYER_CONVENTIONS, f"one of {list(contract.LAYER_CONVENTIONS)}"),
    "state_format": (lambda v: v in contract.STATE_FORMATS, f"one of {list(contract.STATE_FORMATS)}"),
    "entries": (lambda v: isinstance(v, list), "a list of file entries"),
}


class Field(NamedTuple):
    kind: str
    what: str
    #: the documents that carry it: run, merged (host), group (laptop).
    docs: str = "run merged group"


#: every top-level field of a manifest, what it holds, and which documents carry it.
FIELDS = {
    "run_id": Field("text", "the run id"),
    "created_at": Field("text", "when the manifest was written (UTC, ISO 8601)"),
    "format": Field("text", "the sample files' format, described (FORMAT_TEXT)"),
    "format_name": Field("format", "the sample files' format: pt or hs"),
    "engine": Field("object", "the engine that wrote the samples: name, tp, what it reports", "run"),
    "model": Field("object", "the model: path and config summary"),
    "state_format": Field("state_format", "hs: the states' dtype on disk: bf16 (as computed) or fp8 (+ per-token "
                                          "scales); absent: bf16"),
    "scales_key": Field("text", "fp8: the tensor of each file holding its per-token scales (float32 [T, 1, 1])"),
    "hidden_states_backend": Field("text", "hs: the read backend speculators' trainer needs for these files "
                                           "(--hidden-states-backend file|fp8)"),
    "layer_ids": Field("ids", "the captured layer ids, in layer_convention"),
    "layer_convention": Field("convention", "what a layer id means: output or input"),
    "layer_convention_text": Field("text", "layer_convention, described"),
    "file_layer_ids": Field("ids", "hs: the layer ids in the order of a file's layer axis"),
    "samples": Field("int", "how many samples the manifest lists (a run: its range's size)"),
    "sample_range": Field("range", "[start, stop): the global dataset indices the run wrote", "run"),
    "dataset_samples": Field("int", "the number of samples in the dataset", "run merged"),
    "tokens": Field("int", "the tokens of every listed sample"),
    "files": Field("entries", "one entry per sample file (ENTRY_FIELDS)"),
    "dataset_files": Field("names", "hs: the token dataset's files beside the samples"),
    "dataset_writer": Field("text", "hs: the range that wrote the token dataset", "run"),
    "dataset_report": Field("object", "what the samples are made of: the chat rule (turns, what is supervised), "
                                      "rows read, samples made, the samples truncated and left out (file, line, "
                                      "turn, tokens lost; counted)", "run"),
    "identity": Field("object", "what makes writers of one output dir one run's (remote.extract.samples)", "run merged"),
    "versions": Field("object", "the host's package versions and python", "run"),
    "params": Field("object", "the run's parameters (private _ keys left out)", "run"),
    "canary": Field("object", "the canary's verdict: status, samples checked, top-1 agreement, ratio to the "
                              "rounding floor, seconds (remote.verify.canary.summarize); engines without a canary: absent",
                    "run"),
    "complete": Field("flag", "every expected sample is listed", "merged group"),
    "missing": Field("ids", "the expected indices no file is listed for (merged: the first 1000)", "merged group"),
    "merged_from": Field("object", "range tag -> its sample_range, samples, engine, host, created_at", "merged"),
    "sample_ranges": Field("ranges", "the ranges merged, in order", "merged"),
    "missing_ranges": Field("ranges", "expected ranges with no manifest yet", "merged"),
    "total": Field("int", "the group run's dataset size", "group"),
    "dataset": Field("object", "the group run's dataset (count, sha256)", "group"),
    "shard_map": Field("list", "the group run's shards: id, hosts, range, run id, moves", "group"),
    "hosts": Field("object", "host -> its engine and versions", "group"),
    "engines": Field("object", "shard id -> the engine its host ran", "group"),
    "canaries": Field("object", "shard id -> its canary's verdict (each shard checks its own first samples); "
                                "shards without a canary: absent", "group"),
    "dataset_reports": Field("object", "shard id -> what its samples are made of (its dataset_report)", "group"),
}
#: the fields of one ``files`` entry; ``path`` is always there.
ENTRY_FIELDS = {
    "path": Field("text", "the file, relative to the output dir"),
    "index": Field("int", "the sample's global dataset index"),
    "blake3": Field("text", "the file's BLAKE3 digest, hex (where the host has blake3)"),
    "sha256": Field("text", "the file's sha256, hex (a host without blake3; manifests before BLAKE3)"),
    "bytes": Field("int", "the file's size"),
    "tokens": Field("int", "the sample's tokens"),
    "tensors": Field("object", "name -> dtype and shape of each tensor in the file"),
    "range": Field("text", "merged: the tag of the range that wrote it", "merged"),
    "host": Field("text", "merged, group: the host that wrote it", "merged group"),
    "shard": Field("text", "group: the shard that wrote it", "group"),
}
#: what a merged manifest takes over from its first range's (the same in every range of a run).
INHERITED = ("run_id", "format", "format_name", "state_format", "scales_key", "hidden_states_backend", "model", "layer_ids", "layer_convention", "layer_convention_text",
             "file_layer_ids", "dataset_samples", "identity")
#: what each reader needs (``require`` of :func:`read`); ``files[].x``: every entry has ``x``
#: (``files[].digest``: a digest of one of :data:`remote.wire.fsutil.HASHES`).
FOR_VERIFY = ("layer_ids", "layer_convention", "files", "files[].digest")
FOR_FETCH = ("files", "files[].digest", "files[].bytes", "params")
FOR_MERGE = ("run_id", "sample_range", "files", "files[].index")


class ManifestError(ValueError):
    """A manifest that cannot be used: ``field`` (None: the file as a whole) is missing or wrong."""

    def __init__(self, where, field: str | None, problem: str, value=None):
        self.where, self.field, self.problem, self.value = str(where), field, problem, value
        super().__init__(f"{where}: " + (f"field {field!r} {problem}" if field else problem))


class MergeError(ValueError):
    """Ranges that cannot be merged into one manifest (overlapping, or a sample listed twice)."""

    def __init__(self, summary: str, fix: str, **detail):
        super().__init__(summary)
        self.summary, self.fix, self.detail = summary, fix, detail


def utc_now() -> str:
    """``created_at``: now, UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------- build


def build(*, run_id: str, fmt: str, engine: dict, model: dict, layer_ids, convention: str, sample_range,
          files: list, tokens: int, dataset_samples: int | None = None, dataset_files=(), identity=None,
          versions=None, params=None, file_layer_ids=None, dataset_writer=None, created_at=None,
          state_format: str | None = None, canary: dict | None = None,
          dataset_report: dict | None = None) -> dict:
    """A run's manifest (the ``run`` document), checked against :data:`FIELDS`.

    :param fmt: ``pt`` or ``hs``; an ``hs`` manifest also records ``file_layer_ids``
        (default: ascending ``layer_ids``), ``dataset_writer``, ``state_format`` (default bf16),
        the read backend it needs and, for fp8, the scales' key.
    :param model: ``{"path": ..., "config": modelconfig.summary(...)}``.
    :param sample_range: ``[lo, hi)``; ``samples`` is its size.
    :param files: :data:`ENTRY_FIELDS` entries, path relative to the output dir.
    :param params: the run's parameters; private ``_`` keys are left out.
    """
    from . import layers  # host only: the laptop never builds a run's manifest

    lo, hi = sample_range
    doc = {
        "run_id": run_id,
        "created_at": created_at or utc_now(),
        "format": FORMAT_TEXT[fmt],
        "format_name": fmt,
        "engine": engine,
        "model": model,
        "layer_ids": list(layer_ids),
        "layer_convention": convention,
        "layer_convention_text": layers.CONVENTIONS[convention],
        "samples": hi - lo,
        "sample_range": [lo, hi],
        "dataset_samples": dataset_samples,
        "tokens": tokens,
        "files": files,
        "dataset_files": list(dataset_files),
        "identity": identity,
        "versions": versions,
        "params": {k: v for k, v in (params or {}).items() if not str(k).startswith("_")},
    }
    if canary is not None:
        doc["canary"] = canary
    if dataset_report is not None:
        doc["dataset_report"] = dataset_report
    if fmt == HS:
        doc["file_layer_ids"] = list(file_layer_ids or sorted(layer_ids))
        # written by this range, found written by another, or (no files yet) being written by another
        doc["dataset_writer"] = dataset_writer
        states = state_format or contract.BF16
        doc["state_format"] = states
        doc["hidden_states_backend"] = contract.READ_BACKENDS[states]
        if states == contract.FP8:
            doc["scales_key"] = contract.FP8_SCALES_KEY
            doc["format"] += FP8_TEXT
    return check(doc, where="the built manifest")


# --------------------------------------------------------------------------- read and write


def check(doc, require=(), where="manifest") -> dict:
    """``doc`` itself when it fits the schema and has every field of ``require``.

    ``require`` names top-level fields, or ``files[].<key>`` for a key every entry must have.
    A field that is absent or null is missing; unknown fields are kept as they are.

    :raises ManifestError: the first field that is missing or wrong, named.
    """
    if not isinstance(doc, dict):
        raise ManifestError(where, None, f"holds {type(doc).__name__}, expected a JSON object")
    for name in require:
        if not name.startswith("files[]") and doc.get(name) is None:
            raise ManifestError(where, name, "is missing")
    for name, field in FIELDS.items():
        check_value(where, name, doc.get(name), field)
    needed = [name[len("files[]."):] for name in require if name.startswith("files[].")]
    for i, entry in enumerate(doc.get("files") or []):
        if not isinstance(entry, dict):
            raise ManifestError(where, f"files[{i}]", f"is {entry!r}, expected an object", entry)
        for key in ("path", *needed):
            if key == "digest":
                if entry_digest(entry) is None:
                    raise ManifestError(where, f"files[{i}]", f"has no digest ({' or '.join(fsutil.HASHES)})")
            elif entry.get(key) in (None, ""):
                raise ManifestError(where, f"files[{i}].{key}", "is missing")
        for key, field in ENTRY_FIELDS.items():
            check_value(where, f"files[{i}].{key}", entry.get(key), field)
    return doc


def entry_digest(entry: dict):
    """``(algorithm, hex)`` of the digest a ``files`` entry carries (the first of
    :data:`remote.wire.fsutil.HASHES` it has); None when it has none."""
    return next(((name, entry[name]) for name in fsutil.HASHES if entry.get(name)), None)


def file_matches(path, entry: dict) -> bool:
    """The file at ``path`` has the digest its ``files`` entry carries, in that entry's algorithm.

    :raises remote.wire.fsutil.HashUnavailable: this python cannot compute the entry's algorithm
        (BLAKE3 without the ``blake3`` package; its ``fix`` says so): never a silent pass.
    :raises ManifestError: the entry carries no digest.
    """
    found = entry_digest(entry)
    if found is None:
        raise ManifestError("manifest", f"files entry {entry.get('path')!r}",
                            f"has no digest ({' or '.join(fsutil.HASHES)})")
    name, want = found
    return fsutil.file_digest(path, name)[name] == want


def digest_names(entries) -> str:
    """The algorithms of ``entries``' digests, said (``blake3``, ``sha256``, ``blake3 and sha256``)."""
    names = [n for n in fsutil.HASHES if any((entry_digest(e) or ("",))[0] == n for e in entries)]
    return " and ".join(names) or "no digest"


def check_value(where, name: str, value, field: Field, kinds=None, error=None) -> None:
    """Refuse ``value`` of field ``name`` when it is not of ``field``'s kind (None passes: missing).

    :param kinds: the kinds table (default :data:`KINDS`); :param error: the error class raised
        (default :class:`ManifestError`; ``status.json``'s schema passes its own).
    """
    test, expected = (kinds or KINDS)[field.kind]
    if value is not None and not test(value):
        shown = json.dumps(value, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise (error or ManifestError)(where, name, f"is {shown}, expected {expected}", value)


def read(path, require=()) -> dict:
    """The manifest at ``path``, checked (:func:`check`) for what the caller needs.

    :raises FileNotFoundError: no file there (a run that has not finished).
    :raises ManifestError: not JSON, not an object, or a field missing or wrong, named.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ManifestError(path, None, f"cannot be read as JSON ({exc})") from None
    return check(doc, require, where=path)


def read_quietly(path, require=()) -> dict | None:
    """:func:`read`, or None when there is no usable manifest at ``path``."""
    try:
        return read(path, require)
    except (OSError, ManifestError):
        return None


def write_atomic(path, doc: dict, *, temp_prefix: str | None = None, mode: int | None = None) -> Path:
    """Check ``doc`` and write it to ``path`` atomically (readers never see half a file); makes its dir.

    :param temp_prefix: the temp file's name prefix (an output dir's owner sweeps its own by prefix).
    :param mode: the file's permission bits (default ``0o600``).
    """
    path = Path(path)
    check(doc, where=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return fsutil.write_json(path, doc, mode=mode, temp_prefix=temp_prefix)


# --------------------------------------------------------------------------- merge


class Range(NamedTuple):
    """One range's part of a merge: its files, and what each of its entries gets added."""

    tag: str
    start: int
    stop: int
    files: list
    #: added to each of its entries (``{"range": tag, "host": h}``, ``{"shard": id, "host": h}``).
    extra: dict


def merge(ranges, *, expected=None, strict: bool = True) -> dict:
    """The part every merged manifest shares, from the ranges' files: each sample once, by index.

    :param ranges: :class:`Range` s.
    :param expected: the ``[start, stop)`` ranges whose every index should be listed
        (default: the ranges' own); an index no range lists is ``missing``.
    :param strict: True (one output dir's own range manifests): ranges that overlap, an
        entry outside its range or an index listed twice raise :class:`MergeError`.
        False (a group run's shard listings): an entry outside its shard's range (made
        before the shard was cut) is left out, and a range's later entry of an index wins.
    :returns: ``files`` (sorted by index, each with its range's ``extra``), ``samples``,
        ``tokens``, ``complete`` and ``missing`` (every missing index, ascending).
    """
    ranges = sorted(ranges, key=lambda r: (r.start, r.stop))
    if strict:
        for a, b in zip(ranges, ranges[1:]):
            if b.start < a.stop:
                raise MergeError(f"ranges [{a.start}, {a.stop}) and [{b.start}, {b.stop}) overlap",
                                 "a bug or a hand-made claim: remove the stale .specops-shards/<lo>-<hi> dir",
                                 ranges=[a.tag, b.tag])
    chosen = {}
    for r in ranges:
        own = {}
        for entry in r.files:
            index = int(entry["index"])
            inside = r.start <= index < r.stop
            if strict and (not inside or index in own or index in chosen):
                by = (f" and by {chosen[index][0]}" if index in chosen else " twice" if index in own
                      else f", outside [{r.start}, {r.stop})")
                raise MergeError(f"sample {index} is listed by range {r.tag}{by}",
                                 "a bug: report it with the two manifests", index=index)
            if inside:
                own[index] = entry
        for index, entry in own.items():
            chosen[index] = (r.tag, {**entry, "index": index, **r.extra})
    files = [chosen[i][1] for i in sorted(chosen)]
    wanted = sorted({i for lo, hi in (expected if expected is not None else [(r.start, r.stop) for r in ranges])
                     for i in range(lo, hi)})
    missing = [i for i in wanted if i not in chosen]
    return {"files": files, "samples": len(files), "tokens": sum(int(e.get("tokens") or 0) for e in files),
            "complete": not missing, "missing": missing}


def inherited(first: dict) -> dict:
    """What a merged manifest takes over from its first range's manifest (:data:`INHERITED`)."""
    return {k: first.get(k) for k in INHERITED}
