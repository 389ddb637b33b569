"""The ``remote/`` package (and ``patches/``) as one zip named by its content hash.

The host keeps every bundle it ever got under ``<work_dir>/bundles/<hash>/``; a run
whose code did not change finds its bundle there and nothing is uploaded.
"""
from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from specops.transport.assets import asset_root

#: folders of the repo that travel to the host.
BUNDLE_DIRS = ("remote", "patches")
#: development tools inside those folders that stay in the checkout: no task runs them, so
#: no host gets them (tests and scripts run them from the checkout); pyproject.toml keeps
#: them out of the wheel too.
DEV_ONLY = ("remote/dev",)
#: ...but for what an armed test hook does (``remote/run/faults.py``): tests arm hooks on their
#: hosts, so a bundle built from a checkout carries it. The wheel has no ``remote/dev`` at all,
#: so an installed program's hosts never get it.
DEV_TRAVELS = ("remote/dev/__init__.py", "remote/dev/faults.py")
_SKIP_SUFFIXES = (".pyc", ".pyo")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # zip needs a date; a fixed one keeps bytes stable


@dataclass(frozen=True)
class Bundle:
    """A deterministic zip of the remote code; ``digest`` names it on the host."""

    digest: str
    data: bytes = field(repr=False)
    files: tuple[str, ...] = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.data)


def is_dev_only(rel: str) -> bool:
    """Whether the repo path ``rel`` (posix, relative to the root) lies under :data:`DEV_ONLY`
    and stays off hosts (not one of :data:`DEV_TRAVELS`)."""
    return rel not in DEV_TRAVELS and any(rel == d or rel.startswith(d + "/") for d in DEV_ONLY)


def build_bundle(root: Path | None = None, dirs: tuple[str, ...] = BUNDLE_DIRS) -> Bundle:
    """Zip ``dirs`` under ``root`` (this install's asset root) in a fixed order with fixed timestamps.

    The digest covers paths and contents only, so it changes exactly when code does.
    :data:`DEV_ONLY` folders are left out.
    """
    root = Path(root) if root is not None else asset_root()
    paths = sorted(
        p for d in dirs if (root / d).is_dir() for p in (root / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(_SKIP_SUFFIXES)
        and not is_dev_only(p.relative_to(root).as_posix())
    )
    digest = hashlib.sha256()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in paths:
            rel = path.relative_to(root).as_posix()
            content = path.read_bytes()
            digest.update(rel.encode() + b"\0" + hashlib.sha256(content).digest())
            info = zipfile.ZipInfo(rel, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, content)
    return Bundle(digest=digest.hexdigest()[:20], data=buf.getvalue(),
                  files=tuple(p.relative_to(root).as_posix() for p in paths))
