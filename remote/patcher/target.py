"""One file of a patch set on this host: where it is, which state it is in, and its images.

A target file is in one of five states, decided by its sha256 alone:

``pristine``          as the package shipped it (the manifest's ``sha256_pristine``);
``patched``           as the current revision of the set writes it (``sha256_patched``);
``earlier-revision``  what an earlier revision of the same set wrote here (recorded in
                      ``applied.json`` at apply time), with a backup that verifies as
                      pristine: safe to upgrade or revert;
``modified``          anything else (edited by hand, another version): always refused;
``missing``           no such file.

The *images* of a file are the texts it could be: the pristine text (the file itself,
its backup, or the diff reversed) and the patched text (the diff applied to pristine),
each checked against the manifest's sha256 before anything uses it.
"""
from __future__ import annotations

from pathlib import Path

from remote.patcher.hunks import HunkMismatch, apply_hunks, changed_lines, parse_unified_diff, unified_diff
from remote.wire import protocol
from remote.wire.fsutil import sha256_bytes

#: In ``<site-packages>/``: the folder of pristine copies, one sub-folder per set.
BACKUP_DIR = ".specops-backup"

PRISTINE, PATCHED, MODIFIED, MISSING = "pristine", "patched", "modified", "missing"
#: patched by an earlier revision of the same set (its sha256 is in applied.json)
EARLIER = "earlier-revision"


class PatchError(protocol.TaskError):
    """A refusal of this task (``name`` says which record: ``patch.lock``, ``patch.<file>``, ...)."""


class Target:
    """One file of a patch set: where it is, what it should hash to, and its state.

    The file's bytes are read once, at construction: every decision (state, diffs, the
    rollback copy) is about those bytes, so build a new Target to see a later change.
    """

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
        """The set's diff for this file, parsed once; a damaged diff is a :class:`PatchError`."""
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
            changed = {side: changed_lines(diff) for side, (_, diff) in diffs.items()}
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
                changed = changed_lines(region)
                if best is None or changed < best["changed"]:
                    best = {"against": f"{side} (hunk region)", "image": side, "diff": region, "changed": changed}
        best.pop("changed")
        return best
