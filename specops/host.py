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
import collections
import hashlib
import itertools
import json
import logging
import os
import secrets
import shlex
import socket
import threading
import time
from pathlib import Path

import fabric
import paramiko
from invoke.exceptions import CommandTimedOut

from specops.assets import remote_protocol
from specops.bundle import Bundle, build_bundle
from specops.errors import (HostKeyError, PythonTooOldError, RemoteError, UnreachableError, UsageError,
                            WorkDirError)
from specops.inventory import HostSpec, Inventory
from specops.render import heredoc_command, render_entry

#: test-only: demand this python version from the entry script instead of its own minimum, so
#: that a modern interpreter takes the real "too old" path (tests/test_bad_input.py).
PYTHON_MIN_OVERRIDE: tuple[int, int] | None = None

# paramiko's transport thread logs its failures with tracebacks ("Exception (client): ...") and,
# with no handler set up, python prints them on stderr; every failure becomes one error instead.
logging.getLogger("paramiko.transport").addHandler(logging.NullHandler())

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


class _TransportLog(logging.Handler):
    """What paramiko's transport said about one connection, kept to explain a failed handshake.

    Each :class:`Host` gets its own log channel under ``paramiko.transport``, so nothing it
    logs reaches stderr and the lines a non-SSH server sent before giving up (paramiko logs
    them as ``Banner: ...``) can be quoted in the error.
    """

    _ids = itertools.count()

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.channel = f"paramiko.transport.specops-{next(self._ids)}"
        self.logger = logging.getLogger(self.channel)
        self.logger.addHandler(self)
        self.logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # a log line must never break a connection
            pass

    def verbose(self, on: bool) -> None:
        """DEBUG while connecting (banner lines are DEBUG), quieter once connected."""
        self.logger.setLevel(logging.DEBUG if on else logging.WARNING)

    def non_ssh_lines(self) -> list[str]:
        return [line[len("Banner: "):] for line in self.lines if line.startswith("Banner: ")]


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
        self._ssh_log = _TransportLog()
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
        # a port that accepts TCP but never speaks SSH must not hold us longer than a refused one
        connect_kwargs = {"banner_timeout": self.spec.connect_timeout}
        if self.spec.key:
            connect_kwargs["key_filename"] = [os.path.expanduser(self.spec.key)]
            connect_kwargs["look_for_keys"] = False
        cxn = fabric.Connection(
            self.spec.address, user=self.spec.user, port=self.spec.port, config=config,
            connect_timeout=self.spec.connect_timeout, connect_kwargs=connect_kwargs,
        )
        known = self.spec.known_hosts or (looked_up.get("userknownhostsfile") or "").split(" ")[0]
        self.known_hosts = Path(os.path.expanduser(known or "~/.ssh/known_hosts"))
        hop = cxn
        while isinstance(hop, fabric.Connection):  # the ProxyJump chain is verified too
            if self.known_hosts.is_file():
                hop.client.load_host_keys(str(self.known_hosts))
            hop.client.set_missing_host_key_policy(
                _KnownHostsPolicy(self.name, self.known_hosts, self.accept_new))
            hop.client.set_log_channel(self._ssh_log.channel)
            hop = hop.gateway
        return cxn

    def open(self) -> None:
        """Connect and authenticate, mapping every failure to one clear error."""
        cxn = self.cxn
        if cxn.is_connected:
            return
        where = f"{cxn.user}@{cxn.host}:{cxn.port}"
        self._ssh_log.verbose(True)
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
        except (OSError, EOFError, paramiko.SSHException) as exc:
            not_ssh = self._not_ssh(cxn, exc)
            if not_ssh is not None:
                raise not_ssh from None
            if isinstance(exc, (socket.timeout, TimeoutError)):
                raise UnreachableError(f"connecting to {where} timed out after {cxn.connect_timeout}s ({exc})",
                                       "is the host up and the port open? raise connect_timeout if it is slow",
                                       host=self.name) from None
            raise UnreachableError(f"cannot connect to {where}: {exc or type(exc).__name__}",
                                   "check 'address' and 'port' in the inventory, and that sshd runs there",
                                   host=self.name) from None
        finally:
            self._ssh_log.verbose(False)
        if self.spec.keepalive:
            cxn.transport.set_keepalive(self.spec.keepalive)

    def _not_ssh(self, cxn: fabric.Connection, exc: BaseException) -> UnreachableError | None:
        """Explain a TCP connection that never became SSH (silent, closed, or another protocol).

        ``None`` when no TCP connection was made (refused, DNS, timeout): the caller's
        message fits those. Reads what happened from the failed transport itself: the
        banner it got, the lines before it, and the error under paramiko's.
        """
        transport = cxn.client.get_transport()
        if transport is None:
            return None
        transport.close()  # its thread would otherwise wait out its own banner timeout
        reached = f"{cxn.host}:{cxn.port}" + (" (through the ProxyJump host)" if cxn.gateway else "")
        timeout = self.spec.connect_timeout
        causes = []
        cause: BaseException | None = exc
        while cause is not None and len(causes) < 5:
            causes.append(cause)
            cause = cause.__cause__ or cause.__context__
        closed = any(isinstance(c, (EOFError, ConnectionError)) for c in causes)
        check = "check 'address' and 'port' in the inventory (and the ssh config)"
        if transport.remote_version:  # it is an SSH server; the handshake broke later
            if "No existing session" not in str(exc) and not closed:
                return None
            what = ("closed the connection during the SSH handshake" if closed
                    else f"did not finish the SSH handshake within {timeout:g}s")
            return UnreachableError(f"{reached} ({transport.remote_version}) {what}",
                                    "read the host's sshd log (MaxStartups, fail2ban, unsupported "
                                    "algorithms); raise connect_timeout if the host is slow", host=self.name)
        other = self._ssh_log.non_ssh_lines()
        if other:
            what = f"answered {other[0][:80]!r} instead of an SSH banner"
            what += ", then closed the connection" if closed else ""
            hint = f"that port speaks another protocol: {check}"
        elif closed:
            what = "accepted the TCP connection, then closed it without sending an SSH banner"
            hint = (f"{check}: is sshd listening there? an sshd that drops connections at once may be "
                    f"refusing this client (MaxStartups, fail2ban, tcpwrappers)")
        else:
            what = f"accepted the TCP connection but sent no SSH banner within {timeout:g}s"
            hint = f"{check}: is sshd listening there? if it is only slow, raise connect_timeout"
        return UnreachableError(f"{reached} {what}", hint, host=self.name)

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

    def _put_in_work_dir(self, data: bytes, path: str) -> None:
        """:meth:`put_bytes` for a file under ``work_dir``: a failure names the field and the cause."""
        try:
            self.put_bytes(data, path)
        except (socket.timeout, ConnectionError):
            raise
        except OSError as exc:  # paramiko reports SFTP status codes as IOError: "Failure", "No such file"
            raise self._work_dir_error(path.rsplit("/", 1)[0], f"SFTP: {exc.strerror or exc}") from None

    def _work_dir_error(self, directory: str, reason: str) -> WorkDirError:
        """The error for a ``work_dir`` that cannot hold our files, with the host's own reason.

        SFTP says only "Failure" for a read-only file system, so the shell's ``mkdir -p``
        is asked for the real cause (it changes nothing where SFTP could not either).
        """
        if len(directory) < 4000:
            probe = self.run(f"mkdir -p -- {shlex.quote(directory)}")
            said = (probe.stderr.strip().splitlines() or [""])[-1]
            if not probe.ok and said:
                reason = said
        return WorkDirError(
            f"work_dir {self.spec.work_dir!r} is not usable on the host: cannot create or write "
            f"{directory}: {reason}",
            "set 'work_dir' in the inventory to a directory the ssh user can create and write "
            "(the default is ~/.specops)", host=self.name, path=directory)

    # -- tasks ------------------------------------------------------------------
    def bundle_dir(self, bundle: Bundle) -> str:
        return f"{self.spec.work_dir.rstrip('/')}/bundles/{bundle.digest}"

    def python_command(self, *args: str, sudo: bool = False) -> str:
        """The shell command that runs the inventory's python with ``args``, every word quoted.

        :raises UsageError: for a ``python`` that starts with ``-`` (sudo or the
            interpreter would read it as an option; the inventory refuses it too).
        """
        if self.spec.python.startswith("-"):
            raise UsageError(f"python {self.spec.python!r} starts with '-' and would be read as an option",
                             "set 'python' in the inventory to the interpreter's path", host=self.name)
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
        self._put_in_work_dir(script.encode(), path)
        quoted = shlex.quote(path)
        return self.run(f"{self.python_command(path, sudo=sudo)}; rc=$?; rm -f -- {quoted}; exit $rc",
                        timeout)

    def push_bundle(self, bundle: Bundle) -> None:
        """Upload the bundle zip next to its dir; the entry script unpacks and verifies it."""
        self._put_in_work_dir(bundle.data, self.remote_path(self.bundle_dir(bundle)) + ".zip")
        self.bundle_bytes_sent += bundle.size

    def run_task(self, module: str, params: dict, *, sudo: bool = False,
                 timeout: float | None = None, bundle: Bundle | None = None) -> dict:
        """Run ``remote.<module>.main(params)`` on the host and return its payload.

        One python process per call. The bundle travels only when the host lacks it:
        the entry script exits 75 when it does, and we upload and run once more.

        :raises RemoteError: when no result came back (the error carries the exit code
            and the last lines of output).
        """
        return self._run_entry(module, params, bundle,
                               lambda script: self.exec_script(script, sudo=sudo, timeout=timeout))

    @staticmethod
    def _needs_bundle(result) -> bool:
        """The entry script's answer for "upload the bundle and run me again" (remote/protocol.py)."""
        protocol = remote_protocol()
        return result.exited == protocol.NEED_BUNDLE_EXIT and protocol.NEED_BUNDLE_MARKER in result.stdout

    def _parse(self, module: str, result) -> dict:
        out = result.stdout
        protocol = remote_protocol()  # the markers come from the file the host side prints them with
        start = out.rfind(protocol.RESULT_BEGIN)
        end = out.rfind(protocol.RESULT_END)
        if start != -1 and end > start:
            return json.loads(out[start + len(protocol.RESULT_BEGIN):end])
        marker = protocol.ENTRY_ERROR_MARKER
        if marker in out:
            raise self._entry_error(out[out.rindex(marker) + len(marker):].split("\n", 1)[0])
        tail = (out + "\n" + result.stderr).strip()
        hint = "run with --debug to see the whole output"
        if result.exited == 127:
            hint = f"the host has no {self.spec.python!r}: fix 'python' in the inventory"
        elif result.exited == 1 and "sudo" in result.stderr:
            hint = "sudo needs a password on the host: allow passwordless sudo, or turn 'sudo' off"
        raise RemoteError(f"remote.{module} returned no result (exit code {result.exited})", hint,
                          host=self.name, exited=result.exited, output_tail=tail[-3000:])


    def _entry_error(self, line: str) -> Exception:
        """Turn the entry preamble's ``@@SPECOPS-ENTRY-ERROR@@ {json}`` line into one clear error."""
        try:
            facts = json.loads(line)
        except ValueError:
            facts = {"kind": "unreadable", "line": line}
        if facts.get("kind") == "python-too-old":
            found, needed = str(facts.get("found")), str(facts.get("needed"))
            resolved = facts.get("executable")
            where = f" ({resolved})" if resolved and resolved != self.spec.python else ""
            return PythonTooOldError(
                f"python {self.spec.python!r}{where} on the host is python {found}; "
                f"specops needs python >= {needed} there",
                f"set 'python' in the inventory to the env with vLLM and speculators (python >= {needed})",
                host=self.name, found=found, needed=needed)
        if facts.get("kind") == "work-dir":
            return WorkDirError(
                f"work_dir {self.spec.work_dir!r} is not usable on the host: cannot unpack into "
                f"{facts.get('path')}: {facts.get('error')}",
                "set 'work_dir' in the inventory to a directory the ssh user can create and write "
                "(the default is ~/.specops)", host=self.name, path=str(facts.get("path")))
        return RemoteError(f"the entry script stopped early: {line[:200]}",
                           "report this as a specops bug (the marker line is not one this version knows)",
                           host=self.name)

    # -- streaming: one long-lived python whose stdout is read as it comes ------
    def stream_task(self, module: str, params: dict, on_line, *, prefix: str,
                    bundle: Bundle | None = None, idle_timeout: float | None = None) -> dict:
        """Run ``remote.<module>.main(params)`` like :meth:`run_task`, reading its stdout live.

        Every stdout line that starts with ``prefix`` goes to ``on_line(rest_of_line)`` the
        moment it arrives; the task's result comes back at the end as usual. One python
        and one channel for the whole call, however long it runs (``job follow`` streams a
        run's events this way instead of starting a python per poll). With SFTP delivery
        the entry script is uploaded once, before the python starts.

        :param on_line: called in this thread; whatever it raises ends the call and closes
            the channel, which the remote task sees as its stdout going away.
        :param idle_timeout: seconds without a byte on stdout after which the connection
            counts as lost (a task that streams heartbeats never stays that quiet).
        :raises UnreachableError: the connection dropped, or stayed silent past ``idle_timeout``.
        :raises RemoteError: when no result came back.
        """
        return self._run_entry(module, params, bundle,
                               lambda script: self._stream_script(script, on_line, prefix, idle_timeout))

    def _run_entry(self, module: str, params: dict, bundle: Bundle | None, execute) -> dict:
        """Run ``module``'s entry script with ``execute``; send the bundle and retry once if the host lacks it.

        The first try carries no bundle (the common case: the host has it by hash); the
        entry script answers "need bundle" when it does not, and the second try brings it
        over SFTP, or inside the heredoc for hosts without SFTP.
        """
        bundle = bundle or current_bundle()
        params = {**params, "_bundle_dir": self.bundle_dir(bundle)}
        if PYTHON_MIN_OVERRIDE is not None:
            params["_python_min"] = list(PYTHON_MIN_OVERRIDE)
        result = execute(render_entry(module, params))
        if self._needs_bundle(result):
            if self.spec.delivery == "heredoc":
                script = render_entry(module, params, bundle_zip=bundle.data)
                self.bundle_bytes_sent += bundle.size
            else:
                self.push_bundle(bundle)
                script = render_entry(module, params)
            result = execute(script)
        return self._parse(module, result)

    def _stream_script(self, script: str, on_line, prefix: str, idle_timeout: float | None) -> StdinResult:
        self.open()
        stdin = None
        if self.spec.delivery == "heredoc":
            command, stdin = "sh -s", heredoc_command(self.python_command("-"), script).encode()
        else:
            name = f"entry-{hashlib.sha256(script.encode()).hexdigest()[:12]}-{secrets.token_hex(4)}.py"
            path = self.remote_path(f"{self.spec.work_dir.rstrip('/')}/scripts/{name}")
            self._put_in_work_dir(script.encode(), path)
            command = f"{self.python_command(path)}; rc=$?; rm -f -- {shlex.quote(path)}; exit $rc"
        chan = self.cxn.transport.open_session(timeout=self.spec.connect_timeout)
        try:
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
            chan.settimeout(1.0)  # wake up every second to drain stderr and check the idle clock
            kept, pending, err = [], b"", bytearray()
            heard = time.monotonic()
            while True:
                try:
                    chunk = chan.recv(65536)
                except socket.timeout:
                    chunk = None
                while chan.recv_stderr_ready():  # drained, or a chatty stderr would stall the host
                    err += chan.recv_stderr(65536)
                    del err[:-65536]
                if chunk is None:
                    if idle_timeout is not None and time.monotonic() - heard > idle_timeout:
                        raise UnreachableError(
                            f"no word from the host for {idle_timeout:.0f}s while streaming a task's output; "
                            f"the connection is presumed lost",
                            "check the network and the host; a detached run goes on regardless",
                            host=self.name)
                    continue
                if not chunk:  # the remote command closed its stdout: it is ending
                    break
                heard = time.monotonic()
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace")
                    if line.startswith(prefix):
                        on_line(line[len(prefix):])
                    else:
                        kept.append(line)
            kept.append(pending.decode("utf-8", "replace"))
            exited = chan.recv_exit_status()
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if exited == -1 and not self.cxn.transport.is_active():
                raise UnreachableError("the connection to the host dropped while streaming",
                                       "a detached run goes on; follow it again once the host answers",
                                       host=self.name)
        finally:
            chan.close()
        return StdinResult("\n".join(kept), err.decode("utf-8", "replace"), exited)


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
