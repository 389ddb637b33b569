"""The supervisors' watch of a replica's hosts (``remote/extract/replica.py``), on loopback: a worker host that says
it failed, or whose connection closes with no word, is lost by name; the head's end reaches every host."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from remote.extract import replica
from remote.extract.engines.vllm_server import MARKER_ENV


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def watch():
    block = {"name": "pair", "hosts": ["a", "b", "c"], "nnodes": 3, "ranks_per_node": 2, "tp": 6,
             "node_rank": 0, "node_address": "127.0.0.1", "watch_port": free_port()}
    lost, seen = [], threading.Event()

    def on_lost(error):
        lost.append(error)
        seen.set()

    w = replica.HostWatch(block, on_lost)
    w.start()
    yield w, block, lost, seen
    w.close("failed")


def join(block: dict, node: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", block["watch_port"]), timeout=10)
    replica.send(sock, "hello", host=block["hosts"][node], node_rank=node, ranks=replica.ranks_of(block, node))
    return sock


def test_a_host_whose_connection_closes_is_lost_by_name(watch):
    w, block, lost, seen = watch
    b, c = join(block, 1), join(block, 2)
    c.close()  # the host died: its supervisor never said bye (its hello is read first, on the same connection)
    assert w.wait_lost(30) is lost[0]
    error = lost[0]
    assert (error["host"], error["node_rank"], error["rank"], error["ranks"], error["type"]) == (
        "c", 2, 4, [4, 5], "HostLost")
    assert "host c (node 2, ranks [4, 5]) is gone" in error["message"]
    w.close("failed", "host c is gone")
    assert replica.Lines(b).read(10) == [{"event": "end", "state": "failed", "message": "host c is gone"}]
    b.close()


def test_a_hosts_own_failure_keeps_its_rank_and_cause(watch):
    w, block, lost, seen = watch
    b = join(block, 1)
    replica.send(b, "failed", error={"rank": 3, "type": "RuntimeError", "message": "CUDA error: an illegal memory "
                                                                                   "access", "traceback": "..."})
    error = w.wait_lost(30)
    assert (error["host"], error["rank"], error["type"]) == ("b", 3, "RuntimeError")
    assert error["message"] == "on host b (node 1): CUDA error: an illegal memory access"
    b.close()
    assert len(lost) == 1  # one host, one loss: its connection closing after its word adds nothing


def test_the_cause_is_the_worker_killed_by_a_signal_even_when_its_word_comes_after_the_heads_failure(watch):
    """``HostWatch.cause``: a worker host's later word is a consequence of the head's failure, unless its server was
    killed by a signal and the head's was not (its peers on the head fail in a collective first)."""
    import time

    w, block, lost, seen = watch
    head = {"type": "EngineDeadError", "message": "the engine core died", "rank": 0}
    seen_at = time.monotonic()
    b = join(block, 1)
    replica.send(b, "failed", error={"type": "OnlineServerDied", "message": "ranks (pid 8) died: killed by SIGKILL",
                                     "death": {"name": "APIServer", "pid": 8, "exit_code": -9, "source": "waitpid"}})
    assert w.wait_lost(30)["host"] == "b"
    cause = w.cause(head, seen_at, 0)
    assert cause["host"] == "b" and cause["head_error"]["type"] == "EngineDeadError", cause
    # the head's own server killed too: the worker's word, later, is kept beside the head's error
    killed_head = {**head, "death": {"source": "waitpid"}}
    assert w.cause(killed_head, seen_at, 0)["other_errors"][0]["host"] == "b"
    b.close()


def test_a_host_that_says_bye_is_not_lost(watch):
    w, block, lost, seen = watch
    b = join(block, 1)
    replica.send(b, "bye", state="aborted")
    b.close()
    assert w.wait_lost(1.0) is None and not lost


def test_a_stopped_rank_process_is_found_by_its_servers_marker():
    marker = f"test-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, MARKER_ENV: marker})
    try:
        assert replica.stopped_pids(marker) == []
        os.kill(proc.pid, signal.SIGSTOP)
        found = []
        for _ in range(100):  # the kernel marks it stopped once the signal is delivered
            found = replica.stopped_pids(marker)
            if found:
                break
            threading.Event().wait(0.05)
        assert found == [proc.pid]
        assert replica.stopped_pids("another-marker") == []
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_rank_of_the_head_loses_the_head_by_name(watch, monkeypatch):
    """The head's own server (a real process in a session of its own, as the head starts its vLLM server):
    stopped past the grace, the head is lost as ``RanksStopped`` naming it, and a running one is not."""
    w, block, lost, seen = watch
    monkeypatch.setattr(replica, "STOPPED_GRACE_S", 1.0)

    class Server:  # the attributes the watch reads off the head's vllm-server engine's server
        marker = f"head-{os.getpid()}"
        params = {"own_session": True}
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                                env={**os.environ, MARKER_ENV: f"head-{os.getpid()}"})

    try:
        w.watch_own_ranks(lambda: Server)
        assert w.wait_lost(3.0) is None and not lost  # running: nothing to say
        os.kill(Server.proc.pid, signal.SIGSTOP)
        error = w.wait_lost(30)
        assert error is not None, "a stopped head rank was not seen"
        assert (error["host"], error["node_rank"], error["rank"], error["type"]) == ("a", 0, 0, "RanksStopped")
        assert f"process(es) [{Server.proc.pid}] of ranks [0, 1] on a (the head) are stopped" in error["message"]
    finally:
        Server.proc.kill()
        Server.proc.wait()


def test_a_worker_hosts_supervisor_is_known_alive_to_status_start_and_abort(tmp_path, monkeypatch):
    """A replica's worker-host supervisor (``python -m remote.extract.replica``, a real process here, waiting for a head
    that never answers): ``status`` sees it alive and writes no failure over it, the same ``start`` re-attaches
    instead of starting a second one, and ``abort`` stops it by SIGTERM (it records its own abort)."""
    from remote.run import job
    from remote.system import procscan
    from remote.run.rundir import SUPERVISOR_MODULES

    monkeypatch.setattr(job, "STARTING_GRACE_S", 0.0)  # judge liveness at once, as a look minutes later would
    block = {"name": "pair", "hosts": ["a", "b"], "nnodes": 2, "ranks_per_node": 1, "tp": 2, "node_rank": 1,
             "master_addr": "127.0.0.1", "master_port": free_port(), "watch_port": free_port(),
             "node_address": "127.0.0.1"}
    params = {"run_id": "rep", "work_dir": str(tmp_path / "work"), "model_path": str(tmp_path / "model"),
              "dataset": str(tmp_path / "data.jsonl"), "device": "cpu", "replica": block, "ready_timeout_s": 120.0}
    run_dir = tmp_path / "work" / "runs" / "rep"

    def supervisors() -> list[int]:
        found = []
        for pid in procscan.live_pids(env_any={f"SPECOPS_RUN_DIR={run_dir}".encode()}):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read().split(b"\0")[1:3] == [b"-m", SUPERVISOR_MODULES["replica"].encode()]:
                    found.append(pid)
        return found

    started = job.main({**params, "action": "start"})
    assert started["records"][0]["status"] == "changed", started
    pid = started["data"]["pid"]
    try:
        for _ in range(100):  # until it says it waits for the head
            if "waiting for the head" in str(job.current_status(run_dir).get("phase")):
                break
            threading.Event().wait(0.1)
        looked = job.main({**params, "action": "status"})
        st = looked["data"]["status"]
        assert st["alive"] and st["state"] == "pending" and st["error"] is None, st
        assert "waiting for the head a" in st["phase"]
        again = job.main({**params, "action": "start"})
        assert again["data"].get("already") == "running", again["records"]
        assert supervisors() == [pid]
        aborted = job.main({**params, "action": "abort", "grace_s": 10.0})
        assert aborted["records"][0]["status"] == "changed", aborted["records"]
        assert aborted["data"]["killed"] is False  # it stopped on SIGTERM, its own way
        st = job.current_status(run_dir)
        assert st["state"] == "aborted" and not st["alive"], st
        assert "[specops] supervisor exits (aborted)" in (run_dir / "logs" / "supervisor.log").read_text()
    finally:
        for left in supervisors():
            os.kill(left, signal.SIGKILL)


@pytest.mark.parametrize("message, named", [
    ("h1 died", True), ("worker on h1: exit 9", True), ("host h1.", True), ("(h1)", True),
    ("h10 died", False), ("gpu-h1 died", False), ("h1.example died", False), ("", False),
])
def test_a_lost_host_is_named_only_as_a_whole_word(message, named):
    """The lost host's name is put in front of a message that does not name it; ``h1`` is not named by ``h10``."""
    assert replica.names_host(message, "h1") is named
