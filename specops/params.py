"""Run parameters: the inventory's values, overridden by command-line flags.

Flags arrive as strings from the CLI; each is checked here against its entry of the one
parameter table (``remote/wire/argspec.py`` ``RUN_ARGS``, which the host checks again),
with an error that names the flag and the fix, before anything reaches a host. What is
the laptop's own: the ``--layer-ids`` text and the path rules of the inventory.
"""
from __future__ import annotations

import re
from typing import Any

from specops.errors import UsageError
from specops.inventory import CONTRACT, RUN_FIELDS, HostSpec, check_path, shorten
from specops.wire import argspec
from specops.wire.argspec import RUN_ARGS

#: ``--layer-ids output:2,4,5,7`` / ``input:3,5,6,8`` say which convention the ids are in.
LAYER_CONVENTIONS = RUN_ARGS["layer_convention"].choices


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
    try:
        argspec.judge(RUN_ARGS["layer_convention"], head)
    except argspec.BadValue:
        raise UsageError(f"--layer-ids {text!r}: unknown convention {head!r}",
                         "prefix the ids with output: (output of layer i: speculators 0.3, SpecForge) or "
                         "input: (input of layer i: vLLM, speculators >= 0.5), or give no prefix") from None
    return head


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


def _flag_value(name: str, value: Any):
    """Flag ``--<flag of name>``'s value, checked by its :data:`RUN_ARGS` entry (the host checks the same again).

    :raises UsageError: naming the flag, what it must be and the fix (the spec's one wording).
    """
    arg = RUN_ARGS[name]
    flag = f"--{arg.flag_of(name)}"
    try:
        return argspec.judge(arg, value)
    except argspec.BadValue as exc:
        raise UsageError(exc.about(flag, value), f"{exc.fix_for(flag)} ({flag}: {arg.help})") from None


def check_state_format(fmt, engine, spec: HostSpec) -> str:
    """The run's ``format`` (``--format`` over the inventory's), refused where the engine the
    user named writes no fp8 (``engine: auto`` is judged on the host, by the run's plan).

    :raises UsageError: fp8 with an engine that cannot write it (:func:`contract.state_format_problem`).
    """
    chosen = fmt or spec.format
    problem = CONTRACT.state_format_problem(chosen, engine or spec.engine)
    if problem:
        where = "--format fp8" if fmt else f"{spec.name}: format: fp8"
        raise UsageError(f"{where} {problem}",
                         "set format: bf16 (or drop --format fp8), or use engine vllm-server (speculators >= 0.5)")
    return chosen


#: flag (as a python name: ``model``, ``seq_len``) -> the run parameter it sets: every :data:`RUN_ARGS` entry
#: with a ``help`` is a command-line flag of the run tasks (``specops/tasks.py``).
FLAGS = {arg.flag_of(name).replace("-", "_"): name for name, arg in RUN_ARGS.items() if arg.help}
#: flags whose text the laptop reads itself (a path held to the inventory's rules, the --layer-ids syntax).
_PATHS = {"model_path": "model", "output_dir": "output-dir"}


def check_flags(flags: dict) -> dict:
    """The run parameters set by ``flags`` (python names of the flags, unset ones None/empty), each checked
    against the one table before anything connects.

    :raises UsageError: naming the first flag that does not fit, and the fix.
    """
    unknown = sorted(set(flags) - set(FLAGS) - {"output_dir"})
    if unknown:
        raise TypeError(f"not run flags: {unknown}")  # a caller's mistake, never a user's
    out = {}
    for key, value in flags.items():
        name = FLAGS.get(key, key)
        if name == "layer_ids":
            if value is not None:
                out["layer_ids"], out["layer_convention"] = parse_layer_ids(value), parse_layer_convention(value)
        elif value is None or value == "" or value == []:  # a repeatable flag never given is []
            continue
        elif name == "dataset":
            out[name] = _datasets(value)
        elif name in _PATHS:
            out[name] = _path(_PATHS[name], value)
        else:
            out[name] = _flag_value(name, value)
    return out


def run_params(spec: HostSpec, **flags) -> dict:
    """The parameters every remote step of a run sees (preflight, extract, smoke): the inventory's run
    fields, overridden by ``flags`` (:func:`check_flags`)."""
    given = check_flags(flags)
    state_format = check_state_format(given.get("format"), given.get("engine"), spec)
    params = {name: getattr(spec, name) for name in RUN_FIELDS}
    params.update(given, format=state_format, env=dict(spec.env))
    for unset in ("writer_threads", "server_args"):  # the engine's own default, and no key in the run's params
        if not params.get(unset):
            del params[unset]
    if "algorithm" not in given and "algorithm" not in spec.model_fields_set:
        del params["algorithm"]  # unset: eagle3's plan, and no algorithm checks on the host (its speculators may be absent)
    return params
