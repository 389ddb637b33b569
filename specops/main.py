"""The installed ``specops`` program: Fabric's own ``Fab`` over the same tasks as fabfile.py.

``specops preflight`` and ``fab preflight`` are the same task; ``specops --list``
and ``fab --list`` show the same help.
"""
from __future__ import annotations

from fabric import Config, Executor
from fabric.main import Fab
from invoke import Collection

from specops import __version__, tasks


class SpecopsConfig(Config):
    """Config files and env vars are named for specops (``SPECOPS_*``, ``specops.yaml``)."""

    prefix = "specops"


def make_program() -> Fab:
    """Build the program object (a function, as fabric does, for testing)."""
    return Fab(name="Specops", binary="specops", version=__version__,
               namespace=Collection.from_module(tasks), executor_class=Executor,
               config_class=SpecopsConfig)


program = make_program()
