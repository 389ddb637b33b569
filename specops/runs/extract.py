"""``specops extract`` over a group of hosts: plan (or resume, or reassign), start, follow, fetch."""
from __future__ import annotations

from rich.text import Text

from specops.errors import SpecopsError, UsageError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.report import console, err_console
from specops.result import STATE, HostReport, Record, overall_exit
from specops.runs.fetch import fetch
from specops.runs.hostjob import canary_record
from specops.runs.plan import plan
from specops.runs.pool import QUICK_TIMEOUT_S, per_shard
from specops.runs.reassign import parse_reassign, reassign
from specops.runs.shardmap import GroupMap, Shard
from specops.runs.start import lanes_of, remake_gaps, settle_closed, start_lane
from specops.runs.store import GROUP, load_manifest, manifest_path, save_manifest
from specops.runs.view import NotStarted, follow, print_group, shard_table
from specops.transport.parallel import run_steps
from specops.transport.pool import HostPool


def extract(inventory: Inventory, selector: str | None, overrides: dict, *, run_id: str, detach: bool, force: bool,
            skip_preflight: bool, as_json: bool, tensors: bool, accept_new_host_key: bool = False,
            skip_smoke: bool = False, shard_by: str | None = None, allow_partial: bool = False,
            reassign_text: str | None = None, smoke_real: bool = False) -> ExitCode:
    """The whole group run: plan (or resume, or reassign), start, follow, fetch; returns the exit code.

    Every host of a new plan (and a new host a shard moves to) gets the smoke rehearsal
    first unless ``skip_smoke``; a resumed shard does not (it was checked when planned).
    """
    conns = HostPool(inventory, accept_new_host_key)
    try:
        return _extract(inventory, selector, overrides, conns, run_id=run_id, detach=detach, force=force,
                        skip_preflight=skip_preflight, skip_smoke=skip_smoke, as_json=as_json, tensors=tensors,
                        shard_by=shard_by, allow_partial=allow_partial, reassign_text=reassign_text,
                        smoke_real=smoke_real)
    finally:
        conns.close()


def _resume_overrides(manifest: GroupMap, overrides: dict) -> dict:
    """The run's own flags; a flag given again must say the same thing."""
    changed = {k: (manifest.overrides.get(k), v) for k, v in overrides.items()
               if k in manifest.overrides and str(manifest.overrides[k]) != str(v)}
    added = {k: v for k, v in overrides.items() if k not in manifest.overrides}
    if changed or added:
        said = ", ".join([f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in changed.items()]
                         + [f"--{k.replace('_', '-')} {v!r} is new" for k, v in added.items()])
        raise UsageError(f"run {manifest.run_id} exists with other flags ({said})",
                         f"resume it with no run flags (they come from {manifest_path(manifest.run_id)}), "
                         f"or start a new run id")
    return dict(manifest.overrides)


def _extract(inventory, selector, overrides, conns: HostPool, *, run_id, detach, force, skip_preflight, skip_smoke,
             as_json, tensors, shard_by, allow_partial, reassign_text, smoke_real=False) -> ExitCode:
    manifest = load_manifest(run_id)
    reports: list[HostReport] = []
    if manifest is None:
        if reassign_text:
            raise UsageError(f"--reassign needs a group run, and this laptop has none called {run_id!r} "
                             f"({manifest_path(run_id)} does not exist)", "pass the id of a running group run")
        specs = inventory.select(selector)
        manifest, reports = plan(run_id, overrides, specs, conns, shard_by=shard_by, allow_partial=allow_partial,
                                 skip_preflight=skip_preflight, skip_smoke=skip_smoke, force=force,
                                 smoke_real=smoke_real)
        if manifest is None:
            print_group(reports, as_json=as_json)
            return overall_exit(reports)
    else:
        if shard_by:
            raise UsageError(f"--shard-by applies when a run is planned; run {run_id} already has its shard map",
                             "drop --shard-by to resume, or move a shard with --reassign FROM=TO")
        overrides = _resume_overrides(manifest, overrides)
        if reassign_text:
            reports = reassign(manifest, parse_reassign(reassign_text), conns, overrides, skip_preflight,
                               skip_smoke=skip_smoke, force=force, smoke_real=smoke_real)
            if any(r.failed for r in reports):
                print_group(reports, as_json=as_json)
                return overall_exit(reports)
    # hosts left out by --allow-partial are shown, but their failures are not this run's any more
    left_out = set(manifest.history[-1].get("left_out") or {}) if manifest.history else set()
    wanted = {s.name for s in inventory.select(selector)} if selector else None
    closed = [s for s in manifest.shards if not s.empty and s.closed and (wanted is None or s.head in wanted)]
    settled = per_shard(closed, manifest, conns, "extract", lambda s, h: settle_closed(manifest, s, h),
                         QUICK_TIMEOUT_S)
    reports += settled
    gaps = remake_gaps(manifest, list(zip(closed, settled)), conns, overrides)
    if gaps:
        reports.append(HostReport(host=GROUP, task="extract", records=gaps))
    chosen = [s for s in manifest.shards if not s.empty and (wanted is None or s.head in wanted)]
    lanes = lanes_of([s for s in chosen if not s.closed])
    lane_reports = run_steps(list(lanes.values()), lambda lane: start_lane(manifest, lane, conns, overrides, force),
                             name_of=lambda lane: lane[0].head, task="extract", timeout=QUICK_TIMEOUT_S,
                             on_timeout=lambda lane: [conns.for_shard(manifest, s).close() for s in lane])
    running: dict[str, list[Shard]] = {}
    for lane, lane_report in zip(lanes.values(), lane_reports):
        if lane_report.error is not None:  # the host hung or dropped while starting
            reports.append(lane_report.model_copy(update={"host": lane[0].label}))
            continue
        reports.extend(lane_report.data["reports"])
        current = lane_report.data["current"]
        if current is not None:
            running[lane[0].head] = lane[[s.id for s in lane].index(current):]
    save_manifest(manifest)
    waiting = [s.label for lane in running.values() for s in lane[1:]]
    if not running and not detach:
        return _nothing_to_run(manifest, conns, reports, tensors=tensors, as_json=as_json, left_out=left_out)
    if detach or not running:
        print_group(reports, as_json=as_json)
        if not as_json:
            console.print(shard_table(manifest, {}))
            console.print(Text.assemble("run ", (run_id, "bold"), f" started detached ({len(running)} shard(s) running"
                          + (f"; {', '.join(waiting)} wait for their host's shard to finish: run the same command "
                             f"again then" if waiting else "")
                          + f"). Follow: specops extract --run-id {run_id};  status: specops status --run-id {run_id}"))
        return overall_exit([r for r in reports if r.host not in left_out])
    if not as_json:
        print_group(reports)
        console.print(Text.assemble("Following run ", (run_id, "bold"), f" on {len(running)} host(s)"
                                    + (f" ({', '.join(waiting)} start when their host's shard is done)" if waiting
                                       else "") + " (Ctrl-C detaches; the runs go on)"))
    try:
        final, more = follow(manifest, conns, running, overrides, force)
    except KeyboardInterrupt:
        conns.close()
        save_manifest(manifest)
        err_console.print(Text.assemble("\n", ("detached", "yellow"), f": run {run_id} goes on. Re-attach: specops "
                                        f"extract --run-id {run_id}; status: specops status --run-id {run_id}"))
        return ExitCode.JOB_RUNNING
    return _conclude(manifest, conns, final, tensors=tensors, as_json=as_json, printed=reports, late=more,
                     left_out=left_out)


def _nothing_to_run(manifest: GroupMap, conns: HostPool, reports: list[HostReport], *, tensors: bool,
                    as_json: bool, left_out: set[str]) -> ExitCode:
    """No shard is running after the starts: every one is done on its disk (a done run missing
    samples was restarted, so it runs), or the starts failed. Say which; fetch what is done."""
    mine = [r for r in reports if r.host not in left_out]
    group = HostReport(host=GROUP, task="extract")
    if any(r.failed for r in mine):
        group.records.append(Record(name="group.run", status="fail",
                                    summary=f"no shard of run {manifest.run_id} is running: the starts above failed",
                                    fix="fix the causes above, then run the same command again"))
        fetched = []
    else:
        group.records.append(Record(name="group.run", status="ok",
                                    summary=f"nothing left to run: every shard of run {manifest.run_id} is done; "
                                            f"fetching" + (" the files" if tensors else "")))
        fetched = fetch(manifest, conns, tensors=tensors)
    everything = [*reports, group, *fetched]
    print_group(everything, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, {}))
    return overall_exit([r for r in everything if r.host not in left_out])


def _conclude(manifest: GroupMap, conns: HostPool, final: dict, *, tensors: bool, as_json: bool,
              printed: list[HostReport], late: list[HostReport], left_out: set[str] = frozenset()) -> ExitCode:
    """Say how each shard ended; fetch and merge when every shard is done.

    :param printed: the reports shown before the view (``--json`` prints them now, with the rest).
    :param late: start reports of shards started while following.
    """
    codes, reports = [], []
    for shard in manifest.shards:
        if shard.id not in final:
            continue
        result = final[shard.id]
        report = HostReport(host=shard.label, task="extract")
        if isinstance(result, NotStarted):
            report.records.append(Record(
                name="group.run", status="fail", summary=f"not started: {result}",
                fix=f"once the shard before it is done, run the same command again (specops extract --run-id "
                    f"{manifest.run_id})"))
            codes.append(ExitCode.FAILED)
        elif isinstance(result, Exception):
            report.records.append(Record(
                name="group.run", status="fail", summary=f"lost {shard.head}: {str(result).splitlines()[0]}",
                detail={"last_seen": shard.seen},
                fix=f"the other shards went on. Once {shard.head} answers, run the same command again to resume it; "
                    f"or move its remaining range: specops extract --run-id {manifest.run_id} --reassign "
                    f"{shard.head}=OTHER_HOST"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
        elif result.state == STATE.DONE:
            report.records.append(Record(name="group.run", status="ok",
                                         summary=f"[{shard.start}, {shard.stop}) done on {shard.head}"))
            shown = canary_record("extract.canary", result)
            if shown is not None:
                report.records.append(shown)
            codes.append(ExitCode.SUCCESS)
        else:
            err = result.error
            report.records.append(Record(
                name="group.run", status="fail",
                summary=f"{shard.run_id} on {shard.head} {result.state}: "
                        + (err.headline() if err else "no error recorded"),
                detail={"error": err.model_dump() if err else None},
                fix=(f"{err.fix}; then " if err and err.fix else f"read the traceback (specops logs --run-id "
                     f"{manifest.run_id}); fix the cause, then ") + "run the same command again to resume the shard"))
            codes.append(result.exit_code)
        reports.append(report)
    fetched = {r.host: r for r in fetch(manifest, conns, tensors=tensors)}
    for report in reports:  # one report per shard: how its run ended, then what was fetched of it
        got = fetched.pop(report.host, None)
        if got is not None:
            report.records.extend(got.records)
            report.data.update(got.data)
            report.error, report.error_code = got.error, got.error_code
    reports.extend(fetched.values())
    if as_json:
        print_group([*printed, *late, *reports], as_json=True)
    else:
        print_group([*[r for r in late if r.failed], *reports])
        console.print(shard_table(manifest, final))
    # a shard that could not even start (its host busy with another run, unreachable) counts too
    everything = [r for r in (*printed, *late, *reports) if r.host not in left_out]
    if ExitCode.UNREACHABLE in codes or overall_exit(everything) == ExitCode.UNREACHABLE:
        return ExitCode.UNREACHABLE
    return max([*codes, overall_exit(everything)], default=ExitCode.SUCCESS)
