"""One extraction over several hosts, over real SSH: sharded, followed, merged; hosts that die or hang.

Hosts ``a`` and ``b`` share the session's test sshd (each with its own work and output
dir: two hosts to specops), ``c`` has an sshd of its own, so it can be killed mid-run
while the others go on. The fault tests use the transformers reference engine (a few
seconds to load); the group extraction proper runs the real patched speculators 0.3.0
generator on vLLM at TP=1 on the tiny DeepSeek-V3.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specops.exit_codes import ExitCode
from specops.testhost.sshd import TestHost

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def blake3_of(path) -> str:
    """A file's BLAKE3, the digest a run's manifest names where the host has blake3 (both test-host envs do)."""
    import blake3

    return blake3.blake3(Path(path).read_bytes()).hexdigest()


def cli(*args, runs: Path, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", "SPECOPS_RUNS": str(runs), **(env or {})})


def start_cli(*args, runs: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "specops"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "COLUMNS": "250", "SPECOPS_RUNS": str(runs)})


@pytest.fixture(scope="module")
def host_c(tmp_path_factory):
    """A second sshd, so that one host can be killed while the others keep theirs."""
    host = TestHost(name=f"pytest-group-{os.getpid()}", root=tmp_path_factory.mktemp("host-c"))
    host.up()
    yield host
    host.destroy()


@pytest.fixture
def c_up(host_c):
    """``host_c``, running: a test that failed after killing it must not take the next tests with it."""
    if not host_c.running():
        host_c.up(port=host_c.port)
    return host_c


def kill_host(sshd: TestHost, run_dir: Path | None = None) -> None:
    """The host dies: its sshd and every session under it, and the run's supervisor group."""
    pid = int(sshd.pid_file.read_text())
    doomed = {pid}
    grew = True
    while grew:  # every descendant of the listener: connection handlers, their shells and pythons
        grew = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            child, parent = int(stat.parent.name), int(fields[1])
            if parent in doomed and child not in doomed:
                doomed.add(child)
                grew = True
    if run_dir is not None and (run_dir / "pid").exists():
        try:
            os.killpg(int((run_dir / "pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for victim in sorted(doomed, reverse=True):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(pid, 0)  # we started it: reap it, or it lingers as a zombie that "runs"
    except ChildProcessError:
        pass
    sshd.pid_file.unlink(missing_ok=True)


def revive_host(sshd: TestHost, port: int) -> None:
    sshd.up(port=port)  # same port, same host key: the inventory still fits


def write_inventory(tmp_path: Path, testhost: dict, other: TestHost, python, model, dataset, **fields) -> Path:
    def host(info: dict, name: str) -> dict:
        return {"address": "127.0.0.1", "port": info["port"], "user": info["user"], "key": info["key"],
                "known_hosts": info["known_hosts"], "python": str(python), "work_dir": str(tmp_path / name / "work"),
                "output_dir": str(tmp_path / name / "out"), "model_path": str(model), "dataset": str(dataset),
                "device": "cpu", "connect_timeout": 5, **fields}

    hosts = {"a": host(testhost, "a"), "b": host(testhost, "b"), "c": host(other.info(), "c")}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts, "groups": {"trio": ["a", "b", "c"]}}))
    return path


def status_file(tmp_path: Path, host: str, run_id: str) -> dict:
    try:
        return json.loads((tmp_path / host / "work" / "runs" / run_id / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def wait_for(predicate, timeout=300, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def records_of(stdout: str) -> dict:
    """``--json`` output as {host or shard: {record name: record}} (the last record of a name wins)."""
    out: dict = {}
    for h in json.loads(stdout)["hosts"]:
        out.setdefault(h["host"], {}).update({r["name"]: r for r in h["records"]})
    return out


def assert_merged(runs: Path, run_id: str, total: int, tmp_path: Path) -> dict:
    """The merged manifest names every sample once, matches each owner's files, and equals the union of shards."""
    root = runs / run_id
    group_doc = json.loads((root / "group.json").read_text())
    merged = json.loads((root / "manifest.json").read_text())
    assert merged["complete"] and merged["samples"] == total and not merged["missing"]
    assert [f["index"] for f in merged["files"]] == list(range(total)), "every index once, in order"
    union = set()
    for shard in group_doc["shards"]:
        if shard["stop"] <= shard["start"]:
            continue
        out = Path(shard["output_dir"])
        for index in range(shard["start"], shard["stop"]):
            path = out / f"data_{index}.pt"
            union.add((index, path.name, blake3_of(path), shard["id"], shard["hosts"][0]))
        host_manifest = root / "hosts" / shard["hosts"][0] / shard["run_id"] / "manifest.json"
        if host_manifest.exists():  # what the host's own manifest says agrees with the files
            listed = {e["path"]: e["blake3"] for e in json.loads(host_manifest.read_text())["files"]}
            for index in range(shard["start"], shard["stop"]):
                if f"data_{index}.pt" in listed:
                    assert listed[f"data_{index}.pt"] == blake3_of(out / f"data_{index}.pt")
    got = {(f["index"], f["path"], f["blake3"], f["shard"], f["host"]) for f in merged["files"]}
    assert got == union
    for f in merged["files"]:  # the merged dir holds exactly those bytes
        assert blake3_of(root / "samples" / f["path"]) == f["blake3"]
    assert sorted(p.name for p in (root / "samples").glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(total))
    assert merged["layer_convention"] == "output" and merged["format_name"] == "pt"
    return merged


# --------------------------------------------------------------------------- faults (reference engine)

@pytest.fixture
def ref_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models):
    # one sample a batch and a pause after each: a window to kill a host mid-run
    return write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                           engine="hf-reference", tp=1, max_samples=12, seq_len=64, batch_size=1,
                           env={**OFFLINE, "SPECOPS_BATCH_DELAY_S": "1.5"})


def test_a_host_lost_mid_run_leaves_the_others_running_then_resumes(ref_inventory, host_c, tmp_path):
    runs = tmp_path / "runs"
    inv = str(ref_inventory)
    port = host_c.port
    follower = start_cli("extract", "--inventory", inv, "--on", "trio", "--run-id", "F1", "--skip-preflight",
                         "--skip-smoke", "--json", runs=runs)
    def laptop_saw_c() -> bool:  # the follow view keeps each shard's progress in group.json as it comes
        try:
            seen = json.loads((runs / "F1" / "group.json").read_text())["shards"][2]["seen"]
        except (FileNotFoundError, ValueError, IndexError, KeyError):
            return False
        return (seen.get("samples_done") or 0) >= 1

    wait_for(laptop_saw_c, what="the laptop to see c's first sample")
    kill_host(host_c, tmp_path / "c" / "work" / "runs" / "F1")
    out, err = follower.communicate(timeout=600)
    assert follower.returncode == ExitCode.UNREACHABLE, out + err
    lost = records_of(out)["s2@c"]["group.run"]
    assert lost["status"] == "fail" and lost["summary"].startswith("lost c") and "--reassign c=" in lost["fix"]
    for name in ("a", "b"):  # the others finished their shards without c
        assert status_file(tmp_path, name, "F1")["state"] == "done"
    group_doc = json.loads((runs / "F1" / "group.json").read_text())
    assert [(s["id"], s["hosts"], s["start"], s["stop"]) for s in group_doc["shards"]] == [
        ("s0", ["a"], 0, 4), ("s1", ["b"], 4, 8), ("s2", ["c"], 8, 12)]
    assert group_doc["shards"][2]["seen"]["samples_done"] >= 1, "c's last seen progress is kept"

    looked = cli("status", "--inventory", inv, "--run-id", "F1", "--json", runs=runs, timeout=120)
    assert looked.returncode == ExitCode.UNREACHABLE, looked.stdout + looked.stderr
    shown = {h["host"]: h for h in json.loads(looked.stdout)["hosts"]}
    assert shown["s2@c"]["error"] and shown["s2@c"]["data"]["last_seen"]["samples_done"] >= 1
    assert shown["s0@a"]["data"]["state"] == shown["s1@b"]["data"]["state"] == "done"

    revive_host(host_c, port)
    again = cli("extract", "--inventory", inv, "--run-id", "F1", "--tensors", "--json", runs=runs)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    c_status = status_file(tmp_path, "c", "F1")
    assert c_status["state"] == "done" and c_status["attempt"] == 2, "c's shard resumed, not restarted elsewhere"
    assert c_status["resumed_from"] > 8 and c_status["sample_range"] == [8, 12]
    assert status_file(tmp_path, "a", "F1").get("attempt") == 1, "a finished shard is not run again"
    assert_merged(runs, "F1", 12, tmp_path)
    done = cli("status", "--inventory", inv, "--run-id", "F1", runs=runs, timeout=120)
    assert done.returncode == ExitCode.SUCCESS, done.stdout


def test_reassign_moves_the_rest_of_a_dead_hosts_shard_no_sample_twice_none_lost(ref_inventory, host_c, tmp_path):
    runs = tmp_path / "runs"
    inv = str(ref_inventory)
    port = host_c.port
    started = cli("extract", "--inventory", inv, "--on", "trio", "--run-id", "F2", "--skip-preflight", "--skip-smoke",
                  "--detach", runs=runs)
    assert started.returncode == ExitCode.SUCCESS, started.stdout + started.stderr
    wait_for(lambda: (status_file(tmp_path, "c", "F2").get("samples_done") or 0) >= 1, what="c's first sample")
    looked = cli("status", "--inventory", inv, "--run-id", "F2", runs=runs, timeout=120)  # the laptop sees c's progress
    assert looked.returncode == ExitCode.JOB_RUNNING, looked.stdout + looked.stderr
    kill_host(host_c, tmp_path / "c" / "work" / "runs" / "F2")
    seen = json.loads((runs / "F2" / "group.json").read_text())["shards"][2]["seen"]["samples_done"]
    on_c = len(list((tmp_path / "c" / "out" / "F2").glob("data_*.pt")))
    assert on_c >= seen >= 1

    moved = cli("extract", "--inventory", inv, "--run-id", "F2", "--reassign", "c=a", "--tensors", "--json", runs=runs)
    # everything but c's kept part is done and fetched; c itself cannot be reached for its part yet
    assert moved.returncode == ExitCode.UNREACHABLE, moved.stdout[-3000:] + moved.stderr[-3000:]
    group_doc = json.loads((runs / "F2" / "group.json").read_text())
    cut = 8 + seen
    assert [(s["id"], s["hosts"], s["start"], s["stop"], s["run_id"]) for s in group_doc["shards"]] == [
        ("s0", ["a"], 0, 4, "F2"), ("s1", ["b"], 4, 8, "F2"), ("s2", ["c"], 8, cut, "F2"),
        ("s2m1", ["a"], cut, 12, "F2.s2m1")]
    said = records_of(moved.stdout)["group"]["group.reassign"]
    assert said["status"] == "changed" and f"[{cut}, 12) moved from c to a" in said["summary"]
    assert "did not answer" in said["detail"]["how"]
    moved_out = tmp_path / "a" / "out" / "F2.s2m1"
    assert sorted(int(p.stem.split("_")[1]) for p in moved_out.glob("data_*.pt")) == list(range(cut, 12))

    revive_host(host_c, port)
    fetched = cli("fetch", "--inventory", inv, "--run-id", "F2", "--tensors", runs=runs)
    assert fetched.returncode == ExitCode.SUCCESS, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    merged = assert_merged(runs, "F2", 12, tmp_path)
    owners = {f["index"]: f["shard"] for f in merged["files"]}
    assert {owners[i] for i in range(8, cut)} == {"s2"} and {owners[i] for i in range(cut, 12)} == {"s2m1"}
    final = cli("status", "--inventory", inv, "--run-id", "F2", runs=runs, timeout=120)
    assert final.returncode == ExitCode.SUCCESS, final.stdout

    # verify by the group's run id: the moved range under its own run id on a; c's cut run never ended
    # done (it has no manifest of its kept range), which a warning names
    checked = cli("verify", "--inventory", inv, "--run-id", "F2", "--samples", "1", "--json", runs=runs, timeout=900)
    assert checked.returncode == ExitCode.SUCCESS, checked.stdout[-4000:] + checked.stderr[-4000:]
    said = records_of(checked.stdout)
    assert set(said) == {"s0@a", "s1@b", "s2@c", "s2m1@a", "group"}
    for label in ("s0@a", "s1@b", "s2m1@a"):
        assert said[label]["verify.run"]["status"] == "ok", said[label]
    assert said["s2m1@a"]["verify.run"]["summary"].startswith("run F2.s2m1:")
    assert said["s2@c"]["group.verify"]["status"] == "warn" and "not verified" in said["s2@c"]["group.verify"]["summary"]
    verdict = said["group"]["group.verify"]
    assert verdict["status"] == "warn" and "3 of 4 shard(s)" in verdict["summary"] and "s2@c" in verdict["summary"]


# --------------------------------------------------------------------------- refusals, partial start, hung host

def test_mixed_stacks_and_unready_hosts_start_nothing_until_allowed(tmp_path, testhost, c_up, hostenv_python,
                                                                    tiny_models):
    runs = tmp_path / "runs"
    inv = write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                          engine="hf-reference", tp=1, max_samples=4, seq_len=64, batch_size=2, env=OFFLINE)
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"]["b"]["engine"] = "vllm-server"  # input-of-layer ids, hs_{i}.safetensors files
    inv.write_text(yaml.safe_dump(doc))
    mixed = cli("extract", "--inventory", str(inv), "--on", "a,b", "--run-id", "M1", "--skip-preflight", "--json",
                runs=runs, timeout=300)
    assert mixed.returncode == ExitCode.FAILED, mixed.stdout + mixed.stderr
    records = {r["name"]: r for h in json.loads(mixed.stdout)["hosts"] for r in h["records"]}
    assert records["group.stack"]["status"] == "fail" and "mixed stacks" in records["group.stack"]["summary"]
    assert not (runs / "M1").exists() and not (tmp_path / "a" / "work" / "runs" / "M1").exists()

    # b's dataset is missing and c hangs: the recap says so, nothing starts without --allow-partial
    doc["hosts"]["b"].update(engine="hf-reference", dataset=str(tmp_path / "nope.jsonl"))
    hang = tmp_path / "hang-python"
    hang.write_text("#!/bin/sh\nexec sleep 120\n")
    hang.chmod(0o755)
    doc["hosts"]["c"]["python"] = str(hang)
    inv.write_text(yaml.safe_dump(doc))
    # a hung host is waited out twice here (the refusal, then --allow-partial): 10 s is still several times what
    # a quick step of a loopback host takes on a busy 2-core box
    env = {"SPECOPS_STEP_TIMEOUT": "10"}
    t0 = time.monotonic()
    held = cli("extract", "--inventory", str(inv), "--on", "trio", "--run-id", "P1", "--skip-preflight", "--json",
               runs=runs, env=env, timeout=300)
    assert time.monotonic() - t0 < 110, "the hung host held the others"
    assert held.returncode == ExitCode.UNREACHABLE, held.stdout + held.stderr
    hosts = {h["host"]: h for h in json.loads(held.stdout)["hosts"]}
    assert "no answer within 10s" in hosts["c"]["error"]
    ready = next(r for r in hosts["group"]["records"] if r["name"] == "group.ready")
    assert ready["status"] == "fail" and "1 of 3 host(s) ready (a)" in ready["summary"]
    assert "--allow-partial" in ready["fix"] and not (runs / "P1").exists()

    go = cli("extract", "--inventory", str(inv), "--on", "trio", "--run-id", "P1", "--skip-preflight", "--skip-smoke",
             "--allow-partial", "--detach", runs=runs, env=env, timeout=600)
    assert go.returncode == ExitCode.SUCCESS, go.stdout[-3000:] + go.stderr[-3000:]
    group_doc = json.loads((runs / "P1" / "group.json").read_text())
    assert [(s["hosts"], s["start"], s["stop"]) for s in group_doc["shards"]] == [(["a"], 0, 4)]
    assert set(group_doc["history"][0]["left_out"]) == {"b", "c"}
    # abort and status act on the group by its run id; the same extract again resumes it
    stopped = cli("abort", "--inventory", str(inv), "--run-id", "P1", runs=runs, timeout=120)
    assert stopped.returncode == ExitCode.SUCCESS, stopped.stdout + stopped.stderr
    looked = cli("status", "--inventory", str(inv), "--run-id", "P1", runs=runs, timeout=120)
    assert looked.returncode == ExitCode.JOB_ABORTED, looked.stdout + looked.stderr
    again = cli("extract", "--inventory", str(inv), "--run-id", "P1", "--tensors", runs=runs, env=env, timeout=600)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((runs / "P1" / "manifest.json").read_text())["complete"]


# --------------------------------------------------------------------------- the real engine, three hosts

@pytest.mark.vllm
def test_three_hosts_extract_one_dataset_at_tp1_deepseek(tmp_path, testhost, c_up, patched_python, tiny_models):
    runs = tmp_path / "runs"
    inv = write_inventory(tmp_path, testhost, c_up, patched_python, tiny_models["deepseek_v3"],
                          tiny_models["dataset"], engine="speculators-0.3", tp=1, max_samples=8, seq_len=64,
                          batch_size=3, env={**OFFLINE, "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                             "VLLM_CPU_OMP_THREADS_BIND": "0"})
    proc = cli("extract", "--inventory", str(inv), "--on", "trio", "--run-id", "D3", "--skip-smoke", "--tensors",
               "--json", runs=runs, timeout=900)
    assert proc.returncode == ExitCode.SUCCESS, proc.stdout[-4000:] + proc.stderr[-4000:]
    said = records_of(proc.stdout)
    assert all(said[h]["group.preflight"]["status"] == "ok" for h in "abc"), "every host was preflighted first"
    assert said["s0@a"]["group.run"]["status"] == "ok" and said["group"]["group.merge"]["status"] == "ok"
    group_doc = json.loads((runs / "D3" / "group.json").read_text())
    # equal capacity (2 cores / tp 1 each): 8 samples as 3 + 3 + 2, contiguous, global indices
    assert [(s["hosts"], s["start"], s["stop"]) for s in group_doc["shards"]] == [(["a"], 0, 3), (["b"], 3, 6),
                                                                              (["c"], 6, 8)]
    assert group_doc["stack"]["convention"] == "output" and group_doc["stack"]["layer_ids"] == [2, 4, 5, 7]
    assert {h["engine"] for h in group_doc["hosts"].values()} == {"speculators-0.3"}
    assert all(h["versions"]["speculators"] == "0.3.0" for h in group_doc["hosts"].values())
    for name, (start, stop) in {"a": (0, 3), "b": (3, 6), "c": (6, 8)}.items():
        names = sorted(p.name for p in (tmp_path / name / "out" / "D3").glob("data_*.pt"))
        assert names == sorted(f"data_{i}.pt" for i in range(start, stop)), (name, names)
        host_manifest = json.loads((runs / "D3" / "hosts" / name / "D3" / "manifest.json").read_text())
        assert host_manifest["engine"]["name"] == "speculators-0.3" and host_manifest["engine"]["tp"] == 1
        assert host_manifest["sample_range"] == [start, stop]
    merged = assert_merged(runs, "D3", 8, tmp_path)
    assert merged["layer_ids"] == [2, 4, 5, 7]
    for entry in merged["files"]:
        layers = entry["tensors"]["hidden_states"]
        assert len(layers) == 4 and all(h["shape"] == [entry["tokens"], 256] and h["dtype"] == "bfloat16"
                                        for h in layers)
    logs = cli("logs", "--inventory", str(inv), "--run-id", "D3", "--json", runs=runs, timeout=120)
    assert logs.returncode == 0 and set(json.loads(logs.stdout)["logs"]) == {"s0@a", "s1@b", "s2@c"}


@pytest.mark.vllm
def test_two_modern_hosts_merge_into_one_dir_speculators_trains_on(tmp_path, testhost, c_up, modern_vllm_python,
                                                                 tiny_models):
    """Engine auto on speculators 0.9 hosts: hs_{i}.safetensors under hidden_states/ from two hosts, and
    the token dataset once, merged into one dir that speculators' own ArrowDataset reads unchanged."""
    from specops.testhost.hostenv import cache_root
    from test_extract_modern import speculators_reads

    runs = tmp_path / "runs"
    inv = write_inventory(tmp_path, testhost, c_up, modern_vllm_python, tiny_models["llama"], tiny_models["dataset"],
                          tp=1, max_samples=4, seq_len=64, batch_size=2,
                          env={**OFFLINE, "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")})
    proc = cli("extract", "--inventory", str(inv), "--on", "a,b", "--run-id", "H2", "--skip-smoke", "--skip-preflight",
               "--tensors", "--json", runs=runs, timeout=1500)
    assert proc.returncode == ExitCode.SUCCESS, proc.stdout[-4000:] + proc.stderr[-4000:]
    group_doc = json.loads((runs / "H2" / "group.json").read_text())
    assert group_doc["stack"]["format"] == "hs" and group_doc["stack"]["convention"] == "input"
    assert {h["engine"] for h in group_doc["hosts"].values()} == {"vllm-server"}
    merged = json.loads((runs / "H2" / "manifest.json").read_text())
    assert merged["complete"] and [f["index"] for f in merged["files"]] == [0, 1, 2, 3]
    assert [f["path"] for f in merged["files"]] == [f"hidden_states/hs_{i}.safetensors" for i in range(4)]
    assert [f["host"] for f in merged["files"]] == ["a", "a", "b", "b"]
    # each shard ran its own canary over its first samples; the group manifest keeps both verdicts
    assert set(merged["canaries"]) == {s["id"] for s in merged["shard_map"]}, merged.get("canaries")
    assert all(c["status"] == "ok" and c["checked"] >= 1 for c in merged["canaries"].values()), merged["canaries"]
    samples = runs / "H2" / "samples"
    for f in merged["files"]:
        assert blake3_of(samples / f["path"]) == f["blake3"]
    assert merged["dataset_files"] and all((samples / name).is_file() for name in merged["dataset_files"])
    seen = speculators_reads(modern_vllm_python, samples)
    assert seen["existing"] == [0, 1, 2, 3] and seen["corrupt"] == [] and len(seen["items"]) == 4
    for item in seen["items"]:
        assert item["input_ids"] == item["token_ids"]


def test_a_group_run_whose_rows_make_another_count_of_samples_stops_before_extracting(tmp_path, testhost, c_up,
                                                                                      hostenv_python, tiny_models):
    """Issue 40: a group plan shards rows; per-turn chat rows make another count of samples (27 of 24 rows here:
    30 turns, 3 whose context fills seq_len 64 left out), which would shift every range. Each shard stops while
    tokenizing (no model load), naming the counts and the settings that fit."""
    runs = tmp_path / "runs"
    inv = write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                          engine="hf-reference", tp=1, max_samples=100, seq_len=64, batch_size=2, env=OFFLINE,
                          turns="per-turn")
    proc = cli("extract", "--inventory", str(inv), "--on", "a,b", "--run-id", "T1", "--skip-preflight",
               "--skip-smoke", "--json", runs=runs, timeout=600)
    assert proc.returncode != ExitCode.SUCCESS, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [json.loads(p.read_text()).get("error") or {} for p in (tmp_path / "a" / "work" / "runs").glob(
        "*/status.json")]
    said = " ".join(e.get("message", "") for e in errors)
    assert "planned 24 samples (one per row) but the rows make 27 (3 left out; turns: per-turn)" in said, (errors, proc.stdout[-3000:])
    assert "turns: whole" in said
