"""Run parameters: the inventory's values, overridden by command-line flags.

Flags arrive as strings from the CLI; each is checked here with an error that names
the flag and the fix, before anything reaches a host.
"""
from __future__ import annotations

from typing import Any

from specops.errors import UsageError
from specops.inventory import HostSpec, check_path, shorten

ENGINES = ("speculators-0.3", "hf-reference")


def parse_layer_ids(text: str | None) -> list[int] | None:
    """``"2,16,29"`` -> ``[2, 16, 29]``; ``None``/empty -> ``None`` (the engine's default)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        ids = [int(part) for part in str(text).split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--layer-ids {text!r} is not a comma-separated list of integers",
                         "example: --layer-ids 2,16,29,31") from None
    if len(set(ids)) != len(ids):
        raise UsageError(f"--layer-ids {text!r} repeats a layer id",
                         "each layer can be captured once; remove the duplicate")
    return ids


def _positive(name: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        # int(True) is 1 and int(8.7) is 8: neither is what the caller meant
        number = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UsageError(f"--{name} {value!r} must be a positive integer", f"example: --{name} 8")
    return number


def _path(name: str, value: Any) -> str | None:
    """A path flag (``--model``, ``--dataset``), held to the same rules as the inventory's paths."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise UsageError(f"--{name} {value!r} must be a path", f"example: --{name} /data/x")
    try:
        check_path(name, value)
    except ValueError as exc:
        raise UsageError(f"--{name} {shorten(value)}: {exc}", f"pass a path on the host to --{name}") from None
    return value


def run_params(spec: HostSpec, *, model=None, dataset=None, tp=None, layer_ids=None, engine=None,
               seq_len=None, max_samples=None, batch_size=None, output_dir=None) -> dict:
    """The parameters every remote step of a run sees (preflight, extract, smoke)."""
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is not known", f"use one of: {', '.join(ENGINES)}")
    params = {
        "model_path": _path("model", model) or spec.model_path,
        "dataset": _path("dataset", dataset) or spec.dataset,
        "output_dir": _path("output-dir", output_dir) or spec.output_dir,
        "work_dir": spec.work_dir,
        "device": spec.device,
        "tp": _positive("tp", tp) or spec.tp,
        "engine": engine or spec.engine,
        "layer_ids": parse_layer_ids(layer_ids) if layer_ids is not None else spec.layer_ids,
        "seq_len": _positive("seq-len", seq_len) or spec.seq_len,
        "max_samples": _positive("max-samples", max_samples) or spec.max_samples,
        "batch_size": _positive("batch-size", batch_size) or spec.batch_size,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "trust_remote_code": spec.trust_remote_code,
        "env": dict(spec.env),
        "python": spec.python,
    }
    return params
