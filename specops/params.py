"""Run parameters: the inventory's values, overridden by command-line flags.

Flags arrive as strings from the CLI; each is checked here with an error that names
the flag and the fix, before anything reaches a host.
"""
from __future__ import annotations

import re
from typing import Any

from specops.errors import UsageError
from specops.inventory import CONTRACT, HostSpec, check_path, shorten

#: ``auto`` (the default): the host picks from its installed speculators (0.3/0.4 ->
#: speculators-0.3, >= 0.5 -> vllm-server); preflight names the choice.
ENGINES = CONTRACT.ENGINE_CHOICES
#: ``--layer-ids output:2,4,5,7`` / ``input:3,5,6,8`` say which convention the ids are in.
LAYER_CONVENTIONS = CONTRACT.LAYER_CONVENTIONS


#: one layer id as typed: ASCII digits (int() would also take "２" and "2_0"), a sign for the
#: host's range check to name
LAYER_ID = re.compile(r"-?[0-9]+", re.ASCII)


def parse_layer_ids(text: str | None) -> list[int] | None:
    """``"2,16,29"`` -> ``[2, 16, 29]``; ``None``/empty -> ``None`` (the engine's default).

    A ``output:``/``input:`` prefix is dropped here; :func:`parse_layer_convention` reads it.
    Each id is ASCII digits (spaces around it allowed); the host checks the range.
    """
    if text is None or str(text).strip() == "":
        return None
    given = text = str(text)
    head, sep, rest = text.partition(":")
    if sep:
        parse_layer_convention(text)
        text = rest
    parts = [part.strip(" \t") for part in text.split(",")]
    ids = [part for part in parts if part != ""]
    bad = [part for part in ids if not LAYER_ID.fullmatch(part)]
    if bad or not ids:
        what = f"{bad[0]!r} is not a layer id: ASCII digits only" if bad else "it names no layer id"
        raise UsageError(f"--layer-ids {given!r} is not a comma-separated list of integers ({what})",
                         "example: --layer-ids 2,16,29,31 (the engine's convention) or "
                         "--layer-ids output:2,16,29,31") from None
    ids = [int(part) for part in ids]
    if len(set(ids)) != len(ids):
        raise UsageError(f"--layer-ids {given!r} repeats a layer id",
                         "each layer can be captured once; remove the duplicate")
    return ids


def parse_layer_convention(text: str | None) -> str | None:
    """The convention a ``--layer-ids`` value names (``output:...``/``input:...``), or None (the engine's)."""
    if text is None or ":" not in str(text):
        return None
    head = str(text).partition(":")[0].strip().lower()
    if head not in LAYER_CONVENTIONS:
        raise UsageError(f"--layer-ids {text!r}: unknown convention {head!r}",
                         "prefix the ids with output: (output of layer i: speculators 0.3, SpecForge) or "
                         "input: (input of layer i: vLLM, speculators >= 0.5), or give no prefix")
    return head


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


def check_canary_samples(value: Any, spec: HostSpec) -> int:
    """The run's ``canary_samples``: ``--canary-samples`` over the inventory's (0 turns the canary off).

    :raises UsageError: a flag that is not a whole number from 0 to ``CANARY_SAMPLES_MAX``.
    """
    if value is None or value == "":
        return spec.canary_samples
    top = CONTRACT.CANARY_SAMPLES_MAX
    text = str(value).strip()
    if isinstance(value, (bool, float)) or not text.isascii() or not text.isdigit() or int(text) > top:
        raise UsageError(f"--canary-samples {value!r} must be a whole number from 0 to {top}",
                         f"example: --canary-samples {CONTRACT.CANARY_SAMPLES} (the default; the run's first samples "
                         f"are checked against the engine's own logprobs as they land), 0 for no canary")
    return int(text)


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


def _datasets(value: Any) -> str | list[str] | None:
    """``--dataset`` given once (a path) or several times (the inputs in the order given)."""
    given = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if v not in (None, "")]
    paths = [_path("dataset", v) for v in given]
    return None if not paths else paths[0] if len(paths) == 1 else paths


def check_state_format(fmt, engine, spec: HostSpec) -> str:
    """The run's ``format`` (``--format`` over the inventory's), refused where the engine the
    user named writes no fp8 (``engine: auto`` is judged on the host, by the run's plan).

    :raises UsageError: an unknown format, or fp8 with an engine that cannot write it.
    """
    if fmt is not None and fmt not in CONTRACT.STATE_FORMATS:
        raise UsageError(f"--format {fmt!r} is not known",
                         f"use one of: {', '.join(CONTRACT.STATE_FORMATS)} (default {CONTRACT.BF16})")
    chosen = fmt or spec.format
    named = CONTRACT.ENGINE_ALIASES.get(engine or spec.engine, engine or spec.engine)
    if chosen == CONTRACT.FP8 and named != CONTRACT.AUTO_ENGINE and named not in CONTRACT.FP8_ENGINES:
        where = "--format fp8" if fmt else f"{spec.name}: format: fp8"
        raise UsageError(f"{where}: engine {named} writes its states unquantized; fp8 states need the "
                         f"{' or '.join(CONTRACT.FP8_ENGINES)} engine",
                         "set format: bf16 (or drop --format fp8), or use engine vllm-server (speculators >= 0.5)")
    return chosen


def run_params(spec: HostSpec, *, model=None, dataset=None, tp=None, layer_ids=None, engine=None,
               seq_len=None, max_samples=None, batch_size=None, output_dir=None, format=None,
               canary_samples=None, long_samples=None, turns=None, minimum_valid_tokens=None) -> dict:
    """The parameters every remote step of a run sees (preflight, extract, smoke)."""
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is not known", f"use one of: {', '.join(ENGINES)}")
    state_format = check_state_format(format, engine, spec)
    if long_samples is not None and long_samples not in CONTRACT.LONG_SAMPLES:
        raise UsageError(f"--long-samples {long_samples!r} is not known",
                         f"use one of: {', '.join(CONTRACT.LONG_SAMPLES)} (truncate keeps a sample's first "
                         f"seq_len tokens; refuse stops the run before the load; drop leaves it out)")
    if turns is not None and turns not in CONTRACT.CHAT_TURNS:
        raise UsageError(f"--turns {turns!r} is not known",
                         f"use one of: {', '.join(CONTRACT.CHAT_TURNS)} (per-turn: a sample per assistant turn, "
                         f"end-of-turn supervised, speculators 0.9; whole: a sample per row, speculators 0.3; "
                         f"auto: the host's speculators' rule)")
    if minimum_valid_tokens is not None and (not str(minimum_valid_tokens).isdigit()):
        raise UsageError(f"--minimum-valid-tokens {minimum_valid_tokens!r} is not a whole number >= 0",
                         "give the fewest supervised tokens a sample needs, e.g. --minimum-valid-tokens 1")
    params = {
        "model_path": _path("model", model) or spec.model_path,
        "dataset": _datasets(dataset) or spec.dataset,
        "output_dir": _path("output-dir", output_dir) or spec.output_dir,
        "work_dir": spec.work_dir,
        "device": spec.device,
        "tp": _positive("tp", tp) or spec.tp,
        "engine": engine or spec.engine,
        "layer_ids": parse_layer_ids(layer_ids) if layer_ids is not None else spec.layer_ids,
        "layer_convention": (parse_layer_convention(layer_ids) if layer_ids is not None
                             else spec.layer_convention),
        "seq_len": _positive("seq-len", seq_len) or spec.seq_len,
        "max_samples": _positive("max-samples", max_samples) or spec.max_samples,
        "batch_size": _positive("batch-size", batch_size) or spec.batch_size,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "trust_remote_code": spec.trust_remote_code,
        "format": state_format,
        "canary_samples": check_canary_samples(canary_samples, spec),
        "long_samples": long_samples or spec.long_samples,
        "turns": turns or spec.turns,
        "minimum_valid_tokens": (int(minimum_valid_tokens) if minimum_valid_tokens is not None
                                 else spec.minimum_valid_tokens),
        "chunked_prefill": spec.chunked_prefill,
        "env": dict(spec.env),
        "python": spec.python,
    }
    if spec.writer_threads:
        params["writer_threads"] = spec.writer_threads
    return params
