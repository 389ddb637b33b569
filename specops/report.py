"""How results look to a person (rich tables, a recap) and to a program (``--json``)."""
from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from specops.result import HostReport, overall_exit

STYLE = {"ok": "green", "changed": "yellow", "skipped": "dim", "warn": "magenta", "fail": "bold red"}

#: Human output goes to stderr when --json owns stdout, so pipes get pure JSON.
console = Console(highlight=False, soft_wrap=False)
err_console = Console(stderr=True, highlight=False)


def host_table(report: HostReport, title: str | None = None) -> Table:
    table = Table(title=title or f"{report.task} on {report.host}", title_justify="left",
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
        cells = [rec.area if rec.area != area else "", rec.name.split(".", 1)[-1],
                 Text(rec.status, style=STYLE[rec.status]), rec.summary]
        table.add_row(*cells, *([rec.fix or ""] if with_fix else []))
        area = rec.area
    return table


def recap_line(report: HostReport) -> Text:
    style = "bold red" if report.failed else "green"
    return Text(report.recap(), style=style)


def print_reports(reports: list[HostReport], as_json: bool = False, stream=None) -> None:
    """Print every host's table then a recap; or one JSON document with the same records."""
    if as_json:
        doc = {
            "task": reports[0].task if reports else None,
            "exit_code": int(overall_exit(reports)),
            "hosts": [r.model_dump(mode="json") for r in reports],
        }
        (stream or sys.stdout).write(json.dumps(doc, indent=2) + "\n")
        return
    for report in reports:
        if report.error is not None:
            console.print(Text(f"{report.task} on {report.host}: ", style="bold")
                          + Text(report.error, style="bold red"))
        elif report.records:
            console.print(host_table(report))
            for rec in report.records:  # like Ansible's --diff: show what changed or would change
                diff = rec.detail.get("diff") if isinstance(rec.detail, dict) else None
                if isinstance(diff, str) and diff.strip():
                    console.print(Text(f"--- diff of {rec.name}", style="bold"))
                    console.print(Syntax(diff, "diff", theme="ansi_dark", word_wrap=True))
    console.rule("RECAP", style="dim")
    for report in reports:
        console.print(recap_line(report))
