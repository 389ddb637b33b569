"""The remote-task protocol: render the entry script, bring the bundle, run it, read the result.

``host.run_task("facts", {})`` runs ``remote.system.facts.main({})`` in the host's python and
returns its payload; :class:`RemoteTask` is what does it, over a host's (:class:`TaskHost`)
shell and SFTP (as Fabric's ``Transfer`` works over a ``Connection``):

    >>> RemoteTask(host).run("facts", {})["data"]["python"]["version"]
    '3.11.7'
    >>> RemoteTask(host_with_python_3_8).run("facts", {})
    PythonTooOldError: [gpu-a] python '/usr/bin/python3' on the host is python 3.8.10; specops needs python >= 3.10 there

The entry script first looks for the bundle by its hash; only when the host lacks it is
it uploaded (SFTP) or embedded (heredoc delivery), and the script run once more. The
markers and exit codes both sides read come from ``remote/wire/protocol.py``.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import shlex
import socket
import threading
import time
from typing import Protocol

from specops import wire
from specops.errors import PythonTooOldError, RemoteError, UnreachableError, UsageError, WorkDirError
from specops.transport.bundle import Bundle, build_bundle
from specops.transport.render import heredoc_command, render_entry


class TaskHost(Protocol):
    """What a task needs of its host (:class:`specops.transport.host.Host` is one): its name and inventory
    entry, a shell (``run``, ``run_heredoc``), SFTP into the work dir, and the connection for streams."""

    name: str
    spec: object
    cxn: object
    bundle_bytes_sent: int

    def open(self) -> None: ...
    def run(self, command: str, timeout=None): ...
    def run_heredoc(self, command: str, script: str, timeout=None): ...
    def put_in_work_dir(self, data: bytes, path: str) -> None: ...
    def remote_path(self, path: str) -> str: ...
    def bundle_dir(self, bundle: Bundle) -> str: ...

_bundle_lock = threading.Lock()
_bundle_cache: dict[str, Bundle] = {}


def current_bundle() -> Bundle:
    """The bundle of this install's ``remote/``, built once per process."""
    with _bundle_lock:
        if "repo" not in _bundle_cache:
            _bundle_cache["repo"] = build_bundle()
        return _bundle_cache["repo"]


class StdinResult:
    """The part of invoke's Result we use, for commands run with data on stdin."""

    def __init__(self, stdout: str, stderr: str, exited: int):
        self.stdout, self.stderr, self.exited = stdout, stderr, exited

    @property
    def ok(self) -> bool:
        return self.exited == 0


def shell_word(word: str) -> str:
    """Quote ``word`` for sh; a leading ``~/`` becomes ``"$HOME"/`` so it still expands."""
    if word.startswith("~/"):
        return '"$HOME"/' + shlex.quote(word[2:])
    return shlex.quote(word)


def needs_bundle(result) -> bool:
    """The entry script's answer for "upload the bundle and run me again" (remote/wire/protocol.py)."""
    protocol = wire.protocol
    return result.exited == protocol.NEED_BUNDLE_EXIT and protocol.NEED_BUNDLE_MARKER in result.stdout


class RemoteTask:
    """Runs ``remote.<module>.main(params)`` on one host, one python process per call.

    :param host: the host whose shell, SFTP and inventory entry carry the task.
    """

    def __init__(self, host: TaskHost, launcher: list[str] | None = None):
        """:param launcher: words the python command runs under (``srun ... --`` on a host behind Slurm)."""
        self.host = host
        self.spec = host.spec
        self.launcher = list(launcher or [])

    def run(self, module: str, params: dict, *, sudo: bool = False,
            timeout: float | None = None, bundle: Bundle | None = None) -> dict:
        """See :meth:`specops.transport.host.Host.run_task`."""
        return self._run_entry(module, params, bundle,
                               lambda script: self.exec_script(script, sudo=sudo, timeout=timeout))

    def stream(self, module: str, params: dict, on_line, *, prefix: str,
               bundle: Bundle | None = None, idle_timeout: float | None = None) -> dict:
        """See :meth:`specops.transport.host.Host.stream_task`."""
        return self._run_entry(module, params, bundle,
                               lambda script: self._stream_script(script, on_line, prefix, idle_timeout))

    # -- the python command and the script's delivery ----------------------------
    def python_command(self, *args: str, sudo: bool = False) -> str:
        """The shell command that runs the inventory's python with ``args``, every word quoted.

        :raises UsageError: for a ``python`` that starts with ``-`` (sudo or the
            interpreter would read it as an option; the inventory refuses it too).
        """
        if self.spec.python.startswith("-"):
            raise UsageError(f"python {self.spec.python!r} starts with '-' and would be read as an option",
                             "set 'python' in the inventory to the interpreter's path", host=self.host.name)
        words = [*self.launcher, self.spec.python, *args]
        prefix = "sudo -n -- " if sudo else ""
        return prefix + " ".join(shell_word(w) for w in words)

    def _upload_script(self, script: str, *, sudo: bool = False) -> str:
        """Put ``script`` in ``work_dir/scripts`` and return the command that runs it, then deletes it."""
        # unique per call: two calls with the same script must not delete each other's file
        name = f"entry-{hashlib.sha256(script.encode()).hexdigest()[:12]}-{secrets.token_hex(4)}.py"
        path = self.host.remote_path(f"{self.spec.work_dir.rstrip('/')}/scripts/{name}")
        self.host.put_in_work_dir(script.encode(), path)
        return f"{self.python_command(path, sudo=sudo)}; rc=$?; rm -f -- {shlex.quote(path)}; exit $rc"

    def exec_script(self, script: str, *, sudo: bool = False, timeout: float | None = None):
        """Run a python script on the host by the inventory's delivery, return the invoke Result."""
        if self.spec.delivery == "heredoc":
            return self.host.run_heredoc(self.python_command("-", sudo=sudo), script, timeout)
        self.host.open()
        return self.host.run(self._upload_script(script, sudo=sudo), timeout)

    def push_bundle(self, bundle: Bundle) -> None:
        """Upload the bundle zip next to its dir; the entry script unpacks and verifies it."""
        self.host.put_in_work_dir(bundle.data, self.host.remote_path(self.host.bundle_dir(bundle)) + ".zip")
        self.host.bundle_bytes_sent += bundle.size

    def _run_entry(self, module: str, params: dict, bundle: Bundle | None, execute) -> dict:
        """Run ``module``'s entry script with ``execute``; send the bundle and retry once if the host lacks it.

        The first try carries no bundle (the common case: the host has it by hash); the
        entry script answers "need bundle" when it does not, and the second try brings it
        over SFTP, or inside the heredoc for hosts without SFTP. ``params`` go as they are: the
        task checks them against its declared spec on the host (``remote/wire/argspec.py``).
        """
        bundle = bundle or current_bundle()
        params = {**params, "_bundle_dir": self.host.bundle_dir(bundle)}
        result = execute(render_entry(module, params))
        if needs_bundle(result):
            if self.spec.delivery == "heredoc":
                script = render_entry(module, params, bundle_zip=bundle.data)
                self.host.bundle_bytes_sent += bundle.size
            else:
                self.push_bundle(bundle)
                script = render_entry(module, params)
            result = execute(script)
        return self.parse(module, result)

    # -- the result ---------------------------------------------------------------
    def parse(self, module: str, result) -> dict:
        """The task's payload from its output, or the error that says why there is none."""
        out = result.stdout
        protocol = wire.protocol  # the markers come from the file the host side prints them with
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
                          host=self.host.name, exited=result.exited, output_tail=tail[-3000:])

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
                host=self.host.name, found=found, needed=needed)
        if facts.get("kind") == "work-dir":
            return WorkDirError(
                f"work_dir {self.spec.work_dir!r} is not usable on the host: cannot unpack into "
                f"{facts.get('path')}: {facts.get('error')}",
                "set 'work_dir' in the inventory to a directory the ssh user can create and write "
                "(the default is ~/.specops)", host=self.host.name, path=str(facts.get("path")))
        return RemoteError(f"the entry script stopped early: {line[:200]}",
                           "report this as a specops bug (the marker line is not one this version knows)",
                           host=self.host.name)

    # -- streaming: one long-lived python whose stdout is read as it comes --------
    def _stream_script(self, script: str, on_line, prefix: str, idle_timeout: float | None) -> StdinResult:
        host = self.host
        host.open()
        stdin = None
        if self.spec.delivery == "heredoc":
            command, stdin = "sh -s", heredoc_command(self.python_command("-"), script).encode()
        else:
            command = self._upload_script(script)
        chan = host.cxn.transport.open_session(timeout=self.spec.connect_timeout)
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
                            host=host.name)
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
            if exited == -1 and not host.cxn.transport.is_active():
                raise UnreachableError("the connection to the host dropped while streaming",
                                       "a detached run goes on; follow it again once the host answers",
                                       host=host.name)
        finally:
            chan.close()
        return StdinResult("\n".join(kept), err.decode("utf-8", "replace"), exited)
