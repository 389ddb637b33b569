"""A group run rehearses on every host before it starts, and ``verify`` knows it by its run id.

Hosts ``a`` and ``b`` as in :mod:`test_group_remote` (the session's sshd, each with its
own work and output dir), over real SSH; the transformers reference engine on the tiny
Llama, 4 samples: ``a`` makes ``[0, 2)``, ``b`` ``[2, 4)``. (The reassigned case, a range
verified under its ``R.<shard>`` run id on the host it moved to, is
``test_reassign_moves_the_rest_of_a_dead_hosts_shard_no_sample_twice_none_lost``.)
"""
from __future__ import annotations

import json
from pathlib import Path

from specops.exit_codes import ExitCode
from test_group_remote import OFFLINE, c_up, cli, host_c, records_of, write_inventory  # noqa: F401


def smoke_runs(tmp_path: Path, host: str) -> list[str]:
    """The rehearsal runs a host's work dir holds (``smoke-<twin hash>-<time>``)."""
    runs = tmp_path / host / "work" / "runs"
    return sorted(p.name for p in runs.iterdir() if p.name.startswith("smoke-")) if runs.is_dir() else []


def test_a_group_run_smokes_every_host_first_and_verify_checks_every_shard(tmp_path, testhost, c_up, hostenv_python,
                                                                           tiny_models):  # noqa: F811
    runs = tmp_path / "runs"
    inv = str(write_inventory(tmp_path, testhost, c_up, hostenv_python, tiny_models["llama"], tiny_models["dataset"],
                              engine="hf-reference", tp=1, max_samples=4, seq_len=64, batch_size=2, env=OFFLINE))
    proc = cli("extract", "--inventory", inv, "--on", "a,b", "--run-id", "V1", "--skip-preflight", "--json",
               runs=runs, timeout=900)
    assert proc.returncode == ExitCode.SUCCESS, proc.stdout[-4000:] + proc.stderr[-4000:]
    said = records_of(proc.stdout)
    for name in ("a", "b"):  # the CLI's default: a rehearsal on a tiny twin on every host, before any shard
        assert said[name]["group.smoke"]["status"] == "ok", said[name]
        assert smoke_runs(tmp_path, name), f"no rehearsal ran on {name}"
    group_doc = json.loads((runs / "V1" / "group.json").read_text())
    assert [(s["id"], s["hosts"], s["start"], s["stop"]) for s in group_doc["shards"]] == [
        ("s0", ["a"], 0, 2), ("s1", ["b"], 2, 4)]

    # verify by the group's run id: every shard on its host, one report each, and the group's verdict
    checked = cli("verify", "--inventory", inv, "--run-id", "V1", "--samples", "2", "--json", runs=runs,
                  timeout=900)
    assert checked.returncode == ExitCode.SUCCESS, checked.stdout[-4000:] + checked.stderr[-4000:]
    said = records_of(checked.stdout)
    assert set(said) == {"s0@a", "s1@b", "group"}
    for label in ("s0@a", "s1@b"):
        assert said[label]["verify.run"]["status"] == "ok" and "2 of 2 sample(s)" in said[label]["verify.run"]["summary"]
        assert not [r for r in said[label].values() if r["status"] == "fail"], said[label]
    assert said["group"]["group.verify"]["status"] == "ok" and "2 of 2 shard(s)" in said["group"]["group.verify"]["summary"]

    # a sample changed on b's disk fails b's shard, and the group with it; a's shard still verifies
    victim = tmp_path / "b" / "out" / "V1" / "data_3.pt"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = cli("verify", "--inventory", inv, "--run-id", "V1", "--samples", "2", "--json", runs=runs, timeout=900)
    assert bad.returncode == ExitCode.FAILED, bad.stdout[-4000:] + bad.stderr[-4000:]
    said = records_of(bad.stdout)
    assert said["s1@b"]["verify.files"]["status"] == "fail" and said["s0@a"]["verify.run"]["status"] == "ok"
    assert said["group"]["group.verify"]["status"] == "fail" and "failed: s1@b" in said["group"]["group.verify"]["summary"]
