"""Benchmark: following a running job, the old way (a status call per second) against
the new way (one streaming follower), side by side over the same window of one run.

A throwaway test host (a real sshd on loopback, the cached remote env and tiny models)
runs one hf-reference extraction slowed down to last longer than the window. Four
followers watch it at the same time, each over its own SSH connection, for ``--seconds``:

* old, sftp / old, heredoc: what ``specops extract`` did before -- ``job.py status``
  once a second, each call a new python on the host (and, with SFTP delivery, a fresh
  entry script uploaded each time);
* new, sftp / new, heredoc: ``jobs.follow_run`` -- one python streaming events.

Each follower's connection is instrumented on the laptop side (the calls go through
unchanged) to count remote commands started (one python each), SSH channels, SFTP
requests, files and bytes uploaded, and every byte sent over SSH. Targets for the new
way: one remote python per follow, no upload after the first.

    .venv/bin/python scripts/bench_follow.py [--seconds 60]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import paramiko.sftp
import yaml

from specops.runs import hostjob
from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.params import run_params
from specops.result import RunStatus
from specops.testhost.hostenv import ensure_hostenv
from specops.testhost.models import ensure_models
from specops.testhost.sshd import TestHost

DELIVERIES = ("sftp", "heredoc")


class Counted:
    """Counts what one Host sends to its host, by wrapping its transport's calls."""

    def __init__(self, host: Host):
        self.commands = self.channels = self.sftp_requests = self.uploads = 0
        self.upload_bytes = self.sent_bytes = 0
        host.open()
        transport = host.cxn.transport
        open_session, open_sftp = transport.open_session, transport.open_sftp_client
        send_message = transport.packetizer.send_message
        put_bytes = host.put_bytes

        def counting_open_session(*args, **kwargs):
            self.channels += 1
            channel = open_session(*args, **kwargs)
            exec_command = channel.exec_command

            def counting_exec(command):
                self.commands += 1
                return exec_command(command)

            channel.exec_command = counting_exec
            return channel

        def count_requests(client):
            async_request = client._async_request  # every SFTP request goes through it

            def counting_request(fileobj, kind, *args):
                self.sftp_requests += 1
                if kind == paramiko.sftp.CMD_WRITE:
                    self.upload_bytes += len(args[-1])
                return async_request(fileobj, kind, *args)

            client._async_request = counting_request
            return client

        def counting_open_sftp():
            return count_requests(open_sftp())

        def counting_send(message):
            self.sent_bytes += len(message.asbytes())
            return send_message(message)

        def counting_put(data, path, *args, **kwargs):
            self.uploads += 1
            return put_bytes(data, path, *args, **kwargs)

        if host.spec.delivery == "sftp":
            count_requests(host.cxn.sftp())  # the SFTP session the warm-up call opened, kept by fabric
        transport.open_session = counting_open_session
        transport.open_sftp_client = counting_open_sftp
        transport.packetizer.send_message = counting_send
        host.put_bytes = counting_put


def follow_old_way(host: Host, run_id: str, seconds: float) -> int:
    """The loop ``specops extract`` used to run: one ``job.py status`` a second.

    :returns: how many distinct (state, samples_done) pairs it saw.
    """
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = RunStatus.from_payload(hostjob.job_call(host, "status", run_id))
        seen.add((state.state, state.samples_done))
        time.sleep(1.0)
    return len(seen)


def follow_new_way(host: Host, run_id: str, seconds: float) -> int:
    """One streaming follower for the whole window; returns the status changes it saw."""
    seen = set()

    def on_event(event):
        if event["event"] == "status":
            seen.add((event["status"].get("state"), event["status"].get("samples_done")))

    hostjob.follow_run(host, run_id, on_event, timeout=seconds)
    return len(seen)


def write_inventory(path: Path, info: dict, python: Path, models: dict, work: Path) -> Path:
    base = {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
            "known_hosts": info["known_hosts"], "python": str(python), "work_dir": str(work),
            "model_path": str(models["llama"]), "dataset": str(models["dataset"]),
            "output_dir": str(work / "out"), "device": "cpu", "engine": "hf-reference", "tp": 1,
            "seq_len": 64, "batch_size": 1, "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}
    hosts = {delivery: {**base, "delivery": delivery} for delivery in DELIVERIES}
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each follower follows")
    args = parser.parse_args()

    python = ensure_hostenv(sys.executable, quiet=True)
    models = ensure_models(python)
    rows = sum(1 for line in Path(models["dataset"]).read_text().splitlines() if line.strip())
    with tempfile.TemporaryDirectory(prefix="bench-follow-") as tmp:
        testhost = TestHost(name=f"bench-follow-{os.getpid()}", root=Path(tmp) / "testhost")
        info = testhost.up()
        try:
            inv = load_inventory(write_inventory(Path(tmp) / "inventory.yaml", info, python, models,
                                                 Path(tmp) / "work"))
            run(inv, rows, args.seconds)
        finally:
            testhost.destroy()


def run(inv, rows: int, seconds: float) -> None:
    run_id = f"bench-follow-{time.strftime('%H%M%S')}"
    # a sample every few seconds, for longer than the window: the run keeps moving throughout
    delay = round((seconds + 30) / rows, 2)
    with Host(inv.hosts["sftp"], inv) as starter:
        params = run_params(starter.spec, max_samples=rows)
        started = RunStatus.from_payload(hostjob.job_call(starter, "start", run_id, **params, batch_delay_s=delay))
        if not started.found:
            raise SystemExit(f"the run did not start: {started}")
        try:
            followers = []
            for way, follow in (("old", follow_old_way), ("new", follow_new_way)):
                for delivery in DELIVERIES:
                    host = Host(inv.hosts[delivery], inv)
                    hostjob.run_state(host, run_id)  # warm: connected, the bundle is on the host
                    followers.append((way, delivery, host, follow, Counted(host), {}))
            print(f"following run {run_id} ({rows} samples, one every ~{delay:.1f}s) for {seconds:.0f}s "
                  f"with 4 followers at once ...", flush=True)

            def go(host, follow, out):
                out["changes"] = follow(host, run_id, seconds)

            threads = [threading.Thread(target=go, args=(host, follow, out))
                       for _, _, host, follow, _, out in followers]
            t0 = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.monotonic() - t0
            final = hostjob.run_state(starter, run_id)
        finally:
            hostjob.job_call(starter, "abort", run_id, grace_s=2)
    for _, _, host, *_ in followers:
        host.close()
    report(followers, seconds, wall, final)


def report(followers, seconds: float, wall: float, final: RunStatus) -> None:
    columns = [f"{way}, {delivery}" for way, delivery, *_ in followers]
    rows = [
        ("remote pythons started", lambda c, o: c.commands),
        ("SSH channels opened", lambda c, o: c.channels),
        ("SFTP requests", lambda c, o: c.sftp_requests),
        ("files uploaded (SFTP)", lambda c, o: c.uploads),
        ("bytes uploaded (SFTP)", lambda c, o: c.upload_bytes),
        ("bytes sent over SSH", lambda c, o: c.sent_bytes),
        ("status changes seen", lambda c, o: o.get("changes", 0)),
    ]
    print(f"\n{seconds:.0f}s follow of a running job (wall {wall:.1f}s; the run was {final.state} at "
          f"{final.samples_done}/{final.samples_total} samples when the window closed)")
    print(f"{'':26}" + "".join(f"{c:>16}" for c in columns))
    values = {}
    for label, get in rows:
        values[label] = [get(counted, out) for _, _, _, _, counted, out in followers]
        print(f"{label:26}" + "".join(f"{v:>16,}" for v in values[label]))
    print()
    for i, delivery in enumerate(DELIVERIES):
        old = {k: v[i] for k, v in values.items()}
        new = {k: v[i + len(DELIVERIES)] for k, v in values.items()}
        ratios = ", ".join(f"{label} {old[label] / new[label]:.0f}x" for label in
                           ("remote pythons started", "SFTP requests", "bytes sent over SSH") if new[label])
        print(f"{delivery:8} old / new: {ratios}")
    for i, delivery in enumerate(DELIVERIES):
        new = {k: v[i + len(DELIVERIES)] for k, v in values.items()}
        one = new["remote pythons started"] == 1
        uploads = new["files uploaded (SFTP)"]
        print(f"target, new way over {delivery}: 1 remote python -> {'met' if one else 'MISSED'} "
              f"({new['remote pythons started']}); 0 uploads after the first -> "
              f"{'met' if uploads <= 1 else 'MISSED'} ({uploads} upload(s) in all)")


if __name__ == "__main__":
    main()
