"""specops/runs/run.py: one place decides whether a run id is a group's or a host's; the tasks only call verbs."""
from __future__ import annotations

import inspect

from specops.runs.run import GroupRun, HostRun, Run, open_run


class Inventory:  # open_run reads nothing of it; the verbs do
    pass


def test_a_run_id_is_a_group_run_when_this_laptop_holds_its_shard_map(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    inv = Inventory()
    assert type(open_run(inv, "a", "R1")) is HostRun
    (tmp_path / "runs" / "R1").mkdir(parents=True)
    (tmp_path / "runs" / "R1" / "group.json").write_text("{}")
    got = open_run(inv, "a", "R1", accept_new_host_key=True)
    assert type(got) is GroupRun and got.group and got.accept_new_host_key and got.run_id == "R1"
    assert type(open_run(inv, "a,b", "R2", as_group=True)) is GroupRun  # an extraction over several hosts


def test_a_group_run_planned_by_an_earlier_specops_is_still_found_by_its_fleet_json(tmp_path, monkeypatch):
    from specops.runs import store

    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "fleet.json").write_text("{}")
    assert store.is_group_run("old") and type(open_run(Inventory(), "a", "old")) is GroupRun
    assert store.manifest_path("old").name == "fleet.json"  # kept where it is: one map per run
    assert store.manifest_path("new").name == "group.json"


def test_both_kinds_answer_every_verb_and_the_tasks_do_not_ask_which_kind():
    from specops import tasks
    from specops.runs import run

    verbs = ("extract", "status", "logs", "abort", "fetch", "verify")
    for kind in (HostRun, GroupRun):
        assert issubclass(kind, Run) and all(callable(getattr(kind, v)) for v in verbs)
    for task in (tasks.status, tasks.logs, tasks.abort, tasks.fetch, run.extract, run.verify):
        source = inspect.getsource(getattr(task, "body", task))
        assert "is_group_run" not in source and "len(specs) > 1 or is_group_run" not in source
