"""A group run whose hosts share one output dir (one filesystem mounted on every node).

Hosts ``a`` and ``b`` are two hosts to specops on the session's one test sshd, with their
own work dirs and one ``output_dir``: what a cluster with NFS/Lustre gives. The first
cases work on real files with the host-side code directly; the group runs go over SSH.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specops.exit_codes import ExitCode
from test_group_remote import OFFLINE, cli, records_of, blake3_of, status_file, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
IDENTITY = {"dataset_sha256": "ab" * 32, "dataset_samples": 8, "model": {"model_type": "llama", "hidden_size": 256},
            "format": "pt", "layer_ids": [2, 4, 5, 7], "layer_convention": "output"}


@pytest.fixture
def remote_pkg(monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(REPO_ROOT))
    for name in [m for m in sys.modules if m == "remote" or m.startswith("remote.")]:
        monkeypatch.delitem(sys.modules, name)


# --------------------------------------------------------------------------- the host side, on real files

def test_two_ranges_of_one_run_share_a_dir_and_another_run_or_dataset_is_refused_field_by_field(tmp_path,
                                                                                               remote_pkg):
    from remote.extract import samples

    out = tmp_path / "out"
    out.mkdir()
    first = samples.claim_output_dir(out, "R", IDENTITY, (0, 4), who={"host": "a"})
    assert first["shared"] == []
    second = samples.claim_output_dir(out, "R", IDENTITY, (4, 8), who={"host": "b"})
    assert second["shared"] == ["0-4"], "the second shard of the run is let in, and knows it shares the dir"
    again = samples.claim_output_dir(out, "R", IDENTITY, (0, 4), who={"host": "a"})  # a resume of the first
    assert again["shared"] == ["4-8"]
    assert json.loads((out / samples.SHARDS_DIR / "4-8" / "claim.json").read_text())["who"] == {"host": "b"}

    other = dict(IDENTITY, dataset_samples=12, layer_ids=[1, 3, 5, 7], model=dict(IDENTITY["model"], hidden_size=512))
    with pytest.raises(ValueError) as refused:
        samples.claim_output_dir(out, "R", other, (8, 12))
    said = str(refused.value)
    assert "dataset_samples (the number of samples in the dataset): 8 -> 12" in said
    assert "layer_ids (the layer ids): [2, 4, 5, 7] -> [1, 3, 5, 7]" in said
    assert "model (the model (config summary)): hidden_size 256 -> 512" in said
    assert "format" not in said.split("What differs")[1], "only what differs is named"
    with pytest.raises(ValueError, match="holds the samples of run 'R', not 'Q'"):
        samples.claim_output_dir(out, "Q", IDENTITY, (0, 4))
    with pytest.raises(ValueError, match=r"samples \[2, 6\) overlap \[0, 4\), claimed in .* by a"):
        samples.claim_output_dir(out, "R", IDENTITY, (2, 6))
    assert not (out / samples.SHARDS_DIR / "8-12").exists() and not (out / samples.SHARDS_DIR / "2-6").exists()


def test_a_shard_sweeps_only_its_own_temp_files_on_a_shared_dir(tmp_path, remote_pkg):
    from remote.extract import samples

    out = tmp_path / "out"
    out.mkdir()
    for name in (".partial-data_1.x1.pt", ".partial-data_5.x2.pt", ".partial-torn.pt"):
        (out / name).write_bytes(b"half")
    (out / ".partial-dataset-4-8-abc").mkdir()
    (out / ".partial-dataset-0-4-abc").mkdir()
    gone = samples.remove_partials(out, samples.PT, sample_range=(4, 8), sole=False)
    assert sorted(gone) == [".partial-data_5.x2.pt", ".partial-dataset-4-8-abc"]
    assert (out / ".partial-data_1.x1.pt").exists() and (out / ".partial-torn.pt").exists()
    # the only claimant of a dir takes what nobody names too (a killed older writer's)
    assert sorted(samples.remove_partials(out, samples.PT, sample_range=(0, 4), sole=True)) == [
        ".partial-data_1.x1.pt", ".partial-dataset-0-4-abc", ".partial-torn.pt"]


def test_the_token_dataset_is_written_once_per_shared_dir(tmp_path, remote_pkg):
    from remote.extract import samples

    out = tmp_path / "out"
    out.mkdir()
    rows = [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])]
    first = samples.publish_token_dataset(out, rows, (0, 1), "sha-1")
    assert first["written"] and first["writer"] == "0-1" and first["files"]
    stamp = {n: (out / n).stat().st_mtime_ns for n in first["files"]}
    second = samples.publish_token_dataset(out, rows, (1, 2), "sha-1")
    assert not second["written"] and second["files"] == first["files"] and second["writer"] == "0-1"
    assert {n: (out / n).stat().st_mtime_ns for n in first["files"]} == stamp, "not written a second time"
    # another range writing right now: this one leaves it to that one
    (out / samples.TOKEN_DATASET_MARK).unlink()
    (out / samples.TOKEN_DATASET_LOCK).write_text(json.dumps({"writer": "0-1"}))
    assert samples.publish_token_dataset(out, rows, (1, 2), "sha-1") == {"files": [], "written": False,
                                                                         "writer": "0-1"}
    # its own lock, left by a killed attempt of the same range, is taken over
    again = samples.publish_token_dataset(out, rows, (0, 1), "sha-1")
    assert again["written"] and not (out / samples.TOKEN_DATASET_LOCK).exists()


def test_the_host_merge_refuses_ranges_made_from_other_inputs(tmp_path, remote_pkg):
    from remote.extract import merge, samples

    out = tmp_path / "out"
    for (lo, hi), identity in (((0, 2), IDENTITY), ((2, 4), dict(IDENTITY, layer_ids=[1, 2, 3, 4]))):
        shard = samples.shard_dir(out, lo, hi)
        samples.write_json_atomic(shard / "claim.json", {"run_id": "R", "sample_range": [lo, hi], "who": {}})
        samples.write_json_atomic(shard / "manifest.json", {
            "run_id": "R", "sample_range": [lo, hi], "identity": identity, "format_name": "pt",
            "files": [{"index": i, "path": f"data_{i}.pt", "sha256": "0" * 64, "bytes": 1} for i in range(lo, hi)]})
    got = merge.main({"output_dir": str(out), "run_id": "R"})
    rec, = got["records"]
    assert rec["status"] == "fail" and "ranges 0-2 and 2-4" in rec["summary"]
    assert "layer_ids (the layer ids): [2, 4, 5, 7] -> [1, 2, 3, 4]" in rec["summary"]
    assert not (out / "manifest.json").exists(), "nothing half-merged is written"


# --------------------------------------------------------------------------- over SSH

def shared_inventory(tmp_path: Path, testhost: dict, python, model, dataset, **fields) -> Path:
    """Hosts a and b on the one test sshd: own work dirs, one output dir."""
    def host(name: str) -> dict:
        return {"address": "127.0.0.1", "port": testhost["port"], "user": testhost["user"], "key": testhost["key"],
                "known_hosts": testhost["known_hosts"], "python": str(python),
                "work_dir": str(tmp_path / name / "work"), "output_dir": str(tmp_path / "shared"),
                "model_path": str(model), "dataset": str(dataset), "device": "cpu", "connect_timeout": 5, **fields}

    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"a": host("a"), "b": host("b")}, "groups": {"pair": ["a", "b"]}}))
    return path


def assert_shared_run(tmp_path: Path, runs: Path, run_id: str, total: int) -> dict:
    """Every sample once in the shared dir, each range's own files apart, one merged manifest there and here."""
    out = tmp_path / "shared" / run_id
    group_doc = json.loads((runs / run_id / "group.json").read_text())
    assert {s["output_dir"] for s in group_doc["shards"]} == {str(out)}
    assert group_doc["hosts"]["a"]["storage"]["shared_with"] == ["a", "b"]
    assert sorted(p.name for p in out.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(total))
    assert not list(out.glob(".partial-*")) and not list(out.glob(".specops-probe-*"))
    ranges = sorted(f"{s['start']}-{s['stop']}" for s in group_doc["shards"])
    assert sorted(p.name for p in (out / ".specops-shards").iterdir()) == ranges
    for shard in group_doc["shards"]:  # each range's own manifest lists its own samples only
        own = json.loads((out / ".specops-shards" / f"{shard['start']}-{shard['stop']}" / "manifest.json").read_text())
        assert [f["index"] for f in own["files"]] == list(range(shard["start"], shard["stop"]))
        st = status_file(tmp_path, shard["hosts"][0], run_id)
        assert st["state"] == "done" and st["sample_range"] == [shard["start"], shard["stop"]]
        assert st["samples_done"] == st["samples_total"] == shard["stop"] - shard["start"]
    on_host = json.loads((out / "manifest.json").read_text())  # made on the host: the dir's one manifest
    assert on_host["complete"] and [f["index"] for f in on_host["files"]] == list(range(total))
    for f in on_host["files"]:
        assert blake3_of(out / f["path"]) == f["blake3"]
    group = "+".join(group_doc["hosts"]["a"]["storage"]["shared_with"])
    fetched = runs / run_id / "shared" / group / "manifest.json"  # and brought back without a tensor
    assert json.loads(fetched.read_text()) == on_host
    assert not (runs / run_id / "samples").exists()
    laptop = json.loads((runs / run_id / "manifest.json").read_text())
    assert laptop["complete"] and [(f["index"], f["blake3"]) for f in laptop["files"]] == [
        (f["index"], f["blake3"]) for f in on_host["files"]]
    return on_host


#: the seed engine on the CPU test host: each host's generator on one core (the dp 2 run below gives each
#: replica one core of its own, so the two runs' ranks compute with the same threads)
SEED_FIELDS = dict(engine="speculators-0.3", tp=1, max_samples=6, seq_len=64, batch_size=3)
SEED_ENV = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def seed_pair_run(tmp_path_factory, testhost, patched_python, tiny_models) -> dict:
    """One group run of the seed engine on hosts a and b sharing one output dir (dp 1 each, one core each),
    shared by the tests that read it."""
    tmp_path = tmp_path_factory.mktemp("seed-pair")
    runs = tmp_path / "runs"
    inv = shared_inventory(tmp_path, testhost, patched_python, tiny_models["llama"], tiny_models["dataset"],
                           **SEED_FIELDS, env={**SEED_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    proc = cli("extract", "--inventory", str(inv), "--on", "pair", "--run-id", "SH1", "--skip-smoke",
               "--skip-preflight", "--json", runs=runs, timeout=900)
    return {"tmp_path": tmp_path, "runs": runs, "inventory": inv, "proc": proc}


@pytest.mark.vllm
def test_two_hosts_on_one_shared_output_dir_extract_every_sample_once_seed_engine(seed_pair_run):
    tmp_path, runs, proc = seed_pair_run["tmp_path"], seed_pair_run["runs"], seed_pair_run["proc"]
    assert proc.returncode == ExitCode.SUCCESS, proc.stdout[-4000:] + proc.stderr[-4000:]
    said = records_of(proc.stdout)
    shared = said["group"]["group.storage"]
    assert "a, b share one output dir" in shared["summary"] and shared["detail"]["groups"] == [["a", "b"]]
    assert said["a"]["shard.storage"]["status"] == "ok"
    assert said["shared@a+b"]["merge.manifest"]["status"] == "ok"
    merged = assert_shared_run(tmp_path, runs, "SH1", 6)
    assert merged["layer_ids"] == [2, 4, 5, 7] and merged["layer_convention"] == "output"
    assert {f["host"] for f in merged["files"]} == {this_host_name()}, "each file names the host that wrote it"
    assert sorted(merged["merged_from"]) == ["0-3", "3-6"]
    assert all(s["engine"]["name"] == "speculators-0.3" for s in merged["merged_from"].values())


#: every sample of two dirs of data_{i}.pt: the same ids and mask, each layer bitwise equal or its largest difference
SAME_SAMPLES = r"""
import json, sys, torch
out = []
for i in range(int(sys.argv[3])):
    a, b = (torch.load(f"{d}/data_{i}.pt", weights_only=True) for d in sys.argv[1:3])
    pairs = list(zip(a["hidden_states"], b["hidden_states"]))
    out.append({"index": i, "ids": a["input_ids"].tolist() == b["input_ids"].tolist(),
                "mask": a["loss_mask"].tolist() == b["loss_mask"].tolist(), "layers": [len(a["hidden_states"]), len(pairs)],
                "bitwise": all(torch.equal(x, y) for x, y in pairs),
                "max_abs_diff": max(float((x.float() - y.float()).abs().max()) for x, y in pairs)})
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_dp2_seed_engine_one_generator_process_per_core_equals_the_one_core_run(seed_pair_run, testhost,
                                                                                patched_python):
    """``dp: 2`` on one host of the seed engine (one generator process per core, each batch split between
    them) against the pair's one-core runs of the same rows: bitwise equal sample by sample, every sample
    once under the same names, the manifest's engine ``dp: 2`` with its two replicas, a log per replica."""
    import os
    import subprocess

    from remote.run.rundir import run_processes

    assert seed_pair_run["proc"].returncode == ExitCode.SUCCESS, seed_pair_run["proc"].stdout[-3000:]
    tmp_path = seed_pair_run["tmp_path"]
    host = yaml.safe_load(seed_pair_run["inventory"].read_text())["hosts"]["a"]
    host.update(dp=2, work_dir=str(tmp_path / "dp2" / "work"), output_dir=str(tmp_path / "dp2" / "out"), env=SEED_ENV)
    inv = tmp_path / "dp2.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"th": host}}))
    proc = cli("extract", "--inventory", str(inv), "--run-id", "SD2", "--skip-smoke", "--skip-preflight", "--json",
               runs=tmp_path / "dp2" / "runs", timeout=900)
    assert proc.returncode == ExitCode.SUCCESS, proc.stdout[-4000:] + proc.stderr[-4000:]

    one, two = tmp_path / "shared" / "SH1", tmp_path / "dp2" / "out" / "SD2"
    names = sorted(p.name for p in two.glob("data_*.pt"))
    assert names == sorted(p.name for p in one.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(6))
    found = subprocess.run([str(patched_python), "-c", SAME_SAMPLES, str(one), str(two), "6"], capture_output=True,
                           text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    for sample in json.loads(found.stdout):
        print(f"data_{sample['index']}.pt: bitwise {sample['bitwise']}, max |diff| {sample['max_abs_diff']:.3g}")
        assert sample["ids"] and sample["mask"] and sample["layers"] == [4, 4], sample
        assert sample["bitwise"], sample  # one core per replica, as each one-core host: the same threads

    manifest = json.loads((two / "manifest.json").read_text())
    merged = json.loads((one / "manifest.json").read_text())
    assert [(f["index"], f["path"], f["tokens"]) for f in manifest["files"]] == [
        (f["index"], f["path"], f["tokens"]) for f in merged["files"]]
    engine = manifest["engine"]
    cores = sorted(os.sched_getaffinity(0))  # the loopback test host's cores: halves, one replica each
    halves = [cores[:len(cores) // 2], cores[len(cores) // 2:]]
    assert engine["name"] == "speculators-0.3" and engine["dp"] == 2 and engine["replicas_lost"] is None, engine
    assert [(r["name"], r["devices"], r["samples"]) for r in engine["replicas"]] == [("dp0", halves[0], 3),
                                                                                   ("dp1", halves[1], 3)]
    run_dir = tmp_path / "dp2" / "work" / "runs" / "SD2"
    for name in ("dp0", "dp1"):  # each replica's own log and its rank's
        assert f"replica {name} (pid" in (run_dir / "logs" / name / "replica.log").read_text()
        assert (run_dir / "logs" / name / "rank0.log").is_file()
    wait_for(lambda: not run_processes(run_dir), timeout=60, what="no process of the run")


def this_host_name() -> str:
    import socket

    return socket.gethostname()


def test_a_shared_dir_resumes_each_shard_in_its_own_range_and_refuses_another_dataset(tmp_path, testhost,
                                                                                    hostenv_python, tiny_models):
    """The reference engine (seconds to load): a stopped group resumes, each shard counting only its range;
    the same run id with another dataset on the dir is refused, naming what differs, and changes nothing."""
    runs = tmp_path / "runs"
    inv = shared_inventory(tmp_path, testhost, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                           engine="hf-reference", tp=1, max_samples=8, seq_len=64, batch_size=1, env=OFFLINE)
    doc = yaml.safe_load(inv.read_text())  # b pauses after each sample: a window to stop it mid-range
    doc["hosts"]["b"]["env"] = {**OFFLINE, "SPECOPS_BATCH_DELAY_S": "2.0"}
    inv.write_text(yaml.safe_dump(doc))
    started = cli("extract", "--inventory", str(inv), "--on", "pair", "--run-id", "SH2", "--skip-preflight",
                  "--skip-smoke", "--detach", runs=runs)
    assert started.returncode == ExitCode.SUCCESS, started.stdout + started.stderr
    wait_for(lambda: (status_file(tmp_path, "b", "SH2").get("samples_done") or 0) >= 1, what="b's first sample")
    stopped = cli("abort", "--inventory", str(inv), "--run-id", "SH2", runs=runs, timeout=120)
    assert stopped.returncode == ExitCode.SUCCESS, stopped.stdout + stopped.stderr
    first = {h: status_file(tmp_path, h, "SH2") for h in "ab"}
    assert first["b"]["state"] == "aborted" and 1 <= first["b"]["samples_done"] < 4, first["b"]

    again = cli("extract", "--inventory", str(inv), "--run-id", "SH2", "--json", runs=runs)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    for host, (lo, hi) in {"a": (0, 4), "b": (4, 8)}.items():
        st = status_file(tmp_path, host, "SH2")
        assert st["state"] == "done" and st["sample_range"] == [lo, hi]
        if first[host]["state"] == "done":  # a may have finished before the abort: not run again
            assert st["attempt"] == 1
            continue
        # its own range only: the other shard's files in the dir do not count as its progress
        assert st["attempt"] == 2 and st["resumed_from"] == lo + first[host]["samples_done"], (host, st, first)
    before = assert_shared_run(tmp_path, runs, "SH2", 8)
    files = {p.name: blake3_of(p) for p in (tmp_path / "shared" / "SH2").glob("data_*.pt")}

    # the same run id from another laptop and work dirs (another team on the cluster), with another
    # dataset (12 samples) into the same shared dir: refused, naming what differs
    doc = yaml.safe_load(inv.read_text())
    for name in "ab":
        doc["hosts"][name]["work_dir"] = str(tmp_path / f"{name}-other" / "work")
    inv.write_text(yaml.safe_dump(doc))
    other = cli("extract", "--inventory", str(inv), "--on", "pair", "--run-id", "SH2", "--max-samples", "12",
                "--skip-preflight", "--skip-smoke", "--json", runs=tmp_path / "runs-other")
    assert other.returncode == ExitCode.from_job_state("failed"), other.stdout[-3000:] + other.stderr[-3000:]
    for shard in ("s0@a", "s1@b"):
        run = records_of(other.stdout)[shard]["group.run"]
        assert run["status"] == "fail" and "was first written with other inputs" in run["summary"], run
        error = run["detail"]["error"]["message"]
        assert "dataset_samples (the number of samples in the dataset): 8 -> 12" in error, error
        assert "dataset_sha256 (the token rows" in error and "layer_ids" not in error.split("What differs")[1]
    assert {p.name: blake3_of(p) for p in (tmp_path / "shared" / "SH2").glob("data_*.pt")} == files, "nothing changed"
    assert json.loads((tmp_path / "shared" / "SH2" / "manifest.json").read_text()) == before


def test_hosts_that_share_a_work_dir_are_refused_before_anything_starts(tmp_path, testhost, hostenv_python,
                                                                         tiny_models):
    """One work dir (a shared home's ~/.specops) would be one run dir for every shard: the plan says so."""
    runs = tmp_path / "runs"
    inv = shared_inventory(tmp_path, testhost, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                           engine="hf-reference", tp=1, max_samples=4, seq_len=64, batch_size=1, env=OFFLINE)
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"]["b"]["work_dir"] = doc["hosts"]["a"]["work_dir"]
    inv.write_text(yaml.safe_dump(doc))
    proc = cli("extract", "--inventory", str(inv), "--on", "pair", "--run-id", "SW1", "--skip-preflight", "--json",
               runs=runs, timeout=300)
    assert proc.returncode == ExitCode.FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    group_doc = records_of(proc.stdout).get("group", {})
    assert "group.work_dir" in group_doc, proc.stdout[-4000:] + proc.stderr[-2000:]
    said = group_doc["group.work_dir"]
    assert said["status"] == "fail" and f"a, b share one work dir ({tmp_path / 'a' / 'work'})" in said["summary"]
    assert "give each host its own work_dir" in said["fix"]
    assert not (runs / "SW1").exists() and not (tmp_path / "a" / "work" / "runs" / "SW1").exists()
