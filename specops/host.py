"""One host: a verified SSH connection, and the one way we run code there.

:class:`Host` wraps a Fabric :class:`~fabric.Connection` that is opened lazily, kept
for every step of a task, and checked against known_hosts before any byte of
authentication is sent (Fabric on its own accepts any key).

    >>> host = Host(spec)                       # nothing happens yet
    >>> host.run_task("facts", {})["data"]["python"]["version"]
    '3.11.7'
    >>> Host(spec_with_wrong_key).run_task("facts", {})
    HostKeyError: [gpu-a] host key for [10.0.0.5]:22 differs from known_hosts
      (got SHA256:Q2x..., known SHA256:8fV...)
      hint: if the host was reinstalled, remove the old key: ssh-keygen -R '[10.0.0.5]:22' -f ~/.ssh/known_hosts
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shlex
import socket
import threading
from pathlib import Path

import fabric
import paramiko
from invoke.exceptions import CommandTimedOut

from specops.bundle import Bundle, build_bundle
from specops.errors import HostKeyError, RemoteError, UnreachableError
from specops.inventory import HostSpec, Inventory
from specops.render import heredoc_command, render_entry

RESULT_BEGIN = "@@SPECOPS-RESULT-BEGIN@@"
RESULT_END = "@@SPECOPS-RESULT-END@@"
NEED_BUNDLE = 75

_bundle_lock = threading.Lock()
_bundle_cache: dict[str, Bundle] = {}


def current_bundle() -> Bundle:
    """The bundle of this checkout's ``remote/``, built once per process."""
    with _bundle_lock:
        if "repo" not in _bundle_cache:
            _bundle_cache["repo"] = build_bundle()
        return _bundle_cache["repo"]


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint of a host key."""
    raw = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(raw).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class StdinResult:
    """The part of invoke's Result we use, for commands run with data on stdin."""

    def __init__(self, stdout: str, stderr: str, exited: int):
        self.stdout, self.stderr, self.exited = stdout, stderr, exited

    @property
    def ok(self) -> bool:
        return self.exited == 0


class _KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys, or record them when ``accept_new`` (OpenSSH's accept-new)."""

    def __init__(self, host: str, known_hosts: Path, accept_new: bool):
        self.host, self.known_hosts, self.accept_new = host, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        fp = fingerprint(key)
        if not self.accept_new:
            raise HostKeyError(
                f"host key for {hostname} is not in {self.known_hosts} ({key.get_name()} {fp})",
                "check the fingerprint with the host's admin, then rerun with --accept-new-host-key "
                "(or set host_key_policy: accept-new) to record it",
                host=self.host, fingerprint=fp,
            )
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with open(self.known_hosts, "a", encoding="ascii") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class Host:
    """A host of the inventory and its (lazy, reused) SSH connection.

    :param spec: the host's inventory entry.
    :param inventory: for the ssh config file it names.
    :param accept_new_host_key: record a first-seen host key instead of refusing it.

    .. note:: Scripts run with ``pty=False`` and stdin closed, so nothing waits for input
       and a job started from a script is not tied to a terminal.
    """

    def __init__(self, spec: HostSpec, inventory: Inventory | None = None,
                 accept_new_host_key: bool = False):
        self.spec = spec
        self.name = spec.name
        self.ssh_config_path = _ssh_config_path(inventory)
        self.accept_new = accept_new_host_key or spec.host_key_policy == "accept-new"
        self._cxn: fabric.Connection | None = None
        self._home: str | None = None
        #: bytes of bundle uploaded by this object (0 when the host had the bundle).
        self.bundle_bytes_sent = 0

    # -- connection -------------------------------------------------------------
    @property
    def cxn(self) -> fabric.Connection:
        if self._cxn is None:
            self._cxn = self._make_connection()
        return self._cxn

    def _make_connection(self) -> fabric.Connection:
        ssh_config = paramiko.SSHConfig()
        if self.ssh_config_path and self.ssh_config_path.is_file():
            ssh_config = paramiko.SSHConfig.from_path(str(self.ssh_config_path))
        config = fabric.Config(ssh_config=ssh_config, overrides={"load_ssh_configs": False})
        looked_up = ssh_config.lookup(self.spec.address)
        connect_kwargs = {}
        if self.spec.key:
            connect_kwargs["key_filename"] = [os.path.expanduser(self.spec.key)]
            connect_kwargs["look_for_keys"] = False
        cxn = fabric.Connection(
            self.spec.address, user=self.spec.user, port=self.spec.port, config=config,
            connect_timeout=int(self.spec.connect_timeout), connect_kwargs=connect_kwargs,
        )
        known = self.spec.known_hosts or (looked_up.get("userknownhostsfile") or "").split(" ")[0]
        self.known_hosts = Path(os.path.expanduser(known or "~/.ssh/known_hosts"))
        hop = cxn
        while isinstance(hop, fabric.Connection):  # the ProxyJump chain is verified too
            if self.known_hosts.is_file():
                hop.client.load_host_keys(str(self.known_hosts))
            hop.client.set_missing_host_key_policy(
                _KnownHostsPolicy(self.name, self.known_hosts, self.accept_new))
            hop = hop.gateway
        return cxn

    def open(self) -> None:
        """Connect and authenticate, mapping every failure to one clear error."""
        cxn = self.cxn
        if cxn.is_connected:
            return
        where = f"{cxn.user}@{cxn.host}:{cxn.port}"
        try:
            cxn.open()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as exc:
            name = known_hosts_name(cxn.host, cxn.port)
            raise HostKeyError(
                f"host key for {name} differs from {self.known_hosts} "
                f"(got {exc.key.get_name()} {fingerprint(exc.key)}, known {fingerprint(exc.expected_key)}); "
                f"refusing to connect: this may be a man-in-the-middle",
                f"if the host was really reinstalled, remove the old key: "
                f"ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(str(self.known_hosts))}",
                host=self.name, fingerprint=fingerprint(exc.key),
            ) from None
        except paramiko.AuthenticationException as exc:
            raise UnreachableError(f"authentication to {where} failed: {exc}",
                                   "check 'user' and 'key' in the inventory (or the ssh config)",
                                   host=self.name) from None
        except (socket.timeout, TimeoutError) as exc:
            raise UnreachableError(f"connecting to {where} timed out after {cxn.connect_timeout}s ({exc})",
                                   "is the host up and the port open? raise connect_timeout if it is slow",
                                   host=self.name) from None
        except (OSError, paramiko.SSHException) as exc:
            raise UnreachableError(f"cannot connect to {where}: {exc or type(exc).__name__}",
                                   "check 'address' and 'port' in the inventory, and that sshd runs there",
                                   host=self.name) from None
        if self.spec.keepalive:
            cxn.transport.set_keepalive(self.spec.keepalive)

    def close(self) -> None:
        if self._cxn is not None:
            self._cxn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- primitives -------------------------------------------------------------
    def run(self, command: str, timeout: float | None = None):
        """Run a shell command: no pty, stdin closed, output captured, never raises on exit code."""
        self.open()
        try:
            return self.cxn.run(command, hide=True, warn=True, pty=False, in_stream=False,
                                timeout=timeout)
        except CommandTimedOut as exc:
            raise RemoteError(f"command timed out after {exc.timeout}s", "raise the timeout",
                              host=self.name) from None

    def run_heredoc(self, command: str, script: str, timeout: float | None = None) -> "StdinResult":
        """Run ``command <<'DELIM'`` + ``script`` by feeding that text to ``sh -s`` on stdin.

        The heredoc travels on the channel's stdin, not in the exec request, so no
        argument-length limit applies (a bundle of a few hundred KB fits), and the
        quoted delimiter still turns off every expansion.
        """
        self.open()
        text = heredoc_command(command, script).encode()
        chan = self.cxn.transport.open_session(timeout=self.spec.connect_timeout)
        chan.settimeout(timeout)
        try:
            chan.exec_command("sh -s")
            chan.sendall(text)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            while True:  # drain both streams so neither fills its window and blocks the host
                progressed = False
                if chan.recv_ready():
                    out += chan.recv(65536)
                    progressed = True
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    progressed = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if not progressed:
                    chan.status_event.wait(0.01)
            exited = chan.recv_exit_status()
        except socket.timeout:
            raise RemoteError(f"command timed out after {timeout}s", "raise the timeout",
                              host=self.name) from None
        finally:
            chan.close()
        return StdinResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), exited)

    def home(self) -> str:
        if self._home is None:
            self.open()
            self._home = self.cxn.sftp().normalize(".")
        return self._home

    def remote_path(self, path: str) -> str:
        """Expand a leading ``~`` for SFTP (which does not), against the remote home."""
        if path == "~" or path.startswith("~/"):
            return self.home() + path[1:]
        if path.startswith("~"):
            raise RemoteError(f"path {path!r}: '~user' paths are not supported", "use an absolute path",
                              host=self.name)
        return path if path.startswith("/") else f"{self.home()}/{path}"

    def makedirs(self, path: str) -> None:
        """``mkdir -p`` over SFTP, one component at a time."""
        sftp = self.cxn.sftp()
        parts = [p for p in path.split("/") if p]
        current = ""
        for part in parts:
            current += "/" + part
            try:
                sftp.stat(current)
            except FileNotFoundError:
                sftp.mkdir(current)

    def put_bytes(self, data: bytes, path: str, mode: int = 0o644) -> None:
        """Upload ``data`` to ``path`` atomically (write a part file, then rename)."""
        self.open()
        sftp = self.cxn.sftp()
        self.makedirs(path.rsplit("/", 1)[0] or "/")
        part = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
        with sftp.open(part, "wb") as fh:
            fh.set_pipelined(True)
            fh.write(data)
        sftp.chmod(part, mode)
        sftp.posix_rename(part, path)

    # -- tasks ------------------------------------------------------------------
    def bundle_dir(self, bundle: Bundle) -> str:
        return f"{self.spec.work_dir.rstrip('/')}/bundles/{bundle.digest}"

    def python_command(self, *args: str, sudo: bool = False) -> str:
        words = [self.spec.python, *args]
        prefix = "sudo -n -- " if sudo else ""
        return prefix + " ".join(shell_word(w) for w in words)

    def exec_script(self, script: str, *, sudo: bool = False, timeout: float | None = None):
        """Run a python script on the host by the inventory's delivery, return the invoke Result."""
        if self.spec.delivery == "heredoc":
            return self.run_heredoc(self.python_command("-", sudo=sudo), script, timeout)
        self.open()
        # unique per call: two calls with the same script must not delete each other's file
        name = f"entry-{hashlib.sha256(script.encode()).hexdigest()[:12]}-{secrets.token_hex(4)}.py"
        path = self.remote_path(f"{self.spec.work_dir.rstrip('/')}/scripts/{name}")
        self.put_bytes(script.encode(), path)
        quoted = shlex.quote(path)
        return self.run(f"{self.python_command(path, sudo=sudo)}; rc=$?; rm -f -- {quoted}; exit $rc",
                        timeout)

    def push_bundle(self, bundle: Bundle) -> None:
        """Upload the bundle zip next to its dir; the entry script unpacks and verifies it."""
        self.put_bytes(bundle.data, self.remote_path(self.bundle_dir(bundle)) + ".zip")
        self.bundle_bytes_sent += bundle.size

    def run_task(self, module: str, params: dict, *, sudo: bool = False,
                 timeout: float | None = None, bundle: Bundle | None = None) -> dict:
        """Run ``remote.<module>.main(params)`` on the host and return its payload.

        One python process per call. The bundle travels only when the host lacks it:
        the entry script exits 75 when it does, and we upload and run once more.

        :raises RemoteError: when no result came back (the error carries the exit code
            and the last lines of output).
        """
        bundle = bundle or current_bundle()
        params = {**params, "_bundle_dir": self.bundle_dir(bundle)}
        result = self.exec_script(render_entry(module, params), sudo=sudo, timeout=timeout)
        if result.exited == NEED_BUNDLE and "@@SPECOPS-NEED-BUNDLE@@" in result.stdout:
            if self.spec.delivery == "heredoc":
                script = render_entry(module, params, bundle_zip=bundle.data)
                self.bundle_bytes_sent += bundle.size
            else:
                self.push_bundle(bundle)
                script = render_entry(module, params)
            result = self.exec_script(script, sudo=sudo, timeout=timeout)
        return self._parse(module, result)

    def _parse(self, module: str, result) -> dict:
        out = result.stdout
        start = out.rfind(RESULT_BEGIN)
        end = out.rfind(RESULT_END)
        if start != -1 and end > start:
            return json.loads(out[start + len(RESULT_BEGIN):end])
        tail = (out + "\n" + result.stderr).strip()
        hint = "run with --debug to see the whole output"
        if result.exited == 127:
            hint = f"the host has no {self.spec.python!r}: fix 'python' in the inventory"
        elif result.exited == 1 and "sudo" in result.stderr:
            hint = "sudo needs a password on the host: allow passwordless sudo, or turn 'sudo' off"
        raise RemoteError(f"remote.{module} returned no result (exit code {result.exited})", hint,
                          host=self.name, exited=result.exited, output_tail=tail[-3000:])


def shell_word(word: str) -> str:
    """Quote ``word`` for sh; a leading ``~/`` becomes ``"$HOME"/`` so it still expands."""
    if word.startswith("~/"):
        return '"$HOME"/' + shlex.quote(word[2:])
    return shlex.quote(word)


def _ssh_config_path(inventory: Inventory | None) -> Path | None:
    if inventory is not None and inventory.ssh_config:
        path = Path(os.path.expanduser(inventory.ssh_config))
        return path if path.is_absolute() else (inventory.path.parent / path)
    return Path(os.path.expanduser(os.environ.get("SPECOPS_SSH_CONFIG", "~/.ssh/config")))
