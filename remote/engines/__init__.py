"""Extraction engines: plugs behind the supervisor (stdlib at import).

Every engine has one life cycle::

    engine = engine_class(name)(model_path, tp, layer_ids, params)
    engine.load()                                  # slow: model load, workers start
    states = engine.extract([[1, 5, 9], [1, 7]])   # per sample, per layer: Tensor[tokens, hidden]
    engine.close()

``layer_ids`` are already validated by the supervisor and are in the engine's own
convention (``remote.layers.ENGINE_CONVENTION[name]``); ``extract`` returns the layers
in the order of ``layer_ids``. An engine raises on anything it cannot do; the
supervisor turns the exception (and, for multi-process engines, the failing rank's
own traceback) into the run's error.

The registry maps names to ``module:Class`` strings so that importing it loads no
engine (and no torch).
"""
from __future__ import annotations

import importlib

#: engine name -> "module:Class" (module relative to this package).
ENGINES = {
    "hf-reference": "hf_reference:HFReferenceEngine",
    "speculators-0.3": "speculators_v03:SpeculatorsV03Engine",
}
#: other spellings people type.
ALIASES = {"hf_reference": "hf-reference", "hf": "hf-reference",
           "speculators_v03": "speculators-0.3", "speculators": "speculators-0.3"}


def canonical_name(name: str) -> str:
    """The registry name for ``name``; raises ValueError naming the known engines."""
    key = ALIASES.get(name, name)
    if key not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known engines: {sorted(ENGINES)}")
    return key


def engine_class(name: str):
    module_name, _, cls_name = ENGINES[canonical_name(name)].partition(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, cls_name)


class InjectedFailure(RuntimeError):
    """Raised on purpose by the ``inject_failure`` test hook (never in a real run)."""


class Engine:
    """Base of the plugs: keeps the arguments and defines the life cycle.

    :param model_path: the model directory on the host.
    :param tp: tensor-parallel size (engines that cannot shard ignore it and say so).
    :param layer_ids: layer ids in this engine's convention.
    :param params: the run parameters (``seq_len``, ``inject_failure``, ... ).
    """

    #: registry name; also the key of ``remote.layers.ENGINE_CONVENTION``.
    name = ""
    #: True when the engine computes in the supervisor's own process (its errors are rank 0's).
    in_process = False

    def __init__(self, model_path, tp: int, layer_ids, params: dict):
        self.model_path = str(model_path)
        self.tp = int(tp)
        self.layer_ids = list(layer_ids)
        self.params = dict(params)

    def load(self) -> None:
        raise NotImplementedError

    def extract(self, batch):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        """What goes into the manifest about the engine."""
        return {"name": self.name, "tp": self.tp}

    def _maybe_inject(self, at: str, rank: int = 0) -> None:
        """Test hook for in-process engines: raise where ``params["inject_failure"]`` says."""
        spec = self.params.get("inject_failure") or {}
        if spec and spec.get("at") == at and int(spec.get("rank", 0)) == rank:
            raise InjectedFailure(spec.get("message") or f"injected failure at {at} on rank {rank}")
