"""``status``, ``logs`` and ``abort`` of a group run: every shard, on the host that holds it, bounded per host."""
from __future__ import annotations

import json

from rich.text import Text

from specops.errors import SpecopsError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.logs import log_printer
from specops.report import console
from specops.result import STATE, HostReport, Record, RunStatus, overall_exit
from specops.runs import hostjob
from specops.runs.pool import QUICK_TIMEOUT_S, per_shard, shard_files
from specops.runs.shardmap import GroupMap, Shard
from specops.runs.store import load_manifest, save_manifest
from specops.runs.view import INCOMPLETE, print_group, shard_state, shard_table
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_steps
from specops.transport.pool import HostPool


def host_label(shard: Shard, host: str) -> str:
    """``s0@a``: one host of ``shard`` (the shard's own label when it has one host)."""
    return shard.label if len(shard.hosts) == 1 else f"{shard.id}@{host}"


class UnreachableMarker(Exception):
    """A shard whose host did not answer a look (shown with its last seen progress)."""


def _look_step(manifest: GroupMap, shard: Shard, host: Host, conns: HostPool | None = None) -> HostReport:
    payload = hostjob.job_call(host, "status", shard.run_id)
    report = report_from_payload(shard.label, "status", payload)
    state = RunStatus.from_payload(payload)
    if state.found:
        shard.remember(state.model_dump())
    report.data["state"] = shard_state(shard, state)
    report.data["run_state"] = state.model_dump()
    if shard.closed:  # its host's run may have ended any way; what counts is the kept range
        report.records = [Record(name="job.status", status="ok" if report.data["state"] == STATE.DONE else "warn",
                                 summary=f"[{shard.start}, {shard.stop}) on {shard.head}: {report.data['state']} "
                                         f"(rest moved to {', '.join(shard.moved_to)})")]
    if report.data["state"] == STATE.DONE:  # done is what the disk holds, not what a status file says
        listing = shard_files(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
        gone = shard.size - len(listing.get("files") or [])
        if gone:
            report.data.update(state=INCOMPLETE, on_disk=shard.size - gone, disk_first_missing=listing["first_missing"])
            report.records.append(Record(
                name="group.disk", status="fail",
                summary=f"{shard.label} is done by its status, but {gone} of its {shard.size} sample(s) are not on "
                        f"{shard.head}'s disk, or changed there (first {listing['first_missing']})",
                detail={"missing_head": listing.get("missing_head"), "changed": listing.get("changed")},
                fix=f"specops extract --run-id {manifest.run_id} makes them again"))
    if conns is not None:
        report.records.extend(_worker_records(shard, conns))
    return report


def _worker_records(shard: Shard, conns: HostPool) -> list[Record]:
    """One record per worker host of a replica: its headless ranks' run (the head's run is the shard's)."""
    records = []
    for worker in shard.hosts[1:]:
        try:
            payload = hostjob.job_call(conns.host(worker), "status", shard.run_id, timeout=QUICK_TIMEOUT_S)
        except SpecopsError as exc:
            records.append(Record(name="replica.host", status="warn",
                                  summary=f"{worker} (ranks of {shard.label}) did not answer: "
                                          f"{str(exc).splitlines()[0]}"))
            continue
        st = (payload.get("data") or {}).get("status") or {}
        ranks = (st.get("replica") or {}).get("ranks")
        err = st.get("error") or {}
        failed = st.get("state") == STATE.FAILED
        records.append(Record(name="replica.host", status="fail" if failed else "ok",
                              summary=f"{worker}: ranks {ranks} {st.get('state') or 'missing'}"
                                      + (f" ({err.get('type')}: {err.get('message')})" if err else ""),
                              detail={"host": worker, "status": st}))
    return records


def status(inventory: Inventory, run_id: str, *, as_json: bool, accept_new_host_key: bool = False) -> ExitCode:
    """Every shard's state, bounded per host; an unreachable host is shown with its last seen progress."""
    manifest = load_manifest(run_id)
    conns = HostPool(inventory, accept_new_host_key)
    try:
        shards = [s for s in manifest.shards if not s.empty]
        reports = per_shard(shards, manifest, conns, "status", lambda s, h: _look_step(manifest, s, h, conns),
                             QUICK_TIMEOUT_S)
        for shard, report in zip(shards, reports):
            if report.error is not None and len(shard.hosts) > 1:
                # a replica whose head does not answer: its worker hosts say what they saw of it (a dead
                # head stops their ranks, HeadLost naming it)
                workers = _worker_records(shard, conns)
                report.records.extend(workers)
                report.error += "".join(f"\n  {r.summary}" for r in workers)
    finally:
        conns.close()
    save_manifest(manifest)
    states: dict = {}
    for shard, report in zip(shards, reports):
        if report.error is not None:
            states[shard.id] = UnreachableMarker(report.error)
            report.data["last_seen"] = shard.seen
        else:
            states[shard.id] = RunStatus.model_validate(report.data["run_state"])
    print_group(reports, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, states, {
            s.id: (r.data["on_disk"], r.data["disk_first_missing"]) for s, r in zip(shards, reports)
            if r.data.get("state") == INCOMPLETE}))
    if any(r.error is not None for r in reports):
        return overall_exit([r for r in reports if r.error is not None])
    return max((ExitCode.FAILED if r.data.get("state") == INCOMPLETE else
                ExitCode.from_job_state(r.data.get("state", STATE.MISSING)) for r in reports), default=ExitCode.SUCCESS)


def abort(inventory: Inventory, run_id: str, *, accept_new_host_key: bool = False) -> list[HostReport]:
    """Stop every shard's run (cut shards too, should theirs still run)."""
    manifest = load_manifest(run_id)
    conns = HostPool(inventory, accept_new_host_key)
    try:
        shards = [s for s in manifest.shards if not s.empty]
        return per_shard(shards, manifest, conns, "abort", lambda s, h: _abort_shard(s, h, conns), QUICK_TIMEOUT_S)
    finally:
        conns.close()


def _abort_shard(shard: Shard, head: Host, conns: HostPool) -> HostReport:
    """Abort the shard's run on its head, then on every other host of its replica (their headless
    ranks); a host that does not answer is named, the others are still aborted. A head that does
    not answer leaves the shard's report in error (its run may still go on), and its worker hosts
    are aborted all the same: the head cannot go on without their ranks and ends the replica."""
    try:
        report = report_from_payload(shard.label, "abort", hostjob.job_call(head, "abort", shard.run_id))
    except SpecopsError as exc:
        if len(shard.hosts) == 1:
            raise
        report = HostReport(host=shard.label, task="abort", error_code=int(exc.code),
                            error=f"{exc}\n  its worker host(s) {', '.join(shard.hosts[1:])} were still asked to abort "
                                  f"(see below); the head ends the replica once their ranks are gone")
    for worker in shard.hosts[1:]:
        try:
            payload = hostjob.job_call(conns.host(worker), "abort", shard.run_id, timeout=QUICK_TIMEOUT_S)
        except SpecopsError as exc:
            report.records.append(Record(name=f"job.abort@{worker}", status="fail",
                                         summary=f"{worker} (ranks of replica {shard.label}) did not answer: "
                                                 f"{str(exc).splitlines()[0]}",
                                         fix=f"once {worker} answers, abort again (specops abort --run-id "
                                             f"{shard.run_id}); its ranks stop by themselves when the head is gone"))
            continue
        report.records.extend(r.model_copy(update={"name": f"{r.name}@{worker}"})
                              for r in report_from_payload(worker, "abort", payload).records)
    return report


def logs(inventory: Inventory, run_id: str, *, follow_logs: bool, only: str | None, as_json: bool,
         accept_new_host_key: bool = False) -> ExitCode:
    """Every shard's logs, each line prefixed by its shard and host; ``follow_logs`` streams until all are final."""
    manifest = load_manifest(run_id)
    conns = HostPool(inventory, accept_new_host_key)
    shards = [s for s in manifest.shards if not s.empty]
    # a replica over several hosts: every host's logs, each under its own label (the head's is the shard's key)
    collected: dict[str, dict[str, str]] = {host_label(s, h): {} for s in shards for h in s.hosts}
    labels = {s.id: host_label(s, s.head) for s in shards}
    labels.update({f"{s.id}@{w}": host_label(s, w) for s in shards for w in s.hosts[1:]})
    show = log_printer(collected, only, as_json)

    codes = [ExitCode.SUCCESS]
    try:
        if follow_logs:
            def on_event(sid: str, event: dict) -> None:
                if event["event"] == "log":
                    show(labels[sid], event["file"], event["text"])

            try:
                final = hostjob.follow_many([(s.id, conns.for_shard(manifest, s), s.run_id) for s in shards]
                                         + [(f"{s.id}@{w}", conns.host(w), s.run_id) for s in shards
                                            for w in s.hosts[1:]], on_event, logs=True)
            except KeyboardInterrupt:
                conns.close()
                console.print("[yellow]stopped following; the runs go on[/]")
                return ExitCode.SUCCESS
            for sid, result in final.items():
                if isinstance(result, Exception):
                    console.print(Text(f"{labels[sid]}: lost the follow: {result}", style="bold red"))
                    codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
        else:
            def host_of(item: tuple[Shard, str]) -> Host:
                shard, name = item
                return conns.for_shard(manifest, shard) if name == shard.head else conns.host(name)

            def look(item: tuple[Shard, str]) -> HostReport:
                shard, name = item
                host = host_of(item)
                payload = hostjob.job_call(host, "logs", shard.run_id)
                return HostReport(host=host_label(shard, name), task="logs", data=payload.get("data") or {},
                                  records=[Record(**r) for r in payload.get("records", [])])

            # every host of every shard at once: a replica's worker hosts keep their ranks' own logs
            items = [(s, h) for s in shards for h in s.hosts]
            for report in run_steps(items, look, name_of=lambda i: host_label(*i), task="logs",
                                    timeout=QUICK_TIMEOUT_S, on_timeout=lambda i: host_of(i).close()):
                if report.error is not None or "logs" not in report.data:
                    why = report.error or (report.records[0].summary if report.records else "no logs")
                    console.print(Text(f"{report.host}: {why.splitlines()[0]}", style="bold red"))
                    codes.append(ExitCode(report.error_code) if report.error else ExitCode.JOB_NOT_FOUND)
                    continue
                for name, chunk in report.data["logs"].items():
                    show(report.host, name, chunk["text"])
    finally:
        conns.close()
    if as_json:
        import sys

        sys.stdout.write(json.dumps({"run_id": run_id, "logs": collected}, indent=2) + "\n")
    return max(codes)
