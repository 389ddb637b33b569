"""``specops preflight``: every failure that would waste a model load, in seconds.

One remote process per host runs every check (``remote/preflight.py``); hosts run in
parallel. Nothing loads weights: configs, safetensors headers and package sources are
read as files.
"""
from __future__ import annotations

from specops.parallel import report_from_payload, run_on_hosts
from specops.host import Host
from specops.inventory import Inventory
from specops.params import run_params
from specops.result import HostReport


def preflight_params(host: Host, overrides: dict, *, skip_autoconfig: bool = False,
                     autoconfig_timeout: int = 60, shard_probe: dict | None = None) -> dict:
    """:param shard_probe: a group run's plan: the shard probe runs in the same host python."""
    params = run_params(host.spec, **overrides)
    params.update(skip_autoconfig=skip_autoconfig, autoconfig_timeout=autoconfig_timeout)
    if shard_probe is not None:
        params["shard_probe"] = shard_probe
    return params


def preflight_step(host: Host, overrides: dict, **options) -> HostReport:
    payload = host.run_task("preflight", preflight_params(host, overrides, **options))
    return report_from_payload(host.name, "preflight", payload)


def preflight(inventory: Inventory, selector: str | None, overrides: dict | None = None,
              accept_new_host_key: bool = False, **options) -> list[HostReport]:
    """Run every preflight check on the selected hosts; one report per host."""
    return run_on_hosts(inventory, selector, "preflight",
                        lambda h: preflight_step(h, overrides or {}, **options),
                        accept_new_host_key=accept_new_host_key)
