"""One model replica over two hosts (vLLM's multi-node TP on the CPU test hosts), over real SSH.

Host ``a`` is the session's test sshd, host ``b`` an sshd of its own (so it can be killed):
one TP=2 replica of the tiny Llama, one core each, every rank on loopback. The states must
equal a TP=2 run on one host within bf16 noise; a killed worker host must fail the run
naming it, and leave nothing of the run running on the head.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specops.testhost.sshd import TestHost
from test_fleet_remote import kill_host, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.vllm


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the master port and specops' watch of the hosts)."""
    for _ in range(50):
        with socket.socket() as one:
            one.bind(("127.0.0.1", 0))
            port = one.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as two:
                try:
                    two.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two free consecutive loopback ports")


@pytest.fixture(scope="module")
def host_b(tmp_path_factory):
    host = TestHost(name=f"pytest-replica-{os.getpid()}", root=tmp_path_factory.mktemp("host-b"))
    host.up()
    yield host
    host.destroy()


def cli(*args, runs: Path, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", "SPECOPS_RUNS": str(runs)})


def replica_inventory(tmp_path: Path, testhost: dict, host_b: TestHost, python, tiny_models, env=None,
                      model: str = "llama") -> Path:
    from specops.testhost.hostenv import cache_root

    base_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1",
                "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache"), **(env or {})}

    def host(info: dict, name: str, core: str) -> dict:
        return {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
                "known_hosts": info["known_hosts"], "python": str(python),
                "work_dir": str(tmp_path / name / "work"), "output_dir": str(tmp_path / name / "out"),
                "model_path": str(tiny_models[model]), "dataset": str(tiny_models["dataset"]),
                "device": "cpu", "connect_timeout": 5, "seq_len": 128, "max_samples": 4, "batch_size": 4,
                # one core each, as two one-core hosts would have
                "env": {**base_env, "VLLM_CPU_OMP_THREADS_BIND": core}}

    doc = {"hosts": {"a": host(testhost, "a", "0"), "b": host(host_b.info(), "b", "1")},
           "replicas": {"pair": {"hosts": ["a", "b"], "tp": 2, "master_port": free_port_pair()}}}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def hs_files(root: Path) -> dict[int, Path]:
    return {int(p.stem.split("_")[1]): p for p in root.rglob("hs_*.safetensors")}


def run_processes(run_dir: Path) -> list[int]:
    from remote import procscan

    return procscan.live_pids(env_any={f"SPECOPS_RUN_DIR={run_dir}".encode()})


def test_preflight_checks_the_replica_on_every_host_at_once(tmp_path, testhost, host_b, modern_fixed_python,
                                                            tiny_models):
    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models)
    proc = cli("preflight", "--inventory", str(inventory), "--on", "pair", "--json", runs=tmp_path / "runs")
    reports = {r["host"]: r for r in json.loads(proc.stdout)["hosts"]}
    replica = {r["name"]: r for r in reports["replica pair"]["records"]}
    for name in ("replica.versions", "replica.model", "replica.devices", "replica.master_port", "replica.clock"):
        assert replica[name]["status"] == "ok", (name, replica[name]["summary"])
    assert "VLLM_CPU_OMP_THREADS_BIND=1" in replica["replica.network"]["summary"]
    # each host's own preflight judged its share of the ranks (1 of TP 2), not the whole TP
    for host in ("a", "b"):
        devices = {r["name"]: r for r in reports[host]["records"]}["parallel.devices"]
        assert devices["status"] == "ok" and devices["detail"]["tp"] == 1, devices


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_two_hosts_one_tp2_replica_equal_one_host_tp2(tmp_path, testhost, host_b, modern_fixed_python, tiny_models,
                                                      modern_ssh_run, model):
    from conftest import SHARED_RUN_LAYER_IDS

    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models, model=model)
    runs = tmp_path / "runs"
    ids = SHARED_RUN_LAYER_IDS.get(model)  # the ids of the one-host run it is compared with
    t0 = time.monotonic()
    proc = cli("extract", "--inventory", str(inventory), "--on", "pair", "--run-id", "rep1", "--skip-smoke",
               "--tensors", "--json", *(["--layer-ids", "input:" + ",".join(map(str, ids))] if ids else []),
               runs=runs)
    print(f"\n{model}: replica extract over two hosts: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    fleet = json.loads((runs / "rep1" / "fleet.json").read_text())
    assert [s["hosts"] for s in fleet["shards"]] == [["a", "b"]]
    # the worker host ran its ranks headless under the same run id, and ended with the head
    worker = json.loads((tmp_path / "b" / "work" / "runs" / "rep1" / "status.json").read_text())
    assert worker["state"] == "done" and worker["replica"]["ranks"] == [1], worker
    head_log = (tmp_path / "a" / "work" / "runs" / "rep1" / "logs" / "server.log").read_text()
    assert "--nnodes 2 --node-rank 0" in head_log
    worker_log = (tmp_path / "b" / "work" / "runs" / "rep1" / "logs" / "server.log").read_text()
    assert "--headless" in worker_log and "--node-rank 1" in worker_log
    assert not hs_files(tmp_path / "b" / "out"), "states are written on the head only"
    for host in ("a", "b"):  # a done supervisor may still be closing its server
        wait_for(lambda: not run_processes(tmp_path / host / "work" / "runs" / "rep1"), timeout=120,
                 what=f"the run's processes on {host} to end")

    one_host = hs_files(modern_ssh_run(model, 2)["dest"])
    two_hosts = hs_files(runs / "rep1")
    assert sorted(two_hosts) == sorted(one_host) == [0, 1, 2, 3]
    # read with the host env's torch (the controller has none)
    compare = subprocess.run([str(modern_fixed_python), "-c", COMPARE, json.dumps(
        [[str(one_host[i]), str(two_hosts[i])] for i in sorted(one_host)])], capture_output=True, text=True,
        timeout=300)
    assert compare.returncode == 0, compare.stderr[-3000:]
    for i, found in enumerate(json.loads(compare.stdout)):
        print(f"hs_{i}: max |diff| {found['worst']:.3g} of max |state| {found['scale']:.3g}, "
              f"{found['equal_fraction']:.4f} of values bit-equal")
        assert found["same_tokens"] and found["same_shape"], found
        # bf16 noise: partial sums added in another order move a value by an ulp or so
        assert found["worst"] <= 2 ** -6 * found["scale"], (i, found)


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


def test_killed_worker_host_fails_the_run_naming_it(tmp_path, testhost, host_b, modern_fixed_python, tiny_models):
    # a pause after each batch keeps the run in its extraction long enough to lose a host mid-way
    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models,
                                  env={"SPECOPS_BATCH_DELAY_S": "3"})
    runs = tmp_path / "runs"
    inv = yaml.safe_load(inventory.read_text())
    inv["hosts"]["a"]["batch_size"] = inv["hosts"]["b"]["batch_size"] = 1
    inventory.write_text(yaml.safe_dump(inv))
    started = cli("extract", "--inventory", str(inventory), "--on", "pair", "--run-id", "rep2", "--skip-smoke",
                  "--skip-preflight", "--detach", "--json", runs=runs)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
    head_dir, worker_dir = (tmp_path / h / "work" / "runs" / "rep2" for h in ("a", "b"))

    def head_state() -> dict:
        try:
            return json.loads((head_dir / "status.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    wait_for(lambda: (head_state().get("samples_done") or 0) >= 1 or head_state().get("state") == "failed",
             timeout=900, what="the replica's first sample")
    assert head_state().get("state") == "extracting", head_state()
    port = host_b.port
    try:
        kill_host(host_b, worker_dir)  # sshd, its sessions, the run's supervisor group
        for pid in run_processes(worker_dir):  # and the host's vLLM ranks (a session of their own)
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: head_state().get("state") == "failed", timeout=300, what="the head's run to fail")
        error = head_state()["error"]
        assert error["host"] == "b" and error["rank"] == 1 and error["type"] == "HostLost", error
        assert "host b" in error["message"]
        status = cli("status", "--inventory", str(inventory), "--run-id", "rep2", "--json", runs=runs)
        assert status.returncode != 0
        assert "host b" in status.stdout
        wait_for(lambda: not run_processes(head_dir), timeout=60, what="the head's processes to end")
    finally:
        host_b.up(port=port)
    # the host is back: the same command resumes the replica as one shard, after the samples on disk
    resumed = cli("extract", "--inventory", str(inventory), "--run-id", "rep2", "--skip-smoke", "--tensors", "--json",
                  runs=runs)
    assert resumed.returncode == 0, resumed.stdout[-6000:] + resumed.stderr[-4000:]
    assert sorted(hs_files(runs / "rep2" / "samples")) == [0, 1, 2, 3]
    assert json.loads((head_dir / "status.json").read_text())["resumed_from"] >= 1
    assert json.loads((worker_dir / "status.json").read_text())["state"] == "done"


def start_detached(tmp_path, testhost, host_b, python, tiny_models, run_id: str):
    """A replica run started detached, paused 3 s after each one-sample batch; returns (inventory, runs, head
    status reader, head run dir, worker run dir) once its first sample is on disk."""
    inventory = replica_inventory(tmp_path, testhost, host_b, python, tiny_models, env={"SPECOPS_BATCH_DELAY_S": "3"})
    inv = yaml.safe_load(inventory.read_text())
    inv["hosts"]["a"]["batch_size"] = inv["hosts"]["b"]["batch_size"] = 1
    inventory.write_text(yaml.safe_dump(inv))
    runs = tmp_path / "runs"
    started = cli("extract", "--inventory", str(inventory), "--on", "pair", "--run-id", run_id, "--skip-smoke",
                  "--skip-preflight", "--detach", "--json", runs=runs)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
    head_dir, worker_dir = (tmp_path / h / "work" / "runs" / run_id for h in ("a", "b"))

    def state_of(run_dir: Path) -> dict:
        try:
            return json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    wait_for(lambda: (state_of(head_dir).get("samples_done") or 0) >= 1 or state_of(head_dir).get("state") == "failed",
             timeout=900, what="the replica's first sample")
    assert state_of(head_dir).get("state") == "extracting", state_of(head_dir)
    return inventory, runs, state_of, head_dir, worker_dir


def test_a_stopped_rank_on_a_worker_host_fails_the_run_naming_it(tmp_path, testhost, host_b, modern_fixed_python,
                                                                  tiny_models):
    inventory, runs, state_of, head_dir, worker_dir = start_detached(tmp_path, testhost, host_b, modern_fixed_python,
                                                                     tiny_models, "rep3")
    from remote import procscan

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


def test_abort_takes_every_hosts_processes_down(tmp_path, testhost, host_b, modern_fixed_python, tiny_models):
    inventory, runs, state_of, head_dir, worker_dir = start_detached(tmp_path, testhost, host_b, modern_fixed_python,
                                                                     tiny_models, "rep4")
    from remote import procscan

    # every process of the run on both hosts, the vLLM servers' process groups included (vLLM retitles its
    # workers, and a retitled process no longer shows the run's environment in /proc)
    groups = {os.getpgid(pid) for run_dir in (head_dir, worker_dir) for pid in run_processes(run_dir)}
    assert len(groups) >= 3  # each host's supervisor's group, and the head's server's own

    def left() -> list[int]:
        return sorted({*run_processes(head_dir), *run_processes(worker_dir),
                       *(pid for group in groups for pid in procscan.live_pids(pgrp=group))})

    aborted = cli("abort", "--inventory", str(inventory), "--run-id", "rep4", "--json", runs=runs)
    assert aborted.returncode == 0, aborted.stdout[-4000:] + aborted.stderr[-4000:]
    # a process SIGKILLed a moment ago may still be on its way out; none may stay
    gone_or_going = {pid: (procscan.stat_fields(pid) or ["gone"])[0] for pid in left()}
    print(f"\nright after abort: {gone_or_going or 'nothing left'}")
    wait_for(lambda: not left(), timeout=60, what=f"the run's processes to end (left: {left()})")
    assert state_of(head_dir)["state"] == "aborted"
    assert state_of(worker_dir)["state"] == "aborted"


def test_a_group_run_of_two_replicas_and_a_plain_host_writes_every_sample_once(tmp_path, testhost, host_b,
                                                                               modern_fixed_python, tiny_models):
    """Four test hosts as two TP=2 replicas (a+b, c+d; a and c on one sshd, b and d on the other, each its own
    work dir) and host e alone at TP=1: one group run, the dataset sharded by replica, every sample once."""
    inventory = replica_inventory(tmp_path, testhost, host_b, modern_fixed_python, tiny_models)
    doc = yaml.safe_load(inventory.read_text())
    hosts = doc["hosts"]
    for name, twin, core in (("c", "a", "0"), ("d", "b", "1"), ("e", "a", "0,1")):
        hosts[name] = {**hosts[twin], "work_dir": str(tmp_path / name / "work"),
                       "output_dir": str(tmp_path / name / "out"), "max_samples": 12,
                       "env": {**hosts[twin]["env"], "VLLM_CPU_OMP_THREADS_BIND": core}}
    for name in ("a", "b"):
        hosts[name]["max_samples"] = 12
    second = free_port_pair()
    while abs(second - doc["replicas"]["pair"]["master_port"]) < 2:
        second = free_port_pair()
    doc["replicas"]["other"] = {"hosts": ["c", "d"], "tp": 2, "master_port": second}
    inventory.write_text(yaml.safe_dump(doc))
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    proc = cli("extract", "--inventory", str(inventory), "--on", "pair,other,e", "--run-id", "grp", "--skip-smoke",
               "--skip-preflight", "--shard-by", "equal", "--tensors", "--json", runs=runs, timeout=1500)
    print(f"\ntwo replicas and a host, one group run: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    fleet = json.loads((runs / "grp" / "fleet.json").read_text())
    assert [(s["hosts"], s["start"], s["stop"]) for s in fleet["shards"]] == [
        (["a", "b"], 0, 4), (["c", "d"], 4, 8), (["e"], 8, 12)]
    merged = json.loads((runs / "grp" / "manifest.json").read_text())
    indices = sorted(int(Path(f["path"]).stem.split("_")[1]) for f in merged["files"]
                     if Path(f["path"]).name.startswith("hs_"))
    assert indices == list(range(12)), indices
    assert sorted(hs_files(runs / "grp" / "samples")) == list(range(12))
    for worker in ("b", "d"):  # the workers' ranks ran headless and wrote nothing
        assert not hs_files(tmp_path / worker / "out")
        status = json.loads((tmp_path / worker / "work" / "runs" / "grp" / "status.json").read_text())
        assert status["state"] == "done", status
