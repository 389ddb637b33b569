"""A throwaway Slurm cluster on this machine: munged, slurmctld and two slurmd on loopback ports.

The tests' login node is the loopback sshd test host (:mod:`specops.testhost.sshd`); the
compute nodes ``node1`` and ``node2`` are two ``slurmd -N`` daemons on this machine, so they
share its filesystem as a real cluster's nodes share theirs. Everything (key, sockets, state,
spools, logs, ``slurm.conf``) lives under one dir; ``down()`` leaves no process::

    >>> cluster = SlurmCluster(tmp / "slurm").up()
    >>> cluster.env["SLURM_CONF"]
    '/tmp/.../slurm/slurm.conf'
    >>> cluster.down()

Debian's ``slurm-wlm`` and ``munge`` (``scripts/bootstrap.sh`` installs them).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from specops.errors import SpecopsError
from specops.testhost.sshd import free_port

DAEMONS = {"munged": Path("/usr/sbin/munged"), "slurmctld": Path("/usr/sbin/slurmctld"),
           "slurmd": Path("/usr/sbin/slurmd")}
NODES = ("node1", "node2")
PARTITION = "debug"
#: the partition's MaxTime in minutes (a request above it must fail before submission)
MAX_TIME_MIN = 10
#: a job array has at most this many tasks (indices 0..MAX_ARRAY_SIZE-1): small, so the tests can pass it
MAX_ARRAY_SIZE = 4


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int], slurmd_port: int) -> str:
    """The cluster's ``slurm.conf``: no accounting, no cgroups (a container's machine has none to spare)."""
    nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 "
                      f"RealMemory=2000 State=UNKNOWN" for name, port in node_ports.items())
    return f"""ClusterName=specops-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
MaxArraySize={MAX_ARRAY_SIZE}
{nodes}
PartitionName={PARTITION} Nodes={','.join(node_ports)} Default=YES MaxTime={MAX_TIME_MIN} State=UP
"""


@dataclass
class SlurmCluster:
    """munged + slurmctld + a slurmd per node under ``root``; ``up()`` waits until every node is idle."""

    __test__ = False

    root: Path
    nodes: tuple = NODES
    procs: dict = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """What a Slurm client (sinfo, sbatch) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _start(self, name: str, argv: list) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            env={**os.environ, **self.env}, start_new_session=True)
        log.close()

    def up(self, timeout: float = 30) -> "SlurmCluster":
        missing = [str(p) for p in DAEMONS.values() if not p.exists()]
        if missing:
            raise SpecopsError(f"{', '.join(missing)} not found", "install them: apt-get install -y slurm-wlm munge "
                               "(make bootstrap does)")
        self.root.mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        node_ports = {name: free_port() for name in self.nodes}
        self.conf.write_text(slurm_conf(self.root, free_port(), node_ports, free_port()))
        self._start("munged", [str(DAEMONS["munged"]), "-F", "--force", f"--key-file={key}",
                               f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self._wait(lambda: (munge / "munge.socket").exists(), "munged's socket", timeout)
        self._start("slurmctld", [str(DAEMONS["slurmctld"]), "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes:
            self._start(f"slurmd-{name}", [str(DAEMONS["slurmd"]), "-D", "-N", name, "-f", str(self.conf)])
        self._wait(self._all_idle, f"nodes {', '.join(self.nodes)} idle in sinfo", timeout)
        return self

    def sinfo(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=10)
        return proc.stdout

    def _all_idle(self) -> bool:
        states = dict(line.split() for line in self.sinfo().splitlines() if line.strip())
        return all(states.get(n, "").startswith("idle") for n in self.nodes)

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.down()
                raise SpecopsError(f"{', '.join(dead)} exited while waiting for {what}",
                                   f"read the logs under {self.root}")
            if ready():
                return
            time.sleep(0.2)
        self.down()
        raise SpecopsError(f"no {what} within {timeout:.0f}s", f"read the logs under {self.root}")

    def down(self) -> None:
        """Cancel every job, stop every daemon (the Slurm ones together, munged last), then end whatever still
        carries this cluster's ``SLURM_CONF`` (a job step's slurmstepd outlives its slurmd): nothing outlives this."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            env = {**os.environ, **self.env}
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env,
                                  timeout=10).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True, env=env, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and subprocess.run(
                        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env,
                        timeout=10).stdout.strip():
                    time.sleep(0.3)
        slurm = [n for n in self.procs if n != "munged"]
        for names in (slurm, ["munged"]):
            stopping = [self.procs.pop(n) for n in names if n in self.procs]
            for proc in stopping:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in stopping:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[int]:
        """Live processes (not this one) whose environment names this cluster's slurm.conf."""
        marker = f"SLURM_CONF={self.conf}\0".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes() and \
                        (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
        return found

    def destroy(self) -> None:
        self.down()
        shutil.rmtree(self.root, ignore_errors=True)
