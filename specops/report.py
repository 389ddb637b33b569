"""How results look to a person (rich tables or log blocks, a recap) and to a program (``--json``).

A wide terminal gets one table per host. A pipe, a CI log or a narrow terminal gets
:class:`HostBlocks` instead: a table squeezed into 80 columns folds its summary to a
few characters per line (700 lines for one host). There each record is a line,
``status  check  summary``, and what goes on wraps under the check name::

    preflight on gpu-a ──────────────────────────────────────────────────
    host
      ok    python       python 3.12.3 at /opt/envs/vllm/bin/python
      fail  gpus         nvidia-smi is not on PATH and device is cuda, so no GPU
            can be listed or checked for free memory
            fix: install the NVIDIA driver (nvidia-smi) or set device: cpu for
                 this host
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from specops import wire
from specops.result import STATE, HostReport, Record, overall_exit

_C = wire.contract
#: how each record status is shown.
STYLE = {_C.OK: "green", _C.CHANGED: "yellow", _C.SKIPPED: "dim", _C.WARN: "magenta", _C.FAIL: "bold red"}
#: how a run state is shown where a table lists runs (a running state is plain).
STATE_STYLE = {STATE.DONE.value: "green", STATE.FAILED.value: "bold red", STATE.ABORTED.value: "yellow"}

#: Below this many columns for the summary (and for the fix), a table no longer reads
#: well: a 60-character path would fold onto three lines or more.
MIN_TABLE_TEXT = 40
#: The fewest columns the blocks give a summary's first line beside status and check
#: (else it starts on the next line), and its wrapped lines (else the indent shrinks).
MIN_BLOCK_TEXT = 24
GAP = "  "

#: Human output goes to stderr when --json owns stdout, so pipes get pure JSON.
console = Console(highlight=False, soft_wrap=False)
err_console = Console(stderr=True, highlight=False)


def check_name(rec: Record) -> str:
    """The record's name without its area (``host.gpus`` -> ``gpus``): the area is shown once per group."""
    return rec.name.split(".", 1)[-1]


def host_table(report: HostReport, title: str | None = None) -> Table:
    table = Table(title=Text(title or f"{report.task} on {report.host}"), title_justify="left",
                  show_lines=False, expand=False)
    table.add_column("area", style="cyan", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("summary", overflow="fold")
    with_fix = any(rec.fix for rec in report.records)
    if with_fix:
        table.add_column("fix", overflow="fold", style="yellow")
    area = None
    for rec in report.records:
        cells = [Text(rec.area if rec.area != area else ""), Text(check_name(rec)),
                 Text(rec.status, style=STYLE[rec.status]), Text(rec.summary)]
        table.add_row(*cells, *([Text(rec.fix or "")] if with_fix else []))
        area = rec.area
    return table


def _column_width(header: str, cells: Iterable[str]) -> int:
    """A table column's natural width in cells, its padding of one each side included."""
    return max([cell_len(header), *(cell_len(line) for cell in cells for line in cell.splitlines() or [""])]) + 2


def table_fits(report: HostReport, width: int) -> bool:
    """Whether :func:`host_table` at ``width`` columns leaves summary and fix readable.

    rich gives the fixed columns (area, check, status) their full width and shrinks the
    widest of summary and fix first; so the table reads well when, after the fixed
    columns and the borders, each of the two still gets :data:`MIN_TABLE_TEXT` columns
    or all it needs, whichever is less.
    """
    recs = report.records
    fixed = [_column_width("area", (r.area for r in recs)),
             _column_width("check", (check_name(r) for r in recs)),
             _column_width("status", (r.status for r in recs))]
    text = [_column_width("summary", (r.summary for r in recs))]
    if any(r.fix for r in recs):
        text.append(_column_width("fix", (r.fix or "" for r in recs)))
    borders = len(fixed) + len(text) + 1
    room = width - borders - sum(fixed)
    return room >= sum(min(need, MIN_TABLE_TEXT + 2) for need in text)


class HostBlocks:
    """One host's records for a log or a narrow terminal.

    An area heading, then one line per record, ``status  check  summary``, with the
    summaries of short names aligned; a summary that goes on wraps under the check name
    (a hanging indent that leaves the status column clear to scan), then a ``fix:``
    line at the same indent. Wraps at whatever width it is given: no line is longer than
    the console, and words stay whole; only a word longer than a line, such as a long
    path, is folded.
    """

    def __init__(self, report: HostReport, title: str | None = None) -> None:
        self.report = report
        self.title = title or f"{report.task} on {report.host}"

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        yield Rule(Text(self.title, style="bold"), align="left", style="dim")
        records = self.report.records
        if not records:
            return
        status_w = max(len(r.status) for r in records)
        hang = len(GAP) + status_w + len(GAP)
        if width - hang < MIN_BLOCK_TEXT:  # very narrow: give the text all but a small indent
            hang = 2 * len(GAP)
        # Summaries line up after the longest name that fits the cap; a longer name (a
        # drift id) starts its summary on the next line rather than push every other right.
        cap = max(10, width // 5)
        name_w = max((n for n in (cell_len(check_name(r)) for r in records) if n <= cap), default=cap)
        area = None
        for rec in records:
            if rec.area != area:
                yield Text(rec.area, style="cyan")
                area = rec.area
            yield from self._record_lines(console, rec, width, status_w, name_w, hang)

    @staticmethod
    def _record_lines(console: Console, rec: Record, width: int, status_w: int, name_w: int,
                      hang: int) -> Iterable[Text]:
        head = Text.assemble(GAP, (rec.status.ljust(status_w), STYLE[rec.status]), GAP)
        # a name wider than the console itself is folded, as a path is
        name, *name_rest = Text(check_name(rec)).wrap(console, max(width - head.cell_len, 1), overflow="fold")
        head.append_text(name)
        rest = Text(rec.summary)
        first_at = len(GAP) + status_w + len(GAP) + name_w + len(GAP)
        if rest and not name_rest and head.cell_len + len(GAP) <= first_at and width - first_at >= MIN_BLOCK_TEXT:
            first = rest.wrap(console, width - first_at, overflow="fold")[0]
            head.pad_right(first_at - head.cell_len)
            head.append_text(first)
            rest = _lstrip(rest[len(first.plain):])  # what the first line did not take
        head.rstrip()
        yield head
        pad = Text(" " * hang)
        for line in name_rest:
            yield pad + line
        if rest:
            for line in rest.wrap(console, width - hang, overflow="fold"):
                line.rstrip()
                yield pad + _lstrip(line)
        if rec.fix:
            label = "fix: "
            fix = Text(rec.fix, style="yellow").wrap(console, max(width - hang - len(label), 1), overflow="fold")
            for i, line in enumerate(fix):
                line.rstrip()
                yield pad + Text(label if i == 0 else " " * len(label), style="yellow") + _lstrip(line)


def _lstrip(text: Text) -> Text:
    """``text`` without leading blanks (a line that starts after a folded word keeps its space)."""
    return text[len(text.plain) - len(text.plain.lstrip()):]


def host_view(report: HostReport, out: Console) -> RenderableType:
    """The table on a terminal wide enough for it (exactly as before), blocks anywhere else.

    A pipe or a CI log always gets blocks, wrapped at ``out.width`` (rich takes it from
    ``COLUMNS``, else 80): a log is read top to bottom and grepped, not scanned by column.
    """
    if out.is_terminal and table_fits(report, out.width):
        return host_table(report)
    return HostBlocks(report)


def recap_line(report: HostReport) -> Text:
    style = "bold red" if report.failed else "green"
    return Text(report.recap(), style=style)


def print_reports(reports: list[HostReport], as_json: bool = False, stream=None,
                  out: Console | None = None) -> None:
    """Print every host's records (see :func:`host_view`) then a recap, on ``out`` (the
    stdout console by default); or one JSON document with the same records on ``stream``."""
    if as_json:
        doc = {
            "task": reports[0].task if reports else None,
            "exit_code": int(overall_exit(reports)),
            "hosts": [r.model_dump(mode="json") for r in reports],
        }
        (stream or sys.stdout).write(json.dumps(doc, indent=2) + "\n")
        return
    out = out or console
    for report in reports:
        if report.error is not None:
            out.print(Text(f"{report.task} on {report.host}: ", style="bold")
                      + Text(report.error, style="bold red"))
        elif report.records:
            out.print(host_view(report, out))
            for rec in report.records:  # like Ansible's --diff: show what changed or would change
                diff = rec.detail.get("diff") if isinstance(rec.detail, dict) else None
                if isinstance(diff, str) and diff.strip():
                    out.print(Text(f"--- diff of {rec.name}", style="bold"))
                    out.print(Syntax(diff, "diff", theme="ansi_dark", word_wrap=True))
    out.rule("RECAP", style="dim")
    for report in reports:
        out.print(recap_line(report))
