"""The server's process: start, readiness, requests, stop, and the survivors of a stop.

:class:`VllmServer` runs one server in a process group of its own, told to die with
its parent (:func:`die_with_parent`), with a marker in its environment that every
process vLLM starts inherits, so :meth:`VllmServer.stop` can end them all -- the ones
that left the group too (:func:`leftover_pids`) -- without touching the caller.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from remote.system import procscan, signals

from .command import (LOOPBACK, MARKER_ENV, cuda_available, free_port, pick_connector, rank_in_engine_core,
                      server_command, server_env)
from .logs import SERVER_LOG, ServerFailed, log_death, log_failure, read_tail, split_rank_logs


def leftover_pids(marker: str) -> list[int]:
    """Live processes (of this user, readable in /proc) whose environment carries ``marker``."""
    return procscan.live_pids(env_any={f"{MARKER_ENV}={marker}".encode()})


#: Runs first in the server's process, then becomes the server with ``execv``: it asks
#: Linux for SIGTERM when the parent (the caller of :meth:`VllmServer.start`) dies --
#: the request survives exec -- and gives up if that parent is already gone. Done in a
#: tiny program rather than a ``preexec_fn``, which is unsafe in a threaded parent.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('specops: the process that started the vLLM server is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: list[str], python: str) -> list[str]:
    """``argv`` wrapped so that the process gets SIGTERM when this process dies (Linux).

    Linux sends it when the *thread* that started the child ends, so start the server
    from a thread that lives as long as the run (the supervisor's main thread).
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [str(python), "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]



class VllmServer:
    """One vLLM OpenAI server with hidden-state extraction, on loopback, owned by this process.

    :param python: the interpreter that runs the server (the host env's).
    :param work_dir: run-scoped dir: ``storage/`` (the connector's files, same
        filesystem as the output so a finished file is *renamed* into place) and
        ``logs/server.log``.
    """

    def __init__(self, model_path, *, tp: int, layer_ids, work_dir, max_model_len: int,
                 params: dict | None = None, python: str = sys.executable, devices: list[int] | None = None,
                 replica: str | None = None):
        self.model_path = str(model_path)
        self.tp = int(tp)
        self.layer_ids = list(layer_ids)
        self.params = dict(params or {})
        self.python = python
        self.work_dir = Path(work_dir)
        #: a data-parallel replica's devices (GPU ids, or CPU cores) and name (``dp1``); None: the host's own
        self.devices = list(devices) if devices is not None else None
        self.replica = replica
        # a data-parallel replica's files and log in a dir of its own (logs/dp1/server.log)
        self.storage_dir = self.work_dir / "storage" / (replica or "")
        self.log_dir = self.work_dir / "logs" / (replica or "")
        self.log_path = self.log_dir / SERVER_LOG
        self.max_model_len = int(max_model_len)
        self.marker = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.connector: tuple[str, str | None] | None = None
        self.command: list[str] = []
        self.started_at: float | None = None
        #: whether rank 0 runs inside the engine core process (:func:`~.command.rank_in_engine_core`)
        self.rank_in_engine_core = False
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        host = str(self.params.get("bind_host") or LOOPBACK)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def headless(self) -> bool:
        """A worker host of a replica: its ranks join the head's server; no API of its own."""
        return int((self.params.get("replica") or {}).get("node_rank") or 0) > 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server process (returns at once; :meth:`wait_ready` waits for it)."""
        if self.alive:
            raise RuntimeError(f"server already running (pid {self.proc.pid})")
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.connector = self.connector or pick_connector(self.params)
        device = str(self.params.get("device") or "").lower()
        on_cpu = device == "cpu" if device else not cuda_available()
        self.port = int(self.params.get("port") or free_port())
        pinned = server_env(os.environ, marker=self.marker, tp=self.tp, on_cpu=on_cpu,
                            replica=self.params.get("replica"), devices=self.devices)
        self.rank_in_engine_core = rank_in_engine_core(self.params, pinned, tp=self.tp, on_cpu=on_cpu,
                                                       devices=self.devices)
        self.command = server_command(self.python, self.model_path, port=self.port, tp=self.tp,
                                      layer_ids=self.layer_ids, storage_dir=self.storage_dir,
                                      connector=self.connector, max_model_len=self.max_model_len,
                                      params={**self.params, "rank_in_engine_core": self.rank_in_engine_core})
        env = server_env(os.environ, marker=self.marker, tp=self.tp, on_cpu=on_cpu, replica=self.params.get("replica"),
                         devices=self.devices, rank_in_engine_core=self.rank_in_engine_core)
        with open(self.log_path, "ab") as log:
            log.write(f"# specops: {' '.join(self.command)}\n".encode())
            log.flush()
            argv = self.command
            if self.params.get("die_with_parent", True):
                argv = die_with_parent(argv, self.python)
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.work_dir),
                                         # own_session False: the caller's process group, so killing that
                                         # group takes the server's retitled ranks too (a replica's worker host)
                                         start_new_session=bool(self.params.get("own_session", True)))
        self.started_at = time.monotonic()

    def failure(self, summary: str) -> ServerFailed:
        """A :class:`ServerFailed` carrying what the log says went wrong, and who died of what.

        The API server is our child: a signal that ended it comes from ``waitpid`` and
        is the cause (its engine core and workers go down after it). Otherwise the first
        death by a signal vLLM logged (a worker's), then a vanished engine core when no
        process raised anything.
        """
        tail = read_tail(self.log_path)
        found = log_failure(tail, self.rank_in_engine_core)
        death = self.own_death() or log_death(tail, self.rank_in_engine_core)
        if death and death["exit_code"] is None and found and found.get("exception") \
                and "EngineDeadError" not in found["exception"]:
            death = None  # the engine core raised before it went: its exception says more
        failed = ServerFailed(summary if self.replica is None else f"{self.replica}: {summary}", self.log_path,
                              found, tail[-4000:], death=death)
        failed.replica = self.replica
        return failed

    def own_death(self) -> dict | None:
        """The API server's own end by a signal, as ``waitpid`` tells it (None while it runs or exited)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None or not signals.describe_exit(code)["signal"]:
            return None
        return {"name": "APIServer", "pid": self.proc.pid, "exit_code": code, "source": "waitpid"}

    def log_size(self) -> int:
        """The server log's size now: :meth:`failed_since` reads only what came after it."""
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def failed_since(self, offset: int) -> dict | None:
        """The exception the server logged after byte ``offset`` (a worker's, e.g. its connector's writer,
        while the API server still answers), or None. Only what came after: a traceback logged at start-up
        (an optional import) is never taken for a request's cause."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(max(offset, os.path.getsize(self.log_path) - (1 << 20)))
                text = handle.read().decode("utf-8", "replace")
        except OSError:
            return None
        found = log_failure(text, self.rank_in_engine_core)
        return found if found and found.get("exception") else None

    def death_in_log(self) -> bool:
        """Whether the server's log tells of a process that died (a request may fail first)."""
        return log_death(read_tail(self.log_path), self.rank_in_engine_core) is not None

    def wait_ready(self, timeout: float = 900.0, poll_s: float = 0.5) -> float:
        """Poll ``/health`` until it answers 200; return the seconds since :meth:`start`.

        :raises ServerFailed: at once when the process exits (with the exception its log
            names), or after ``timeout`` seconds (the server is then stopped).
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.failure(f"vLLM server exited with code {code} before it was ready")
            if self.headless:  # no API here: the head's server says when the replica is ready
                self.ready_after_s = time.monotonic() - self.started_at
                return self.ready_after_s
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            if time.monotonic() > deadline:
                error = self.failure(f"vLLM server not ready after {timeout:.0f} s")
                self.stop()
                raise error
            time.sleep(poll_s)

    def post_json(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST ``body`` as JSON; the decoded reply. HTTP errors raise with vLLM's own message."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")[:2000]
            if exc.code >= 500:
                # "EngineCore encountered an issue" says nothing; the engine's own exception is in the log
                time.sleep(1.0)  # the dying engine flushes its traceback
                tail = read_tail(self.log_path)
                failure = log_failure(tail)
                if (failure and failure.get("exception")) or log_death(tail, self.rank_in_engine_core) or self.own_death():
                    raise self.failure(f"POST {path}: HTTP {exc.code} from the server") from None
            raise RuntimeError(f"POST {path}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
            if not self.alive:
                raise self.failure(f"vLLM server died during POST {path}") from exc
            raise

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """End the server and everything it started; split its log per rank.

        SIGTERM to the API server alone (it shuts its engine core and workers down in
        order; a signal to the whole group would kill the engine under it and log a
        spurious ``EngineDeadError``), SIGKILL to the process group after ``grace_s``,
        then to any process still carrying this server's marker.
        :returns: the pids that had to be killed outright.
        """
        killed = []
        if self.proc is not None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while True:
            pids = leftover_pids(self.marker)
            if not pids or time.monotonic() > deadline:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        split_rank_logs(self.log_path, self.log_dir, self.rank_in_engine_core)
        return sorted(set(killed))
