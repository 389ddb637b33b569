"""Who holds a TCP port, and which ports the kernel hands to outgoing connections (Linux).

A port a replica or an online server must listen on can be taken between preflight's check and the
run's start: by a process that listens on it, or by an outgoing connection the kernel gave it to (a
port of the *ephemeral range*, ``net.ipv4.ip_local_port_range``), which holds it while it lives and
for 60 s after in TIME_WAIT. :func:`ephemeral_range` lets preflight warn of a port in that range;
:func:`bind_listening` waits out a brief holder and, when the port stays taken, says who holds it.
"""
from __future__ import annotations

import errno
import socket
import time
from pathlib import Path

#: Linux keeps a closed connection's port in TIME_WAIT for 60 s.
TIME_WAIT_S = 60.0
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class PortTaken(OSError):
    """A port that stayed taken: :attr:`users` says by what (``port_users``)."""

    #: what to do (set by the caller, who knows which setting chose the port)
    fix: str | None = None

    def __init__(self, what: str, addr: str, port: int, waited_s: float, users: list[dict]):
        self.addr, self.port, self.users = addr, port, users
        self.detail = {"address": addr, "port": port, "waited_s": round(waited_s, 1), "users": users,
                       "ephemeral_range": ephemeral_range()}
        held = "; ".join(describe(u) for u in users) or "no process of this user holds it (another user's, " \
                                                       "or a connection the kernel still winds down)"
        super().__init__(errno.EADDRINUSE, f"{what} {addr}:{port} stayed taken for {waited_s:.0f} s: {held}")

    def __str__(self) -> str:  # the words, without OSError's "[Errno 98]"
        return self.strerror


def ephemeral_range(path: Path = RANGE_FILE) -> list[int] | None:
    """``[low, high]``: the ports the kernel gives outgoing connections (None where it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return [low, high]


def port_users(port: int) -> list[dict]:
    """The TCP sockets bound to local ``port``: ``{"status", "pid", "cmd", "remote"}`` each (pid None: not ours to
    see; remote None: not connected).
    Read through psutil, which vLLM's env always has; without it, nothing is found."""
    try:
        import psutil
    except ImportError:
        return []
    users = []
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    for conn in conns:
        if conn.laddr and conn.laddr.port == port:
            cmd = None
            if conn.pid:
                try:
                    cmd = " ".join(psutil.Process(conn.pid).cmdline())[:200] or None
                except psutil.Error:
                    pass
            users.append({"status": conn.status, "pid": conn.pid, "cmd": cmd,
                          "remote": f"{conn.raddr.ip}:{conn.raddr.port}" if conn.raddr else None})
    return users


def describe(user: dict) -> str:
    """One holder in words: ``LISTEN by pid 12 (python3 -m vllm ...)``,
    ``TIME_WAIT to 127.0.0.1:22 (a closed connection's; frees within 60 s)``."""
    words = str(user.get("status"))
    if user.get("remote"):
        words += f" to {user['remote']}"
    if user.get("pid"):
        words += f" by pid {user['pid']}" + (f" ({user['cmd']})" if user.get("cmd") else "")
    elif user.get("status") == "TIME_WAIT":
        words += f" (a closed connection's; frees within {TIME_WAIT_S:.0f} s)"
    return words


def in_range(ports: list[int], span: list[int] | None) -> bool:
    """Whether any of ``ports`` lies in ``span`` (an :func:`ephemeral_range`; None: unknown, so no)."""
    return span is not None and any(span[0] <= p <= span[1] for p in ports)


def fix_for(how: str, first: int, exc: PortTaken | None = None) -> str:
    """The fix of a taken port pair (``first`` and the next) that ``how`` chooses ("set master_port of replica r
    in the inventory", "pass --server-port"): another pair, out of the ephemeral range when it was in it."""
    span = ephemeral_range()
    users = [u for u in (exc.users if exc else []) if u.get("pid")]
    fix = f"{how} to a port P whose P and P + 1 are free on that host"
    if in_range([first, first + 1], span):
        fix += (f", below {span[0]}: {first} lies in the range the kernel hands to outgoing connections "
                f"({span[0]}-{span[1]}), which can take it at any time")
    if users:
        fix += f"; or stop pid {users[0]['pid']}, which holds it"
    return fix


def bind_listening(addr: str, port: int, *, what: str = "port", wait_s: float = TIME_WAIT_S,
                   backlog: int = 16, on_wait=None) -> socket.socket:
    """A socket listening on ``addr:port`` (SO_REUSEADDR). While the port is taken it retries for up to
    ``wait_s`` (a connection winding down frees it within :data:`TIME_WAIT_S`); ``on_wait(users)`` is called
    once, when the first try fails.

    :raises PortTaken: the port stayed taken; the exception names its holders.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    deadline = time.monotonic() + wait_s
    started, told = time.monotonic(), False
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
            sock.listen(backlog)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                raise PortTaken(what, addr, port, time.monotonic() - started, port_users(port)) from exc
            if not told and on_wait is not None:
                on_wait(port_users(port))
                told = True
            time.sleep(0.5)
