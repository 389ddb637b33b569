"""Preflight of a replica over several hosts: every host's probe (``remote/extract/replica_probe.py``) run for real,
at once, on loopback, and judged as the laptop judges it (:func:`specops.replica.judge`)."""
from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path

import pytest

from remote.extract import replica_probe
from specops.inventory import ReplicaSpec
from specops.replica import judge
from conftest import free_port_pair  # P and P + 1 free: the master port and the watch

MODEL_FILES = {"config.json": b'{"model_type": "llama", "num_hidden_layers": 2}',
               "model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a": 1}        ' + b"\x00" * 64}


def model_dir(root: Path, **changed: bytes) -> Path:
    root.mkdir(parents=True)
    for name, data in {**MODEL_FILES, **changed}.items():
        (root / name).write_bytes(data)
    return root


def probe_replica(replica: ReplicaSpec, models: dict[str, Path], listen_s: float = 5.0, only: str | None = None
                  ) -> dict:
    """Every host's probe at once, as the laptop runs them (the head holds its ports meanwhile); ``only``:
    that host's alone."""

    def one(host: str):
        node = replica.hosts.index(host)
        block = {"name": replica.name, "hosts": replica.hosts, "node_rank": node, "nnodes": len(replica.hosts),
                 "ranks_per_node": replica.ranks_per_host, "tp": replica.tp, "master_addr": "127.0.0.1",
                 "master_port": replica.master_port, "watch_port": replica.watch_port, "node_address": "127.0.0.1"}
        sent = time.time()
        payload = replica_probe.main({"model_path": str(models[host]), "device": "cpu", "replica": block,
                                      "listen_s": listen_s, "env": {"NCCL_SOCKET_IFNAME": "lo"}})
        return payload, (sent, time.time())

    with concurrent.futures.ThreadPoolExecutor(len(replica.hosts)) as pool:
        done = {h: pool.submit(one, h) for h in replica.hosts if only in (None, h)}
        answers = {h: f.result()[0] for h, f in done.items()}
        answers["_clock"] = {h: f.result()[1] for h, f in done.items()}
    return answers


def by_name(records) -> dict:
    return {r.name: r for r in records}


def test_a_sound_replica_passes_every_check(tmp_path):
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=free_port_pair())
    model = model_dir(tmp_path / "m")
    records = by_name(judge(replica, probe_replica(replica, {"a": model, "b": model})))
    for name in ("replica.versions", "replica.model", "replica.devices", "replica.master_port",
                 "replica.port_range", "replica.network", "replica.clock"):
        assert records[name].status == "ok", (name, records[name].summary)
    assert "NCCL_SOCKET_IFNAME=lo" in records["replica.network"].summary
    assert records["replica.hosts"].status == "ok" and records["replica.hosts"].detail["overlap_s"] > 0
    assert records["replica.master_port"].detail["head"]["peers"][str(replica.master_port)] == ["127.0.0.1"]


def test_another_copy_of_the_model_is_named(tmp_path):
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=free_port_pair())
    odd = {"model.safetensors": MODEL_FILES["model.safetensors"].replace(b'"a": 1', b'"a": 2')}
    models = {"a": model_dir(tmp_path / "a"), "b": model_dir(tmp_path / "b", **odd)}
    record = by_name(judge(replica, probe_replica(replica, models)))["replica.model"]
    assert record.status == "fail" and record.detail["differ"] == ["b"]
    assert "b differ(s) from the head a" in record.summary and record.fix


def ephemeral_port_pair() -> int:
    """A port P with P and P + 1 free that the kernel hands to outgoing connections (bind to port 0 draws there)."""
    for _ in range(50):
        with socket.socket() as one:
            one.bind(("127.0.0.1", 0))
            port = one.getsockname()[1]
            try:
                with socket.socket() as two:
                    two.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free consecutive ephemeral ports")


def test_a_master_port_in_the_ephemeral_range_is_a_warn_with_a_port_below_it(tmp_path):
    """A pair the kernel may give an outgoing connection at any time (the head's ip_local_port_range) is a warn
    naming the range and a port below it."""
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=ephemeral_port_pair())
    model = model_dir(tmp_path / "m")
    records = by_name(judge(replica, probe_replica(replica, {"a": model, "b": model}, listen_s=2.0)))
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = records["replica.port_range"]  # judged whether or not an outgoing connection took the pair meanwhile
    assert rng.status == "warn" and rng.detail["ephemeral_range"] == [low, high], rng
    assert f"ephemeral range {low}-{high}" in rng.summary and f"below {low}" in rng.fix


def test_a_taken_master_port_and_too_many_ranks_fail(tmp_path):
    port = free_port_pair()
    model = model_dir(tmp_path / "m")
    with socket.socket() as squatter:  # another program holds the master port on the head
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=64, master_port=port)
        records = by_name(judge(replica, probe_replica(replica, {"a": model, "b": model}, listen_s=1.0)))
    assert records["replica.master_port"].status == "fail"
    assert f"port {port}" in records["replica.master_port"].summary
    devices = records["replica.devices"]
    assert devices.status == "fail" and "32 rank(s) per host" in devices.summary and "too few on a, b" in devices.summary


def test_a_worker_that_cannot_reach_the_head_is_named(tmp_path):
    # the head's probe answers nothing here: the worker tries the (closed) loopback ports alone
    port = free_port_pair()
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=port)
    model = model_dir(tmp_path / "m")
    block = {"name": "pair", "hosts": ["a", "b"], "node_rank": 1, "nnodes": 2, "ranks_per_node": 1, "tp": 2,
             "master_addr": "127.0.0.1", "master_port": port, "watch_port": port + 1, "node_address": "127.0.0.1"}
    worker = replica_probe.main({"model_path": str(model), "device": "cpu", "replica": block, "listen_s": 1.0})
    head = {"data": {"node_rank": 0, "listen": {"bound": {str(port): None, str(port + 1): None}, "peers": {}},
                     "node_address": "127.0.0.1"}}
    record = by_name(judge(replica, {"a": head, "b": worker}))["replica.master_port"]
    assert record.status == "fail" and "b cannot reach the head on 127.0.0.1:" in record.summary


def test_hosts_checked_one_after_another_are_told_apart(tmp_path):
    """The windows ``replica.hosts`` judges: the head's probe, then the worker's, do not overlap (a warn),
    and the worker then finds no head to reach (the head held its ports while nobody came)."""
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=free_port_pair())
    model = model_dir(tmp_path / "m")
    answers, clock = {}, {}
    for host in replica.hosts:  # one after another, as a serial loop over the hosts would run them
        one = probe_replica(ReplicaSpec(name="pair", hosts=replica.hosts, tp=2, master_port=replica.master_port),
                            {"a": model, "b": model}, listen_s=1.0, only=host)
        answers[host], clock[host] = one[host], one["_clock"][host]
    records = by_name(judge(replica, {**answers, "_clock": clock}))
    hosts = records["replica.hosts"]
    assert hosts.status == "warn" and hosts.detail["overlap_s"] <= 0, hosts
    assert "did not overlap" in hosts.summary
    assert records["replica.master_port"].status == "fail"


def test_a_slow_call_is_no_clock_skew_and_a_real_skew_is_named(tmp_path):
    """The clock check judges by each call's round trip: the head's call that lasts while it holds its ports
    (20 s here) shows no skew, where its clock reading at the start against the call's midpoint made one; a host
    whose clock is 30 s ahead is named, as far apart as the calls prove."""
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=free_port_pair())
    model = model_dir(tmp_path / "m")
    answers = probe_replica(replica, {"a": model, "b": model})
    t = time.time()
    # the same answers, timed as a slow head call would be: both hosts' clocks agree with the laptop's
    timing = {"a": (t, t + 0.5, t + 20.0, t + 20.5), "b": (t, t + 0.5, t + 1.5, t + 2.0)}
    for host, (sent, started, ended, received) in timing.items():
        answers[host]["data"].update(time_unix=started, started_unix=started, ended_unix=ended)
        answers["_clock"][host] = (sent, received)
    clock = by_name(judge(replica, answers))["replica.clock"]
    assert clock.status == "ok", clock.summary
    assert clock.detail["skew_at_least_s"] == 0 and clock.detail["skew_at_most_s"] == 1.0, clock.detail
    for key in ("time_unix", "started_unix", "ended_unix"):  # b's clock runs 30 s ahead
        answers["b"]["data"][key] += 30.0
    clock = by_name(judge(replica, answers))["replica.clock"]
    assert clock.status == "warn" and clock.fix, clock.summary
    assert clock.detail["skew_at_least_s"] == 29.0 and clock.detail["skew_at_most_s"] == 31.0, clock.detail
    assert "at least 29.00 s apart" in clock.summary


def test_one_host_answering_is_not_every_host(tmp_path):
    """A worker whose probe refused its parameters answers with a failure, not findings: the recap counts the
    hosts that answered against those asked, names the silent one, and no check speaks for every host."""
    replica = ReplicaSpec(name="pair", hosts=["a", "b"], tp=2, master_port=free_port_pair())
    model = model_dir(tmp_path / "m")
    head = probe_replica(replica, {"a": model, "b": model}, listen_s=1.0, only="a")
    refused = replica_probe.main({"model_path": str(model), "device": "cpu", "listen_s": -1,
                                  "replica": {"name": "pair", "node_rank": 1}})
    assert refused["records"][0]["status"] == "fail"
    records = judge(replica, {"a": head["a"], "b": refused, "_clock": head["_clock"]})
    hosts = by_name(records)["replica.hosts"]
    assert hosts.status == "fail" and "1 of 2 hosts answered" in hosts.summary, hosts.summary
    assert "b: its probe failed" in hosts.summary and hosts.detail["answered"] == ["a"]
    assert not [r.summary for r in records if "every" in r.summary and r.status == "ok"]
    for name in ("replica.versions", "replica.model", "replica.master_port"):
        record = by_name(records)[name]
        assert record.status == "skipped" and "b not " in record.summary, (name, record.summary)


@pytest.mark.parametrize("bind, ranks_per_node, status", [("1", 1, "ok"), ("0|1", 2, "ok"), ("0|1", 1, "warn"),
                                                          ("0", 2, "warn")])
def test_thread_binding_is_judged_against_the_ranks_on_this_host(bind, ranks_per_node, status):
    """A replica's host binds one core range per rank it runs, not per rank of the whole TP: ``"1"`` for the
    one rank of TP=2 a worker host of two runs is right (the host checks of this machine, for real)."""
    from remote.probes import Context, host

    params = {"device": "cpu", "engine": "vllm-server", "tp": 2, "model_path": None, "output_dir": None,
              "env": {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"},
              "replica": {"name": "pair", "node_rank": 1, "ranks_per_node": ranks_per_node}}
    threads = by_name_dict(host.probe(Context(params)))["host.cpu_threads"]
    assert threads["status"] == status, threads["summary"]
    assert f"{ranks_per_node} rank(s) of TP=2 on this host" in threads["summary"] or ranks_per_node == 2
    assert threads["detail"]["ranks_here"] == ranks_per_node


def by_name_dict(records) -> dict:
    return {r["name"]: r for r in records}
