"""What people see of a group run: the live follow view (a bar per shard and a total), the
shard table, and the recap of many hosts.
"""
from __future__ import annotations

import queue
import threading
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from specops.report import STATE_STYLE, console, err_console, host_view, print_reports, recap_line
from specops.result import STATE, HostReport, RunStatus
from specops.runs import hostjob
from specops.runs.shardmap import GroupMap, Shard
from specops.runs.start import start_step
from specops.runs.store import GROUP, save_manifest
from specops.transport.pool import HostPool

#: how often the follow view writes last seen progress to group.json (seconds).
SAVE_EVERY_S = 2.0
#: a shard whose status says done while its disk lacks samples (status's word for it).
INCOMPLETE = "incomplete"


def print_group(reports: list[HostReport], as_json: bool = False) -> None:
    """``print_reports``, made for many hosts: with ``--json`` every record; for people, the
    tables of the hosts that have something to say (a failure, a warning, a change of plan)
    and one recap line for every host."""
    if as_json:
        print_reports(reports, as_json=True)
        return
    for report in reports:
        if report.error is not None:
            console.print(Text(f"{report.task} on {report.host}: ", style="bold")
                          + Text(report.error, style="bold red"))
        elif report.host == GROUP or any(r.status in ("fail", "warn") for r in report.records):
            console.print(host_view(report, console))
    console.rule("RECAP", style="dim")
    for report in reports:
        console.print(recap_line(report))


def shard_state(shard: Shard, state: RunStatus | None) -> str:
    """A shard's state for people: a cut shard is done once its kept range is on disk."""
    if shard.empty:
        return "empty"
    if state is None:
        return "unknown"
    if shard.closed and state.found and shard.first_missing(state.model_dump()) >= shard.stop:
        return STATE.DONE
    return state.state


class NotStarted(Exception):
    """A shard that waited for another shard of its host, which did not end done."""


def follow(manifest: GroupMap, conns: HostPool, lanes: dict[str, list[Shard]], overrides: dict,
           force: bool) -> tuple[dict[str, RunStatus | Exception], list[HostReport]]:
    """One view over every lane until each shard is final, lost or left waiting.

    Each host's lane runs on a thread of its own: it follows the running shard (one
    python on the host, one channel), and when that ends done, starts the host's next
    shard and follows it. Returns each shard's last state (or why it has none) and the
    start reports of the shards started on the way.

    :raises KeyboardInterrupt: passed through; the caller detaches.
    """
    shard_list = [s for lane in lanes.values() for s in lane]
    events: queue.Queue = queue.Queue()
    states: dict[str, RunStatus] = {}
    results: dict[str, RunStatus | Exception] = {}
    started: list[HostReport] = []
    last_save = [0.0]

    def lane_worker(lane: list[Shard]) -> None:
        for i, shard in enumerate(lane):
            host = conns.for_shard(manifest, shard)
            try:
                if i > 0:  # the shard before it on this host is done: this one's turn
                    report = start_step(manifest, shard, host, overrides, force, conns)
                    events.put(("report", shard.id, report))
                    if report.failed:
                        raise NotStarted(report.error or next(r.summary for r in report.records if r.status == "fail"))
                # a next shard waits until this one's supervisor has exited (its engine freed the devices)
                until = "exited" if i + 1 < len(lane) else "final"
                result = hostjob.follow_run(host, shard.run_id, lambda e, sid=shard.id: events.put(("event", sid, e)),
                                         until=until)
            except Exception as exc:  # noqa: BLE001 -- this shard's result; the other lanes go on
                result = exc
            events.put(("result", shard.id, result))
            if not (isinstance(result, RunStatus) and result.state == STATE.DONE):
                for rest in lane[i + 1:]:
                    events.put(("result", rest.id, NotStarted(f"waits for {shard.id} on {shard.head}, which did not "
                                                              f"end done")))
                return

    with Progress(TextColumn("{task.fields[label]}", style="bold", markup=False),
                  TextColumn("{task.fields[phase]:<14}", markup=False), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[rate]:>12}"), TextColumn("ETA {task.fields[eta]}"),
                  TimeElapsedColumn(), console=err_console, transient=False) as progress:
        bars = {s.id: progress.add_task("", label=s.label, phase="starting" if lane[0] is s else "waiting",
                                        rate="", eta="?", total=s.size, completed=max(0, s.first_missing() - s.start))
                for lane in lanes.values() for s in lane}
        total_bar = progress.add_task("", label=f"total {manifest.run_id}", phase="", rate="", eta="?",
                                      total=manifest.total)
        by_id = {s.id: s for s in shard_list}

        def draw_total() -> None:
            done = 0
            for s in manifest.shards:
                st = states.get(s.id)
                done += s.size if shard_state(s, st) == STATE.DONE else max(
                    0, s.first_missing(st.model_dump() if st else None) - s.start)
            running = [st for sid, st in states.items() if not st.is_final and sid not in results]
            rate = sum(st.tokens_per_s or 0 for st in running if st.state == STATE.EXTRACTING)
            etas = [st.eta_s for st in running]
            eta = "?" if any(e is None for e in etas) else f"{max(etas, default=0):.0f}s"
            lost = [sid for sid, r in results.items() if isinstance(r, Exception) and not isinstance(r, NotStarted)]
            progress.update(total_bar, completed=done, rate=f"{rate:.0f} tok/s" if rate else "", eta=eta,
                            phase=f"{len(lost)} lost" if lost else "")

        def show(shard: Shard, state: RunStatus) -> None:
            states[shard.id] = state
            before = (shard.seen.get("state"), shard.seen.get("samples_done"))
            shard.remember(state.model_dump())
            if (state.state, state.samples_done) != before:  # progress is what a reassignment goes by: keep it now
                last_save[0] = 0.0
            rate, eta = state.tokens_per_s, state.eta_s
            progress.update(bars[shard.id], completed=max(0, shard.first_missing(state.model_dump()) - shard.start),
                            phase=shard_state(shard, state), rate=f"{rate:.0f} tok/s" if rate else "",
                            eta=f"{eta:.0f}s" if eta is not None else "?")
            draw_total()
            if time.monotonic() - last_save[0] > SAVE_EVERY_S:
                save_manifest(manifest)
                last_save[0] = time.monotonic()

        for lane in lanes.values():
            threading.Thread(target=lane_worker, args=(lane,), daemon=True, name=f"lane-{lane[0].head}").start()
        while len(results) < len(shard_list):
            try:
                kind, sid, item = events.get(timeout=0.5)  # a timeout keeps Ctrl-C deliverable here
            except queue.Empty:
                continue
            if kind == "event":
                if item["event"] == "status":
                    show(by_id[sid], RunStatus.model_validate(item["status"]))
            elif kind == "report":
                started.append(item)
            else:
                results[sid] = item
                if isinstance(item, RunStatus):
                    if item.found:
                        show(by_id[sid], item)
                else:
                    progress.update(bars[sid], phase="not started" if isinstance(item, NotStarted) else "unreachable",
                                    rate="", eta="?")
                    draw_total()
    save_manifest(manifest)
    return results, started


def shard_table(manifest: GroupMap, states: dict[str, RunStatus | Exception | None],
                disk: dict[str, tuple[int, int]] | None = None) -> Table:
    """One row per shard; ``disk`` (``{shard id: (samples on disk, first missing)}``) overrides a done
    status for shards whose disk lacks samples."""
    table = Table(title=Text(f"run {manifest.run_id}: {manifest.total} samples, {len(manifest.shards)} shard(s)"),
                  title_justify="left")
    for column in ("shard", "host(s)", "range", "run id", "state", "done", "first missing", "note"):
        table.add_column(column, justify="right" if column in ("done", "first missing") else "left")
    for s in manifest.shards:
        result = states.get(s.id)
        if result is None and s.seen.get("state"):  # not looked at now: what was seen last
            result = RunStatus(state=s.seen["state"], samples_done=s.seen.get("samples_done"),
                              samples_total=s.seen.get("samples_total"), alive=s.seen.get("alive"))
        state = result if isinstance(result, RunStatus) else None
        if isinstance(result, Exception):
            text = Text("unreachable", style="bold red")
            first = s.first_missing()
            note = f"last seen {s.seen.get('at', 'never')}: {s.seen.get('state') or '?'}"
        else:
            name = shard_state(s, state)
            style = STATE_STYLE.get(name, "")
            text = Text(name, style=style)
            first = s.first_missing(state.model_dump() if state and state.found else None)
            note = ""
            if disk and s.id in disk:
                text = Text(INCOMPLETE, style="bold red")
                first = disk[s.id][1]
                note = f"{disk[s.id][0]}/{s.size} on disk"
        if s.moved_to:
            note = (note + "; " if note else "") + f"rest moved to {', '.join(s.moved_to)}"
        if s.moved_from:
            note = (note + "; " if note else "") + f"moved from {s.moved_from}"
        table.add_row(Text(s.id), Text("+".join(s.hosts)), Text(f"[{s.start}, {s.stop})"), Text(s.run_id), text,
                      f"{max(0, first - s.start)}/{s.size}", str(first) if first < s.stop else "-", Text(note))
    return table
