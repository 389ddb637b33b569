"""One model replica over two hosts (vLLM's multi-node TP on the CPU test hosts), over real SSH.

Host ``a`` is the session's test sshd, host ``b`` an sshd of its own (so it can be killed):
one TP=2 replica of the tiny DeepSeek-V3 (and Llama), one core each, every rank on loopback.
Its stopped worker ranks, or a killed worker host, must fail the run naming it and leave nothing of
the run running on the head; the same command then resumes the replica, and the states must
equal a TP=2 run on one host within bf16 noise. A group run of two Llama replicas and a plain host
loses a host of each replica at once: ``a+b`` its worker host ``b`` (killed), ``c+d`` its head
(its own sshd, ``c``): the worker host d stops its ranks; the same command resumes ``a+b`` and
moves the rest of c's shard to the plain host, every sample once.

A CPU server start costs about a minute here: each run carries as many of the cases as its
scenario allows (a loss, then the resume or the move that completes it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port_pair
from specops.testhost.sshd import TestHost
from test_group_remote import kill_host, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def host_b(tmp_path_factory):
    host = TestHost(name=f"pytest-replica-{os.getpid()}", root=tmp_path_factory.mktemp("host-b"))
    host.up()
    yield host
    host.destroy()


def _base_env() -> dict:
    from specops.testhost.hostenv import cache_root

    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1",
            "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}


def cli(*args, runs: Path, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", "SPECOPS_RUNS": str(runs)})


def replica_inventory(tmp_path: Path, testhost: dict, host_b: TestHost, python, tiny_models, env=None,
                      model: str = "llama", detached: bool = False) -> Path:
    """Hosts ``a`` (the session's sshd) and ``b`` (its own sshd) as replica ``pair`` (head ``a``), one core each.

    :param detached: one sample a batch and a 3 s pause after each, so a run stays in its
        extraction long enough to lose a host (or a rank) mid-way.
    """
    base_env = {**_base_env(), **({"SPECOPS_BATCH_DELAY_S": "3"} if detached else {}), **(env or {})}
    doc = {"hosts": {"a": host_entry(tmp_path, testhost, "a", "0", python, tiny_models, model, base_env),
                     "b": host_entry(tmp_path, host_b.info(), "b", "1", python, tiny_models, model, base_env)},
           "replicas": {"pair": {"hosts": ["a", "b"], "tp": 2, "master_port": free_port_pair()}}}
    if detached:
        for entry in doc["hosts"].values():
            entry["batch_size"] = 1
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def host_entry(tmp_path: Path, info: dict, name: str, core: str, python, tiny_models, model: str, env: dict) -> dict:
    """One test host of the inventory: its own work and output dirs under ``tmp_path/name``, bound to ``core``
    (one core each, as two one-core hosts would have)."""
    return {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
            "known_hosts": info["known_hosts"], "python": str(python),
            "work_dir": str(tmp_path / name / "work"), "output_dir": str(tmp_path / name / "out"),
            "model_path": str(tiny_models[model]), "dataset": str(tiny_models["dataset"]),
            "device": "cpu", "connect_timeout": 5, "seq_len": 128, "max_samples": 4, "batch_size": 4,
            "env": {**env, "VLLM_CPU_OMP_THREADS_BIND": core}}


def hs_files(root: Path) -> dict[int, Path]:
    return {int(p.stem.split("_")[1]): p for p in root.rglob("hs_*.safetensors")}


def run_processes(run_dir: Path) -> list[int]:
    from remote.system import procscan

    return procscan.live_pids(env_any={f"SPECOPS_RUN_DIR={run_dir}".encode()})


def state_of(run_dir: Path) -> dict:
    """A host's ``status.json`` of a run ({} while it is being written or not there)."""
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def start_detached(inventory: Path, runs: Path, on: str, run_id: str, *args: str) -> None:
    started = cli("extract", "--inventory", str(inventory), "--on", on, "--run-id", run_id, "--skip-smoke",
                  "--skip-preflight", "--detach", "--json", *args, runs=runs)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]


def wait_first_sample(head_dir: Path) -> None:
    """Until the head's run has a sample on disk (it is then extracting, every host joined)."""
    wait_for(lambda: (state_of(head_dir).get("samples_done") or 0) >= 1 or state_of(head_dir).get("state") == "failed",
             timeout=900, what=f"the first sample of {head_dir}")
    assert state_of(head_dir).get("state") == "extracting", state_of(head_dir)


def kill_whole_host(sshd: TestHost, run_dir: Path) -> None:
    """The host dies: its sshd, its sessions, the run's supervisor group, and its vLLM processes (a session
    of their own on a head; retitled ranks no longer show the run's environment, their group does)."""
    groups = {os.getpgid(pid) for pid in run_processes(run_dir)}
    kill_host(sshd, run_dir)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in run_processes(run_dir):
        os.kill(pid, signal.SIGKILL)


def test_preflight_checks_the_replica_on_every_host_at_once(tmp_path, testhost, host_b, modern_fixed_python,
                                                            tiny_models):
    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models)
    proc = cli("preflight", "--inventory", str(inventory), "--on", "pair", "--json", runs=tmp_path / "runs")
    reports = {r["host"]: r for r in json.loads(proc.stdout)["hosts"]}
    replica = {r["name"]: r for r in reports["replica pair"]["records"]}
    for name in ("replica.hosts", "replica.versions", "replica.model", "replica.devices", "replica.master_port",
                 "replica.clock"):
        assert replica[name]["status"] == "ok", (name, replica[name]["summary"])
    assert "VLLM_CPU_OMP_THREADS_BIND=1" in replica["replica.network"]["summary"]
    # both hosts' checks ran at once: each host's own start/end (one clock here) overlap, and so do the
    # laptop's calls; checks one after another would give disjoint windows
    ran = replica["replica.hosts"]["detail"]["ran"]
    calls = replica["replica.hosts"]["detail"]["calls"]
    assert sorted(ran) == sorted(calls) == ["a", "b"]
    print(f"\nreplica probes: {ran}")
    assert max(w["started"] for w in ran.values()) < min(w["ended"] for w in ran.values()), ran
    assert max(c["sent"] for c in calls.values()) < min(c["received"] for c in calls.values()), calls
    assert "2 of 2 hosts answered, checked at once" in replica["replica.hosts"]["summary"]
    # one clock here: the calls' round trips bound the skew, and no skew is shown
    assert replica["replica.clock"]["detail"]["skew_at_least_s"] == 0, replica["replica.clock"]
    # each host's own preflight judged its share of the ranks (1 of TP 2), not the whole TP: its devices, and its
    # one core range of VLLM_CPU_OMP_THREADS_BIND
    for host in ("a", "b"):
        checks = {r["name"]: r for r in reports[host]["records"]}
        devices = checks["parallel.devices"]
        assert devices["status"] == "ok" and devices["detail"]["tp"] == 1, devices
        threads = checks["host.cpu_threads"]
        assert threads["status"] == "ok" and "1 rank(s) of TP=2 on this host" in threads["summary"], threads


def stop_the_worker_ranks(head_dir: Path, worker_dir: Path) -> None:
    """SIGSTOP every vLLM process of worker host ``b`` mid-run: the head's run fails naming it, and both
    hosts' processes end."""
    from remote.system import procscan

    supervisor = int((worker_dir / "pid").read_text())
    # the host's vLLM processes run in its supervisor's process group (its retitled workers no longer show
    # the run's environment in /proc): every one of them hangs (SIGSTOP); the supervisor still runs
    group = {*procscan.live_pids(pgrp=os.getpgid(supervisor)), *run_processes(worker_dir)}
    ranks = sorted(pid for pid in group if pid != supervisor)
    assert ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: state_of(head_dir).get("state") == "failed", timeout=300, what="the head's run to fail")
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    error = state_of(head_dir)["error"]
    assert error["host"] == "b" and error["rank"] == 1 and error["type"] == "RanksStopped", error
    assert "stopped" in error["message"] and "on b" in error["message"]
    for run_dir in (head_dir, worker_dir):
        wait_for(lambda: not run_processes(run_dir), timeout=120, what=f"{run_dir}'s processes to end")


def test_two_hosts_one_tp2_replica_equal_one_host_tp2(tmp_path, testhost, host_b, modern_fixed_python, tiny_models,
                                                      modern_ssh_run):
    """One TP=2 replica of the DeepSeek-V3 over two hosts, its worker host's ranks stopped mid-way: the run
    fails naming the host, the same command resumes the replica as one shard after the samples on disk, and
    the states equal a TP=2 run on one host within bf16 noise. (The Llama's replica, its worker host killed,
    is the group run's replica ``pair``: test_a_group_run_of_two_replicas_and_a_plain_host_writes_every_sample_once.)"""
    from conftest import SHARED_RUN_LAYER_IDS

    model = "deepseek_v3"
    # the product holds a stopped rank 10 s before it fails the run; 2 s prove the same
    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models, model=model,
                                  detached=True, env={"SPECOPS_STOPPED_GRACE_S": "2"})
    runs = tmp_path / "runs"
    ids = SHARED_RUN_LAYER_IDS[model]  # the ids of the one-host run it is compared with
    t0 = time.monotonic()
    start_detached(inventory, runs, "pair", "rep1", "--layer-ids", "input:" + ",".join(map(str, ids)))
    head_dir, worker_dir = (tmp_path / h / "work" / "runs" / "rep1" for h in ("a", "b"))
    wait_first_sample(head_dir)
    stop_the_worker_ranks(head_dir, worker_dir)
    # the same command resumes the replica as one shard, after the samples on disk (preflight on)
    proc = cli("extract", "--inventory", str(inventory), "--run-id", "rep1", "--skip-smoke", "--tensors", "--json",
               runs=runs)
    print(f"\n{model}: replica extract over two hosts, its worker ranks stopped and resumed: "
          f"{time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert state_of(head_dir)["resumed_from"] >= 1
    group_doc = json.loads((runs / "rep1" / "group.json").read_text())
    assert [s["hosts"] for s in group_doc["shards"]] == [["a", "b"]]
    replica_ran_headless_on_the_worker(tmp_path, head_dir, worker_dir)
    assert_equal_states(modern_fixed_python, hs_files(modern_ssh_run(model, 2)["dest"]), hs_files(runs / "rep1"))


def replica_ran_headless_on_the_worker(tmp_path: Path, head_dir: Path, worker_dir: Path) -> None:
    """The worker host ``b`` ran its ranks headless under the same run id and ended with the head ``a``."""
    worker = state_of(worker_dir)
    assert worker["state"] == "done" and worker["replica"]["ranks"] == [1], worker
    head_log = (head_dir / "logs" / "server.log").read_text()
    assert "--nnodes 2 --node-rank 0" in head_log
    worker_log = (worker_dir / "logs" / "server.log").read_text()
    assert "--headless" in worker_log and "--node-rank 1" in worker_log
    assert not hs_files(tmp_path / "b" / "out"), "states are written on the head only"
    for run_dir in (head_dir, worker_dir):  # a done supervisor may still be closing its server
        wait_for(lambda: not run_processes(run_dir), timeout=120, what=f"the run's processes in {run_dir} to end")


def assert_equal_states(python, one_host: dict[int, Path], two_hosts: dict[int, Path]) -> None:
    """Samples 0-3 of a replica over two hosts equal a TP=2 run on one host's within bf16 noise."""
    assert sorted(two_hosts) == sorted(one_host) == [0, 1, 2, 3]
    # read with the host env's torch (the controller has none)
    compare = subprocess.run([str(python), "-c", COMPARE, json.dumps(
        [[str(one_host[i]), str(two_hosts[i])] for i in sorted(one_host)])], capture_output=True, text=True,
        timeout=300)
    assert compare.returncode == 0, compare.stderr[-3000:]
    for i, found in enumerate(json.loads(compare.stdout)):
        print(f"hs_{i}: max |diff| {found['worst']:.3g} of max |state| {found['scale']:.3g}, "
              f"{found['equal_fraction']:.4f} of values bit-equal")
        assert found["same_tokens"] and found["same_shape"], found
        # bf16 noise: partial sums added in another order move a value by an ulp or so
        assert found["worst"] <= 2 ** -6 * found["scale"], (i, found)


def logs_and_fetch_name_every_host(inventory: Path, runs: Path, run_id: str, shard: str) -> None:
    """``specops logs`` and ``specops fetch`` of a run show each host of its replica ``shard`` (head ``a``, worker
    ``b``) by its own logs, named by host: the head's, and the worker host's headless ranks' (on that host only)."""
    logs = cli("logs", "--inventory", str(inventory), "--run-id", run_id, "--json", runs=runs)
    assert logs.returncode == 0, logs.stdout[-4000:] + logs.stderr[-4000:]
    by_host = json.loads(logs.stdout)["logs"]
    assert sorted(k for k in by_host if k.startswith(f"{shard}@")) == [f"{shard}@a", f"{shard}@b"], sorted(by_host)
    assert "replica: b (node 1, ranks [1]) joined" in by_host[f"{shard}@a"]["supervisor.log"]
    assert "ranks [1] of replica pair started headless" in by_host[f"{shard}@b"]["supervisor.log"]
    assert "Worker_TP1" in by_host[f"{shard}@b"]["rank1.log"]
    assert "rank1.log" not in by_host[f"{shard}@a"]
    # the run's own fetch brought them; fetch them again from nothing
    hosts = runs / run_id / "hosts"
    shutil.rmtree(hosts)
    fetched = cli("fetch", "--inventory", str(inventory), "--run-id", run_id, "--json", runs=runs)
    assert fetched.returncode == 0, fetched.stdout[-4000:] + fetched.stderr[-4000:]
    worker, head = hosts / "b" / run_id, hosts / "a" / run_id
    assert "ranks [1] of replica pair started headless" in (worker / "logs" / "supervisor.log").read_text()
    assert "--headless" in (worker / "logs" / "server.log").read_text()
    assert json.loads((worker / "status.json").read_text())["replica"]["ranks"] == [1]
    assert "--nnodes 2 --node-rank 0" in (head / "logs" / "server.log").read_text()


COMPARE = """
import json, sys
from safetensors.torch import load_file
out = []
for ref_path, got_path in json.loads(sys.argv[1]):
    ref, got = load_file(ref_path), load_file(got_path)
    a, b = ref["hidden_states"].float(), got["hidden_states"].float()
    same_shape = a.shape == b.shape
    out.append({"same_tokens": bool((ref["token_ids"] == got["token_ids"]).all()), "same_shape": same_shape,
                "worst": (a - b).abs().max().item() if same_shape else None, "scale": a.abs().max().item(),
                "equal_fraction": (a == b).float().mean().item() if same_shape else 0.0})
print(json.dumps(out))
"""


def test_abort_takes_every_hosts_processes_down(tmp_path, testhost, host_b, modern_fixed_python, tiny_models):
    """A running replica, as seen while its head is out of the laptop's reach: the worker host's supervisor is
    known alive (the same command re-attaches to it, ``status`` names its ranks and writes no failure over it),
    and ``abort`` still reaches it; the head, which the laptop cannot reach, then ends the replica aborted by
    itself, naming the worker host. Nothing of the run is left on either host."""
    from remote.system import procscan

    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models, detached=True)
    doc = yaml.safe_load(inventory.read_text())
    for entry in doc["hosts"].values():  # a long extraction: the looks below happen while it runs
        entry["max_samples"] = 24
    inventory.write_text(yaml.safe_dump(doc))
    runs = tmp_path / "runs"
    start_detached(inventory, runs, "pair", "rep4")
    head_dir, worker_dir = (tmp_path / h / "work" / "runs" / "rep4" for h in ("a", "b"))
    wait_first_sample(head_dir)
    # every process of the run on both hosts, the vLLM servers' process groups included (vLLM retitles its
    # workers, and a retitled process no longer shows the run's environment in /proc)
    groups = {os.getpgid(pid) for run_dir in (head_dir, worker_dir) for pid in run_processes(run_dir)}
    assert len(groups) >= 3  # each host's supervisor's group, and the head's server's own
    supervisor = {h: int((d / "pid").read_text()) for h, d in (("a", head_dir), ("b", worker_dir))}

    def left() -> list[int]:
        return sorted({*run_processes(head_dir), *run_processes(worker_dir),
                       *(pid for group in groups for pid in procscan.live_pids(pgrp=group))})

    def worker_supervisors() -> list[int]:
        return sorted(pid for pid in run_processes(worker_dir)
                      if b"remote.extract.replica" in Path(f"/proc/{pid}/cmdline").read_bytes())

    # the same command again re-attaches to both hosts' runs: no second supervisor (nor its second set of ranks)
    start_detached(inventory, runs, "pair", "rep4")
    assert {h: int((d / "pid").read_text()) for h, d in (("a", head_dir), ("b", worker_dir))} == supervisor
    assert worker_supervisors() == [supervisor["b"]], worker_supervisors()
    # the head out of the laptop's reach (its sshd's port closed to it): the worker host still answers for itself
    unreachable = tmp_path / "head-unreachable.yaml"
    doc["hosts"]["a"]["port"] = free_port_pair()
    unreachable.write_text(yaml.safe_dump(doc))
    status = cli("status", "--inventory", str(unreachable), "--run-id", "rep4", "--json", runs=runs)
    assert status.returncode != 0 and "b: ranks [1] extracting" in status.stdout, status.stdout[-4000:]
    worker = state_of(worker_dir)
    assert worker["state"] == "extracting" and worker["error"] is None, worker
    aborted = cli("abort", "--inventory", str(unreachable), "--run-id", "rep4", "--json", runs=runs)
    assert aborted.returncode != 0, aborted.stdout[-4000:]  # the head did not answer: said so
    assert "job.abort@b" in aborted.stdout, aborted.stdout[-4000:]
    assert state_of(worker_dir)["state"] == "aborted", state_of(worker_dir)
    # the head runs on without its worker's ranks for no longer than its current batch
    wait_for(lambda: state_of(head_dir).get("state") in ("aborted", "failed", "done"), timeout=120,
             what="the head's run to end")
    head = state_of(head_dir)
    assert head["state"] == "aborted", head
    assert head["error"]["type"] == "Aborted" and head["error"]["host"] == "b", head["error"]
    assert "ranks [1] on b aborted by request" in head["error"]["message"], head["error"]
    # a process SIGKILLed a moment ago may still be on its way out; none may stay
    gone_or_going = {pid: (procscan.stat_fields(pid) or ["gone"])[0] for pid in left()}
    print(f"\nright after abort: {gone_or_going or 'nothing left'}")
    wait_for(lambda: not left(), timeout=60, what=f"the run's processes to end (left: {left()})")
    # every host in reach again: an abort of the ended replica changes nothing
    again = cli("abort", "--inventory", str(inventory), "--run-id", "rep4", "--json", runs=runs)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert state_of(head_dir)["state"] == "aborted" and state_of(worker_dir)["state"] == "aborted"


@pytest.fixture
def host_c(tmp_path_factory):
    """A third sshd of its own: the head of the group run's second replica, so it can die."""
    host = TestHost(name=f"pytest-replica-c-{os.getpid()}", root=tmp_path_factory.mktemp("host-c"))
    host.up()
    yield host
    host.destroy()


def test_a_group_run_of_two_replicas_and_a_plain_host_writes_every_sample_once(tmp_path, testhost, host_b, host_c,
                                                                               modern_fixed_python, tiny_models,
                                                                               modern_ssh_run):
    """Four test hosts as two TP=2 replicas of the tiny Llama (a+b; c+d, head c on an sshd of its own, d on a's)
    and host e alone at TP=1: one group run, the dataset sharded by replica. Each replica loses a host mid-way.
    Replica a+b its worker host (b killed, sshd and ranks): the head's run fails naming b and leaves nothing
    running on the head. Replica c+d its head (host c killed): its worker host d stops its ranks and says the
    head is gone. Status names both. The same command with ``--reassign`` moves the rest of c's shard to e and
    resumes a+b after the samples on disk: every sample once, none twice, none lost, and a+b's states equal a
    TP=2 run on one host within bf16 noise. (One group run carries both losses: a server start is most of a
    test's time here.)"""
    from remote.system import procscan

    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models)
    doc = yaml.safe_load(inventory.read_text())
    hosts = doc["hosts"]
    env = hosts["a"]["env"]
    for name, info, core in (("c", host_c.info(), "0"), ("d", testhost, "1"), ("e", testhost, "0,1")):
        hosts[name] = host_entry(tmp_path, info, name, core, modern_fixed_python, tiny_models, "llama", env)
    # the replicas that lose a host pause after each one-sample batch, so each is lost mid-way; e runs at speed
    for name in ("a", "b", "c"):
        hosts[name].update(batch_size=1, env={**hosts[name]["env"], "SPECOPS_BATCH_DELAY_S": "6"})
    for name in hosts:
        hosts[name]["max_samples"] = 12
    second = free_port_pair()
    while abs(second - doc["replicas"]["pair"]["master_port"]) < 2:
        second = free_port_pair()
    doc["replicas"]["other"] = {"hosts": ["c", "d"], "tp": 2, "master_port": second}
    inventory.write_text(yaml.safe_dump(doc))
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    start_detached(inventory, runs, "pair,other,e", "grp", "--shard-by", "equal")
    group_doc = json.loads((runs / "grp" / "group.json").read_text())
    assert [(s["hosts"], s["start"], s["stop"]) for s in group_doc["shards"]] == [
        (["a", "b"], 0, 4), (["c", "d"], 4, 8), (["e"], 8, 12)]
    run_dir = {h: tmp_path / h / "work" / "runs" / "grp" for h in hosts}
    # each replica loses its host once its own head has a sample (their servers come up some seconds apart)
    wait_first_sample(run_dir["a"])
    killed = []  # (sshd, its port): brought back after
    try:
        # the lost worker host: b's sshd, its sessions, the run's supervisor group and its vLLM ranks (a session
        # of their own)
        killed.append((host_b, host_b.port))
        kill_host(host_b, run_dir["b"])
        for pid in run_processes(run_dir["b"]):
            os.kill(pid, signal.SIGKILL)
        # the dead head: host c (sshd, sessions, supervisor, server)
        wait_first_sample(run_dir["c"])
        worker_group = os.getpgid(int((run_dir["d"] / "pid").read_text()))  # d's supervisor and its ranks
        killed.append((host_c, host_c.port))
        kill_whole_host(host_c, run_dir["c"])
        wait_for(lambda: state_of(run_dir["a"]).get("state") == "failed", timeout=300,
                 what="the head of the replica that lost its worker host to fail")
        error = state_of(run_dir["a"])["error"]
        assert error["host"] == "b" and error["rank"] == 1 and error["type"] == "HostLost", error
        assert "host b" in error["message"]
        wait_for(lambda: state_of(run_dir["d"]).get("state") == "failed", timeout=120,
                 what="the worker host of the dead head to fail")
        error = state_of(run_dir["d"])["error"]
        assert error["type"] == "HeadLost" and "the head c's supervisor is gone" in error["message"], error
        assert error["host"] == "d" and error["ranks"] == [1], error
        # d's ranks stop, not linger; nothing of the run is left running on head a
        wait_for(lambda: not run_processes(run_dir["d"]) and not procscan.live_pids(pgrp=worker_group),
                 timeout=60, what="the worker host's ranks to end")
        wait_for(lambda: not run_processes(run_dir["a"]), timeout=60, what="head a's processes to end")
        status = cli("status", "--inventory", str(inventory), "--run-id", "grp", "--json", runs=runs)
        assert status.returncode != 0
        assert "host b" in status.stdout, status.stdout[-4000:]
        assert "the head c's supervisor is gone" in status.stdout, status.stdout[-4000:]
    finally:
        for sshd, port in killed:
            sshd.up(port=port)
    kept = sorted(hs_files(tmp_path / "c" / "out"))
    assert kept and kept[0] == 4, kept
    kept_a = sorted(hs_files(tmp_path / "a" / "out"))
    assert kept_a and kept_a[0] == 0, kept_a
    # the pauses are a fault point, not part of the run: the resume goes at speed
    for name in ("a", "b", "c"):
        hosts[name]["env"].pop("SPECOPS_BATCH_DELAY_S")
    inventory.write_text(yaml.safe_dump(doc))
    # the rest of the dead head's shard moves to e (after e's own shard); a+b resumes its own (preflight on)
    moved = cli("extract", "--inventory", str(inventory), "--run-id", "grp", "--reassign", "other=e", "--skip-smoke",
                "--tensors", "--json", runs=runs, timeout=1500)
    print(f"\ntwo replicas and a host, one group run, a worker host and a head lost, the rest moved and resumed: "
          f"{time.monotonic() - t0:.0f} s")
    assert moved.returncode == 0, moved.stdout[-6000:] + moved.stderr[-4000:]
    assert state_of(run_dir["a"])["resumed_from"] >= 1
    group_doc = json.loads((runs / "grp" / "group.json").read_text())
    shards = {tuple(s["hosts"]): (s["start"], s["stop"]) for s in group_doc["shards"] if s["stop"] > s["start"]}
    cut = shards[("c", "d")][1]
    assert cut == kept[-1] + 1, (cut, kept)  # cut where c's disk said
    assert sorted(group_ranges(group_doc)) == sorted([(0, 4, ("a", "b")), (4, cut, ("c", "d")), (8, 12, ("e",))] + (
        [(cut, 8, ("e",))] if cut < 8 else [])), group_doc["shards"]
    merged = json.loads((runs / "grp" / "manifest.json").read_text())
    indices = sorted(int(Path(f["path"]).stem.split("_")[1]) for f in merged["files"]
                     if Path(f["path"]).name.startswith("hs_"))
    assert indices == list(range(12)), indices
    assert sorted(hs_files(runs / "grp" / "samples")) == list(range(12))
    # on the hosts' disks: every index made once, by the shard that holds it
    on_disk = [*hs_files(tmp_path / "a" / "out"), *hs_files(tmp_path / "c" / "out"), *hs_files(tmp_path / "e" / "out")]
    assert sorted(on_disk) == list(range(12)), sorted(on_disk)
    assert not hs_files(tmp_path / "d" / "out")  # the workers' ranks ran headless and wrote nothing
    replica_ran_headless_on_the_worker(tmp_path, run_dir["a"], run_dir["b"])
    # replica a+b's samples, made over two hosts before and after the loss, equal one host's TP=2 run
    assert_equal_states(modern_fixed_python, hs_files(modern_ssh_run("llama", 2)["dest"]),
                        hs_files(tmp_path / "a" / "out"))
    pair_shard = next(s["id"] for s in group_doc["shards"] if s["hosts"] == ["a", "b"])
    logs_and_fetch_name_every_host(inventory, runs, "grp", pair_shard)


def group_ranges(group_doc: dict) -> list[tuple]:
    return [(s["start"], s["stop"], tuple(s["hosts"])) for s in group_doc["shards"] if s["stop"] > s["start"]]
