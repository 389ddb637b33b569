"""The one place the patcher writes: back up, write atomically, verify, compile, or roll back.

:func:`write_files` takes the new content of every file, already computed and checked
by sha256, and writes it as one transaction:

1. (apply only) back every original up to ``<site>/.specops-backup/<set>/`` and verify
   the copy against the pristine sha256;
2. write each file atomically (a temp file in the same folder, then ``os.replace``), so
   a reader sees the old file or the new one, never half of each;
3. read it back and verify its sha256, then byte-compile it (a file python cannot load
   must not stay behind);
4. run ``commit`` (the apply record), still inside the transaction;
5. on any failure, put back the original bytes of every file written so far, newest
   first, and verify each: the host is as it was.

:func:`patch_lock` keeps it to one run at a time per site-packages.
"""
from __future__ import annotations

import py_compile
from contextlib import contextmanager
from pathlib import Path

from remote.patcher.hunks import unified_diff
from remote.patcher.target import EARLIER, PatchError
from remote.run import faults
from remote.wire import fsutil, protocol
from remote.wire.fsutil import atomic_write, sha256_bytes

#: In ``<site-packages>/``: held (``flock``) while apply or revert runs.
LOCK_FILE = ".specops-patch.lock"


@contextmanager
def patch_lock(site_packages: Path):
    """Hold ``<site-packages>/.specops-patch.lock`` or refuse at once: one run at a time per env.

    :raises PatchError: ``patch.lock`` when another run holds it, or the file cannot be opened.
    """
    path = site_packages / LOCK_FILE
    lock = fsutil.FileLock(path, blocking=False)
    try:
        lock.__enter__()
    except fsutil.LockHeld as held:
        raise PatchError("patch.lock", f"another patch run holds {path} ({held.holder})",
                         "wait for the other run to finish, then retry",
                         {"lock": str(path), "holder": held.holder}) from None
    except OSError as exc:
        raise PatchError("patch.lock", f"cannot open the lock file {path}: {exc}",
                         "run as a user who can write site-packages (or ask for sudo)") from exc
    try:
        yield path
    finally:
        lock.__exit__(None, None, None)


def write_files(targets, todo, planned, verb, *, backup, inject_failure_after=None, commit=None) -> list:
    """Write ``planned[t.rel]`` to every target in ``todo`` as one transaction; return the records.

    :param targets: every file of the set (those not in ``todo`` get an ``ok`` record).
    :param todo: the targets to write, in order.
    :param planned: ``{rel: new bytes}``, already verified against the manifest.
    :param verb: ``"patched"`` or ``"reverted"``: which sha256 the written file must have.
    :param backup: back the originals up first (apply), or not (revert).
    :param inject_failure_after: tests: fail after writing this many files.
    :param commit: called after the last file is written, inside the transaction.
    :returns: one record per target, or a single ``patch.rollback`` fail record.
    """
    untouched = [protocol.record(t.name, protocol.OK, f"{t.rel} already {verb}",
                                 detail={"diff": ""})
                 for t in targets if t not in todo]
    if not todo:
        return untouched
    written = []
    try:
        if backup:
            for target in todo:
                _backup(target)
        for target in todo:
            faults.file_written(len(written), inject_failure_after)  # a test's rollback proof
            new = planned[target.rel]
            written.append(target)
            atomic_write(target.path, new, mode=target.mode)
            on_disk = target.path.read_bytes()
            want = target.sha_patched if verb == "patched" else target.sha_pristine
            if sha256_bytes(on_disk) != want:
                raise RuntimeError(f"{target.rel}: sha256 after writing is "
                                   f"{sha256_bytes(on_disk)}, expected {want}")
            py_compile.compile(str(target.path), doraise=True)
        if commit is not None:
            commit()
    except BaseException as exc:
        # BaseException too: a Ctrl-C midway must not leave half a patch set behind.
        restored = _rollback(written)
        detail = {"error": f"{type(exc).__name__}: {exc}", "restored": restored}
        records = [protocol.record(
            "patch.rollback", protocol.FAIL,
            f"{'apply' if backup else 'revert'} failed midway ({type(exc).__name__}: "
            f"{exc}); restored {len(restored)} file(s), the host is as it was",
            detail=detail, fix="read detail.error, fix the cause, then retry")]
        if not isinstance(exc, Exception):
            raise
        return records
    records = untouched
    for target in todo:
        before, after = target.text, planned[target.rel].decode("utf-8")
        done = verb
        if target.state == EARLIER:  # state is of the bytes read before the transaction
            done = (f"upgraded from an earlier revision of {target.set_name}" if verb == "patched"
                    else f"{verb} (it had an earlier revision of {target.set_name})")
        records.append(protocol.record(
            target.name, protocol.CHANGED, f"{target.rel} {done} (sha256 verified, compiled)",
            detail={"diff": unified_diff(before, after, target.rel),
                    "sha256": sha256_bytes(planned[target.rel]),
                    "backup": str(target.backup) if backup else None}))
    return records


def _backup(target):
    """Keep a verified pristine copy of ``target`` (an existing verified copy is kept as is)."""
    target.backup.parent.mkdir(parents=True, exist_ok=True)
    if target.backup.is_file() and sha256_bytes(target.backup.read_bytes()) == target.sha_pristine:
        return
    atomic_write(target.backup, target.data, mode=target.mode)
    if sha256_bytes(target.backup.read_bytes()) != target.sha_pristine:
        raise RuntimeError(f"backup of {target.rel} does not verify")


def _rollback(written):
    """Put back the original bytes of every file written; verify each."""
    restored = []
    for target in reversed(written):
        atomic_write(target.path, target.data, mode=target.mode)
        if sha256_bytes(target.path.read_bytes()) != sha256_bytes(target.data):
            raise RuntimeError(f"rollback of {target.rel} did not verify: restore it "
                               f"from {target.backup}")
        restored.append(target.rel)
    return restored
