"""``specops demo``: the main job on the built-in test host, step by step.

Each step prints its own table; the demo stops at the first step that fails and
exits with that step's code.
"""
from __future__ import annotations

from invoke import Exit

from specops.inventory import load_inventory
from specops.report import console, print_reports
from specops.result import overall_exit


def run_demo(inventory_path: str | None, selector: str | None) -> None:
    from specops.facts import facts

    inventory = load_inventory(inventory_path)
    steps = [("facts", lambda: facts(inventory, selector))]
    for name, step in steps:
        console.rule(f"[bold]{name}")
        reports = step()
        print_reports(reports)
        code = overall_exit(reports)
        if code:
            raise Exit(code=int(code))
