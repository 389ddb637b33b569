"""Preflight probes: one module per area, each a plain function over a :class:`Context`.

A probe reads what it needs from ``ctx.params`` and from facts earlier probes left on
the context (``ctx.host``, ``ctx.model``, ...), and returns a list of
:func:`remote.wire.protocol.record`. Probes never raise for a broken host or model: a
missing file or a bad value is a ``fail`` record with a fix. They import only the
standard library; the one probe that needs transformers runs it in a subprocess
(:mod:`remote.probes.hf_load`).

Files that parse but have the wrong shape are checked with
:mod:`remote.system.jsonfile` (``expect`` / ``field`` raise ``Malformed``: one line naming the
file, the key and what was expected), which the probe turns into its fail record
(``preflight`` turns any that escape into one too).
"""
from __future__ import annotations

import os


class Context:
    """What the probes of one preflight run share.

    :param params: the checked params (``remote.probes.preflight.SPEC``).
    """

    def __init__(self, params: dict):
        self.params = params
        #: host facts: python, os, cpus, ram, gpus, disk (filled by ``host``).
        self.host: dict = {}
        #: model summary from config.json (filled by ``model``); empty when unreadable.
        self.model: dict = {}
        #: checkpoint facts: files, bytes (filled by ``checkpoint``).
        self.checkpoint: dict = {}
        #: the layer ids the run would capture and their convention (filled by ``layer_ids``).
        self.layers: dict = {}
        #: dataset facts: record count when cheap to count (filled by ``tokenizer_data``).
        self.data: dict = {}
        #: ``(engine, why)`` as preflight resolved ``params["engine"]`` (None: the name as given).
        self.engine: tuple | None = None
        #: the run's :class:`remote.extract.runplan.Plan` (filled by ``layer_ids``); None when none could be made.
        self.plan = None

    def env(self, name: str, default=None):
        """A variable as the extraction job will see it: the inventory's ``env`` wins over ours."""
        job_env = self.params.get("env") or {}
        if name in job_env:
            return str(job_env[name])
        return os.environ.get(name, default)


def nearest_existing(path: str) -> str:
    """The path itself or its closest existing parent (where a new dir would be made)."""
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p
