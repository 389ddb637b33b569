"""Start a group run's shards: one lane of shards per host, cut shards settled, gaps made again."""
from __future__ import annotations

from specops.errors import SpecopsError
from specops.params import run_params
from specops.replica import node_params
from specops.result import STATE, HostReport, Record
from specops.runs import hostjob, shardmap
from specops.runs.plan import shard_output_dir
from specops.runs.pool import QUICK_TIMEOUT_S, shard_files
from specops.runs.shardmap import GroupMap, Shard
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload
from specops.transport.pool import HostPool


def start_job(host: Host, run_id: str, overrides: dict, *, force: bool, output_dir: str | None = None,
              sample_range: list[int] | None = None, node: dict | None = None) -> dict:
    """Start (or re-attach to, or resume) one shard's run on ``host``: ``job start``'s payload.

    :param output_dir: the shard's output dir (default: the run's own, :func:`shard_output_dir`).
    :param sample_range: the shard's ``[start, stop)``; None: the whole dataset (a one-host run).
    :param node: the host's place in a replica over several hosts (:func:`specops.replica.node_params`).
    """
    params = run_params(host.spec, **overrides)
    params.update(force=force, output_dir=output_dir or shard_output_dir(host.spec, overrides, run_id))
    if sample_range is not None:
        params["sample_range"] = list(sample_range)
    params.update(node or {})
    return hostjob.job_call(host, "start", run_id, **params)


def start_step(manifest: GroupMap, shard: Shard, host: Host, overrides: dict, force: bool,
               conns: HostPool | None = None) -> HostReport:
    """Start (or re-attach to, or resume) one shard's run on its head host, and on a replica's
    other hosts their headless ranks under the same run id (the head first: its watch of them
    listens before they knock)."""
    inventory = conns.inventory if conns is not None else None
    node = node_params(inventory, shard.head) if inventory is not None and len(shard.hosts) > 1 else None
    payload = start_job(host, shard.run_id, overrides, force=force, output_dir=shard.output_dir,
                        sample_range=[shard.start, shard.stop], node=node)
    report = report_from_payload(shard.label, "extract", payload)
    status = (payload.get("data") or {}).get("status")
    if status:
        shard.remember(status)
    report.data.update(payload.get("data") or {})
    if node and not report.failed and (payload.get("data") or {}).get("already") != "done":
        for worker in shard.hosts[1:]:
            worker_host = conns.host(worker)
            started = start_job(worker_host, shard.run_id, overrides, force=force, node=node_params(inventory, worker))
            report.records.extend(r.model_copy(update={"name": f"{r.name}@{worker}"})
                                  for r in report_from_payload(worker, "extract", started).records)
    return report


def settle_closed(manifest: GroupMap, shard: Shard, host: Host) -> HostReport:
    """A cut shard's run must not go on past its cut: stop it if it runs; read what its host's disk
    holds of the kept range (``data["first_missing"]``: where a gap starts, or its stop)."""
    report = HostReport(host=shard.label, task="extract")
    state = hostjob.run_state(host, shard.run_id)
    moved = ", ".join(shard.moved_to)
    if state.alive and not state.is_final:
        hostjob.job_call(host, "abort", shard.run_id)
        report.records.append(Record(name="group.cut", status="changed",
                                     summary=f"stopped run {shard.run_id} on {shard.head}: its range past {shard.stop} "
                                             f"moved to {moved}"))
        state = hostjob.run_state(host, shard.run_id)
    if state.found:
        shard.remember(state.model_dump())
    listing = shard_files(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
    have = int(listing["first_missing"])
    report.data["first_missing"] = have
    if have >= shard.stop:
        report.records.append(Record(name="group.cut", status="ok",
                                     summary=f"[{shard.start}, {shard.stop}) kept on {shard.head}, every sample on "
                                             f"its disk (the rest moved to {moved})", detail={"first_missing": have}))
    return report


def remake_gaps(manifest: GroupMap, settled: list[tuple[Shard, HostReport]], conns: HostPool,
                overrides: dict) -> list[Record]:
    """A cut shard whose kept range has a gap on its host's disk (a file lost in a crash before an
    unchecked cut, or deleted since): ``[gap, stop)`` becomes a new shard on the same host, so it is
    made again (a cut shard's own run never restarts: it would make its whole old range)."""
    records = []
    for shard, report in settled:
        if report.error is not None or "first_missing" not in report.data:
            continue
        cut = int(report.data["first_missing"])
        old_stop = shard.stop
        new_run_id = shardmap.moved_run_id(manifest.run_id, shardmap.next_moved_id(manifest, shard))
        moved = shardmap.reassign(manifest, shard, shard.head, cut,
                                  shard_output_dir(conns.spec(shard.head), overrides, new_run_id))
        shard.cut_checked = True
        if moved is None:
            continue
        records.append(Record(
            name="group.gap", status="changed",
            summary=f"{shard.label}: sample {cut} of its kept range [{shard.start}, {old_stop}) is not on "
                    f"{shard.head}'s disk; [{cut}, {old_stop}) is made again there as {moved.label} (run id "
                    f"{moved.run_id})", detail={"from": shard.model_dump(), "to": moved.model_dump()}))
    return records


def lanes_of(shard_list: list[Shard]) -> dict[str, list[Shard]]:
    """Shards by head host, in map order: a host runs one shard at a time (one run per host, as
    ``job start`` enforces), so a range moved to a busy host waits for the shard before it."""
    lanes: dict[str, list[Shard]] = {}
    for shard in shard_list:
        lanes.setdefault(shard.head, []).append(shard)
    return lanes


def start_lane(manifest: GroupMap, lane: list[Shard], conns: HostPool, overrides: dict,
               force: bool) -> HostReport:
    """Start a host's first unfinished shard (shards already done just say so); ``data["current"]`` names it."""
    out = HostReport(host=lane[0].head, task="extract")
    reports, current = [], None
    for shard in lane:
        try:
            report = start_step(manifest, shard, conns.for_shard(manifest, shard), overrides, force, conns)
        except SpecopsError as exc:
            report = HostReport(host=shard.label, task="extract", error=str(exc), error_code=int(exc.code))
        reports.append(report)
        if report.failed:
            break
        if shard.seen.get("state") != STATE.DONE:
            current = shard.id
            break
    out.data = {"reports": reports, "current": current}
    return out
