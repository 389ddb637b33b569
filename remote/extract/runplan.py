"""A run's parameters resolved once into a :class:`Plan` (stdlib only).

What a run captures and where it writes is decided here, once, from its parameters and
the model's ``config.json``: the engine (``auto`` made concrete) and the layer convention
it writes in, the layer ids in that convention and in both named ones, the sample file
format, the model's decoder-layer count ``N`` (:func:`remote.system.modelconfig.decoder_layers`,
the one rule), the output dir, the sample range and the canary (how many first samples
are checked against the engine's own logprobs as they land). Preflight reports the plan, the
shard probe plans a group run from it, the supervisor runs it and hands it to the
engine, and verify reads a finished run's plan back from its manifest::

    >>> plan = resolve({"engine": "vllm-server", "layer_ids": [1, 3], "layer_convention": "output"},
    ...                {"num_hidden_layers": 8})
    >>> plan.engine, plan.convention, plan.layer_ids, plan.ids("output"), plan.format, plan.num_layers
    ('vllm-server', 'input', [2, 4], [1, 3], 'hs', 8)
    >>> resolve({"engine": "vllm-server", "layer_ids": [0], "layer_convention": "output"},
    ...         {"num_hidden_layers": 8}).problems
    []
    >>> resolve({"engine": "speculators-0.3", "layer_ids": [9]}, {"num_hidden_layers": 8}).require()
    Traceback (most recent call last):
    ValueError: layer ids [9] (given, output convention): layer id 9 is out of range 0..7 (output convention, 8 layers)

A plan whose ids are unusable is still a plan (``problems`` says why): preflight and the
shard probe report it; the supervisor calls :meth:`Plan.require` and fails the run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from remote.system import modelconfig, versions
from remote.wire import argspec, contract, layers

#: the run's sizes a :class:`Plan` carries, defaulted once (:data:`remote.wire.contract.DEFAULTS`).
SIZES = ("seq_len", "batch_size", "max_samples")
#: where a run's samples go when its parameters name no output dir (inside its run dir).
DEFAULT_OUTPUT_SUBDIR = "samples"


class PlanError(ValueError):
    """A parameter no plan can be made from (an engine that does not fit, a malformed sample
    range, a config with no layer count); ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass
class Plan:
    """One run, resolved: every later step reads these instead of resolving them again."""

    #: the concrete engine (never ``auto``) and why it was picked.
    engine: str
    engine_why: str
    #: the convention the engine's layer ids are written in (``output`` or ``input``).
    convention: str
    #: the layer ids in :attr:`convention`, in the order the run captures them.
    layer_ids: list
    #: the sample file format the engine writes (``pt`` or ``hs``).
    format: str
    #: the language model's decoder-layer count.
    num_layers: int
    #: the states' dtype on disk (:data:`remote.wire.contract.STATE_FORMATS`): ``bf16`` or ``fp8``.
    state_format: str = contract.BF16
    #: how many of the run's first samples also ask the engine for their prompt logprobs and are
    #: checked as they land (:mod:`remote.verify.canary`); 0: no canary (an engine without prompt logprobs).
    canary_samples: int = contract.CANARY_SAMPLES
    #: the run's sizes, defaulted once here (:data:`remote.wire.contract.DEFAULTS`) for every later reader:
    #: tokens per sample, samples per engine call, samples in all.
    seq_len: int = contract.DEFAULTS["seq_len"]
    batch_size: int = contract.DEFAULTS["batch_size"]
    max_samples: int = contract.DEFAULTS["max_samples"]
    #: where the samples go (None: not known to the caller; a run dir's ``samples/``).
    output_dir: str | None = None
    #: the ``[start, stop)`` of global sample indices asked for (None: the whole dataset).
    sample_range: list | None = None
    #: where the ids came from (``engine default``, ``given``, ``given as output:[...]``).
    source: str = "given"
    #: the engine's default ids for this model, in :attr:`convention`.
    default: list = field(default_factory=list)
    #: ``src:i=dst:j`` for ids typed in the other convention.
    mapping: list = field(default_factory=list)
    #: ids typed in the other convention that have no counterpart in this one.
    refused: list = field(default_factory=list)
    #: why the ids are unusable (out of range, repeated, ...); empty when they are fine.
    problems: list = field(default_factory=list)

    def ids(self, convention: str) -> list[int]:
        """The layer ids named in ``convention`` (the same tensors)."""
        return layers.convert(self.layer_ids, self.convention, convention)

    def require(self) -> "Plan":
        """This plan, when its layer ids are usable.

        :raises ValueError: naming the ids, where they came from and every problem.
        """
        problems = self.refused + self.problems
        if problems:
            raise ValueError(f"layer ids {self.layer_ids} ({self.source}, {self.convention} convention): "
                             + "; ".join(problems))
        return self

    def bounds(self, size: int) -> tuple[int, int]:
        """``(start, stop)`` of the samples to extract from a dataset of ``size`` rows: the
        asked range clipped to the dataset, else all of it."""
        if self.sample_range is None:
            return 0, size
        return min(self.sample_range[0], size), min(self.sample_range[1], size)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data, the ids in both conventions beside the engine's own."""
        out = asdict(self)
        ok = not (self.refused or self.problems)
        out.update(layer_ids_output=self.ids(layers.OUTPUT) if ok else None,
                   layer_ids_input=self.ids(layers.INPUT) if ok else None)
        return out


def output_dir(params: dict, run_dir=None) -> str | None:
    """Where a run's samples go: its ``output_dir``, else ``<run_dir>/samples`` (None without a run dir)."""
    if params.get("output_dir"):
        return str(params["output_dir"])
    return str(Path(run_dir) / DEFAULT_OUTPUT_SUBDIR) if run_dir is not None else None


def check_sample_range(asked) -> list | None:
    """``asked`` (a shard's ``[start, stop)`` of global indices) as a list, or None for the whole dataset.

    :raises PlanError: a range that is not two whole numbers ``0 <= start <= stop``.
    """
    if asked is None:
        return None
    if (not isinstance(asked, (list, tuple)) or len(asked) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in asked)
            or not 0 <= asked[0] <= asked[1]):
        raise PlanError("sample_range", f"sample_range {asked!r} must be [start, stop] with 0 <= start <= stop "
                                        f"(global dataset indices, stop exclusive)")
    return [asked[0], asked[1]]


def _checked(name: str, asked):
    """Run parameter ``name`` as asked, else its default (:data:`remote.wire.contract.DEFAULTS`), held to its
    entry of the one table (:data:`remote.wire.argspec.RUN_ARGS`: a caller that skipped the task's spec, such
    as a benchmark building a plan directly, gets the same check).

    :raises PlanError: naming the field, what it must be and the fix.
    """
    value = contract.param({name: asked}, name) if name in contract.DEFAULTS else asked
    try:
        return argspec.judge(argspec.RUN_ARGS[name], value)
    except argspec.BadValue as exc:
        raise PlanError(name, f"{exc.about(name, value)}. Fix: {exc.fix_for(name)}") from None


def check_state_format(asked, engine: str) -> str:
    """The run's ``format`` (bf16 when unset), when ``engine`` writes it.

    :raises PlanError: an unknown format, or fp8 on an engine that writes no fp8 states.
    """
    fmt = _checked("format", asked or contract.BF16)
    problem = contract.state_format_problem(fmt, engine)
    if problem:
        raise PlanError("format", f"format fp8 {problem}. Fix: set format: bf16 (or drop --format fp8), "
                                  f"or run on a host whose speculators >= 0.5 picks the vllm-server engine")
    return fmt


def check_canary_samples(asked, engine: str) -> int:
    """The run's ``canary_samples`` (:data:`remote.wire.contract.CANARY_SAMPLES` when unset); 0 on an engine
    that gives no prompt logprobs (the seed engine computes no logits), whatever was asked.

    :raises PlanError: out of its :data:`remote.wire.argspec.RUN_ARGS` bounds.
    """
    count = _checked("canary_samples", asked)
    return count if engine in contract.CANARY_ENGINES else 0


def resolve_engine(asked) -> tuple[str, str]:
    """``(engine, why)`` for the ``engine`` parameter (``auto``/None: what the host's speculators needs).

    :raises PlanError: an unknown name, or ``auto`` on a host where no engine fits.
    """
    try:
        return versions.resolve_engine(asked)
    except ValueError as exc:
        raise PlanError("engine", str(exc)) from None


def resolve(params: dict, config: dict, *, run_dir=None, engine: tuple[str, str] | None = None) -> Plan:
    """The run's plan from its (checked) parameters and the model's ``config.json``.

    :param engine: ``(name, why)`` when the caller resolved the engine already (preflight
        reports its own record for it); else :func:`resolve_engine` of ``params["engine"]``.
    :param run_dir: the run's dir, for the default output dir.
    :raises PlanError: no engine fits, a malformed sample range, or no layer count in the config.
    """
    name, why = engine or resolve_engine(params.get("engine"))
    facts = contract.ENGINES[name]
    try:
        n = modelconfig.decoder_layers(config)
    except ValueError as exc:
        raise PlanError("num_layers", str(exc)) from None
    sample_range = check_sample_range(params.get("sample_range"))
    state_format = check_state_format(params.get("format"), name)
    canary_samples = check_canary_samples(params.get("canary_samples"), name)
    sizes = {key: _checked(key, params.get(key)) for key in SIZES}
    picked = layers.resolve(params.get("layer_ids"), params.get("layer_convention"), name, n)
    return Plan(engine=name, engine_why=why, convention=facts.convention, layer_ids=picked["ids"],
                format=facts.sample_format, num_layers=n, state_format=state_format, canary_samples=canary_samples,
                **sizes, output_dir=output_dir(params, run_dir),
                sample_range=sample_range, source=picked["source"], default=list(picked["default"] or []),
                mapping=picked["mapping"], refused=picked["refused"], problems=picked["problems"])


def for_engine(name: str, model_path, layer_ids, params: dict | None = None) -> Plan:
    """The plan of an engine built directly (a benchmark, the server CLI): ``layer_ids`` already
    in the engine's convention, ``N`` from the model's config."""
    params = dict(params or {}, engine=name, layer_ids=list(layer_ids), layer_convention=None)
    return resolve(params, modelconfig.read(model_path), engine=(name, "given"))


def from_manifest(doc: dict, output_dir) -> Plan:
    """A finished run's plan as its manifest records it (what verify checks)."""
    engine = doc.get("engine") or {}
    name = engine.get("name") if isinstance(engine, dict) else engine
    config = (doc.get("model") or {}).get("config") or {}
    n = modelconfig.num_layers(config)
    return Plan(engine=str(name or ""), engine_why="recorded", convention=doc["layer_convention"],
                layer_ids=[int(x) for x in doc["layer_ids"]], format=doc.get("format_name") or "",
                num_layers=n if isinstance(n, int) else 0, state_format=doc.get("state_format") or contract.BF16,
                canary_samples=_recorded_canary(doc, str(name or "")), output_dir=str(output_dir),
                **{key: int(contract.param(doc.get("params") or {}, key)) for key in SIZES},
                sample_range=doc.get("sample_range"), source="recorded")


def _recorded_canary(doc: dict, engine: str) -> int:
    """The canary samples a finished run had: its engine's record, else its params (an older run: the
    default), 0 for an engine that runs no canary."""
    facts = doc.get("engine") if isinstance(doc.get("engine"), dict) else {}
    if isinstance(facts.get("canary_samples"), int):
        return facts["canary_samples"]
    count = contract.param(doc.get("params") or {}, "canary_samples")
    return int(count) if engine in contract.CANARY_ENGINES and isinstance(count, int) else 0
