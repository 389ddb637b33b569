"""remote/wire/contract.py is the one definition of what both sides of the wire agree on.

Run states and their exit codes, record statuses and their order, the engine table,
the run-id rule, sample file names and run defaults: the laptop (loading the file by
path) and the host (importing it) must answer from that one file. These tests compare
every reader with it -- the CLI's help, the inventory's defaults, what a job does when
a parameter is unset -- so a second copy that drifts fails here.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.extract import samples  # noqa: E402
from remote.wire import contract, layers, protocol
from remote.extract import dataset
from remote.run import job, rundir
from specops import wire  # noqa: E402
from specops.exit_codes import ExitCode  # noqa: E402
from specops.inventory import HostSpec  # noqa: E402
from specops.params import LAYER_CONVENTIONS, run_params  # noqa: E402
from specops.wire.argspec import RUN_ARGS  # noqa: E402
from specops.result import HostReport, Record, RunStatus  # noqa: E402

LAPTOP = wire.contract
ALL_STATES = [s.value for s in contract.RunState]

LOAD_ON_LAPTOP = """
import json, sys
before = set(sys.modules)
from specops import wire
contract = wire.contract
print(json.dumps({"file": contract.__file__, "same": contract is wire.protocol.contract,
                  "new_remote": sorted(m for m in set(sys.modules) - before
                                       if m.split(".")[0] == "remote")}))
"""


def test_the_laptop_imports_the_hosts_file_once_and_no_remote_package(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LOAD_ON_LAPTOP], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["file"]).resolve() == (REPO / "remote" / "wire" / "contract.py").resolve()
    assert out["same"] and out["new_remote"] == [], out
    assert protocol.contract is contract  # the host imports it: one module, not a second load


def test_run_states_and_exit_codes_have_one_home():
    assert rundir.STATES == contract.STATES == tuple(s for s in ALL_STATES if s != "missing")
    assert rundir.FINAL_STATES == contract.FINAL_STATES == ("done", "failed", "aborted")
    assert [s.value for s in LAPTOP.RunState] == ALL_STATES
    expected = {"done": ExitCode.SUCCESS, "failed": ExitCode.JOB_FAILED, "aborted": ExitCode.JOB_ABORTED,
                "missing": ExitCode.JOB_NOT_FOUND}
    for state in ALL_STATES + ["no-such-state"]:
        code = ExitCode.from_job_state(state)
        assert code == expected.get(state, ExitCode.JOB_RUNNING), state
        assert code == contract.job_exit_code(state)
        if state in ALL_STATES:
            laptop = RunStatus(state=state)
            assert (laptop.is_final, laptop.exit_code) == (contract.RunState(state).is_final, code)
    with pytest.raises(ValueError):
        RunStatus(state="finished")  # a state the host never writes is refused, not guessed


def test_record_statuses_and_their_order():
    assert protocol.STATUSES == contract.STATUSES == LAPTOP.STATUSES
    assert list(HostReport(host="h", task="t").counts) == list(contract.STATUSES)
    for status in contract.STATUSES:
        assert Record(name="a.b", status=status).status == status
    with pytest.raises(ValueError):
        Record(name="a.b", status="error")
    by_severity = sorted(contract.STATUSES, key=contract.SEVERITY.__getitem__)
    assert by_severity == ["skipped", "ok", "changed", "warn", "fail"]
    for i, status in enumerate(by_severity):
        records = [protocol.record(f"x.{s}", s, "s", fix="f") for s in by_severity[:i + 1]]
        assert protocol.worst(records) == status
    failing = HostReport(host="h", task="t", records=[Record(name="a.b", status=contract.FAIL, fix="f")])
    assert failing.failed and failing.exit_code == ExitCode.FAILED


def test_engine_table_is_read_by_every_side():
    from remote.extract import engines

    assert set(engines.ENGINES) == set(contract.ENGINES)  # the registry loads exactly these
    assert not hasattr(engines, "ALIASES") and not hasattr(engines, "resolve_engine")  # one engine choice
    # the laptop (flags, inventory) and the host check the engine against the one table: a name or an alias
    assert RUN_ARGS["engine"].choices == (*contract.ENGINE_CHOICES, *contract.ENGINE_ALIASES)
    assert LAYER_CONVENTIONS == contract.LAYER_CONVENTIONS == tuple(layers.CONVENTIONS)
    for name, facts in contract.ENGINES.items():
        assert layers.ENGINE_CONVENTION[name] == facts.convention
        assert samples.ENGINE_FORMAT[name] == facts.sample_format
        ids, convention = layers.default_layer_ids(name, 8)
        assert convention == facts.convention and len(ids) == 4


def test_cli_help_names_every_engine_and_the_inventory_defaults():
    """What ``specops extract --help`` says about engines and defaults is what the host does."""
    proc = subprocess.run([str(Path(sys.executable).parent / "specops"), "extract", "--help"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    help_text = re.sub(r"-\s+", "-", " ".join(proc.stdout.split()))  # a name wrapped at its hyphen
    for name in contract.ENGINE_CHOICES:
        assert name in help_text, name
    assert f"{contract.AUTO_ENGINE} (default" in help_text


def test_defaults_agree_inventory_params_and_job():
    spec = HostSpec(name="h", address="127.0.0.1", python="/usr/bin/python3", model_path="/m", output_dir="/o")
    params = run_params(spec)
    for key, value in contract.DEFAULTS.items():
        assert getattr(spec, key) == value, key
        if key == "algorithm":  # unset, it is not sent (no algorithm checks); the host reads the same default
            assert key not in params and contract.param(params, key) == value
            continue
        assert params[key] == value, key
    from remote.probes import preflight

    for key in ("tp", "engine", "seq_len", "max_samples", "gpu_memory_utilization"):
        assert preflight.DEFAULTS[key] == contract.DEFAULTS[key], key


def test_a_job_without_seq_len_truncates_at_the_default(tmp_path):
    """The host's own default, not a copy: a pre-tokenized row longer than it is cut there."""
    rows = tmp_path / "rows.jsonl"
    length = contract.DEFAULTS["seq_len"] + 5
    rows.write_text(json.dumps({"input_ids": list(range(length)), "loss_mask": [1] * length}) + "\n")
    ((ids, mask),) = dataset.load_token_samples({"dataset": str(rows)}, str(tmp_path))
    assert len(ids) == len(mask) == contract.DEFAULTS["seq_len"]
    assert contract.param({"seq_len": None}, "seq_len") == contract.param({}, "seq_len") == 2048
    assert contract.param({"tp": 4}, "tp") == 4


@pytest.mark.parametrize("run_id, ok", [("r1", True), ("a" * 128, True), ("a" * 129, False), ("../x", False),
                                        (".hidden", False), ("-x", False), ("a b", False), ("", False)])
def test_one_run_id_rule_and_one_message(tmp_path, run_id, ok):
    assert protocol.RUN_ID_RE is contract.RUN_ID_RE is rundir.RUN_ID_RE
    assert bool(contract.RUN_ID_RE.match(run_id)) == ok == (contract.run_id_problem(run_id) is None)
    assert LAPTOP.run_id_problem(run_id) == contract.run_id_problem(run_id)
    if ok:
        assert job.run_dir_of({"run_id": run_id, "work_dir": str(tmp_path)}).name == run_id
        return
    with pytest.raises(job.JobError) as refused:
        job.run_dir_of({"run_id": run_id, "work_dir": str(tmp_path)})
    assert refused.value.summary == contract.run_id_problem(run_id)
    assert refused.value.fix == contract.run_id_fix()
    user_limit = contract.USER_RUN_ID_MAX
    assert contract.USER_RUN_ID_RE.match("a" * user_limit) and not contract.USER_RUN_ID_RE.match("a" * (user_limit + 1))


@pytest.mark.parametrize("fmt, name, sub", [("pt", "data_7.pt", ""), ("hs", "hs_7.safetensors", "hidden_states")])
def test_sample_file_names(tmp_path, fmt, name, sub):
    assert contract.sample_name(7, fmt) == samples.sample_name(7, fmt) == name
    assert samples.sample_path(tmp_path, 7, fmt) == (tmp_path / sub / name if sub else tmp_path / name)
    assert samples.index_of(f"{sub}/{name}") == 7 and samples.FORMATS[fmt][0].match(name)
    assert not contract.sample_pattern(fmt).match(".partial-" + name) and samples.index_of("data_x.pt") is None
    assert (samples.MANIFEST, samples.SUMMARY) == (contract.MANIFEST, contract.SUMMARY)


def test_run_dir_files_are_the_ones_the_laptop_fetches(tmp_path):
    from specops.runs import hostjob

    paths = rundir.RunPaths(tmp_path)
    assert hostjob.RUN_FILES == contract.RUN_FILES
    assert {paths.params.name, paths.status.name} | {contract.MANIFEST, contract.SUMMARY} == set(hostjob.RUN_FILES)
