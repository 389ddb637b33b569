"""Extraction engines: plugs behind the supervisor (stdlib at import).

Every engine has one life cycle::

    engine = engine_class(name)(model_path, tp, layer_ids, params, plan=plan)
    engine.load()                                  # slow: model load, workers start
    states = engine.extract([[1, 5, 9], [1, 7]])   # per sample, per layer: Tensor[tokens, hidden]
    engine.close()

``layer_ids`` are already validated by the supervisor and are in the engine's own
convention (``remote.wire.layers.ENGINE_CONVENTION[name]``); ``plan`` is the run's
:class:`remote.extract.runplan.Plan` (the model's layer count, the format), resolved once by the
supervisor (an engine built without one resolves it from the model's config, as a
benchmark does); ``extract`` returns the layers
in the order of ``layer_ids``. An engine raises on anything it cannot do; the
supervisor turns the exception (and, for multi-process engines, the failing rank's
own traceback) into the run's error.

The registry maps names to ``module:Class`` strings so that importing it loads no
engine (and no torch).
"""
from __future__ import annotations

import importlib

from remote.run import faults
from remote.wire import contract
from remote.wire.contract import HF_REFERENCE, SPECULATORS_03, VLLM_SERVER

#: engine name -> "module:Class" (module relative to this package).
ENGINES = {
    HF_REFERENCE: "hf_reference:HFReferenceEngine",
    SPECULATORS_03: "speculators_v03:SpeculatorsV03Engine",
    VLLM_SERVER: "vllm_server:VllmServerEngine",
}


def engine_class(name: str):
    """The class of the engine ``name`` (or an alias of it) names; which engine ``auto`` means is the
    (:func:`remote.system.versions.resolve_engine`)."""
    module_name, _, cls_name = ENGINES[contract.canonical_name(name)].partition(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, cls_name)


class Engine:
    """Base of the plugs: keeps the arguments and defines the life cycle.

    :param model_path: the model directory on the host.
    :param tp: tensor-parallel size (engines that cannot shard ignore it and say so).
    :param layer_ids: layer ids in this engine's convention.
    :param params: the run parameters (``inject_failure``, ... ; its sizes are the plan's: ``plan.seq_len``).
    :param plan: the run's :class:`remote.extract.runplan.Plan`; None: resolved here from the model's
        config for ``layer_ids`` (an engine built outside a run), when first read.
    """

    #: registry name; also the key of ``remote.wire.layers.ENGINE_CONVENTION``.
    name = ""
    #: True when the engine computes in the supervisor's own process (its errors are rank 0's).
    in_process = False

    def __init__(self, model_path, tp: int, layer_ids, params: dict, plan=None):
        self.model_path = str(model_path)
        self.tp = int(tp)
        self.layer_ids = list(layer_ids)
        self.params = dict(params)
        self._plan = plan

    @property
    def plan(self):
        """The run's plan (:mod:`remote.extract.runplan`): what N and the format are for this engine."""
        if self._plan is None:
            from remote.extract import runplan

            self._plan = runplan.for_engine(self.name, self.model_path, self.layer_ids, self.params)
        return self._plan

    def load(self) -> None:
        raise NotImplementedError

    def extract(self, batch):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def model_len(self, config: dict) -> int:
        """vLLM's ``max_model_len`` for this run: room for the longest sample (``seq_len``) plus
        the one token each request generates, within the language model's own position limit."""
        from remote.system import modelconfig

        seq_len = self.plan.seq_len
        limit = modelconfig.text_value(config, "max_position_embeddings")
        return min(seq_len + 1, int(limit)) if limit else seq_len + 1

    def describe(self) -> dict:
        """What goes into the manifest about the engine."""
        return {"name": self.name, "tp": self.tp}

    def process_deaths(self) -> list[dict]:
        """Processes of the engine that ended (``name``, ``rank``, ``pid``, ``exit_code``, ``died_at``),
        for engines that are their parent; the root-cause reader names a death by signal."""
        return []

    def error_record(self, exc: BaseException) -> dict | None:
        """The run's error for ``exc`` when the engine knows its root cause better than the
        supervisor's readers (``rank``, ``type``, ``message``, ``traceback``, ``where``); None otherwise."""
        return None

    def _maybe_inject(self, at: str, rank: int = 0) -> None:
        """An in-process engine's fault point (``inject_failure``, :mod:`remote.run.faults`)."""
        faults.engine_step(self.params, at, rank)
