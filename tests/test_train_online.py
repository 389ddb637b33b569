"""``specops train --online`` (issue 44): the run's own extraction server beside the trainer.

Light: an online plan's trainer command (the token dataset without states, ``--on-missing generate``
at the server's endpoint, the stream checks passed as speculators' own flags), the dataset link that
leaves the states out, the trainer's lines for a streamed sample that failed its checks, what the
laptop refuses.

Heavy (marked ``vllm``; five CPU server starts loaded (one beside another), the first on a second host, one launch aborted
while it loads): on the
session's shared tiny-Llama extraction (``modern_ssh_run("llama", 1)``, ids ``input:2,4,5,8``), one
online train run, started five times by the same command:

1. disaggregated, the server a replica over two more test hosts (``--server-on svr``: head ``sv``, worker
   ``sv2``, TP=2, one rank each, each its own sshd and work dir; the trainer here), detached, paced (the CPU
   launcher's pause after each step): preflight reached the head's ports from the trainer's host and ran the
   replica's own checks; both hosts run ranks of the one server (the head's command ``--node-rank 0``, the
   worker's ``--headless --node-rank 1``, both alive while the trainer streams); once the trainer is past
   epoch 0's checkpoint (its status), the worker host's server process is killed; the run fails naming the
   online server and that host, both server hosts' halves fail too, and neither a server process (on either
   host) nor the trainer is left;
   nothing but the token dataset's links is on disk (``--keep-states none``); its first steps' losses
   equal an offline train's on the same rows, seed and order;
2. again, colocated (a resume may move the server), paced: once the fresh server answers and the
   trainer runs, the trainer is killed (SIGKILL):
   the run fails naming the trainer, and the server is stopped;
3. again, paced: the supervisor is killed (SIGKILL) while both run: neither is left, the next status
   names the dead supervisor;
4. the same command, detached: aborted as soon as its fresh server is launched (its pid in the
   status): aborted, nothing of it left;
5. the same command with ``--keep-states all``, to the end, with the test host's connector corrupting
   two files it writes (non-finite states, then token ids off by one: one sample's two tries): done,
   resumed, a curve fetched, a checkpoint whose aux ids are the plan's, every loss finite (the bad
   sample never trained on), the run's record counting and naming it, and the states kept as the
   extraction run ``online-kept`` (its files digest as its manifest says, ``verify`` passes, a train
   plan reads it) with none left in the train run;
6. beside 5 (``--force``), a second online run ``ranked`` with ``--keep-states all`` and the trainer as two
   torchrun ranks (``--gpus 2``: the CPU launcher's gloo), each streaming in a spawned dataloader worker: every
   row the ranks' ledgers say they streamed is in ``ranked-kept`` exactly once, under its own index (token ids
   equal to the states run's file of that index), none lost; ``verify`` passes; its summary's tok/s is the rate the
   next train preflight from it prices the offline way with.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
from specops_cli import records, run_status, specops, wait_status  # noqa: E402
from trainplans import train_plan  # noqa: E402
sys.path.insert(0, str(REPO))

from remote.extract.engines.vllm_server.process import leftover_pids  # noqa: E402
from remote.train import plan as trainplan  # noqa: E402
from specops.testhost.sshd import TestHost  # noqa: E402
from test_replica_remote import free_port_pair  # noqa: E402

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
    # --keep-states all: the trainer runs under the module that keeps what it streamed, and a resume keeps what the
    # earlier attempts kept (the trainer reads those rows from disk)
    keep = train_plan(data_path=str(out), online=True, online_data=str(linked), keep_states="all")
    assert keep.argv("python", "launcher")[:5] == ["python", "-m", trainplan.KEEP_STATES_MODULE, "launcher",
                                                   "--verifier-name-or-path"]
    (linked / "hidden_states").mkdir()
    (linked / "hidden_states" / "hs_2.safetensors").write_bytes(b"kept")
    assert sorted(p.name for p in trainplan.link_token_dataset(keep).iterdir()) == [
        "data-00000-of-00001.arrow", "dataset_info.json", "hidden_states", "state.json", "token_freq.pt"]
    assert (linked / "hidden_states" / "hs_2.safetensors").read_bytes() == b"kept"
    assert not (trainplan.link_token_dataset(plan) / "hidden_states").exists()  # none: nothing of them stays


def test_a_resume_may_change_what_stays_on_disk_and_nothing_else():
    from remote.run import job

    started = {"run_id": "t", "from_run": "r", "online": True, "epochs": 4}
    assert job._identity({**started, "keep_states": "all"}) == job._identity(started)
    # the server may move (colocated <-> another host): stateless, the trainer's checkpoints stay on its host
    assert job._identity({**started, "online_server": {"role": "trainer", "server_host": "sv"}}) == \
        job._identity(started)
    assert job._identity({**started, "epochs": 5}) != job._identity(started)
    assert job._identity({**started, "gpus": 2}) != job._identity(started)  # the ranks a checkpoint was made by


def test_a_streamed_sample_that_failed_its_checks_is_counted_and_named_from_the_trainers_lines():
    from remote.train import supervisor

    # as speculators 0.9 prints them (train/recovery.py): a failed try, then the last one (the sample given up)
    retried = ("    WARNING  Hidden-state round trip failed for dataset index 1, file index 1 (attempt 1/2): "
               "ValueError: Hidden states contain non-finite values (min=nan, max=nan)    recovery.py:99")
    given_up = ("    WARNING  Hidden-state round trip failed for dataset index 1, file index 1 (attempt 2/2, "
                "consecutive failures=1/3): ValueError: Token ids don't match expected token ids " + "[7, 8] " * 200)
    first = supervisor.stream_failure(retried)
    assert first == {"row": 1, "attempt": 1, "attempts": 2, "dropped": False,
                     "error": "ValueError: Hidden states contain non-finite values (min=nan, max=nan)"}
    last = supervisor.stream_failure(given_up)
    assert last["dropped"] is True and last["attempt"] == 2 and last["row"] == 1
    assert len(last["error"]) == supervisor.STREAM_ERROR_CHARS and last["error"].startswith("ValueError: Token ids")
    assert supervisor.stream_failure("INFO     Training epoch 3/4 started    trainer.py:737") is None
    stream = supervisor.count_stream_failure(supervisor.count_stream_failure(None, first), last)
    assert stream == {"failed_round_trips": 2, "retried": 1, "dropped": 1, "rows": [1], "dropped_rows": [1],
                      "last": last}
    # the trainer's command carries the stream checks as its own flags, an online run's only
    argv = train_plan(online=True, online_data="/w/d", stream_checks={"generation_validation_retries": 0,
                                                                      "max_consecutive_generation_failures": 5}
                      ).argv("python")
    assert argv[argv.index("--generation-validation-retries") + 1] == "0"
    assert argv[argv.index("--max-consecutive-generation-failures") + 1] == "5"
    assert "--generation-validation-retries" not in train_plan(online=True, online_data="/w/d").argv("python")
    # given as a trainer flag too: refused, naming specops' own option
    with pytest.raises(trainplan.TrainError) as refused:
        trainplan.check_extra_args(["--generation-validation-retries", "3"], {"flags": {}})
    assert "specops train --online --generation-validation-retries" in str(refused.value.__dict__), refused.value


@pytest.mark.parametrize("args, says", [
    (["--generation-validation-retries", "1"], "--generation-validation-retries set(s) how an online run streams"),
    (["--online", "--generation-validation-retries", "-1"], "--generation-validation-retries"),
    (["--online", "--max-consecutive-generation-failures", "0"], "--max-consecutive-generation-failures"),
    (["--online", "--keep-states", "some"], "--keep-states"),
    (["--keep-states", "all"], "--keep-states set(s) how an online run streams"),
])
def test_bad_stream_options_name_the_flag_and_nothing_runs(args, says, tmp_path):
    host = {"address": "10.0.0.1", "python": "python3", "work_dir": "/w", "model_path": "/m", "output_dir": "/o"}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": host}}))
    proc = specops("train", "--inventory", inv, "--run-id", "t", "--from-run", "r", *args, timeout=60)
    assert proc.returncode == 3 and says in proc.stderr, proc.stdout + proc.stderr


def test_preflight_prices_offline_against_online_from_the_last_runs_rates(tmp_path):
    from remote.train import task

    runs = tmp_path / "runs"
    states = runs / "r1"
    states.mkdir(parents=True)
    plan = train_plan(states_run_dir=str(states), tokens=1000, epochs=3, run_id="t2")
    # no rate known at all: said, no numbers made up
    assert task.online_time(plan)["line"] == "time: no extraction rate known for this dataset"
    (states / "summary.json").write_text(json.dumps({"tokens_per_s": 100.0}))
    first = task.online_time(plan)  # the extraction's rate alone: the states' time each way, training's unknown
    assert first["offline_extract_s"] == 10.0 and first["online_extract_s"] == 30.0 and first["online_s"] is None
    assert "training's offline rate not known yet (no earlier offline train run of r1)" in first["line"], first

    def train_run(name, from_run, rate, online=False):
        (runs / name).mkdir()
        (runs / name / "status.json").write_text(json.dumps({"kind": "train", "tokens_per_s": rate,
                                                             "plan": {"from_run": from_run, "online": online}}))
        time.sleep(0.01)  # the newest status is the last run

    train_run("t0", "r1", 50.0)
    train_run("t1", "other", 1.0)  # trained other states: not this dataset's rate
    priced = task.online_time(plan)  # estimated: the states made again each epoch, then the same training
    assert priced["train_tokens_per_s"] == 50.0 and priced["train_rate_from"] == "t0", priced
    assert priced["offline_s"] == 10.0 + 60.0 and priced["online_s"] == 30.0 + 60.0, priced
    assert "offline ~70 s" in priced["line"] and "online ~90 s (the states made again each epoch, estimated)" in \
        priced["line"], priced["line"]
    train_run("t2", "r1", 20.0, online=True)  # this run's earlier attempt, online: its measured rate wins
    measured = task.online_time(plan)
    assert measured["online_s"] == 150.0 and measured["online_rate_from"] == "t2" and measured["offline_s"] == 70.0
    assert "online ~150 s (20 tok/s measured in run t2)" in measured["line"], measured["line"]
    assert measured["load_s"] == 0.0 and "loads the target" not in measured["line"]  # a summary without its load
    # the states run's load (its summary's phase_seconds): paid once by either way, in both totals
    (states / "summary.json").write_text(json.dumps({"tokens_per_s": 100.0, "phase_seconds": {"load": 12.04}}))
    loaded = task.online_time(plan)
    assert loaded["load_s"] == 12.0 and loaded["offline_s"] == 82.0 and loaded["online_s"] == 162.0, loaded
    assert loaded["line"].endswith("; each way loads the target once (~12 s in run r1), in both"), loaded["line"]


def test_online_with_an_algorithm_takes_both_halves_ids_from_its_layer_plan():
    from remote.train import online, task
    from remote.wire import layers

    # dflash: the server captures the file's layer axis (aux ids, the final state last), the trainer reads the aux
    # ids, and vLLM serves them one lower (aux - 1), all from algorithm_plan
    plan = train_plan(online=True, online_data="/w/d", algorithm="dflash",
                      layer_plan=layers.algorithm_plan("dflash", [8, 2, 5, 4], 8))
    assert online.capture_ids(plan) == [2, 4, 5, 8] and plan.layer_plan["engine_ids"] == [1, 3, 4]
    argv = plan.argv("python")
    assert argv[argv.index("--speculator-type") + 1] == "dflash"
    assert argv[argv.index("--target-layer-ids") + 1:argv.index("--target-layer-ids") + 4] == ["2", "4", "5"]
    # a trainer that would read other ids than the server captures: refused before any load, both lists named
    with pytest.raises(trainplan.TrainError) as refused:
        task.check_online(train_plan(online=True, online_data="/w/d", algorithm="dflash", trainer_layer_ids=[2, 4],
                                     layer_plan=plan.layer_plan), {})
    said = str(refused.value.__dict__)
    assert "the server would capture ids [2, 4, 5, 8]" in said and "reads aux ids [2, 4]" in said, said
    assert refused.value.detail["reads"] == [2, 4, 8], refused.value.detail
    # states dflash cannot use (aux id 0: the embeddings, layer -1 in vLLM): refused naming the ids and why
    bad = layers.algorithm_plan("dflash", [0, 4, 8], 8)
    with pytest.raises(trainplan.TrainError) as refused:
        task.check_online(train_plan(online=True, online_data="/w/d", algorithm="dflash", layer_ids=[0, 4, 8],
                                     trainer_layer_ids=[0, 4], layer_plan=bad), {})
    said = str(refused.value.__dict__)
    assert "capture ids [0, 4, 8]" in said and "aux id 0 (the embeddings) would be layer -1" in said, said


def test_the_ranks_ledgers_give_the_kept_runs_rows_and_its_rate_over_the_servers_busy_seconds(tmp_path):
    from remote.train import keepstates, supervisor
    from specops.result import RunStatus
    from specops.train import run_record

    # two ranks' ledgers (one file per process), a torn last line skipped; spans that overlap count once
    online_data = tmp_path / "run" / trainplan.ONLINE_DATA
    ledgers = keepstates.streamed_dir(online_data)
    ledgers.mkdir(parents=True)
    (ledgers / "rank0-11.jsonl").write_text('{"row": 0, "rank": 0, "pid": 11, "tokens": 30, "t0": 10.0, "t1": 12.0}\n'
                                            '{"row": 2, "rank": 0, "pid": 11, "tokens": 10, "t0": 13.0, "t1": 14.0}\n')
    (ledgers / "rank1-12.jsonl").write_text('{"row": 1, "rank": 1, "pid": 12, "tokens": 20, "t0": 11.0, "t1": 12.5}\n'
                                            '{"row": 3, "ra')
    lines = keepstates.read_streamed(online_data)
    assert sorted(line["row"] for line in lines) == [0, 1, 2]
    assert keepstates.busy_seconds([(10.0, 12.0), (11.0, 12.5), (13.0, 14.0)]) == 3.5
    assert keepstates.busy_seconds([]) == 0.0
    record = keepstates.stream_record(lines, {0, 1, 2})
    assert record == {"streamed": 3, "ranks": {"0": 2, "1": 1}, "streamed_twice": [], "lost": [], "tokens": 60,
                      "stream_s": 3.5, "tokens_per_s": 17.1}, record
    # a row streamed twice (its last file kept) and one streamed whose file is not in the kept run: both named
    again = keepstates.stream_record([*lines, {**lines[0], "rank": 1, "t0": 20.0, "t1": 21.0}], {0, 1})
    assert again["streamed_twice"] == [0] and again["lost"] == [2], again
    assert keepstates.stream_record([], set())["tokens_per_s"] is None  # nothing streamed: no rate made up
    rec = run_record("t", RunStatus(state="done", step=3, kept_states={
        "run_id": "t-kept", "samples": 2, "missing": [3], "ranks": {"0": 2, "1": 1}, "lost": [2],
        "tokens_per_s": 17.1}))
    assert rec.status == "warn" and "rows [2] streamed but not kept" in rec.summary, rec
    assert "streamed by ranks {'0': 2, '1': 1}" in rec.summary and "17.1 tok/s streamed" in rec.summary, rec
    # the CPU test host's launcher: --gpus N is N gloo ranks under torchrun (1 unless given); the trainer's own
    # module on a CPU device stays one process
    assert supervisor.trainer_processes({"gpus": 2}, trainplan.CPU_LAUNCHER_MODULE) == 2
    assert supervisor.trainer_processes({}, trainplan.CPU_LAUNCHER_MODULE) == 1
    assert supervisor.trainer_processes({"gpus": 2, "device": "cpu"}, trainplan.TRAINER_MODULE) == 1


@pytest.mark.parametrize("args, says", [
    (["--on", "pair", "--online"], "--online over several --on hosts"),
    (["--on", "a", "--server-on", "b"], "--server-on b places an online run's extraction server"),
    (["--on", "a", "--online", "--server-on", "zz"], "--server-on 'zz' is not a host or a replica of"),
    # a server that is a replica over several hosts: the trainer outside it, at its TP, every host reachable
    (["--on", "b", "--online", "--server-on", "duo"], "the trainer's host b is a host of replica duo (b, c)"),
    (["--on", "a", "--online", "--server-on", "duo", "--tp", "4"], "--tp 4 for replica 'duo', whose tp is 2"),
    (["--on", "a", "--tp", "2"], "--tp 2 sets the TP of an online run's extraction server"),
    (["--on", "a", "--online", "--server-on", "a"], "--server-on a is the trainer's host too"),
    (["--on", "pair", "--online", "--server-on", "b"], "a disaggregated online run's trainer runs on one host"),
    (["--on", "a", "--online", "--server-on", "n"], "set node_address of host n"),
    (["--on", "a", "--online", "--server-on", "b", "--server-port", "0"], "--server-port"),
    (["--on", "a", "--server-port", "29700"], "--server-port is the port of a disaggregated online run's server"),
])
def test_bad_disaggregated_online_input_names_the_flag_before_connecting(args, says, tmp_path):
    host = {"address": "10.0.0.1", "python": "python3", "work_dir": "/w", "model_path": "/m", "output_dir": "/o"}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": host, "b": {**host, "address": "10.0.0.2"},
                                             "c": {**host, "address": "10.0.0.3"},
                                             "n": {**host, "address": "gpu-n.example"}},
                                   "groups": {"pair": ["a", "b"]},
                                   "replicas": {"duo": {"hosts": ["b", "c"], "tp": 2}}}))
    proc = specops("train", "--inventory", inv, "--run-id", "t", "--from-run", "r", *args, timeout=60)
    assert proc.returncode == 3 and says in proc.stderr, proc.stdout + proc.stderr


def test_the_trainer_half_joins_the_server_halfs_watch_each_end_seen_by_the_other():
    """The two halves of a disaggregated run over real loopback sockets (no server): the trainer's host joins the
    server host's watch (the replica's HostWatch), ``ready`` brings the endpoint, the server half's ``end`` is the
    server dead (naming its host), the trainer's ``bye`` its end, and a trainer gone without one is lost."""
    from remote.extract import replica
    from remote.train import online

    def halves(**more):
        port = free_port_pair()
        block = {"server_host": "sv", "trainer_host": "th", "address": "127.0.0.1", "port": port,
                 "watch_port": port + 1, **more}
        watch = replica.HostWatch(online.watch_block(block), on_lost=lambda error: None)
        watch.start()
        trainer = online.RemoteServer({"online_server": {"role": "trainer", **block}})
        assert trainer.launch()["server_host"] == "sv"
        _until(lambda: 1 in watch.nodes)
        assert watch.nodes[1]["host"] == "th"
        return block, watch, trainer

    block, watch, trainer = halves()
    watch.broadcast("ready", endpoint=f"http://127.0.0.1:{block['port']}/v1")
    assert trainer.wait_ready(10) >= 0 and trainer.endpoint == f"http://127.0.0.1:{block['port']}/v1"
    died: list[dict] = []
    trainer.watch(died.append)
    watch.close("failed", "the online extraction server (pid 7) died while the trainer ran: SIGKILL")
    _until(lambda: died)
    assert died[0]["type"] == "OnlineServerDied" and died[0]["where"] == "online server on host sv", died
    assert "on host sv (127.0.0.1:" in died[0]["message"] and "(pid 7)" in died[0]["message"], died
    # a server that is a replica: the head's end names the worker host whose ranks ended it
    block, watch, trainer = halves(replica={"name": "svr", "hosts": ["sv", "sv2"], "node_rank": 0})
    died.clear()
    trainer.watch(died.append)
    watch.close("failed", "on host sv2 (node 1): the headless ranks (pid 8) died: killed by SIGKILL", host="sv2")
    _until(lambda: died)
    assert died[0]["where"] == "online server on host sv2" and died[0]["host"] == "sv2", died
    assert "on host sv2 of replica svr (head sv, 127.0.0.1:" in died[0]["message"] and "(pid 8)" in died[0]["message"]
    # the trainer's end: its bye, with its state, is what the server half ends in
    block, watch, trainer = halves()
    trainer.stop("done")
    _until(lambda: watch.nodes[1].get("bye"))
    assert watch.nodes[1]["bye"] == "done" and watch.lost is None
    watch.close("done")
    # a trainer host gone without a word (its supervisor killed): lost, naming it
    block, watch, trainer = halves()
    trainer.sock.close()
    assert "host th" in watch.wait_lost(10)["message"], watch.lost
    watch.close("failed")


def test_the_server_halfs_done_record_names_where_the_trainer_ran():
    from specops.result import RunStatus
    from specops.train import run_record

    rec = run_record("t", RunStatus(state="done", online_server={"trainer_host": "th", "ready_s": 30.0,
                                                                  "endpoint": "http://10.0.0.2:29600/v1"}))
    assert rec.status == "ok" and "served the trainer on th at http://10.0.0.2:29600/v1" in rec.summary, rec
    worker = run_record("t", RunStatus(state="done", online_server={"trainer_host": "th", "server_host": "sv",
                                                                      "replica": "duo", "ranks": [1]}))
    assert "ranks [1] of replica duo (headless) served the trainer on th through the head sv" in worker.summary, worker
    trainer = run_record("t", RunStatus(state="done", step=3, loss=0.1, online_server={"server_host": "sv"}))
    assert "served" not in trainer.summary and "step 3" in trainer.summary, trainer


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --------------------------------------------------------------------------- heavy


def _trainers(run_dir: Path) -> list[int]:
    """The pids of this train run's trainer processes still alive (their command names its online dataset; read
    from /proc, whole: ``ps`` may cut a long command line)."""
    wanted = str(run_dir / trainplan.ONLINE_DATA).encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and wanted in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


def _trainer_running(inventory, args, env, attempt: int, run_dir: Path) -> tuple[int, dict]:
    """Start the same online command again (detached); once its fresh server answers and its trainer runs, the
    trainer's pid and the run's status."""
    started = specops("train", "--inventory", inventory, *args, "--detach", "--json", env=env)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
    st = wait_status(inventory, "online", env, lambda s: (s.get("online_server") or {}).get("endpoint"),
                     also=lambda: bool(_trainers(run_dir)), timeout=300, after_attempt=attempt)
    assert st.get("state") not in ("done", "failed", "aborted"), st
    return _trainers(run_dir)[0], st


def _gone(marker: str, run_dir: Path, timeout: float = 30) -> bool:
    """Neither the server (its marker) nor the trainer lives, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while leftover_pids(marker) or _trainers(run_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _check_kept_run(inv, env, work: Path, states_run: str, st: dict, stream: dict) -> None:
    """``--keep-states all``: the run's record names its kept extraction run, which is a normal one: its
    manifest's files digest as recorded, ``verify`` recomputes one with the reference, and a train plan reads it."""
    from remote.verify.run import open_run
    from remote.wire import manifest as run_manifest

    kept = st["kept_states"]
    assert kept["run_id"] == "online-kept" and kept["samples"] + len(kept["missing"]) == 4, kept
    assert set(kept["missing"]) <= set(stream["dropped_rows"]), kept  # only a row given up in the last epoch
    found = open_run({"work_dir": str(work), "run_id": "online-kept"})
    states = open_run({"work_dir": str(work), "run_id": states_run})
    assert found.layer_ids == states.layer_ids and found.manifest["kept_from"]["train_run"] == "online"
    # the states run's canary judged its own server, not the online one these files came from
    assert "canary" in states.manifest and "canary" not in found.manifest
    for entry in found.manifest["files"]:
        assert run_manifest.file_matches(found.output_dir / entry["path"], entry), entry
    verified = specops("verify", "--inventory", inv, "--run-id", "online-kept", "--samples", 1, "--json", env=env,
                       timeout=300)
    assert verified.returncode == 0, verified.stdout[-4000:] + verified.stderr[-4000:]
    plan = trainplan.resolve({"work_dir": str(work), "run_id": "again", "from_run": "online-kept"})
    assert plan.samples == kept["samples"] and plan.trainer_layer_ids == [2, 4, 5], plan


def _with_env(inv, path: Path, **env) -> Path:
    """The shared inventory with more env for its hosts (a fault point armed), written to ``path``."""
    doc = yaml.safe_load(Path(inv).read_text())
    for host in doc["hosts"].values():
        host["env"] = {**(host.get("env") or {}), **env}
    path.write_text(yaml.safe_dump(doc))
    return path


def _train_losses(metrics: Path) -> dict[int, float]:
    """Each training step's loss of a run's metrics.jsonl (a resumed step's last row wins)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"train"' in line]
    return {row["step"]: row["loss"] for row in rows}


#: seconds the CPU launcher pauses after each optimizer step in the first three starts (of 5): the first start's
#: server is killed once the status shows step 3, with 5 paced steps still to go
PACE_S = "2"
#: the files the third start's server corrupts: the 3rd non-finite, its retry (the 4th) with ids off by one
STREAM_FAULT = {"3": "nonfinite", "4": "ids"}


@pytest.mark.vllm
def test_online_train_a_dead_server_fails_it_abort_leaves_nothing_the_same_command_finishes(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    inv, env, work = run["inventory"], run["env"], run["run_dir"].parent.parent
    run_dir = work / "runs" / "online"
    args = ["--run-id", "online", "--from-run", run["run_id"], "--epochs", EPOCHS, "--online",
            "--generation-validation-retries", "1", "--max-consecutive-generation-failures", "3"]
    paced = _with_env(inv, tmp_path / "paced.yaml", SPECOPS_BATCH_DELAY_S=PACE_S)
    faulty = _with_env(inv, tmp_path / "faulty.yaml", SPECOPS_STREAM_FAULT=json.dumps(STREAM_FAULT))
    t0 = time.monotonic()

    # 1. disaggregated: the server a replica over two more hosts (svr: head sv, worker sv2, TP=2), the trainer here
    # (th), one run id; the worker host's server dies while the trainer runs: the run fails naming that host;
    # nothing of it is left on any host
    server_hosts = [TestHost(name=f"pytest-online-{name}-{os.getpid()}", root=tmp_path / f"sshd-{name}")
                    for name in ("sv", "sv2")]
    try:
        for sshd in server_hosts:
            sshd.up()
        three_hosts = _server_replica(paced, tmp_path, server_hosts, run["run_id"])
        server_dir, worker_dir = (tmp_path / name / "work" / "runs" / "online" for name in ("sv", "sv2"))
        port = free_port_pair()
        started = specops("train", "--inventory", three_hosts, "--on", "th", "--server-on", "svr", "--server-port",
                          port, *args, "--detach", "--json", env=env)
        assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
        by_host = {h["host"]: {r["name"]: r for r in h["records"]} for h in json.loads(started.stdout)["hosts"]}
        recs = by_host["th"]
        # preflight: the trainer's host reached the head's two ports while it held them; the replica's own checks
        reached = recs["train.server_address"]
        assert reached["status"] == "ok" and reached["detail"]["reach"] == {str(port): None, str(port + 1): None}
        assert by_host["sv"]["train.server_address"]["detail"]["listen"]["peers"][str(port)] == ["127.0.0.1"]
        assert "train.server_address" not in by_host["sv2"], by_host["sv2"]  # a worker host reaches the replica's
        for name in ("replica.hosts", "replica.model", "replica.master_port"):
            assert by_host["sv"][name]["status"] == "ok", by_host["sv"][name]
        online = recs["train.online"]
        assert online["status"] == "ok" and online["detail"]["captured"] == [2, 4, 5, 8], online
        disk = online["detail"]["disk"]  # what each way keeps: online the token dataset alone
        assert disk["samples"] == 4 and disk["states_bytes"] > 0 and disk["online_bytes"] == disk["token_dataset_bytes"]
        assert disk["offline_bytes"] == disk["states_bytes"] + disk["online_bytes"], disk
        assert online["detail"]["trainer_layer_ids"] == recs["train.plan"]["detail"]["trainer_layer_ids"] == [2, 4, 5]
        # past epoch 0's checkpoint (2 steps an epoch), 5 paced steps to go: the kill lands while the trainer trains
        st = wait_status(inv, "online", env, lambda s: (s.get("step") or 0) >= 3)
        assert st["state"] == "training" and (run_dir / "checkpoints" / "0").is_dir(), st
        command = st["command"]  # the stream checks reach the trainer as its own flags
        assert command[command.index("--generation-validation-retries") + 1] == "1", command
        assert command[command.index("--max-consecutive-generation-failures") + 1] == "3", command
        served = _read_status(server_dir)
        server = served["online_server"]
        assert served["state"] == "extracting" and server["layer_ids"] == [2, 4, 5, 8], served
        assert server["endpoint"] == st["online_server"]["endpoint"] == f"http://127.0.0.1:{port}/v1", (served, st)
        # both hosts run ranks of the one TP=2 server the trainer streams from: the head 0 with the API, sv2 1 headless
        assert served["replica"] == {"name": "svr", "hosts": ["sv", "sv2"], "ranks_per_node": 1, "tp": 2}, served
        assert _flags(server["command"]) >= {("--nnodes", "2"), ("--node-rank", "0"), ("--tensor-parallel-size", "2")}
        worked = _read_status(worker_dir)
        worker = worked["online_server"]
        assert worked["state"] == "extracting" and worker["ranks"] == [1] and "--headless" in worker["command"], worked
        assert _flags(worker["command"]) >= {("--nnodes", "2"), ("--node-rank", "1")}, worker["command"]
        assert leftover_pids(server["marker"]) and leftover_pids(worker["marker"]), (server, worker)
        t_first = time.monotonic() - t0
        os.kill(worker["pid"], signal.SIGKILL)
        st = wait_status(inv, "online", env, lambda s: False, timeout=120)
        assert st["state"] == "failed" and st["error"]["type"] == "OnlineServerDied", st
        assert "online extraction server on host sv2 of replica svr" in st["error"]["message"], st["error"]
        assert str(worker["pid"]) in st["error"]["message"], st["error"]  # the worker host's own words
        assert st["error"]["where"] == "online server on host sv2" and st["error"]["rank"] == 0, st["error"]
        for marker in (server["marker"], worker["marker"]):
            assert _gone(marker, run_dir), (leftover_pids(marker), _trainers(run_dir))
        _until(lambda: _read_status(server_dir).get("state") == "failed", timeout=60)
        assert _read_status(server_dir)["error"]["host"] == "sv2", _read_status(server_dir)
        assert _read_status(worker_dir)["state"] == "failed", _read_status(worker_dir)
    finally:
        for sshd in server_hosts:
            sshd.destroy()
    # --keep-states none (the default): the token dataset only, linked; no state file anywhere in the run
    data = run_dir / trainplan.ONLINE_DATA
    assert [p for p in data.rglob("*") if not p.is_symlink()] == [], list(data.rglob("*"))
    assert [p for p in run_dir.rglob("*.safetensors") if "checkpoints" not in p.parts] == []
    first_losses = _train_losses(run_dir / trainplan.METRICS_FILE)
    assert 0 in first_losses and math.isfinite(first_losses[0]), first_losses

    # parity: the same rows, seed and order trained offline from the shared extraction's files (no server): the
    # same first-step loss as the online run's, within the noise of states made in another batch
    offline = specops("train", "--inventory", inv, "--run-id", "offline", "--from-run", run["run_id"], "--epochs", 1,
                      "--detach", "--json", env=env)
    assert offline.returncode == 0, offline.stdout[-4000:] + offline.stderr[-4000:]
    st_off = wait_status(inv, "offline", env, lambda s: False)
    assert st_off["state"] == "done", st_off
    offline_losses = _train_losses(work / "runs" / "offline" / trainplan.METRICS_FILE)
    assert [offline_losses[k] for k in (0, 1)] == pytest.approx([first_losses[k] for k in (0, 1)], rel=0.02), \
        (offline_losses, first_losses)  # epoch 0's curve

    # 2. the same command, a fresh server: the trainer dies (SIGKILL) -> the run fails naming it, the server stopped
    killed, st = _trainer_running(paced, args, env, st["attempt"], run_dir)
    os.kill(killed, signal.SIGKILL)
    st = wait_status(inv, "online", env, lambda s: False, timeout=120)
    # named with its rank and what to do (an OOM kill, a preemption)
    error = st["error"]
    assert st["state"] == "failed" and error["where"] == "trainer", error
    assert error["signal"] == "SIGKILL" and error["rank"] == 0 and error["pid"] == killed, error
    assert error["message"].startswith(f"rank 0 (trainer, pid {killed}) was killed by SIGKILL"), error
    assert "resumes from the last epoch checkpoint" in error["message"], error
    assert _gone(st["online_server"]["marker"], run_dir), (leftover_pids(st["online_server"]["marker"]),
                                                          _trainers(run_dir))
    assert st["online_server"]["stopped"] is True

    # 3. again: the supervisor dies (SIGKILL) while both halves run -> neither is left; the next status names it
    _, st = _trainer_running(paced, args, env, st["attempt"], run_dir)
    os.kill(st["pid"], signal.SIGKILL)
    assert _gone(st["online_server"]["marker"], run_dir, timeout=90), (leftover_pids(st["online_server"]["marker"]),
                                                                       _trainers(run_dir))
    code, st = run_status(inv, "online", env)
    assert st["state"] == "failed" and st["error"]["type"] == "SupervisorDied", st
    server = st["online_server"]

    # 4. the same command resumes it with a fresh server; an abort as it loads leaves nothing
    resumed = specops("train", "--inventory", inv, *args, "--detach", "--json", env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    st = wait_status(inv, "online", env,
                     lambda s: (s.get("online_server") or {}).get("marker") not in (None, server["marker"]),
                     after_attempt=st["attempt"])
    assert st["state"] in ("loading", "training"), st
    second = st["online_server"]
    abort = specops("abort", "--inventory", inv, "--run-id", "online", env=env, timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    code, st = run_status(inv, "online", env)
    assert code == 103 and st["state"] == "aborted", st
    assert leftover_pids(second["marker"]) == [] and _trainers(run_dir) == [], (leftover_pids(second["marker"]),
                                                                                 _trainers(run_dir))
    assert st["online_server"]["stopped"] is True

    # 5. the same command to the end, keeping the states this time, two streamed files corrupted: a curve, the
    # plan's aux ids, the states kept as an extraction run of their own
    # beside it (6.), a second online run keeping its states with the trainer as two torchrun ranks
    _start_ranked(inv, env, run["run_id"])
    done = specops("train", "--inventory", faulty, *args, "--keep-states", "all", "--force", "--json", env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    fetched = records(done)
    # preflight priced both ways with the rates of the last runs: the extraction's and the offline train's
    priced = fetched["train.online"]["detail"]["time"]
    assert priced["train_rate_from"] == "offline" and priced["online_s"] > priced["offline_s"] > 0, priced
    assert "offline ~" in fetched["train.online"]["summary"], fetched["train.online"]["summary"]
    final = fetched["train.run"]
    code, st = run_status(inv, "online", env)
    assert code == 0 and st["state"] == "done" and st["epoch"] == EPOCHS - 1, st
    assert st["resumed_from"]["epoch"] >= 0 and st["resumed_from"]["global_step"] >= 2, st["resumed_from"]
    # the corrupted sample: tried twice (non-finite, then ids off), counted, named, never trained on
    stream = st["online_stream"]
    assert stream["failed_round_trips"] == 2 and stream["retried"] == 1 and stream["dropped"] == 1, stream
    assert stream["dropped_rows"] == stream["rows"] and len(stream["rows"]) == 1, stream
    assert "Token ids don't match" in stream["last"]["error"], stream
    assert final["status"] == "warn" and final["detail"]["online_stream"] == stream, final
    assert f"rows {stream['rows']}" in final["summary"] and "not trained on" in final["summary"], final
    losses = _train_losses(run_dir / trainplan.METRICS_FILE)
    assert losses and all(math.isfinite(v) for v in losses.values()), losses
    assert "curve.png" in fetched["fetch.metrics"]["summary"], fetched["fetch.metrics"]
    steps = [json.loads(line)["step"] for line in
             (Path(env["SPECOPS_RUNS"]) / "th" / "online" / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    assert steps and steps[-1] == st["steps_total"] - 1, steps
    best = run_dir / "checkpoints" / "checkpoint_best"
    assert json.loads((best / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert fetched["train.online"]["detail"]["keep_states"] == "all", fetched["train.online"]
    kept = [p for p in run_dir.rglob("*.safetensors") if "checkpoints" not in p.parts]
    assert kept == [], kept  # the kept ones moved to the kept run, the failed tries deleted
    assert not (run_dir / trainplan.ONLINE_DATA / "hidden_states").exists()
    assert leftover_pids(st["online_server"]["marker"]) == []
    _check_kept_run(inv, env, work, run["run_id"], st, stream)
    t_ranked = time.monotonic()
    ranked = _check_ranked(inv, env, work, run["run_id"])
    t_ranked = time.monotonic() - t_ranked
    print(f"\nonline train: first server (disaggregated, replica svr over sv and sv2) ready {server['ready_s']} s, "
          f"to training {t_first:.0f} s; "
          f"all five starts and the offline train {time.monotonic() - t0:.0f} s; first-step loss online "
          f"{first_losses[0]}, offline {offline_losses[0]}; {fetched['train.online']['summary']}; two ranks kept "
          f"{ranked['ranks']} at {ranked['tokens_per_s']} tok/s, its wait and checks after 5. {t_ranked:.0f} s")


def _token_ids(path: Path) -> bytes:
    """A state file's ``token_ids`` tensor, its raw bytes (read by its safetensors header, stdlib only)."""
    from remote.system.weights import read_header

    begin, end = read_header(str(path))["tensors"]["token_ids"]["data_offsets"]
    with open(path, "rb") as fh:
        fh.seek(8 + int.from_bytes(fh.read(8), "little") + begin)
        return fh.read(end - begin)


def _start_ranked(inv, env, states_run: str) -> None:
    """A second online run, detached, beside the first (``--force``): ``--keep-states all`` with the trainer as two
    torchrun ranks (the CPU launcher's gloo, ``--gpus 2``), each with a spawned dataloader worker (as on a GPU,
    where speculators starts 12), 2 epochs."""
    started = specops("train", "--inventory", inv, "--run-id", "ranked", "--from-run", states_run, "--epochs", 2,
                      "--online", "--keep-states", "all", "--gpus", 2, "--trainer-arg=--num-workers=1", "--force",
                      "--detach", "--json", env=env)
    assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]


def _check_ranked(inv, env, work: Path, states_run: str) -> dict:
    """:func:`_start_ranked`'s run, once done: every row a rank streamed is in the kept run once, under its own
    index (its token ids those of the states run's file of that index); the kept run verifies, a train plan reads
    it, and its summary's tok/s is what the next preflight prices the offline way with."""
    from remote.train import keepstates, task
    from remote.verify.run import open_run
    from remote.wire import manifest as run_manifest

    run_dir = work / "runs" / "ranked"
    st = wait_status(inv, "ranked", env, lambda s: False, timeout=300)
    assert st["state"] == "done" and st["processes"] == 2, st
    assert st["command"][1:3] == ["-m", "torch.distributed.run"], st["command"]
    kept = st["kept_states"]
    ledgers = keepstates.read_streamed(run_dir / trainplan.ONLINE_DATA)
    streamed = [line["row"] for line in ledgers]
    # both ranks streamed (in their dataloader workers: a patch made in the rank alone would keep nothing), no row
    # twice, none lost
    assert {line["rank"] for line in ledgers} == {0, 1}, ledgers
    assert len(streamed) == len(set(streamed)) and streamed, ledgers
    found = open_run({"work_dir": str(work), "run_id": "ranked-kept"})
    states = open_run({"work_dir": str(work), "run_id": states_run})
    rows = [entry["index"] for entry in found.manifest["files"]]
    assert sorted(rows) == sorted(streamed) and len(rows) == len(set(rows)), (rows, streamed)
    assert kept["streamed"] == len(streamed) and kept["lost"] == [] and kept["streamed_twice"] == [], kept
    assert set(kept["ranks"]) == {"0", "1"} and sum(kept["ranks"].values()) == len(streamed), kept
    assert sorted(kept["missing"]) == sorted(set(range(4)) - set(streamed)), kept  # never streamed: never kept
    by_index = {entry["index"]: entry for entry in states.manifest["files"]}
    for entry in found.manifest["files"]:
        assert run_manifest.file_matches(found.output_dir / entry["path"], entry), entry
        assert _token_ids(found.output_dir / entry["path"]) == \
            _token_ids(states.output_dir / by_index[entry["index"]]["path"]), entry
    assert not (run_dir / trainplan.ONLINE_DATA / "hidden_states").exists()
    verified = specops("verify", "--inventory", inv, "--run-id", "ranked-kept", "--samples", 1, "--json", env=env,
                       timeout=300)
    assert verified.returncode == 0, verified.stdout[-4000:] + verified.stderr[-4000:]
    # its tok/s, recorded as an extraction's: the next train preflight from it prices both ways with it
    summary = json.loads((work / "runs" / "ranked-kept" / "summary.json").read_text())
    assert summary["tokens_per_s"] == kept["tokens_per_s"] > 0 and summary["ok"] == (not kept["missing"]), summary
    assert summary["tokens_this_attempt"] == sum(line["tokens"] for line in ledgers), summary
    plan = trainplan.resolve({"work_dir": str(work), "run_id": "from-kept", "from_run": "ranked-kept",
                              "online": True, "epochs": 2})
    assert plan.samples == len(rows) and plan.trainer_layer_ids == [2, 4, 5], plan
    priced = task.online_time(plan)
    assert priced["extract_tokens_per_s"] == summary["tokens_per_s"], priced
    assert f"at {summary['tokens_per_s']:.0f} tok/s" in priced["line"], priced
    return kept


def _server_replica(inv, tmp_path: Path, server_hosts, states_run: str) -> Path:
    """The shared inventory's host ``th`` (the trainer's), and ``sv`` and ``sv2`` as replica ``svr`` (TP=2, head
    ``sv``, one core each): each a second sshd on loopback with its own work dir, the same modern env, the states
    run linked into its runs (a server host reads its manifest)."""
    doc = yaml.safe_load(Path(inv).read_text())
    th = doc["hosts"]["th"]
    for core, (name, sshd) in enumerate(zip(("sv", "sv2"), server_hosts)):
        info, work = sshd.info(), tmp_path / name / "work"
        (work / "runs").mkdir(parents=True)
        (work / "runs" / states_run).symlink_to(Path(th["work_dir"]) / "runs" / states_run)
        doc["hosts"][name] = {**th, "port": info["port"], "user": info["user"], "key": info["key"],
                              "known_hosts": info["known_hosts"], "work_dir": str(work),
                              "env": {**(th.get("env") or {}), "VLLM_CPU_OMP_THREADS_BIND": str(core)}}
    doc["replicas"] = {"svr": {"hosts": ["sv", "sv2"], "tp": 2, "master_port": free_port_pair()}}
    path = tmp_path / "server-replica.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _flags(command: list[str]) -> set[tuple[str, str]]:
    """A command's ``--flag value`` pairs."""
    return set(zip(command, command[1:]))


def _read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}

