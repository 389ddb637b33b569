"""Where the trees that travel with specops live: ``templates/``, ``remote/``, ``patches/``.

In a checkout they are the top-level folders beside ``specops/`` (the layout the
project keeps). An installed wheel carries the same three trees inside the package,
as ``specops/_assets/<name>/`` (``pyproject.toml`` maps them there), because a wheel
can only install files under its own packages. Every reader asks :func:`asset_root`,
so the program behaves the same installed with pip, pipx or ``uv tool install`` as in
a clone.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

#: the trees every install must carry, by their folder names.
SHIPPED = ("templates", "remote", "patches")

_PACKAGE = Path(__file__).resolve().parents[1]  # specops/


@lru_cache(maxsize=None)
def asset_root() -> Path:
    """The folder holding ``templates/``, ``remote/`` and ``patches/``.

    :raises FileNotFoundError: when neither an installed copy nor a checkout has them
        (a broken install); the message names what is missing and how to fix it.
    """
    for root in (_PACKAGE / "_assets", _PACKAGE.parent):
        if all((root / name).is_dir() for name in SHIPPED):
            return root
    raise FileNotFoundError(
        f"specops is installed without its {', '.join(SHIPPED)} folders (looked in {_PACKAGE / '_assets'} "
        f"and {_PACKAGE.parent}); reinstall it from a wheel built by `pip wheel .` or `pip install .`")


def asset(name: str) -> Path:
    """``asset("templates")`` -> the templates folder of this install."""
    if name not in SHIPPED:
        raise ValueError(f"unknown asset {name!r}; one of {SHIPPED}")
    return asset_root() / name
