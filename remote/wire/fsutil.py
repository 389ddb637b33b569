"""Files on the host: atomic writes, file digests and one lock (stdlib only at import).

Everything specops writes on a host that another process may read at any moment (a
patched speculators file, a status file, a sample, a manifest) goes through
:func:`atomic_write`: a temp file in the same directory, flushed and fsync'ed, then
renamed over the target with :func:`os.replace`, which POSIX makes atomic. A reader
sees the old file or the new one, never half of one, and a crash midway leaves at
most a hidden ``.<name>.*.specops-tmp`` file, never a damaged target.

:class:`FileLock` is the one lock: an exclusive ``flock`` on a file, released by the
kernel when its holder dies, so a crashed run never leaves a stale lock behind::

    >>> with FileLock("/tmp/site/.specops-patch.lock", blocking=False):
    ...     pass                         # a second holder gets LockHeld right away
    >>> with FileLock(run_dir / ".lock"):
    ...     pass                         # this one waits its turn instead
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

#: suffix of the temp files :func:`atomic_write` leaves only when the process is killed midway.
TEMP_SUFFIX = ".specops-tmp"


#: the name prefix of a run's files while they are written (samples, manifests, status): listings and
#: sweeps of a run's dirs skip and clear them.
TEMP_PREFIX = ".partial-"


@contextmanager
def atomic_open(path, mode: int | None = None, temp_prefix: str | None = None, suffix: str = TEMP_SUFFIX):
    """A binary file handle whose content replaces ``path`` atomically when the block ends.

    For content too big to hold in memory (``torch.save`` of a sample straight to disk).
    An exception inside the block removes the temp file and leaves ``path`` untouched.

    :param mode: permission bits of the new file; None leaves :func:`tempfile.mkstemp`'s ``0o600``.
    :param temp_prefix: name prefix of the temp file (default ``.<name>.``), for directories
        whose owner sweeps its own leftovers by prefix.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix or f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path, data, mode: int | None = None, temp_prefix: str | None = None) -> Path:
    """Replace ``path`` with ``data`` (bytes, or text written as UTF-8) in one atomic step.

    :param mode: permission bits of the new file (say the old file's, to keep them);
        None leaves :func:`tempfile.mkstemp`'s private ``0o600``.
    :param temp_prefix: as for :func:`atomic_open`.
    :returns: ``path`` as a :class:`~pathlib.Path`.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_open(path, mode=mode, temp_prefix=temp_prefix) as handle:
        handle.write(data)
    return Path(path)


def write_json(path, obj, mode: int | None = None, temp_prefix: str | None = None) -> Path:
    """:func:`atomic_write` of ``obj`` as indented, key-sorted JSON with a final newline."""
    text = json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n"
    return atomic_write(path, text, mode=mode, temp_prefix=temp_prefix)


def read_json_quietly(path):
    """A JSON file's document, None when it is missing or not JSON (a status read while it is replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data`` (patch files, source files: not sample data, see :func:`file_digest`)."""
    return hashlib.sha256(data).hexdigest()


#: the digests a manifest entry can carry, as ``{name: hex}``, preferred first: BLAKE3 (the
#: ``blake3`` package, which vLLM depends on; ~2.5x sha256's speed per core) where this python
#: has it, else sha256 (stdlib; also what manifests before BLAKE3 carry)
HASHES = ("blake3", "sha256")
#: what a python without ``blake3`` needs to check a BLAKE3 digest
BLAKE3_FIX = "pip install blake3 (the manifest's files are hashed with BLAKE3)"


class HashUnavailable(RuntimeError):
    """A digest this python cannot compute (BLAKE3 without the ``blake3`` package); ``fix`` says how."""

    def __init__(self, name: str):
        self.name, self.fix = name, BLAKE3_FIX if name == "blake3" else f"a python whose hashlib has {name}"
        super().__init__(f"this python cannot compute {name} digests: {self.fix}")


@lru_cache(maxsize=1)
def default_hash() -> str:
    """The digest new files get here: ``blake3`` when it imports, else ``sha256`` (asked once)."""
    try:
        import blake3  # noqa: F401  (a third-party package: imported only here, never at import time)
    except ImportError:
        return "sha256"
    return "blake3"


def new_hasher(name: str, threads: int = 1):
    """A fresh hash object of ``name`` (``update``, ``hexdigest``); BLAKE3 on ``threads`` threads (0: all cores).

    :raises HashUnavailable: ``name`` cannot be computed here.
    """
    if name == "sha256":
        return hashlib.sha256()
    if name != "blake3":
        raise HashUnavailable(name)
    try:
        import blake3
    except ImportError:
        raise HashUnavailable(name) from None
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads == 0 else threads)


def buffer_digest(data, name: str | None = None, threads: int = 1) -> dict:
    """``{name: hex}`` of ``data`` (bytes, a memory map: any buffer), a manifest entry's digest.

    :param name: ``blake3`` or ``sha256``; None: :func:`default_hash`.
    :param threads: BLAKE3's threads for this one buffer (0: all cores); 1 where several files
        are digested at once on threads of their own (the GIL is released while it hashes).
    :raises HashUnavailable: ``name`` cannot be computed here.
    """
    name = name or default_hash()
    digest = new_hasher(name, threads)
    digest.update(data)
    return {name: digest.hexdigest()}


def file_digest(path, name: str | None = None, threads: int = 1, chunk: int = 1 << 22) -> dict:
    """``{name: hex}`` of the file at ``path``, read in ``chunk``-sized blocks (samples can be gigabytes).

    :param name: as for :func:`buffer_digest`.
    :param threads: BLAKE3's threads (0: all cores); one by default: a host's listing or check may
        run beside an extraction whose server needs the cores, and one core outruns most disks.
    :raises HashUnavailable: ``name`` cannot be computed here.
    """
    name = name or default_hash()
    digest = new_hasher(name, threads)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return {name: digest.hexdigest()}


def sha256_file(path) -> str:
    """Hex sha256 of a file (:func:`file_digest` named ``sha256``): a manifest of an older specops."""
    return file_digest(path, "sha256")["sha256"]


def sync_filesystem(path) -> None:
    """Make everything written to ``path``'s filesystem durable in one call (Linux ``syncfs``).

    For many files written without a per-file fsync (hidden-state samples, tens of MB
    each): one flush of the filesystem is far cheaper than one fsync per file. Falls back
    to :func:`os.sync` where ``syncfs`` is missing.
    """
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            syncfs = ctypes.CDLL(None, use_errno=True).syncfs
        except AttributeError:
            syncfs = None
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


class LockHeld(BlockingIOError):
    """A non-blocking :class:`FileLock` found another holder (``holder``: what it wrote, e.g. ``pid 123``)."""

    def __init__(self, path, holder: str):
        super().__init__(errno.EWOULDBLOCK, f"{path} is held by {holder}")
        self.path, self.holder = str(path), holder


class FileLock:
    """An exclusive ``flock`` on ``path`` for a ``with`` block; its parent dir is made when missing.

    The holder writes ``pid <n>`` into the file, so a refused caller can say who holds it.

    :param blocking: wait for the lock (True), or raise :class:`LockHeld` at once (False).
    :raises OSError: when the lock file cannot be opened (a read-only dir, say).

    .. note:: ``flock`` locks belong to the open file, not the process: two
       :class:`FileLock` objects on one path exclude each other even in one process.
    """

    def __init__(self, path, blocking: bool = True):
        self.path = Path(path)
        self.blocking = blocking
        self._handle = None

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # "a+": never truncate what the current holder wrote
        try:
            flags = fcntl.LOCK_EX if self.blocking else fcntl.LOCK_EX | fcntl.LOCK_NB
            try:
                fcntl.flock(handle.fileno(), flags)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                handle.seek(0)
                raise LockHeld(self.path, handle.read().strip() or "an unknown process") from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}\n")
            handle.flush()
        except BaseException:
            handle.close()
            raise
        self._handle = handle
        return self

    def __exit__(self, *exc):
        import fcntl

        handle, self._handle = self._handle, None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        finally:
            handle.close()
