"""remote/wire/status.py is the one schema of a run's ``status.json`` and its ``error``, with the moves between
run states; remote/run/lifecycle.py's StatusFile is the one writer of that file.

The cases check the schema against every status a real run left (tests/fixtures), that a wrong field or a
wrong move is refused naming it and changes nothing on disk, that the laptop's model is the wire's view, that
the job verbs write through the one writer, and -- structurally, over the source -- that no other module
writes status.json and no other module spells the run's error by hand. Fast: files on disk only, no SSH.
"""
from __future__ import annotations

import ast
import json
import os
import time
import typing
from pathlib import Path

import pytest

from remote.run import job, lifecycle
from remote.run.lifecycle import StatusFile
from remote.wire import contract
from remote.wire import status as schema
from specops import wire
from specops.result import RunError, RunStatus

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def _statuses(doc):
    """Every status.json document inside ``doc`` (a status file, or a payload or report that holds statuses)."""
    if isinstance(doc, dict):
        if "state" in doc and ("heartbeat_unix" in doc or "phase" in doc):
            yield doc
        for value in doc.values():
            yield from _statuses(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _statuses(value)


def test_every_status_a_real_run_left_reads():
    """The fixtures hold what GPU hosts' runs wrote (extractions done, failed, aborted; train runs; canary
    runs) with the code before the one writer: each reads, and every field they hold is declared."""
    found, undeclared = 0, set()
    for path in sorted(FIXTURES.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        for status in _statuses(doc):
            schema.check(status, where=path)
            undeclared |= set(status) - set(schema.FIELDS) - {"run_dir"}
            for name in ("error", "previous_error"):
                undeclared |= {f"{name}.{k}" for k in (status.get(name) or {})} - {
                    f"{name}.{k}" for k in schema.ERROR_FIELDS}
            found += 1
    assert found >= 20
    assert not undeclared, f"fields real runs write that the schema does not declare: {sorted(undeclared)}"


@pytest.mark.parametrize("doc, field", [
    ({"state": "extracting", "samples_done": "3"}, "samples_done"),
    ({"state": "running"}, "state"),
    ({"phase": "x"}, "state"),
    ({"state": "failed", "error": {"type": "ValueError"}}, "error.message"),
    ({"state": "failed", "error": {"type": "X", "message": "m", "rank": "1"}}, "error.rank"),
    ({"state": "pending", "previous_error": "boom"}, "previous_error"),
    ({"state": "done", "layer_ids": [1, "2"]}, "layer_ids"),
])
def test_a_wrong_field_is_named(doc, field):
    with pytest.raises(schema.StatusError) as caught:
        schema.check(doc)
    assert caught.value.field == field and repr(field) in str(caught.value)


def test_the_laptop_reads_through_the_same_schema():
    """specops.wire.status is remote/wire/status.py; RunStatus/RunError's fields are the wire's, of matching
    kinds; a status the wire refuses is refused on the laptop, naming the field."""
    assert Path(wire.status.__file__).resolve() == Path(schema.__file__).resolve()
    kinds = {int: {"int", "rank"}, float: {"number"}, str: {"text", "state"}, bool: {"flag"},
             dict: {"object", "seconds", "error"}}
    laptop_only = {"run_dir"}  # from the payload, not the status file

    def base(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is typing.Literal:
            return str
        annotation = args[0] if args and typing.get_origin(annotation) is not dict else annotation
        return typing.get_origin(annotation) or annotation

    for model, fields in ((RunStatus, schema.FIELDS), (RunError, schema.ERROR_FIELDS)):
        for name, info in model.model_fields.items():
            if name in laptop_only:
                continue
            assert name in fields, f"{model.__name__}.{name} is not in the wire's schema"
            wanted = base(info.annotation)
            wanted = dict if wanted is RunError else wanted
            assert fields[name].kind in kinds[wanted], (model.__name__, name, fields[name].kind, wanted)
    with pytest.raises(ValueError, match="'error.message' is missing"):
        RunStatus.from_payload({"data": {"status": {"run_id": "r", "state": "failed", "error": {"type": "X"}}}})
    assert RunStatus.from_payload({"data": {}}).state == "missing"


EXTRACT = ["pending", "loading", "extracting", "writing", "done"]
ALL_ON_DISK = ["pending", "writing", "done"]
TRAIN = ["pending", "loading", "loading", "training", "training", "done"]
REPLICA_WORKER = ["pending", "loading", "extracting", "aborted"]


@pytest.mark.parametrize("states", [EXTRACT, ALL_ON_DISK, TRAIN, REPLICA_WORKER, ["pending", "failed"],
                                    ["loading", "aborted"]])
def test_every_life_a_run_lives_is_allowed(states):
    for old, new in zip(states, states[1:]):
        schema.check_move(old, new)


@pytest.mark.parametrize("old, new, named", [
    ("done", "extracting", ()), ("failed", "pending", ()), ("aborted", "loading", ()), ("extracting", "loading", ()),
    ("training", "pending", ()), ("done", "failed", ()), ("done", "aborted", ("abort_by_request",)),
    ("failed", "done", ("restart",)), ("aborted", "failed", ()), ("done", "failed", ("ended_by_slurm",)),
])
def test_a_wrong_move_is_refused_naming_from_and_to(old, new, named):
    with pytest.raises(schema.TransitionError) as caught:
        schema.check_move(old, new, named=named)
    assert (caught.value.old, caught.value.new) == (old, new)
    assert f"from {old!r} to {new!r}" in str(caught.value)


def test_a_final_state_is_left_only_by_a_named_move():
    assert schema.check_move("failed", "pending", named=("restart",)) == "restart"
    assert schema.check_move(None, "pending") == "begin"  # a status where there was none
    assert schema.check_move("failed", "aborted", named=("abort_by_request",)) == "abort_by_request"
    assert schema.check_move("aborted", "failed", named=("ended_by_slurm",)) == "ended_by_slurm"
    assert schema.check_move("done", "done") == "stay"


def test_the_error_has_one_builder():
    err = schema.error_from(ValueError("bad layer"), rank=1, where="engine")
    assert (err["type"], err["message"], err["rank"], err["where"]) == ("ValueError", "bad layer", 1, "engine")
    assert "ValueError: bad layer" in err["traceback"]
    assert schema.error("Aborted", "by request") == {"rank": None, "type": "Aborted", "message": "by request",
                                                       "traceback": "", "where": "supervisor"}
    with pytest.raises(schema.StatusError, match="'error.pid'"):
        schema.error("X", "m", pid="12")


# --------------------------------------------------------------------------- the writer


def test_the_writer_begins_moves_and_refuses_without_changing_the_file(tmp_path):
    path = tmp_path / "r1" / contract.STATUS_FILE
    path.parent.mkdir()
    path.write_text(json.dumps({"run_id": "r1", "state": "failed", "attempt": 2,
                                "error": {"type": "X", "message": "the last one"}}))
    status = StatusFile.begin(path, "r1", kind="train", step=lambda previous: previous.get("step"))
    status.update(phase="tokenizing")
    on_disk = json.loads(path.read_text())
    assert (on_disk["state"], on_disk["attempt"], on_disk["previous_error"]["message"]) == ("pending", 3, "the last one")
    assert on_disk["pid"] == os.getpid() and on_disk["kind"] == "train"
    status.update(state="loading", layer_ids=(2, 4))  # a tuple is written, and checked, as the list it becomes
    before = path.read_text()
    with pytest.raises(schema.StatusError, match="'samples_done'"):
        status.update(samples_done=-1)
    with pytest.raises(schema.TransitionError, match="from 'loading' to 'pending'"):
        status.update(state="pending")
    assert path.read_text() == before and status.data["state"] == "loading"
    assert status.finish() and status.end(schema.error("Aborted", "late SIGTERM"), aborted=True) == 0
    assert json.loads(path.read_text())["state"] == "done"  # done before the signal: done stays done
    with pytest.raises(ValueError):
        status.heartbeat(state="failed")


def test_what_the_run_holds_is_stopped_before_its_final_state_is_written(tmp_path):
    """The supervisor's ``before_final`` (an online run's server stop) runs once, on the write that ends the run,
    before anyone can read the run ended; what it returns lands in that same write."""
    path = tmp_path / "r3" / contract.STATUS_FILE
    status = StatusFile.begin(path, "r3", kind="train")
    seen = []

    def stop(state):
        seen.append((state, json.loads(path.read_text())["state"]))  # the file still says the run lives
        return {"online_server": {"stopped": True}}

    status.before_final = stop
    status.update(state="loading")
    status.update(state="training", step=1)
    assert seen == []
    status.fail(schema.error("TrainerExited", "the trainer exited with code 1"))
    on_disk = json.loads(path.read_text())
    assert seen == [("failed", "training")] and on_disk["state"] == "failed", seen
    assert on_disk["online_server"] == {"stopped": True}, on_disk
    status.end(schema.error("X", "a later failure"))  # once: a later final write does not stop it again
    assert seen == [("failed", "training")]


def test_an_odd_old_error_never_stops_a_restart(tmp_path):
    path = tmp_path / "r2" / contract.STATUS_FILE
    path.parent.mkdir()
    path.write_text(json.dumps({"run_id": "r2", "state": "failed", "error": {"message": "no type"}}))
    StatusFile.begin(path, "r2").update(phase="tokenizing")
    kept = json.loads(path.read_text())["previous_error"]
    assert kept["type"] == "UnreadableError" and "no type" in kept["message"] and "'previous_error.type'" in kept["message"]


def test_job_start_status_and_abort_write_through_the_one_writer(tmp_path):
    """job start's restart, job status's dead-supervisor correction: the same writer, the same schema."""
    run_dir = tmp_path / "runs" / "gone"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / contract.STATUS_FILE).write_text(json.dumps({"run_id": "gone", "state": "extracting",
                                                            "phase": "extracting", "heartbeat_unix": 5.0}))
    st = job.current_status(run_dir)
    on_disk = json.loads((run_dir / contract.STATUS_FILE).read_text())
    assert st["state"] == on_disk["state"] == "failed" and st["alive"] is False and "alive" not in on_disk
    assert on_disk["error"]["type"] == "SupervisorDied" and on_disk["heartbeat_unix"] == 5.0  # not its heartbeat
    schema.check(on_disk, require=schema.FOR_WRITE)
    job._prepare_run_dir(run_dir, {"run_id": "gone"}, write_params=False)
    again = json.loads((run_dir / contract.STATUS_FILE).read_text())
    assert (again["state"], again["error"], again["previous_error"]["type"]) == ("pending", None, "SupervisorDied")
    assert time.time() - again["heartbeat_unix"] < 60  # the start's grace counts from now


# --------------------------------------------------------------------------- structure


def _product_files():
    for root in ("remote", "specops"):
        for path in sorted((REPO / root).rglob("*.py")):
            if "_assets" not in path.parts:
                yield path


WRITES = {"write_json_atomic", "write_json", "atomic_write", "write_text", "write_bytes", "dump", "write"}
STATUS_NAMES = ("STATUS_FILE", "status.json", "paths.status", ".status,", ".status)")


def test_no_module_but_the_lifecycle_writes_status_json():
    """Every call that writes a file (write_json_atomic, fsutil.write_json/atomic_write, write_text, json.dump,
    open(..., 'w')) and names the status file (STATUS_FILE, "status.json", paths.status) is in lifecycle.py."""
    offenders = []
    for path in _product_files():
        if path == Path(lifecycle.__file__).resolve():
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            opens = name == "open" and any(isinstance(a, ast.Constant) and str(a.value)[:1] in "wax"
                                           for a in node.args[1:2])
            if name not in WRITES and not opens:
                continue
            text = ast.get_source_segment(source, node) or ""
            if any(marker in text for marker in STATUS_NAMES):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {text.splitlines()[0]}")
    assert not offenders, "status.json written outside remote/run/lifecycle.py:\n" + "\n".join(offenders)


def test_no_module_spells_the_run_error_by_hand():
    """A dict literal of the run error's shape (rank, type, message, traceback) is built only by
    remote/wire/status.py's error(); everyone else calls it (or error_from)."""
    offenders = []
    for path in _product_files():
        if path.resolve() == Path(schema.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if {"rank", "type", "message", "traceback"} <= keys:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"the run's error spelled by hand (use remote.wire.status.error): {offenders}"


def test_a_supervisor_started_by_an_older_bundle_is_still_found_alive(tmp_path):
    """Bundles before the wings ran ``python -m remote.supervisor RUN_DIR``; after an upgrade, status, follow and
    abort must still see that process as the run's live supervisor, and a stranger naming the dir as no supervisor."""
    import subprocess
    import sys

    from remote.run import rundir

    old = tmp_path / "old-bundle" / "remote"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    for name in ("supervisor", "stranger"):
        (old / f"{name}.py").write_text("import time\ntime.sleep(60)\n")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in (rundir.RUN_DIR_ENV, "PYTHONPATH")}
    procs = {name: subprocess.Popen([sys.executable, "-m", f"remote.{name}", str(run_dir)], cwd=old.parent, env=env)
             for name in ("supervisor", "stranger")}
    try:
        deadline = time.monotonic() + 30
        while not all(Path(f"/proc/{p.pid}/cmdline").read_bytes().count(b"remote.") for p in procs.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "remote.supervisor" in rundir.EARLIER_SUPERVISOR_MODULES
        assert rundir.pid_alive(procs["supervisor"].pid, run_dir)
        assert not rundir.pid_alive(procs["stranger"].pid, run_dir)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
