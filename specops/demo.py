"""``specops demo``: the main job on the built-in test host, step by step.

1. ``facts``      -- the pipe works (render, bundle, upload once, one JSON result);
2. ``preflight``  -- on the freshly built env it shows the speculators/vLLM drift;
3. ``patch``      -- applies the matching patch set (idempotent: ok when already applied);
4. ``extract``    -- preflight again (now clean), smoke on a tiny twin, then the TP extraction, followed to
                     the end, with manifest and per-layer summary fetched into ``runs/``;
5. ``train``      -- where the run's states are speculators' own format (the vllm-server engine: the modern
                     stack), an EAGLE-3 draft trained on them, followed, its curve fetched;
6. ``eval``       -- that draft served by vLLM as eagle3 on held-out rows: its acceptance.

The demo stops at the first step that fails (other than the expected drift in step 2)
and exits with that step's code.
"""
from __future__ import annotations

import time

from invoke import Exit

from specops import wire
from specops.exit_codes import ExitCode
from specops.inventory import load_inventory
from specops.report import console, print_reports
from specops.result import overall_exit
from specops.runs.hostjob import local_runs_root

VLLM_SERVER = wire.contract.VLLM_SERVER


def run_demo(inventory_path: str | None, selector: str | None) -> None:
    from specops.facts import facts
    from specops.patch import patch
    from specops.preflight import preflight
    from specops.runs.run import extract

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
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    code = extract(inventory, selector, {}, run_id=run_id, detach=False, force=False,
                   skip_preflight=False, skip_smoke=False, as_json=False)
    if code != ExitCode.SUCCESS:
        raise Exit(code=int(code))
    # speculators' trainer reads the vllm-server engine's files (hs_{i}.safetensors + the token dataset);
    # the seed engine's data_{i}.pt are speculators 0.3's, which has no trainer
    trainable = [h.name for h in inventory.select(selector) if _engine_of(h.name, run_id) == VLLM_SERVER]
    if not trainable:
        return
    from specops.draft_eval import evaluate
    from specops.train import train

    on = ",".join(trainable)
    console.rule(f"[bold]5. train (a draft on run {run_id}'s states, followed, curve fetched)")
    code = train(inventory, on, run_id=f"{run_id}-draft", from_run=run_id, epochs=DEMO_EPOCHS)
    if code != ExitCode.SUCCESS:
        raise Exit(code=int(code))
    step("6. eval (the draft served as eagle3 on held-out rows)", evaluate(inventory, on, draft=f"{run_id}-draft"))


#: enough for the tiny Llama's draft to be accepted now and then (a minute on two cores)
DEMO_EPOCHS = 10


def _engine_of(host: str, run_id: str) -> str | None:
    """The engine that wrote ``run_id`` on ``host``, from its fetched manifest."""
    doc = wire.fsutil.read_json_quietly(local_runs_root() / host / run_id / "manifest.json")
    return (doc.get("engine") or {}).get("name") if isinstance(doc, dict) else None
