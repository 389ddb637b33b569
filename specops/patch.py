"""``specops patch``: apply the versioned patch set that fits the host's speculators/vLLM.

The work happens on the host (``remote/patcher/``: pick set by versions, verify
sha256, back up, write atomically, byte-compile, restore everything on any failure,
host lock). Afterwards the static drift check runs again in the same connection; it
must be clean for the patch to count as done.
"""
from __future__ import annotations

from specops.inventory import Inventory
from specops.params import run_params
from specops.result import HostReport, Record
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts

ACTIONS = ("apply", "check", "revert", "status")


def patch_step(host: Host, action: str, sudo: bool | None = None, overrides: dict | None = None,
               extra: dict | None = None) -> HostReport:
    """Run one patch action on the host; ``extra`` passes test hooks (e.g. ``hold_lock_s``)."""
    use_sudo = bool(host.spec.sudo or sudo)
    params = {"action": action, **run_params(host.spec, **(overrides or {})), **(extra or {})}
    payload = host.run_task("patcher", params, sudo=use_sudo)
    report = report_from_payload(host.name, "patch", payload)
    # a stack that needs no patch (the vllm-server engine) has no drift to re-check either
    if action == "apply" and not report.failed and payload.get("data", {}).get("needs_patch") is not False:
        drift = report_from_payload(host.name, "patch", host.run_task("drift", params))
        left = [r for r in drift.records if r.status == "fail"]
        notes = [r.summary for r in drift.records if r.status == "warn"]
        if left:
            report.records.append(Record(
                name="patch.drift-after", status="fail",
                summary=f"{len(left)} drift finding(s) remain after patching: "
                        + ", ".join(r.name.split(".", 1)[-1] for r in left),
                detail={"findings": [r.model_dump() for r in left]},
                fix="the patch set does not cover this host's vLLM; see detail.findings and "
                    "`specops preflight`"))
        else:
            report.records.append(Record(name="patch.drift-after", status="ok",
                                         summary="static drift check is clean after patching",
                                         detail={"notes": notes}))
    return report


def patch(inventory: Inventory, selector: str | None, action: str = "apply", sudo: bool | None = None,
          accept_new_host_key: bool = False, overrides: dict | None = None) -> list[HostReport]:
    return run_on_hosts(inventory, selector, "patch", lambda h: patch_step(h, action, sudo, overrides),
                        accept_new_host_key=accept_new_host_key)
