"""Every exit code specops returns, named once (like pip's ``status_codes``).

Task exit codes (``specops preflight``, ``patch``, ``extract``, ...):

====  ===============  ===========================================================
code  name             meaning
====  ===============  ===========================================================
0     SUCCESS          every check/step ended ok, changed, skipped or warn
1     FAILED           at least one check or step failed (see its ``fix``)
2     UNREACHABLE      a host could not be reached, or its host key was refused
3     USAGE            bad input: inventory, flags or arguments (nothing was run)
4     INTERNAL         a bug in specops itself; please report it with ``--debug``
5     GATE_FAILED      ``eval --min-acceptance-length``: measured, and below the bar (its record names the categories)
130   INTERRUPTED      a foreground task (``eval``) stopped by Ctrl-C; what it started on the host is stopped
====  ===============  ===========================================================

Job exit codes (``specops status`` / following a run), borrowed from SkyPilot:

====  ===============  ===========================================================
100   JOB_FAILED       the run failed (the status file names the rank and cause)
101   JOB_RUNNING      the run has not finished yet (still loading or extracting)
102   JOB_NOT_FOUND    no run with that id on the host
103   JOB_ABORTED      the run was aborted
====  ===============  ===========================================================
"""
from __future__ import annotations

import enum

from specops import wire


class ExitCode(enum.IntEnum):
    SUCCESS = 0
    FAILED = 1
    UNREACHABLE = 2
    USAGE = 3
    INTERNAL = 4
    GATE_FAILED = 5
    JOB_FAILED = 100
    JOB_RUNNING = 101
    JOB_NOT_FOUND = 102
    JOB_ABORTED = 103
    INTERRUPTED = 130

    @classmethod
    def from_job_state(cls, state: str) -> "ExitCode":
        """The code a run state means (``remote/wire/contract.py``); a state it does not know is still running."""
        return cls(wire.contract.job_exit_code(state))

    @classmethod
    def help_text(cls) -> str:
        """One line per code, generated from the enum so help never drifts from it."""
        return "; ".join(f"{c.value}={c.name.lower()}" for c in cls)
