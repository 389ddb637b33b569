"""A host's ``dp x tp`` layout (remote/extract/layout.py) and the flags that set it: pure, no host."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote.extract import layout  # noqa: E402
from specops.errors import UsageError  # noqa: E402
from specops.params import check_flags  # noqa: E402


@pytest.mark.parametrize("tp, gpus, dp, sets, idle", [
    (1, 8, 8, [[0], [1], [2], [3], [4], [5], [6], [7]], []),   # 8 GPUs, 8B target
    (4, 8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]], []),               # 8 GPUs, 70B target
    (8, 8, 1, [list(range(8))], []),
    (3, 8, 2, [[0, 1, 2], [3, 4, 5]], [6, 7]),                 # the remainder stays idle, named
])
def test_the_default_is_as_many_replicas_as_the_gpus_hold(tp, gpus, dp, sets, idle):
    plan = layout.resolve({}, tp, "cuda", list(range(gpus)), "vllm-server")
    assert (plan.dp, plan.sets, plan.idle, plan.problem) == (dp, sets, idle, None)
    assert plan.text().startswith(f"dp {dp} x tp {tp} over {gpus} GPU(s)")


def test_visible_gpu_ids_are_kept_as_they_are():
    plan = layout.resolve({}, 2, "cuda", [2, 3, 6, 7])
    assert plan.sets == [[2, 3], [6, 7]]


def test_a_cpu_host_runs_one_replica_unless_asked_and_then_splits_its_cores():
    assert layout.resolve({}, 1, "cpu", [0, 1]).dp == 1
    assert layout.resolve({"dp": 2}, 1, "cpu", [0, 1]).sets == [[0], [1]]
    assert layout.resolve({"dp": 2}, 1, "cpu", [0, 1, 2, 3, 4]).sets == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("params, tp, devices, engine, says", [
    ({"dp": 3}, 1, [0, 1], None, "dp 3 x tp 1 needs 3 CPU core(s), 2 usable"),
    ({"dp": 2}, 4, list(range(4)), None, "dp 2 x tp 4 needs 8 CPU core(s), 4 usable"),
    ({"dp": 2}, 1, [0, 1], "hf-reference", "the hf-reference engine runs one replica per host"),
    ({"dp": 2, "replica": {"node_rank": 0}}, 1, [0, 1], None, "the replica is one data-parallel unit"),
])
def test_a_layout_that_cannot_run_says_why(params, tp, devices, engine, says):
    assert says in layout.resolve(params, tp, "cpu", devices, engine).problem


def test_a_host_of_a_replica_over_several_hosts_defaults_to_one():
    plan = layout.resolve({"replica": {"node_rank": 1, "ranks_per_node": 2}}, 2, "cuda", list(range(8)))
    assert plan.dp == 1 and plan.problem is None and plan.sets == [[0, 1]]


def test_an_engine_without_replicas_defaults_to_one():
    plan = layout.resolve({}, 1, "cuda", list(range(8)), "hf-reference")
    assert plan.dp == 1 and plan.problem is None and "one replica per host" in plan.why


@pytest.mark.parametrize("engine", ["speculators-0.3", "vllm-server"])
def test_the_seed_engine_runs_replicas_as_the_server_engine_does(engine):
    """One generator process per device set: the same default (GPUs // tp; one on a CPU host) and no refusal."""
    assert layout.resolve({}, 2, "cuda", list(range(8)), engine).sets == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.resolve({}, 1, "cpu", [0, 1], engine).dp == 1
    asked = layout.resolve({"dp": 2}, 1, "cpu", [0, 1], engine)
    assert (asked.dp, asked.sets, asked.problem) == (2, [[0], [1]], None)


def test_a_replica_gets_its_own_devices_from_the_one_env_writer():
    from remote.extract.engines.vllm_server import server_env

    gpu = layout.device_env({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, tp=2, on_cpu=False, devices=[2, 3])
    assert (gpu["CUDA_VISIBLE_DEVICES"], gpu["CUDA_DEVICE_ORDER"]) == ("2,3", "PCI_BUS_ID")
    cpu = layout.device_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tp=1, on_cpu=True, devices=[1])
    assert (cpu["VLLM_CPU_OMP_THREADS_BIND"], cpu["OMP_NUM_THREADS"]) == ("1", "1")
    # the server's environment is the same writer's, plus its marker
    server = server_env({}, marker="m", tp=1, on_cpu=True, devices=[1])
    assert {k: server[k] for k in cpu if k != "VLLM_CPU_OMP_THREADS_BIND"} == {
        k: v for k, v in cpu.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} and server["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_a_batch_goes_to_the_replicas_in_contiguous_parts_every_sample_once():
    from remote.extract.engines.replicas import split_parts

    for n in range(0, 13):
        for ways in (1, 2, 3, 8):
            parts = split_parts(list(range(n)), ways)
            assert [i for a, b in parts for i in range(a, b)] == list(range(n)), (n, ways)
            assert n == 0 or all(b > a for a, b in parts) and len(parts) == min(ways, n)
    # a full batch of batch_size x dp gives each replica batch_size samples, as a one-replica run's batches
    assert split_parts(list(range(6)), 2) == [(0, 3), (3, 6)]


def test_a_replicas_error_names_it():
    from remote.extract.engines.replicas import replica_error

    ranked = replica_error("dp1", {"type": "InjectedFailure", "message": "boom", "rank": 0,
                                   "source": "errors/rank0.json", "where": "escaped worker_main"})
    assert (ranked["message"], ranked["where"], ranked["source"], ranked["replica"]) == (
        "dp1: boom", "dp1/rank0", "errors/dp1/rank0.json", "dp1")
    dead = replica_error("dp0", {"type": "ProcessDied", "message": "dp0: killed", "rank": None,
                                 "where": "replica process"})
    assert (dead["message"], dead["where"]) == ("dp0: killed", "dp0/replica process")


@pytest.mark.parametrize("flags, says", [
    ({"dp": "0"}, "--dp"), ({"dp": "two"}, "--dp"), ({"on_replica_loss": "retry"}, "--on-replica-loss"),
])
def test_bad_dp_flags_name_the_flag(flags, says):
    with pytest.raises(UsageError) as err:
        check_flags(flags)
    assert says in str(err.value)


def test_bad_dp_fields_of_the_inventory_name_the_field(tmp_path):
    from specops.inventory import InventoryError, load_inventory

    path = tmp_path / "inv.yaml"
    path.write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, output_dir: /o, dp: 0, "
                    "on_replica_loss: maybe}\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert "field 'dp': must be at least 1" in str(err.value)
    assert "field 'on_replica_loss': must be one of fail, continue" in str(err.value)
