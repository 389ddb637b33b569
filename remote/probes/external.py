"""Checks other modules own, composed into preflight: API drift and patch status.

``remote.drift.check(params)`` and ``remote.patcher.status_records(params)`` each return
a list of records. A bundle without the module gives one ``skipped`` record saying so;
a module that crashes gives one ``fail`` record with the traceback, never a crash of
the whole preflight.
"""
from __future__ import annotations

import importlib
import inspect
import os
import traceback

from remote.protocol import FAIL, SKIPPED, STATUSES, record
from remote.probes import Context

#: area -> (module under remote/, function, params flag that skips it)
EXTERNAL = {
    "drift": ("drift", "check", "skip_drift"),
    "patch": ("patcher", "status_records", "skip_patch"),
}


def run(ctx: Context, area: str) -> list:
    module_name, func_name, skip_flag = EXTERNAL[area]
    qualified = f"remote.{module_name}"
    if ctx.params.get(skip_flag):
        return [record(f"{area}.check", SKIPPED, f"skipped by {skip_flag}", detail={})]
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name == qualified:
            return [record(f"{area}.check", SKIPPED, f"remote/{module_name}.py is not in this bundle",
                           detail={"module": qualified})]
        return [_crash(area, qualified, "import")]
    except Exception:
        return [_crash(area, qualified, "import")]
    try:
        func = getattr(module, func_name)
        found = func(*_arguments(func, ctx.params))
    except Exception:
        return [_crash(area, f"{qualified}.{func_name}", "call")]
    bad = [r for r in (found or []) if not (isinstance(r, dict) and r.get("status") in STATUSES and r.get("name"))]
    if not isinstance(found, list) or bad:
        return [record(f"{area}.crash", FAIL, f"{qualified}.{func_name} returned something that is not a list of "
                       f"records", detail={"returned": repr(found)[:2000]},
                       fix=f"fix {qualified}.{func_name} to return protocol.record(...) items")]
    return found


def patches_root(params: dict) -> str:
    """Where the patch sets are: params, else ``<bundle>/patches``, else the repo's ``patches/``."""
    if params.get("patches_root"):
        return params["patches_root"]
    if params.get("_bundle_dir"):
        return os.path.join(params["_bundle_dir"], "patches")
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "patches")


def _arguments(func, params: dict) -> tuple:
    """``(params,)`` for ``f(params)``; ``(patches_root, site_packages)`` for the patcher's older form."""
    try:
        first = next(iter(inspect.signature(func).parameters), "params")
    except (TypeError, ValueError):
        first = "params"
    if first == "patches_root":
        return patches_root(params), params.get("site_packages")
    return (params,)


def _crash(area, what, phase):
    tb = traceback.format_exc()
    last = tb.strip().splitlines()[-1]
    return record(f"{area}.crash", FAIL, f"{what} failed on {phase}: {last}", detail={"traceback": tb},
                  fix=f"read detail.traceback; {what} is a specops bug or does not fit this host's packages")
