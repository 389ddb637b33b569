"""The connections of a group run, one per shard, and steps over every shard in parallel."""
from __future__ import annotations

import threading

from specops.errors import UsageError
from specops.transport.host import Host
from specops.inventory import Inventory
from specops.transport.parallel import run_steps, step_timeout
from specops.result import HostReport
from specops.runs.shardmap import GroupMap, Shard

#: seconds for the quick per-shard steps (start a job, look at it, abort it, read its logs):
#: ``step_timeout("quick")``, so ``SPECOPS_STEP_TIMEOUT`` means here what it means for every
#: step (read once, when the group run's code is imported). The plan takes preflight's
#: limit, and a fetch is bounded by its downloads' idle limit.
QUICK_TIMEOUT_S = step_timeout("quick")
#: seconds for listing (and, where no manifest has them, hashing) one shard's files on its host.
FILES_TIMEOUT_S = 3600.0


class Connections:
    """One :class:`Host` per host for the plan, and one per shard after that.

    A host that holds two shards of a group gets a connection per shard, so their
    steps and follows never share an SFTP session; the first shard of a host reuses
    the connection the plan opened.
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

    def for_shard(self, manifest: GroupMap, shard: Shard) -> Host:
        slot = [s.id for s in manifest.shards_on(shard.head)].index(shard.id)
        return self.host(shard.head, slot)

    def close(self) -> None:
        for host in self._by_key.values():
            host.close()


def per_shard(items: list[Shard], manifest: GroupMap, conns: Connections, task: str, step,
               timeout: float | None) -> list[HostReport]:
    """``step(shard, host)`` for every shard in parallel, each bounded by ``timeout``."""
    return run_steps(items, lambda s: step(s, conns.for_shard(manifest, s)), name_of=lambda s: s.label, task=task,
                     timeout=timeout, on_timeout=lambda s: conns.for_shard(manifest, s).close())


def shard_files(host: Host, shard: Shard, *, sha256: bool, timeout: float) -> dict:
    """What ``shard``'s range holds on its head's disk (``remote/extract/shard.py files``): the truth a
    resume, a cut and a fetch go by, whatever a status file says."""
    payload = host.run_task("shard", {"action": "files", "output_dir": shard.output_dir, "start": shard.start,
                                      "stop": shard.stop, "sha256": sha256}, timeout=timeout)
    return payload.get("data") or {}
