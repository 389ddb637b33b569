"""Detached extraction jobs on the host: start, status, logs, abort, follow (stdlib only).

A task module (``main(params) -> payload``); ``params["action"]`` picks the verb. A run
lives in ``<work_dir>/runs/<run_id>/`` (the layout is described in :mod:`remote.run.rundir`).

Verbs:

``start``   launches ``python -m remote.extract.supervisor RUN_DIR`` (or another module of
            :data:`remote.run.rundir.SUPERVISOR_MODULES`: a replica's worker host's, a train run's) detached from the SSH
            session (new session, stdin closed, output to the supervisor log) and returns
            at once. Idempotent per run id: alive -> "already running"; done -> "already
            done"; failed, aborted or killed -> started again, resuming after the last
            complete sample. Refuses while another run on this host is alive, unless
            ``force``. Same run id with different parameters is refused.
``status``  ``status.json`` plus liveness: a dead supervisor whose state is not final was
            killed (SIGKILL, OOM killer, reboot): reported, and written back, as failed.
``logs``    new bytes of every log since ``offsets`` ({file: byte_offset}); without
            ``offsets``, the last ``tail_bytes`` of each file; with ``offsets``, a file not
            in them (a rank log that appeared since) from its start. Returns the next
            offsets, so a controller follows by calling again.
``abort``   SIGTERM to the run's process group, SIGKILL after ``grace_s``, then SIGKILL to
            every process left that carries the run's marker (a vLLM server in its own
            session); state aborted, its error saying which signal ended the run.
``follow``  one process that watches the run and prints one line per event on stdout
            (``protocol.JOB_EVENT_PREFIX`` + JSON): ``hello`` (its pid), ``status`` (status.json changed),
            ``log`` (new bytes of one log, whole lines; only with ``logs``), ``heartbeat``
            (every ``heartbeat_s`` when nothing else was said). It returns the final status
            like ``status`` once the run is final (``until: final``) or final with its
            supervisor gone (``until: exited``, at most ``exit_grace_s`` more), or after
            ``timeout_s``. When the SSH channel closes (the laptop detached or vanished) it
            exits at once, printing nothing more; the run never depends on it.

Parameters: :data:`SPEC`. ``run_id`` and ``work_dir`` always; ``start`` also needs
``model_path`` and ``dataset``, and takes a run's parameters (:data:`remote.wire.argspec.RUN_ARGS`:
``output_dir``, default ``RUN_DIR/samples``; ``engine``, ``tp``, ``layer_ids``, ``seq_len``,
``env`` exported to the job, the engines' knobs, the test hooks ``inject_failure`` and
``batch_delay_s``), which it records in ``params.json`` as they were sent. The parameters
marked ``call`` steer one call, not the run (``python``, default this interpreter;
``force``; the verbs' own), and may differ between calls for one run id.

An output dir belongs to one run: the supervisor refuses one that holds another run's
samples, or samples of another dataset/model/layers under the same run id.

A hung run can be inspected without stopping it: ``kill -USR1 <pid>`` makes the
supervisor dump every thread's stack into its log; each vLLM rank does the same into
``logs/rank<k>.log`` (its pid is on the first line of that log).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from remote.extract import runplan
from remote.run import faults, slurm
from remote.run.lifecycle import StatusFile
from remote.run.rootcause import last_traceback
from remote.run.rundir import (SUPERVISOR_MODULES, RunPaths, kill_run_processes, pid_alive, read_json, read_pid,
                               run_alive, run_busy, signal_group, tail_text)
from remote.system import signals
from remote.wire import fsutil, protocol, status as wire_status, words
from remote.wire.argspec import RUN_ARGS, SLURM_ARGS, Arg, Spec
from remote.wire.contract import (FINAL_STATES, MANIFEST as MANIFEST_FILE, PARAMS_FILE, STATUS_FILE, RunState,
                                  run_id_fix, run_id_problem)
from remote.wire.fsutil import FileLock

VERBS = ("start", "status", "logs", "abort", "follow")
#: a run's parameters (recorded by ``start``; the others take them and ignore them), and the
#: parameters of one call (``call=True``: never recorded, may differ between calls for one run id).
SPEC = Spec("job", RUN_ARGS, {
    "action": Arg("str", "status", choices=VERBS, call=True),
    "run_id": Arg("str", required=True, doc="checked by run_dir_of (remote.wire.contract.run_id_problem)"),
    "work_dir": RUN_ARGS["work_dir"].but(required=True),
    "python": RUN_ARGS["python"].but(call=True, doc="the supervisor's python (default: this one)"),
    "force": Arg("bool", False, call=True, doc="start beside another run of this host"),
    "offsets": Arg("dict", call=True, doc="logs/follow: {file: byte offset} to go on from"),
    "tail_bytes": Arg("int", 16384, min=0, call=True, doc="logs/follow: how much of a log a first look shows"),
    "max_bytes": Arg("int", 262144, min=1, call=True, doc="logs/follow: at most this much of one log per read"),
    "grace_s": Arg("float", 10.0, min=0, call=True, doc="abort: SIGKILL this long after SIGTERM"),
    "logs": Arg("bool", False, call=True, doc="follow: stream new log lines too"),
    "until": Arg("str", "final", choices=("final", "exited"), call=True),
    "timeout_s": Arg("float", min=0, call=True, doc="follow: give up after this long (default, or 0: never)"),
    "poll_s": Arg("float", 0.5, above=0, call=True),
    "heartbeat_s": Arg("float", 2.0, above=0, call=True),
    "exit_grace_s": Arg("float", 60.0, min=0, call=True),
    "slurm": Arg("dict", options=SLURM_ARGS, call=True,
                 doc="start: submit the supervisor as a Slurm batch job (remote/run/slurm.py), not as a process here"),
}, required_if=[("action", "start", ("model_path", "dataset"))])
#: what steers one call, not the run.
CALL_KEYS = frozenset(SPEC.names(call=True))
#: recorded parameters a resume may change: what stays on disk beside a run (``train --keep-states``), what
#: the run does when a replica dies (``extract --on-replica-loss``), or where an online run's stateless server
#: runs (``train --online --server-on``: the trainer's checkpoints stay where they are), not what the run makes
RESUME_MAY_CHANGE = ("keep_states", "on_replica_loss", "online_server")
STARTING_GRACE_S = 15.0


class JobError(protocol.TaskError):
    """A refusal with a fix hint; becomes one failed record."""


@SPEC.task
def main(params: dict) -> dict:
    verbs = {"start": start, "status": status, "logs": logs, "abort": abort, "follow": follow}
    try:
        return verbs[params["action"]](params)
    except JobError as exc:
        return exc.payload()


# --------------------------------------------------------------------------- run dirs

def runs_root(params: dict) -> Path:
    if not params.get("work_dir"):
        raise JobError("job.params", "work_dir is missing", "set work_dir for the host in the inventory")
    return Path(params["work_dir"]) / "runs"


def run_dir_of(params: dict) -> Path:
    run_id = str(params.get("run_id") or "")
    problem = run_id_problem(run_id)
    if problem:
        raise JobError("job.params", problem, run_id_fix())
    return runs_root(params) / run_id


def _RunsLock(root: Path):
    """One start at a time per host: the runs dir's own lock file."""
    return FileLock(root / ".lock")


def job_params(params: dict) -> dict:
    """What ``params.json`` records: the run's parameters as the caller sent them (checked), not the defaults."""
    given = getattr(params, "given", params.keys())
    return {k: v for k, v in params.items() if k in given and k not in CALL_KEYS and not k.startswith("_")}


# --------------------------------------------------------------------------- start

def start(params: dict) -> dict:
    run_dir = run_dir_of(params)
    wanted = job_params(params)
    with _RunsLock(run_dir.parent):
        old = read_json(run_dir / PARAMS_FILE)
        if old is not None and _identity(old) != _identity(wanted):
            changed = sorted(k for k in set(old) | set(wanted) if _identity(old).get(k) != _identity(wanted).get(k))
            raise JobError("job.start", f"run {params['run_id']} exists with different parameters "
                           f"({', '.join(changed)})",
                           "use a new run id, or repeat the original parameters to resume",
                           detail={"changed": changed})
        if _array_asked(params) or (run_dir / slurm.ARRAY_FILE).exists():
            return _start_array(params, run_dir, wanted, old)
        if old is not None:
            st = current_status(run_dir)
            # done first: a finished supervisor may still be exiting (closing the engine)
            gone = _missing_on_disk(run_dir, st, old) if st and st.get("state") == RunState.DONE else []
            if st and st.get("state") == RunState.DONE and not gone:
                return _payload("job.start", protocol.OK, f"run {params['run_id']} is already done", run_dir, st,
                                already="done")
            # done by its status but samples gone from disk: resumed below, making just those
            if run_busy(run_dir):
                return _payload("job.start", protocol.OK, f"run {params['run_id']} is already running (pid "
                                f"{read_pid(run_dir)}); re-attached", run_dir, st, already="running")
            # failed/aborted: its supervisor may still be stopping workers; never overlap it
            deadline = time.monotonic() + 15
            while run_alive(run_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            if run_alive(run_dir):
                raise JobError("job.start", f"run {params['run_id']} ended ({st.get('state')}) but its "
                               f"supervisor pid {read_pid(run_dir)} is still exiting",
                               "try again in a minute, or abort the run to stop it")
        # a cluster queues its jobs: runs beside each other are Slurm's to place
        others = [] if params.get("slurm") else [d.name for d in sorted(run_dir.parent.iterdir())
                                                 if d.is_dir() and d != run_dir and run_busy(d)]
        if others and not params.get("force"):
            raise JobError("job.start", f"this host is already running extraction {', '.join(others)}",
                           f"wait for it, abort it (abort --run-id {others[0]}), or force a second run",
                           detail={"running": others})
        resumed = old is not None
        # a resume keeps the recorded parameters but takes this start's value of each RESUME_MAY_CHANGE
        record = wanted if not resumed else {**{k: v for k, v in old.items() if k not in RESUME_MAY_CHANGE},
                                             **{k: wanted[k] for k in RESUME_MAY_CHANGE if k in wanted}}
        _prepare_run_dir(run_dir, record, write_params=record != old)
        if params.get("slurm"):
            job = slurm.submit(run_dir, *_supervisor_command(run_dir, params), params["slurm"], params["run_id"])
            st = current_status(run_dir)
            what = "resubmitted (resumes after the last complete sample)" if resumed else "submitted"
            return _payload("job.start", protocol.CHANGED, f"run {params['run_id']} {what} as Slurm job "
                            f"{job['job_id']} (partition {job['partition']})", run_dir, st, slurm_job=job,
                            resumed=resumed)
        (run_dir / slurm.JOB_FILE).unlink(missing_ok=True)  # an earlier attempt's job: not this process's word
        pid = _spawn(run_dir, params)
        st = current_status(run_dir)
    what = "restarted (resumes after the last complete sample)" if resumed else "started"
    return _payload("job.start", protocol.CHANGED, f"run {params['run_id']} {what}, pid {pid}", run_dir, st,
                    pid=pid, resumed=resumed)


def _missing_on_disk(run_dir: Path, st: dict, wanted: dict) -> list[int]:
    """Indices of a done run's range that are not on disk (deleted since): a resume believes the disk."""
    from remote.extract.shard import present

    bounds = st.get("sample_range")
    if not (isinstance(bounds, list) and len(bounds) == 2):
        return []
    out_dir = Path(str(st.get("output_dir") or runplan.output_dir(wanted, run_dir)))
    have = present(out_dir, int(bounds[0]), int(bounds[1]))
    return [i for i in range(int(bounds[0]), int(bounds[1])) if i not in have]


def _identity(params: dict) -> dict:
    """What a resume compares: the recorded parameters less fault points and :data:`RESUME_MAY_CHANGE`."""
    return {k: v for k, v in faults.resumable_as(params).items() if k not in RESUME_MAY_CHANGE}


def _prepare_run_dir(run_dir: Path, wanted: dict, write_params: bool) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "errors").mkdir(exist_ok=True)
    if write_params:
        fsutil.write_json(run_dir / PARAMS_FILE, wanted, temp_prefix=fsutil.TEMP_PREFIX)
    StatusFile.of_job(run_dir / STATUS_FILE).restart(wanted["run_id"])
    try:
        (run_dir / "pid").unlink()
    except FileNotFoundError:
        pass


def _spawn(run_dir: Path, params: dict) -> int:
    argv, env = _supervisor_command(run_dir, params)
    with open(run_dir / "logs" / "supervisor.log", "ab") as log:
        try:
            proc = subprocess.Popen(
                argv, cwd=run_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            raise JobError("job.start", f"cannot start the supervisor with {argv[0]}: {exc}",
                           "set the host's python in the inventory to the env that has torch "
                           "(and vLLM/speculators for the speculators engine)") from exc
    (run_dir / "pid").write_text(f"{proc.pid}\n")
    return proc.pid


def _supervisor_command(run_dir: Path, params: dict) -> tuple[list, dict]:
    """The supervisor's argv and environment (one for both ways of starting it: here, or a Slurm job)."""
    bundle = str(Path(params.get("_bundle_dir") or Path(__file__).resolve().parents[2]))
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (params.get("env") or {}).items()})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bundle, env.get("PYTHONPATH", "")) if p)
    env["SPECOPS_RUN_DIR"] = str(run_dir)
    env["PYTHONUNBUFFERED"] = "1"
    faults.job_env(params, env)
    python = params.get("python") or sys.executable
    # ``_entry``: another run kind's supervisor (remote/train/task.py starts remote.train.supervisor)
    module = params.get("_entry") or _supervisor_of(params)
    if module not in SUPERVISOR_MODULES.values():  # liveness would never recognise it: a bug of ours
        raise ValueError(f"{module} is not among the supervisor modules (remote.run.rundir.SUPERVISOR_MODULES)")
    return [python, "-m", module, str(run_dir)], env


def _supervisor_of(params: dict) -> str:
    """A worker host of a replica runs its headless ranks under :mod:`remote.extract.replica`; every
    other extraction (a replica's head included) under :mod:`remote.extract.supervisor`."""
    replica = params.get("replica") or {}
    return SUPERVISOR_MODULES["replica" if int(replica.get("node_rank") or 0) > 0 else "extract"]


# --------------------------------------------------------------------------- status

def current_status(run_dir: Path) -> dict | None:
    """status.json with liveness folded in; a dead supervisor of a live state -> failed (persisted).
    A job array's run (``array.json``) has no status.json of its own: its tasks' (:func:`_array_status`)."""
    if (run_dir / slurm.ARRAY_FILE).exists():
        return _array_status(run_dir)
    st = read_json(run_dir / STATUS_FILE)
    if st is None:
        return None
    pid = read_pid(run_dir)
    job = slurm.job_state(run_dir)
    alive = job["alive"] if job is not None else pid_alive(pid, run_dir)
    st["alive"] = alive
    if job is not None:
        st["slurm"] = job
    if job is not None and not alive and _ended_by_slurm(st, job):
        return _slurm_ended(run_dir, st, job, aborted=True)
    if st.get("state") in FINAL_STATES or alive:
        return st
    age = time.time() - float(st.get("heartbeat_unix") or 0)
    if st.get("state") == RunState.PENDING and age < STARTING_GRACE_S and job is None:
        return st  # a start in progress: pid not written yet, or the process not yet readable
    tail = tail_text(run_dir / "logs" / "supervisor.log", 8000)
    if job is not None:
        # Slurm ended the job before its supervisor recorded an end: Slurm's state names why
        now = read_json(run_dir / STATUS_FILE) or st
        if now.get("state") in FINAL_STATES:  # it recorded one between the two reads
            if _ended_by_slurm(now, job):
                return _slurm_ended(run_dir, now, job, aborted=True)
            return {**now, "alive": alive, "slurm": job}
        return _slurm_ended(run_dir, now, job, aborted=False, tail=tail)
    where = f"{st.get('samples_done')}/{st.get('samples_total')} samples"
    crashed = last_traceback(tail) if "[specops] supervisor exits" not in tail else None
    if crashed:  # it died of an exception it could not record (e.g. at import)
        error = wire_status.error(crashed["type"], (f"supervisor exited without recording a result: "
                                                   f"{crashed['message']} (state was {st.get('state')!r} at {where})"),
                                  traceback=crashed["traceback"], log_tail=tail)
    else:
        # not our child: how it ended is unknown; the kernel may still tell of an OOM kill
        oom = signals.oom_evidence(pid)
        error = wire_status.error(
            "SupervisorDied", (f"supervisor died (SIGKILL?): pid {pid} is gone while the run was "
                               f"{st.get('state')!r} at {where} (killed by SIGKILL, the OOM killer, or "
                               f"a reboot; {oom['text']}); starting the same run id again resumes after "
                               f"the last complete sample"), log_tail=tail, oom=oom)
    written = StatusFile.of_job(run_dir / STATUS_FILE, {k: v for k, v in st.items() if k != "alive"}).fail(error)
    return {**written, "alive": alive}


def _ended_by_slurm(st: dict, job: dict) -> bool:
    """The supervisor recorded ``aborted`` for a SIGTERM that was Slurm's own end of the job (its time limit, a
    node failure, memory), not a cancel (``scancel``, ``job abort``): Slurm's state is then the run's end."""
    return (st.get("state") == RunState.ABORTED and job["slurm"] not in ("CANCELLED", "COMPLETED", "UNKNOWN")
            and not job["alive"] and (st.get("error") or {}).get("where") != "job.abort")


def _slurm_ended(run_dir: Path, st: dict, job: dict, *, aborted: bool, tail: str | None = None) -> dict:
    """The run failed as Slurm ended its job (``Slurm<State>``, Slurm's fix), written once; ``aborted``: over
    the abort its supervisor recorded for Slurm's SIGTERM."""
    tail = tail_text(run_dir / "logs" / "supervisor.log", 8000) if tail is None else tail
    crashed = None if aborted else last_traceback(tail)
    error = wire_status.error(f"Slurm{job['slurm'].title().replace('_', '')}", (
        f"{slurm.state_words(job)}: the job ended ({job['state']}) "
        + ("and its supervisor stopped" if aborted else f"while the run was {st.get('state')!r}")
        + f" at {st.get('samples_done')}/{st.get('samples_total')} samples"
        + (f"; the supervisor's last error: {crashed['type']}: {crashed['message']}" if crashed else "")),
        log_tail=tail, slurm=job, fix=job["fix"] or "run the same command again to resume",
        traceback=(crashed or {}).get("traceback") or "")
    written = StatusFile.of_job(run_dir / STATUS_FILE, {k: v for k, v in st.items()
                                                        if k not in ("alive", "slurm")}).fail(error,
                                                                                               ended_by_slurm=aborted)
    return {**written, "alive": False, "slurm": job}


def status(params: dict) -> dict:
    run_dir = run_dir_of(params)
    st = current_status(run_dir)
    if st is None:
        raise _no_such_run("job.status", params, run_dir)
    return _status_payload("job.status", params["run_id"], run_dir, st)


def _no_such_run(name: str, params: dict, run_dir: Path) -> JobError:
    return JobError(name, f"no run {params.get('run_id')} on this host ({run_dir})",
                    "check the run id (list runs under work_dir/runs) or start it")


def _status_payload(name: str, run_id: str, run_dir: Path, st: dict, **extra) -> dict:
    """One record that says how the run stands (fail when it failed), and the status itself."""
    if isinstance(st.get("tasks"), list):  # a job array: the run's state, then each task's with its Slurm state
        payload = _status_payload(name, run_id, run_dir, {k: v for k, v in st.items() if k != "tasks"}, **extra)
        payload["data"]["status"] = st
        payload["records"] += [_task_record(name, task) for task in st["tasks"]]
        if st.get("merge_record"):
            payload["records"].append(st["merge_record"])
        return payload
    if isinstance(st.get("slurm"), dict):  # a run submitted to Slurm: its job's state beside the run's own
        payload = _status_payload(name, run_id, run_dir, {k: v for k, v in st.items() if k != "slurm"}, **extra)
        payload["data"]["status"] = st
        payload["records"].append(_slurm_record(name, st))
        return payload
    state = st.get("state")
    progress = f"{st.get('samples_done')}/{st.get('samples_total')} samples"
    # a train run's measured memory, the peak so far (remote.wire.words)
    used = f"; {words.usage_line(st['memory'])}" if st.get("memory") else ""
    if state == RunState.FAILED:
        err = st.get("error") or {}
        return _payload(name, protocol.FAIL, f"run {run_id} failed: {err.get('type')}: {err.get('message')}{used}",
                        run_dir, st, fix="read error.traceback and the logs; fix the cause, then start the "
                                         "same run id again to resume", **extra)
    if state == RunState.ABORTED:
        return _payload(name, protocol.WARN, f"run {run_id} was aborted at {progress}{used}", run_dir, st, **extra)
    # the states' dtype once the run's plan is made (status.json's plan): bf16 or fp8
    states = f", {st['plan']['state_format']} states" if (st.get("plan") or {}).get("state_format") else ""
    replica = st.get("replica") if isinstance(st.get("replica"), dict) else {}
    # a replica's head: the hosts (a Slurm job's nodes) its ranks run on
    over = (f"; one replica over {', '.join(map(str, replica['hosts']))} (tp {replica.get('tp')})"
            if replica.get("hosts") else "")
    payload = _payload(name, protocol.OK, f"run {run_id} {state}: {progress}{states}{over}{used}", run_dir, st,
                       **extra)
    if isinstance(st.get("canary"), dict):  # what the run's canary found (remote.verify.canary.summarize)
        from remote.verify import canary

        payload["records"].append(canary.shown_record(f"{name.split('.')[0]}.canary", st["canary"]))
    return payload


def _slurm_record(name: str, st: dict) -> dict:
    """``<kind>.slurm``: Slurm's state of the run's job, named, with its fix where it is not a good one."""
    job = st["slurm"]
    words = slurm.state_words(job)
    summary = f"{words}: {job['state']}"
    if job["alive"] or job["slurm"] == "COMPLETED" or st.get("state") in (RunState.DONE, RunState.ABORTED):
        bad = job["state"] == "held" or \
            job["slurm"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED", "CANCELLED")
        return protocol.record(f"{name.split('.')[0]}.slurm", protocol.WARN if bad else protocol.OK, summary,
                               detail=job, fix=job["fix"] if bad or job["slurm"] == "PENDING" else None)
    return protocol.record(f"{name.split('.')[0]}.slurm", protocol.FAIL, summary, detail=job,
                           fix=job["fix"] or "run the same command again to resume")


# --------------------------------------------------------------------------- logs

class LogReader:
    """New bytes of a run's logs since the last read, one byte offset per file.

    A file without an offset is read from its last ``tail_bytes`` on the first look (a
    person wants the recent lines, not a whole load log), and from its start once
    following (a rank log that appeared since: every line of it is new).

    :param offsets: ``{file: byte_offset}`` from an earlier read; given, we are following.
    """

    def __init__(self, paths: RunPaths, offsets: dict | None = None, tail_bytes: int = 16384,
                 max_bytes: int = 262144):
        self.paths = paths
        self.following = offsets is not None
        self.offsets = {str(k): int(v) for k, v in (offsets or {}).items()}
        self.tail_bytes, self.max_bytes = int(tail_bytes), int(max_bytes)

    def read(self, whole_lines: bool = False) -> dict:
        """``{file: {offset, next_offset, size, text}}`` for every log, at most ``max_bytes`` each.

        :param whole_lines: hold back a last line that has no newline yet (it is still
            being written); a follower passes False once the run is over.
        """
        out = {}
        for path in self.paths.log_files():
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            # a replica's: dp1/server.log; a job array task's: tasks/0/logs/supervisor.log
            base = self.paths.logs if path.is_relative_to(self.paths.logs) else self.paths.run_dir
            name = str(path.relative_to(base))
            off = self.offsets.get(name)
            if off is None:
                off = 0 if self.following else max(0, size - self.tail_bytes)
            if off > size:  # the file was replaced: start over
                off = 0
            with open(path, "rb") as fh:
                fh.seek(off)
                data = fh.read(self.max_bytes)
            if whole_lines and len(data) < self.max_bytes:
                data = data[:data.rfind(b"\n") + 1]
            out[name] = {"offset": off, "next_offset": off + len(data), "size": size,
                         "text": data.decode("utf-8", errors="replace")}
            self.offsets[name] = off + len(data)
        self.following = True
        return out


def logs(params: dict) -> dict:
    run_dir = run_dir_of(params)
    paths = RunPaths(run_dir)
    if not paths.logs.is_dir():
        raise JobError("job.logs", f"no run {params.get('run_id')} on this host ({run_dir})",
                       "check the run id")
    reader = LogReader(paths, params["offsets"], params["tail_bytes"], params["max_bytes"])
    out = reader.read()
    st = current_status(run_dir) or {}
    rec = protocol.record("job.logs", protocol.OK, f"{len(out)} log file(s) of run {params['run_id']}",
                          detail={"files": sorted(out)})
    return protocol.payload([rec], logs=out, offsets=dict(reader.offsets),
                            state=st.get("state"), alive=st.get("alive"))


# --------------------------------------------------------------------------- follow

class ChannelClosed(SystemExit):
    """The laptop's end of our stdout went away: nobody is left to tell, so exit quietly (code 0)."""

    def __init__(self):
        super().__init__(0)


class EventChannel:
    """One line per event on this process's stdout, which is the SSH channel to the laptop.

    Nothing else reads that stdout, so a closed channel shows two ways: ``poll()`` on it
    reports an error or hangup as soon as sshd closes its end (the laptop detached, or
    its connection dropped), and a write fails with EPIPE. Either raises
    :class:`ChannelClosed`, so a follower never outlives the one who listens to it.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.sent = 0
        self.last_sent = time.monotonic()
        self._poll = None
        if hasattr(select, "poll"):
            self._poll = select.poll()
            self._poll.register(fd, 0)  # no events asked: only error and hangup are reported

    def send(self, kind: str, **fields) -> None:
        line = protocol.JOB_EVENT_PREFIX + json.dumps({"event": kind, "t": round(time.time(), 3), **fields},
                                         default=str, ensure_ascii=True) + "\n"
        data = line.encode("ascii")
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except (BrokenPipeError, ConnectionResetError):
            raise ChannelClosed() from None
        self.sent += 1
        self.last_sent = time.monotonic()

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or raise :class:`ChannelClosed` as soon as the channel closes."""
        if self._poll is None:
            time.sleep(seconds)
            return
        gone = select.POLLERR | select.POLLHUP | select.POLLNVAL
        if any(mask & gone for _, mask in self._poll.poll(seconds * 1000)):
            raise ChannelClosed()


def follow(params: dict) -> dict:
    """Watch one run from this one process and stream what changes (see the module doc)."""
    run_dir = run_dir_of(params)
    st = current_status(run_dir)
    if st is None:
        raise _no_such_run("job.follow", params, run_dir)
    until, poll_s, heartbeat_s, exit_grace_s = (params[k] for k in ("until", "poll_s", "heartbeat_s", "exit_grace_s"))
    deadline = time.monotonic() + params["timeout_s"] if params["timeout_s"] else None
    reader = None
    if params["logs"]:
        reader = LogReader(RunPaths(run_dir), params["offsets"], params["tail_bytes"], params["max_bytes"])
    channel = EventChannel(sys.__stdout__.fileno())
    channel.send("hello", pid=os.getpid(), run_dir=str(run_dir))
    sent_status, final_since, timed_out = None, None, False
    while True:
        st = current_status(run_dir) or st  # None only while the file is being replaced
        if reader is not None:
            _send_logs(channel, reader, whole_lines=True)
        changed = {k: v for k, v in st.items() if k not in ("updated_at", "heartbeat_unix")}
        if changed != sent_status:
            channel.send("status", status=st)
            sent_status = changed
        if st.get("state") in FINAL_STATES:
            # a done supervisor may still be closing its engine; "exited" waits for that
            final_since = final_since or time.monotonic()
            if until == "final" or not st.get("alive") or time.monotonic() - final_since > exit_grace_s:
                break
        if deadline is not None and time.monotonic() >= deadline:
            timed_out = True
            break
        if time.monotonic() - channel.last_sent >= heartbeat_s:
            channel.send("heartbeat")
        channel.wait(poll_s)
    if reader is not None:
        _send_logs(channel, reader, whole_lines=False)  # the run is over: partial last lines too
    return _status_payload("job.follow", params["run_id"], run_dir, st, timed_out=timed_out,
                           events=channel.sent, offsets=dict(reader.offsets) if reader else None)


def _send_logs(channel: EventChannel, reader: LogReader, whole_lines: bool) -> None:
    for name, chunk in reader.read(whole_lines=whole_lines).items():
        if chunk["text"]:
            channel.send("log", file=name, **chunk)


# --------------------------------------------------------------------------- abort

def abort(params: dict) -> dict:
    """Stop a run in whatever phase it is: nothing of it may outlive this call.

    SIGTERM to the supervisor's process group (it stops its engine, a vLLM server's
    process group included, and records ``aborted``); SIGKILL to the group after
    ``grace_s``; then SIGKILL to every process still carrying the run's marker
    (:func:`remote.run.rundir.run_processes`): a server in a session of its own whose stop
    was cut short, its engine core, multiprocessing's resource tracker. The status
    written and the record returned tell the same story: which signal ended the
    supervisor and what else had to be killed.
    """
    run_dir = run_dir_of(params)
    if (run_dir / slurm.ARRAY_FILE).exists():
        return _abort_array(params, run_dir)
    st = read_json(run_dir / STATUS_FILE)
    if st is None:
        raise JobError("job.abort", f"no run {params.get('run_id')} on this host ({run_dir})",
                       "check the run id")
    if slurm.job_of(run_dir) is not None:
        return _abort_slurm_job(params, run_dir)
    pid = read_pid(run_dir)
    if not pid_alive(pid, run_dir):
        swept, left = kill_run_processes(run_dir)
        st = current_status(run_dir)
        if not swept and not left:
            return _payload("job.abort", protocol.SKIPPED, f"run {params['run_id']} is not running "
                            f"({st.get('state')})", run_dir, st)
        how = _leftovers_text(swept, left)
        return _payload("job.abort", protocol.FAIL if left else protocol.CHANGED,
                        f"run {params['run_id']} was not running ({st.get('state')}); {how}", run_dir, st,
                        swept=swept, left=left, fix="kill the pids left by hand" if left else None)
    grace = params["grace_s"]
    signalled = signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pid_alive(pid, run_dir):
        time.sleep(0.2)
    killed = pid_alive(pid, run_dir)
    if killed:
        signal_group(pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while time.monotonic() < end and pid_alive(pid, run_dir):
            time.sleep(0.1)
    else:
        signal_group(pid, signal.SIGKILL)  # workers that outlived their supervisor
    swept, left = kill_run_processes(run_dir)
    how = (f"the supervisor did not stop within {grace:.0f}s of SIGTERM; SIGKILL ended it" if killed
           else "the supervisor stopped on SIGTERM")
    if swept or left:
        how += "; " + _leftovers_text(swept, left)
    st = _record_abort(run_dir, how, signal="SIGKILL" if killed else "SIGTERM", killed_after_grace=killed,
                       swept=swept, left=left)
    st["alive"] = pid_alive(pid, run_dir)
    status_ = protocol.FAIL if left else protocol.CHANGED
    return _payload("job.abort", status_, f"run {params['run_id']} aborted: {how}", run_dir, st,
                    signalled=signalled, killed=killed, swept=swept, left=left,
                    fix="kill the pids left by hand (they ignore SIGKILL: a process in the kernel's D state)"
                    if left else None)


def _record_abort(run_dir: Path, how: str, **detail) -> dict:
    """The run's status after an abort by request: ``aborted`` naming ``how`` (a run that got to ``done`` first
    stays done)."""
    status_file = StatusFile.of_job(run_dir / STATUS_FILE)
    st = dict(status_file.data)
    if st.get("state") != RunState.DONE:
        st = status_file.abort(wire_status.error(
            "Aborted", f"aborted by request: {how}", where="job.abort", **detail,
            supervisor_error=(st.get("error") or {}).get("message")), by_request=True)
    return st


def _abort_slurm_job(params: dict, run_dir: Path) -> dict:
    """``scancel`` the run's job: Slurm sends SIGTERM to the supervisor (which stops its engine and records
    ``aborted``), SIGKILL after its KillWait; we wait until Slurm counts the job ended, then sweep what
    carries the run's marker here (a compute node that is this host) and record the abort."""
    before = slurm.job_state(run_dir, fresh=True)
    if not before["alive"]:
        swept, left = kill_run_processes(run_dir)
        st = current_status(run_dir)
        status_ = protocol.FAIL if left else protocol.CHANGED if swept else protocol.SKIPPED
        extra = f"; {_leftovers_text(swept, left)}" if swept or left else ""
        return _payload("job.abort", status_, f"run {params['run_id']} is not running ({st.get('state')}; "
                        f"{slurm.state_words(before)}){extra}", run_dir, st, swept=swept, left=left,
                        fix="kill the pids left by hand" if left else None)
    after = slurm.cancel(run_dir, wait_s=params["grace_s"] + 60)
    swept, left = kill_run_processes(run_dir)
    how = f"scancel {before['job_id']} ({before['slurm']} -> {after.get('slurm')})"
    if after.get("alive"):
        how += f"; Slurm still counts the job {after.get('slurm')}"
    if swept or left:
        how += "; " + _leftovers_text(swept, left)
    st = _record_abort(run_dir, how, slurm=after, swept=swept, left=left)
    st = {**st, "alive": bool(after.get("alive")), "slurm": after}
    failed = left or after.get("alive")
    return _payload("job.abort", protocol.FAIL if failed else protocol.CHANGED,
                    f"run {params['run_id']} aborted: {how}", run_dir, st, swept=swept, left=left,
                    fix=(f"scancel {before['job_id']} again, or ask the cluster's admins (squeue -j {before['job_id']})"
                         if after.get("alive") else "kill the pids left by hand") if failed else None)


def _leftovers_text(swept: list[int], left: list[int]) -> str:
    parts = []
    if swept:
        parts.append(f"SIGKILL to {len(swept)} leftover process(es) of the run {swept}")
    if left:
        parts.append(f"{len(left)} process(es) still alive {left}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- a group plan as a Slurm job array

def _array_asked(params: dict) -> bool:
    return int((params.get("slurm") or {}).get("array") or 1) > 1


def _plan_array(params: dict, tasks: int) -> dict:
    """``array.json``: the run's samples in ``tasks`` contiguous shards, one per array task (refused by name,
    nothing written, where the cluster or the dataset cannot take them)."""
    limit = slurm.max_array_size(params.get("env"))
    if limit is not None and tasks > limit:
        raise JobError("job.start", f"field 'slurm.array' is {tasks}: this cluster's MaxArraySize is {limit} (task "
                       f"indices 0..{limit - 1}); nothing was submitted",
                       f"set slurm.array to at most {limit} (scontrol show config | grep MaxArraySize)",
                       detail={"array": tasks, "max_array_size": limit})
    from remote.extract.shard import count_rows

    try:
        total, digest = count_rows(params["dataset"], params.get("max_samples"))
    except (OSError, ValueError) as exc:
        raise JobError("job.start", f"cannot count the dataset's rows on the login node to shard them: {exc}",
                       "a job array's shards are planned on the login node: give a dataset path on the shared "
                       "filesystem") from exc
    if tasks > total:
        raise JobError("job.start", f"field 'slurm.array' is {tasks}: more shards than the run's {total} sample(s); "
                       f"nothing was submitted", f"set slurm.array to at most {total}",
                       detail={"array": tasks, "samples": total})
    from remote.wire.ranges import split

    shards = split(total, {index: 1 for index in range(tasks)})  # equal: the first shards one more where it leaves some
    return {"tasks": tasks, "total": total, "dataset_sha256": digest,
            "ranges": [list(shards[index]) for index in range(tasks)]}


def _start_array(params: dict, run_dir: Path, wanted: dict, old: dict | None) -> dict:
    """A group plan on a host behind Slurm (``slurm.array``): one ``sbatch --array`` of the shards not done, task
    ``i`` the usual supervisor over shard ``i``'s range, every task writing into the run's one output dir; the
    same command again resubmits only the shards that are not done (each resumes after its last sample)."""
    run_id, asked = params["run_id"], int(params["slurm"].get("array") or 1)
    for given in ("sample_range", "replica"):  # the laptop refuses these first (specops.slurm.refuse_array_in_group)
        if params.get(given) and asked > 1:
            raise JobError("job.start", f"field 'slurm.array' shards the whole run; this start also gives {given}",
                           "extract on the Slurm host alone, or drop slurm.array from its inventory entry")
    if asked > 1 and int(params["slurm"].get("nodes") or 1) > 1:  # the laptop refuses it first (refuse_job_replica)
        raise JobError("job.start", f"field 'slurm.nodes' is {params['slurm']['nodes']} with slurm.array {asked}: a "
                       f"job array's task extracts on one node", "drop slurm.array, or set slurm.nodes: 1")
    layout = read_json(run_dir / slurm.ARRAY_FILE)
    if layout is None and old is not None:
        raise JobError("job.start", f"run {run_id} was started as one Slurm job, not as a job array "
                       f"(slurm.array {asked})", "resume it without slurm.array, or give the job array a new run id")
    if layout is not None and asked > 1 and asked != layout["tasks"]:
        raise JobError("job.start", f"field 'slurm.array' is {asked}, and run {run_id} was planned as "
                       f"{layout['tasks']} shards ({run_dir / slurm.ARRAY_FILE})",
                       f"resume it with slurm.array {layout['tasks']}, or start a new run id")
    if layout is None:
        layout = _plan_array(params, asked)
    record = wanted if old is None else {**{k: v for k, v in old.items() if k not in RESUME_MAY_CHANGE},
                                         **{k: wanted[k] for k in RESUME_MAY_CHANGE if k in wanted}}
    out_dir = runplan.output_dir(record, run_dir)  # one dir for every shard: the merge makes its one manifest
    todo, running = [], []
    for index, (lo, hi) in enumerate(layout["ranges"]):
        task = slurm.task_dir(run_dir, index)
        task_params = {**record, "sample_range": [lo, hi], "output_dir": out_dir}
        st = current_status(task) if (task / STATUS_FILE).exists() else None
        if st and st.get("state") == RunState.DONE and not _missing_on_disk(task, st, task_params):
            continue
        if st and run_busy(task):
            running.append(index)
            continue
        todo.append((index, task, task_params))
    if not todo:
        st = current_status(run_dir) if (run_dir / slurm.ARRAY_FILE).exists() else None
        what = f"already running (task(s) {running})" if running else "already done"
        return _payload("job.start", protocol.OK, f"run {run_id} is {what}", run_dir, st,
                        already="running" if running else "done")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # the run's logs: its tasks' (RunPaths.log_files)
    if old is None or record != old:
        fsutil.write_json(run_dir / PARAMS_FILE, record, temp_prefix=fsutil.TEMP_PREFIX)
    if not (run_dir / slurm.ARRAY_FILE).exists():
        fsutil.write_json(run_dir / slurm.ARRAY_FILE, layout, temp_prefix=fsutil.TEMP_PREFIX)
    (run_dir / MANIFEST_FILE).unlink(missing_ok=True)  # merged again once every shard is done
    for _, task, task_params in todo:
        _prepare_run_dir(task, task_params, write_params=read_json(task / PARAMS_FILE) != task_params)
        (task / slurm.JOB_FILE).unlink(missing_ok=True)
    indices = [index for index, _, _ in todo]
    job = slurm.submit(run_dir, *_supervisor_command(run_dir, params), params["slurm"], run_id, array=indices)
    resumed = old is not None
    what = (f"resubmitted shard(s) {indices} of {layout['tasks']} (each resumes after its last complete sample)"
            if resumed else f"submitted: {layout['tasks']} shards of {layout['total']} samples")
    return _payload("job.start", protocol.CHANGED, f"run {run_id} {what} as Slurm job array {job['job_id']} "
                    f"(--array={','.join(str(i) for i in indices)}, partition {job['partition']})", run_dir,
                    current_status(run_dir), slurm_job=job, resumed=resumed, tasks=indices)


def _array_status(run_dir: Path) -> dict:
    """The run of a job array as one status: its tasks' (each folded with its own Slurm state, ``JOBID_i``),
    ``tasks`` listing them; once every shard is done, the shards' manifests merged into one."""
    layout = read_json(run_dir / slurm.ARRAY_FILE) or {}
    params = read_json(run_dir / PARAMS_FILE) or {}
    tasks = []
    for index, (lo, hi) in enumerate(layout.get("ranges") or []):
        st = current_status(slurm.task_dir(run_dir, index)) or {}
        tasks.append({"task": index, "sample_range": [lo, hi], "state": st.get("state") or RunState.PENDING,
                      "samples_done": int(st.get("samples_done") or 0), "samples_total": hi - lo,
                      "alive": bool(st.get("alive")), "slurm": st.get("slurm"), "error": st.get("error")})
    alive = [t for t in tasks if t["alive"]]
    # a task that recorded its end while Slurm still holds it (COMPLETING) is ended: the run goes on only while a
    # task that has not ended does, so one shard's abort does not end the run while another still extracts or waits
    going = [t for t in alive if t["state"] not in FINAL_STATES]
    states = {t["state"] for t in tasks}
    ended = next((t for t in tasks if t["state"] == RunState.FAILED), None) or next(
        (t for t in tasks if t["state"] == RunState.ABORTED), None)
    if tasks and states == {RunState.DONE}:
        state = RunState.DONE
    elif going:
        state = RunState.EXTRACTING if any(t["state"] == RunState.EXTRACTING for t in going) else going[0]["state"]
    else:
        state = ended["state"] if ended else RunState.PENDING
    st = {"run_id": params.get("run_id") or run_dir.name, "kind": "extract",
          "state": str(getattr(state, "value", state)), "samples_done": sum(t["samples_done"] for t in tasks),
          "samples_total": layout.get("total"),
          "alive": bool(alive), "output_dir": runplan.output_dir(params, run_dir), "tasks": tasks,
          "array": {"tasks": layout.get("tasks"), "job_id": (slurm.job_of(run_dir) or {}).get("job_id")}}
    if ended and not going and state != RunState.DONE:
        err = ended["error"] or {}
        st["error"] = wire_status.error(err.get("type") or "TaskEnded", f"shard {ended['task']} "
                                        f"{ended['sample_range']}: {err.get('message') or ended['state']}",
                                        where=err.get("where") or "supervisor")
    if state == RunState.DONE:
        st.update(_merge_array(run_dir, st, layout))
    return st


def _merge_array(run_dir: Path, st: dict, layout: dict) -> dict:
    """Every shard done: their manifests merged into the output dir's one ``manifest.json``
    (:mod:`remote.extract.merge`), and its copy in the run dir, where a fetch reads a run's manifest."""
    from remote.extract import merge

    if (run_dir / MANIFEST_FILE).exists():
        return {}
    try:
        merged = merge.merge({"output_dir": st["output_dir"], "run_id": st["run_id"], "ranges": layout["ranges"]})
    except protocol.TaskError as exc:
        return {"state": RunState.FAILED.value, "merge_record": exc.record(),
                "error": wire_status.error("MergeFailed", exc.record()["summary"], where="job.status")}
    if merged["data"].get("complete"):
        fsutil.atomic_write(run_dir / MANIFEST_FILE, Path(merged["data"]["path"]).read_bytes())
    return {"merge_record": merged["records"][0]}


def _task_record(name: str, task: dict) -> dict:
    """``<kind>.task<i>``: one shard of a job array, its run's state and Slurm's word on its task (``JOBID_i``)."""
    job = task.get("slurm") or {}
    lo, hi = task["sample_range"]
    said = f"; {slurm.state_words(job)}: {job['state']}" if job else "; not submitted"
    summary = f"shard {task['task']} [{lo}, {hi}): {task['state']} {task['samples_done']}/{task['samples_total']}{said}"
    failed = task["state"] == RunState.FAILED or (job and not job.get("alive") and task["state"] != RunState.DONE
                                                   and job.get("slurm") not in ("COMPLETED", "CANCELLED"))
    status_ = (protocol.FAIL if failed else protocol.WARN if task["state"] == RunState.ABORTED
               or job.get("slurm") == "PENDING" else protocol.OK)
    fix = (job.get("fix") or (task.get("error") or {}).get("fix") or "run the same command again: it resubmits the "
           "shards that are not done") if status_ != protocol.OK else None
    return protocol.record(f"{name.split('.')[0]}.task{task['task']}", status_, summary, detail=task, fix=fix)


def _abort_array(params: dict, run_dir: Path) -> dict:
    """``scancel`` the run's job array (every task of it), wait until Slurm counts each ended, sweep what carries a
    task's marker here, and record each unfinished shard aborted."""
    job = slurm.job_of(run_dir) or {}
    before = _array_status(run_dir)
    if not before["alive"]:
        return _payload("job.abort", protocol.SKIPPED, f"run {params['run_id']} is not running ({before['state']})",
                        run_dir, before)
    after = slurm.cancel(run_dir, wait_s=params["grace_s"] + 60)
    swept, left = [], []
    for index in range(len(before["tasks"])):
        task = slurm.task_dir(run_dir, index)
        one_swept, one_left = kill_run_processes(task)
        swept, left = swept + one_swept, left + one_left
        if (task / STATUS_FILE).exists():
            _record_abort(task, f"scancel {job.get('job_id')} (the run's job array)", slurm=after)
    how = f"scancel {job.get('job_id')} (the job array: {len(before['tasks'])} task(s))"
    if after.get("alive"):
        how += f"; Slurm still counts a task alive ({after.get('slurm')})"
    if swept or left:
        how += "; " + _leftovers_text(swept, left)
    st = _array_status(run_dir)
    failed = left or after.get("alive")
    return _payload("job.abort", protocol.FAIL if failed else protocol.CHANGED, f"run {params['run_id']} aborted: "
                    f"{how}", run_dir, st, swept=swept, left=left,
                    fix=f"scancel {job.get('job_id')} again, or kill the pids left by hand" if failed else None)


# --------------------------------------------------------------------------- helpers

def _payload(name, status_, summary, run_dir: Path, st, fix=None, **extra) -> dict:
    rec = protocol.record(name, status_, summary, detail={"run_dir": str(run_dir)}, fix=fix)
    return protocol.payload([rec], run_dir=str(run_dir), status=st, **extra)
