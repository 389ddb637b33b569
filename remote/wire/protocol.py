"""The one result contract between the host and the controller (stdlib only).

Every check and step is a *record*::

    {"name": "checkpoint.shards", "area": "checkpoint", "status": "fail",
     "summary": "2 of 4 shards missing", "detail": {...}, "fix": "re-download ..."}

``status`` is one of ok / changed / skipped / warn / fail. A remote task returns one
*payload* (``{"records": [...], "data": {...}}``) which the entry script prints on
stdout between two marker lines, so that whatever libraries print around it (vLLM
is chatty) never breaks parsing.

This module is also the one home of the markers and exit codes the entry script and
the controller agree on: the laptop imports this very module as ``specops.wire.protocol`` (it
imports only the standard library and its wire siblings, and does nothing when imported), and the entry
template gets the values from it when it is rendered. The statuses and the run-id
rule come from :mod:`remote.wire.contract` (kept here under their names for every reader).
"""
from __future__ import annotations

import json
import os
import sys

from . import contract

OK, CHANGED, SKIPPED, WARN, FAIL = contract.OK, contract.CHANGED, contract.SKIPPED, contract.WARN, contract.FAIL
STATUSES = contract.STATUSES

#: every task the laptop runs on a host, by its name (``host.run_task(NAME, params)``, the name of
#: its crash record), to the module under ``remote/`` whose ``main(params)`` it calls: the one list.
TASKS = {
    "facts": "system.facts",
    "preflight": "probes.preflight",
    "patcher": "patcher",
    "drift": "drift",
    "job": "run.job",
    "slurm": "run.slurm",
    "shard": "extract.shard",
    "merge": "extract.merge",
    "smoke": "extract.smoke",
    "replica_probe": "extract.replica_probe",
    "verify": "verify",
    "train": "train.task",
    "draft_eval": "train.evaluate",
}

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

#: the run-id rule (:mod:`remote.wire.contract`), under the names the laptop's readers know.
RUN_ID_MAX, RUN_ID_RE = contract.RUN_ID_MAX, contract.RUN_ID_RE
MOVE_LIMIT, MOVED_SUFFIX_MAX = contract.MOVE_LIMIT, contract.MOVED_SUFFIX_MAX
USER_RUN_ID_MAX, USER_RUN_ID_RE = contract.USER_RUN_ID_MAX, contract.USER_RUN_ID_RE


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


def run_in_job_env(body, params) -> dict:
    """``body(params)`` with the inventory's ``env`` exported (:func:`apply_job_env`); a
    :class:`TaskError` it raises becomes its one failed record: what a task that loads a
    model (smoke, verify) does in ``main``."""
    apply_job_env(params)
    try:
        return body(params)
    except TaskError as exc:
        return exc.payload()


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
    return max((r["status"] for r in records), key=contract.SEVERITY.__getitem__, default=OK)
