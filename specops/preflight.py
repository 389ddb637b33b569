"""``specops preflight``: every failure that would waste a model load, in seconds.

One remote process per host runs every check (``remote/probes/preflight.py``); hosts run in
parallel. Nothing loads weights: configs, safetensors headers and package sources are
read as files.
"""
from __future__ import annotations

from specops.inventory import Inventory
from specops.params import run_params
from specops.result import HostReport
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts
from specops.transport.pool import HostPool


def preflight_params(host: Host, overrides: dict, *, skip_autoconfig: bool = False,
                     autoconfig_timeout: int = 60, shard_probe: dict | None = None) -> dict:
    """:param shard_probe: a group run's plan: the shard probe runs in the same host python."""
    from specops.replica import node_params, replica_overrides

    inventory = getattr(host, "inventory", None)
    if inventory is not None and inventory.replica_of(host.spec.name) is not None:
        # a host of a replica over several hosts: the replica's TP, and its own share of the ranks
        overrides = replica_overrides(inventory, host.spec.name, overrides)
    params = run_params(host.spec, **overrides)
    if inventory is not None:
        params.update(node_params(inventory, host.spec.name))
    params.update(skip_autoconfig=skip_autoconfig, autoconfig_timeout=autoconfig_timeout)
    if shard_probe is not None:
        params["shard_probe"] = shard_probe
    return params


def preflight_step(host: Host, overrides: dict, **options) -> HostReport:
    from specops import slurm

    params = preflight_params(host, overrides, **options)
    if slurm.is_slurm(host.spec):  # the login node's facts, then the host checks on a compute node (srun)
        return report_from_payload(host.name, "preflight", slurm.preflight_payload(host, params))
    payload = host.run_task("preflight", params)
    return report_from_payload(host.name, "preflight", payload)


def preflight(inventory: Inventory, selector: str | None, overrides: dict | None = None,
              accept_new_host_key: bool = False, **options) -> list[HostReport]:
    """Run every preflight check on the selected hosts; one report per host, and one per replica
    over several hosts whose every host is selected (:func:`specops.replica.preflight_replicas`)."""
    reports = run_on_hosts(inventory, selector, "preflight",
                           lambda h: preflight_step(h, overrides or {}, **options),
                           accept_new_host_key=accept_new_host_key)
    names = [s.name for s in inventory.select(selector)]
    whole = [r for r in inventory.replicas.values() if all(h in names for h in r.hosts)]
    if whole:
        from specops.replica import preflight_replicas

        pool = HostPool(inventory, accept_new_host_key)
        try:
            checked = preflight_replicas(inventory, [r.head for r in whole], pool.host, overrides or {})
        finally:
            pool.close()
        reports.extend(HostReport(host=f"replica {r.name}", task="preflight", records=checked[r.head])
                       for r in whole)
    return reports
