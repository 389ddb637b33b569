"""Runs on a host behind Slurm (stdlib only): the partition's facts, sbatch, the job's state, scancel.

The host the laptop reaches is the cluster's login node; its ``slurm`` mapping (the
inventory's, :data:`remote.wire.argspec.SLURM_ARGS`) says how jobs are asked for. A run is
submitted as one batch job whose script runs the run's supervisor on a compute node, in the
same run dir (a shared filesystem), and ``slurm.json`` beside ``status.json`` names the job::

    {"job_id": "42", "partition": "gpu", "submitted_unix": 1760000000.0, "env": {"SLURM_CONF": "..."},
     "setup": "module load cuda"}

Liveness of such a run is Slurm's word (:func:`job_state`: ``scontrol show job``, then ``sacct``),
not a pid: the login node cannot see a compute node's processes. A job Slurm starts again (requeued
after a node failure or a preemption) restarts the run from its batch script (:func:`requeued`).
A job over several nodes runs the rest of the run on the other nodes as one job step (:func:`node_step`):
a train run's torchrun a node, an extraction's replica workers (:func:`job_replica_block`).

The task (``main``) answers ``action: partition``: ``sinfo`` on the partition against what
the run asks (time limit, nodes, GPUs per node), before anything is submitted.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from remote.wire import fsutil, protocol, slurm as wire_slurm
from remote.wire.argspec import RUN_ARGS, SLURM_ARGS, Arg, Spec

#: beside status.json: the Slurm job that runs this run (absent: a run started by ``job start`` over SSH).
JOB_FILE = "slurm.json"
#: a group plan's job array (``slurm.array``): ``array.json`` (its shards) beside the run's params, and under
#: ``tasks/<i>/`` each task's own run dir (params, status, pid, logs, the task's ``slurm.json``)
ARRAY_FILE = "array.json"
TASKS_DIR = "tasks"
#: the Slurm client's own variables (SLURM_CONF ...): a status asked later uses the ones the job was submitted with.
CLIENT_ENV_PREFIX = "SLURM_"
#: sinfo's partition line: name, availability, time limit, node count, gres, node list.
SINFO_FORMAT = "%P|%a|%l|%D|%G|%N"
#: ``python -m remote.run.slurm requeued RUN_DIR``: the run is done, the requeued job has nothing to do.
ALREADY_DONE_EXIT = 10
#: a state read this recently is reused (``job follow`` asks twice a second).
STATE_CACHE_S = 2.0

SPEC = Spec("slurm", {
    "action": Arg("str", "partition", choices=("partition",)),
    "slurm": Arg("dict", required=True, options=SLURM_ARGS, doc="the host's slurm mapping"),
    "env": RUN_ARGS["env"].but(default={}),
    "tp": RUN_ARGS["tp"],
    "device": RUN_ARGS["device"],
})


def client_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def _run(argv: list, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=client_env(env), timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} gave no answer within {timeout:.0f}s")


# --------------------------------------------------------------------------- the partition

@SPEC.task
def main(params: dict) -> dict:
    return protocol.payload(partition_records(params["slurm"], params.get("env"), params.get("tp") or 1,
                                              params.get("device") or "cuda"))


def partition_facts(partition: str, env: dict | None = None) -> dict | None:
    """The partition as sinfo sees it (None: no such partition); raises TaskError when sinfo cannot answer."""
    proc = _run(["sinfo", "-h", "-p", partition, "-o", SINFO_FORMAT], env)
    if proc.returncode != 0:
        raise protocol.TaskError("slurm.sinfo", f"sinfo failed (exit {proc.returncode}): "
                                 f"{(proc.stderr or proc.stdout).strip()[:300]}",
                                 "check Slurm on the login node (sinfo must answer there); for a Slurm client "
                                 "that needs it, set SLURM_CONF in the host's env")
    lines = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 5]
    if not lines:
        return None
    nodes = sum(int(line[3]) for line in lines if line[3].isdigit())
    limits = [line[2] for line in lines]
    return {"partition": partition, "available": sorted({line[1] for line in lines}), "max_time": limits[0],
            "max_time_min": wire_slurm.time_limit_minutes(limits[0]) if limits[0] not in ("", "n/a") else None,
            "nodes": nodes, "gpus_per_node": max(wire_slurm.gres_gpus(line[4]) for line in lines),
            "gres": sorted({line[4] for line in lines}), "node_list": ",".join(line[5] for line in lines)}


def partition_records(slurm: dict, env: dict | None, tp: int, device: str) -> list:
    """``slurm.partition``: the request fits the partition (or fails naming the limit it passes)."""
    name = "slurm.partition"
    try:
        facts = partition_facts(slurm["partition"], env)
    except protocol.TaskError as exc:
        return [exc.record()]
    if facts is None:
        known = _run(["sinfo", "-h", "-o", "%P"], env).stdout.split()
        return [protocol.record(name, protocol.FAIL, f"partition {slurm['partition']!r} does not exist on this "
                                f"cluster", detail={"partitions": known},
                                fix=f"set slurm.partition to one of: {', '.join(known) or '(sinfo lists none)'}")]
    problems = []
    asked = slurm.get("time_limit")
    if asked not in (None, "") and facts["max_time_min"] is not None:
        minutes = wire_slurm.time_limit_minutes(str(asked))
        if minutes is None or minutes > facts["max_time_min"]:
            problems.append((f"time_limit {asked} is above the partition's MaxTime {facts['max_time']} "
                             f"({facts['max_time_min']:g} min)",
                             f"set slurm.time_limit to at most {facts['max_time']}, or pick a partition with a "
                             f"longer MaxTime (sinfo -o '%P %l')"))
    nodes = int(slurm.get("nodes") or 1)
    if nodes > facts["nodes"]:
        problems.append((f"nodes {nodes} is more than the partition's {facts['nodes']} node(s)",
                         f"set slurm.nodes to at most {facts['nodes']}, or pick a bigger partition"))
    wanted_gpus = wire_slurm.gres_gpus(slurm.get("gres"))
    if wanted_gpus > facts["gpus_per_node"]:
        problems.append((f"gres {slurm.get('gres')} asks {wanted_gpus} GPU(s) per node; the partition's nodes have "
                         f"{facts['gpus_per_node']}", f"set slurm.gres to at most gpu:{facts['gpus_per_node']}"))
    elif device == "cuda" and wanted_gpus and tp > wanted_gpus * nodes:
        problems.append((f"tp {tp} needs {tp} GPUs; slurm.gres {slurm.get('gres')} x {nodes} node(s) asks "
                         f"{wanted_gpus * nodes}", f"ask for gpu:{tp} (slurm.gres), or lower tp"))
    tasks = int(slurm.get("array") or 1)
    limit = max_array_size(env) if tasks > 1 else None
    if limit is not None and tasks > limit:
        problems.append((f"array {tasks} is more tasks than the cluster's MaxArraySize {limit}",
                         f"set slurm.array to at most {limit}"))
    if "up" not in facts["available"]:
        problems.append((f"partition {slurm['partition']} is {'/'.join(facts['available'])}",
                         "wait for the admins to bring it up, or pick another partition"))
    if problems:
        return [protocol.record(name, protocol.FAIL, f"partition {slurm['partition']}: {problems[0][0]}",
                                detail={**facts, "problems": [p for p, _ in problems]}, fix=problems[0][1])]
    gpus = f", {facts['gpus_per_node']} GPU(s) per node" if facts["gpus_per_node"] else ", no GPUs in its gres"
    return [protocol.record(name, protocol.OK, f"partition {slurm['partition']}: {facts['nodes']} node(s) "
                            f"({facts['node_list']}){gpus}, MaxTime {facts['max_time']}; the request fits",
                            detail=facts)]


def node_record(name: str, what: str) -> dict | None:
    """``<name>``: the compute node ``what`` runs on under ``srun`` (None: not inside a Slurm job)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get("SLURM_STEP_NODELIST") or os.environ.get(
        "SLURM_JOB_NODELIST") or "?"
    facts = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURMD_NODENAME",
                                            "SLURM_JOB_NODELIST", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES")}
    return protocol.record(name, protocol.OK, f"{what} ran on compute node {node} (Slurm job {facts['SLURM_JOB_ID']}, "
                           f"partition {facts['SLURM_JOB_PARTITION']})", detail={"node": node, **facts})


# --------------------------------------------------------------------------- a run as a batch job

def submit(run_dir: Path, argv: list, env: dict, slurm: dict, run_id: str, array: list | None = None) -> dict:
    """Submit the run's supervisor (``argv``, with ``env``; its last word the run dir) as one batch job; write and
    return ``slurm.json``.

    The script writes the supervisor's pid (it ``exec``s it) where ``job start`` would, so a
    compute node that is this host too reads it as usual. ``array`` (task indices): one job array
    instead, task ``i`` running the supervisor of ``run_dir/tasks/i`` (:func:`task_dir`); each
    of those dirs gets its own ``slurm.json`` naming its task as Slurm does (``JOBID_i``).
    """
    setup = slurm.get("setup")
    python = shlex.quote(str(argv[0]))
    where = shlex.quote(str(run_dir)) + ("/" + TASKS_DIR + "/$SLURM_ARRAY_TASK_ID" if array is not None else "")
    script = "\n".join([
        "#!/bin/sh",
        f"# specops run {run_id}: its supervisor on the job's first node (remote/run/slurm.py)",
        f"run_dir={where}",
        'cd "$run_dir"',
        'export SPECOPS_RUN_DIR="$run_dir"',
        *([setup] if setup else []),
        "# started again by Slurm (requeued after a node failure or a preemption): the run restarts as job start",
        "# restarts it, resuming after its last complete sample; a run done already stays done",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        f'  {python} -m remote.run.slurm requeued "$run_dir"',
        f"  rc=$?; [ $rc -eq {ALREADY_DONE_EXIT} ] && exit 0; [ $rc -ne 0 ] && exit $rc",
        "fi",
        "echo $$ > pid",
        "exec " + " ".join(shlex.quote(str(w)) for w in argv[:-1]) + ' "$run_dir"',
        "",
    ])
    path = run_dir / "slurm.sbatch"
    path.write_text(script)
    log = (run_dir / TASKS_DIR / "%a" if array is not None else run_dir) / "logs" / "supervisor.log"
    words = ["sbatch", "--parsable", *wire_slurm.request_options(slurm), "-N", str(int(slurm.get("nodes") or 1)),
             *([f"--array={','.join(str(i) for i in array)}"] if array is not None else []),
             "-J", f"specops-{run_id}", "-D", str(run_dir), "-o", str(log),
             "--open-mode=append", "--export=ALL", str(path)]
    proc = _run(words, env)
    if proc.returncode != 0:
        raise protocol.TaskError("job.start", f"sbatch refused the run: {(proc.stderr or proc.stdout).strip()[:300]}",
                                 "fix the host's slurm mapping in the inventory (specops preflight checks it "
                                 "against the partition), then run the same command again",
                                 detail={"command": words})
    job_id = proc.stdout.strip().split(";")[0]
    record = {"job_id": job_id, "partition": slurm["partition"], "submitted_unix": time.time(),
              "command": words, "env": {k: v for k, v in env.items() if k.startswith(CLIENT_ENV_PREFIX)},
              "setup": setup}  # a job step over the job's other nodes runs it there too (node_step)
    if array is not None:
        for i in array:
            _record_job(task_dir(run_dir, i), {**record, "job_id": f"{job_id}_{i}", "array_job_id": job_id})
        record["array"] = list(array)
    _record_job(run_dir, record)
    return record


def _record_job(run_dir: Path, record: dict) -> None:
    """The one writer of a run dir's ``slurm.json``."""
    fsutil.write_json(run_dir / JOB_FILE, record, temp_prefix=fsutil.TEMP_PREFIX)
    _cache.pop(str(run_dir), None)


def task_dir(run_dir: Path, index: int) -> Path:
    """The run dir of a job array's task ``index`` (a shard's own status, pid, params and logs)."""
    return Path(run_dir) / TASKS_DIR / str(int(index))


def max_array_size(env: dict | None = None) -> int | None:
    """The cluster's ``MaxArraySize`` (``scontrol show config``): a job array's task indices stay below it
    (None: scontrol did not say)."""
    proc = _run(["scontrol", "show", "config"], env)
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return None


def job_of(run_dir: Path) -> dict | None:
    """The run's ``slurm.json`` (None: not a Slurm run)."""
    try:
        return json.loads((Path(run_dir) / JOB_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


_cache: dict = {}


def job_state(run_dir: Path, fresh: bool = False) -> dict | None:
    """Slurm's word on the run's job: :func:`remote.wire.slurm.job_state` plus its nodes; None: not a Slurm run."""
    job = job_of(run_dir)
    if job is None:
        return None
    seen = _cache.get(str(run_dir))
    if seen and not fresh and time.monotonic() - seen[0] < STATE_CACHE_S and seen[1]["job_id"] == job["job_id"]:
        return seen[1]
    job_id, env = str(job["job_id"]), job.get("env") or {}
    if job.get("array") is not None:  # a job array: its tasks' words (scontrol and sacct name them JOBID_i)
        tasks = {i: job_state(task_dir(run_dir, i), fresh) for i in job["array"]}
        live = [t for t in tasks.values() if t and t["alive"]]
        found = dict(live[0] if live else next((t for t in tasks.values() if t), None) or
                     {"slurm": "UNKNOWN", "state": "gone", "alive": False, "reason": None, "fix": None})
        found.update(job_id=job_id, alive=bool(live), tasks=tasks)
        _cache[str(run_dir)] = (time.monotonic(), found)
        return found
    state, reason, nodes, restarts = _scontrol(job_id, env) or _sacct(job_id, env) or ("", "", "", 0)
    if not state:  # aged out of every record: Slurm no longer knows the job (MinJobAge, no accounting)
        found = {"slurm": "UNKNOWN", "state": "gone", "alive": False, "reason": None, "job_id": job_id,
                 "fix": None}
    else:
        found = wire_slurm.job_state(state, job=job_id, reason=reason if reason not in ("None", "(null)") else "")
    found["nodes"] = nodes if nodes and nodes not in ("(null)", "None assigned") else None
    found["restarts"] = restarts
    _cache[str(run_dir)] = (time.monotonic(), found)
    return found


def _scontrol(job_id: str, env: dict):
    """(state, reason, nodes, restarts) from ``scontrol show job`` (a job Slurm still holds: MinJobAge)."""
    proc = _run(["scontrol", "-o", "show", "job", job_id], env, timeout=20)
    if proc.returncode != 0 or "JobState=" not in proc.stdout:
        return None
    fields = dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
    restarts = fields.get("Restarts", "0")
    return (fields.get("JobState", ""), fields.get("Reason", ""), fields.get("NodeList", ""),
            int(restarts) if restarts.isdigit() else 0)


def _sacct(job_id: str, env: dict):
    """The same from accounting, for a job ``scontrol`` forgot (where the cluster keeps accounting)."""
    proc = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,NodeList"], env, timeout=20)
    line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    return (*line.split("|", 2), 0) if line.count("|") == 2 else None


def cancel(run_dir: Path, wait_s: float = 60.0) -> dict:
    """``scancel`` the run's job and wait until Slurm counts it ended; returns its last state."""
    job = job_of(run_dir) or {}
    env = job.get("env") or {}
    proc = _run(["scancel", str(job.get("job_id"))], env)
    deadline = time.monotonic() + wait_s
    state = job_state(run_dir, fresh=True)
    while state is not None and state["alive"] and time.monotonic() < deadline:
        time.sleep(0.5)
        state = job_state(run_dir, fresh=True)
    return {**(state or {}), "scancel_exit": proc.returncode, "scancel_said": (proc.stderr or "").strip()[:300]}


def state_words(found: dict) -> str:
    """``Slurm job 42 RUNNING on node1`` / ``Slurm job 42 PENDING (Resources)`` / ``... (requeued 1x)``."""
    where = f" on {found['nodes']}" if found.get("nodes") and found["alive"] else ""
    why = [found["reason"]] if found.get("reason") and found["slurm"] == "PENDING" else []
    if found.get("restarts"):
        why.append(f"requeued {found['restarts']}x: started again by Slurm after a node failure or a preemption")
    return f"Slurm job {found['job_id']} {found['slurm']}{' (' + '; '.join(why) + ')' if why else ''}{where}"


# --------------------------------------------------------------------------- a run over the job's nodes

#: ``python -m remote.run.slurm node ARGV...``: on each node of a job step, ARGV (a train run's torchrun, an
#: extraction's replica worker) run with this node's rank after its :data:`NODE_RANK_FLAG`; the batch host (Slurm's
#: node 0) is torchrun's node 0, and an extraction replica's head.
NODE_ACTION = "node"
NODE_RANK_FLAG = "--node-rank"


def job_node_count() -> int:
    """How many nodes the batch job this process runs in holds (1 outside a Slurm job)."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)


def job_nodes_block(env: dict | None = None) -> dict:
    """A train run over the batch job's nodes: torchrun's static rendezvous at the first node's address (Slurm's
    node 0, the batch host this supervisor runs on, is torchrun's node 0 and the run's head), a free port there;
    the ``nodes`` block :func:`remote.train.plan.node_problem` reads, with ``slurm_step: True``.

    :raises RuntimeError: scontrol did not name the job's nodes.
    """
    from remote.extract.engines.vllm_server.command import free_port

    listed = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    proc = _run(["scontrol", "show", "hostnames", listed], env)
    names = proc.stdout.split() if proc.returncode == 0 else []
    if not names:
        raise RuntimeError(f"scontrol show hostnames {listed!r} named no node: {(proc.stderr or '').strip()[:300]}")
    return {"hosts": names, "node_rank": 0, "nnodes": len(names), "master_addr": node_address(names[0], env),
            "master_port": free_port(""), "slurm_step": True}  # the head is this node: a port free on it now


def node_address(name: str, env: dict | None = None) -> str:
    """A node's ``NodeAddr`` (``scontrol show node``), else its name (a cluster whose node names resolve)."""
    proc = _run(["scontrol", "-o", "show", "node", name], env)
    for word in proc.stdout.split() if proc.returncode == 0 else []:
        key, _, value = word.partition("=")
        if key == "NodeAddr" and value:
            return value
    return name


#: under an extraction's run dir: ``nodes/<k>/``, the run dir of the job's node ``k`` > 0 in its replica (params, status,
#: logs of its headless ranks, :mod:`remote.extract.replica`); the head, node 0, is the run dir itself
NODES_DIR = "nodes"


def job_replica_block(tp: int, env: dict | None = None) -> dict:
    """An extraction over the batch job's nodes as one vLLM replica (``params["replica"]``, see
    :mod:`remote.extract.replica`): its hosts Slurm's node names, each reached at its ``NodeAddr``; node 0 (this
    batch host) the head, holding vLLM's master port and specops' watch port (both free on it now); ``tp`` the
    replica's whole TP, ``tp / nodes`` ranks a node.

    :raises ValueError: ``tp`` that the job's nodes do not divide.
    """
    from remote.extract.engines.vllm_server.command import free_port

    nodes = job_nodes_block(env)
    count = nodes["nnodes"]
    if int(tp) % count:
        raise ValueError(f"tp {tp} over the job's {count} nodes: tp is the replica's whole TP (ranks a node x "
                         f"slurm.nodes), and {count} does not divide it")
    addresses = [nodes["master_addr"], *(node_address(name, env) for name in nodes["hosts"][1:])]
    watch_port = free_port("")
    while watch_port == nodes["master_port"]:
        watch_port = free_port("")
    return {"name": f"slurm job {os.environ.get('SLURM_JOB_ID', '?')}", "hosts": nodes["hosts"], "node_rank": 0,
            "nnodes": count, "ranks_per_node": int(tp) // count, "tp": int(tp), "master_addr": nodes["master_addr"],
            "master_port": nodes["master_port"], "watch_port": watch_port, "node_address": addresses[0],
            "addresses": addresses, "slurm_step": True}


def node_dir(run_dir: Path, node_rank: int) -> Path:
    """The run dir of the job's node ``node_rank`` in an extraction's replica (:data:`NODES_DIR`)."""
    return Path(run_dir) / NODES_DIR / str(int(node_rank))


def node_step(argv: list, nnodes: int, python: str, first: int = 0, setup: str | None = None) -> list:
    """``argv`` as one job step over ``nnodes`` nodes, one task a node, each with its own node rank (:func:`exec_node`;
    ``argv``'s :data:`NODE_RANK_FLAG` value is the step's first node's); a task that fails ends the step
    (``--kill-on-bad-exit``). ``first``: the step starts at the job's node ``first`` (``--relative``), the nodes
    before it left to the batch host's own processes (an extraction's head). ``setup``: the host's ``slurm.setup``
    line, run on each node first, as the batch script runs it on the batch host."""
    return ["srun", "--nodes", str(int(nnodes)), "--ntasks", str(int(nnodes)), "--ntasks-per-node", "1",
            *([f"--relative={int(first)}"] if first else []),
            "--kill-on-bad-exit=1", "--export=ALL", *wire_slurm.setup_words(setup), str(python), "-m",
            "remote.run.slurm", NODE_ACTION, *[str(a) for a in argv]]


def exec_node(argv: list) -> None:
    """Run ``argv`` in place of this process with its :data:`NODE_RANK_FLAG` value this node's rank in the job: the
    value given (the step's first node's, :func:`node_step`) plus this node's place in the step (``SLURM_NODEID``,
    which Slurm counts from the step's first node)."""
    argv = list(argv)
    if NODE_RANK_FLAG not in argv or "SLURM_NODEID" not in os.environ:
        raise SystemExit(f"usage: srun ... python -m remote.run.slurm {NODE_ACTION} ARGV (with {NODE_RANK_FLAG} "
                         f"N), inside a Slurm job step")
    at = argv.index(NODE_RANK_FLAG) + 1
    argv[at] = str(int(argv[at]) + int(os.environ["SLURM_NODEID"]))
    os.execvp(argv[0], argv)


def failed_step_task(log_text: str) -> dict | None:
    """The task of a step that ended it, as srun names it (``srun: error: node2: task 1: Exited with exit code 1``):
    its ``host``, node ``rank`` and srun's ``said``; None when srun named none. A task that exited on its own comes
    before the ones srun then killed (``Killed``, ``Terminated``), whatever the order of the lines."""
    import re

    found = [{"host": m.group(1), "rank": int(m.group(2)), "said": m.group(3).strip()}
             for m in re.finditer(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (.+)", log_text)]
    own = [task for task in found if task["said"].startswith("Exited with exit code")]
    return (own or found or [None])[0]


def requeued(run_dir: Path) -> int:
    """The batch script of a job Slurm started again: restart the run as ``job start`` would (it resumes after its
    last complete sample). Returns :data:`ALREADY_DONE_EXIT` for a run that is done already."""
    from remote.run.lifecycle import StatusFile
    from remote.wire.contract import STATUS_FILE, RunState

    status = StatusFile.of_job(Path(run_dir) / STATUS_FILE)
    if status.state == RunState.DONE:
        return ALREADY_DONE_EXIT
    status.restart(status.data.get("run_id") or Path(run_dir).name)
    (Path(run_dir) / "pid").unlink(missing_ok=True)
    print(f"[specops] Slurm started job {os.environ.get('SLURM_JOB_ID')} again (restart "
          f"{os.environ.get('SLURM_RESTART_COUNT')}): run restarted, resuming after its last complete sample",
          flush=True)
    return 0


if __name__ == "__main__":  # the batch script: requeued RUN_DIR; a train run's job step: node ARGV...
    import sys

    if sys.argv[1:2] == [NODE_ACTION] and len(sys.argv) > 2:
        exec_node(sys.argv[2:])
    if sys.argv[1:2] != ["requeued"] or len(sys.argv) != 3:
        sys.exit("usage: python -m remote.run.slurm requeued RUN_DIR | node ARGV...")
    sys.exit(requeued(Path(sys.argv[2])))
