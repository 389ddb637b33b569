"""Where the trees that travel with specops live: ``templates/``, ``remote/``, ``patches/``.

In a checkout they are the top-level folders beside ``specops/`` (the layout the
project keeps). An installed wheel carries the same three trees inside the package,
as ``specops/_assets/<name>/`` (``pyproject.toml`` maps them there), because a wheel
can only install files under its own packages. Every reader asks :func:`asset_root`,
so the program behaves the same installed with pip, pipx or ``uv tool install`` as in
a clone.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

#: the trees every install must carry, by their folder names.
SHIPPED = ("templates", "remote", "patches")

_PACKAGE = Path(__file__).resolve().parent


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


def _load_remote(name: str, path: Path | None = None, **given):
    """``remote/<name>.py`` (or ``path``) of this install, executed as the private module
    ``specops._remote_<name>`` (not added to :data:`sys.modules`), with ``given`` set as its globals before it runs."""
    path = path or asset("remote") / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"specops._remote_{name}", path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(given)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def remote_protocol():
    """``remote/protocol.py`` of this install, loaded by path: the markers and exit codes the
    entry script and the controller share, from the one file that defines them.

    ``remote`` is no importable package on the laptop (an installed wheel carries it as
    data), so the file is executed as the private module ``specops._remote_protocol``,
    not added to :data:`sys.modules`. It imports only the standard library and does
    nothing else when loaded.
    """
    return _load_remote("protocol")


def remote_contract():
    """``remote/contract.py`` of this install: run states, statuses, engines, file names, defaults.

    Loaded with :func:`remote_protocol`, which reads it, so the laptop holds one copy.
    """
    return remote_protocol().contract


@lru_cache(maxsize=None)
def remote_manifest():
    """``remote/manifest.py`` of this install: the one schema of a run's ``manifest.json``
    (read, check, write, merge), loaded by path with the contract above and
    ``remote/fsutil.py`` (atomic writes; stdlib only) as the two modules it uses.
    """
    return _load_remote("manifest", contract=remote_contract(), fsutil=remote_fsutil())


@lru_cache(maxsize=None)
def remote_fsutil():
    """``remote/fsutil.py`` of this install: the one atomic write (temp file, fsync, rename) both
    sides use, for the laptop's fetched run files, fleet maps and merged manifests too."""
    return _load_remote("fsutil")


@lru_cache(maxsize=None)
def remote_memuse():
    """``remote/memuse.py`` of this install: the one wording of a train run's measured memory
    (:func:`usage_line`), loaded by path with ``remote/probes/__init__.py``'s ``human_bytes``
    (stdlib only) as its global."""
    probes = _load_remote("probes", asset("remote") / "probes" / "__init__.py")
    return _load_remote("memuse", human_bytes=probes.human_bytes)
