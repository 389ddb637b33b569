"""``specops train --online`` (issue 44, first slice): the run's own extraction server beside the trainer.

Light: an online plan's trainer command (the token dataset without states, ``--on-missing generate``
at the server's endpoint) and the dataset link that leaves the states out.

Heavy (marked ``vllm``; three CPU server starts, one module): on the session's shared tiny-Llama
extraction (``modern_ssh_run("llama", 1)``, ids ``input:2,4,5,8``), one online train run, started
three times by the same command:

1. detached, slowed (the CPU launcher's step pause): once it trains, the server's API process is
   killed; the run fails naming the online server, and neither a server process nor the trainer is left;
2. the same command resumes it with a fresh server; an abort mid-training leaves neither either;
3. the same command resumes it to the end: done, a curve fetched, a checkpoint whose aux ids are the
   plan's, and no states kept on the host (the server's files were each read and deleted by the trainer).
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
from specops_cli import records, specops  # noqa: E402
from trainplans import train_plan  # noqa: E402
sys.path.insert(0, str(REPO))

from remote.extract.engines.vllm_server.process import leftover_pids  # noqa: E402
from remote.train import plan as trainplan  # noqa: E402

EPOCHS = 4


# --------------------------------------------------------------------------- light


def test_an_online_plan_points_the_trainer_at_the_server_and_a_dataset_without_states(tmp_path):
    plan = train_plan(online=True, online_data="/w/runs/t1/online-data", vllm_endpoint="http://127.0.0.1:9/v1")
    argv = plan.argv("python")
    assert argv[argv.index("--data-path") + 1] == "/w/runs/t1/online-data"
    assert argv[argv.index("--on-missing") + 1] == "generate" and argv.count("--on-missing") == 1
    assert argv[argv.index("--vllm-endpoint") + 1] == "http://127.0.0.1:9/v1"
    offline = train_plan().argv("python")
    assert offline[offline.index("--on-missing") + 1] == "raise" and "--vllm-endpoint" not in offline
    # the link: every dataset file of the states run, its states left out
    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"x")
    for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json", "token_freq.pt"):
        (out / name).write_text(name)
    plan = train_plan(data_path=str(out), online=True, online_data=str(tmp_path / "run" / trainplan.ONLINE_DATA))
    linked = trainplan.link_token_dataset(plan)
    assert sorted(p.name for p in linked.iterdir()) == ["data-00000-of-00001.arrow", "dataset_info.json",
                                                        "state.json", "token_freq.pt"]
    assert (linked / "state.json").read_text() == "state.json"
    assert trainplan.link_token_dataset(plan) == linked  # again (a resume): the same links


def test_a_failed_round_trip_of_a_streamed_sample_is_read_from_the_trainers_line():
    from remote.train import supervisor

    line = ("    WARNING  Hidden-state round trip failed for dataset index 1, file index 1 (attempt 1/3): "
            "APIConnectionError: Connection error.    recovery.py:99")  # as speculators 0.9 printed it here
    assert supervisor.stream_failure(line) == {"row": 1, "attempt": 1, "attempts": 3,
                                               "error": "APIConnectionError: Connection error."}
    assert supervisor.stream_failure("INFO     Training epoch 3/4 started    trainer.py:737") is None


def test_online_over_several_hosts_is_refused_before_connecting(tmp_path):
    host = {"address": "10.0.0.1", "python": "python3", "work_dir": "/w", "model_path": "/m", "output_dir": "/o"}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": host, "b": {**host, "address": "10.0.0.2"}},
                                   "groups": {"pair": ["a", "b"]}}))
    proc = specops("train", "--inventory", inv, "--on", "pair", "--run-id", "t", "--from-run", "r", "--online",
                   timeout=60)
    assert proc.returncode == 3 and "--online runs the server and the trainer colocated on one host" in proc.stderr, \
        proc.stdout + proc.stderr


# --------------------------------------------------------------------------- heavy


def _status(inventory, run_id, env) -> tuple[int, dict]:
    proc = specops("status", "--inventory", inventory, "--run-id", run_id, "--json", env=env, timeout=120)
    doc = json.loads(proc.stdout)
    return proc.returncode, (doc["hosts"][0].get("data") or {}).get("status") or {}


def _wait(inv, run_id, env, until, timeout=600) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, st = _status(inv, run_id, env)
        if until(st) or st.get("state") in ("done", "failed", "aborted"):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(1)


def _trainers(run_dir: Path) -> list[str]:
    """The trainer processes of this train run still alive (their command names its online dataset)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(run_dir / trainplan.ONLINE_DATA) in line]


@pytest.mark.vllm
def test_online_train_a_dead_server_fails_it_abort_leaves_nothing_the_same_command_finishes(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    inv, env, work = run["inventory"], run["env"], run["run_dir"].parent.parent
    run_dir = work / "runs" / "online"
    args = ["--run-id", "online", "--from-run", run["run_id"], "--epochs", EPOCHS, "--online"]
    slow = yaml.safe_load(Path(inv).read_text())
    for host in slow["hosts"].values():
        host["env"] = {**(host.get("env") or {}), "SPECOPS_BATCH_DELAY_S": "0.5"}
    slow_inv = tmp_path / "slow-steps.yaml"
    slow_inv.write_text(yaml.safe_dump(slow))
    t0 = time.monotonic()

    # 1. the server dies while the trainer runs: the run fails naming it; nothing of it is left
    started = specops("train", "--inventory", slow_inv, *args, "--detach", "--json", env=env)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
    recs = records(started)
    online = recs["train.online"]
    assert online["status"] == "ok" and online["detail"]["captured"] == [2, 4, 5, 8], online
    disk = online["detail"]["disk"]  # what each way keeps: online the token dataset alone
    assert disk["samples"] == 4 and disk["states_bytes"] > 0 and disk["online_bytes"] == disk["token_dataset_bytes"]
    assert disk["offline_bytes"] == disk["states_bytes"] + disk["online_bytes"], disk
    assert online["detail"]["trainer_layer_ids"] == recs["train.plan"]["detail"]["trainer_layer_ids"] == [2, 4, 5]
    st = _wait(inv, "online", env, lambda s: (s.get("step") or 0) >= 2)
    assert st["state"] == "training", st
    server = st["online_server"]
    assert server["layer_ids"] == [2, 4, 5, 8] and server["endpoint"].startswith("http://127.0.0.1:"), server
    t_first = time.monotonic() - t0
    os.kill(server["pid"], signal.SIGKILL)
    st = _wait(inv, "online", env, lambda s: False, timeout=120)
    assert st["state"] == "failed" and st["error"]["type"] == "OnlineServerDied", st
    assert "online extraction server" in st["error"]["message"] and str(server["pid"]) in st["error"]["message"]
    assert st["error"]["where"] == "online server", st["error"]
    assert leftover_pids(server["marker"]) == [] and _trainers(run_dir) == []

    # 2. the same command resumes it with a fresh server; an abort mid-training leaves neither
    resumed = specops("train", "--inventory", slow_inv, *args, "--detach", "--json", env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    st = _wait(inv, "online", env, lambda s: s.get("state") == "training" and s.get("online_server", {}).get(
        "marker") not in (None, server["marker"]))
    assert st["state"] == "training", st
    second = st["online_server"]
    abort = specops("abort", "--inventory", inv, "--run-id", "online", env=env, timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    code, st = _status(inv, "online", env)
    assert code == 103 and st["state"] == "aborted", st
    assert leftover_pids(second["marker"]) == [] and _trainers(run_dir) == [], (leftover_pids(second["marker"]),
                                                                                 _trainers(run_dir))
    assert st["online_server"]["stopped"] is True

    # 3. the same command, at full speed, to the end: a curve, a checkpoint with the plan's aux ids, no states kept
    done = specops("train", "--inventory", inv, *args, "--json", env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    fetched = records(done)
    assert fetched["train.run"]["status"] == "ok", fetched["train.run"]
    code, st = _status(inv, "online", env)
    assert code == 0 and st["state"] == "done" and st["epoch"] == EPOCHS - 1, st
    assert "curve.png" in fetched["fetch.metrics"]["summary"], fetched["fetch.metrics"]
    steps = [json.loads(line)["step"] for line in
             (Path(env["SPECOPS_RUNS"]) / "th" / "online" / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    assert steps and steps[-1] == st["steps_total"] - 1, steps
    best = run_dir / "checkpoints" / "checkpoint_best"
    assert json.loads((best / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    kept = [p for p in run_dir.rglob("*.safetensors") if "checkpoints" not in p.parts]
    assert kept == [], kept  # every state the server wrote was read once and deleted
    assert not (run_dir / trainplan.ONLINE_DATA / "hidden_states").exists()
    assert leftover_pids(st["online_server"]["marker"]) == []
    print(f"\nonline train: first server ready {server['ready_s']} s, to training {t_first:.0f} s; "
          f"all three starts {time.monotonic() - t0:.0f} s")
