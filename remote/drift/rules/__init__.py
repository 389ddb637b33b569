"""The drift rules: one module per family, each a plain ``rule(ctx) -> [Finding]``.

A rule reads one speculators file (``ctx.spec``) against the installed vLLM
(``ctx.index``) and returns what it found; it keeps nothing between calls. File rules
run once per file; target rules run once per file and target model (``ctx.target``),
because whether the worker's ``model.model`` exists depends on the class vLLM builds.

================  ==========================================================  =======
module            what it checks                                              per
================  ==========================================================  =======
``imports``       names imported from vLLM still exist                        file
``calls``         calls to vLLM callables bind against their signatures       file
``runtime``       two-phase execution, block hashes, CUDA-only calls,         file
                  ``collective_rpc(unique_reply_rank=...)`` results
``gates``         ``supports_*(model)`` gates that raise, for the target      target
``model_object``  ``model.<attr>`` on the object vLLM builds                  target
``bound_model``   functions bound onto the inner model: attributes, layer     target
                  calls
================  ==========================================================  =======

:func:`remote.drift.run_rules` applies them all and merges a place found again for
another target into one finding (its ``architectures`` grow; a ``fail`` wins over a
``warn``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from remote.wire import protocol


@dataclass
class Finding:
    """One drift at one place: the stable ``id``, ``file:line`` in speculators, the cause."""

    id: str
    file: str
    line: int
    cause: str
    status: str = protocol.FAIL
    hint: str = ""
    detail: dict = field(default_factory=dict)


@dataclass
class Context:
    """What a rule reads. Nothing here changes while the rules run, except :attr:`sites`.

    :ivar spec: the speculators file being checked (a :class:`~remote.drift.source.SpecFile`).
    :ivar files: every checked speculators file (some facts, such as whether prefix
        caching is on, are settled across them).
    :ivar index: the installed vLLM (:class:`~remote.drift.pyindex.PackageIndex`).
    :ivar params: the check's params (``device``, ...).
    :ivar target: the :class:`~remote.drift.targets.Target` of a target rule; None for file rules.
    :ivar sites: vLLM call sites bound against a signature, ``(file, line, column)``: rules
        that bind a call add it, for the summary's count.
    """

    spec: object
    files: list
    index: object
    params: dict
    target: object = None
    sites: set = field(default_factory=set)

    def finding(self, node, drift_id: str, cause: str, status: str = protocol.FAIL, hint: str = "",
                **detail) -> Finding:
        """A :class:`Finding` at ``node`` of this file, naming this context's target."""
        path, line = self.spec.loc(node)
        if self.target is not None:
            detail["architectures"] = [self.target.architecture]
        return Finding(drift_id, path, line, cause, status, hint, detail)

    def site(self, call) -> None:
        self.sites.add((str(self.spec.path), call.lineno, call.col_offset))


def slug(text: str) -> str:
    """``"SchedulerConfig"`` -> ``"scheduler-config"``: the readable part of a generic drift id."""
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", text).lower()).strip("-")

