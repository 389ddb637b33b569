"""One training run over several hosts (``specops train --on <group>``): torchrun's nodes, from the laptop.

Every selected host runs one trainer node (``nproc`` processes: one per device it trains on) of one run
id, started through the same host task as a single-host run with its place in the run (``nodes``:
:data:`remote.train.plan.NODE_KEYS`); torchrun's static rendezvous meets at the first host's address
(its ``node_address``, else its IP ``address``) and ``--master-port``. The first host is the head: its
run dir holds the one curve (``metrics.jsonl``) and the checkpoints (speculators saves on rank 0);
the other hosts run headless trainer nodes.

* **preflight**: the train checks on every host (each trains on states it can read: a shared
  ``output_dir``, or a copy of the states run on each host), then the replica preflight of the nodes
  (``remote/extract/replica_probe.py`` judged by :func:`specops.replica.judge`: the head listens on
  the master port, every other host connects to it; versions and the model agree);
* **resume**: the trainer's ranks all read the last epoch checkpoint of their own save path, which
  only the head wrote: :func:`sync_checkpoint` copies the head's last whole epoch to the others first;
* **a lost host**: the first node whose run ends without being done (killed, unreachable, failed)
  is named, and every other node is aborted (a trainer waiting for a gone peer would hang).
"""
from __future__ import annotations

from specops.errors import UsageError
from specops.inventory import DEFAULT_MASTER_PORT, Inventory, ReplicaSpec
from specops.result import Record
from specops.transport.host import Host
from specops.wire import contract


def node_blocks(inventory: Inventory, hosts: list[str], master_port: int | None) -> dict[str, dict]:
    """``{host: nodes}``: each host's place in the run, the first host the head.

    :raises UsageError: a head without an IP address the others can reach.
    """
    head = inventory.hosts[hosts[0]]
    address = head.replica_address
    if address is None:
        raise UsageError(f"host {hosts[0]!r} heads the training run over {', '.join(hosts)}, but its address "
                         f"{head.address!r} is no IP address: the other hosts' trainers connect to it",
                         f"set node_address of host {hosts[0]!r} in {inventory.path} to its IP address "
                         f"the other hosts reach")
    port = int(master_port or DEFAULT_MASTER_PORT)
    return {name: {"hosts": list(hosts), "node_rank": i, "nnodes": len(hosts), "master_addr": address,
                   "master_port": port} for i, name in enumerate(hosts)}


def preflight(inventory: Inventory, hosts: list[str], host_of, master_port: int) -> list[Record]:
    """The rendezvous checks of the nodes: the replica preflight (:mod:`specops.replica`) of a replica made of
    them, its records named ``train.nodes.*``."""
    from specops import replica as replicas

    spec = ReplicaSpec(name="train", hosts=list(hosts), tp=len(hosts), master_port=int(master_port))
    view = inventory.model_copy(update={"replicas": {**inventory.replicas, spec.name: spec}})
    answers = replicas.probe_hosts(view, spec, host_of, {})
    records = replicas.judge(spec, answers)
    return [r.model_copy(update={"name": r.name.replace("replica.", "train.nodes."),
                                 "summary": r.summary.replace("replica train:", "training nodes:")})
            for r in records]


def _complete_epochs(host: Host, save_path: str) -> list[int]:
    from specops.runs import hostjob

    epochs = sorted((int(n) for n in hostjob.list_remote(host, save_path) if n.isdigit()), reverse=True)
    return [e for e in epochs if set(contract.CHECKPOINT_COMPLETE) <= set(hostjob.list_remote(host, f"{save_path}/{e}"))]


def save_path(host: Host, run_id: str) -> str:
    return host.remote_path(f"{host.spec.work_dir}/runs/{run_id}/checkpoints")


def sync_checkpoint(head: Host, worker: Host, run_id: str) -> Record | None:
    """Copy the head's last whole epoch checkpoint into ``worker``'s save path when it lacks it (speculators'
    ranks each read it there on resume: the optimizer state, the epoch and step); None when there is nothing
    to copy. The files pass through the laptop (SFTP): a big draft's hosts should share the work_dir instead."""
    from specops.runs import hostjob

    source = save_path(head, run_id)
    done = _complete_epochs(head, source)
    if not done:
        return None
    epoch, dest = done[0], save_path(worker, run_id)
    if epoch in _complete_epochs(worker, dest) or source == dest and head.spec.address == worker.spec.address \
            and head.spec.port == worker.spec.port:
        return None
    names = hostjob.list_remote(head, f"{source}/{epoch}")
    total = 0
    for name in names:
        data = hostjob.read_remote(head, f"{source}/{epoch}/{name}")
        if data is None:  # a dir (speculators keeps none in an epoch dir) or gone meanwhile
            continue
        worker.put_bytes(data, f"{dest}/{epoch}/{name}")
        total += len(data)
    return Record(name="train.resume", status="changed",
                  summary=f"{worker.name}: the head's epoch {epoch} checkpoint copied into its save path "
                          f"({total / 2**20:.1f} MiB) for the resume",
                  detail={"epoch": epoch, "from": f"{head.name}:{source}/{epoch}", "to": f"{dest}/{epoch}"})


def abort_nodes(hosts: list[Host], run_id: str) -> None:
    """Abort the run on every one of ``hosts`` (a node that does not answer is left: its trainer ends when its
    peers are gone)."""
    from specops.runs import hostjob

    for host in hosts:
        try:
            hostjob.job_call(host, "abort", run_id, timeout=60)
        except Exception:  # noqa: BLE001 -- best effort: the run already failed, and says why
            pass


#: errors of a node that itself went away (killed, its supervisor gone), not of one whose peer did
GONE = ("SupervisorDied", "KilledBySignal", "ProcessDied", "FatalError")


def lost_node(order: list[str], results: dict) -> str | None:
    """The node that ended the run, else None when every node is done: a node the laptop lost (unreachable) or
    that went away (:data:`GONE`) before one whose trainer failed because its peer went (a gloo or NCCL error),
    a node that failed before one aborted after it (the laptop stops the others), then the order they ended."""
    def rank(name: str) -> int:
        result = results[name]
        if isinstance(result, Exception):
            return 0
        error = getattr(result, "error", None)
        if error is not None and error.type in GONE:
            return 0
        return 2 if result.state == contract.RunState.ABORTED.value else 1

    lost = [n for n in order if getattr(results[n], "state", None) != contract.RunState.DONE.value]
    return min(lost, key=lambda n: (rank(n), order.index(n))) if lost else None
