"""The installed ``specops`` program and ``fab`` expose the same tasks and exit codes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from specops.exit_codes import ExitCode
REPO_ROOT = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent


def run(*args, cwd=REPO_ROOT):
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd,
                          stdin=subprocess.DEVNULL, timeout=120)


def task_lines(text):
    return [line for line in text.splitlines() if re.match(r"^  \S", line)]


def test_specops_and_fab_list_the_same_tasks_with_help():
    ours, fabs = run("specops", "--list"), run("fab", "--list")
    assert ours.returncode == fabs.returncode == 0, ours.stderr + fabs.stderr
    assert task_lines(ours.stdout) == task_lines(fabs.stdout)
    names = {line.split()[0] for line in task_lines(ours.stdout)}
    assert {"facts", "demo", "testhost.up", "testhost.down"} <= names
    assert all(len(line.split()) > 1 for line in task_lines(ours.stdout)), "every task has help text"


def test_facts_json_and_exit_code(make_inventory):
    proc = run("specops", "facts", "--inventory", str(make_inventory()), "--json")
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 0 and doc["hosts"][0]["host"] == "th"
    assert {r["status"] for r in doc["hosts"][0]["records"]} <= {"ok", "warn"}


def test_fab_runs_the_same_task_per_host(make_inventory):
    proc = run("fab", "-H", "th", "facts", "--inventory", str(make_inventory()), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["hosts"][0]["host"] == "th"


def test_bad_inventory_is_a_usage_error(tmp_path):
    bad = tmp_path / "inv.yaml"
    bad.write_text("hosts:\n  a:\n    address: x\n    tp: nine\n")
    proc = run("specops", "facts", "--inventory", str(bad))
    assert proc.returncode == ExitCode.USAGE
    assert "field 'tp'" in proc.stderr and "missing required field 'python'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_usage_error_holding_markup_is_printed_as_written_with_its_exit_code(tmp_path):
    """User text is never rich markup: ``[/x]`` used to crash every task with MarkupError (exit 1), and
    ``[bold]`` vanished from the message."""
    for args, said in ((["status", "--inventory", str(tmp_path / "[/x]inv.yaml")], "[/x]inv.yaml does not exist"),
                       (["preflight", "--inventory", str(tmp_path / "[bold]a[/bold].yaml")], "[bold]a[/bold].yaml")):
        proc = subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                              stdin=subprocess.DEVNULL, timeout=120, env={**os.environ, "COLUMNS": "400"})
        assert proc.returncode == ExitCode.USAGE, proc.stderr
        assert said in " ".join(proc.stderr.split()) and "MarkupError" not in proc.stderr, proc.stderr


def test_unknown_host_selector_is_a_usage_error(make_inventory):
    proc = run("specops", "facts", "--inventory", str(make_inventory()), "--on", "nope")
    assert proc.returncode == ExitCode.USAGE and "no host or group named 'nope'" in proc.stderr


def test_unreachable_host_exit_code(make_inventory):
    from specops.testhost.sshd import free_port

    proc = run("specops", "facts", "--inventory", str(make_inventory(port=free_port(), connect_timeout=3)))
    assert proc.returncode == ExitCode.UNREACHABLE
    assert "unreachable=1" in proc.stdout


def test_layer_ids_may_name_their_convention():
    """``output:``/``input:`` name the convention; plain ids are the engine's; typos exit 3 naming the flag."""
    import pytest

    from specops.errors import UsageError
    from specops.params import parse_layer_convention, parse_layer_ids

    assert parse_layer_ids("output:2,4,5,7") == [2, 4, 5, 7] and parse_layer_convention("output:2,4,5,7") == "output"
    assert parse_layer_ids("input:3,5") == [3, 5] and parse_layer_convention("INPUT:3,5") == "input"
    assert parse_layer_ids("2,4") == [2, 4] and parse_layer_convention("2,4") is None
    for bad, said in (("foo:1,2", "unknown convention 'foo'"), ("output:a,b", "'output:a,b' is not a comma")):
        with pytest.raises(UsageError) as caught:
            parse_layer_ids(bad)
        assert said in str(caught.value) and "--layer-ids" in str(caught.value)
