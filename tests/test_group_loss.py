"""No sample lost, none wrong: a group run over real SSH whose disks change under it (issue 20).

Three hosts as in :mod:`test_group_remote` (``a`` and ``b`` on the session's sshd, ``c`` on
its own, so it can die), the transformers reference engine, 12 samples: ``a`` makes
``[0, 4)``, ``b`` ``[4, 8)``, ``c`` ``[8, 12)``. Each stage damages what a finished (or
half-finished) run left on a host's disk or on the laptop, and checks that the next
command believes the disk: the sample is made again, or refused, with an exit code and a
record that say so; a command that reports done never leaves a gap. (The stages that start
from a finished run share one: each leaves it whole again.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.exit_codes import ExitCode
from test_group_remote import (OFFLINE, assert_merged, c_up, cli, host_c, kill_host, records_of,  # noqa: F401
                               revive_host, blake3_of, status_file, wait_for, write_inventory)


@pytest.fixture
def fast_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models):  # noqa: F811
    return write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                           engine="hf-reference", tp=1, max_samples=12, seq_len=64, batch_size=2, env=OFFLINE)


@pytest.fixture
def slow_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models):  # noqa: F811
    # one sample a batch and a pause after each: a window to act mid-run
    return write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                           engine="hf-reference", tp=1, max_samples=12, seq_len=64, batch_size=1,
                           env={**OFFLINE, "SPECOPS_BATCH_DELAY_S": "1.5"})


def done_run(inv: Path, runs: Path, run_id: str, *extra: str) -> None:
    """A 3-host group run, followed to the end: every shard done."""
    got = cli("extract", "--inventory", str(inv), "--on", "trio", "--run-id", run_id, "--skip-preflight",
              "--skip-smoke", "--json", *extra, runs=runs)
    assert got.returncode == ExitCode.SUCCESS, got.stdout[-3000:] + got.stderr[-3000:]
    for name in ("a", "b", "c"):
        assert status_file(inv.parent, name, run_id)["state"] == "done"
        runs_dir = inv.parent / name / "work" / "runs"
        assert not [p for p in runs_dir.iterdir() if p.name.startswith("smoke-")], "--skip-smoke rehearses nowhere"


def shard_map(runs: Path, run_id: str) -> list[tuple]:
    group_doc = json.loads((runs / run_id / "group.json").read_text())
    return [(s["id"], s["hosts"], s["start"], s["stop"], s["run_id"]) for s in group_doc["shards"]]


# ------------------------------------------------------------------- 1: a sample deleted after its shard finished

def test_a_finished_group_run_believes_its_disks(fast_inventory, tmp_path):
    """One finished 3-host run (its samples fetched), damaged three ways in turn; each stage
    leaves every sample whole again, on the hosts and on the laptop."""
    runs = tmp_path / "runs"
    done_run(fast_inventory, runs, "L", "--tensors")
    a_sample_deleted_after_its_shard_finished_is_made_again_by_resume(fast_inventory, tmp_path)
    reassign_believes_the_disk_of_a_finished_shard_and_a_second_one_says_why_it_does_nothing(fast_inventory, tmp_path)
    fetch_refuses_a_host_file_whose_size_changed_and_keeps_the_good_copy(fast_inventory, tmp_path)


def a_sample_deleted_after_its_shard_finished_is_made_again_by_resume(fast_inventory, tmp_path):
    runs, inv = tmp_path / "runs", str(fast_inventory)
    gone = tmp_path / "b" / "out" / "L" / "data_5.pt"
    gone.unlink()

    looked = cli("status", "--inventory", inv, "--run-id", "L", "--json", runs=runs, timeout=120)
    assert looked.returncode == ExitCode.FAILED, looked.stdout[-3000:] + looked.stderr[-3000:]
    shown = {h["host"]: h for h in json.loads(looked.stdout)["hosts"]}
    assert shown["s1@b"]["data"]["state"] == "incomplete" and shown["s1@b"]["data"]["disk_first_missing"] == 5
    said = {r["name"]: r for r in shown["s1@b"]["records"]}["group.disk"]
    assert said["status"] == "fail" and "extract --run-id L" in said["fix"]
    assert shown["s0@a"]["data"]["state"] == shown["s2@c"]["data"]["state"] == "done"

    # the same command again believes b's disk, not its status file: b's run resumes and makes data_5 only
    again = cli("extract", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    b = status_file(tmp_path, "b", "L")
    assert b["state"] == "done" and b["attempt"] == 2 and b["resumed_from"] == 5
    assert status_file(tmp_path, "a", "L")["attempt"] == 1, "a shard whose disk is whole is not run again"
    assert gone.is_file()
    assert_merged(runs, "L", 12, tmp_path)

    # --force believes the disk too
    (tmp_path / "a" / "out" / "L" / "data_1.pt").unlink()
    forced = cli("extract", "--inventory", inv, "--run-id", "L", "--force", "--json", runs=runs)
    assert forced.returncode == ExitCode.SUCCESS, forced.stdout[-3000:] + forced.stderr[-3000:]
    assert status_file(tmp_path, "a", "L")["resumed_from"] == 1
    assert (tmp_path / "a" / "out" / "L" / "data_1.pt").is_file()

    # nothing left to run: said so, and the files are still fetched (not "started detached (0 running)")
    (runs / "L" / "samples" / "data_9.pt").unlink()
    idle = cli("extract", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert idle.returncode == ExitCode.SUCCESS, idle.stdout[-3000:] + idle.stderr[-3000:]
    group = records_of(idle.stdout)["group"]
    assert group["group.run"]["status"] == "ok" and "nothing left to run" in group["group.run"]["summary"]
    assert group["group.merge"]["status"] == "ok" and "12 sample(s) of 12" in group["group.merge"]["summary"]
    assert_merged(runs, "L", 12, tmp_path)
    human = cli("extract", "--inventory", inv, "--run-id", "L", runs=runs)
    assert human.returncode == ExitCode.SUCCESS and "started detached" not in human.stdout, human.stdout[-2000:]
    assert "nothing left to run" in human.stdout


def reassign_believes_the_disk_of_a_finished_shard_and_a_second_one_says_why_it_does_nothing(fast_inventory,
                                                                                             tmp_path):
    runs, inv = tmp_path / "runs", str(fast_inventory)
    (tmp_path / "b" / "out" / "L" / "data_6.pt").unlink()

    moved = cli("extract", "--inventory", inv, "--run-id", "L", "--reassign", "b=a", "--tensors", "--json",
                runs=runs)
    assert moved.returncode == ExitCode.SUCCESS, moved.stdout[-3000:] + moved.stderr[-3000:]
    said = records_of(moved.stdout)["group"]["group.reassign"]
    assert said["status"] == "changed" and "[6, 8) moved from b to a" in said["summary"]
    assert "disk" in said["detail"]["how"]
    assert shard_map(runs, "L") == [("s0", ["a"], 0, 4, "L"), ("s1", ["b"], 4, 6, "L"),
                                     ("s1m1", ["a"], 6, 8, "L.s1m1"), ("s2", ["c"], 8, 12, "L")]
    merged = assert_merged(runs, "L", 12, tmp_path)
    assert {f["index"]: f["shard"] for f in merged["files"]}[7] == "s1m1"

    twice = cli("extract", "--inventory", inv, "--run-id", "L", "--reassign", "b=a", "--json", runs=runs)
    assert twice.returncode == ExitCode.SUCCESS, twice.stdout[-3000:] + twice.stderr[-3000:]
    again = records_of(twice.stdout)["group"]["group.reassign"]
    assert again["status"] == "skipped" and "nothing to move" in again["summary"] and "s1@b" in again["summary"]
    assert len(shard_map(runs, "L")) == 4, "a move asked twice changes nothing"

    for text, words in [(" , ", "names no move"), ("b=a,b=c", "moves 'b' twice")]:
        bad = cli("extract", "--inventory", inv, "--run-id", "L", "--reassign", text, runs=runs, timeout=120)
        assert bad.returncode == ExitCode.USAGE and "--reassign" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
        assert words in bad.stdout + bad.stderr
    assert len(shard_map(runs, "L")) == 4


# ------------------------------------------------------------------- 3, 13: a host file that changed; a junk .part

def fetch_refuses_a_host_file_whose_size_changed_and_keeps_the_good_copy(fast_inventory, tmp_path):
    runs, inv = tmp_path / "runs", str(fast_inventory)
    local = runs / "L" / "samples" / "data_5.pt"
    good = blake3_of(local)
    on_b = tmp_path / "b" / "out" / "L" / "data_5.pt"
    assert blake3_of(on_b) == good
    with open(on_b, "r+b") as fh:
        fh.truncate(1000)

    fetched = cli("fetch", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert fetched.returncode == ExitCode.FAILED, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    said = records_of(fetched.stdout)["s1@b"]["group.changed"]
    assert said["status"] == "fail" and "data_5.pt" in said["summary"]
    assert said["detail"]["changed"][0]["manifest_blake3"] == good and said["detail"]["changed"][0]["bytes"] == 1000
    assert blake3_of(local) == good, "the good local copy is never overwritten"
    merged = json.loads((runs / "L" / "manifest.json").read_text())
    assert 5 in merged["missing"] and 5 not in {f["index"] for f in merged["files"]}
    assert records_of(fetched.stdout)["group"]["group.merge"]["status"] != "ok"

    # its fix works: remove the damaged copy on the host, resume, and the sample is made again
    on_b.unlink()
    again = cli("extract", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    assert_merged(runs, "L", 12, tmp_path)

    # a laptop copy gone with a junk .part beside it: the fetch starts that file over, and says ok only then
    (runs / "L" / "samples" / "data_2.pt").unlink()
    (runs / "L" / "samples" / "data_2.pt.part").write_bytes(b"junk" * 16)
    refetched = cli("fetch", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert refetched.returncode == ExitCode.SUCCESS, refetched.stdout[-3000:] + refetched.stderr[-3000:]
    assert records_of(refetched.stdout)["group"]["group.merge"]["status"] == "ok"
    assert not (runs / "L" / "samples" / "data_2.pt.part").exists()
    assert_merged(runs, "L", 12, tmp_path)

    # a host file of the right size but other bytes cannot be fetched: the merge never says ok without it
    flipped = tmp_path / "c" / "out" / "L" / "data_9.pt"  # (data_6 has moved to a)
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    (runs / "L" / "samples" / "data_9.pt").unlink()
    broken = cli("fetch", "--inventory", inv, "--run-id", "L", "--tensors", "--json", runs=runs)
    assert broken.returncode == ExitCode.FAILED, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert records_of(broken.stdout)["s2@c"]["group.tensors"]["status"] == "fail"
    merge = records_of(broken.stdout)["group"]["group.merge"]
    assert merge["status"] == "fail" and "data_9.pt" in merge["summary"], merge


# ------------------------------------------------------------------- 2, 4: reassign away from a dead host with a hole

def test_reassign_from_a_dead_host_with_a_hole_makes_the_hole_again_once_it_answers(
        slow_inventory, host_c, tmp_path):  # noqa: F811
    from specops import wire

    runs, inv = tmp_path / "runs", str(slow_inventory)
    port = host_c.port
    rid = "L5-" + "x" * (wire.protocol.USER_RUN_ID_MAX - 3)  # the longest a user may give
    started = cli("extract", "--inventory", inv, "--on", "trio", "--run-id", rid, "--skip-preflight", "--skip-smoke",
                  "--detach", runs=runs)
    assert started.returncode == ExitCode.SUCCESS, started.stdout + started.stderr
    wait_for(lambda: (status_file(tmp_path, "c", rid).get("samples_done") or 0) >= 2, what="c's second sample")
    looked = cli("status", "--inventory", inv, "--run-id", rid, runs=runs, timeout=120)  # the laptop sees c's progress
    assert looked.returncode == ExitCode.JOB_RUNNING, looked.stdout + looked.stderr
    kill_host(host_c, tmp_path / "c" / "work" / "runs" / rid)
    seen = json.loads((runs / rid / "group.json").read_text())["shards"][2]["seen"]["samples_done"]
    assert seen >= 2
    (tmp_path / "c" / "out" / rid / "data_8.pt").unlink()  # a hole below what the status counted

    moved = cli("extract", "--inventory", inv, "--run-id", rid, "--reassign", "c=a", "--json", runs=runs)
    assert moved.returncode == ExitCode.UNREACHABLE, moved.stdout[-3000:] + moved.stderr[-3000:]
    said = records_of(moved.stdout)["group"]["group.reassign"]
    assert said["status"] == "changed" and "not checked on its disk" in said["detail"]["how"]
    cut = 8 + seen
    assert shard_map(runs, rid)[2:] == [("s2", ["c"], 8, cut, rid), ("s2m1", ["a"], cut, 12, f"{rid}.s2m1")]
    assert not json.loads((runs / rid / "group.json").read_text())["shards"][2]["cut_checked"]

    revive_host(host_c, port)
    again = cli("extract", "--inventory", inv, "--run-id", rid, "--tensors", "--json", runs=runs)
    assert again.returncode == ExitCode.SUCCESS, again.stdout[-3000:] + again.stderr[-3000:]
    gap = records_of(again.stdout)["group"]["group.gap"]
    assert gap["status"] == "changed" and f"[8, {cut}) is made again there as s2m2@c" in gap["summary"]
    assert shard_map(runs, rid)[2:] == [("s2", ["c"], 8, 8, rid), ("s2m2", ["c"], 8, cut, f"{rid}.s2m2"),
                                        ("s2m1", ["a"], cut, 12, f"{rid}.s2m1")]
    assert len(f"{rid}.s2m2") <= wire.protocol.RUN_ID_MAX
    merged = assert_merged(runs, rid, 12, tmp_path)
    assert {f["shard"] for f in merged["files"] if 8 <= f["index"] < cut} == {"s2m2"}
    final = cli("status", "--inventory", inv, "--run-id", rid, runs=runs, timeout=120)
    assert final.returncode == ExitCode.SUCCESS, final.stdout


# --------------------------------------------------------------------------- 4, 11: bad ids and weights

def test_a_run_id_without_room_for_the_move_suffix_and_huge_weights_are_usage_errors(fast_inventory, tmp_path):
    from specops import wire

    runs, inv = tmp_path / "runs", str(fast_inventory)
    long_id = "r" * 126  # the host takes 128, but a moved range would append .s2m1
    got = cli("extract", "--inventory", inv, "--on", "trio", "--run-id", long_id, "--skip-preflight", runs=runs,
              timeout=120)
    said = got.stdout + got.stderr
    assert got.returncode == ExitCode.USAGE and "--run-id" in said, said
    assert f"at most {wire.protocol.USER_RUN_ID_MAX}" in said
    for weights in ("a=1e308", "a=1e308,b=1e308,c=1e308", "a=1e308,b=1e308"):
        got = cli("extract", "--inventory", inv, "--on", "trio", "--run-id", "L6", "--skip-preflight",
                  "--shard-by", weights, runs=runs, timeout=120)
        said = got.stdout + got.stderr
        assert got.returncode == ExitCode.USAGE and "--shard-by" in said and "Traceback" not in said, said
    assert not (runs / "L6").exists(), "nothing planned, nothing started"
