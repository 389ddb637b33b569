"""One run's directory on the host: its layout, its files, and whether its supervisor lives.

Stdlib only. A run lives in ``<work_dir>/runs/<run_id>/``::

    params.json          the run's parameters (a restart must bring the same ones)
    pid                  the supervisor's pid (also its process group: it leads a new session)
    status.json          rewritten atomically by the supervisor: state, phase, progress, error
    logs/supervisor.log  the supervisor's stdout+stderr (vLLM's driver logs land here)
    logs/rank<k>.log     one per TP rank (vLLM workers; see remote.extract.engines.vllm_worker_hook)
    errors/rank<k>.json  a worker's own exception, the root cause the supervisor reports
    manifest.json, summary.json   copies of the final files in the output dir

``remote.run.job`` (the verbs the controller calls) and ``remote.extract.supervisor`` (the process
that does the run) both read this module, so the layout, the run states and the
liveness rule have one home.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from remote.run import slurm
from remote.system import procscan
from remote.wire import contract

#: every state a run passes through, in order; the last three are final (:class:`remote.wire.contract.RunState`).
STATES, FINAL_STATES = contract.STATES, contract.FINAL_STATES
RUN_ID_RE = contract.RUN_ID_RE  # one rule, shared with the laptop
#: every run kind's supervisor, by the module ``job start`` runs (``python -m MODULE RUN_DIR``): the one
#: list. A supervisor's command line holds its module, a recycled pid of another program does not;
#: ``job start`` spawns no module missing here (one that is would be taken for dead while it runs).
SUPERVISOR_MODULES = {
    "extract": "remote.extract.supervisor",  # an extraction, a replica's head included
    "replica": "remote.extract.replica",  # a replica's worker host: its headless ranks (remote/extract/replica.py)
    "train": "remote.train.supervisor",  # a train run (remote/train/supervisor.py)
}
#: the same supervisors under the module names bundles before the remote/ wings ran them by: a run
#: started by an older specops is still found alive, followed, aborted and fetched after an upgrade.
EARLIER_SUPERVISOR_MODULES = ("remote.supervisor", "remote.replica", "remote.trainrun")
SUPERVISOR_MODULE = SUPERVISOR_MODULES["extract"]


class RunPaths:
    """Where everything of one run lives.

    >>> paths = RunPaths("/work/runs/r1")
    >>> paths.status, paths.log("rank1.log")
    (PosixPath('/work/runs/r1/status.json'), PosixPath('/work/runs/r1/logs/rank1.log'))
    """

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir).resolve()
        self.params = self.run_dir / contract.PARAMS_FILE
        self.status = self.run_dir / contract.STATUS_FILE
        self.pid = self.run_dir / "pid"
        self.logs = self.run_dir / "logs"
        self.errors = self.run_dir / "errors"
        self.supervisor_log = self.logs / "supervisor.log"
        #: rank log sizes when this attempt began (older tracebacks are not this attempt's);
        #: set by the supervisor at its start.
        self.log_offsets: dict[str, int] = {}

    def log(self, name: str) -> Path:
        return self.logs / name

    def log_files(self) -> list[Path]:
        """Every log of the run, the supervisor's first, then the ranks' by name, then each data-parallel
        replica's (``dp1/server.log``, ``dp1/rank0.log``: :mod:`remote.extract.layout`), then a job array's
        tasks' (``tasks/<i>/logs/``) and a replica's Slurm nodes' (``nodes/<k>/logs/``)."""
        tasks = sorted(self.run_dir.glob(f"{slurm.TASKS_DIR}/*/logs/*.log")) + sorted(
            self.run_dir.glob(f"{slurm.NODES_DIR}/*/logs/*.log"))
        if not self.logs.is_dir():
            return tasks
        return sorted([*self.logs.glob("*.log"), *self.logs.glob("dp*/*.log")],
                      key=lambda p: (p.parent != self.logs, p.name != "supervisor.log", str(p))) + tasks


def read_json(path: Path):
    """The JSON in ``path``, or None when it is missing or not (yet) JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def read_pid(run_dir: Path):
    try:
        return int((Path(run_dir) / "pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def pid_alive(pid, run_dir: Path | None = None) -> bool:
    """True when ``pid`` runs and (where /proc tells) is this run's supervisor, not a zombie
    and not a recycled pid of some other program: its command line names a module of
    :data:`SUPERVISOR_MODULES` and ``run_dir``, or (``run_dir`` given) its environment carries
    the run's marker (:data:`RUN_DIR_ENV`, set by ``job start``), whatever its command line says."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return True  # no /proc (macOS): trust kill(0)
    fields = procscan.stat_fields(pid)
    if fields is None or fields[0] in procscan.DEAD_STATES:
        return False
    try:
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    if not cmdline:
        return True  # seen for a moment right after exec: cannot tell, so not dead
    if any(f"-m\0{module}\0".encode() in cmdline
           for module in (*SUPERVISOR_MODULES.values(), *EARLIER_SUPERVISOR_MODULES)) and (
            run_dir is None or str(run_dir).encode() in cmdline):
        return True
    # a live process of this very run is never taken for dead: the worst a wrong "dead" does is
    # write failed over a running run, or start a second supervisor beside it
    return run_dir is not None and bool(run_markers(run_dir) & procscan.environ(pid))


def run_alive(run_dir: Path) -> bool:
    """The run's supervisor lives; for a run submitted to Slurm (``slurm.json``), Slurm's word on its job."""
    found = slurm.job_state(run_dir)
    return found["alive"] if found is not None else pid_alive(read_pid(run_dir), run_dir)


def run_busy(run_dir: Path) -> bool:
    """Alive and not yet final (a finished supervisor may take a moment to exit)."""
    st = read_json(Path(run_dir) / contract.STATUS_FILE) or {}
    return st.get("state") not in FINAL_STATES and run_alive(run_dir)


#: set in the supervisor's environment by ``job start`` (and by the supervisor itself, resolved);
#: every process of the run inherits it -- vLLM's workers, a server in a session of its own,
#: its engine core, multiprocessing's resource tracker -- so it finds them all.
RUN_DIR_ENV = "SPECOPS_RUN_DIR"


def run_markers(run_dir: Path) -> set[bytes]:
    """The ``NAME=value`` environment entries that mark a process of this run (the dir as given, and resolved)."""
    run_dir = Path(run_dir)
    return {f"{RUN_DIR_ENV}={run_dir}".encode(), f"{RUN_DIR_ENV}={run_dir.resolve()}".encode()}


def run_processes(run_dir: Path) -> list[int]:
    """Live processes (zombies excluded) of this user whose environment names this run dir, and vLLM's
    retitled processes working in it (:func:`retitled_vllm_processes`)."""
    run_dir = Path(run_dir)
    found = set(procscan.live_pids(env_any=run_markers(run_dir)))
    return sorted(found | set(retitled_vllm_processes(run_dir)))


def retitled_vllm_processes(run_dir: Path) -> list[int]:
    """vLLM's own processes whose working directory is this run dir.

    vLLM retitles its workers (``VLLM::Worker_TP1``, setproctitle), which overwrites the
    environment ``/proc`` shows, so the run's marker misses them; a rank whose supervisor was
    killed before it could stop it (a replica's worker host, aborted while it stopped its ranks)
    was left running. Its working directory, the run dir the supervisor started it in, still says
    whose it is; only processes named ``VLLM::`` are taken (a shell cd'd into the run dir is not).
    """
    roots = {str(run_dir), str(Path(run_dir).resolve())}
    found = []
    for pid in procscan.live_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if not fh.read(6).startswith(b"VLLM::"):
                    continue
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if any(cwd == root or cwd.startswith(root + "/") for root in roots):
            found.append(pid)
    return found


def kill_run_processes(run_dir: Path, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
    """SIGKILL every process of the run (:func:`run_processes`) until none is left.

    :returns: ``(killed, left)``: the pids killed, and those still alive after ``timeout_s``.
    """
    import time

    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = run_processes(run_dir)
        if not pids or time.monotonic() > deadline:
            return sorted(set(killed)), pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)


def signal_group(pid: int, sig=signal.SIGTERM) -> bool:
    """Signal the run's process group, only if the pid really leads its own group."""
    try:
        if os.getpgid(pid) != pid:
            os.kill(pid, sig)
        else:
            os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def tail_text(path: Path, nbytes: int) -> str:
    """The last ``nbytes`` of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, Path(path).stat().st_size - nbytes))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
