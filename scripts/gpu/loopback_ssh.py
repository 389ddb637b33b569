#!/usr/bin/env python3
"""An SSH server on 127.0.0.1 for driving specops on a machine that has no sshd (the lent GPU).

specops reaches a host over SSH (Fabric/paramiko): exec channels, SFTP uploads, one
long-lived channel for ``job follow``. The lent GPU machine is a bare container with
no OpenSSH server and no network, so the real transport is brought up on its
loopback in one of two ways, the first that works:

* ``openssh``: ``/usr/sbin/sshd`` and ``ssh-keygen`` are there: the built-in test host
  (``specops.testhost.sshd.TestHost``, the same server the test suite uses);
* ``asyncssh``: a small server from the ``asyncssh`` package (pure Python; it travels
  as a wheel): public-key auth against one client key, its own host key, exec
  requests run by ``/bin/sh -c`` with stdin/stdout/stderr pumped both ways and the
  exit status returned, and asyncssh's SFTP server over the real filesystem. When
  the client closes a channel the command's pipes close, as with sshd, so a
  ``job follow`` on the host ends while the job it watches goes on.

Either way the client is specops's own code, unchanged: the inventory written here
names ``127.0.0.1``, the port, the user, the client key and a known_hosts file that
holds the server's host key (so host-key verification runs, nothing is accepted blind).

    python3 scripts/gpu/loopback_ssh.py up --root /tmp/specops-ssh     # prints JSON, stays in background
    python3 scripts/gpu/loopback_ssh.py inventory --root /tmp/specops-ssh --python python3 ... > inv.yaml
    python3 scripts/gpu/loopback_ssh.py down --root /tmp/specops-ssh
"""
from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------- asyncssh server


async def _pump(reader, write, close=None):
    """Copy ``reader`` (asyncio/asyncssh stream, bytes) into ``write`` until EOF."""
    try:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            await write(chunk)
    except (BrokenPipeError, ConnectionError, OSError):
        pass
    finally:
        if close is not None:
            try:
                close()
            except Exception:
                pass


async def handle_process(process) -> None:
    """Run one exec request (``process.command``) with ``/bin/sh -c`` and relay its streams."""
    import asyncssh

    command = process.command
    if command is None:  # an interactive shell: specops never asks for one
        process.stderr.write(b"this loopback server runs exec requests only\n")
        process.exit(1)
        return
    child = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=os.path.expanduser("~"))

    async def to_stdout(chunk):
        process.stdout.write(chunk)
        await process.stdout.drain()

    async def to_stderr(chunk):
        process.stderr.write(chunk)
        await process.stderr.drain()

    async def to_child(chunk):
        child.stdin.write(chunk)
        await child.stdin.drain()

    def close_child_stdin():
        if not child.stdin.is_closing():
            child.stdin.close()

    feeder = asyncio.ensure_future(_pump(process.stdin, to_child, close_child_stdin))
    outs = asyncio.gather(_pump(child.stdout, to_stdout), _pump(child.stderr, to_stderr))
    try:
        await outs
        code = await child.wait()
    except (asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
        code = await child.wait()
    except (ConnectionError, asyncssh.DisconnectError, asyncio.CancelledError):
        # the client went away: close the command's pipes, as sshd does (it sees EPIPE)
        for pipe in (child.stdout, child.stderr):
            try:
                pipe._transport.close()  # noqa: SLF001 (asyncio's StreamReader has no public close)
            except Exception:
                pass
        raise
    finally:
        feeder.cancel()
    try:
        process.exit(code if code >= 0 else 128 - code)
    except Exception:
        pass


class _Server:
    """Allows exactly the one client key; everything else is asyncssh's defaults."""

    def __init__(self, authorized_keys: str):
        import asyncssh

        base = asyncssh.SSHServer

        class Server(base):
            def begin_auth(self, username):
                return True

            def password_auth_supported(self):
                return False

        self.factory = Server
        self.authorized_keys = authorized_keys


async def serve(root: Path, port: int) -> None:
    import asyncssh

    os.chdir(os.path.expanduser("~"))  # SFTP's "." (paramiko normalizes it to find the home)
    server = _Server(str(root / "authorized_keys"))
    await asyncssh.create_server(
        server.factory, "127.0.0.1", port, server_host_keys=[str(root / "host_ed25519")],
        authorized_client_keys=server.authorized_keys, process_factory=handle_process,
        sftp_factory=True, encoding=None, allow_scp=False, keepalive_interval=0,
        line_editor=False)
    (root / "port").write_text(str(port))
    await asyncio.Event().wait()


def asyncssh_keys(root: Path, user: str) -> None:
    import asyncssh

    for name in ("host_ed25519", "client_ed25519"):
        path = root / name
        if not path.exists():
            key = asyncssh.generate_private_key("ssh-ed25519", comment=f"specops-gpu-{name}")
            key.write_private_key(str(path))
            key.write_public_key(str(path) + ".pub")
            os.chmod(path, 0o600)
    (root / "authorized_keys").write_text((root / "client_ed25519.pub").read_text())


# ----------------------------------------------------------------------------- up / down


def up(root: Path, kind: str = "auto") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    info_path = root / "info.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        try:
            os.kill(int(info["pid"]), 0)
            return info
        except (ProcessLookupError, KeyError, ValueError):
            pass
    user = getpass.getuser()
    have_openssh = SSHD.exists() and shutil.which("ssh-keygen") is not None
    if kind == "openssh" or (kind == "auto" and have_openssh):
        os.environ.setdefault("SPECOPS_CACHE", str(root / "cache"))
        from specops.testhost.sshd import TestHost

        host = TestHost(name="gpu", root=root / "openssh")
        got = host.up()
        info = {"server": "openssh", "sshd": str(SSHD), "address": "127.0.0.1", "port": got["port"],
                "user": got["user"], "key": got["key"], "known_hosts": got["known_hosts"],
                "pid": int(host.pid_file.read_text())}
    else:
        asyncssh_keys(root, user)
        port = free_port()
        log = open(root / "server.log", "ab")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", "--root", str(root),
                                 "--port", str(port)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env=dict(os.environ))
        if not wait_port(port):
            raise SystemExit(f"asyncssh server did not listen on {port}: {(root / 'server.log').read_text()[-2000:]}")
        import asyncssh

        host_key = asyncssh.read_private_key(str(root / "host_ed25519"))
        public = host_key.export_public_key("openssh").decode().split()[:2]
        (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {public[0]} {public[1]}\n")
        info = {"server": "asyncssh", "asyncssh": asyncssh.__version__, "address": "127.0.0.1", "port": port,
                "user": user, "key": str(root / "client_ed25519"), "known_hosts": str(root / "known_hosts"),
                "pid": proc.pid, "openssh_found": have_openssh}
    info_path.write_text(json.dumps(info, indent=1))
    return info


def down(root: Path) -> bool:
    info_path = root / "info.json"
    if not info_path.exists():
        return False
    info = json.loads(info_path.read_text())
    try:
        os.kill(int(info["pid"]), signal.SIGTERM)
    except (ProcessLookupError, KeyError, ValueError):
        return False
    info_path.unlink()
    return True


def inventory(info: dict, hosts: dict, defaults: dict) -> str:
    """An inventory (YAML is a superset of JSON: written as JSON) for ``hosts`` on this server."""
    doc = {"defaults": defaults, "hosts": {}}
    for name, fields in hosts.items():
        doc["hosts"][name] = {"address": "127.0.0.1", "port": info["port"], "user": info["user"],
                              "key": info["key"], "known_hosts": info["known_hosts"], **fields}
    return json.dumps(doc, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="loopback_ssh.py")
    parser.add_argument("action", choices=["up", "down", "serve", "info"])
    parser.add_argument("--root", default="/tmp/specops-ssh")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kind", choices=["auto", "openssh", "asyncssh"], default="auto")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.action == "serve":
        asyncio.run(serve(root, args.port))
        return 0
    if args.action == "up":
        print(json.dumps(up(root, args.kind)))
        return 0
    if args.action == "info":
        print((root / "info.json").read_text())
        return 0
    print(json.dumps({"stopped": down(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
