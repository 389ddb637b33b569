"""Bad input and hostile hosts: one clear error, an exit code from the table, never a traceback.

Each class of mistake is tried against the real test host (a real sshd on loopback):

1. a ``work_dir`` the host cannot create (under /proc, through a file, on a read-only
   mount) -> exit 1 naming ``work_dir``, the path and the host's own reason; one that no
   host could ever accept (200 KB, a 300-byte component) -> exit 3 before connecting;
2. a python too old for the host code -> exit 1 naming the version found and the one
   needed. No python 2.7 or 3.6 can be installed here (Debian 12 ships neither, and PyPI
   has no interpreters), so the preamble is proven twice instead: it parses under the
   3.4 grammar and the python 2 grammar, and a real interpreter takes the real "too old"
   path over real SSH when the call raises the minimum to 3.99 (the ``_python_min`` test
   hook, which the entry preamble reads; no override in the laptop's code);
3. an endpoint that accepts TCP but is not sshd (silent, closes at once, another
   protocol) -> exit 2, one message saying what was reached and what it did;
4. values the inventory must refuse (NUL in env, booleans for ints, ``~user``, a python
   that looks like an option, an env string over Linux's MAX_ARG_STRLEN) and the same
   through CLI flags -> exit 3 naming the field.
"""
from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

import specops.transport.host
from specops.errors import InventoryError, PythonTooOldError
from specops.exit_codes import ExitCode
from specops.facts import facts
from specops.inventory import MAX_ARG_STRLEN, load_inventory
from specops.transport.render import render_entry

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def cli(*args, timeout=120):
    """The installed ``specops`` program, as a user runs it."""
    return subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def assert_clean(text):
    """No python or paramiko traceback reached the user."""
    assert "Traceback" not in text and "Exception (client)" not in text, text


# -- 1. work_dir ------------------------------------------------------------------

@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only tmpfs (needs root, as CI and the dev machines run)."""
    target = tmp_path / "ro"
    target.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "specops-test-ro", str(target)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"NOT TESTED: the read-only-mount case needs root to mount a tmpfs "
                    f"({mount.stderr.strip() or mount.returncode})")
    yield target
    subprocess.run(["umount", str(target)], check=True)


def unusable_work_dir(case, tmp_path, request):
    """(work_dir, the host's reason) for one way a work_dir cannot be made."""
    if case == "under /proc":
        return f"/proc/specops-{os.getpid()}/work", "No such file or directory"
    if case == "through a file":
        a_file = tmp_path / "a-file"
        a_file.write_text("not a directory\n")
        return f"{a_file}/work", "Not a directory"
    return f"{request.getfixturevalue('read_only_dir')}/work", "Read-only file system"


@pytest.mark.parametrize("delivery", ["sftp", "heredoc"])
@pytest.mark.parametrize("case", ["under /proc", "through a file", "read-only mount"])
def test_work_dir_that_cannot_be_created_names_field_path_and_reason(make_inventory, tmp_path, request,
                                                                     case, delivery):
    work_dir, reason = unusable_work_dir(case, tmp_path, request)
    (report,) = facts(load_inventory(make_inventory(work_dir=work_dir, delivery=delivery)), None)
    assert report.exit_code == ExitCode.FAILED, report.error
    assert f"work_dir {work_dir!r} is not usable on the host" in report.error
    assert reason in report.error, report.error
    assert "hint: set 'work_dir' in the inventory" in report.error
    assert_clean(report.error)


def test_work_dir_error_through_the_cli(make_inventory):
    proc = cli("facts", "--inventory", str(make_inventory(work_dir="/proc/specops-cli/work")))
    assert proc.returncode == ExitCode.FAILED, proc.stdout + proc.stderr
    assert "work_dir '/proc/specops-cli/work' is not usable" in proc.stdout
    assert_clean(proc.stdout + proc.stderr)


@pytest.mark.parametrize("work_dir, words", [
    ("/tmp/" + "a" * 200_000, ["field 'work_dir'", "200,005 bytes", "PATH_MAX", "(200,005 characters)"]),
    ("/tmp/" + "b" * 300 + "/w", ["field 'work_dir'", "300-byte component", "NAME_MAX"]),
])
def test_work_dir_no_host_accepts_is_a_usage_error(make_inventory, work_dir, words):
    path = make_inventory(work_dir=work_dir)
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert err.value.code == ExitCode.USAGE
    text = str(err.value)
    for word in words:
        assert word in text
    assert len(text) < 1000  # the 200 KB value is not echoed back whole
    proc = cli("facts", "--inventory", str(path))
    assert proc.returncode == ExitCode.USAGE and "field 'work_dir'" in proc.stderr
    assert_clean(proc.stderr)


# -- 2. a python too old ----------------------------------------------------------

PY3_ONLY = (ast.AnnAssign, ast.JoinedStr, ast.NamedExpr, ast.Nonlocal, ast.YieldFrom, ast.Await,
            ast.AsyncFunctionDef, ast.MatMult)


def preamble_of(script):
    return script[:script.index("\nENTRY = ")]


def test_preamble_parses_on_old_pythons():
    script = render_entry("facts", {"_bundle_dir": "/nowhere", "value": "it's \"quoted\" <&>"},
                          bundle_zip=b"PK-not-really")
    # python 3.4's grammar: no f-strings, no walrus, no async; the modern code is only a string
    tree = ast.parse(script, feature_version=(3, 4))
    preamble = ast.parse(preamble_of(script), feature_version=(3, 4))
    for node in ast.walk(preamble):
        assert not isinstance(node, PY3_ONLY), f"python 2 cannot parse {ast.dump(node)[:80]}"
        if isinstance(node, ast.arguments):
            assert not node.kwonlyargs and all(a.annotation is None for a in node.args + node.kwonlyargs)
        if isinstance(node, ast.FunctionDef):
            assert node.returns is None
    # python 2's grammar (print statement, exec statement): lib2to3 ships it with python <= 3.12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        lib2to3 = pytest.importorskip("lib2to3.pgen2.driver", reason="lib2to3 left python in 3.13")
        from lib2to3 import pygram, pytree
    lib2to3.Driver(pygram.python_grammar, convert=pytree.convert).parse_string(script)
    # and the entry code itself is exactly what runs after the check
    entry = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ENTRY")
    compile(entry.value.value, "<entry>", "exec")


@pytest.mark.parametrize("delivery", ["sftp", "heredoc"])
def test_python_too_old_says_found_and_needed(make_inventory, tmp_path, delivery, hostenv_python):
    found = subprocess.run([str(hostenv_python), "-c", "import platform; print(platform.python_version())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    too_old = {"_python_min": [3, 99]}  # the preamble's test hook (remote/wire/argspec.py)
    inv = load_inventory(make_inventory(delivery=delivery, work_dir=str(tmp_path / "fresh")))
    with pytest.raises(PythonTooOldError) as err:
        with specops.transport.host.Host(inv.hosts["th"], inv) as host:
            host.run_task("facts", dict(too_old))
    assert err.value.found == found and err.value.needed == "3.99"
    assert f"is python {found}; specops needs python >= 3.99" in str(err.value)
    assert "hint: set 'python' in the inventory" in str(err.value)
    assert err.value.code == ExitCode.FAILED
    assert not (tmp_path / "fresh" / "bundles").exists()  # refused before any bundle was unpacked

    (report,) = facts(inv, None, extra=too_old)
    assert report.exit_code == ExitCode.FAILED and "needs python >= 3.99" in report.error
    assert_clean(report.error)


def test_python_that_looks_like_an_option_is_refused(make_inventory):
    path = make_inventory(python="--version")
    with pytest.raises(InventoryError, match=r"field 'python': must be a path or a command name, not an option"):
        load_inventory(path)
    proc = cli("facts", "--inventory", str(path))
    assert proc.returncode == ExitCode.USAGE and "field 'python'" in proc.stderr


def test_python_path_is_quoted_on_the_command_line(make_inventory, tmp_path, hostenv_python):
    marker = Path.home() / f"specops-pwned-{os.getpid()}"  # where `touch NAME` would land over ssh
    odd_dir = tmp_path / f"env it's $(touch {marker.name}) `touch {marker.name}` -n"
    odd_dir.mkdir()
    (odd_dir / "python").symlink_to(hostenv_python)
    for delivery in ("sftp", "heredoc"):
        (report,) = facts(load_inventory(make_inventory(python=str(odd_dir / "python"), delivery=delivery)),
                          None)
        assert report.error is None, report.error
        assert not marker.exists()


# -- 3. endpoints that are not sshd ------------------------------------------------

class NotSshd:
    """A loopback TCP server the test owns, that accepts and then misbehaves one way.

    ``silent`` holds the connection and says nothing; ``close`` hangs up at once;
    ``http`` answers like a web server and closes; ``smtp`` greets like a mail server
    and then waits.
    """

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            if self.behaviour == "close":
                conn.close()
            elif self.behaviour == "http":
                conn.settimeout(5)
                try:
                    conn.recv(4096)  # the client's banner: read it, so closing sends FIN, not RST
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(4096):
                        pass
                except OSError:
                    pass
                conn.close()
            elif self.behaviour == "smtp":
                conn.sendall(b"220 mail.example.org ESMTP ready\r\n")
                self.held.append(conn)
            else:
                self.held.append(conn)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for conn in [*self.held, self.server]:
            conn.close()


@pytest.mark.parametrize("behaviour, says", [
    ("silent", "accepted the TCP connection but sent no SSH banner within 2s"),
    ("close", "accepted the TCP connection, then closed it without sending an SSH banner"),
    ("http", "answered 'HTTP/1.1 400 Bad Request' instead of an SSH banner, then closed the connection"),
    ("smtp", "answered '220 mail.example.org ESMTP ready' instead of an SSH banner"),
])
def test_endpoint_that_is_not_sshd_is_one_clear_error(make_inventory, behaviour, says):
    endpoint = NotSshd(behaviour)
    try:
        path = make_inventory(port=endpoint.port, connect_timeout=2)
        proc = cli("facts", "--inventory", str(path), timeout=60)
    finally:
        endpoint.close()
    assert proc.returncode == ExitCode.UNREACHABLE, proc.stdout + proc.stderr
    message = " ".join(proc.stdout.split())  # the table wraps long lines
    assert f"[th] 127.0.0.1:{endpoint.port} {says}" in message
    assert "hint:" in message and "'port'" in message
    assert "No existing session" not in message
    assert_clean(proc.stdout + proc.stderr)
    assert proc.stderr.strip() == ""  # paramiko printed nothing of its own


# -- 4. values the inventory must refuse -----------------------------------------

@pytest.mark.parametrize("fields, words", [
    ({"env": {"OK": "1", "BAD": "a\0b"}}, ["field 'env.BAD'", "NUL byte"]),
    ({"env": {"HUGE": "x" * 200_000}}, ["field 'env.HUGE'", "200,006 bytes", "MAX_ARG_STRLEN",
                                         "Argument list too long"]),
    ({"tp": True}, ["field 'tp'", "valid integer", "(got True)"]),
    ({"layer_ids": [True, 2]}, ["field 'layer_ids.0'", "valid integer"]),
    ({"port": True}, ["field 'port'", "valid integer"]),
    ({"gpu_memory_utilization": True}, ["field 'gpu_memory_utilization'", "valid number"]),
    ({"work_dir": "~nobody/w"}, ["field 'work_dir'", "'~user' paths are not supported"]),
    ({"python": "~nobody/bin/python"}, ["field 'python'", "'~user' paths are not supported"]),
    ({"dataset": "/data/a\0b"}, ["field 'dataset'", "NUL byte"]),
])
def test_inventory_refuses_with_the_field_named(make_inventory, fields, words):
    path = make_inventory(**fields)
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert err.value.code == ExitCode.USAGE
    text = str(err.value)
    for word in words:
        assert word in text, text
    assert len(text) < 1000


def test_nul_and_huge_env_through_the_cli(make_inventory):
    for env, field in (({"A": "x\0y"}, "env.A"), ({"BIG": "y" * 200_000}, "env.BIG")):
        proc = cli("preflight", "--inventory", str(make_inventory(env=env)))
        assert proc.returncode == ExitCode.USAGE, proc.stderr
        assert f"field '{field}'" in proc.stderr
        assert_clean(proc.stderr)


def test_env_at_the_linux_limit_arrives_and_one_byte_more_is_refused(make_inventory, hostenv_python):
    name = "SPECOPS_BIG"
    fits = "v" * (MAX_ARG_STRLEN - len(name) - 2)  # NAME=value and its NUL: exactly MAX_ARG_STRLEN
    (report,) = facts(load_inventory(make_inventory(env={name: fits})), None)
    assert report.error is None, report.error[:300]
    assert report.data["env_seen"][name] == fits
    with pytest.raises(InventoryError, match=f"field 'env.{name}'"):
        load_inventory(make_inventory(env={name: fits + "v"}))
    # the constant is Linux's: on the host, exec takes the first and refuses the second
    probe = ("import os, subprocess, sys\n"
             "for size in (int(a) for a in sys.argv[1:]):\n"
             "    try:\n"
             "        subprocess.run(['/bin/true'], env={'SPECOPS_BIG': 'v' * size}, check=True)\n"
             "        print('ok')\n"
             "    except OSError as exc:\n"
             "        print(exc.errno)\n")
    out = subprocess.run([str(hostenv_python), "-c", probe, str(len(fits)), str(len(fits) + 1)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ok", "7"]  # 7 = E2BIG, "Argument list too long"


@pytest.mark.parametrize("flags, words", [
    # the table's words (RUN_ARGS in remote/wire/argspec.py), as the host would say them
    (["--tp", "true"], "--tp 'true' must be an integer"),
    (["--tp", "2.5"], "--tp '2.5' must be an integer"),
    (["--tp", "0"], "--tp '0' must be at least 1 hint: give --tp a value at least 1"),
    (["--layer-ids", "true,2"], "--layer-ids 'true,2' is not a comma-separated list of integers"),
    # int() takes fullwidth digits and underscores; a layer id is ASCII digits, quoted as typed
    (["--layer-ids", "\uff12,\uff14"], "--layer-ids '\uff12,\uff14' is not a comma-separated list of integers "
                                   "('\uff12' is not a layer id: ASCII digits only)"),
    (["--layer-ids", "output:2_0"], "--layer-ids 'output:2_0' is not a comma-separated list of integers "
                                    "('2_0' is not a layer id: ASCII digits only)"),
    (["--layer-ids", " , "], "--layer-ids ' , ' is not a comma-separated list of integers (it names no layer id)"),
    (["--model", "/m/" + "c" * 300], "--model"),
    (["--tp"], "needed value and was not given one"),
])
def test_cli_flags_feeding_the_same_params_are_usage_errors(make_inventory, flags, words):
    proc = cli("preflight", "--inventory", str(make_inventory()), "--skip-autoconfig", *flags)
    assert proc.returncode == ExitCode.USAGE, proc.stdout + proc.stderr
    assert words in " ".join((proc.stdout + proc.stderr).split())
    assert_clean(proc.stdout + proc.stderr)


def test_step_timeout_has_one_meaning_and_refuses_what_is_no_number(monkeypatch):
    """``SPECOPS_STEP_TIMEOUT`` replaces every built-in step limit (a group run's quick steps too) and
    leaves the steps that bound themselves unbounded; a value that is no number is a usage error."""
    from specops.errors import UsageError
    from specops.transport.parallel import STEP_TIMEOUT_ENV, TASK_TIMEOUTS, step_timeout

    monkeypatch.delenv(STEP_TIMEOUT_ENV, raising=False)
    assert [step_timeout(t) for t in ("facts", "quick", "smoke")] == [TASK_TIMEOUTS["facts"], 180.0, 0.0]
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "20")
    assert [step_timeout(t) for t in ("facts", "preflight", "quick", "smoke", "fetch")] == [20.0] * 3 + [0.0] * 2
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv(STEP_TIMEOUT_ENV, bad)
        with pytest.raises(UsageError, match=f"{STEP_TIMEOUT_ENV}='{bad}' is not a number of seconds"):
            step_timeout("facts")
