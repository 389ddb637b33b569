"""Extra trainer flags (``specops train --trainer-arg``), checked against the installed trainer.

Light (no trainer run, no vLLM): the flags read from speculators 0.9.0's files by AST are the
ones its own argparse parser builds (kind, choices), and over SSH against the modern test host
the training preflight refuses a flag specops sets (naming the specops option to use), one the
trainer does not take (naming the nearest), a value of the wrong type or out of its choices, and
takes good ones, recording them. The heavy test (``tests/test_train_eval.py``) runs a trainer
with one and refuses a resume that gives other flags.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.train import plan as trainplan  # noqa: E402
from trainplans import train_plan  # noqa: E402

#: the argparse parser speculators' trainer builds, each flag's kind and choices, as JSON
PARSER_FLAGS = r"""
import argparse, json
from speculators.train.config.resolution import build_parser
out = {}
for a in build_parser()._actions:
    names = [o for o in a.option_strings if o.startswith("--") and not o.startswith("--no-")]
    if not names or a.dest == "help":
        continue
    kind = ("switch" if isinstance(a, argparse._StoreTrueAction) else "bool_optional"
            if isinstance(a, argparse.BooleanOptionalAction) else "list" if a.nargs == "+" else "value")
    out[names[0][2:].replace("-", "_")] = {"kind": kind, "choices": list(a.choices) if a.choices else None}
print(json.dumps(out))
"""


def _site(python: Path) -> str:
    return str(next((python.parent.parent / "lib").glob("python3*/site-packages")))


def test_the_flags_read_from_the_trainers_files_are_the_ones_its_parser_takes(modern_hostenv_python):
    parser = json.loads(subprocess.run([str(modern_hostenv_python), "-c", PARSER_FLAGS], capture_output=True,
                                       text=True, check=True, timeout=600,
                                       env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout.splitlines()[-1])
    read = trainplan.trainer_api([_site(modern_hostenv_python)])["flags"]
    # --no-resume-from-checkpoint is a store_true field whose own name starts with no-
    assert set(read) - {"no_resume_from_checkpoint"} == set(parser), (set(read) ^ set(parser))
    for name, spec in parser.items():
        assert read[name]["kind"] == spec["kind"], (name, read[name], spec)
        # the backend's choices are a live registry, read as hs-connectors' registered backends instead
        if spec["choices"] and name != "hidden_states_backend":
            assert read[name]["choices"] == spec["choices"], (name, read[name], spec)
    assert {"mooncake_master", "hidden_states_path"} <= set(read)  # hs-connectors' backends add them


def _api(modern_hostenv_python) -> dict:
    return trainplan.trainer_api([_site(modern_hostenv_python)])


@pytest.mark.parametrize("args, says, fix", [
    (["--data-path", "/x"], "--data-path is set by specops", "--from-run"),
    (["--target-layer-ids", "1", "2"], "--target-layer-ids is set by specops", "extract --layer-ids"),
    (["--hidden-states-backend", "fp8"], "--hidden-states-backend is set by specops", "extract --format"),
    (["--save-path", "/tmp/x"], "--save-path is set by specops", "--run-id"),
    (["--epochs", "3"], "--epochs is set by specops", "specops train --epochs"),
    (["--config", "run.yaml"], "--config is set by specops", "--trainer-arg"),
    (["--no-resume-from-checkpoint"], "--no-resume-from-checkpoint is set by specops", "new --run-id"),
    (["--lrr", "1e-4"], "takes no --lrr", "did you mean --lr?"),
    (["--lr", "fast"], "--lr takes a number, got 'fast'", "--trainer-arg=--lr=1e-4"),
    (["--num-layers", "2.5"], "--num-layers takes an integer", "--num-layers=2"),
    (["--optimizer", "sgd"], "--optimizer takes one of adamw, muon, got 'sgd'", "--optimizer=adamw"),
    (["--save-best", "yes"], "--save-best is a switch and takes no value", "--save-best"),
    (["--lr"], "--lr needs a value", "--lr=1e-4"),
    (["--lr", "1", "--lr", "2"], "--lr is given twice", "once"),
    (["--no-lr"], "takes no --no-lr", ""),
    # issue 38: values that pass the trainer's parser and then train nothing (or nan), and a bare "--"
    (["--lr", "nan"], "--lr takes a finite number, got 'nan'", "--lr=1e-4"),
    (["--lr", "inf"], "--lr takes a finite number, got 'inf'", "--lr=1e-4"),
    (["--num-layers", "0"], "--num-layers must be at least 1, got '0'", "--num-layers=2"),
    (["--lr", "1e-4", "--"], "'--' is no flag", "one flag"),
    (["--on-missing", "generate"], "--on-missing is set by specops", "--on-missing raise"),
    (["--vllm-endpoint", "http://127.0.0.1:8000/v1"], "--vllm-endpoint is set by specops", "specops extract"),
])
def test_a_flag_specops_sets_or_the_trainer_does_not_take_is_refused_naming_what_to_do(
        modern_hostenv_python, args, says, fix):
    with pytest.raises(trainplan.TrainError) as caught:
        trainplan.check_extra_args(args, _api(modern_hostenv_python))
    rec = caught.value.payload()["records"][0]
    assert rec["name"] == "train.trainer_args" and rec["status"] == "fail", rec
    assert says in rec["summary"] and fix in rec["fix"], rec


def test_good_flags_pass_and_replace_only_specops_own_defaults(modern_hostenv_python):
    args = ["--lr", "1e-4", "--num-layers", "2", "--full-attention-indices", "0", "1", "--no-norm-before-fc",
            "--save-best", "--optimizer", "muon", "--mooncake-master", "127.0.0.1:1"]
    rec = trainplan.check_extra_args(args, _api(modern_hostenv_python))
    assert rec["status"] == "ok" and rec["detail"]["flags"] == [
        "--lr", "--num-layers", "--full-attention-indices", "--no-norm-before-fc", "--save-best", "--optimizer",
        "--mooncake-master"], rec
    plan = train_plan(extra_args=args)
    argv = plan.argv("/env/python", trainplan.CPU_LAUNCHER_MODULE)
    # the user's --optimizer replaces specops' CPU default (adamw) instead of following it, the rest stay
    assert argv.count("--optimizer") == 1 and argv[-len(args):] == args
    assert "--draft-attn-impl sdpa" in " ".join(argv)
    assert plan.overrides() == {"optimizer": "adamw"} and plan.as_dict()["overrides"] == {"optimizer": "adamw"}
    assert trainplan.check_extra_args([], _api(modern_hostenv_python))["status"] == "skipped"


def _specops(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "specops"), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=600,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def _records(proc) -> dict:
    return {r["name"]: r for h in json.loads(proc.stdout)["hosts"] for r in h["records"]}


def test_over_ssh_the_training_preflight_refuses_a_flag_specops_sets_and_takes_one_the_trainer_takes(
        modern_make_inventory):
    inv = modern_make_inventory()
    refused = _specops("train", "--inventory", inv, "--run-id", "t1", "--from-run", "r1",
                       "--trainer-arg=--lr=1e-4", "--trainer-arg", "--data-path=/elsewhere", "--json")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    rec = _records(refused)["train.trainer_args"]
    assert rec["status"] == "fail" and rec["summary"].startswith("--data-path is set by specops"), rec
    assert "--from-run" in rec["fix"] and rec["detail"]["args"] == ["--lr", "1e-4", "--data-path", "/elsewhere"]
    assert "speculators/train/config/schema.py" not in rec["summary"]  # a refusal, not an unknown flag
    # nothing was started: no run dir
    assert not (Path(inv).parent / "work" / "runs" / "t1").exists()

    # good flags, both spellings: checked against the host's trainer, then the states run is looked for
    taken = _specops("train", "--inventory", inv, "--run-id", "t1", "--from-run", "r1", "--trainer-arg",
                     "--lr 1e-4", "--trainer-arg=--num-layers=2", "--draft-vocab-size", "64", "--json")
    assert taken.returncode == 1, taken.stdout + taken.stderr
    recs = _records(taken)
    assert recs["train.trainer_args"]["status"] == "ok", recs
    # --draft-vocab-size goes to the trainer (which reads the states run's token_freq.pt), checked like the others
    assert recs["train.trainer_args"]["detail"] == {"args": ["--lr", "1e-4", "--num-layers", "2",
                                                             "--draft-vocab-size", "64"],
                                                    "flags": ["--lr", "--num-layers", "--draft-vocab-size"]}
    assert "site-packages/speculators/train/config/schema.py" in recs["train.trainer_args"]["summary"]
    assert recs["train.states"]["status"] == "fail" and "r1" in recs["train.states"]["summary"], recs


@pytest.mark.parametrize("value", ["lr=1e-4", "", "-x", "--lr '1e-4", "--lr 1e-4 --", "--"])
def test_a_trainer_arg_that_is_no_flag_is_a_usage_error(value, tmp_path):
    (tmp_path / "inv.yaml").write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, "
                                       "output_dir: /o}\n")
    proc = _specops("train", "--inventory", tmp_path / "inv.yaml", "--run-id", "t1", "--from-run", "r1",
                    f"--trainer-arg={value}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "--trainer-arg" in proc.stderr, proc.stderr


def test_the_packed_tokens_per_step_default_by_device_and_are_refused_below_the_states_seq_len(tmp_path):
    """``--total-seq-len``: speculators packs that many tokens of several samples into a step. A GPU gets
    the trainer's own default (a step of one 256-token sample kept the H200 at 600 tok/s, round 8); a CPU
    host one sample's worth; below the states' seq_len every longer sample would be cut, so refused."""
    from remote.train import plan as trainplan

    assert trainplan.total_seq_len({"device": "cpu"}, 128) == 128
    assert trainplan.total_seq_len({"device": "cuda"}, 256) == trainplan.TRAINER_TOTAL_SEQ_LEN == 8192
    assert trainplan.total_seq_len({"device": "cuda"}, 16384) == 16384
    assert trainplan.total_seq_len({"device": "cpu", "total_seq_len": 4096}, 128) == 4096
    with pytest.raises(trainplan.TrainError) as refused:
        trainplan.total_seq_len({"device": "cuda", "total_seq_len": 64, "from_run": "r1"}, 256)
    record = refused.value.payload()["records"][0]
    assert record["name"] == "train.total_seq_len" and record["status"] == "fail", record
    assert "below run r1's seq_len 256" in record["summary"] and "--total-seq-len 256 or more" in record["fix"]
    # the trainer's own flag stays specops': --trainer-arg names the option instead
    assert "specops train --total-seq-len" in trainplan.SPECOPS_SETS["total_seq_len"]

    (tmp_path / "inv.yaml").write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, "
                                       "output_dir: /o}\n")
    proc = _specops("train", "--inventory", tmp_path / "inv.yaml", "--run-id", "t1", "--from-run", "r1",
                    "--total-seq-len", "0")
    assert proc.returncode == 3 and "--total-seq-len" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--regenerate", "--regen-temperature", "nan"], "--regen-temperature 'nan' must be a number (a finite number"),
    (["--regenerate", "--regen-temperature", "inf"], "--regen-temperature 'inf' must be a number (a finite number"),
])
def test_a_number_that_is_not_finite_is_a_usage_error_naming_its_flag(args, says, tmp_path):
    (tmp_path / "inv.yaml").write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, "
                                       "output_dir: /o}\n")
    proc = _specops("train", "--inventory", tmp_path / "inv.yaml", "--run-id", "t1", "--from-run", "r1", *args)
    assert proc.returncode == 3 and says in proc.stderr, proc.stdout + proc.stderr


def test_the_host_task_refuses_a_number_that_is_not_finite_naming_the_field():
    """The host's own check (remote/wire/argspec.py) too: nan passes every bound (nan < 0 is False)."""
    from remote.train import task as train

    for value in ("nan", float("nan"), float("inf"), "-inf"):
        with pytest.raises(Exception) as caught:
            train.SPEC.validate({"action": "check", "run_id": "t1", "work_dir": "/w", "from_run": "r1",
                              "regen_temperature": value})
        assert "regen_temperature" in str(caught.value) and "finite" in str(caught.value), caught.value


def test_the_trainer_is_never_let_ask_a_server_for_missing_rows():
    """speculators' default --on-missing is "generate" (from http://localhost:8000/v1): specops passes raise."""
    argv = " ".join(train_plan().argv("/env/python"))
    assert "--on-missing raise" in argv, argv
    assert "on_missing" not in trainplan.OVERRIDABLE and "on_missing" in trainplan.USED_FLAGS
