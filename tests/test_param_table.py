"""One declaration per run parameter: ``RUN_ARGS`` (remote/wire/argspec.py) is the table that the run tasks'
command-line flags (and their help), the inventory's run fields and the host tasks' arguments come from, and
no other module restates a run parameter's bound or choices. Pure laptop-side checks: no host, no subprocess."""
from __future__ import annotations

import ast
import sys
import typing
from pathlib import Path

import pytest
from invoke import Context, Exit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.extract import shard  # noqa: E402
from remote.extract import smoke as host_smoke  # noqa: E402
from remote.probes import preflight as host_preflight  # noqa: E402
from remote.run import job  # noqa: E402
from specops import tasks  # noqa: E402
from specops.errors import UsageError  # noqa: E402
from specops.exit_codes import ExitCode  # noqa: E402
from specops.inventory import REACH_FIELDS, RUN_FIELDS, HostSpec  # noqa: E402
from specops.params import FLAGS, check_flags  # noqa: E402
from specops.wire import argspec, contract  # noqa: E402
from specops.wire.argspec import RUN_ARGS, TRAIN_ARGS  # noqa: E402

#: the tasks that start or rehearse a run, and so take run flags
RUN_TASKS = ("preflight", "extract", "smoke")
#: the inventory's fields that are the laptop's own (how to reach a host), not run parameters
LAPTOP_FIELDS = {"name", "address", "port", "user", "key", "known_hosts", "host_key_policy", "connect_timeout",
                 "keepalive", "delivery", "sudo", "node_address", "scheduler", "slurm"}


def shape(arg) -> tuple:
    """What a check of ``arg`` refuses (the laptop's ``specops.wire`` and the host's ``remote.wire`` are two imports
    of the same file, so their Args are compared by what they declare)."""
    return arg.types, arg.choices, arg.min, arg.max, arg.above, arg.elements


def test_every_run_flag_and_its_help_come_from_the_table():
    """Each run task's flags that set a run parameter are RUN_ARGS entries (their help is the entry's, word for
    word), and every other flag of theirs is no run parameter under another spelling."""
    flag_of = {arg.flag_of(name): name for name, arg in RUN_ARGS.items()}
    for task_name in RUN_TASKS:
        task = tasks.ns.tasks[task_name]
        for argument in task.get_arguments():
            flag = argument.names[0]
            if flag in tasks.COMMON_HELP:
                continue
            key = flag.replace("-", "_")
            if key in task.body.run_flags:
                name = FLAGS[key]
                assert argument.help == RUN_ARGS[name].help and RUN_ARGS[name].help, (task_name, flag)
            else:
                assert flag not in flag_of, f"{task_name} --{flag} sets {flag_of[flag]} but is not a run flag"
    assert set(tasks.ns.tasks["extract"].body.run_flags) == set(FLAGS)  # extract takes every flag of the table
    # help for a run flag written by hand is refused where the task is declared
    with pytest.raises(TypeError, match="seq-len"):
        tasks.host_task(help={"seq-len": "restated"})(lambda target, seq_len=None: None)


def test_the_laptop_checks_run_flags_against_the_table_before_anything_else():
    """A flag out of its bound is a usage error (exit 3) naming the flag, in the table's words, before the
    inventory is even read (here it does not exist) -- so before any host is reached."""
    with pytest.raises(Exit) as stopped:
        tasks.preflight(Context(), inventory="/nonexistent/inventory.yaml", canary_samples="40")
    assert stopped.value.code == ExitCode.USAGE
    for flags, words in (({"canary_samples": "40"}, "--canary-samples '40' must be from 0 to 32"),
                         ({"tp": "0"}, "--tp '0' must be at least 1"),
                         ({"engine": "vllm"}, "--engine 'vllm' must be one of auto, "),
                         ({"long_samples": "cut"}, "--long-samples 'cut' must be one of truncate, refuse, drop"),
                         ({"seq_len": "2k"}, "--seq-len '2k' must be an integer")):
        with pytest.raises(UsageError) as err:
            check_flags(flags)
        assert words in str(err.value) and err.value.code == ExitCode.USAGE, str(err.value)
    assert check_flags({"canary_samples": "32", "tp": "2", "engine": "hf"}) == {"canary_samples": 32, "tp": 2,
                                                                                "engine": "hf"}


def test_every_inventory_run_field_validates_through_the_table():
    """HostSpec's fields are either the laptop's own or run parameters; a run field declares its type and default
    only (no bound, no Literal of its own), and refuses a bad value in the table's words."""
    fields = set(HostSpec.model_fields)
    assert set(REACH_FIELDS) == LAPTOP_FIELDS
    assert fields - set(RUN_ARGS) <= LAPTOP_FIELDS, "a new inventory field: a run parameter (RUN_ARGS) or laptop-only?"
    assert set(RUN_FIELDS) == fields - LAPTOP_FIELDS  # "port" is ssh's: no run field, never sent as the server's
    assert "port" not in RUN_FIELDS
    for name in RUN_FIELDS:
        assert name in RUN_ARGS
        info = HostSpec.model_fields[name]
        assert not info.metadata, f"HostSpec.{name} restates a bound: {info.metadata}"
        literal = [a for a in typing.get_args(info.annotation) or (info.annotation,)
                   if typing.get_origin(a) is typing.Literal]
        assert not literal, f"HostSpec.{name} restates its choices"
    base = {"name": "h", "address": "127.0.0.1", "python": "/p", "model_path": "/m", "output_dir": "/o"}
    for name, bad in (("canary_samples", 33), ("tp", 0), ("long_samples", "cut"), ("writer_threads", 257),
                      ("gpu_memory_utilization", 1.5), ("engine", "vllm"), ("layer_convention", "middle")):
        with pytest.raises(argspec.BadValue) as expected:
            argspec.judge(RUN_ARGS[name], bad)
        with pytest.raises(ValueError) as got:
            HostSpec(**base, **{name: bad})
        assert str(expected.value) in str(got.value), (name, str(got.value))


@pytest.mark.parametrize("spec", [job.SPEC, host_preflight.SPEC, shard.SPEC, host_smoke.SPEC],
                         ids=lambda s: s.name)
def test_every_host_argument_of_the_run_tasks_comes_from_the_table(spec):
    """The host tasks of a run take every run parameter, each as the table declares it (a default may differ:
    smoke's seq_len is capped)."""
    assert set(RUN_ARGS) <= set(spec.args), set(RUN_ARGS) - set(spec.args)
    for name, arg in RUN_ARGS.items():
        assert shape(spec.args[name]) == shape(arg), name


def test_the_train_flags_the_host_declares_are_checked_on_the_laptop_by_the_same_entries():
    """``specops train``'s numbers (epochs, gpus, ...) are TRAIN_ARGS entries: the train task's spec on the host
    takes them as they are, and the laptop refuses a bad one in the same words before connecting."""
    from remote.train import task as train_task
    from specops.train import _train_flag

    for name, arg in TRAIN_ARGS.items():
        assert shape(train_task.SPEC.args[name]) == shape(arg), name
        flag = f"--{name.replace('_', '-')}"
        assert flag[2:] in {a.names[0] for a in tasks.ns.tasks["train"].get_arguments()}
        if arg.types == ("str",) and not arg.choices:  # a name (--server-on's host): the inventory judges it
            continue
        with pytest.raises(UsageError) as err:
            _train_flag(name, "-1")
        assert str(err.value).startswith(f"{flag} '-1' must be "), str(err.value)
    assert _train_flag("epochs", None) == 1 and _train_flag("regen_temperature", "0.5") == 0.5


#: modules that may name a constant a run parameter's choices or bound is made of: the table itself, the file
#: that defines the constants, and manifest.py, which checks a finished run's recorded document (the plan's
#: convention and state format), not a parameter
MAY_NAME_BOUNDS = {"remote/wire/argspec.py", "remote/wire/contract.py", "remote/wire/manifest.py"}


#: the keywords of an Arg that bound its value
BOUND_WORDS = {"choices", "min", "max", "above"}


def _bound_constants() -> set:
    """contract's names whose value is some RUN_ARGS entry's choices (or their head: the engine names before
    their aliases), or a bound named ``*_MAX``/``*_MIN``."""
    names = set()
    for const, value in vars(contract).items():
        if not const.isupper():
            continue
        for arg in RUN_ARGS.values():
            if (isinstance(value, tuple) and value and arg.choices and arg.choices[:len(value)] == value) or (
                    const.endswith(("_MAX", "_MIN")) and value in (arg.min, arg.max) and value is not None):
                names.add(const)
    return names


def test_no_other_module_restates_a_bound_or_choices_of_a_run_parameter():
    """Robust to wording: every module under specops/ and remote/ is parsed, and a check there (``x in C``,
    ``x not in C``, ``x < C``, ``Literal[C]``) against a constant a run parameter's choices or bound is made of
    (``contract.LONG_SAMPLES``, ``CANARY_SAMPLES_MAX``, ...) is refused: such a check belongs to the table
    (``argspec.judge(RUN_ARGS[name], value)``). So is an ``Arg`` with a bound or choices for a run parameter's name
    declared outside it. (A grep for ``32`` or a choices tuple would catch unrelated numbers and miss a renamed
    import; the AST check looks at what is compared, whatever the module calls it.)"""
    constants = _bound_constants()
    assert {"LONG_SAMPLES", "CANARY_SAMPLES_MAX", "STATE_FORMATS", "CHAT_TURNS", "CHUNKED_PREFILL", "ENGINE_CHOICES",
            "LAYER_CONVENTIONS"} <= constants

    def named(node) -> str | None:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None

    found = []
    for path in sorted([*REPO.glob("specops/**/*.py"), *REPO.glob("remote/**/*.py")]):
        where = str(path.relative_to(REPO))
        if where in MAY_NAME_BOUNDS:
            continue
        tree = ast.parse(path.read_text(), where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                found += [f"{where}:{node.lineno}" for c in node.comparators for n in ast.walk(c)
                          if named(n) in constants]
            elif isinstance(node, ast.Subscript) and named(node.value) == "Literal":
                found += [f"{where}:{node.lineno}" for n in ast.walk(node.slice) if named(n) in constants]
            elif isinstance(node, ast.Dict):  # {"tp": Arg("int", min=1)}: a run parameter's bound declared again
                found += [f"{where}:{node.lineno} (an Arg with bounds for run parameter {k.value})"
                          for k, v in zip(node.keys, node.values)
                          if isinstance(k, ast.Constant) and k.value in {**RUN_ARGS, **TRAIN_ARGS}
                          and isinstance(v, ast.Call)
                          and named(v.func) == "Arg" and {w.arg for w in v.keywords} & BOUND_WORDS]
    assert not found, found
