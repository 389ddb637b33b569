"""A verified SSH connection to one host: trust, connect, diagnose.

:class:`VerifiedConnection` makes a Fabric :class:`~fabric.Connection` lazily and checks
the host key (and every ProxyJump hop's) against known_hosts before any byte of
authentication is sent (Fabric on its own accepts any key). Every way a connection can
fail becomes one error that says what happened and what to change:

    >>> VerifiedConnection(spec_with_wrong_key).open()
    HostKeyError: [gpu-a] host key for [10.0.0.5]:22 differs from known_hosts
      (got SHA256:Q2x..., known SHA256:8fV...)
      hint: if the host was reinstalled, remove the old key: ssh-keygen -R '[10.0.0.5]:22' -f ~/.ssh/known_hosts
"""
from __future__ import annotations

import base64
import collections
import hashlib
import itertools
import logging
import os
import shlex
import socket
from pathlib import Path

import fabric
import paramiko

from specops.errors import HostKeyError, UnreachableError
from specops.inventory import HostSpec, Inventory

# paramiko's transport thread logs its failures with tracebacks ("Exception (client): ...") and,
# with no handler set up, python prints them on stderr; every failure becomes one error instead.
logging.getLogger("paramiko.transport").addHandler(logging.NullHandler())


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint of a host key."""
    raw = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(raw).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def ssh_config_path(inventory: Inventory | None) -> Path | None:
    """The ssh config file to read: the inventory's (relative to it), else ``$SPECOPS_SSH_CONFIG``
    or ``~/.ssh/config``."""
    if inventory is not None and inventory.ssh_config:
        path = Path(os.path.expanduser(inventory.ssh_config))
        return path if path.is_absolute() else (inventory.path.parent / path)
    return Path(os.path.expanduser(os.environ.get("SPECOPS_SSH_CONFIG", "~/.ssh/config")))


class TransportLog(logging.Handler):
    """What paramiko's transport said about one connection, kept to explain a failed handshake.

    Each connection gets its own log channel under ``paramiko.transport``, so nothing it
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


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
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


class VerifiedConnection:
    """One host's Fabric connection: made on first use, host keys checked, failures explained.

    :param spec: the host's inventory entry.
    :param inventory: for the ssh config file it names.
    :param accept_new_host_key: record a first-seen host key instead of refusing it.
    """

    def __init__(self, spec: HostSpec, inventory: Inventory | None = None,
                 accept_new_host_key: bool = False):
        self.spec = spec
        self.name = spec.name
        self.ssh_config_path = ssh_config_path(inventory)
        self.accept_new = accept_new_host_key or spec.host_key_policy == "accept-new"
        #: the known_hosts file the keys are checked against (set when the connection is made).
        self.known_hosts: Path | None = None
        self._cxn: fabric.Connection | None = None
        self._ssh_log = TransportLog()

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
                KnownHostsPolicy(self.name, self.known_hosts, self.accept_new))
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
