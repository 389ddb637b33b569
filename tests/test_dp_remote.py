"""Data-parallel extraction inside one host: ``dp: 2, tp: 1`` on the 2-core CPU test host, one core each.

The proof of ``remote/extract/layout.py`` and the vllm-server engine's replicas, over SSH with the real
vLLM (CPU build): the states equal the one-server run's sample by sample (the shared ``modern_ssh_run``),
every sample once under the same names, the manifest as before; every replica's first samples pass the
canary; each replica has its own log; abort leaves no process of any replica; a replica killed mid-run
fails the run naming it (``dp1``) and the same command resumes it, there with ``--on-replica-loss continue``:
the replica killed again, its rows go to the other replica and the manifest says so (one paced run carries
the three: a server pair's start is most of a test's time here).
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
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from specops_cli import records, specops  # noqa: E402
from test_group_remote import wait_for  # noqa: E402
from test_replica_remote import COMPARE, hs_files, run_processes, state_of  # noqa: E402

pytestmark = pytest.mark.vllm


def dp_inventory(run: dict, path: Path, **fields) -> Path:
    """The shared run's inventory with ``fields`` changed on its host (``dp`` above all)."""
    doc = yaml.safe_load(Path(run["inventory"]).read_text())
    doc["hosts"]["th"].update(fields)
    path.write_text(yaml.safe_dump(doc))
    return path


def replica_server_pids(run_dir: Path, replica: str) -> list[int]:
    """The pids of replica ``replica``'s vLLM API server: the process whose command line has its port."""
    # the log is appended to by every attempt: the last command line is this attempt's server
    head = [line for line in (run_dir / "logs" / replica / "server.log").read_text().splitlines()
            if line.startswith("# specops: ")][-1]
    words = head.split()
    port = words[words.index("--port") + 1]
    pids = []
    for pid in run_processes(run_dir):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            pids.append(pid)
    return pids


def core_halves() -> list[list[int]]:
    """The device sets ``dp: 2`` gives on this machine's test host (a loopback sshd: this process's cores)."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    return [cores[:half], cores[half:]]


def paced_dp2_run(run: dict, tmp_path: Path, run_id: str, **fields) -> tuple[list, Path]:
    """A ``dp: 2`` run paced 1 s per batch of one sample per replica, started detached; (its args, its run dir)
    once it has two samples on disk."""
    host_env = yaml.safe_load(Path(run["inventory"]).read_text())["hosts"]["th"]["env"]
    inv = dp_inventory(run, tmp_path / f"{run_id}.yaml", dp=2, batch_size=1, output_dir=str(tmp_path / "out"),
                       env={**host_env, "SPECOPS_BATCH_DELAY_S": "1"}, **fields)
    run_dir = Path(yaml.safe_load(inv.read_text())["hosts"]["th"]["work_dir"]) / "runs" / run_id
    args = ["extract", "--inventory", inv, "--run-id", run_id, "--skip-smoke", "--skip-preflight"]
    start_and_wait(args, run, run_dir, 2)
    return args, run_dir


def start_and_wait(args: list, run: dict, run_dir: Path, more: int) -> None:
    """Start ``args`` detached; return once ``more`` samples more than before are on disk (or the run failed)."""
    done_before = state_of(run_dir).get("samples_done") or 0
    started = specops(*args, "--detach", "--json", env=run["env"])
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    wait_for(lambda: (state_of(run_dir).get("samples_done") or 0) >= done_before + more
             or state_of(run_dir).get("state") == "failed", timeout=600, what=f"{more} more samples")


def kill_replica(run_dir: Path, replica: str) -> None:
    pids = replica_server_pids(run_dir, replica)
    assert pids, f"{replica}'s server is running"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def compare_states(python, ref: dict, got: dict) -> list[dict]:
    found = subprocess.run([str(python), "-c", COMPARE, json.dumps([[str(ref[i]), str(got[i])] for i in sorted(ref)])],
                           capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    return json.loads(found.stdout)


def test_dp2_on_one_core_each_equals_one_server_sample_by_sample(modern_ssh_run, modern_fixed_python, tmp_path):
    run = modern_ssh_run("llama", 1)
    inv = dp_inventory(run, tmp_path / "dp2.yaml", dp=2, output_dir=str(tmp_path / "out"))
    pre = specops("preflight", "--inventory", inv, "--json", env=run["env"], timeout=600)
    layout = records(pre)["parallel.layout"]
    assert layout["status"] == "ok" and layout["detail"]["dp"] == 2 and layout["detail"]["sets"] == core_halves(), layout
    assert "dp 2 x tp 1" in layout["summary"], layout

    proc = specops("extract", "--inventory", inv, "--run-id", "dp2", "--skip-smoke", "--skip-preflight", "--tensors",
                   "--json", env=run["env"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    dest = Path(run["env"]["SPECOPS_RUNS"]) / "th" / "dp2"
    one, two = hs_files(run["dest"]), hs_files(dest)
    assert sorted(two) == sorted(one) == [0, 1, 2, 3]  # every sample once, under the same names
    assert {i: p.name for i, p in two.items()} == {i: p.name for i, p in one.items()}
    for i, found in enumerate(compare_states(modern_fixed_python, one, two)):
        print(f"hs_{i}: max |diff| {found['worst']:.3g} of max |state| {found['scale']:.3g}, "
              f"{found['equal_fraction']:.4f} of values bit-equal")
        assert found["same_tokens"] and found["same_shape"], found
        # one core per replica against two for the one server: sums in another order, bf16 rounding at most
        assert found["worst"] <= 2 ** -6 * found["scale"], (i, found)

    ref = json.loads((Path(run["dest"]) / "manifest.json").read_text())
    got = json.loads((dest / "manifest.json").read_text())
    assert sorted(got) == sorted(ref)  # the manifest as before: the same fields...
    strip = lambda entries: [{k: v for k, v in e.items() if k not in ("sha256", "blake3", "stats", "digest")}  # noqa: E731
                             for e in entries]
    assert strip(got["files"]) == strip(ref["files"])  # ...the same sample files, names and token counts
    assert (got["samples"], got["tokens"], got["layer_ids"]) == (ref["samples"], ref["tokens"], ref["layer_ids"])
    engine = got["engine"]
    assert engine["dp"] == 2 and ref["engine"]["dp"] == 1 and ref["engine"]["replicas"] is None
    replicas = engine["replicas"]
    assert [r["name"] for r in replicas] == ["dp0", "dp1"] and [r["devices"] for r in replicas] == core_halves()
    assert sum(r["samples"] for r in replicas) == 4 and all(r["samples"] >= 1 for r in replicas), replicas
    # every replica's first samples are canary samples: 2 each, all checked and passed
    canary = got["canary"]
    assert canary["status"] == "ok" and canary["asked"] == canary["checked"] == 4, canary
    assert sorted(canary["samples"]) == [0, 1, 2, 3], canary
    # each replica's own log, on the host and fetched
    ports = set()
    for name in ("dp0", "dp1"):
        words = (dest / "logs" / name / "server.log").read_text().splitlines()[0].split()
        ports.add(words[words.index("--port") + 1])
    assert len(ports) == 2  # two servers
    logs = specops("logs", "--inventory", inv, "--run-id", "dp2", "--json", env=run["env"], timeout=120)
    assert logs.returncode == 0, logs.stderr
    assert {"dp0/server.log", "dp1/server.log"} <= set(json.loads(logs.stdout)["logs"]["th"]), logs.stdout[:2000]


def test_dp2_abort_a_killed_replica_and_the_continue_policy_on_one_run(modern_ssh_run, tmp_path):
    """One paced run, three attempts (a server pair's start each): aborted, then a replica killed under the
    default policy, then resumed with ``--on-replica-loss continue`` and the same replica killed again."""
    run = modern_ssh_run("llama", 1)
    out = tmp_path / "out"

    # abort mid-run: no process of either replica is left
    args, run_dir = paced_dp2_run(run, tmp_path, "dpk", max_samples=16)
    assert replica_server_pids(run_dir, "dp0") and replica_server_pids(run_dir, "dp1")
    abort = specops("abort", "--inventory", args[2], "--run-id", "dpk", env=run["env"], timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    assert state_of(run_dir)["state"] == "aborted" and not run_processes(run_dir)

    # resumed, then dp1's server killed: the run fails naming dp1
    start_and_wait(args, run, run_dir, 2)
    kill_replica(run_dir, "dp1")
    wait_for(lambda: state_of(run_dir).get("state") in ("failed", "done"), timeout=300, what="the run to end")
    st = state_of(run_dir)
    assert st["state"] == "failed" and "dp1" in json.dumps(st["error"]), st.get("error")
    assert st["error"]["message"].startswith("dp1: ") and st["error"]["where"].startswith("dp1/"), st["error"]
    # written once the run's servers are stopped: the same command run now starts no second server beside one
    assert not replica_server_pids(run_dir, "dp0"), "the run says failed while dp0's server still runs"
    print(f"\nthe killed replica's error: {st['error'].get('where')}: {st['error']['message'][:300]}")
    wait_for(lambda: not run_processes(run_dir), timeout=120, what="the failed run's processes to end")

    # the same command with on_replica_loss: continue resumes it; dp1 killed again, its rows go to dp0
    start_and_wait([*args, "--on-replica-loss", "continue"], run, run_dir, 2)
    kill_replica(run_dir, "dp1")
    t0 = time.monotonic()
    wait_for(lambda: state_of(run_dir).get("state") in ("failed", "done"), timeout=600, what="the run to end")
    st = state_of(run_dir)
    assert st["state"] == "done", st.get("error")
    print(f"\nthe run went on on dp0 for {time.monotonic() - t0:.0f} s")
    # the resume completes: every sample once
    assert sorted(hs_files(out)) == list(range(16))
    manifest = json.loads(next(out.rglob("manifest.json")).read_text())
    assert manifest["samples"] == len(manifest["files"]) == 16 and manifest["engine"]["dp"] == 2
    lost = manifest["engine"]["replicas_lost"]
    assert [x["replica"] for x in lost] == ["dp1"] and lost[0]["devices"] == core_halves()[1], lost
    # this attempt's samples: those not on disk when it began, most of them by dp0
    log = (run_dir / "logs" / "supervisor.log").read_text()
    on_disk = int(re.findall(r"; (\d+) already on disk;", log)[-1])
    made = {r["name"]: r["samples"] for r in manifest["engine"]["replicas"]}
    assert made["dp0"] + made["dp1"] == 16 - on_disk and made["dp0"] > made["dp1"], (made, on_disk)
    assert "replica dp1 lost" in log
