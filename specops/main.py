"""The installed ``specops`` program: Fabric's own ``Fab`` over the same tasks as fabfile.py.

``specops preflight`` and ``fab preflight`` are the same task; ``specops --list``
and ``fab --list`` show the same help.
"""
from __future__ import annotations

import contextlib

from fabric import Config, Executor
from fabric.main import Fab
from invoke import Collection, Exit, ParseError

from specops import __version__, tasks
from specops.exit_codes import ExitCode


class SpecopsConfig(Config):
    """Config files and env vars are named for specops (``SPECOPS_*``, ``specops.yaml``)."""

    prefix = "specops"


@contextlib.contextmanager
def _usage_errors():
    try:
        yield
    except ParseError as exc:
        raise Exit(f"error: {exc}\n  hint: `specops --help TASK` lists a task's flags",
                   code=int(ExitCode.USAGE)) from None


class SpecopsProgram(Fab):
    """Fab, except that a flag or task it cannot parse is a usage error (exit 3), not invoke's 1."""

    def parse_core(self, *args, **kwargs):
        with _usage_errors():
            super().parse_core(*args, **kwargs)

    def parse_tasks(self):
        with _usage_errors():
            super().parse_tasks()

    def parse_cleanup(self):
        with _usage_errors():
            super().parse_cleanup()


def make_program() -> Fab:
    """Build the program object (a function, as fabric does, for testing)."""
    return SpecopsProgram(name="Specops", binary="specops", version=__version__,
               namespace=Collection.from_module(tasks), executor_class=Executor,
               config_class=SpecopsConfig)


program = make_program()
