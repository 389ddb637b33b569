"""A replica over several hosts in a group run's plan: one shard, each host's place in it, a move as one (pure)."""
from __future__ import annotations

import pytest

from specops.errors import UsageError
from specops.inventory import load_inventory
from specops.replica import node_params, replica_overrides
from specops.runs import shardmap
from specops.runs.reassign import _as_units


@pytest.fixture
def inventory(tmp_path):
    hosts = "".join(f"  {h}:\n    address: 127.0.0.{i + 1}\n    python: /p\n    model_path: /m\n    output_dir: /o\n"
                    for i, h in enumerate("abcde"))
    path = tmp_path / "inv.yaml"
    path.write_text("hosts:\n" + hosts + "replicas:\n  big: {hosts: [a, b], tp: 4, master_port: 31000}\n"
                    "  wide: {hosts: [c, d], tp: 2}\n")
    return load_inventory(path)


def test_each_host_of_a_replica_gets_its_place(inventory):
    head, worker = node_params(inventory, "a"), node_params(inventory, "b")
    assert head["tp"] == worker["tp"] == 4
    assert head["replica"] == {"name": "big", "hosts": ["a", "b"], "node_rank": 0, "nnodes": 2, "ranks_per_node": 2,
                               "tp": 4, "master_addr": "127.0.0.1", "master_port": 31000, "watch_port": 31001,
                               "node_address": "127.0.0.1"}
    assert worker["replica"]["node_rank"] == 1 and worker["replica"]["node_address"] == "127.0.0.2"
    assert worker["replica"]["master_addr"] == "127.0.0.1"  # every host reaches the head on its address
    assert node_params(inventory, "e") == {}


def test_tp_of_a_replica_is_its_own(inventory):
    assert replica_overrides(inventory, "a", {"seq_len": "64"}) == {"seq_len": "64", "tp": 4}
    assert replica_overrides(inventory, "e", {"tp": "8"}) == {"tp": "8"}
    with pytest.raises(UsageError, match=r"--tp 8 for replica 'big', whose tp is 4") as err:
        replica_overrides(inventory, "b", {"tp": "8"})
    assert "drop --tp" in err.value.hint


def test_a_replica_is_one_shard_of_the_plan(inventory):
    units = inventory.units(["e", "a", "b", "c", "d"])
    shards = shardmap.plan("r", 9, {h: 1.0 for h in units}, {}, members=units)
    assert [(s.hosts, s.start, s.stop, s.label) for s in shards] == [
        (["e"], 0, 3, "s0@e"), (["a", "b"], 3, 6, "s1@a+b"), (["c", "d"], 6, 9, "s2@c+d")]


def test_a_range_moves_to_a_replica_as_one(inventory):
    units = inventory.units(["e", "a", "b"])
    manifest = shardmap.GroupMap(run_id="r", total=6, shards=shardmap.plan("r", 6, {"e": 1.0, "a": 1.0}, {},
                                                                              members=units))
    assert _as_units(inventory, "e", "wide") == ("e", "c")
    assert _as_units(inventory, "big", "e") == ("a", "e")
    moved = shardmap.reassign(manifest, manifest.shards[0], "c", 1, "/o/r.s0m1", hosts=["c", "d"])
    assert moved.hosts == ["c", "d"] and moved.label == "s0m1@c+d" and (moved.start, moved.stop) == (1, 3)
    assert not shardmap.coverage_problems(manifest)
    with pytest.raises(UsageError, match=r"'d' runs ranks of replica 'wide', whose head is 'c'"):
        _as_units(inventory, "e", "d")
