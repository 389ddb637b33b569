"""Following a run over one channel, against the real sshd test host and real runs.

One follow is one python on the host for as long as it lasts (not one per look), it
streams status changes and new log lines as they happen, and it never outlives its
channel: closing the connection (Ctrl-C), or the laptop vanishing, ends it at once
while the detached run goes on. The reference engine (transformers) keeps runs short.
"""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specops.runs import hostjob
from specops.exit_codes import ExitCode
from specops.runs.run import extract
from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.params import run_params
from specops.result import RunStatus
from specops_cli import default_sigint

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def one_host(path) -> Host:
    inv = load_inventory(path)
    return Host(inv.hosts["th"], inv)


def start(host: Host, run_id: str, **overrides) -> RunStatus:
    params = run_params(host.spec)
    params.update(overrides)
    state = RunStatus.from_payload(hostjob.job_call(host, "start", run_id, **params))
    assert state.found, f"run {run_id} did not start"
    return state


class ChannelLog:
    """Every remote command this host starts and every file it uploads (calls go through)."""

    def __init__(self, host: Host):
        host.open()
        self.commands: list[str] = []
        self.uploads: list[str] = []
        put_bytes = host.put_bytes

        def counting_put(data, path, *args, **kwargs):
            self.uploads.append(path)
            return put_bytes(data, path, *args, **kwargs)

        host.put_bytes = counting_put
        transport = host.cxn.transport
        open_session = transport.open_session

        def counting_open_session(*args, **kwargs):
            channel = open_session(*args, **kwargs)
            exec_command = channel.exec_command

            def counting_exec(command):
                self.commands.append(command)
                return exec_command(command)

            channel.exec_command = counting_exec
            return channel

        transport.open_session = counting_open_session


def followers_on_host(work_dir: Path) -> list[int]:
    """Pids of live ``job follow`` entry scripts (the test host is this machine).

    Other tasks run entry scripts too (a status call): the script's own parameters,
    a base64 JSON literal in its text, tell a follower apart.
    """
    prefix = str(work_dir / "scripts" / "entry-").encode()
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            scripts = [w.decode() for w in cmdline.read_bytes().split(b"\0") if w.startswith(prefix)]
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
            text = Path(scripts[0]).read_text() if scripts else ""
        except (OSError, IndexError):
            continue
        params = re.search(r'b64decode\("([A-Za-z0-9+/=]+)"\)', text)
        if state != "Z" and params and json.loads(base64.b64decode(params.group(1))).get("action") == "follow":
            found.append(int(cmdline.parent.name))
    return found


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def llama_inventory(make_inventory, tiny_models, tmp_path):
    def make(**fields):
        base = dict(model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]),
                    engine="hf-reference", max_samples=6, seq_len=64, batch_size=2, tp=1,
                    output_dir=str(tmp_path / "out"))
        return make_inventory(**{**base, **fields})
    return make


def test_run_state_is_typed_from_any_job_payload():
    failed = RunStatus.from_payload({"data": {"run_dir": "/w/runs/r", "status": {
        "state": "failed", "samples_done": 2, "samples_total": 6, "attempt": 1,
        "error": {"rank": 1, "type": "OutOfMemoryError", "message": "CUDA out of memory", "traceback": "tb"}}}})
    assert failed.is_final and failed.exit_code == ExitCode.JOB_FAILED
    assert failed.error.headline() == "rank 1: OutOfMemoryError: CUDA out of memory"
    assert failed.model_dump()["attempt"] == 1  # keys we do not model are kept
    missing = RunStatus.from_payload({"records": [{"status": "fail"}], "data": {}})
    assert (missing.found, missing.is_final, missing.exit_code) == (False, False, ExitCode.JOB_NOT_FOUND)
    running = RunStatus.from_payload({"data": {"status": {"state": "extracting", "alive": True}}})
    assert not running.is_final and running.exit_code == ExitCode.JOB_RUNNING
    assert RunStatus.from_payload({"data": {"status": {"state": "aborted"}}}).exit_code == ExitCode.JOB_ABORTED


@pytest.mark.parametrize("delivery", ["sftp", "heredoc"])
def test_one_python_streams_status_and_logs_to_the_end(llama_inventory, delivery):
    with one_host(llama_inventory(delivery=delivery)) as host:
        start(host, "f1", batch_delay_s=0.5)
        channels = ChannelLog(host)
        events: list[dict] = []
        final = hostjob.follow_run(host, "f1", events.append, logs=True)

    assert final.state == "done" and final.samples_done == 6 and final.is_final
    # one remote command for the whole follow, and with SFTP one upload (its entry script)
    assert len(channels.commands) == 1, channels.commands
    assert len(channels.uploads) == (1 if delivery == "sftp" else 0), channels.uploads
    hello = [e for e in events if e["event"] == "hello"]
    assert len(hello) == 1 and hello[0]["pid"] > 0
    statuses = [e["status"] for e in events if e["event"] == "status"]
    assert statuses[-1]["state"] == "done"
    done = [s.get("samples_done") or 0 for s in statuses]
    assert done == sorted(done) and len(set(done)) >= 3, f"progress was not streamed: {done}"
    text = "".join(e["text"] for e in events if e["event"] == "log" and e["file"] == "supervisor.log")
    assert "run f1: 6 samples" in text
    offsets = [e["next_offset"] for e in events if e["event"] == "log" and e["file"] == "supervisor.log"]
    assert offsets == sorted(offsets)


def test_a_follow_of_a_missing_run_says_so(llama_inventory):
    with one_host(llama_inventory()) as host:
        state = hostjob.follow_run(host, "no-such-run", lambda e: pytest.fail(f"event for no run: {e}"))
    assert not state.found and state.exit_code == ExitCode.JOB_NOT_FOUND


def test_follower_never_outlives_its_channel(llama_inventory, tmp_path):
    """Close the connection, SIGKILL the laptop, Ctrl-C extract: each time the follower on
    the host is gone within seconds, and the run goes on."""
    # the job's env makes every batch wait 10 minutes: alive until aborted
    path = llama_inventory(max_samples=4, env={"SPECOPS_BATCH_DELAY_S": "600"})
    work_dir = tmp_path / "work"
    env = {**os.environ, "COLUMNS": "200", "SPECOPS_RUNS": str(tmp_path / "runs")}
    # started as `specops extract` starts it, so that step 3 re-attaches to it
    assert extract(load_inventory(path), None, {"max_samples": 4}, run_id="slow", detach=True, force=False,
                   skip_preflight=True, skip_smoke=True, as_json=True) == ExitCode.SUCCESS
    with one_host(path) as host:
        try:
            # 1. the connection closes under a follow in progress
            seen = threading.Event()
            pids: list[int] = []
            errors: list[BaseException] = []

            def on_event(event):
                if event["event"] == "hello":
                    pids.append(event["pid"])
                seen.set()

            def follow():
                try:
                    hostjob.follow_run(host, "slow", on_event)
                except BaseException as exc:  # noqa: BLE001 -- the closed connection, expected
                    errors.append(exc)

            thread = threading.Thread(target=follow)
            thread.start()
            assert seen.wait(60), "no event from the follower"
            assert followers_on_host(work_dir) == pids
            host.close()
            thread.join(30)
            assert not thread.is_alive() and errors, "the follow did not end with its connection"
            wait_until(lambda: not followers_on_host(work_dir), 10, "the follower to exit")
            assert hostjob.run_state(host, "slow").alive  # reconnects: the run goes on

            # 2. the laptop vanishes (SIGKILL: no goodbye on the channel)
            logs = subprocess.Popen([str(BIN / "specops"), "logs", "--inventory", str(path), "--run-id", "slow",
                                     "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, cwd=REPO_ROOT, env=env)
            assert any("run slow:" in line for line in logs.stdout), "the log lines never came"
            wait_until(lambda: followers_on_host(work_dir), 30, "the logs follower")
            logs.kill()
            logs.wait()
            wait_until(lambda: not followers_on_host(work_dir), 10, "the follower of a killed laptop to exit")

            # 3. Ctrl-C while extract follows: detached, exit 101, the follower goes too.
            # SIGINT as a terminal gives it: a test run started as a background job of a
            # script (`make test &`, nohup) has SIGINT ignored, its children inherit that and
            # Python then installs no KeyboardInterrupt handler: the Ctrl-C would be lost.
            # (PYTHONFAULTHANDLER: should it hang anyway, SIGABRT prints every thread's stack)
            cli = subprocess.Popen([str(BIN / "specops"), "extract", "--inventory", str(path), "--run-id",
                                    "slow", "--skip-preflight", "--skip-smoke", "--max-samples", "4"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                   text=True, cwd=REPO_ROOT, env={**env, "PYTHONFAULTHANDLER": "1"},
                                   preexec_fn=default_sigint)
            wait_until(lambda: followers_on_host(work_dir), 60, "extract's follower")
            cli.send_signal(signal.SIGINT)
            try:
                out, err = cli.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                cli.send_signal(signal.SIGABRT)
                out, err = cli.communicate(timeout=30)
                pytest.fail(f"specops extract did not exit within 60 s of SIGINT; where it was:\n{err[-12000:]}")
            assert cli.returncode == ExitCode.JOB_RUNNING, out + err
            assert "detached" in err and "Following run slow" in out
            wait_until(lambda: not followers_on_host(work_dir), 10, "extract's follower to exit")
            state = hostjob.run_state(host, "slow")
            assert state.alive and not state.is_final
        finally:
            hostjob.job_call(host, "abort", "slow", grace_s=2)


def test_logs_follow_prints_new_lines_until_the_run_ends(llama_inventory):
    path = llama_inventory()
    with one_host(path) as host:
        start(host, "lf", batch_delay_s=0.5)
    proc = subprocess.run([str(BIN / "specops"), "logs", "--inventory", str(path), "--run-id", "lf", "--follow"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "run lf: 6 samples" in proc.stdout
    with one_host(path) as host:
        assert hostjob.run_state(host, "lf").state == "done"  # it followed to the end, not a snapshot


def test_smoke_follows_its_run_until_the_supervisor_is_gone(llama_inventory):
    """smoke waits on one follower until its run is done and its supervisor exited, so a
    real run started right after it is never refused as "already running"."""
    from specops.smoke import smoke_step

    with one_host(llama_inventory()) as host:
        report = smoke_step(host, {"engine": "hf-reference", "tp": 1}, samples=2, verify=False)
        assert not report.failed, [(r.name, r.summary) for r in report.records]
        state = hostjob.run_state(host, report.data["run_id"])
    assert state.state == "done" and state.alive is False
    assert report.data["status"]["state"] == "done" and report.data["status"]["samples_done"] == 2
