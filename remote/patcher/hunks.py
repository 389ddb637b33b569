"""The strict unified-diff reader and applier the patcher writes files with (stdlib only).

Why a hand-written applier: the standard library has no patch module (:mod:`difflib`
only *makes* diffs) and hosts may lack GNU ``patch``. This one is deliberately strict:
every hunk must apply at exactly the line it names, context and removed lines
byte-for-byte, no fuzz and no offset search; anything else is a refusal, never a guess.

    >>> hunks = parse_unified_diff("@@ -1,2 +1,2 @@\\n a\\n-b\\n+B\\n")
    >>> apply_hunks("a\\nb\\n", hunks)
    'a\\nB\\n'
    >>> apply_hunks("a\\nB\\n", hunks, reverse=True)
    'a\\nb\\n'
    >>> apply_hunks("z\\na\\nb\\n", hunks)   # the same lines one further down: refused
    Traceback (most recent call last):
    ...
    remote.patcher.hunks.HunkMismatch: hunk 1 does not match at line 1
"""
from __future__ import annotations

import difflib
import re


class HunkMismatch(Exception):
    """A hunk whose context or removed lines are not where the diff says.

    ``hunk_index`` counts from 0; ``expected`` are the lines the diff wants at ``line``,
    ``found`` the lines that are there (both with their line endings).
    """

    def __init__(self, message, hunk_index, expected, found, line):
        super().__init__(message)
        self.hunk_index, self.expected, self.found, self.line = hunk_index, expected, found, line


# "@@ -old_start[,old_len] +new_start[,new_len] @@"; a missing length means 1.
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(text: str) -> list[dict]:
    """Hunks of a single-file unified diff: ``[{"old_start", "lines": [(op, text)]}]``.

    ``op`` is one of ``" -+"``; ``text`` keeps its line ending, and a following
    ``\\ No newline at end of file`` strips it. Counts in the headers are checked.

    :raises ValueError: on anything that is not one file's well-formed hunks.
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


def unified_diff(before: str, after: str, path: str, before_label="a", after_label="b") -> str:
    """The unified diff from ``before`` to ``after``, headed ``a/<path>`` and ``b/<path>``
    (or the labels given); empty when the texts are equal."""
    return "".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"{before_label}/{path}", tofile=f"{after_label}/{path}"))


def changed_lines(diff: str) -> int:
    """Added plus removed lines of a unified diff (its two header lines not counted)."""
    return sum(1 for line in diff.splitlines()[2:] if line[:1] in "+-")
