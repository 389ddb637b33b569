"""The hosts of one command: one pool, built in one place (Fabric's ``Group`` is the model)."""
from __future__ import annotations

import threading

from specops.errors import UsageError
from specops.inventory import Inventory
from specops.transport.host import Host


class HostPool:
    """The hosts of one command, as Fabric's ``Group`` holds them: one :class:`Host` per host and slot,
    opened lazily, closed together; every command builds its host set here.

    A host that holds two shards of a group run gets a connection per shard (a slot each), so
    their steps and follows never share an SFTP session; the first shard of a host reuses the
    connection the plan opened.
    """

    def __init__(self, inventory: Inventory, accept_new_host_key: bool):
        self.inventory, self.accept_new = inventory, accept_new_host_key
        self._by_key: dict[tuple[str, int], Host] = {}
        self._lock = threading.Lock()  # steps of several shards ask at once

    def spec(self, name: str):
        if name not in self.inventory.hosts:
            raise UsageError(f"host {name!r} of this run is not in {self.inventory.path}",
                             f"add {name!r} back to the inventory (or pass the inventory the run was started with)")
        return self.inventory.hosts[name]

    def host(self, name: str, slot: int = 0) -> Host:
        key = (name, slot)
        with self._lock:
            if key not in self._by_key:
                self._by_key[key] = Host(self.spec(name), self.inventory, self.accept_new)
            return self._by_key[key]

    def selected(self, selector: str | None) -> list[Host]:
        """The hosts ``--on`` names (hosts or groups of the inventory), in inventory order."""
        return [self.host(spec.name) for spec in self.inventory.select(selector)]

    def for_shard(self, manifest, shard) -> Host:
        """The connection of a group run's ``shard`` (a :class:`specops.runs.shardmap.Shard` of ``manifest``)."""
        slot = [s.id for s in manifest.shards_on(shard.head)].index(shard.id)
        return self.host(shard.head, slot)

    def close(self) -> None:
        for host in self._by_key.values():
            host.close()
