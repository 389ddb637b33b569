"""The result model on the controller side: records, per-host reports, the recap, run states.

A :class:`Record` mirrors ``remote.wire.protocol.record``; a :class:`HostReport` holds every
record of one host, or the error that kept us from getting any (fabric's GroupResult
idea: a host's error is a result, never lost). A :class:`RunStatus` is one extraction
run's ``status.json`` as the host reported it, typed, with the two questions every
caller asks of it: is it over (:attr:`RunStatus.is_final`), and which exit code it means.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specops import wire
from specops.exit_codes import ExitCode

#: the host's definitions (``remote/wire/contract.py``), loaded once.
_CONTRACT = wire.contract
Status = Literal[_CONTRACT.STATUSES]
#: eval's acceptance gate (remote/train/gate.py ``RECORD``): its failure alone exits ExitCode.GATE_FAILED
GATE_RECORD = "eval.gate"


class Record(BaseModel):
    """One check or step: what ran, how it ended, and what to do when it failed."""

    name: str
    status: Status
    summary: str = ""
    area: str = ""
    detail: dict[str, Any] = Field(default_factory=dict)
    fix: str | None = None

    def model_post_init(self, _ctx: Any) -> None:
        if not self.area:
            self.area = self.name.split(".", 1)[0]


class HostReport(BaseModel):
    """Every record of one host for one task, or the error that stopped it."""

    host: str
    task: str
    records: list[Record] = Field(default_factory=list)
    data: dict[str, Any] = Field(default_factory=dict)
    #: set when the host could not be reached or returned nothing readable.
    error: str | None = None
    error_code: int | None = None

    @property
    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in _CONTRACT.STATUSES}
        for rec in self.records:
            out[rec.status] += 1
        return out

    @property
    def failed(self) -> bool:
        return self.error is not None or any(r.status == _CONTRACT.FAIL for r in self.records)

    @property
    def exit_code(self) -> ExitCode:
        if self.error is not None:
            return ExitCode(self.error_code or ExitCode.UNREACHABLE)
        if not self.failed:
            return ExitCode.SUCCESS
        # measured, and only the acceptance bar failed: a code of its own, so CI tells "worse draft" from "broken"
        gated = {r.name for r in self.records if r.status == _CONTRACT.FAIL} == {GATE_RECORD}
        return ExitCode.GATE_FAILED if gated else ExitCode.FAILED

    def recap(self) -> str:
        """An Ansible PLAY RECAP style line: ``host : ok=12 changed=0 warn=1 fail=0``."""
        if self.error is not None:
            kind = "unreachable" if self.error_code == ExitCode.UNREACHABLE else "error"
            return f"{self.host} : {kind}=1 ({self.error.splitlines()[0]})"
        c = self.counts
        return (f"{self.host} : ok={c['ok']} changed={c['changed']} warn={c['warn']} "
                f"fail={c['fail']} skipped={c['skipped']}")


def overall_exit(reports: list[HostReport]) -> ExitCode:
    """The exit code for a task over many hosts: the most severe host wins."""
    codes = [r.exit_code for r in reports] or [ExitCode.SUCCESS]
    if ExitCode.USAGE in codes:
        return ExitCode.USAGE
    if ExitCode.UNREACHABLE in codes:
        return ExitCode.UNREACHABLE
    # a failure to measure is worse news than a draft below its bar
    return max(codes, key=lambda code: 0.5 if code == ExitCode.GATE_FAILED else int(code))


#: the run states themselves (``STATE.DONE == "done"``), from the one definition both sides read.
STATE = _CONTRACT.RunState
#: every state a run can be in, as the host writes it, plus ``missing`` for "the host has no such run".
RunStateName = Literal[tuple(s.value for s in STATE)]
FINAL_STATES: tuple[str, ...] = _CONTRACT.FINAL_STATES


class RunError(BaseModel):
    """Why a run failed: the failing TP rank (None: the supervisor), the exception and its traceback.

    The laptop's view of ``specops.wire.status.ERROR_FIELDS`` (tests/test_contract.py holds them in step)."""

    model_config = ConfigDict(extra="allow")

    rank: int | None = None
    type: str | None = None
    message: str | None = None
    traceback: str = ""
    where: str | None = None
    #: what to do, where the failed check knew it
    fix: str | None = None

    def headline(self) -> str:
        """``rank 1: ValueError: bad layer`` (``supervisor: ...`` for an error of no rank) -- the one line a
        person reads first."""
        return f"{'rank ' + str(self.rank) if self.rank is not None else self.where or 'supervisor'}: " \
               f"{self.type}: {self.message}"


class RunStatus(BaseModel):
    """One run on one host, as its status file (plus the supervisor's liveness) says.

    The laptop's view of ``specops.wire.status.FIELDS``, checked against it on every parse (a test holds
    the fields in step).

    Unknown keys of the status file are kept, so :meth:`model_dump` gives the file back.

        >>> state = RunStatus.from_payload(hostjob.job_call(host, "status", "r1"))
        >>> state.state, state.is_final, state.exit_code
        ('failed', True, <ExitCode.JOB_FAILED: 100>)
        >>> state.error.headline()
        'rank 1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB'
        >>> RunStatus.from_payload({"records": [...], "data": {}}).state   # no such run
        'missing'
    """

    model_config = ConfigDict(extra="allow")

    run_id: str | None = None
    state: RunStateName = _CONTRACT.RunState.MISSING.value
    phase: str | None = None
    samples_done: int | None = None
    samples_total: int | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    #: whether the supervisor process still runs (a done run may still be closing its engine).
    alive: bool | None = None
    error: RunError | None = None
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    #: the run's directory on the host (from the payload, not the status file).
    run_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _fits_the_wire(cls, data: Any) -> Any:
        """The host's status checked against the one schema both sides read (``specops.wire.status``):
        a field of the wrong kind is refused naming it (``error.message``), as the host's writer would."""
        if isinstance(data, dict) and data.get("state") not in (None, _CONTRACT.RunState.MISSING.value):
            wire.status.check(data, where=f"status.json of run {data.get('run_id')}")
        return data

    @classmethod
    def from_payload(cls, payload: dict) -> "RunStatus":
        """The state in a ``remote/run/job.py`` payload (``status``, ``start``, ``abort``, ``follow``)."""
        data = payload.get("data") or {}
        status = data.get("status")
        if not status:
            return cls(state=_CONTRACT.RunState.MISSING.value)
        fields = {**status, "run_dir": data.get("run_dir")}
        fields["state"] = fields.get("state") or _CONTRACT.RunState.PENDING.value
        return cls(**fields)

    @property
    def found(self) -> bool:
        return self.state != _CONTRACT.RunState.MISSING

    @property
    def is_final(self) -> bool:
        """Done, failed or aborted: the run will not change any more by itself."""
        return _CONTRACT.RunState(self.state).is_final

    @property
    def exit_code(self) -> ExitCode:
        """0 done, 100 failed, 101 still running, 102 not found, 103 aborted."""
        return ExitCode.from_job_state(self.state)
