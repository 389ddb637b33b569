"""The one result contract between the host and the controller (stdlib only).

Every check and step is a *record*::

    {"name": "checkpoint.shards", "area": "checkpoint", "status": "fail",
     "summary": "2 of 4 shards missing", "detail": {...}, "fix": "re-download ..."}

``status`` is one of ok / changed / skipped / warn / fail. A remote task returns one
*payload* (``{"records": [...], "data": {...}}``) which the entry script prints on
stdout between two marker lines, so that whatever libraries print around it (vLLM
is chatty) never breaks parsing.

This module is also the one home of the markers and exit codes the entry script and
the controller agree on: ``specops/`` loads this very file on the laptop (it has no
imports beyond the standard library and does nothing when imported), and the entry
template gets the values from it when it is rendered.
"""
from __future__ import annotations

import json
import os
import re
import sys

OK, CHANGED, SKIPPED, WARN, FAIL = "ok", "changed", "skipped", "warn", "fail"
STATUSES = (OK, CHANGED, SKIPPED, WARN, FAIL)

#: the lines around the one JSON payload a task prints (:func:`emit`).
RESULT_BEGIN = "@@SPECOPS-RESULT-BEGIN@@"
RESULT_END = "@@SPECOPS-RESULT-END@@"
#: the entry script lacks the bundle: it prints this line and exits with this code
#: (EX_TEMPFAIL); the controller uploads the bundle and runs it once more.
NEED_BUNDLE_MARKER = "@@SPECOPS-NEED-BUNDLE@@"
NEED_BUNDLE_EXIT = 75
#: the entry preamble cannot run specops here (python too old, work_dir unusable): one
#: ``<marker> {json}`` line and this exit code (EX_CONFIG).
ENTRY_ERROR_MARKER = "@@SPECOPS-ENTRY-ERROR@@"
ENTRY_ERROR_EXIT = 78
#: prefix of each event line ``job follow`` streams (one JSON object after it).
JOB_EVENT_PREFIX = "@@SPECOPS-JOB-EVENT@@ "

#: a run id as a host takes it: a run dir's name (and an output dir's), at most RUN_ID_MAX characters.
RUN_ID_MAX = 128
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,%d}$" % (RUN_ID_MAX - 1))
#: a group run names a range moved to another host ``<run-id>.<shard id>``; shard ids are
#: ``s<k>`` or ``s<k>m<n>`` (a move of a move keeps its root: ``s2m3``, never ``s2m1m1``), with
#: k and n below MOVE_LIMIT, so this is the longest suffix ever appended to a user's id.
MOVE_LIMIT = 10000
MOVED_SUFFIX_MAX = len(f".s{MOVE_LIMIT - 1}m{MOVE_LIMIT - 1}")
#: the longest run id a user may give: the host's limit less the longest suffix we append.
USER_RUN_ID_MAX = RUN_ID_MAX - MOVED_SUFFIX_MAX
USER_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,%d}$" % (USER_RUN_ID_MAX - 1))


def record(name, status, summary, detail=None, fix=None, area=None):
    """Build one result record; ``area`` defaults to the part of ``name`` before the dot."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if status == FAIL and not fix:
        raise ValueError(f"record {name!r} fails without a fix hint")
    return {
        "name": name,
        "area": area or name.split(".", 1)[0],
        "status": status,
        "summary": str(summary).splitlines()[0] if summary else "",
        "detail": detail if detail is not None else {},
        "fix": fix,
    }


class TaskError(Exception):
    """A refusal with a fix hint, raised anywhere in a task; the task returns it as one failed record.

    The one refusal type of the host side: a task may subclass it for a default
    ``name`` (``PatchSetError``, ``JobError``), never for another argument order.

    :param name: the record's name, e.g. ``patch.lock``.
    :param summary: one line a person reads (also ``str(exc)``).
    :param fix: what to do about it; a failed record always carries one.
    :param detail: structured facts for ``--json``.
    """

    def __init__(self, name, summary, fix, detail=None):
        super().__init__(summary)
        self.name, self.summary, self.fix, self.detail = name, summary, fix, detail or {}

    def record(self):
        return record(self.name, FAIL, self.summary, detail=self.detail, fix=self.fix)

    def payload(self, **data):
        return payload([self.record()], **data)


def apply_job_env(params) -> None:
    """Export the inventory's ``env`` for this process; never reach a model hub by default."""
    for key, value in (params.get("env") or {}).items():
        os.environ[str(key)] = str(value)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def payload(records, **data):
    return {"records": list(records), "data": data}


def emit(result) -> None:
    """Write the payload framed by marker lines to the real stdout and flush."""
    text = json.dumps(result, default=str, ensure_ascii=True)
    out = os.fdopen(os.dup(sys.__stdout__.fileno()), "w")
    with out:
        out.write(f"\n{RESULT_BEGIN}\n{text}\n{RESULT_END}\n")
        out.flush()


def worst(records):
    """The worst status among records (fail > warn > changed > ok > skipped)."""
    order = {SKIPPED: 0, OK: 1, CHANGED: 2, WARN: 3, FAIL: 4}
    return max((r["status"] for r in records), key=order.__getitem__, default=OK)
