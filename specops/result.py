"""The result model on the controller side: records, per-host reports, the recap.

A :class:`Record` mirrors ``remote.protocol.record``; a :class:`HostReport` holds every
record of one host, or the error that kept us from getting any (fabric's GroupResult
idea: a host's error is a result, never lost).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from specops.exit_codes import ExitCode

Status = Literal["ok", "changed", "skipped", "warn", "fail"]
_ORDER = {"skipped": 0, "ok": 1, "changed": 2, "warn": 3, "fail": 4}


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
        out = {s: 0 for s in _ORDER}
        for rec in self.records:
            out[rec.status] += 1
        return out

    @property
    def failed(self) -> bool:
        return self.error is not None or any(r.status == "fail" for r in self.records)

    @property
    def exit_code(self) -> ExitCode:
        if self.error is not None:
            return ExitCode(self.error_code or ExitCode.UNREACHABLE)
        return ExitCode.FAILED if self.failed else ExitCode.SUCCESS

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
    return max(codes)
