"""A replica over several hosts, from the laptop: each host's place in it, as its run sees it.

The inventory names the replica (``replicas: {big: [a, b]}``, head first; see
:class:`specops.inventory.ReplicaSpec`); a group run makes it one shard (``Shard.hosts``);
this module gives each host's run its ``replica`` parameter (read on the host by
:mod:`remote.replica` and the vllm-server engine), so the head starts the API server with
ranks ``0..k-1`` and every next host ``--headless`` ranks, all under the shard's run id.
"""
from __future__ import annotations

from specops.errors import UsageError
from specops.inventory import Inventory, ReplicaSpec


def node_block(inventory: Inventory, replica: ReplicaSpec, host: str) -> dict:
    """``params["replica"]`` for ``host`` of ``replica`` (see :mod:`remote.replica`)."""
    head = inventory.hosts[replica.head]
    return {"name": replica.name, "hosts": list(replica.hosts), "node_rank": replica.hosts.index(host),
            "nnodes": len(replica.hosts), "ranks_per_node": replica.ranks_per_host, "tp": replica.tp,
            "master_addr": head.replica_address, "master_port": replica.master_port,
            "watch_port": replica.watch_port, "node_address": inventory.hosts[host].replica_address}


def replica_overrides(inventory: Inventory, host: str, overrides: dict) -> dict:
    """The run flags of ``host``'s run: a replica's host runs at the replica's TP (all its ranks).

    :raises UsageError: ``--tp`` that is not the replica's.
    """
    replica = inventory.replica_of(host)
    if replica is None:
        return overrides
    given = overrides.get("tp")
    if given not in (None, "") and str(given) != str(replica.tp):
        raise UsageError(f"--tp {given} for replica {replica.name!r}, whose tp is {replica.tp} (its ranks over "
                         f"{len(replica.hosts)} hosts)", f"drop --tp, or set tp of replica {replica.name!r} in "
                                                         f"{inventory.path}")
    return {**overrides, "tp": replica.tp}


def node_params(inventory: Inventory, host: str) -> dict:
    """What a run on ``host`` adds to its parameters: its place in its replica (nothing for a host
    that holds a whole replica)."""
    replica = inventory.replica_of(host)
    if replica is None:
        return {}
    return {"tp": replica.tp, "replica": node_block(inventory, replica, host)}
