"""The declared parameters of every host task, checked once before the task runs (stdlib only).

Ansible's ``argument_spec`` is the model: a task module (``main(params) -> payload``)
declares each parameter it takes -- type, default, whether it is required, whether it
is a path -- and :meth:`Spec.task` checks every call against that declaration before the
task's own code sees a value, whoever calls it (the entry script the laptop sends, a
test, a benchmark)::

    SPEC = Spec("shard", RUN_ARGS, {"action": Arg("str", "probe", choices=("probe", "files")),
                                    "start": Arg("int", min=0), "stop": Arg("int", min=0)},
                required_if=[("action", "files", ("output_dir", "start", "stop"))])

    @SPEC.task
    def main(params):          # every declared key present: checked, defaulted, ~ expanded
        ...

    >>> main({"action": "probe", "seq_lenn": 8})["records"][0]["summary"]
    "unknown parameter 'seq_lenn' for task shard; known: action, batch_delay_s, ..., work_dir"
    >>> main({"action": "files", "output_dir": "~/out", "start": "x", "stop": 4})["records"][0]["summary"]
    "parameter 'start' of task shard must be an integer, got 'x'"

What a check does, key by key:

* a key starting with ``_`` is internal (``_bundle_dir``, which the entry script sets) and
  passes as it is;
* a key the spec does not declare is refused by name, with the known ones and the nearest
  spelling as the fix;
* a value that is None or ``""`` is unset: the declared default takes its place (None
  when there is none), so ``params[name]`` never raises inside a task;
* a set value must have the declared type (``int`` takes ``8``, ``8.0`` and ``"8"``,
  never ``True``), and lie within ``choices`` / ``min`` / ``max`` / ``above``;
* a ``path`` starting with ``~`` is expanded to this host's home -- here, and nowhere
  else on the host;
* a required parameter left unset is refused (``required_if``: only for one verb).

Every problem of a call is one :class:`protocol.TaskError` named ``<task>.params`` (the
first problem in its summary, all of them in ``detail.problems``), returned as the
task's one failed record. A *lenient* spec (preflight's: its other checks still tell the
user something) hands the problems to the task instead, each bad value replaced by its
default. The checked dict is a :class:`Params`, which also knows the keys the caller
actually sent (a run records those, not the defaults).

**Test hooks.** Parameters only tests (and benchmarks) send are declared like any other,
with ``hook=True``, so a misspelt one is refused too and :func:`hooks` lists them all. The
fault points they arm are named in :mod:`remote.run.faults`; what an armed one does lives in
``remote/dev/faults.py``, which no wheel holds:

``inject_failure`` (job; ``{"rank", "at": load|extract, "message"}``)
    the engine raises there, to prove a failure's root cause
    comes back (the job passes it to the engines as ``SPECOPS_INJECT_FAILURE``).
``batch_delay_s`` (job)
    a pause after each batch, to act mid-run. ``SPECOPS_BATCH_DELAY_S`` in the run's
    ``env`` does the same without being a run parameter (a resume need not repeat it).
    ``SPECOPS_STREAM_FAULT`` there (``{"n": "nonfinite"|"ids"}``) makes the test host's CPU
    hidden-states connector corrupt the n-th file it writes: an online run's streamed sample
    that fails the trainer's checks.
``inject_failure_after``, ``hold_lock_s`` (patcher, drift)
    fail after writing this many files (proves the rollback); keep the lock this long.
``plain`` (job)
    the vLLM server without extraction: the benchmarks' baseline (eval's baseline server
    passes it in-process, :mod:`remote.train.evaluate`).
``swap_sample_states`` (job, vllm-server)
    ``[i, j]``: once both requests are answered, the two files the server wrote exchange
    their states (each keeps its own token ids, so the landing's checks pass): the engine
    mixing up two requests, which the canary must stop and name.
``server_args_unchecked`` (job)
    vLLM server flags appended after ``server_args`` without its check: the GPU round plants
    a shifted final id with a second ``--speculative-config``, which ``server_args`` refuses.
``cli`` (facts)
    echoed back in ``data.received``: the wire carries any value intact.
``_python_min`` (any task; read by the entry preamble, not by a task)
    demand this python instead of 3.10, so a modern interpreter takes the "python too
    old" path (``tests/test_bad_input.py`` sends it).
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import re

from . import contract, protocol

#: every type a parameter may declare; a tuple of them means any one of them (tried in order).
TYPE_WORDS = {
    "str": "a string", "path": "a path (a string)", "int": "an integer", "float": "a number",
    "bool": "true or false", "list": "a list", "dict": "a mapping", "env": "a mapping of names to strings",
    "any": "any JSON value",
}
_INT_TEXT = re.compile(r"\s*[-+]?[0-9]+\s*", re.ASCII)


class ArgError(protocol.TaskError):
    """The parameters of one call do not fit the task's spec; every problem is in ``detail.problems``."""


class Arg:
    """One declared parameter.

    :param type: one of :data:`TYPE_WORDS`, or a tuple of them (``("path", "list")``).
    :param default: the value when unset (None or ``""``); a ``path`` default is expanded too.
    :param required: unset is refused.
    :param choices: the values allowed.
    :param min: / :param max: inclusive bounds of an ``int``/``float``; :param above: an exclusive lower bound.
    :param elements: the type of each item of a ``list``.
    :param options: for a ``dict``: its own declared keys (checked the same way, with the
        field named ``outer.inner``); :param open: other keys of it pass unchecked.
    :param call: steers one call, not the run (a job records the run's parameters without these).
    :param hook: sent only by tests and benchmarks (see the module docstring).
    :param doc: what it means, for a reader of the spec (a run flag's ``help`` where not given).
    :param help: the laptop's command-line help of the flag that sets it (a run parameter the CLI takes:
        ``specops/tasks.py`` builds its flags and their help from these, :func:`flag_help`).
    :param flag: the flag's name where it is not the key's (``model_path`` is ``--model``).
    """

    __slots__ = ("types", "default", "required", "choices", "min", "max", "above", "elements", "options", "open",
                 "call", "hook", "doc", "help", "flag")

    def __init__(self, type="str", default=None, *, required=False, choices=None, min=None, max=None, above=None,
                 elements=None, options=None, open=False, call=False, hook=False, doc="", help="", flag=None):
        self.types = (type,) if isinstance(type, str) else tuple(type)
        unknown = [t for t in self.types + ((elements,) if elements else ()) if t not in TYPE_WORDS]
        if unknown:
            raise ValueError(f"unknown parameter type(s) {unknown}; use {sorted(TYPE_WORDS)}")
        self.default, self.required, self.choices = default, required, tuple(choices) if choices else None
        self.min, self.max, self.above, self.elements = min, max, above, elements
        self.options, self.open = dict(options) if options else None, open
        self.call, self.hook, self.help, self.flag = call, hook, help, flag
        self.doc = doc or help  # a run flag's help says what it means: no second text

    def flag_of(self, name: str) -> str:
        """The command-line flag (without ``--``) that sets parameter ``name``."""
        return self.flag or name.replace("_", "-")

    def bound(self) -> str | None:
        """What a number must be, in words (``at least 1``, ``from 0 to 32``), or None when unbounded."""
        if self.min is not None and self.max is not None:
            return f"from {self.min} to {self.max}"
        parts = [f"at least {self.min}" if self.min is not None else None,
                 f"above {self.above}" if self.above is not None else None,
                 f"at most {self.max}" if self.max is not None else None]
        return " and ".join(p for p in parts if p) or None

    @property
    def is_path(self) -> bool:
        return "path" in self.types or self.elements == "path"

    def but(self, **changes) -> "Arg":
        """A copy with ``changes`` (``RUN_ARGS["python"].but(call=True)``)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields["type"] = fields.pop("types")
        fields.update(changes)
        return Arg(fields.pop("type"), **fields)

    def __repr__(self) -> str:
        return f"Arg({'|'.join(self.types)}, default={self.default!r}{', required' if self.required else ''})"


class Params(dict):
    """The checked parameters of one call; :attr:`given` are the declared keys the caller sent
    (None-valued ones too; no ``_`` ones)."""

    given: frozenset = frozenset()


class _Bad(ValueError):
    """A value that does not fit; the message says what was expected."""


def _unset(value) -> bool:
    return value is None or value == ""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _convert(kind: str, value, arg: Arg, field: str, problems: list, task: str):
    """``value`` as ``kind``, or :class:`_Bad`."""
    if kind == "any":
        return value
    if kind in ("str", "path"):
        if not isinstance(value, str):
            raise _Bad()
        return os.path.expanduser(value) if kind == "path" and value.startswith("~") else value
    if kind == "int":
        if isinstance(value, bool):
            raise _Bad()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _INT_TEXT.fullmatch(value):
            return int(value)
        raise _Bad()
    if kind == "float":
        if isinstance(value, bool):
            raise _Bad()
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise _Bad() from None
        if not math.isfinite(number):  # nan passes every bound check (nan < 0 is False)
            raise _Bad(f"a finite number, got {_shown(value)}")
        return number
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise _Bad()
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise _Bad()
        if not arg.elements:
            return list(value)
        out = []
        for i, item in enumerate(value):
            try:
                out.append(_convert(arg.elements, item, arg, f"{field}[{i}]", problems, task))
            except _Bad:
                raise _Bad(f"item {i} must be {TYPE_WORDS[arg.elements]}, got {_shown(item)}") from None
        return out
    if kind == "env":
        if not isinstance(value, dict):
            raise _Bad()
        bad = [k for k, v in value.items() if isinstance(v, (dict, list, tuple)) or v is None]
        if bad:
            raise _Bad(f"{bad[0]!r} must be a string, got {_shown(value[bad[0]])}")
        return {str(k): str(v) for k, v in value.items()}
    if kind == "dict":
        if not isinstance(value, dict):
            raise _Bad()
        if arg.options is None:
            return dict(value)
        return _check_mapping(value, arg.options, {}, arg.open, field + ".", problems, task)
    raise AssertionError(kind)


class BadValue(ValueError):
    """A set value that does not fit its :class:`Arg`: ``str(self)`` says what it must be (``must be at least 1``),
    :attr:`fix` what to do, with ``{name}`` where the caller's name of it goes (a task's parameter, an inventory
    field, a ``--flag``): the one wording of each check, whoever makes it."""

    def __init__(self, must: str, fix: str, *, says_value: bool = False):
        super().__init__(must)
        self.fix, self.says_value = fix, says_value

    def fix_for(self, name: str) -> str:
        return self.fix.replace("{name}", name)

    def about(self, name: str, value) -> str:
        """The problem, said of ``name`` (a field, ``--flag``): ``--tp 'x' must be an integer``."""
        return f"{name} {_shown(value)} {self}"


def judge(arg: Arg, value, field: str = "", problems: list | None = None, task: str = ""):
    """The checked value of a set ``value`` of ``arg``: of its type, within its bounds and choices.

    :param problems: where a ``dict`` parameter's own keys note theirs (``field.key``).
    :raises BadValue: saying what the value must be.
    """
    why = None
    for kind in arg.types:
        try:
            value = _convert(kind, value, arg, field, [] if problems is None else problems, task)
            break
        except _Bad as exc:
            why = str(exc) or None
    else:
        words = " or ".join(TYPE_WORDS[t] for t in arg.types)
        raise BadValue(f"must be {words}" + (f" ({why})" if why else ""), f"pass {{name}} as {words}",
                       says_value=bool(why))
    # a list of numbers (``elements="int"``) holds each item to the bounds
    for item in (value if isinstance(value, list) and arg.elements in ("int", "float") else [value]):
        if isinstance(item, (int, float)) and not isinstance(item, bool) and (
                (arg.min is not None and item < arg.min) or (arg.above is not None and item <= arg.above)
                or (arg.max is not None and item > arg.max)):
            raise BadValue(f"must be {arg.bound()}" + ("" if item is value else f" (each item; got {item})"),
                           f"give {{name}} a value {arg.bound()}", says_value=item is not value)
    if arg.choices is not None and value not in arg.choices:
        known = ", ".join(map(str, arg.choices))
        raise BadValue(f"must be one of {known}", f"use one of: {known}")
    return value


def _check_value(field: str, arg: Arg, value, problems: list, task: str):
    """The checked value of one set parameter; a problem noted (and the default returned) when it does not fit."""
    try:
        return judge(arg, value, field, problems, task)
    except BadValue as exc:
        why = str(exc)
        problems.append((field, f"parameter {field!r} of task {task} {why}"
                                + ("" if exc.says_value else f", got {_shown(value)}"), exc.fix_for(field)))
        return _default(arg)


def _default(arg: Arg):
    """The default, as a fresh copy per call: a path's ``~`` expanded, a mapping's declared keys filled."""
    value = arg.default
    if isinstance(value, str) and value.startswith("~") and arg.is_path:
        return os.path.expanduser(value)
    if isinstance(value, dict) and arg.options is not None:
        return _check_mapping(value, arg.options, {}, True, "", [], "")
    return type(value)(value) if isinstance(value, (dict, list)) else value


def _check_mapping(values: dict, args: dict, prefixes: dict, open_: bool, head: str, problems: list,
                   task: str) -> dict:
    out = {}
    for key, value in values.items():
        key = str(key)
        if key.startswith("_") and not head:
            out[key] = value  # internal: set by the entry script, never by a user
            continue
        arg = args.get(key) or next((a for p, a in prefixes.items() if key.startswith(p)), None)
        if arg is None:
            if open_:
                out[key] = value
                continue
            known = sorted(args) + [p + "*" for p in sorted(prefixes)]
            near = difflib.get_close_matches(key, known, n=1)
            problems.append((head + key, f"unknown parameter {head + key!r} for task {task}; known: "
                                         f"{', '.join(known)}",
                             f"remove {head + key}" + (f", or spell it {head + near[0]}" if near else "")
                             + " (a specops version mismatch between laptop and host also does this)"))
            continue
        out[key] = _default(arg) if _unset(value) else _check_value(head + key, arg, value, problems, task)
    for key, arg in args.items():
        if key not in out:
            out[key] = _default(arg)
        if arg.required and _unset(out[key]) and not any(f == head + key for f, _, _ in problems):
            problems.append((head + key, f"missing parameter {head + key!r} for task {task}",
                             f"set {head + key} (in the inventory, or as a flag)"))
    return out


class Spec:
    """What one task takes: the union of ``groups`` (dicts of name -> :class:`Arg`, later ones win).

    A name ending in ``*`` declares a prefix (``"model_has_*"``: every ``model_has_<x>``).

    :param task: the task's name (:attr:`name`), as messages and the refusal record say it.
    :param defaults: name -> default, replacing declared defaults (``contract.DEFAULTS``).
    :param required_if: ``(name, value, required names)``: those are required when ``name`` is ``value``.
    :param lenient: problems go to the task (with defaults in place) instead of refusing the call.
    """

    def __init__(self, task: str, *groups: dict, defaults: dict | None = None, required_if=(),
                 lenient: bool = False):
        self.name, self.lenient, self.required_if = task, lenient, tuple(required_if)
        merged = {}
        for group in groups:
            merged.update(group)
        for name, value in (defaults or {}).items():
            if name not in merged:
                raise ValueError(f"default for {name!r}, which task {task} does not declare")
            merged[name] = merged[name].but(default=value)
        self.args = {k: v for k, v in merged.items() if not k.endswith("*")}
        self.prefixes = {k[:-1]: v for k, v in merged.items() if k.endswith("*")}

    @property
    def defaults(self) -> dict:
        """name -> the value an unset parameter gets."""
        return {name: arg.default for name, arg in self.args.items()}

    def names(self, **flags) -> list:
        """Declared names whose :class:`Arg` has every attribute of ``flags`` (``names(hook=True)``)."""
        return sorted(n for n, a in self.args.items() if all(getattr(a, k) == v for k, v in flags.items()))

    def check(self, params) -> tuple:
        """``(Params, problems)``: every declared key present, each problem ``(field, message, fix)``."""
        problems: list = []
        if not isinstance(params, dict):
            problems.append(("", f"the parameters of task {self.name} must be a mapping, got {_shown(params)}",
                             "pass a JSON object"))
            params = {}
        out = Params(_check_mapping(params, self.args, self.prefixes, False, "", problems, self.name))
        out.given = frozenset(k for k in map(str, params) if k in out and not k.startswith("_"))
        for name, value, needed in self.required_if:
            missing = [n for n in needed if _unset(out.get(n)) and not any(f == n for f, _, _ in problems)]
            if out.get(name) == value and missing:
                problems.append((missing[0], f"task {self.name} with {name} {value!r} needs parameter(s) "
                                             f"{', '.join(missing)}", "set them in the inventory, or as flags"))
        return out, problems

    def error(self, problems: list) -> ArgError:
        field, summary, fix = problems[0]
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        return ArgError(f"{self.name}.params", summary + more, fix,
                        detail={"problems": [p[1] for p in problems], "fields": [p[0] for p in problems]})

    def validate(self, params) -> Params:
        """The checked parameters.

        :raises ArgError: naming the field of each problem (the first in the summary).
        """
        checked, problems = self.check(params)
        if problems:
            raise self.error(problems)
        return checked

    def task(self, fn):
        """Make ``fn`` the task's ``main``: ``main(params)`` checks ``params`` first, and a call that
        does not fit returns the one failed record without running ``fn``. ``fn(params)`` gets
        the :class:`Params`; a lenient spec's ``fn(params, problems)`` also gets the problems'
        messages. ``main.spec`` is this spec."""
        @functools.wraps(fn)
        def main(params=None):
            checked, problems = self.check({} if params is None else params)
            if self.lenient:
                return fn(checked, [message for _, message, _ in problems])
            if problems:
                return self.error(problems).payload()
            return fn(checked)

        main.spec = self
        return main


def flag_help(args: dict, names) -> dict:
    """``--flag`` name -> its help, for the parameters ``names`` of ``args`` (invoke's ``task(help=...)``)."""
    return {args[n].flag_of(n): args[n].help for n in names}


def hooks(*specs: Spec) -> dict:
    """task -> its test hooks (see the module docstring)."""
    return {spec.name: spec.names(hook=True) for spec in specs}


# --------------------------------------------------------------------------- shared declarations

#: a run's parameters: what ``specops/params.py`` ``run_params`` sends to every step of a run
#: (preflight, smoke, the job's start, the shard probe, patch), and what a run's ``params.json``
#: holds for the supervisor and its engine. Unset, each means :data:`contract.DEFAULTS` (the run's
#: sizes are defaulted once into its plan, ``remote.extract.runplan.Plan``); a task that uses the defaults
#: itself says ``defaults=contract.DEFAULTS``. The one table of run parameters: an entry with ``help`` is a
#: flag of the run tasks (specops/tasks.py), the inventory's field of its name is checked by it, and no
#: other module states its bounds or choices (tests/test_param_table.py).
RUN_ARGS = {
    "model_path": Arg("path", doc="the model's dir on the host", flag="model",
                      help="model dir on the host (default: the inventory's model_path)"),
    "dataset": Arg(("path", "list"), elements="path",
                   doc="JSONL of chat records or token ids, or speculators prepare-data's dir; a list: "
                       "concatenated in the order given (remote.extract.dataset)",
                   help="chat or token JSONL on the host, or speculators prepare-data's dir; repeat the flag for "
                        "several, read in the order given (default: the inventory's dataset)"),
    "output_dir": Arg("path", doc="where the samples go"),
    "work_dir": Arg("path", doc="specops' own dir on the host: runs/, smoke/, bundles/"),
    "python": Arg("path", doc="the inventory's python: the run's supervisor runs in it"),
    "device": Arg("str", choices=("cuda", "cpu")),
    "tp": Arg("int", min=1, help="tensor parallel size (default: the inventory's tp)"),
    "dp": Arg("int", min=1, help="data-parallel replicas on the host, each its own server (or generator process) on its own devices "
                                 "(default: the inventory's dp, else GPUs // tp; 1 on a CPU host)"),
    "on_replica_loss": Arg("str", choices=("fail", "continue"),
                           help="a replica (dp > 1) that dies: fail the run naming it (default), or give "
                                "its rows to the other replicas and say so"),
    "engine": Arg("str", choices=(*contract.ENGINE_CHOICES, *contract.ENGINE_ALIASES),
                  doc="auto, an engine or an alias of one (remote.system.versions.resolve_engine judges it)",
                  help="extraction engine: auto (default: from the host's speculators), speculators-0.3, "
                       "vllm-server or hf-reference"),
    "algorithm": Arg("str", doc="the draft algorithm: its choices are the host's (the speculators it trains with, "
                                "the vLLM it serves with: remote.drift.algorithms), its layer-id plan "
                                "remote.wire.layers.algorithm_plan; unset: contract.DEFAULTS",
                     help="draft algorithm the states are for, trained and served: one the host's speculators "
                          "trains (eagle3, peagle, dflash, dflash2, dspark, xpress, mtp in 0.9; default eagle3)"),
    "layer_ids": Arg("list", help="comma-separated layer ids (default: the engine's own, convention recorded)"),
    "layer_convention": Arg("str", choices=contract.LAYER_CONVENTIONS,
                            doc="what layer_ids mean (output/input); None: the engine's own"),
    "seq_len": Arg("int", min=1, help="max tokens per sample"),
    "long_samples": Arg("str", choices=contract.LONG_SAMPLES,
                        help="a sample longer than --seq-len: truncate (default: keep its first seq_len tokens, "
                             "warn), refuse (stop before the load, naming it) or drop (leave it out; counted in the "
                             "manifest)"),
    "turns": Arg("str", choices=contract.CHAT_TURNS,
                 help="chat rows: per-turn (a sample per assistant turn, end-of-turn token supervised: speculators "
                      "0.9), whole (a sample per row, reply text supervised: 0.3) or auto (default: the host's "
                      "speculators' rule)"),
    "minimum_valid_tokens": Arg("int", min=0,
                                help="leave out a sample with fewer supervised tokens (default 1: none with "
                                     "nothing to learn)"),
    "max_samples": Arg("int", min=1, help="number of samples to extract"),
    "batch_size": Arg("int", min=1, help="samples per engine call"),
    "gpu_memory_utilization": Arg("float", above=0, max=1),
    "trust_remote_code": Arg("bool"),
    "env": Arg("env", doc="exported for the run's processes"),
    "sample_range": Arg("list", doc="[start, stop): the dataset range of a group run's shard"),
    "replica": Arg("dict", doc="this host's place in a replica over several hosts (remote.extract.replica)"),
    "format": Arg("str", choices=contract.STATE_FORMATS,
                  doc="the states' dtype on disk: bf16 (None: what the model computes) or fp8 (vllm-server only: "
                      "contract.state_format_problem)",
                  help="the states' dtype on disk: bf16 (default: what the model computes) or fp8 (half the bytes; on an "
                       "H100 {fp8_of_plain} of plain prefill landed vs bf16's {bf16_of_plain}, {fp8_durable_of_plain} "
                       "on disk vs {bf16_durable_of_plain}; vllm-server engine; train with --hidden-states-backend "
                       "fp8)".format(**contract.FP8_SPEED)),
    # the engines' own knobs: read from the run's params (remote/extract/engines, remote/extract/supervisor)
    "writer_threads": Arg("int", min=1, max=256, doc="vllm-server: the connector's num_writer_threads (default: its own 8, "
                                             "capped at the host's usable cores)"),
    "chunked_prefill": Arg("str", choices=contract.CHUNKED_PREFILL,
                           doc="vllm-server: prefill a sample longer than the step budget in chunks; auto: on where "
                               "the installed connector writes once a request is done (chunking.py)"),
    "dtype": Arg("str", doc="the engine's dtype (vLLM's --dtype; hf-reference: bfloat16)"),
    "enforce_eager": Arg("bool", doc="vLLM without graph compilation (default on CPU hosts)"),
    "server_args": Arg("list", elements="str", doc="more vLLM server flags, appended as given"),
    "kv_connector": Arg("str", doc="the hidden-states connector the server loads (default: by device)"),
    "language_model_only": Arg("bool"),
    "max_num_seqs": Arg("int", min=1),
    "max_num_batched_tokens": Arg("int", min=1),
    "port": Arg("int", min=1, max=65535, doc="the server's port (default: a free one)"),
    "die_with_parent": Arg("bool", doc="the server dies with the supervisor (default true)"),
    "ready_timeout_s": Arg("float", above=0),
    "request_timeout_s": Arg("float", above=0),
    "stop_grace_s": Arg("float", min=0),
    "concurrency": Arg("int", min=1, doc="requests in flight (default: batch_size)"),
    "digest_workers": Arg("int", min=1),
    "digest_in": Arg("str", choices=("auto", "processes", "threads"),
                     doc="where landed files are digested: worker processes, the engine's threads, or auto "
                         "(processes on hosts of more than 4 cores)"),
    "worker_error_grace_s": Arg("float", min=0,
                                doc="how long a rank's recorded error may go unanswered by the driver (20)"),
    "write_queue_batches": Arg("int", min=0, doc="batches that may wait for the sample writer (1; 0: no writer thread)"),
    "canary_samples": Arg("int", min=0, max=contract.CANARY_SAMPLES_MAX,
                          doc="the run's first N samples also ask the engine for their prompt logprobs "
                          "(vllm-server; contract.CANARY_SAMPLES) and are checked as they land (remote/verify/canary.py); 0: none",
                          help="the canary: the run's first N samples checked against the engine's own logprobs as "
                               "they land, a fail stops the run (default: the inventory's canary_samples, else 2; "
                               "0: none; vllm-server)"),
    "prompt_logprobs_top": Arg("int", min=1, max=20, doc="top tokens kept per position (contract.PROMPT_LOGPROBS_TOP)"),
    "canary": Arg("bool", doc="stop the run when a canary sample fails its logits check (default true)"),
    # test hooks (the module docstring says what each does)
    "inject_failure": Arg("dict", hook=True, doc="{rank, at: load|extract, message}"),
    "batch_delay_s": Arg("float", min=0, hook=True, doc="a pause after each batch"),
    "plain": Arg("bool", hook=True, doc="the server without extraction (the benchmarks' baseline)"),
    "server_args_unchecked": Arg("list", elements="str", hook=True,
                                 doc="server flags appended unchecked (a planted fault)"),
    "swap_sample_states": Arg("list", elements="int", hook=True,
                              doc="[i, j]: samples i and j land with each other's states (a planted fault)"),
}

#: a train run's own numbers that ``specops train`` flags set: the laptop checks a flag against these before
#: connecting (``specops/train.py``), the train task's spec again (``remote/train/task.py``).
TRAIN_ARGS = {
    "epochs": Arg("int", 1, min=1, doc="speculators' --epochs (its --max-steps does not end a run in 0.9.0)"),
    "gpus": Arg("int", min=1, doc="trainer processes on a CUDA host, one per GPU under torchrun (default: every "
                                  "GPU the job sees); on a CPU test host (its CPU launcher) that many gloo ranks "
                                  "(default 1): remote.train.supervisor.trainer_processes"),
    "total_seq_len": Arg("int", min=1, doc="speculators' --total-seq-len: tokens packed into one step (default "
                         "remote.train.plan.default_total_seq_len); not below the states' seq_len"),
    "master_port": Arg("int", min=1, max=65534, doc="a run over several hosts: the port torchrun's rendezvous "
                       "listens on at the first host (default specops.inventory.DEFAULT_MASTER_PORT)"),
    "regen_max_tokens": Arg("int", min=1, doc="regenerate: tokens per reply (default: the states run's seq_len)"),
    "regen_temperature": Arg("float", min=0, doc="regenerate: sampling temperature (default 0: greedy)"),
    # train --online: speculators' own checks of each streamed sample (ids echo, shape, finite), passed to its trainer
    "generation_validation_retries": Arg("int", min=0, doc="online: speculators' --generation-validation-retries, "
                                         "more tries of a streamed sample that failed its checks (default its 2)"),
    "max_consecutive_generation_failures": Arg("int", min=1, doc="online: speculators' --max-consecutive-generation-"
                                               "failures, samples in a row given up before the run fails (default "
                                               "its 20)"),
    "server_on": Arg("str", help="--online, disaggregated: the inventory host, or replica over several hosts "
                     "(replicas:), that runs the run's extraction server (the trainer runs on --on's host, which "
                     "reaches it at the server host's (the replica head's) node_address, or its address when that "
                     "is an IP)"),
    "server_port": Arg("int", 29600, min=1, max=65534, help="--online --server-on: the port the server's API listens "
                       "on at the server host's address; the next one is its supervisor's watch"),
    "keep_states": Arg("str", "none", choices=("none", "all"), doc="online: which streamed states stay on disk; none "
                       "(the token dataset only; speculators 0.9 deletes each once read) or all (each validated "
                       "sample kept, later epochs read it from disk, and the finished run leaves an extraction run "
                       "<run-id>-kept: remote.train.keepstates)"),
}

#: which installed packages a check looks at, and what it checks them for: the drift check, the
#: patcher and preflight (which runs both) read these.
STACK_ARGS = {
    "site_packages": Arg(("path", "list"), elements="path",
                         doc="dir(s) searched first for speculators/vLLM (default: this python's)"),
    "patches_root": Arg("path", doc="the patch sets (default: <bundle>/patches)"),
    "architecture": Arg("str", doc="check this architecture (default: from model_path's config)"),
    "model_family": Arg("str", doc="check this family's architecture (llama, deepseek_v3, ...)"),
    "model_has_*": Arg("bool", doc="model_has_<feature>: the model uses it (default: from its config)"),
}

#: ``specops patch`` sends these to the patcher and then, as they are, to the drift check.
PATCH_ARGS = {
    "action": Arg("str", "status", choices=("check", "apply", "revert", "status")),
    "inject_failure_after": Arg("int", min=0, hook=True, doc="fail after writing this many files"),
    "hold_lock_s": Arg("float", min=0, hook=True, doc="keep the lock this long after the action"),
}

#: a host behind Slurm (the inventory's ``scheduler: slurm``, its ``slurm:`` mapping): how its jobs are asked
#: for. The inventory checks these (``specops/inventory.py``), the job task again before it submits
#: (``remote/run/slurm.py``); ``slurm.time_limit_minutes`` reads the time in Slurm's own formats.
SLURM_ARGS = {
    "partition": Arg("str", required=True, doc="the partition jobs go to (sbatch/srun -p)"),
    "account": Arg("str", doc="the account charged (-A); default: the user's default account"),
    "qos": Arg("str", doc="the quality of service (--qos)"),
    "gres": Arg("str", doc="generic resources per node, e.g. gpu:8 or gpu:h100:8 (--gres); the GPUs a job asks for"),
    "time_limit": Arg("str", doc="the job's time limit in Slurm's format: MINUTES, HH:MM:SS or D-HH:MM:SS (-t); "
                                 "default: the partition's"),
    "nodes": Arg("int", 1, min=1, doc="nodes per job (-N); a train run spans them, one torchrun a node; an extraction "
                                "is one vLLM replica over them (tp: its whole TP, tp / nodes ranks a node)"),
    "array": Arg("int", min=1, doc="extract as a group plan of this many shards, each a task of one job array "
                                   "(sbatch --array=0-N-1, task i extracts shard i into the run's one output dir); "
                                   "unset or 1: the run is one job"),
    "setup": Arg("str", doc="a shell line run on the compute node before specops' python (module load ..., "
                            "a container's env)"),
}

#: ``eval``'s flags of what is measured and how (remote/train/evaluate.py ``SPEC``): the CLI's flags and
#: their help derive from these (specops/tasks.py), and the laptop checks them with :func:`judge` before connecting.
EVAL_ARGS = {
    "prompts": Arg(("int", "path"), 8, min=1,
                   help="held-out dataset rows to send (N, after the rows the extraction read), or a prompt file on "
                        "the host: MT-Bench question.jsonl, SPEED-Bench, a speculator_benchmarks subset or chat rows "
                        "(remote/train/prompts.py); results per category"),
    "max_tokens": Arg("int", 32, min=1, doc="tokens to generate per prompt"),
    "temperature": Arg("list", [0.0], elements="float", min=0.0, max=10.0,
                       help="sampling temperature (repeat the flag to sweep: --temperature 0 --temperature 0.7); "
                            "0 is greedy"),
    "concurrency": Arg("list", [1], elements="int", min=1, max=1024,
                       help="requests in flight at once (repeat the flag to sweep: --concurrency 1 --concurrency 4); "
                            "each level measured alone, and with --baseline against the plain server"),
    "min_acceptance_length": Arg("dict", open=True,
                                 help="the bar a draft must clear: X (every category and the whole set) or "
                                      "CATEGORY=X (repeat the flag); below it eval fails with its own exit code"),
}
