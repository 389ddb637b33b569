"""``specops demo``: the main job on the built-in test host, step by step.

1. ``facts``      -- the pipe works (render, bundle, upload once, one JSON result);
2. ``preflight``  -- on the freshly built env it shows the speculators/vLLM drift;
3. ``patch``      -- applies the matching patch set (idempotent: ok when already applied);
4. ``extract``    -- preflight again (now clean), smoke on a tiny twin, then the TP extraction, followed to
                     the end, with manifest and per-layer summary fetched into ``runs/``.

The demo stops at the first step that fails (other than the expected drift in step 2)
and exits with that step's code.
"""
from __future__ import annotations

from invoke import Exit

from specops.exit_codes import ExitCode
from specops.inventory import load_inventory
from specops.report import console, print_reports
from specops.result import overall_exit


def run_demo(inventory_path: str | None, selector: str | None) -> None:
    from specops.extract import extract
    from specops.facts import facts
    from specops.patch import patch
    from specops.preflight import preflight

    inventory = load_inventory(inventory_path)

    def step(title, reports, tolerate_drift=False):
        console.rule(f"[bold]{title}")
        print_reports(reports)
        failing = [r for rep in reports for r in rep.records if r.status == "fail"
                   and not (tolerate_drift and r.area == "drift")]
        code = overall_exit(reports)
        if code and (failing or any(rep.error for rep in reports)):
            raise Exit(code=int(code))

    step("1. facts", facts(inventory, selector))
    step("2. preflight (before patching: drift findings expected)", preflight(inventory, selector),
         tolerate_drift=True)
    step("3. patch", patch(inventory, selector, "apply"))
    console.rule("[bold]4. extract (preflight, smoke, start detached, follow, fetch)")
    code = extract(inventory, selector, {}, run_id=None, detach=False, force=False,
                   skip_preflight=False, skip_smoke=False, as_json=False)
    if code != ExitCode.SUCCESS:
        raise Exit(code=int(code))
