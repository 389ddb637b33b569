"""Training over several hosts (issue 42, item 3): ``specops train --on <group>`` runs one torchrun node per host.

Light: the torchrun command of a node (static rendezvous at the first host), the lost node named from the
nodes' ends, refusals before connecting.

Heavy (marked ``vllm``: it reads the session's shared tiny-Llama extraction, ``modern_ssh_run("llama", 1)``):
two "hosts" are two inventory entries on the one test sshd with their own work_dirs; host ``b`` reads the
head's states run (a shared output_dir: its work_dir's ``runs/<from_run>`` is the head's, linked). One
trainer process per host (CPU: gloo, through the CPU launcher shim).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
from conftest import free_port_pair  # noqa: E402
from specops_cli import specops  # noqa: E402
sys.path.insert(0, str(REPO))

from remote.train import plan as trainplan  # noqa: E402
from specops import trainnodes  # noqa: E402
from specops.result import RunStatus  # noqa: E402
from trainplans import train_plan  # noqa: E402


def test_a_node_runs_torchrun_with_a_static_rendezvous_at_the_head(tmp_path):
    nodes = {"hosts": ["a", "b"], "node_rank": 1, "nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29600}
    argv = train_plan(save_path=str(tmp_path / "ckpt")).launch_argv("py", trainplan.CPU_LAUNCHER_MODULE, 1, tmp_path / "ranks", nodes=nodes)
    assert argv[:13] == ["py", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                         "10.0.0.1", "--master-port", "29600", "--nproc_per_node", "1"], argv
    assert argv[17:19] == ["-m", trainplan.CPU_LAUNCHER_MODULE]
    assert trainplan.node_problem(nodes) is None and not trainplan.is_head(nodes) and trainplan.is_head(None)
    assert "node_rank 2 of 2" in trainplan.node_problem({**nodes, "node_rank": 2})


def test_the_lost_node_is_the_one_that_went_away_not_the_peer_that_failed_after_it():
    gone = RunStatus.model_validate({"run_id": "r", "state": "failed", "error": {"type": "SupervisorDied",
                                                                                "message": "pid 9 is gone"}})
    peer = RunStatus.model_validate({"run_id": "r", "state": "failed", "error": {"type": "ChildFailedError",
                                                                                "message": "Connection closed"}})
    done = RunStatus.model_validate({"run_id": "r", "state": "done"})
    aborted = RunStatus.model_validate({"run_id": "r", "state": "aborted"})
    assert trainnodes.lost_node(["a", "b"], {"a": peer, "b": gone}) == "b"
    assert trainnodes.lost_node(["b", "a"], {"a": aborted, "b": peer}) == "b"
    assert trainnodes.lost_node(["a", "b"], {"a": done, "b": done}) is None
    assert trainnodes.lost_node(["a", "b"], {"a": peer, "b": OSError("unreachable")}) == "b"


def test_a_head_without_an_ip_address_and_a_master_port_on_one_host_are_refused_before_connecting(tmp_path):
    host = {"address": "gpu-a.example.org", "python": "python3", "work_dir": "/w", "model_path": "/m",
            "output_dir": "/o"}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": host, "b": {**host, "address": "10.0.0.2"}},
                                   "groups": {"pair": ["a", "b"]}}))
    proc = specops("train", "--inventory", inv, "--on", "pair", "--run-id", "t", "--from-run", "r", timeout=60)
    assert proc.returncode == 3 and "heads the training run over a, b" in proc.stderr, proc.stdout + proc.stderr
    assert "set node_address of host 'a'" in proc.stderr, proc.stderr
    proc = specops("train", "--inventory", inv, "--on", "b", "--run-id", "t", "--from-run", "r", "--master-port",
                   "29600", timeout=60)
    assert proc.returncode == 3 and "--master-port is the rendezvous port" in proc.stderr, proc.stdout + proc.stderr
    from specops.inventory import load_inventory

    blocks = trainnodes.node_blocks(load_inventory(inv), ["b", "a"], None)
    assert blocks["a"] == {"hosts": ["b", "a"], "node_rank": 1, "nnodes": 2, "master_addr": "10.0.0.2",
                           "master_port": 29500}


# --------------------------------------------------------------------------- heavy: two hosts over SSH


def _two_hosts(run, tmp_path, name: str, env: dict | None = None) -> Path:
    """An inventory of hosts ``a`` (the shared run's host, the head) and ``b`` (its own work_dir, the head's
    states run linked into it: a shared output_dir) in group ``pair``."""
    doc = yaml.safe_load(Path(run["inventory"]).read_text())
    a = doc["hosts"]["th"]
    if env:
        a["env"] = {**(a.get("env") or {}), **env}
    work_b = tmp_path / name / "work-b"
    (work_b / "runs").mkdir(parents=True)
    (work_b / "runs" / run["run_id"]).symlink_to(run["run_dir"])
    doc = {"hosts": {"a": a, "b": {**a, "work_dir": str(work_b)}}, "groups": {"pair": ["a", "b"]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _train(inv, run, run_id, epochs, port, env, *extra):
    return ["train", "--inventory", inv, "--on", "pair", "--run-id", run_id, "--from-run", run["run_id"],
            "--epochs", epochs, "--master-port", port, *extra]


@pytest.mark.vllm
def test_two_hosts_train_one_draft_the_head_holds_the_curve_and_the_checkpoints(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    env, head_work = run["env"], run["run_dir"].parent.parent
    inv = _two_hosts(run, tmp_path, "pair")
    proc = specops(*_train(inv, run, "nodes-2", 2, free_port_pair(), env), "--json", env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    by_host = {h["host"]: {r["name"]: r for r in h["records"]} for h in doc["hosts"]}
    assert by_host["a"]["train.nodes.master_port"]["status"] == "ok", by_host["a"]["train.nodes.master_port"]
    head = by_host["a"]["train.run"]
    assert head["status"] == "ok" and "checkpoint" in head["summary"], head
    assert "headless" in by_host["b"]["train.run"]["summary"], by_host["b"]["train.run"]
    final = next(h for h in doc["hosts"] if h["host"] == "a")["data"]["final_status"]
    assert final["epoch"] == 1 and final["loss"] is not None and final["accuracy"], final
    assert final["command"][2] == "torch.distributed.run" and "--nnodes" in final["command"], final["command"]
    # one curve and the checkpoints, on the head only
    head_dir, node_dir = head_work / "runs" / "nodes-2", tmp_path / "pair" / "work-b" / "runs" / "nodes-2"
    steps = [json.loads(line) for line in (head_dir / trainplan.METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "train"] == list(range(final["step"])), steps
    assert [e for e, _, whole in trainplan.epoch_dirs(head_dir / "checkpoints") if whole] == [0, 1]
    assert not (node_dir / trainplan.METRICS_FILE).exists() or not (node_dir / trainplan.METRICS_FILE).read_text()
    assert not trainplan.epoch_dirs(node_dir / "checkpoints")
    # the trainer saw two ranks: each node's log says which it was
    assert "rank 0 of 2 joined (gloo)" in (head_dir / "logs" / trainplan.TRAIN_LOG).read_text()
    assert "rank 1 of 2 joined (gloo)" in (node_dir / "logs" / trainplan.TRAIN_LOG).read_text()


@pytest.mark.vllm
def test_a_killed_node_fails_the_run_naming_its_host_abort_stops_every_node_and_the_same_command_resumes(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    env, head_work = run["env"], run["run_dir"].parent.parent
    # a pause after each optimizer step (the CPU launcher's fault point): the kill lands mid-training
    inv = _two_hosts(run, tmp_path, "slow", env={"SPECOPS_BATCH_DELAY_S": "1.0"})
    args = _train(inv, run, "nodes-lost", 4, free_port_pair(), env)
    head_dir, node_dir = head_work / "runs" / "nodes-lost", tmp_path / "slow" / "work-b" / "runs" / "nodes-lost"
    first = subprocess.Popen([str(Path(sys.executable).parent / "specops"), *map(str, args), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                             stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "250", **env})
    try:
        deadline = time.monotonic() + 600
        while not [e for e, _, whole in trainplan.epoch_dirs(head_dir / "checkpoints") if whole]:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(1)
        os.killpg(int((node_dir / "pid").read_text()), signal.SIGKILL)  # the node's supervisor leads its group
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 100, out[-4000:] + err[-3000:]
    lost = next(r for h in json.loads(out)["hosts"] for r in h["records"] if r["name"] == "train.nodes")
    assert lost["status"] == "fail" and "lost node 1 (host b)" in lost["summary"], lost
    assert lost["detail"]["lost"] == "b" and "same train command" in lost["fix"], lost

    # the same command resumes (detached here): abort --on the group takes every node down mid-training
    again = specops(*args, "--detach", "--json", env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-5000:] + again.stderr[-3000:]
    recs = {h["host"]: {r["name"]: r for r in h["records"]} for h in json.loads(again.stdout)["hosts"]}
    assert recs["b"]["train.resume"]["status"] == "changed", recs["b"]  # the head's last epoch, copied to b
    deadline = time.monotonic() + 300
    while json.loads((head_dir / "status.json").read_text()).get("state") != "training":
        assert time.monotonic() < deadline, (head_dir / "status.json").read_text()
        time.sleep(1)
    abort = specops("abort", "--inventory", inv, "--on", "pair", "--run-id", "nodes-lost", env=env, timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    for run_dir in (head_dir, node_dir):
        st = json.loads((run_dir / "status.json").read_text())
        assert st["state"] == "aborted", (run_dir, st)
        pid = int((run_dir / "pid").read_text())
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    resumed = specops(*args, "--json", env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-5000:] + resumed.stderr[-3000:]
    recs = {h["host"]: {r["name"]: r for r in h["records"]} for h in json.loads(resumed.stdout)["hosts"]}
    final = recs["a"]["train.run"]
    assert final["status"] == "ok" and final["detail"]["resumed_from"]["epoch"] >= 0, final
    st = json.loads((head_dir / "status.json").read_text())
    assert st["state"] == "done" and st["epoch"] == 3 and st["loss"] is not None, st


@pytest.mark.vllm
def test_a_host_without_the_states_stops_every_node_before_one_starts_naming_it(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    env = run["env"]
    inv = _two_hosts(run, tmp_path, "apart")
    (tmp_path / "apart" / "work-b" / "runs" / run["run_id"]).unlink()  # b's storage is its own: no states there
    proc = specops(*_train(inv, run, "nodes-apart", 1, free_port_pair(), env), "--json", env=env, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = {h["host"]: {r["name"]: r for r in h["records"]} for h in json.loads(proc.stdout)["hosts"]}
    assert recs["b"]["train.nodes"]["status"] == "fail" and "the checks of b failed" in recs["b"]["train.nodes"][
        "summary"], recs["b"]
    assert "give b the states" in recs["b"]["train.nodes"]["fix"], recs["b"]["train.nodes"]
    assert recs["a"]["train.nodes"]["status"] == "skipped", recs["a"]
    for work in (run["run_dir"].parent.parent, tmp_path / "apart" / "work-b"):
        assert not (work / "runs" / "nodes-apart").exists(), work  # nothing started anywhere
