"""The ``testhost`` tasks: bring the built-in test host up and down."""
from __future__ import annotations

import json
import sys

from specops.report import console, err_console


def up(name: str = "default", as_json: bool = False) -> dict:
    from specops.testhost.hostenv import ensure_hostenv, env_dir, make_overlay_env
    from specops.testhost.models import ensure_models
    from specops.testhost.sshd import TestHost

    if not (env_dir() / ".specops-complete").exists():
        err_console.print(f"[cyan]⚙︎ building the remote env (once) in {env_dir()} ...[/]")
    python = ensure_hostenv(quiet=True)
    err_console.print("[cyan]⚙︎ tiny models (cached after the first build) ...[/]")
    models = ensure_models(python)
    host = TestHost(name)
    info = host.up()
    # the host's own env: sees the cached packages, owns the speculators that `patch` edits
    python = make_overlay_env(python, host.root / "env")
    host.link_models(models)
    info["python"], info["models"] = str(python), {k: str(v) for k, v in models.items()}
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        console.print(f"[green]✓[/] test host [bold]{name}[/] listens on 127.0.0.1:{info['port']} "
                      f"(ssh -F {info['ssh_config']} {info['alias']})")
    return info


def down(name: str = "default") -> None:
    from specops.testhost.sshd import TestHost

    stopped = TestHost(name).down()
    console.print(f"[green]✓[/] test host {name} " + ("stopped" if stopped else "was not running"))


def status(name: str = "default", as_json: bool = False) -> None:
    from specops.testhost.sshd import TestHost

    info = TestHost(name).info()
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        state = "running" if info["running"] else "stopped"
        console.print(f"test host {name}: {state}" + (f" on 127.0.0.1:{info['port']}" if info["port"] else ""))
