"""The connections of a group run, one per shard, and steps over every shard in parallel."""
from __future__ import annotations

from specops.result import HostReport
from specops.runs.shardmap import GroupMap, Shard
from specops.transport.host import Host
from specops.transport.parallel import run_steps, step_timeout
from specops.transport.pool import HostPool

#: seconds for the quick per-shard steps (start a job, look at it, abort it, read its logs):
#: ``step_timeout("quick")``, so ``SPECOPS_STEP_TIMEOUT`` means here what it means for every
#: step (read once, when the group run's code is imported). The plan takes preflight's
#: limit, and a fetch is bounded by its downloads' idle limit.
QUICK_TIMEOUT_S = step_timeout("quick")
#: seconds for listing (and, where no manifest has them, hashing) one shard's files on its host.
FILES_TIMEOUT_S = 3600.0


def per_shard(items: list[Shard], manifest: GroupMap, conns: HostPool, task: str, step,
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
