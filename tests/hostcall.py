"""Host calls for the tests: ``remote.*`` functions run in a host env's python that stays up.

The tests run host code (``remote.probes.preflight.main``, ``remote.patcher.main``,
``remote.drift.main``, the dataset readers) in the test host's own python, as a host
does. Starting that python and importing ``remote`` (and, for the readers, transformers)
cost more than most calls, so one process per env python and bundle answers every call
of a test session, one call at a time, each as a fresh one-shot process would run it:

- the process environment is exactly the one the call asks for (``env``, by default
  the controller's own ``os.environ`` at the call), set afresh for each call;
- the working directory is the bundle, and ``sys.path`` starts with it;
- the answer is the JSON of the function's return value (``default=str``), as the
  one-shot runners printed it; an exception comes back as its traceback, and fails
  the calling test.

A call whose env changes what only an interpreter's start reads (``PYTHON*``,
``LD_*``) gets a one-shot process instead. ``remote`` writes neither ``os.environ`` nor
``sys.path`` in these calls, and its one per-process cache (drift's parsed trees) is keyed
by path, size and mtime, so a long-lived process answers what a fresh one would; only the
CPU time of a first, cold call differs, and a test that measures it runs one-shot.

Stdlib only: this file is imported by the controller's tests and run, as the server,
by the host env's python (``python hostcall.py BUNDLE``).
"""
from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the environment keys only an interpreter's start reads: a call that changes one gets its own process
STARTUP_KEYS = ("PYTHON", "LD_")


def _startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_KEYS)}


# ----------------------------------------------------------------------------- the host side

def _resolve(request: dict):
    if "code" in request:  # a test's own function: its text defines main(*args)
        namespace = {"__name__": "hostcall_case"}
        exec(compile(request["code"], "<hostcall case>", "exec"), namespace)
        return namespace["main"]
    import importlib

    module, _, name = request["func"].partition(":")
    return getattr(importlib.import_module(module), name)


def serve(bundle: str) -> None:
    """Answer one JSON request per stdin line with one JSON line on the answer pipe (the
    original stdout); whatever the calls print goes to stderr."""
    sys.path[0] = bundle  # where `python -c ...` run from the bundle has its '' (the script's own dir otherwise)
    os.chdir(bundle)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        os.environ.clear()
        os.environ.update(request["env"])
        try:
            answer = {"result": _resolve(request)(*request["args"])}
        except BaseException:  # the caller's test fails with it; the server goes on
            answer = {"error": traceback.format_exc()}
        finally:
            os.chdir(bundle)
        try:
            text = json.dumps(answer, default=str)
        except (TypeError, ValueError):
            text = json.dumps({"error": traceback.format_exc()})
        answers.write(text + "\n")
        answers.flush()


# ----------------------------------------------------------------------------- the test side

class HostCallError(AssertionError):
    """A host call raised, died or timed out; the message has its traceback or the server's stderr tail."""


class _Server:
    def __init__(self, python: Path, bundle: Path, env: dict):
        self.startup = _startup_env(env)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), str(bundle)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     cwd=str(bundle), env=env)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.buffer = b""

    def stderr_tail(self, chars: int = 4000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-chars:]

    def ask(self, request: dict, timeout: float) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self.selector.select(left):
                self.close()
                raise HostCallError(f"no answer in {timeout} s; stderr tail:\n{self.stderr_tail()}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                self.close()
                raise HostCallError(f"the host python exited (rc {self.proc.returncode}); "
                                    f"stderr tail:\n{self.stderr_tail()}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict = {}


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def _one_shot(python: Path, request: dict, bundle: Path, timeout: float) -> dict:
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), str(bundle)],
                          input=json.dumps(request) + "\n", capture_output=True, text=True,
                          cwd=str(bundle), env=request["env"], timeout=timeout)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines:
        raise HostCallError(f"rc {proc.returncode}; stderr tail:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def _ask(python, request: dict, bundle, timeout: float):
    python, bundle = Path(python), Path(bundle)
    key = (str(python), str(bundle))
    server = _SERVERS.get(key)
    if server is not None and server.proc.poll() is not None:  # died since its last answer
        server.close()
        server = _SERVERS.pop(key)
    if key not in _SERVERS:
        _SERVERS[key] = _Server(python, bundle, request["env"])
    server = _SERVERS[key]
    if server.startup != _startup_env(request["env"]):
        answer = _one_shot(python, request, bundle, timeout)
    else:
        try:
            answer = server.ask(request, timeout)
        except HostCallError:
            _SERVERS.pop(key, None)
            raise
    if "error" in answer:
        raise HostCallError(answer["error"])
    return answer["result"]


def call(python, func: str, *args, env: dict | None = None, bundle=REPO, timeout: float = 240):
    """``func(*args)`` (``"module:function"``, imported from the bundle) in ``python``; its JSON result.

    :param env: the process environment of the call (default: this process's ``os.environ``)
    :raises HostCallError: the function raised (its traceback), or the process died or timed out
    """
    request = {"func": func, "args": list(args), "env": dict(os.environ if env is None else env)}
    return _ask(python, request, bundle, timeout)


def run_code(python, code: str, *args, env: dict | None = None, bundle=REPO, timeout: float = 240):
    """:func:`call` for a test's own host code: ``code`` defines ``main(*args)``."""
    request = {"code": code, "args": list(args), "env": dict(os.environ if env is None else env)}
    return _ask(python, request, bundle, timeout)


if __name__ == "__main__":
    serve(sys.argv[1])
