"""Every host task declares its parameters once (remote/wire/argspec.py); a call is checked before the task runs.

Unknown keys are refused by name with the nearest spelling, a wrong type names the field,
``~`` is expanded once, defaults come from remote/wire/contract.py, and every key the laptop's
real call sites send is declared (a stand-in host records them; no SSH). One test runs the
rendered entry script for real, over a bundle dir that is the checkout's ``remote/``.
"""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.extract import shard  # noqa: E402
from remote.wire import argspec, contract
from remote.run import job
from remote.probes import preflight
from remote.wire.argspec import Arg, Spec  # noqa: E402

#: every task the laptop runs (``host.run_task`` / ``stream_task``), by name: the entry script's one table.
from remote.wire.protocol import TASKS  # noqa: E402


def task(name: str):
    return importlib.import_module(f"remote.{TASKS[name]}")


def test_every_host_task_the_laptop_names_is_in_the_one_table():
    names = set()
    for path in (REPO / "specops").rglob("*.py"):
        names |= set(re.findall(r"\.(?:run|stream)_task\(\s*\"(\w+)\"", path.read_text()))
    assert names <= set(TASKS) and names, names - set(TASKS)


# --------------------------------------------------------------------------- the checks


def test_an_unknown_key_is_refused_by_name_with_the_known_ones_and_a_fix(tmp_path):
    res = job.main({"action": "status", "run_id": "r1", "work_dir": str(tmp_path), "seq_lenn": 8})
    rec, = res["records"]
    assert rec["name"] == "job.params" and rec["status"] == "fail"
    assert rec["summary"].startswith("unknown parameter 'seq_lenn' for task job; known: action, ")
    assert "seq_len" in rec["summary"] and "seq_len" in rec["fix"] and rec["detail"]["fields"] == ["seq_lenn"]
    assert not (tmp_path / "runs").exists()  # the task never ran


@pytest.mark.parametrize("value,says", [("x", "must be an integer, got 'x'"), (True, "must be an integer, got True"),
                                        (-1, "must be at least 0, got -1"), (2.5, "must be an integer, got 2.5")])
def test_a_wrong_type_or_range_names_the_field(tmp_path, value, says):
    rec, = shard.main({"action": "files", "output_dir": str(tmp_path), "start": value, "stop": 4})["records"]
    assert rec["name"] == "shard.params" and rec["summary"] == f"parameter 'start' of task shard {says}"
    assert rec["fix"]


def test_values_are_converted_defaulted_and_every_problem_listed():
    spec = Spec("t", {"n": Arg("int", 3, min=1), "f": Arg("float", above=0, max=1), "b": Arg("bool", False),
                      "mode": Arg("str", "a", choices=("a", "b")), "ids": Arg("list", elements="int"),
                      "env": Arg("env"), "blob": Arg("any")})
    got = spec.validate({"n": "8", "f": 1, "ids": [1, 2.0, "3"], "env": {"A": 1, "B": "x"}, "mode": "", "blob": [{}]})
    assert got == {"n": 8, "f": 1.0, "b": False, "mode": "a", "ids": [1, 2, 3], "env": {"A": "1", "B": "x"},
                   "blob": [{}]}
    assert got.given == {"n", "f", "ids", "env", "mode", "blob"}
    with pytest.raises(argspec.ArgError) as refused:
        spec.validate({"n": 0, "f": 0, "b": "yes", "mode": "c", "ids": [1, "x"], "env": {"A": None}})
    fields = refused.value.detail["fields"]
    assert fields == ["n", "f", "b", "mode", "ids", "env"], refused.value.detail
    assert "(and 5 more problem(s))" in refused.value.summary
    problems = refused.value.detail["problems"]
    assert "must be at least 1" in problems[0] and "must be above 0" in problems[1]
    assert "must be true or false, got 'yes'" in problems[2] and "one of a, b" in problems[3]
    assert "item 1 must be an integer, got 'x'" in problems[4] and "'A' must be a string" in problems[5]


def test_required_internal_keys_prefixes_and_nested_options():
    spec = Spec("t", {"a": Arg("str", required=True), "verb": Arg("str", "x"), "k": Arg("int"),
                      "model_has_*": Arg("bool"),
                      "probe": Arg("dict", options={"token": Arg("str", required=True), "dir": Arg("path")})},
                required_if=[("verb", "y", ("k",))])
    ok = spec.validate({"a": "1", "_bundle_dir": "/b", "model_has_mla": True, "probe": {"token": "t"}})
    assert ok["_bundle_dir"] == "/b" and ok["model_has_mla"] is True and ok["probe"] == {"token": "t", "dir": None}
    _, problems = spec.check({"verb": "y", "probe": {"tokn": "t"}, "model_has_mla": 1})
    assert [p[0] for p in problems] == ["probe.tokn", "probe.token", "model_has_mla", "a", "k"], problems
    assert "spell it probe.token" in problems[0][2]
    assert problems[4][1] == "task t with verb 'y' needs parameter(s) k"
    with pytest.raises(argspec.ArgError, match="must be a mapping"):
        spec.validate(["not", "a", "mapping"])


def test_tilde_is_expanded_once_in_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    got = preflight.SPEC.check({"model_path": "~/m", "site_packages": ["~/a", "/b"], "patches_root": "~",
                                "dataset": "/d/~x"})[0]
    assert got["model_path"] == str(tmp_path / "m") and got["site_packages"] == [str(tmp_path / "a"), "/b"]
    assert got["patches_root"] == str(tmp_path) and got["dataset"] == "/d/~x"
    facts = task("facts").SPEC.validate({"inventory": {"model_path": "~/kept as sent"}})
    assert facts["inventory"] == {"model_path": "~/kept as sent", "work_dir": str(tmp_path / ".specops"), "env": {}}
    assert task("facts").SPEC.validate({})["inventory"] == {"work_dir": str(tmp_path / ".specops"), "env": {}}
    # the task modules leave it to the spec: no second expansion on the host
    for name in TASKS:
        assert "expanduser" not in Path(task(name).__file__).read_text(), name
    entry = (REPO / "templates" / "entry.py.j2").read_text()
    assert "PATH_KEYS" not in entry and entry.count("expanduser") == 1  # the bundle dir only


def test_defaults_come_from_the_contract():
    for name, value in contract.DEFAULTS.items():
        assert preflight.SPEC.defaults[name] == value == preflight.DEFAULTS[name], name
    assert shard.SPEC.validate({})["device"] == preflight.SPEC.defaults["device"] == "cuda"
    # a run records what was sent, not the defaults: the supervisor applies them (contract.param)
    sent = job.SPEC.validate({"action": "start", "run_id": "r", "work_dir": "/w", "model_path": "/m",
                              "dataset": "/d", "seq_len": 64, "force": True, "python": "/p", "output_dir": None})
    assert job.job_params(sent) == {"run_id": "r", "work_dir": "/w", "model_path": "/m", "dataset": "/d",
                                    "seq_len": 64, "output_dir": None}


def test_preflight_reports_bad_params_and_goes_on_with_defaults():
    checked, problems = preflight.SPEC.check({"model_path": "/m", "tp": "two", "device": "tpu", "seq_lenn": 1})
    assert len(problems) == 3 and checked["tp"] == 1 and checked["device"] == "cuda" and "seq_lenn" not in checked
    assert preflight.SPEC.lenient and not job.SPEC.lenient


def test_job_call_keys_are_declared_not_kept_by_hand():
    assert job.CALL_KEYS == {"action", "force", "offsets", "tail_bytes", "max_bytes", "grace_s", "python", "logs",
                             "until", "timeout_s", "poll_s", "heartbeat_s", "exit_grace_s", "slurm"}
    assert set(job.CALL_KEYS) <= set(job.SPEC.args)


def test_test_hooks_are_declared_and_documented_once():
    hooks = argspec.hooks(*(task(name).SPEC for name in TASKS))
    assert set(hooks["job"]) == {"inject_failure", "batch_delay_s", "plain", "server_args_unchecked",
                                 "swap_sample_states"}
    assert set(hooks["patcher"]) >= {"inject_failure_after", "hold_lock_s"} and hooks["facts"] == ["cli"]
    doc = argspec.__doc__
    for name in {h for names in hooks.values() for h in names} | {"_python_min", "SPECOPS_BATCH_DELAY_S"}:
        assert f"``{name}``" in doc, name
    assert "PYTHON_MIN_OVERRIDE" not in (REPO / "specops" / "transport" / "remote_task.py").read_text()
    assert "inject_failure" not in (REPO / "specops" / "extract.py").read_text()


# --------------------------------------------------------------------------- what the laptop sends


def laptop_tasks() -> set:
    """The task names ``specops/`` runs on hosts, read from its source."""
    found = set()
    for path in (REPO / "specops").rglob("*.py"):
        found |= set(re.findall(r"(?:run_task|stream_task)\(\s*\"(\w+)\"", path.read_text()))
    return found


def test_every_task_the_laptop_runs_declares_a_spec():
    assert laptop_tasks() == set(TASKS)
    for name in TASKS:
        spec = task(name).main.spec
        assert spec is task(name).SPEC and spec.name == name


class StandIn:
    """A host whose tasks only check their params against the task's spec; answers minimal payloads."""

    def __init__(self, spec):
        self.spec, self.name, self.bundle_bytes_sent = spec, spec.name, 0
        self.calls = []

    def run_task(self, module, params, **_):
        task(module).SPEC.validate(params)  # raises, naming the field, on an undeclared key or a wrong type
        self.calls.append((module, params.get("action")))
        data = {}
        if module == "smoke":
            data = {"twin_dir": "/twin", "twin_hash": "0" * 20, "dataset": "/twin/samples.jsonl", "samples": 4,
                    "seq_len": 128, "twin": {"layers": 8}}
            if params.get("real"):  # the verification run of the model itself: its ids and engine
                data.update(twin_dir="/m", layer_ids=[1, 2, 4, 5, 7, 8], layer_convention="input",
                            engine="vllm-server", real=True)
        if module == "job" and params.get("action") != "status":
            data = {"status": {"state": "done", "samples_done": 4, "samples_total": 4}, "run_dir": "/r"}
        return {"records": [], "data": data}

    def stream_task(self, module, params, on_line, **_):
        return self.run_task(module, params)


def test_every_key_the_laptop_sends_is_declared():
    from specops.runs import hostjob
    from specops.extract import start_step
    from specops.facts import facts_step
    from specops.inventory import HostSpec
    from specops.patch import patch_step
    from specops.preflight import preflight_step
    from specops.runs import plan, pool
    from specops.runs import start as group_start
    from specops.runs.shardmap import Shard
    from specops.smoke import smoke_step
    from specops.verify import verify_step

    spec = HostSpec(name="h", address="127.0.0.1", python="~/env/bin/python", model_path="~/m", output_dir="/o",
                    dataset="/d.jsonl", layer_ids=[1, 2], layer_convention="input", env={"A": "1"},
                    trust_remote_code=True)
    host = StandIn(spec)
    overrides = {"tp": "2", "seq_len": "64", "engine": "hf-reference"}
    facts_step(host, {"cli": ["x"]})
    preflight_step(host, overrides, skip_autoconfig=True)
    for action in ("apply", "check", "revert", "status"):
        patch_step(host, action, overrides=overrides, extra={"hold_lock_s": 1, "inject_failure_after": 1})
    smoke_step(host, overrides, samples=4)
    verify_step(host, "r1", samples=2)
    start_step(host, "r1", overrides, skip_preflight=True, force=True, skip_smoke=True)
    # the verification run of the real model: its job (ids, canary) and both references
    smoke_step(host, overrides, samples=2, real=True)
    start_step(host, "r2", overrides, skip_preflight=True, force=True, skip_smoke=True, smoke_real=True)
    for action in ("status", "logs", "abort"):
        hostjob.job_call(host, action, "r1")
    hostjob.follow_run(host, "r1", logs=True, offsets={"supervisor.log": 3}, until="exited", timeout=5)
    shard_ = Shard(id="s0", hosts=["h"], start=0, stop=4, run_id="R", output_dir="/o/R")
    group_start.start_step(None, shard_, host, overrides, False)
    pool.shard_files(host, shard_, sha256=True, timeout=5)
    for preflight in (False, True):  # the shard probe alone, or inside the plan's one preflight call
        plan.probe_step(host, overrides, preflight=preflight,
                        storage_probe={"dir": "/o/R", "token": "t", "work_dir": "~/.specops", "others": {"g": "u"}})
    host.run_task("merge", {"output_dir": "/o/R", "run_id": "R", "ranges": [[0, 2], [2, 4]]})  # specops/storage.py
    from specops.draft_eval import eval_step
    from specops.train import start_step as train_start

    train_start(host, "t1", "r1", epochs=2, dry_run=True, force=False)
    eval_step(host, "t1", from_run="r1", k=3, prompts=4, max_tokens=8, baseline=True)
    # a replica over two hosts: its preflight on each, and a shard started on both (the worker's place in it)
    from pathlib import Path

    from specops.inventory import Inventory, ReplicaSpec
    from specops.replica import probe_hosts

    worker = StandIn(spec.model_copy(update={"name": "w"}))
    replica = ReplicaSpec(name="pair", hosts=["h", "w"], tp=2)
    inventory = Inventory(path=Path("inv.yaml"), hosts={"h": spec, "w": worker.spec}, replicas={"pair": replica})
    both = {"h": host, "w": worker}
    probe_hosts(inventory, replica, both.__getitem__, overrides)

    class Conns:
        def __init__(self):
            self.inventory = inventory

        def host(self, name):
            return both[name]

    pair = Shard(id="s0", hosts=["h", "w"], start=0, stop=4, run_id="R", output_dir="/o/R")
    group_start.start_step(None, pair, host, {k: v for k, v in overrides.items() if k != "tp"}, False, Conns())
    assert ("job", "start") in worker.calls and ("replica_probe", None) in worker.calls
    # a host behind Slurm: the login node's partition check, and a start that carries the slurm mapping
    from specops.inventory import SlurmSpec

    slurm_host = StandIn(spec.model_copy(update={"name": "s", "scheduler": "slurm",
                                                 "slurm": SlurmSpec(partition="gpu", gres="gpu:8", time_limit="60")}))
    preflight_step(slurm_host, overrides, skip_autoconfig=True)
    start_step(slurm_host, "r3", overrides, skip_preflight=True, force=True, skip_smoke=True)
    assert ("slurm", "partition") in slurm_host.calls and ("job", "start") in slurm_host.calls
    host.calls += slurm_host.calls
    assert {module for module, _ in host.calls} == set(TASKS), host.calls


# --------------------------------------------------------------------------- over the entry script


def test_the_entry_script_runs_a_task_with_checked_params(tmp_path):
    """The rendered entry script, run for real over a bundle dir that is this checkout's remote/."""
    from specops.transport.remote_task import RemoteTask
    from specops.transport.render import render_entry

    bundle = tmp_path / "bundles" / "checkout"
    bundle.mkdir(parents=True)
    (bundle / "remote").symlink_to(REPO / "remote")
    (bundle / ".complete").touch()
    reader = RemoteTask.__new__(RemoteTask)  # only its parser: no host behind it
    reader.host, reader.spec = SimpleNamespace(name="h"), SimpleNamespace(python="python3")

    def run(params: dict) -> dict:
        script = render_entry("facts", {"_bundle_dir": str(bundle), **params})
        proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60,
                              env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        return reader.parse("facts", SimpleNamespace(stdout=proc.stdout, stderr=proc.stderr, exited=proc.returncode))

    good = run({"inventory": {"work_dir": "~/w", "env": {"X": 1}}, "cli": "kept"})
    assert good["data"]["work_dir"] == str(tmp_path / "w") and (tmp_path / "w").is_dir()
    assert good["data"]["received"] == {"cli": "kept", "inventory": {"work_dir": str(tmp_path / "w"),
                                                                     "env": {"X": "1"}}}
    assert good["data"]["env_seen"] == {"X": "1"}
    bad = run({"inventory": {}, "work_dirr": "~/x"})
    rec, = bad["records"]
    assert rec["name"] == "facts.params" and "unknown parameter 'work_dirr' for task facts" in rec["summary"]
    assert json.dumps(bad).count("crash") == 0
