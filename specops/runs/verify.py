"""``specops verify`` of a group run: every shard where it is now, under its own run id."""
from __future__ import annotations

from specops.inventory import Inventory
from specops.result import STATE, HostReport, Record
from specops.runs import hostjob
from specops.runs.pool import per_shard
from specops.runs.shardmap import Shard
from specops.runs.store import GROUP, load_manifest
from specops.transport.host import Host
from specops.transport.pool import HostPool


def verify(inventory: Inventory, run_id: str, *, samples: int, reference: str,
           accept_new_host_key: bool = False) -> list[HostReport]:
    """Verify every shard of a group run where it is now: on its head host, under its own run id
    (``R.<shard>`` for a range a reassign moved); one report per shard, and the group's verdict.

    A cut shard whose run never ended done (stopped when the rest of its range moved) has no
    manifest of its own to verify: it is named in a warning, never passed over in silence.
    """
    from specops.verify import verify_step

    manifest = load_manifest(run_id)
    conns = HostPool(inventory, accept_new_host_key)

    def one(shard: Shard, host: Host) -> HostReport:
        if shard.closed:
            state = hostjob.run_state(host, shard.run_id)
            if state.state != STATE.DONE:
                return HostReport(host=shard.label, task="verify", records=[Record(
                    name="group.verify", status="warn",
                    summary=f"{shard.label}: not verified: its run {shard.run_id} was cut at {shard.stop} (the rest "
                            f"moved to {', '.join(shard.moved_to)}) and ended {state.state}, so it has no manifest "
                            f"of [{shard.start}, {shard.stop})", detail={"range": [shard.start, shard.stop]})])
        report = verify_step(host, shard.run_id, samples, reference)
        report.host = shard.label
        return report

    try:
        shards = [s for s in manifest.shards if not s.empty]
        reports = per_shard(shards, manifest, conns, "verify", one, timeout=None)
    finally:
        conns.close()
    failed = [r.host for r in reports if r.failed]
    unverified = [r.host for r in reports if not r.failed and any(x.name == "group.verify" for x in r.records)]
    verdict = Record(
        name="group.verify", status="fail" if failed else "warn" if unverified else "ok",
        summary=(f"{len(reports) - len(failed) - len(unverified)} of {len(reports)} shard(s) of run {run_id} "
                 f"verified" + (f"; failed: {', '.join(failed)}" if failed else "")
                 + (f"; not verifiable: {', '.join(unverified)}" if unverified else "")),
        fix=f"see the shards' records above (specops status --run-id {run_id})" if failed else None)
    return [*reports, HostReport(host=GROUP, task="verify", records=[verdict])]
