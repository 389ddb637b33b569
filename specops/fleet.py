"""Run one step on many hosts at once; every host ends with a report, never a crash.

Like fabric's ``GroupResult``, a host that cannot be reached is a result
(``HostReport.error``), not an exception that hides the other hosts.
"""
from __future__ import annotations

import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from specops.errors import SpecopsError
from specops.exit_codes import ExitCode
from specops.host import Host
from specops.inventory import Inventory
from specops.result import HostReport, Record

#: at most this many hosts are worked on at once (fabric's ThreadingGroup has no cap).
MAX_PARALLEL = int(os.environ.get("SPECOPS_MAX_PARALLEL", "16"))


def report_from_payload(host: str, task: str, payload: dict) -> HostReport:
    return HostReport(host=host, task=task, records=[Record(**r) for r in payload.get("records", [])],
                      data=payload.get("data", {}))


def run_on_hosts(inventory: Inventory, selector: str | None, task: str,
                 step: Callable[[Host], HostReport], accept_new_host_key: bool = False) -> list[HostReport]:
    """Call ``step(host)`` for every selected host in parallel, in inventory order."""
    specs = inventory.select(selector)

    def one(spec) -> HostReport:
        host = Host(spec, inventory, accept_new_host_key=accept_new_host_key)
        try:
            return step(host)
        except SpecopsError as exc:
            return HostReport(host=spec.name, task=task, error=str(exc), error_code=int(exc.code))
        except Exception as exc:  # a bug of ours: keep the traceback, go on with other hosts
            return HostReport(host=spec.name, task=task, error_code=int(ExitCode.INTERNAL),
                              error=f"internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        finally:
            host.close()

    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(specs)))) as pool:
        return list(pool.map(one, specs))
