"""The task collection behind both ``fab`` (via fabfile.py) and the ``specops`` program.

Tasks only parse arguments and call the package; every task takes ``--on`` (hosts or
groups, default all), ``--inventory``, ``--json`` and ``--accept-new-host-key``, and
exits with a code from :mod:`specops.exit_codes`. With fab's own ``-H a,b`` the task
runs once per named host (inventory names, not raw addresses).
"""
from __future__ import annotations

import fabric
from invoke import Collection, Exit, task

from specops import exit_codes
from specops.errors import SpecopsError
from specops.inventory import load_inventory
from specops.report import err_console, print_reports
from specops.result import overall_exit

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


def _finish(reports, as_json):
    print_reports(reports, as_json=as_json)
    code = overall_exit(reports)
    if code:
        raise Exit(code=int(code))


def _guard(fn):
    """Turn our errors into one readable message and their exit code (no traceback)."""
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecopsError as exc:
            err_console.print(f"[bold red]error:[/] {exc}")
            raise Exit(code=int(exc.code)) from None
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


@task(help=COMMON_HELP)
def facts(c, on=None, inventory=None, json=False, accept_new_host_key=False):
    """Show each host's python, OS, packages and devices (proves the whole pipe)."""
    from specops.facts import facts as run

    @_guard
    def go():
        _finish(run(load_inventory(inventory), _selector(c, on), accept_new_host_key), json)
    go()


RUN_HELP = {
    "model": "model dir on the host (default: the inventory's model_path)",
    "dataset": "chat JSONL on the host (default: the inventory's dataset)",
    "tp": "tensor parallel size (default: the inventory's tp)",
    "layer-ids": "comma-separated layer ids (default: the engine's own, convention recorded)",
    "engine": "extraction engine: speculators-0.3 or hf-reference",
    "seq-len": "max tokens per sample",
    "max-samples": "number of samples to extract",
}


def _overrides(**flags):
    return {k: v for k, v in flags.items() if v not in (None, "")}


@task(help={**COMMON_HELP, **RUN_HELP,
            "skip-autoconfig": "skip loading the config through transformers (the slowest check)"})
def preflight(c, on=None, inventory=None, json=False, accept_new_host_key=False, model=None,
              dataset=None, tp=None, layer_ids=None, engine=None, seq_len=None, max_samples=None,
              skip_autoconfig=False):
    """Find every failure that would waste a model load, in seconds, without loading weights."""
    from specops.preflight import preflight as run

    @_guard
    def go():
        overrides = _overrides(model=model, dataset=dataset, tp=tp, layer_ids=layer_ids, engine=engine,
                               seq_len=seq_len, max_samples=max_samples)
        _finish(run(load_inventory(inventory), _selector(c, on), overrides, accept_new_host_key,
                    skip_autoconfig=skip_autoconfig), json)
    go()


@task(help={**COMMON_HELP,
            "check": "change nothing; show the unified diff of what would change",
            "revert": "restore the pristine files (verified by sha256)",
            "status": "say which patch set fits and whether it is applied",
            "sudo": "write through `sudo -n` (root-owned site-packages)"})
def patch(c, on=None, inventory=None, json=False, accept_new_host_key=False, check=False, revert=False,
          status=False, sudo=False):
    """Apply the versioned patch set that makes the host's speculators fit its vLLM."""
    from specops.errors import UsageError
    from specops.patch import patch as run

    @_guard
    def go():
        chosen = [name for name, on_ in (("check", check), ("revert", revert), ("status", status)) if on_]
        if len(chosen) > 1:
            raise UsageError(f"--{chosen[0]} and --{chosen[1]} were both given", "pick one of them")
        action = chosen[0] if chosen else "apply"
        _finish(run(load_inventory(inventory), _selector(c, on), action, sudo, accept_new_host_key), json)
    go()


@task(help={"name": "test host name (several can run side by side)",
            "json": "print the connection details as JSON"})
def testhost_up(c, name="default", json=False):
    """Bring up the built-in test host: sshd on loopback, remote env, tiny models."""
    from specops.testhost.cli import up

    _guard(up)(name, as_json=json)


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

ns = Collection(facts, preflight, patch, demo, testhost)
ns.configure({"run": {"pty": False}})

__doc__ += "\n\nExit codes: " + exit_codes.ExitCode.help_text()
