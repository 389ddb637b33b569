"""``--reassign FROM=TO``: move the unfinished rest of a shard to another host, cut where FROM's disk says."""
from __future__ import annotations

from specops.errors import UsageError
from specops.replica import replica_overrides
from specops.result import HostReport, Record
from specops.runs import hostjob, shardmap
from specops.runs.plan import agreement, probe_step, rehearse_hosts, shard_output_dir
from specops.runs.pool import QUICK_TIMEOUT_S, shard_files
from specops.runs.shardmap import GroupMap, Shard
from specops.runs.store import GROUP, save_manifest
from specops.transport.parallel import run_steps, step_timeout
from specops.transport.pool import HostPool


def parse_reassign(text: str) -> list[tuple[str, str]]:
    """``--reassign FROM=TO[,FROM=TO...]``: each FROM once; nothing given is a usage error, not a no-op."""
    pairs = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        src, sep, dst = part.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise UsageError(f"--reassign {text!r}: {part!r} is not FROM=TO",
                             "name the host that lost its shard and the host that takes the rest, e.g. "
                             "--reassign gpu-b=gpu-d")
        if src.strip() == dst.strip():
            raise UsageError(f"--reassign {part!r} moves a shard to its own host", "name another host after '='")
        if any(src.strip() == had for had, _ in pairs):
            raise UsageError(f"--reassign {text!r} moves {src.strip()!r} twice",
                             f"name each host once: its unfinished range goes to one host, e.g. --reassign "
                             f"{src.strip()}={dst.strip()}")
        pairs.append((src.strip(), dst.strip()))
    if not pairs:
        raise UsageError(f"--reassign {text!r} names no move", "give FROM=TO, e.g. --reassign gpu-b=gpu-d")
    return pairs


def _cut_point(manifest: GroupMap, shard: Shard, conns: HostPool) -> tuple[int, str, bool]:
    """The first index of ``shard`` not on its host's disk, how it was learned, and whether
    that was read on the disk.

    Asked from the host when it answers (its run is stopped first, so it makes nothing
    past the cut); else the last status the laptop saw, which never runs ahead of the
    disk (a run reports a sample only once it is written) but counts samples, so a gap
    below it (a file lost in an earlier crash) is not seen: the cut is then marked
    unchecked, and the kept range is read when the host answers again.
    """
    host = conns.for_shard(manifest, shard)

    def ask(_shard) -> HostReport:
        state = hostjob.run_state(host, shard.run_id)
        if state.alive and not state.is_final:
            hostjob.job_call(host, "abort", shard.run_id)
        listing = shard_files(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
        return HostReport(host=shard.label, task="extract", data={"first_missing": listing["first_missing"],
                                                                  "state": state.state})

    report, = run_steps([shard], ask, name_of=lambda s: s.label, task="extract", timeout=QUICK_TIMEOUT_S,
                        on_timeout=lambda s: host.close())
    if report.error is None:
        return int(report.data["first_missing"]), f"read on {shard.head}'s disk (its run stopped first)", True
    at = shard.seen.get("at") or "never"
    return shard.first_missing(), (f"{shard.head} did not answer ({report.error.splitlines()[0]}); last seen "
                                   f"status at {at}, not checked on its disk: a gap below it is made again once "
                                   f"{shard.head} answers (specops extract --run-id {manifest.run_id})"), False


def _replica_hosts(inventory, name: str) -> list[str]:
    replica = inventory.replica_of(name)
    return list(replica.hosts) if replica is not None else []


def _as_units(inventory, src: str, dst: str) -> tuple[str, str]:
    """``FROM=TO`` with a replica over several hosts named by its name or its head: a replica moves,
    and takes a range, as one (its head names it).

    :raises UsageError: a TO that is a worker host of a replica (its ranks cannot run alone).
    """
    if src in inventory.replicas:
        src = inventory.replicas[src].head
    if dst in inventory.replicas:
        dst = inventory.replicas[dst].head
    replica = inventory.replica_of(dst)
    if replica is not None and dst != replica.head:
        raise UsageError(f"--reassign {src}={dst}: {dst!r} runs ranks of replica {replica.name!r}, whose head is "
                         f"{replica.head!r}", f"move the range to the replica: --reassign {src}={replica.name}")
    return src, dst


def reassign(manifest: GroupMap, pairs: list[tuple[str, str]], conns: HostPool, overrides: dict,
             skip_preflight: bool, skip_smoke: bool = False, force: bool = False,
             smoke_real: bool = False) -> list[HostReport]:
    """Move every unfinished shard of each FROM to its TO; the map is saved when all moves are settled.

    A TO new to the run is checked as the plan checks a host (preflight, then smoke)."""
    group = HostReport(host=GROUP, task="extract")
    reports: list[HostReport] = []
    pairs = [_as_units(conns.inventory, src, dst) for src, dst in pairs]
    for src, dst in pairs:
        if src not in manifest.host_names():
            raise UsageError(f"--reassign {src}={dst}: {src!r} holds no shard of run {manifest.run_id}",
                             f"its hosts are {', '.join(manifest.host_names())}")
        conns.spec(dst)
    targets = sorted({dst for _, dst in pairs})
    probed = run_steps([conns.host(n) for n in targets],
                       lambda h: probe_step(h, replica_overrides(conns.inventory, h.name, overrides),
                                            preflight=not skip_preflight and h.name not in manifest.hosts),
                       name_of=lambda h: h.name, task="extract", timeout=step_timeout("preflight"),
                       on_timeout=lambda h: h.close())
    reports.extend(probed)
    bad = [r.host for r in probed if r.failed]
    probes = {r.host: r.data["probe"] for r in probed if not r.failed}
    checks = agreement(probes, expected=manifest) if probes else []
    group.records.extend(checks)
    new = [n for n in targets if n not in manifest.hosts]
    if not bad and (smoke_real or not skip_smoke) and new and not any(r.status == "fail" for r in checks):
        bad = rehearse_hosts(new, conns, overrides, force, reports, real=smoke_real, twin=not skip_smoke)
    if bad or any(r.status == "fail" for r in checks):
        group.records.append(Record(name="group.reassign", status="fail",
                                    summary=f"not moving anything: {', '.join(bad) or 'the new host'} cannot take a "
                                            f"shard of run {manifest.run_id}",
                                    fix="fix the target host (see its records), or pick another one"))
        return [*reports, group]
    for src, dst in pairs:
        # a cut shard too: what its host keeps is read again, and a gap in it moves (the disk decides, not a
        # status); every shard says what happened to it, a move asked twice included
        for shard in [s for s in manifest.shards_on(src) if not s.empty]:
            cut, how, checked = _cut_point(manifest, shard, conns)
            kept = f" (the rest moved to {', '.join(shard.moved_to)} before)" if shard.closed else ""
            if shard.closed and not checked:
                group.records.append(Record(
                    name="group.reassign", status="skipped",
                    summary=f"{shard.label}: [{shard.start}, {shard.stop}) stays on {src}{kept}; nothing more to move "
                            f"while it does not answer ({how.split(';')[0]})",
                    fix=f"once {src} answers, specops extract --run-id {manifest.run_id} reads its disk and makes "
                        f"any gap again"))
                continue
            new_run_id = shardmap.moved_run_id(manifest.run_id, shardmap.next_moved_id(manifest, shard))
            moved = shardmap.reassign(manifest, shard, dst, cut, shard_output_dir(conns.spec(dst), overrides, new_run_id),
                                      hosts=_replica_hosts(conns.inventory, dst) or [dst])
            if moved is None:
                if checked:
                    shard.cut_checked = True
                group.records.append(Record(name="group.reassign", status="skipped",
                                            summary=f"{shard.label}: every sample of [{shard.start}, {shard.stop}) "
                                                    f"is on {src}{kept} ({how}); nothing to move"))
                continue
            shard.cut_checked = checked
            manifest.hosts.setdefault(dst, {"engine": probes[dst]["stack"].get("engine"),
                                            "versions": probes[dst].get("versions"),
                                            "capacity": probes[dst].get("capacity"),
                                            "dataset_path": probes[dst]["dataset"].get("path")})
            group.records.append(Record(
                name="group.reassign", status="changed",
                summary=f"{shard.id}: [{cut}, {moved.stop}) moved from {src} to {dst} as {moved.label} (run id "
                        f"{moved.run_id}); [{shard.start}, {cut}) stays on {src} (cut {how})",
                detail={"from": shard.model_dump(), "to": moved.model_dump(), "how": how}))
    save_manifest(manifest)
    return [*reports, group]
