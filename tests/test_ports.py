"""A port a run must listen on that something else holds (:mod:`remote.system.ports`): the replica head's watch
port is bound once a holder lets go, and one that stays taken fails the run naming the holder's pid and a fix the
laptop shows (the error's own ``fix``, through ``status.error_from`` and ``RunError``)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from remote.extract.replica import HostWatch
from specops.result import RunError
from conftest import free_port_pair

REPO_ROOT = Path(__file__).resolve().parents[1]


def head_block(master_port: int) -> dict:
    return {"name": "pair", "hosts": ["a", "b"], "node_rank": 0, "nnodes": 2, "ranks_per_node": 1, "tp": 2,
            "master_addr": "127.0.0.1", "master_port": master_port, "watch_port": master_port + 1,
            "node_address": "127.0.0.1"}


def holding(port: int) -> socket.socket:
    """A listener on ``port`` (no SO_REUSEADDR: nothing else binds it while it lives)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_a_watch_port_let_go_while_the_head_waits_is_bound(capsys):
    port = free_port_pair()
    holder = holding(port + 1)
    threading.Timer(1.5, holder.close).start()
    watch, t0 = HostWatch(head_block(port), on_lost=lambda error: None), time.monotonic()
    try:
        watch.start()
        assert watch.server.getsockname()[1] == port + 1
        assert time.monotonic() - t0 >= 1.0  # it waited for the holder, not around it
    finally:
        watch.close("done")
    said = capsys.readouterr().out
    # (who holds it is read through psutil, which the host's env has: the next test reads it there)
    assert f"the watch port 127.0.0.1:{port + 1} is taken (" in said and "waiting for it" in said


def test_a_watch_port_that_stays_taken_names_its_holder_and_the_fix(hostenv_python):
    """Held past the wait by this process: the run's error names this pid, LISTEN, and the fix (a master port
    below the kernel's ephemeral range, where this pair lies); the laptop's headline and fix read it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # a port of the ephemeral range, as an unlucky pick would be
    holder.listen(1)
    watch_port = holder.getsockname()[1]
    script = (
        "import json, sys\n"
        "from remote.extract.replica import HostWatch\n"
        "from remote.wire import status\n"
        f"watch = HostWatch({head_block(watch_port - 1)!r}, on_lost=lambda error: None)\n"
        "watch.bind_wait_s = 1.0\n"
        "try:\n"
        "    watch.start()\n"
        "except OSError as exc:\n"
        "    print(json.dumps(status.error_from(exc)))\n")
    try:  # the host's env (psutil is vLLM's) reads who holds the port
        out = subprocess.run([str(hostenv_python), "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    finally:
        holder.close()
    assert out.returncode == 0 and out.stdout, out.stderr
    error = json.loads(out.stdout.splitlines()[-1])  # after the line that says it waits
    assert error["type"] == "PortTaken" and f"the replica's watch port 127.0.0.1:{watch_port}" in error["message"]
    assert f"LISTEN by pid {os.getpid()}" in error["message"], error["message"]
    assert error["detail"]["users"][0]["pid"] == os.getpid() and error["detail"]["port"] == watch_port
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert error["fix"].startswith("set master_port of replica pair in the inventory") and f"below {low}" in error["fix"]
    assert f"stop pid {os.getpid()}" in error["fix"]
    seen = RunError.model_validate(error)
    assert seen.headline().startswith("supervisor: PortTaken: the replica's watch port"), seen.headline()
    assert seen.fix == error["fix"]


def test_a_master_port_torch_could_not_listen_on_fails_the_run_with_the_fix(hostenv_python, tmp_path):
    """torch's own TCPStore (what vLLM's ranks and torchrun listen with) refused a port this process holds: the
    failed run's status carries a fix that names the port and where to set another."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    script = (
        "import datetime, json, sys\n"
        "import torch.distributed as dist\n"
        "from remote.run.lifecycle import StatusFile\n"
        "from remote.wire import status\n"
        f"run = StatusFile(__import__('pathlib').Path({str(tmp_path / 'status.json')!r}), "
        "{'run_id': 'r', 'state': 'loading', 'kind': 'extract'}, beats=False)\n"
        "try:\n"
        f"    dist.TCPStore('127.0.0.1', {port}, 2, True, timeout=datetime.timedelta(seconds=3))\n"
        "except Exception as exc:\n"
        "    run.fail(status.error_from(exc))\n")
    try:
        out = subprocess.run([str(hostenv_python), "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    finally:
        holder.close()
    assert out.returncode == 0, out.stderr[-3000:]
    error = json.loads((tmp_path / "status.json").read_text())["error"]
    assert "EADDRINUSE" in error["message"] and f"port: {port}" in error["message"], error["message"]
    assert error["fix"].startswith(f"port {port} of that host is taken") and "master_port in the inventory" in \
        error["fix"] and "--master-port" in error["fix"], error["fix"]
