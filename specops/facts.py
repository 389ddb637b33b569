"""``specops facts``: prove the whole pipe and show what a host is.

render -> bundle -> upload once -> one python -> one JSON result -> table or ``--json``.
"""
from __future__ import annotations

from specops.inventory import Inventory
from specops.result import HostReport
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts


def inventory_params(host: Host) -> dict:
    """Inventory values a remote task may need, as data (never as shell or code)."""
    return host.spec.model_dump(mode="json", exclude={"key", "known_hosts", "host_key_policy",
                                                      "connect_timeout", "keepalive"})


def facts_step(host: Host, extra: dict | None = None) -> HostReport:
    payload = host.run_task("facts", {"inventory": inventory_params(host), **(extra or {})})
    report = report_from_payload(host.name, "facts", payload)
    report.data["bundle_bytes_sent"] = host.bundle_bytes_sent
    return report


def facts(inventory: Inventory, selector: str | None, accept_new_host_key: bool = False,
          extra: dict | None = None) -> list[HostReport]:
    return run_on_hosts(inventory, selector, "facts", lambda h: facts_step(h, extra),
                        accept_new_host_key=accept_new_host_key)
