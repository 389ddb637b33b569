"""A host behind Slurm, from the laptop: its login node's facts first, then the host checks under ``srun``.

The inventory's ``scheduler: slurm`` makes ``address`` a login node and ``slurm:`` say how
jobs are asked for (``remote/wire/argspec.py`` ``SLURM_ARGS``). Preflight there is two steps:

1. ``slurm.partition`` on the login node (``remote/run/slurm.py``): ``sinfo`` on the partition
   against the request -- a partition that does not exist, a time limit above its MaxTime,
   more nodes or GPUs than it has fail here, before anything is submitted;
2. the usual host task (``remote/probes/preflight.py``) on a compute node: the same command
   line, run under ``srun -p PARTITION -N1 -n1 ... --`` (``host.node`` names the node).

A run's start (``job start``, and ``train``'s start, which ends in it) gets the mapping and submits
the supervisor with ``sbatch`` (:func:`job_params`); status, follow and abort read Slurm's state on
the host. A mapping with ``array: N`` makes an extraction a group plan of N shards, one job array whose
task i extracts shard i into the run's one output dir (``remote/run/job.py`` ``_start_array``). A mapping with
``nodes: N`` (N > 1) makes an extraction one vLLM replica over the job's N nodes (``tp`` its whole TP), built on the
batch host from the job's own node list (``remote/extract/replica.py`` ``JobStep``); preflight checks a node's share
of its ranks, and :func:`refuse_job_replica` refuses what cannot run so.
``verify`` and ``eval`` run on a compute node under ``srun`` as preflight does (:func:`launcher`),
reading the run dir on the shared filesystem.
"""
from __future__ import annotations

import math

from specops import wire
from specops.inventory import HostSpec

#: srun gives up when the partition cannot start the preflight step within this long (seconds).
SRUN_IMMEDIATE_S = 120
#: the preflight step's own time limit (minutes), below the partition's MaxTime.
PREFLIGHT_MINUTES = 10


def is_slurm(spec: HostSpec) -> bool:
    return spec.scheduler == "slurm" and spec.slurm is not None


def job_params(spec: HostSpec) -> dict:
    """What a run's start on this host adds to the job task's parameters (nothing on a plain SSH host)."""
    return {"slurm": spec.slurm.model_dump(exclude_none=True)} if is_slurm(spec) else {}


def srun_launcher(spec: HostSpec, job_name: str, max_minutes: float | None = None, *,
                  limit: float | None = PREFLIGHT_MINUTES) -> list[str]:
    """The words a host task runs under on a compute node: the host's ``env`` exported (a login node's
    ``SLURM_CONF`` among them), ``srun`` as the slurm mapping asks for one node, and its ``setup`` line.

    The step's time limit is the least of ``limit``, ``max_minutes`` (the partition's MaxTime) and the
    mapping's ``time_limit``; none of them given: the partition's default time.
    """
    slurm = spec.slurm.model_dump(exclude_none=True)
    limits = [limit, max_minutes]
    if slurm.get("time_limit") is not None:
        limits.append(wire.slurm.time_limit_minutes(str(slurm["time_limit"])))
    limits = [m for m in limits if m is not None]
    words = ["env", *(f"{k}={v}" for k, v in spec.env.items())] if spec.env else []
    words += ["srun", *wire.slurm.request_options(slurm, time_limit=False),
              *(["-t", str(max(1, math.floor(min(limits))))] if limits else []), "-N", "1",
              "-n", "1", "-J", job_name, f"--immediate={SRUN_IMMEDIATE_S}", "--"]
    return words + wire.slurm.setup_words(slurm.get("setup"))


def launcher(spec: HostSpec, task: str) -> list[str] | None:
    """Where a host task that reads a run's files (``verify``, ``eval``) runs: on a compute node through ``srun``
    on a host behind Slurm, under the mapping's ``time_limit`` (else the partition's default); None elsewhere."""
    return srun_launcher(spec, f"specops-{task}", limit=None) if is_slurm(spec) else None


def preflight_payload(host, params: dict) -> dict:
    """The login node's partition check, then (when it passes) the preflight host task under srun."""
    spec = host.spec
    checked = host.run_task("slurm", {"action": "partition", "slurm": spec.slurm.model_dump(exclude_none=True),
                                      "env": spec.env, "tp": params.get("tp"), "device": params.get("device")})
    records = checked["records"]
    problem = job_replica_problem(spec, int(params.get("tp") or 1), params.get("engine"),
                                  (params.get("replica") or {}).get("name"))
    if problem:  # what extract refuses (refuse_job_replica), named here too
        records.append(wire.protocol.record("slurm.replica", "fail", problem[0], fix=problem[1]))
    if any(r["status"] == "fail" for r in records):
        records.append(wire.protocol.record("host.node", "skipped", "host checks not run: nothing is submitted "
                                            "while the request does not fit the partition or its nodes"))
        return wire.protocol.payload(records, **checked.get("data", {}))
    max_minutes = next((r["detail"].get("max_time_min") for r in records if r["name"] == "slurm.partition"), None)
    nodes, tp = int(spec.slurm.nodes or 1), int(params.get("tp") or 1)
    if nodes > 1 and not params.get("replica"):
        # an extraction is one replica over the job's nodes: the node checked holds one node's share of its ranks
        params = {**params, "replica": {"name": f"{nodes} Slurm nodes", "nnodes": nodes, "node_rank": 0,
                                        "ranks_per_node": tp // nodes, "tp": tp}}
    payload = host.run_task("preflight", params,
                            launcher=srun_launcher(spec, "specops-preflight", max_minutes))
    payload["records"] = records + payload["records"]
    return payload


def refuse_train(spec: HostSpec, hosts: int = 1) -> None:
    """``train`` on a host behind Slurm is one batch job: on one node, or over the mapping's ``slurm.nodes`` as one
    job step of torchrun a node (:func:`remote.run.slurm.node_step`). Several hosts selected, or a job array, are
    refused by name before anything reaches the login node.

    :raises UsageError: naming the field (``slurm.array``) or the selection, with the fix.
    """
    if not is_slurm(spec):
        return
    from specops.errors import UsageError

    if hosts > 1:
        raise UsageError(f"host {spec.name!r} is behind Slurm (scheduler: slurm): training over several hosts is "
                         f"torchrun's across SSH hosts, and a Slurm host cannot be one of them",
                         f"train on it alone (--on {spec.name}), with slurm.nodes set to the nodes the job should "
                         f"span", host=spec.name)
    if int(spec.slurm.array or 1) > 1:
        raise UsageError(f"host {spec.name!r}: field 'slurm.array' is {spec.slurm.array}: a job array shards an "
                         f"extraction, and a train run is one job", "train through an inventory entry of its own "
                         "for this cluster without slurm.array (slurm.nodes spans several nodes)", host=spec.name)


def refuse_array_in_group(specs: list[HostSpec], group: bool) -> None:
    """A host with ``slurm.array`` is a group plan by itself (its shards are its job array's tasks): one shard of a
    group over several hosts (or a run given ``--shard-by``/``--allow-partial``/``--reassign``) it cannot be.

    :raises UsageError: naming the host and the field, before any host is reached.
    """
    from specops.errors import UsageError

    arrays = [s.name for s in specs if is_slurm(s) and int(s.slurm.array or 1) > 1]
    if arrays and group:
        raise UsageError(f"host(s) {', '.join(arrays)}: field 'slurm.array' makes a run on that cluster a group plan "
                         f"of its own (a job array), and it cannot be one shard of a group over several hosts",
                         f"extract on it alone (--on {arrays[0]}), or drop slurm.array to give it one shard of the "
                         f"group as one job", host=arrays[0])


def job_replica_problem(spec: HostSpec, tp: int, engine: str | None, replica: str | None = None) -> tuple | None:
    """What keeps an extraction on ``spec`` from running as one vLLM replica over its job's nodes, as ``(message,
    fix)``; None when nothing does (or ``slurm.nodes`` is 1 and no SSH replica group names it).

    A host whose ``slurm.nodes`` is above 1 extracts as one replica over the job's nodes
    (:class:`remote.extract.replica.JobStep`: the batch host the head, the other nodes a job step of headless ranks;
    the host's ``tp`` is the replica's whole TP, ``tp / slurm.nodes`` ranks a node). It cannot with a job array (its
    tasks are one node each), as a host of an SSH replica group ``replica`` (Slurm's nodes are the replica's hosts),
    with a tp the nodes do not divide, or with another engine.
    """
    if replica is not None:
        return (f"host {spec.name!r} is behind Slurm (scheduler: slurm) and one host of replica {replica!r} over SSH "
                f"hosts: a replica on a Slurm cluster spans the nodes of one job, which Slurm picks",
                f"drop {spec.name} from replicas.{replica}, and set slurm.nodes on it to the nodes the replica should "
                f"span")
    nodes = int(spec.slurm.nodes or 1)
    if nodes < 2:
        return None
    if int(spec.slurm.array or 1) > 1:
        return (f"host {spec.name!r}: field 'slurm.nodes' is {nodes} and field 'slurm.array' is {spec.slurm.array}: an "
                f"extraction over several nodes is one replica in one job, and a job array's task extracts its shard "
                f"on one node", f"drop slurm.array (one job, one replica over {nodes} nodes), or set slurm.nodes: 1 "
                f"(a job array of one-node tasks)")
    if int(tp) % nodes:
        return (f"host {spec.name!r}: tp {tp} over field 'slurm.nodes' {nodes}: tp is the replica's whole TP (ranks a "
                f"node x slurm.nodes), and {nodes} nodes do not divide it",
                f"set tp to a multiple of {nodes} (e.g. {nodes} x the GPUs of a node), or slurm.nodes to a divisor of "
                f"{tp}")
    engine = wire.contract.ENGINE_ALIASES.get(engine or "", engine or wire.contract.AUTO_ENGINE)
    if engine not in (wire.contract.AUTO_ENGINE, wire.contract.VLLM_SERVER):
        return (f"host {spec.name!r}: engine {engine} with field 'slurm.nodes' {nodes}: one replica over several nodes "
                f"is vLLM's multi-node runtime, the vllm-server engine",
                "set engine: vllm-server (vLLM >= 0.18 with speculators >= 0.5 on the nodes), or slurm.nodes: 1")
    return None


def refuse_job_replica(inventory, specs: list[HostSpec], overrides: dict) -> None:
    """An extraction on a host behind Slurm that cannot run as :func:`job_replica_problem` asks is refused by name
    before anything reaches the login node.

    :raises UsageError: naming the host and the field, with the fix.
    """
    from specops.errors import UsageError
    from specops.params import run_params

    for spec in specs:
        if not is_slurm(spec):
            continue
        params = run_params(spec, **{k: v for k, v in overrides.items() if v is not None})
        group = inventory.replica_of(spec.name) if inventory is not None else None
        problem = job_replica_problem(spec, int(params.get("tp") or 1), params.get("engine"),
                                      group.name if group is not None else None)
        if problem:
            raise UsageError(*problem, host=spec.name)
