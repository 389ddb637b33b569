"""A host behind Slurm (``scheduler: slurm``), against a real Slurm: slurmctld and two slurmd on loopback.

One cluster for the module (:class:`specops.testhost.slurm.SlurmCluster`); its login node is the
loopback sshd test host, its compute nodes ``node1``/``node2`` share this machine's filesystem.
The extraction runs use the reference engine (transformers) on the tiny Llama, as tests/test_extract.py; the
module's one vLLM extraction (:func:`modern_states`, in the modern host env) is one replica over both nodes
(``slurm.nodes: 2``), and its states are the train test's: the session's shared run would put this module in the
one unit of modules that must share a worker (tests/conftest.py, SHARED_SESSION_FIXTURES), the suite's longest.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops import wire
from specops.errors import InventoryError
from specops.inventory import load_inventory
from specops.testhost.slurm import MAX_ARRAY_SIZE, MAX_TIME_MIN, PARTITION, SlurmCluster
from tests.specops_cli import records, specops

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).up()
    yield cluster
    cluster.down()
    left = cluster.leftovers() + [p for p in _pids_with(str(cluster.root)) if p != os.getpid()]
    cluster.destroy()
    assert not left, f"processes of the cluster outlived it: {left}"
    # every job names its output file: sbatch's default slurm-<id>.out would land in the repo (the cwd)
    repo = Path(__file__).resolve().parents[1]
    assert not [p.name for p in repo.glob("slurm-*.out")], "a Slurm job wrote its output into the repo"


@pytest.fixture(autouse=True)
def _nodes_back_up(request):
    """After a test on the cluster, a node it left down or drained (a failed launch drains one) is resumed: one
    test's failure is not the next ones' cause."""
    yield
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        left = _slurm(cluster, "sinfo", "-h", "-t", "down,drain,fail", "-o", "%N").strip()
        if left:
            print(f"\nnodes left down or drained: {left}; resumed")
            _slurm(cluster, "scontrol", "update", f"nodename={left}", "state=resume")


@pytest.fixture(scope="module")
def modern_states(cluster, testhost, modern_fixed_python, tiny_models, tmp_path_factory) -> dict:
    """One ``specops extract`` of the tiny Llama in the modern host env (the trainer's: speculators 0.9) on the Slurm
    host with ``slurm.nodes: 2`` and tp 2: one vLLM replica over the job's two nodes, a rank a node (4 samples of up to
    128 tokens, the engine's default ids). Its first three attempts end while the replica loads: aborted (scancel),
    node2's supervisor killed, node2's task failing in its setup line; the same command then runs it to the end. What each attempt showed is in ``seen``, for
    :func:`test_extract_over_two_nodes_is_one_vllm_replica_a_lost_node_is_named_abort_is_scancel` (one extraction
    for the module: a CPU server start costs a minute or more). The reference engine's states are no train input: it
    writes ``data_{i}.pt`` files, and train takes only ``hs_{i}.safetensors`` states.

    Returns a dict: ``inventory`` (the Slurm host it ran on), ``run_id``, ``run_dir`` (on the shared filesystem),
    ``output`` and ``seen``.
    """
    import yaml

    from specops.testhost.hostenv import cache_root

    tmp = tmp_path_factory.mktemp("slurm-states")
    inventory = tmp / "inventory.yaml"
    entry = {
        "address": "127.0.0.1", "port": testhost["port"], "user": testhost["user"], "key": testhost["key"],
        "known_hosts": testhost["known_hosts"], "python": str(modern_fixed_python), "work_dir": str(tmp / "work"),
        # each node's rank on a core of its own, as two one-core nodes would have it (the nodes share this machine)
        "scheduler": "slurm", "slurm": {"partition": PARTITION, "nodes": 2, "setup": (
            'case "$SLURMD_NODENAME" in node2) core=1;; *) core=0;; esac; '
            'export VLLM_CPU_OMP_THREADS_BIND=$core OMP_NUM_THREADS=1')},
        "model_path": str(tiny_models["llama"]), "dataset": str(tiny_models["dataset"]),
        "output_dir": str(tmp / "out"), "device": "cpu", "tp": 2, "seq_len": 128, "max_samples": 4, "batch_size": 4,
        "env": {**OFFLINE, **cluster.env, "VLLM_MLA_DISABLE": "1",
                "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}}
    inventory.write_text(yaml.safe_dump({"hosts": {"th": entry}}))
    # a node2 whose own start fails (its setup line: a module it lacks, a broken container), before its supervisor
    # can say a word: srun names it
    broken = tmp / "inventory-broken.yaml"
    broken.write_text(yaml.safe_dump({"hosts": {"th": {**entry, "slurm": {**entry["slurm"], "setup": (
        'if [ "$SLURMD_NODENAME" = node2 ]; then echo "no such module" >&2; exit 3; fi')}}}}))
    run_id, runs = "llama-2nodes", {"SPECOPS_RUNS": str(tmp / "runs")}
    run_dir = tmp / "work" / "runs" / run_id
    argv = ("extract", "--inventory", inventory, "--run-id", run_id, "--skip-preflight", "--skip-smoke", "--json")
    seen = {}

    def worker_joined() -> dict:
        """Start an attempt; once node2's supervisor said hello (its ranks loading): the status then, and its pid."""
        log = run_dir / "logs" / "supervisor.log"
        before = len(_text(log))  # the run's log keeps every attempt's lines
        started = specops(*argv, "--detach", env=runs, timeout=120)
        assert records(started)["job.start"]["status"] == "changed", started.stdout[-3000:] + started.stderr[-2000:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            node = _read_json(run_dir / "nodes" / "1" / "status.json")
            pids = [p for p in _pids_with("remote.extract.replica") if str(run_dir).encode() in _proc(p, "cmdline")]
            if node.get("state") == "loading" and pids and "joined" in _text(log)[before:]:
                proc, found = _status(run_id, runs, inventory)
                return {"status": found, "node": node, "pids": pids, "job_id": _read_json(run_dir / "slurm.json")[
                    "job_id"], "head": _read_json(run_dir / "status.json")}
            time.sleep(0.5)
        raise AssertionError(f"node2 never joined: {_text(run_dir / 'logs' / 'supervisor.log')[-3000:]}"
                             f"{_text(run_dir / 'logs' / 'nodes.log')[-3000:]}")

    def gone(job_id, tree=()) -> dict:
        """Once Slurm no longer holds the job: the processes of the run still alive (``tree``: those of both nodes
        seen before the end, whatever vLLM retitled them to)."""
        deadline = time.monotonic() + 60  # the job's own end follows its supervisor's record
        while _slurm(cluster, "squeue", "-h", "-j", job_id).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        return {"squeue": _slurm(cluster, "squeue", "-h", "-j", job_id).strip(),
                "left": _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ") + _pids_with(str(run_dir)) + [
                    pid for pid in tree if _alive(pid)]}

    def tree(attempt) -> list:
        """Every process of both nodes' supervisors now: the batch host's (its server, srun) and node2's."""
        head = int(_text(run_dir / "pid").strip() or 0)
        return _descendants([head, *attempt["pids"]])

    # abort while the replica loads: scancel of the one job ends both nodes' processes
    seen["aborting"] = worker_joined()
    before = tree(seen["aborting"])
    seen["abort"] = records(specops("abort", "--inventory", inventory, "--run-id", run_id, "--json", env=runs,
                                    timeout=120))["job.abort"]
    seen["aborted"] = {**gone(seen["aborting"]["job_id"], before), "status": _status(run_id, runs, inventory)[1],
                       "tree": before}
    # node2's supervisor killed (the node lost) while its ranks load: the run fails naming it
    seen["killing"] = worker_joined()
    before = tree(seen["killing"])
    for pid in seen["killing"]["pids"]:
        os.kill(pid, 9)
    proc, found = _wait_status(run_id, runs, inventory, lambda r: r["job.status"]["status"] == "fail", timeout=120)
    seen["killed"] = {**gone(seen["killing"]["job_id"], before), "status": found, "tree": before,
                      "error": (json.loads(proc.stdout)["hosts"][0]["data"]["status"] or {}).get("error")}
    # node2's task of the job step fails before its supervisor runs: the run fails naming the node srun names
    started = specops(argv[0], "--inventory", broken, *argv[3:], "--detach", env=runs, timeout=120)
    assert records(started)["job.start"]["status"] == "changed", started.stdout[-3000:]
    proc, found = _wait_status(run_id, runs, inventory, lambda r: r["job.status"]["status"] == "fail", timeout=120)
    seen["step_failed"] = {**gone(_read_json(run_dir / "slurm.json")["job_id"]), "status": found,
                           "error": (json.loads(proc.stdout)["hosts"][0]["data"]["status"] or {}).get("error")}
    # the same command (followed) runs it to the end, and fetches it
    done = specops(*argv, env=runs, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    seen["done"] = {"status": _status(run_id, runs, inventory)[1], "head": _read_json(run_dir / "status.json"),
                    "node": _read_json(run_dir / "nodes" / "1" / "status.json"), **gone(
                        _read_json(run_dir / "slurm.json")["job_id"])}
    return {"inventory": inventory, "run_id": run_id, "run_dir": run_dir, "output": tmp / "out" / run_id,
            "fetched": tmp / "runs" / "th" / run_id, "seen": seen}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """``pid`` is a live process (not a zombie)."""
    stat = _proc(pid, "stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _descendants(roots: list) -> list:
    """``roots`` (the live ones) and every live process below them."""
    parents = {}
    for entry in Path("/proc").iterdir():
        stat = _proc(int(entry.name), "stat") if entry.name.isdigit() else b""
        if stat:
            parents[int(entry.name)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found = [pid for pid in roots if pid in parents]
    for pid in found:  # grows as it goes: children, then theirs
        found += [child for child, parent in parents.items() if parent == pid and child not in found]
    return [pid for pid in found if _alive(pid)]


def _proc(pid: int, what: str) -> bytes:
    """``/proc/<pid>/<what>`` (b"" once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _pids_with(text: str, where: str = "cmdline") -> list[int]:
    """Live processes whose command line (or environment) holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = (entry / where).read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in data and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _slurm(cluster, *argv) -> str:
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **cluster.env},
                          timeout=30).stdout


def _slurm_host(make_inventory, cluster, tiny_models, tmp_path, name="login", **slurm):
    return {"address": "127.0.0.1", "scheduler": "slurm", "slurm": {"partition": PARTITION, **slurm},
            "env": {**OFFLINE, **cluster.env}, "model_path": str(tiny_models["llama"]),
            "dataset": str(tiny_models["dataset"]), "engine": "hf-reference", "max_samples": 6, "seq_len": 64,
            "batch_size": 2, "tp": 1, "output_dir": str(tmp_path / f"out-{name}")}


# --------------------------------------------------------------------------- pure rules

def test_slurm_time_gres_and_states_are_read_as_slurm_writes_them():
    minutes = wire.slurm.time_limit_minutes
    assert [minutes(t) for t in ("90", "10:30", "04:00:00", "1-00", "2-03:04", "1-02:00:00")] == [
        90, 10.5, 240, 1440, 2 * 1440 + 3 * 60 + 4, 1560]
    assert minutes("UNLIMITED") is None and minutes("infinite") is None
    with pytest.raises(ValueError, match="not a Slurm time"):
        minutes("4 hours")
    assert wire.slurm.gres_gpus("gpu:h100:8(S:0-1)") == 8 and wire.slurm.gres_gpus("gpu:4,shard:8") == 4
    assert wire.slurm.gres_gpus("(null)") == 0
    # every state a run can end in is named, and every bad end carries its fix
    for word in ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                 "PREEMPTED"):
        found = wire.slurm.job_state(word, job="7", reason="Resources")
        assert found["slurm"] == word and found["state"] and found["job_id"] == "7"
        assert found["alive"] == (word in ("PENDING", "RUNNING"))
        assert (found["fix"] is None) == (word in ("RUNNING", "COMPLETED")), found
    assert wire.slurm.job_state("CANCELLED by 0", job="7")["slurm"] == "CANCELLED"
    assert "time limit" in wire.slurm.job_state("TIMEOUT", job="7")["fix"]
    assert "Resources" in wire.slurm.job_state("PENDING", job="7", reason="Resources")["fix"]
    # a pending job Slurm holds (a launch that failed on a node, a user's or an admin's hold) never starts by itself
    for reason in ("launch_failed_requeued_held", "JobHeldUser", "JobHeldAdmin"):
        held = wire.slurm.job_state("PENDING", job="7", reason=reason)
        assert held["state"] == "held" and held["alive"] and "scontrol release 7" in held["fix"], held
        assert f"({reason})" in held["fix"] and "it does not start by itself" in held["fix"]


def test_the_node_a_train_step_lost_is_read_as_srun_names_it():
    from remote.run.slurm import failed_step_task, node_step

    tail = "[default0]: step 3\nsrun: error: node2: task 1: Exited with exit code 1\nsrun: error: node1: task 0: Killed\n"
    assert failed_step_task(tail) == {"host": "node2", "rank": 1, "said": "Exited with exit code 1"}
    # the peer that died of the lost one's end may be named first: the task that exited on its own is the cause
    assert failed_step_task("srun: error: node1: task 0: Killed\nsrun: error: node2: task 1: Exited with exit code "
                            "1\n")["host"] == "node2"
    assert failed_step_task("srun: error: gpu-a12: tasks 2-3: Killed") == {"host": "gpu-a12", "rank": 2,
                                                                           "said": "Killed"}
    assert failed_step_task("Traceback (most recent call last):\n") is None
    # one task a node; a node that fails ends the step; each task's torchrun gets its node rank from Slurm
    argv = node_step(["/p", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "0", "x"], 2, "/p")
    assert argv[:8] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert argv[-11:-8] == ["-m", "remote.run.slurm", "node"] and argv[-3:] == ["--node-rank", "0", "x"]
    # an extraction's worker nodes: a step from the job's node 1 (the batch host keeps the head), the entry's setup
    # line run on each node first; a node's rank is the step's first node's plus Slurm's node id in the step
    argv = node_step(["/p", "-m", "remote.extract.replica", "/run", "--node-rank", "1"], 1, "/p", first=1,
                     setup="module load cuda")
    assert "--relative=1" in argv and argv[argv.index("sh"):argv.index("sh") + 3] == [
        "sh", "-c", 'module load cuda\nexec "$0" "$@"'], argv
    ran = subprocess.run([sys.executable, "-m", "remote.run.slurm", "node", sys.executable, "-c",
                          "import sys; print(sys.argv[1:])", "--node-rank", "1"], capture_output=True, text=True,
                         env={**os.environ, "SLURM_NODEID": "2"}, cwd=Path(__file__).resolve().parents[1], timeout=30)
    assert ran.stdout.strip() == "['--node-rank', '3']", ran.stdout + ran.stderr


def test_slurm_inventory_fields_are_checked_by_name(tmp_path):
    base = {"address": "login", "python": "/p", "model_path": "/m", "output_dir": "/o"}
    path = tmp_path / "inv.yaml"
    path.write_text(json.dumps({"hosts": {
        "ok": {**base, "scheduler": "slurm", "slurm": {"partition": "gpu", "gres": "gpu:8", "time_limit": 240,
                                                        "account": "proj", "qos": "normal", "nodes": 1,
                                                        "setup": "module load cuda"}}}}))
    spec = load_inventory(path).hosts["ok"]
    assert spec.scheduler == "slurm" and spec.slurm.time_limit == "240" and spec.slurm.nodes == 1
    path.write_text(json.dumps({"hosts": {
        "none": {**base, "scheduler": "slurm"},
        "typo": {**base, "scheduler": "slurm", "slurm": {"partitio": "gpu"}},
        "time": {**base, "scheduler": "slurm", "slurm": {"partition": "gpu", "time_limit": "4 hours", "nodes": 0,
                                                          "array": 0}},
        "kind": {**base, "scheduler": "pbs"},
        "alone": {**base, "slurm": {"partition": "gpu"}}}}))
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    said = str(caught.value)
    assert "host 'none': field 'slurm' is needed with scheduler: slurm: give at least its partition" in said
    assert "host 'typo': missing required field 'slurm.partition'" in said
    assert "host 'typo': unknown field 'slurm.partitio' (allowed: partition, account, qos, gres, time_limit" in said
    assert "host 'time': field 'slurm.time_limit': '4 hours' is not a Slurm time: write MINUTES" in said
    assert "host 'time': field 'slurm.nodes': must be at least 1" in said
    assert "host 'time': field 'slurm.array': must be at least 1" in said
    assert "host 'kind': field 'scheduler': Input should be 'ssh' or 'slurm'" in said
    assert "host 'alone': field 'slurm' is set but field 'scheduler' is not slurm: add scheduler: slurm" in said


def test_a_train_over_several_hosts_or_as_an_array_is_refused_by_name_before_the_login_node_is_reached(tmp_path):
    from specops.errors import UsageError
    from specops.inventory import HostSpec, SlurmSpec
    from specops.train import start_step, train

    class Untouched:  # a host no task may reach
        def __init__(self, spec):
            self.spec, self.name = spec, spec.name

        def run_task(self, *args, **kwargs):
            raise AssertionError("a task reached the login node")

    fields = dict(address="login", python="/p", model_path="/m", output_dir="/o", scheduler="slurm")
    arrayed = HostSpec(name="c", **fields, slurm=SlurmSpec(partition="gpu", nodes=2, array=2))
    with pytest.raises(UsageError) as caught:
        start_step(Untouched(arrayed), "t1", "r1", epochs=1, dry_run=True, force=False)
    assert "field 'slurm.array' is 2: a job array shards an extraction" in str(caught.value), caught.value
    # a Slurm host among several selected for one train run: refused before any host is reached
    inventory = tmp_path / "inv.yaml"
    base = {"address": "127.0.0.1", "port": 1, "python": "/p", "model_path": "/m", "output_dir": "/o"}
    inventory.write_text(json.dumps({"hosts": {"c": {**base, "scheduler": "slurm", "slurm": {"partition": "gpu"}},
                                               "s": base}}))
    with pytest.raises(UsageError, match="training over several hosts is torchrun's across SSH hosts"):
        train(load_inventory(inventory), "c,s", run_id="t1", from_run="r1", epochs=1)
    # a disaggregated online run with a half behind Slurm would start that half on the login node
    for on, server in (("s", "c"), ("c", "s")):
        with pytest.raises(UsageError, match=r"--server-on: host\(s\) c are behind Slurm"):
            train(load_inventory(inventory), on, run_id="t1", from_run="r1", epochs=1, online=True, server_on=server)


def test_a_job_array_host_in_a_group_over_several_hosts_is_refused_by_name_before_any_host_is_reached(tmp_path):
    from specops.errors import UsageError
    from specops.runs.run import extract

    inventory = tmp_path / "inv.yaml"
    base = {"address": "127.0.0.1", "port": 1, "python": "/p", "model_path": "/m", "output_dir": "/o"}
    inventory.write_text(json.dumps({"hosts": {
        "c": {**base, "scheduler": "slurm", "slurm": {"partition": "gpu", "array": 4}}, "s": base}}))
    for selector, flags in (("c,s", {}), ("c", {"shard_by": "equal"})):
        with pytest.raises(UsageError) as caught:  # port 1 answers nobody: a reach would fail otherwise
            extract(load_inventory(inventory), selector, {}, run_id="g1", detach=True, force=False,
                    skip_preflight=True, as_json=True, **flags)
        assert "host(s) c: field 'slurm.array' makes a run on that cluster a group plan of its own" in \
            str(caught.value) and "--on c" in caught.value.hint


def test_a_replica_over_the_jobs_nodes_that_cannot_run_is_refused_by_name_before_any_host_is_reached(tmp_path):
    from specops.errors import UsageError
    from specops.runs.run import extract

    inventory = tmp_path / "inv.yaml"
    base = {"address": "127.0.0.1", "port": 1, "python": "/p", "model_path": "/m", "output_dir": "/o"}
    slurm = {**base, "scheduler": "slurm", "tp": 2}
    inventory.write_text(json.dumps({"hosts": {
        "arrayed": {**slurm, "slurm": {"partition": "gpu", "nodes": 2, "array": 2}},
        "odd": {**slurm, "tp": 3, "slurm": {"partition": "gpu", "nodes": 2}},
        "ref": {**slurm, "engine": "hf-reference", "slurm": {"partition": "gpu", "nodes": 2}},
        "paired": {**slurm, "slurm": {"partition": "gpu"}}, "s": base},
        "replicas": {"pair": {"hosts": ["paired", "s"], "tp": 2}}}))
    for selector, said, fix in (
            ("arrayed", "field 'slurm.nodes' is 2 and field 'slurm.array' is 2: an extraction over several nodes is "
                        "one replica in one job", "drop slurm.array"),
            ("odd", "tp 3 over field 'slurm.nodes' 2: tp is the replica's whole TP", "set tp to a multiple of 2"),
            ("ref", "engine hf-reference with field 'slurm.nodes' 2: one replica over several nodes is vLLM's "
                    "multi-node runtime", "set engine: vllm-server"),
            ("pair", "host 'paired' is behind Slurm (scheduler: slurm) and one host of replica 'pair' over SSH hosts",
             "drop paired from replicas.pair")):
        with pytest.raises(UsageError) as caught:  # port 1 answers nobody: a reach would fail otherwise
            extract(load_inventory(inventory), selector, {}, run_id="r1", detach=True, force=False,
                    skip_preflight=True, as_json=True)
        assert said in str(caught.value) and fix in caught.value.hint, (selector, str(caught.value),
                                                                        caught.value.hint)
    # --tp on the command line is judged as the inventory's tp is
    with pytest.raises(UsageError, match="tp 1 over field 'slurm.nodes' 2"):
        extract(load_inventory(inventory), "ref", {"tp": 1}, run_id="r1", detach=True, force=False,
                skip_preflight=True, as_json=True)


# --------------------------------------------------------------------------- against the cluster

def test_preflight_checks_the_partition_then_runs_on_a_compute_node(cluster, make_inventory, tiny_models, tmp_path):
    host = _slurm_host(make_inventory, cluster, tiny_models, tmp_path)
    inventory = make_inventory(hosts={
        "fits": make_inventory_host(make_inventory, host),
        "spans": make_inventory_host(make_inventory, host, tp=2, engine="vllm-server",
                                     slurm={"partition": PARTITION, "nodes": 2}),
        "uneven": make_inventory_host(make_inventory, host, tp=3, slurm={"partition": PARTITION, "nodes": 2}),
        "nopart": make_inventory_host(make_inventory, host, slurm={"partition": "gpu-nope"}),
        "toolong": make_inventory_host(make_inventory, host, slurm={"partition": PARTITION,
                                                                    "time_limit": "1-00:00:00"}),
        "toomany": make_inventory_host(make_inventory, host, slurm={"partition": PARTITION, "nodes": 3}),
        "gpus": make_inventory_host(make_inventory, host, slurm={"partition": PARTITION, "gres": "gpu:8"}),
        "wide": make_inventory_host(make_inventory, host, slurm={"partition": PARTITION, "array": MAX_ARRAY_SIZE + 1}),
    })
    proc = specops("preflight", "--inventory", inventory, "--json")
    doc = json.loads(proc.stdout)
    by_host = {h["host"]: {r["name"]: r for r in h["records"]} for h in doc["hosts"]}
    fits = by_host["fits"]
    assert fits["slurm.partition"]["status"] == "ok", fits["slurm.partition"]
    assert f"MaxTime {MAX_TIME_MIN}:00" in fits["slurm.partition"]["summary"]
    assert fits["slurm.partition"]["detail"]["nodes"] == 2
    node = fits["host.node"]
    assert node["status"] == "ok" and node["detail"]["node"] in ("node1", "node2"), node
    assert f"partition {PARTITION}" in node["summary"] and "compute node node" in node["summary"]
    assert fits["host.python"]["status"] == "ok"  # the usual host checks ran there
    # tp 2 over slurm.nodes 2 is one replica, a rank a node: the node checked holds its share, not the whole TP
    spans = by_host["spans"]
    assert spans["slurm.partition"]["status"] == "ok" and spans["host.node"]["status"] == "ok", spans
    assert spans["parallel.devices"]["summary"].startswith("device=cpu: TP 1 over"), spans["parallel.devices"]
    # what extract refuses for a replica over the job's nodes, preflight names before anything is submitted
    uneven = by_host["uneven"]
    assert uneven["slurm.replica"]["status"] == "fail" and "tp 3 over field 'slurm.nodes' 2" in \
        uneven["slurm.replica"]["summary"] and "set tp to a multiple of 2" in uneven["slurm.replica"]["fix"], uneven
    assert uneven["host.node"]["status"] == "skipped" and "host.python" not in uneven
    refused = {name: by_host[name]["slurm.partition"] for name in ("nopart", "toolong", "toomany", "gpus", "wide")}
    assert all(r["status"] == "fail" for r in refused.values()), refused
    assert "partition 'gpu-nope' does not exist" in refused["nopart"]["summary"]
    assert PARTITION in refused["nopart"]["fix"]
    assert f"above the partition's MaxTime {MAX_TIME_MIN}:00" in refused["toolong"]["summary"]
    assert f"at most {MAX_TIME_MIN}:00" in refused["toolong"]["fix"]
    assert "nodes 3 is more than the partition's 2 node(s)" in refused["toomany"]["summary"]
    assert "asks 8 GPU(s) per node; the partition's nodes have 0" in refused["gpus"]["summary"]
    assert f"array {MAX_ARRAY_SIZE + 1} is more tasks than the cluster's MaxArraySize {MAX_ARRAY_SIZE}" in \
        refused["wide"]["summary"] and f"at most {MAX_ARRAY_SIZE}" in refused["wide"]["fix"]
    for name in refused:  # nothing was submitted for them: no host check ran
        assert by_host[name]["host.node"]["status"] == "skipped" and "host.python" not in by_host[name]
    assert proc.returncode != 0
    assert "specops-preflight" not in _slurm(cluster, "squeue", "-h", "-o", "%j")


def make_inventory_host(make_inventory, host: dict, **changes) -> dict:
    """``host`` (a slurm host's fields) completed with the test host's reach fields, as make_inventory writes them."""
    import yaml

    written = yaml.safe_load(Path(make_inventory(**host)).read_text())["hosts"]["th"]
    return {**written, **changes}


def _status(run_id, runs, inventory):
    proc = specops("status", "--inventory", inventory, "--run-id", run_id, "--json", env=runs, timeout=120)
    return proc, records(proc)


#: seconds between two ``specops status`` calls of a wait: a call costs a second of CPU (the CLI, the host's entry,
#: Slurm's own queries), which the suite's other worker needs; every state waited for here lasts longer
STATUS_POLL_S = 2.0


def _wait_status(run_id, runs, inventory, ready, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        proc, found = _status(run_id, runs, inventory)
        if ready(found) or time.monotonic() > deadline:
            return proc, found
        time.sleep(STATUS_POLL_S)


def test_extract_is_a_slurm_job_status_names_its_state_abort_is_scancel(cluster, make_inventory, tiny_models,
                                                                         tmp_path):
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    host = _slurm_host(make_inventory, cluster, tiny_models, tmp_path)
    host["env"]["SPECOPS_BATCH_DELAY_S"] = "6"  # time to look at it running, and to abort it there
    inventory = make_inventory(**host)
    started = specops("extract", "--inventory", inventory, "--run-id", "s1", "--skip-preflight", "--skip-smoke",
                      "--detach", "--json", env=runs, timeout=120)
    start = records(started)["job.start"]
    assert start["status"] == "changed" and "submitted as Slurm job" in start["summary"], started.stdout
    run_dir = tmp_path / "work" / "runs" / "s1"
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    assert "exec " in (run_dir / "slurm.sbatch").read_text()

    proc, found = _wait_status("s1", runs, inventory, lambda r: "RUNNING" in r.get("job.slurm", {}).get("summary", ""))
    assert "job.slurm" in found, proc.stdout + started.stdout
    assert found["job.slurm"]["status"] == "ok" and f"Slurm job {job_id} RUNNING on node" in \
        found["job.slurm"]["summary"], proc.stdout
    assert proc.returncode == 101  # running

    # a second run asks for both nodes while s1 holds one: Slurm keeps it pending and says why
    second = _slurm_host(make_inventory, cluster, tiny_models, tmp_path, name="s2", nodes=2)
    second.update(engine="vllm-server", tp=2)  # over two nodes: one vLLM replica (it never starts here)
    inventory2 = make_inventory(**second)
    pending = specops("extract", "--inventory", inventory2, "--run-id", "s2", "--skip-preflight", "--skip-smoke",
                      "--detach", "--json", env=runs, timeout=120)
    assert records(pending)["job.start"]["status"] == "changed", pending.stdout
    proc, found = _wait_status("s2", runs, inventory2, lambda r: "Resources" in r.get("job.slurm", {}).get("summary", ""),
                               timeout=20)
    assert "PENDING (Resources)" in found["job.slurm"]["summary"], proc.stdout
    assert "waits for nodes (Resources)" in found["job.slurm"]["fix"]
    # cancelled behind specops' back (an admin, the user's own scancel): named, with its fix
    s2_job = json.loads((tmp_path / "work" / "runs" / "s2" / "slurm.json").read_text())["job_id"]
    _slurm(cluster, "scancel", s2_job)
    proc, found = _wait_status("s2", runs, inventory2, lambda r: "CANCELLED" in r.get("job.slurm", {}).get("summary", ""),
                               timeout=20)
    assert found["job.slurm"]["status"] == "fail" and "cancelled" in found["job.slurm"]["summary"], proc.stdout
    assert "run the same command again to resume" in found["job.slurm"]["fix"]
    assert found["job.status"]["status"] == "fail" and "SlurmCancelled" in found["job.status"]["summary"]
    assert proc.returncode == 100

    proc, found = _wait_status("s1", runs, inventory, lambda r: "extracting" in r["job.status"]["summary"])
    assert "extracting" in found["job.status"]["summary"] and "RUNNING" in found["job.slurm"]["summary"], proc.stdout

    # abort = scancel: the job ends, the run is aborted, and nothing of it is left
    aborted = specops("abort", "--inventory", inventory, "--run-id", "s1", "--json", env=runs, timeout=120)
    said = records(aborted)["job.abort"]
    assert said["status"] == "changed" and f"scancel {job_id}" in said["summary"], aborted.stdout
    assert _slurm(cluster, "squeue", "-h", "-j", job_id).strip() == ""
    assert not _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ"), "a process of the aborted run is left"
    proc, found = _status("s1", runs, inventory)
    assert "aborted" in found["job.status"]["summary"] and "CANCELLED" in found["job.slurm"]["summary"]
    assert proc.returncode == 103

    # the same command again resubmits it; a node set down mid-run then makes Slurm requeue the job, status names
    # it, and the job started again resumes the run: every sample once, the run's files and manifest as ever
    host["env"]["SPECOPS_BATCH_DELAY_S"] = "5"  # a fault point is not part of what the run is: a resume may change it
    inventory = make_inventory(**host)
    started = specops("extract", "--inventory", inventory, "--run-id", "s1", "--skip-preflight", "--skip-smoke",
                      "--detach", "--json", env=runs, timeout=120)
    assert "resubmitted (resumes after the last complete sample)" in records(started)["job.start"]["summary"]
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    proc, found = _wait_status("s1", runs, inventory, lambda r: "extracting" in r["job.status"]["summary"])
    node = found["job.slurm"]["detail"]["nodes"]
    assert node in ("node1", "node2"), proc.stdout
    _slurm(cluster, "scontrol", "update", f"nodename={node}", "state=down", "reason=specops-test")
    try:
        proc, found = _wait_status("s1", runs, inventory, lambda r: "requeued 1x" in r["job.slurm"]["summary"],
                                   timeout=30)
        assert f"Slurm job {job_id} PENDING" in found["job.slurm"]["summary"], proc.stdout
        assert "after a node failure or a preemption" in found["job.slurm"]["summary"]
        # the killed instance ends first (KillWait): a relaunch of the same job on a node still cleaning up after it
        # can fail there, and Slurm then holds the job (launch_failed_requeued_held)
        deadline = time.monotonic() + 60
        while _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ") and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        _slurm(cluster, "scontrol", "update", f"nodename={node}", "state=resume")
    _slurm(cluster, "scontrol", "update", f"jobid={job_id}", "StartTime=now")  # Slurm holds a requeue back ~2 min
    proc, found = _wait_status("s1", runs, inventory, lambda r: "done" in r["job.status"]["summary"]
                               and "COMPLETED" in r["job.slurm"]["summary"], timeout=120)
    assert proc.returncode == 0 and "COMPLETED" in found["job.slurm"]["summary"], proc.stdout
    log = (run_dir / "logs" / "supervisor.log").read_text()
    assert f"Slurm started job {job_id} again (restart 1)" in log
    out = tmp_path / "out-login" / "s1"
    assert sorted(p.name for p in out.glob("data_*.pt")) == [f"data_{i}.pt" for i in range(6)]
    fetched = specops("extract", "--inventory", inventory, "--run-id", "s1", "--json", env=runs, timeout=120)
    assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "th" / "s1" / "manifest.json").read_text())
    assert manifest["samples"] == 6 and len(manifest["files"]) == 6


def test_extract_over_two_nodes_is_one_vllm_replica_a_lost_node_is_named_abort_is_scancel(modern_states):
    """``slurm.nodes: 2``, tp 2 (:func:`modern_states`): one batch job; its batch host (node1) the replica's head with
    the API server and rank 0, node2 a job step of one headless rank, the nodes, addresses and ports the job's."""
    seen, run_dir = modern_states["seen"], modern_states["run_dir"]
    first = seen["aborting"]
    job, said = first["status"]["job.slurm"]["summary"], first["status"]["job.status"]["summary"]
    assert f"Slurm job {first['job_id']} RUNNING on node[1-2]" in job, first["status"]
    assert "one replica over node1, node2 (tp 2)" in said, said
    replica = first["head"]["replica"]
    assert replica["hosts"] == ["node1", "node2"] and replica["ranks_per_node"] == 1 and replica["tp"] == 2, replica
    assert replica["addresses"] == ["127.0.0.1", "127.0.0.1"], replica  # each node's NodeAddr (scontrol show node)
    step = replica["command"]
    assert step[:6] == ["srun", "--nodes", "1", "--ntasks", "1", "--ntasks-per-node"] and "--relative=1" in step
    # node2's task runs the replica's worker supervisor as node 1: the step's first node's rank plus Slurm's node id
    assert step[-4:] == ["remote.extract.replica", str(run_dir), "--node-rank", "1"], step
    assert first["node"]["replica"]["host"] == "node2" and first["node"]["replica"]["ranks"] == [1], first["node"]

    # abort = scancel of the one job: both nodes' processes end, nothing of the run is left
    assert seen["abort"]["status"] == "changed" and f"scancel {first['job_id']}" in seen["abort"]["summary"], \
        seen["abort"]
    assert seen["aborted"]["squeue"] == "" and not seen["aborted"]["left"], seen["aborted"]
    assert len(seen["aborted"]["tree"]) >= 4, seen["aborted"]  # at least: the head, its server and srun, node2's
    assert "aborted" in seen["aborted"]["status"]["job.status"]["summary"], seen["aborted"]["status"]

    # node2's supervisor killed: the run fails naming the node, and nothing of it is left on either node
    killed = seen["killed"]
    assert killed["error"]["host"] == "node2" and killed["error"]["node_rank"] == 1, killed["error"]
    assert killed["error"]["type"] in ("HostLost", "NodeStepFailed"), killed["error"]
    assert "node2" in killed["status"]["job.status"]["summary"], killed["status"]
    assert killed["squeue"] == "" and not killed["left"], killed
    # node2's task failed before its supervisor ran (its setup line): named as srun names it
    failed = seen["step_failed"]
    assert failed["error"]["type"] == "NodeStepFailed" and failed["error"]["host"] == "node2", failed["error"]
    assert failed["error"]["message"].startswith("node 1 (node2) of the job's 2: Exited with exit code 3"), \
        failed["error"]
    assert failed["squeue"] == "" and not failed["left"], failed

    # the same command ran it to the end: every sample once, both nodes' ranks ran it
    done = seen["done"]
    assert done["head"]["state"] == "done" and done["node"]["state"] == "done", (done["head"], done["node"])
    assert "COMPLETED" in done["status"]["job.slurm"]["summary"] and not done["left"], done
    files = sorted(p.name for p in modern_states["output"].rglob("hs_*.safetensors"))
    assert files == [f"hs_{i}.safetensors" for i in range(4)], files
    manifest = json.loads((modern_states["fetched"] / "manifest.json").read_text())
    assert manifest["samples"] == 4 and sorted(Path(f["path"]).name for f in manifest["files"]) == files
    nodes_log = (run_dir / "logs" / "nodes.log").read_text()
    assert "ranks [1] of replica slurm job" in nodes_log and "head node1" in nodes_log, nodes_log[-3000:]
    head_log = (run_dir / "logs" / "supervisor.log").read_text()
    assert "replica: node2 (node 1, ranks [1]) joined" in head_log, head_log[-3000:]
    # both nodes ran ranks of one world: the head's server rank 0 (and the API server), node2's headless server rank 1
    assert "world_size=2 rank=0 " in (run_dir / "logs" / "server.log").read_text()
    assert "world_size=2 rank=1 " in (run_dir / "nodes" / "1" / "logs" / "server.log").read_text()
    # the run's logs are both nodes'
    logs = json.loads(specops("logs", "--inventory", modern_states["inventory"], "--run-id", modern_states["run_id"],
                              "--json", env={"SPECOPS_RUNS": str(modern_states["fetched"].parents[1])},
                              timeout=60).stdout)["logs"]["th"]
    assert {"supervisor.log", "nodes.log", "server.log", "nodes/1/logs/server.log"} <= set(logs), sorted(logs)


def test_train_over_two_nodes_is_one_job_abort_is_scancel_a_lost_node_is_named_and_resumed_eval_on_a_node(
        cluster, modern_states, tmp_path):
    """The module's tiny-Llama states (modern stack), copied into this host's work dir; the trainer runs in a batch
    job over both compute nodes (``slurm.nodes: 2``): one job step of torchrun a node (gloo ranks through the CPU
    launcher shim), node 0 the batch host."""
    import shutil

    import yaml

    states = modern_states
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    work = tmp_path / "work"
    shutil.copytree(states["run_dir"], work / "runs" / states["run_id"])
    host = yaml.safe_load(Path(states["inventory"]).read_text())["hosts"]["th"]
    host.update(scheduler="slurm", slurm={"partition": PARTITION, "nodes": 2}, work_dir=str(work),
                env={**host.get("env", {}), **OFFLINE, **cluster.env})

    def inventory(**env) -> Path:
        path = tmp_path / f"inv-{len(list(tmp_path.glob('inv-*')))}.yaml"
        path.write_text(yaml.safe_dump({"hosts": {"th": {**host, "env": {**host["env"], **env}}}}))
        return path

    def status() -> tuple[int, dict, dict]:
        proc, found = _status("d1", runs, inv)
        return proc.returncode, found, (json.loads(proc.stdout)["hosts"][0].get("data") or {}).get("status") or {}

    def wait(ready, timeout=120) -> tuple[int, dict, dict]:
        deadline = time.monotonic() + timeout
        while True:
            code, found, st = status()
            if ready(found, st) or time.monotonic() > deadline:
                return code, found, st
            time.sleep(STATUS_POLL_S)

    # paced (a pause after its one optimizer step an epoch: 4 samples over two ranks): there is a run to abort, and
    # one still training once it has its first checkpoint: 5 paced epochs are left then, however fast the steps run
    # (the resume runs them unpaced)
    epochs = 6
    argv = ["train", "--run-id", "d1", "--from-run", states["run_id"], "--epochs", str(epochs), "--json"]
    # 10 s: the kill below lands in rank 0's pause (not in a collective, where rank 0 would fail at the same instant)
    inv = inventory(SPECOPS_BATCH_DELAY_S="10")
    started = specops(argv[0], "--inventory", inv, *argv[1:], "--detach", env=runs, timeout=180)
    said = records(started)
    assert started.returncode == 0 and said["job.start"]["status"] == "changed", started.stdout[-3000:]
    assert "submitted as Slurm job" in said["job.start"]["summary"], said["job.start"]
    # the training preflight ran on the login node: the trainer's memory is the compute node's, not judged there
    assert said["train.memory"]["status"] == "skipped" and "this is the login node" in said["train.memory"]["summary"]
    run_dir = work / "runs" / "d1"
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    assert "remote.train.supervisor" in (run_dir / "slurm.sbatch").read_text()
    code, found, st = wait(lambda r, st: "RUNNING" in r.get("job.slurm", {}).get("summary", ""))
    assert f"Slurm job {job_id} RUNNING on node" in found["job.slurm"]["summary"] and code == 101, found

    # abort = scancel: the job ends, the run is aborted, nothing of it is left
    aborted = specops("abort", "--inventory", inv, "--run-id", "d1", "--json", env=runs, timeout=120)
    assert f"scancel {job_id}" in records(aborted)["job.abort"]["summary"], aborted.stdout
    assert _slurm(cluster, "squeue", "-h", "-j", job_id).strip() == ""
    assert not _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ"), "a process of the aborted train run is left"
    code, found, st = status()
    assert code == 103 and st["state"] == "aborted" and "CANCELLED" in found["job.slurm"]["summary"], found

    # the same command resubmits it: one job step over both nodes, torchrun's node rank Slurm's node id, the
    # rendezvous at node1's NodeAddr; once it has a checkpoint, node 1's trainer killed (an OOM kill, a lost GPU):
    # srun ends the step, and the run fails naming the node (Slurm's own end of a job, its time limit, is the job
    # array's test below: the same status path)
    again = specops(argv[0], "--inventory", inv, *argv[1:], "--detach", env=runs, timeout=180)
    assert "resubmitted" in records(again)["job.start"]["summary"], again.stdout[-3000:]
    code, found, st = wait(lambda r, st: (st.get("epoch") or 0) >= 1
                           or st.get("state") in ("done", "failed", "aborted"), timeout=240)
    assert st["state"] == "training" and st["epoch"] >= 1, st
    assert st["nodes"]["hosts"] == ["node1", "node2"] and st["nodes"]["master_addr"] == "127.0.0.1", st["nodes"]
    assert st["command"][:4] == ["srun", "--nodes", "2", "--ntasks"] and "--kill-on-bad-exit=1" in st["command"]
    def proc_bytes(pid: int, what: str) -> bytes:  # b"" once the process is gone
        try:
            return Path(f"/proc/{pid}/{what}").read_bytes()
        except OSError:
            return b""

    node_ranks = {node: [pid for pid in _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ")
                         if f"SLURM_NODEID={node}".encode() in proc_bytes(pid, "environ")
                         and b"_specops_cpu_train_launcher" in proc_bytes(pid, "cmdline")
                         and b"torch.distributed.run" not in proc_bytes(pid, "cmdline")]
                  for node in (0, 1)}
    assert len(node_ranks[0]) == len(node_ranks[1]) == 1, node_ranks  # a rank a node
    os.kill(node_ranks[1][0], 9)
    code, found, st = wait(lambda r, st: st.get("state") in ("failed", "done"), timeout=120)
    assert code == 100 and st["state"] == "failed" and st["error"]["node"] == {"rank": 1, "host": "node2"}, st
    assert st["error"]["message"].startswith("node 1 (node2) of the job's 2: "), st["error"]
    killed_at = st["step"]
    deadline = time.monotonic() + 60  # the job's own end follows its supervisor's record: then nothing is left
    while _slurm(cluster, "squeue", "-h", "-j", json.loads((run_dir / "slurm.json").read_text())["job_id"]).strip() \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ"), "a process of the failed train run is left"

    # the same command (unpaced, followed) resumes it from the trainer's last checkpoint to the end, then fetches
    inv = inventory()
    done = specops(argv[0], "--inventory", inv, *argv[1:], env=runs, timeout=300)
    final = records(done)
    assert done.returncode == 0 and final["train.run"]["status"] == "ok", done.stdout[-4000:] + done.stderr[-2000:]
    resumed_from = final["train.run"]["detail"]["resumed_from"]
    assert resumed_from and resumed_from["global_step"] > 0, final["train.run"]
    code, found, st = status()
    # from the checkpoint, not from the start: no step before it is trained again (the kill may land after the last
    # step, in the last epoch's validation or save)
    assert resumed_from["global_step"] <= killed_at and code == 0 and st["step"] == st["steps_total"] >= killed_at
    assert st["epoch"] == epochs - 1, st
    assert "COMPLETED" in found["job.slurm"]["summary"], found
    assert (tmp_path / "runs" / "th" / "d1" / "metrics.jsonl").read_text().count('"train"') >= st["steps_total"] // 2

    # eval runs on a compute node (srun), never on the login node: a copy of the draft with its aux ids off by one
    # is refused there before anything loads (a whole eval is the same task under srun, its servers started on
    # that node; a CPU server start is over this module's time budget)
    shifted = tmp_path / "shifted-draft"
    shutil.copytree(run_dir / "checkpoints" / str(epochs - 1), shifted)  # two ranks of 4 rows: no val, no best link
    config = json.loads((shifted / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    refused = specops("eval", "--inventory", inv, "--draft", shifted, "--from-run", states["run_id"], "--json",
                      env=runs, timeout=300)
    said = records(refused)
    assert refused.returncode == 1 and said["eval.draft_layer_ids"]["status"] == "fail", refused.stdout[-3000:]
    assert said["eval.node"]["status"] == "ok" and said["eval.node"]["detail"]["node"] in ("node1", "node2"), said
    assert "eval ran on compute node node" in said["eval.node"]["summary"]
    assert "JobName=specops-eval" in _slurm(cluster, "scontrol", "-o", "show", "job")


# --------------------------------------------------------------------------- a group plan as a job array

def test_a_group_plan_is_one_job_array_a_task_ended_by_its_time_limit_resumes_alone_abort_is_scancel_every_sample_once(
        cluster, make_inventory, tiny_models, tmp_path):
    """``slurm.array: 3`` over 7 samples: one ``sbatch --array=0,1,2`` (two nodes of one CPU: the third task waits),
    a running task ended by Slurm's time limit named by its ``JOBID_i``, the same command resubmitting only that
    shard, an abort of the array (scancel) leaving nothing, the resume that merges the shards into one manifest, and
    verify of the merged run on a compute node."""
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    host = _slurm_host(make_inventory, cluster, tiny_models, tmp_path, name="a1", array=3)
    host["max_samples"], host["batch_size"] = 7, 1
    # a sample each 20 s: shard 0 (3 samples, the second at 20 s, the third at 40 s) still extracting, with at most
    # two written, when slurmctld next checks time limits (every 30 s)
    host["env"]["SPECOPS_BATCH_DELAY_S"] = "20"
    inventory = make_inventory(**host)
    argv = ("extract", "--inventory", inventory, "--run-id", "a1", "--skip-preflight", "--skip-smoke", "--json")
    started = specops(*argv, "--detach", env=runs, timeout=120)
    start = records(started)["job.start"]
    run_dir = tmp_path / "work" / "runs" / "a1"
    job = json.loads((run_dir / "slurm.json").read_text())
    array_id = job["job_id"]
    assert start["status"] == "changed" and f"3 shards of 7 samples as Slurm job array {array_id}" in \
        start["summary"], started.stdout
    # one submission: one sbatch of the whole array; each task's run dir names its task as Slurm does (JOBID_i)
    assert "--array=0,1,2" in job["command"] and job["command"][0] == "sbatch", job
    assert json.loads((run_dir / "array.json").read_text())["ranges"] == [[0, 3], [3, 5], [5, 7]]
    assert [json.loads((run_dir / "tasks" / str(i) / "slurm.json").read_text())["job_id"] for i in range(3)] == [
        f"{array_id}_{i}" for i in range(3)]
    proc, found = _wait_status("a1", runs, inventory, lambda r: "extracting" in r["job.task0"]["summary"])
    assert f"Slurm job {array_id}_0 RUNNING on node" in found["job.task0"]["summary"], proc.stdout
    assert f"Slurm job {array_id}_2 PENDING" in found["job.task2"]["summary"] and proc.returncode == 101
    # shard 0's task ended by Slurm's own time limit (a limit it has passed: slurmctld ends it as TIMEOUT at its
    # next check): named by its JOBID_i with its fix; the others go on, and the run fails only once none still goes
    _slurm(cluster, "scontrol", "update", f"JobId={array_id}_0", "TimeLimit=0")
    proc, found = _wait_status("a1", runs, inventory, lambda r: " failed" in r["job.status"]["summary"]
                               and "TIMEOUT" in r["job.task0"]["summary"] and all(
                                   "COMPLETED" in r[f"job.task{i}"]["summary"] for i in (1, 2)), timeout=120)
    assert found["job.task0"]["status"] == "fail" and f"Slurm job {array_id}_0 TIMEOUT" in \
        found["job.task0"]["summary"] and "failed" in found["job.task0"]["summary"], proc.stdout
    assert "slurm.time_limit" in found["job.task0"]["fix"] and "run the same command again to resume" in \
        found["job.task0"]["fix"], found["job.task0"]
    for i, (lo, hi) in ((1, (3, 5)), (2, (5, 7))):
        assert found[f"job.task{i}"]["status"] == "ok" and f"shard {i} [{lo}, {hi}): done" in \
            found[f"job.task{i}"]["summary"] and "COMPLETED" in found[f"job.task{i}"]["summary"], proc.stdout
    said = json.loads(proc.stdout)["hosts"][0]["data"]["status"]
    assert proc.returncode == 100 and said["state"] == "failed" and said["error"]["message"].startswith(
        "shard 0 [0, 3]: ") and said["error"]["type"] == "SlurmTimeout", said
    out = tmp_path / "out-a1" / "a1"
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("data_*.pt")}
    assert {f"data_{i}.pt" for i in range(3, 7)} <= set(kept) and len(kept) < 7, kept

    # the same command resubmits only the shard not done (paced: there is a task to abort); abort = scancel of the
    # array: the task ends, the run is aborted, nothing of it is left
    paced = make_inventory(**host)  # still paced: its last sample may be its only one, still paused at the abort
    again = specops(*argv[:2], paced, *argv[3:], "--detach", env=runs, timeout=120)
    said = records(again)["job.start"]
    second = json.loads((run_dir / "slurm.json").read_text())
    assert "resubmitted shard(s) [0] of 3" in said["summary"] and "--array=0" in second["command"], again.stdout
    proc, found = _wait_status("a1", runs, paced, lambda r: "extracting" in r["job.task0"]["summary"])
    assert f"Slurm job {second['job_id']}_0 RUNNING" in found["job.task0"]["summary"], proc.stdout
    aborted = specops("abort", "--inventory", paced, "--run-id", "a1", "--json", env=runs, timeout=120)
    said = records(aborted)["job.abort"]
    assert said["status"] == "changed" and f"scancel {second['job_id']} (the job array" in said["summary"], \
        aborted.stdout
    assert _slurm(cluster, "squeue", "-h", "-r", "-j", second["job_id"]).strip() == ""
    assert not _pids_with(f"SPECOPS_RUN_DIR={run_dir}", "environ"), "a process of the aborted array is left"
    proc, found = _status("a1", runs, paced)
    assert proc.returncode == 103 and found["job.task0"]["status"] == "warn" and "aborted" in \
        found["job.task0"]["summary"], proc.stdout

    del host["env"]["SPECOPS_BATCH_DELAY_S"]
    argv = (*argv[:2], make_inventory(**host), *argv[3:])
    # the same command (followed) finishes the shard, merges the shards' manifests into one, and fetches it
    done = specops(*argv, env=runs, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    manifest = json.loads((tmp_path / "runs" / "th" / "a1" / "manifest.json").read_text())
    assert manifest["sample_ranges"] == [[0, 3], [3, 5], [5, 7]] and not manifest["missing"], manifest.keys()
    # every sample once: each of the dataset's first 7 rows in exactly one shard's manifest, none made again
    rows = [line for line in Path(tiny_models["dataset"]).read_text().splitlines() if line.strip()]
    assert len(rows) >= 7
    shard_files = [json.loads(p.read_text())["files"] for p in sorted(out.glob(".specops-shards/*/manifest.json"))]
    indices = sorted(int(Path(f["path"]).stem.split("_")[1]) for files in shard_files for f in files)
    assert indices == list(range(7)) == sorted(int(Path(f["path"]).stem.split("_")[1]) for f in manifest["files"])
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    # the run's logs are its tasks'
    logs = json.loads(specops("logs", "--inventory", argv[2], "--run-id", "a1", "--json", env=runs,
                              timeout=60).stdout)["logs"]["th"]
    assert {f"tasks/{i}/logs/supervisor.log" for i in range(3)} <= set(logs), sorted(logs)
    assert "test pause: 20 s" in logs["tasks/1/logs/supervisor.log"], logs["tasks/1/logs/supervisor.log"][-2000:]
    # shard 0's three attempts: the two paced ones paused, the last ran with the env of the call that resumed it
    assert logs["tasks/0/logs/supervisor.log"].count("[specops] test pause: 20 s after each batch") == 2

    # verify reads the array's run (its merged manifest) on the shared filesystem from a compute node (srun)
    checked = specops("verify", "--inventory", argv[2], "--run-id", "a1", "--samples", "2", "--json", env=runs,
                      timeout=300)
    said = records(checked)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert said["verify.node"]["status"] == "ok" and said["verify.node"]["detail"]["node"] in ("node1", "node2")
    assert all(r["status"] == "ok" for name, r in said.items() if name.startswith("verify.layer")), checked.stdout
    assert "JobName=specops-verify" in _slurm(cluster, "scontrol", "-o", "show", "job")


def test_a_job_array_the_cluster_or_the_dataset_cannot_take_is_refused_by_name_before_submission(
        cluster, make_inventory, tiny_models, tmp_path):
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    for run_id, array, samples, said in (
            ("big", MAX_ARRAY_SIZE + 1, 6, f"field 'slurm.array' is {MAX_ARRAY_SIZE + 1}: this cluster's "
                                            f"MaxArraySize is {MAX_ARRAY_SIZE}"),
            ("thin", 3, 2, "field 'slurm.array' is 3: more shards than the run's 2 sample(s)")):
        host = _slurm_host(make_inventory, cluster, tiny_models, tmp_path, name=run_id, array=array)
        host["max_samples"] = samples
        proc = specops("extract", "--inventory", make_inventory(**host), "--run-id", run_id, "--skip-preflight",
                       "--skip-smoke", "--detach", "--json", env=runs, timeout=120)
        start = records(proc)["job.start"]
        assert proc.returncode != 0 and start["status"] == "fail" and said in start["summary"], proc.stdout
        assert "set slurm.array to at most" in start["fix"]
        assert not (tmp_path / "work" / "runs" / run_id).exists(), "a refused array left a run dir"
        assert f"specops-{run_id}" not in _slurm(cluster, "squeue", "-h", "-o", "%j")
