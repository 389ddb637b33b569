"""One host: a verified SSH connection, its shell and SFTP, and the one way we run code there.

:class:`Host` holds a :class:`~specops.transport.ssh.VerifiedConnection` (opened lazily, kept for
every step of a task, host key checked before any byte of authentication is sent) and
hands tasks to :class:`~specops.transport.remote_task.RemoteTask`, as Fabric's ``Connection`` hands
``put`` to ``Transfer``:

    >>> host = Host(spec)                       # nothing happens yet
    >>> host.run_task("facts", {})["data"]["python"]["version"]
    '3.11.7'
    >>> Host(spec_with_wrong_key).run_task("facts", {})
    HostKeyError: [gpu-a] host key for [10.0.0.5]:22 differs from known_hosts
      (got SHA256:Q2x..., known SHA256:8fV...)
      hint: if the host was reinstalled, remove the old key: ssh-keygen -R '[10.0.0.5]:22' -f ~/.ssh/known_hosts
"""
from __future__ import annotations

import os
import shlex
import socket
import stat
import threading

import fabric
from invoke.exceptions import CommandTimedOut

from specops.errors import RemoteError, WorkDirError
from specops.inventory import HostSpec, Inventory
from specops.transport.bundle import Bundle
from specops.transport.remote_task import RemoteTask, StdinResult
from specops.transport.render import heredoc_command
from specops.transport.ssh import VerifiedConnection


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
        #: the inventory the host came from (a replica's hosts read their place in it), or None.
        self.inventory = inventory
        self.connection = VerifiedConnection(spec, inventory, accept_new_host_key)
        self._home: str | None = None
        #: bytes of bundle uploaded by this object (0 when the host had the bundle).
        self.bundle_bytes_sent = 0

    # -- connection: specops.transport.ssh ---------------------------------------------------
    @property
    def cxn(self) -> fabric.Connection:
        return self.connection.cxn

    def open(self) -> None:
        """Connect and authenticate; see :meth:`specops.transport.ssh.VerifiedConnection.open`."""
        self.connection.open()

    def close(self) -> None:
        self.connection.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- tasks: specops.transport.remote_task -----------------------------------------------
    def run_task(self, module: str, params: dict, *, sudo: bool = False,
                 timeout: float | None = None, bundle: Bundle | None = None,
                 launcher: list[str] | None = None) -> dict:
        """Run ``remote.<module>.main(params)`` on the host and return its payload.

        One python process per call. The bundle travels only when the host lacks it:
        the entry script exits 75 when it does, and we upload and run once more.

        :param launcher: words the host's python runs under (``srun -p gpu -N1 --``: a compute node's).
        :raises RemoteError: when no result came back (the error carries the exit code
            and the last lines of output).
        """
        return RemoteTask(self, launcher).run(module, params, sudo=sudo, timeout=timeout, bundle=bundle)

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
        return RemoteTask(self).stream(module, params, on_line, prefix=prefix, bundle=bundle,
                                       idle_timeout=idle_timeout)

    def bundle_dir(self, bundle: Bundle) -> str:
        """Where ``bundle`` lives on the host, by its hash."""
        return f"{self.spec.work_dir.rstrip('/')}/bundles/{bundle.digest}"

    # -- shell ---------------------------------------------------------------------
    def run(self, command: str, timeout: float | None = None):
        """Run a shell command: no pty, stdin closed, output captured, never raises on exit code."""
        self.open()
        try:
            return self.cxn.run(command, hide=True, warn=True, pty=False, in_stream=False,
                                timeout=timeout)
        except CommandTimedOut as exc:
            raise RemoteError(f"command timed out after {exc.timeout}s", "raise the timeout",
                              host=self.name) from None

    def run_heredoc(self, command: str, script: str, timeout: float | None = None) -> StdinResult:
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

    # -- SFTP ----------------------------------------------------------------------
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
                try:
                    sftp.mkdir(current)
                except OSError as failure:
                    # another upload (a host sharing this dir) made it between our stat and mkdir;
                    # SFTP answers only "Failure" then, so the dir's existence is the test
                    try:
                        made = stat.S_ISDIR(sftp.stat(current).st_mode)
                    except OSError:
                        made = False
                    if not made:
                        raise failure

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

    def put_in_work_dir(self, data: bytes, path: str) -> None:
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

