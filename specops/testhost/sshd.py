"""The built-in test host: a real OpenSSH server on a free loopback port.

``specops testhost up`` brings it up with its own host key, client key and
known_hosts entry, and writes an ssh config so the example ``inventory.yaml`` reaches
it as ``specops-testhost``. Stable links under the test host dir point at the remote
python env and the tiny models, so the inventory never names a content hash.

Layout of ``<cache>/testhost/<name>/``::

    sshd_config  host_ed25519(.pub)  client_ed25519(.pub)  authorized_keys
    known_hosts  ssh_config  sshd.pid  sshd.log  port
    env/ (overlay venv over the cached env)   models/{llama,deepseek_v3,kimi_k25,chat.jsonl}
    work/  out/
"""
from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specops.errors import SpecopsError
from specops.testhost.hostenv import cache_root
from specops.transport.render import render

#: What every process of a test host runs with (sshd's ``SetEnv``; tests/conftest.py sets the same for the
#: host processes the tests start themselves). One small box runs every test host's processes side by side:
#:
#: - OpenMP threads that spin at each barrier (the default) burn the cores the other processes wait for.
#:   Measured here, two tiny-Llama vLLM CPU servers generating at once on 2 cores: 56 s each spinning,
#:   29-31 s with PASSIVE.
#: - vLLM compiles small helpers with torch's inductor on CPU, eager or not (the sampler's random sample,
#:   the logprob ranks; speculators' DFlash block mask): dynamo traces them and inductor checks each vector
#:   ISA the CPU flags name by building and dlopening a probe library in a child python (~1.4 s of CPU each
#:   under the seed stack's torch). A CPU test host runs the model eager (``enforce_eager``) for the same
#:   reason: off, the helpers run as plain torch ops with the same results, and no child python probes.
#:   ``TORCHINDUCTOR_VEC_ISA_OK`` (trust the flags) stays for a probe that runs outside a compile.
HOST_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TORCHDYNAMO_DISABLE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}

SSHD = Path("/usr/sbin/sshd")
ALIAS = "specops-testhost"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SpecopsError(f"sshd exited with code {proc.returncode}: {log.read_text()[-800:]}",
                               "read the log above; is openssh-server installed?")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SpecopsError(f"sshd did not listen on 127.0.0.1:{port} within {timeout}s", f"see {log}")


@dataclass
class TestHost:
    """A throwaway sshd and its keys; ``up()`` is idempotent, ``down()`` stops it."""

    __test__ = False  # not a pytest class, despite the name

    name: str = "default"
    root: Path | None = None

    def __post_init__(self):
        self.root = Path(self.root or cache_root() / "testhost" / self.name)

    @property
    def pid_file(self) -> Path:
        return self.root / "sshd.pid"

    @property
    def port(self) -> int | None:
        f = self.root / "port"
        return int(f.read_text()) if f.exists() else None

    @property
    def user(self) -> str:
        return getpass.getuser()

    def running(self) -> bool:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return False
        return True

    def _keygen(self, path: Path) -> None:
        if not path.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"specops-{self.name}",
                            "-f", str(path)], check=True)

    def up(self, port: int | None = None) -> dict:
        """Start sshd (if not running) and return how to reach it."""
        if not SSHD.exists():
            raise SpecopsError(f"{SSHD} not found", "install it: apt-get install -y openssh-server")
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("work", "out"):
            (self.root / sub).mkdir(exist_ok=True)
        if self.running():
            return self.info()
        host_key, client_key = self.root / "host_ed25519", self.root / "client_ed25519"
        self._keygen(host_key)
        self._keygen(client_key)
        (self.root / "authorized_keys").write_text((self.root / "client_ed25519.pub").read_text())
        port = port or free_port()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir
        config = self.root / "sshd_config"
        config.write_text(render(
            "sshd_config.j2", listen="127.0.0.1", port=port, host_key=host_key, pid_file=self.pid_file,
            authorized_keys=self.root / "authorized_keys", user=self.user, log_level="ERROR",
            sftp_subsystem="internal-sftp", set_env=" ".join(f"{k}={v}" for k, v in HOST_PROCESS_ENV.items())))
        log = self.root / "sshd.log"
        with open(log, "ab") as log_fh:
            proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                    stdout=log_fh, stderr=log_fh, start_new_session=True)
        _wait_for_port(port, proc, log)
        self.pid_file.write_text(str(proc.pid))
        (self.root / "port").write_text(str(port))
        key_type, key_b64 = (self.root / "host_ed25519.pub").read_text().split()[:2]
        (self.root / "known_hosts").write_text(f"[127.0.0.1]:{port} {key_type} {key_b64}\n")
        (self.root / "ssh_config").write_text(
            f"Host {ALIAS}\n  HostName 127.0.0.1\n  Port {port}\n  User {self.user}\n"
            f"  IdentityFile {client_key}\n  UserKnownHostsFile {self.root / 'known_hosts'}\n"
            f"  IdentitiesOnly yes\n")
        return self.info()

    def link_models(self, models: dict[str, Path]) -> None:
        """Stable names for the models, for the example inventory.

        (The env needs no link: it lives at ``<root>/env``. A symlinked venv python
        would lose its venv, since python looks for pyvenv.cfg beside argv[0].)
        """
        (self.root / "models").mkdir(exist_ok=True)
        for name, path in models.items():
            _relink(self.root / "models" / Path(path).name if name == "dataset" else
                    self.root / "models" / name, Path(path))

    def down(self) -> bool:
        """Stop sshd; return whether one was running."""
        if not self.running():
            return False
        pid = int(self.pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if _ended(pid):
                break
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True

    def destroy(self) -> None:
        self.down()
        shutil.rmtree(self.root, ignore_errors=True)

    def info(self) -> dict:
        return {
            "name": self.name, "alias": ALIAS, "address": "127.0.0.1", "port": self.port,
            "user": self.user, "key": str(self.root / "client_ed25519"),
            "known_hosts": str(self.root / "known_hosts"), "ssh_config": str(self.root / "ssh_config"),
            "root": str(self.root), "running": self.running(),
        }


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended. The sshd this process started is reaped here: until its
    parent waits for it, a dead child is a zombie that still answers ``kill(pid, 0)`` (every
    ``down()`` waited its whole 5 s for it)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass  # not this process's child (another session's sshd): its own parent reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _relink(link: Path, target: Path) -> None:
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


if __name__ == "__main__":  # python -m specops.testhost.sshd: bring the default one up
    print(json.dumps(TestHost().up(), indent=2))
