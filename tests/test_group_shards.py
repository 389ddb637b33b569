"""The shard map's math and rules, without any host: sizes, weights, cuts, coverage, agreement."""
from __future__ import annotations

import threading
import time

import pytest

from specops.runs import shardmap as shards
from specops.errors import UsageError
from specops.transport.parallel import run_steps
from specops.runs.plan import agreement, check_shared_params
from specops.result import HostReport
from specops.runs.shardmap import GroupMap, Shard


def sizes(ranges):
    return {h: stop - start for h, (start, stop) in ranges.items()}


def assert_partition(ranges, total):
    at = 0
    for start, stop in ranges.values():
        assert start == at and stop >= start
        at = stop
    assert at == total


@pytest.mark.parametrize("total,hosts", [(0, 3), (1, 3), (2, 3), (7, 3), (10, 4), (1000, 7), (5, 1)])
def test_equal_split_is_contiguous_and_uneven_by_at_most_one(total, hosts):
    ranges = shards.split(total, {f"h{i}": 1 for i in range(hosts)})
    assert_partition(ranges, total)
    n = list(sizes(ranges).values())
    assert max(n) - min(n) <= 1
    assert n == sorted(n, reverse=True), "the remainder goes to the first hosts"


def test_more_hosts_than_samples_leaves_the_last_hosts_empty():
    ranges = shards.split(2, {"a": 1, "b": 1, "c": 1, "d": 1})
    assert ranges == {"a": (0, 1), "b": (1, 2), "c": (2, 2), "d": (2, 2)}
    manifest = GroupMap(run_id="r", total=2, shards=shards.plan("r", 2, {"a": 1, "b": 1, "c": 1, "d": 1}, {}))
    assert [s.empty for s in manifest.shards] == [False, False, True, True]
    assert [s.head for s in manifest.active()] == ["a", "b"]
    assert shards.coverage_problems(manifest) == []


def test_capacity_weights_follow_data_parallel_width():
    # an 8-GPU host at tp=2 (width 4), a 4-GPU host at tp=4 (width 1), one whose width is unknown (1)
    weights = shards.capacity_weights({"big": 4, "small": 1, "unknown": None})
    assert weights == {"big": 4.0, "small": 1.0, "unknown": 1.0}
    ranges = shards.split(600, weights)
    assert sizes(ranges) == {"big": 400, "small": 100, "unknown": 100}
    assert_partition(ranges, 600)
    # uneven quotas: largest remainders win, the total is exact
    odd = shards.split(10, {"a": 3, "b": 3, "c": 1})
    assert sizes(odd) == {"a": 4, "b": 4, "c": 2}  # quotas 4.29, 4.29, 1.43: the one left goes to c
    assert sum(sizes(odd).values()) == 10
    assert_partition(odd, 10)


def test_split_refuses_nonsense():
    with pytest.raises(ValueError, match="positive"):
        shards.split(10, {"a": 0})
    with pytest.raises(ValueError, match="no hosts"):
        shards.split(10, {})
    with pytest.raises(ValueError, match="negative"):
        shards.split(-1, {"a": 1})


def test_shard_by_parsing_names_the_flag_and_the_fix():
    assert shards.parse_shard_by(None, ["a", "b"]) == ("capacity", None)
    assert shards.parse_shard_by("equal", ["a", "b"]) == ("equal", None)
    assert shards.parse_shard_by("b=1, a=2.5", ["a", "b"]) == ("weights", {"a": 2.5, "b": 1.0})
    for text, words in [("a=2", "no weight to b"), ("a=2,b=x", "not a positive number"), ("a=2,b=0", "positive"),
                        ("a=1,b=1,z=1", "z"), ("a", "not HOST=WEIGHT"), ("a=1,a=2,b=1", "twice")]:
        with pytest.raises(UsageError) as err:
            shards.parse_shard_by(text, ["a", "b"])
        assert "--shard-by" in str(err.value) and words in str(err.value) and err.value.hint


def three_shards(total=30):
    manifest = GroupMap(run_id="g", total=total)
    manifest.shards = shards.plan("g", total, {"a": 1, "b": 1, "c": 1}, {"a": "/o/g", "b": "/o/g", "c": "/o/g"})
    return manifest


def test_reassign_cuts_at_the_first_missing_index_and_keeps_every_sample_once():
    manifest = three_shards()
    b = manifest.shard("s1")
    b.remember({"state": "extracting", "samples_done": 4, "samples_total": 10})
    assert b.first_missing() == 14
    moved = shards.reassign(manifest, b, "c", b.first_missing(), "/o/g.s1m1")
    assert (b.start, b.stop, b.closed) == (10, 14, True)
    assert (moved.id, moved.hosts, moved.start, moved.stop, moved.run_id) == ("s1m1", ["c"], 14, 20, "g.s1m1")
    assert moved.moved_from == "s1" and b.moved_to == ["s1m1"]
    assert shards.coverage_problems(manifest) == []
    # c now holds two shards of the group, under two run ids
    assert [s.run_id for s in manifest.shards_on("c")] == ["g.s1m1", "g"]
    assert [shards.owner_of(manifest, i).id for i in (13, 14, 19, 20)] == ["s1", "s1m1", "s1m1", "s2"]
    # moving the moved range again gets a new id; nothing to move returns None and changes nothing
    again = shards.reassign(manifest, moved, "a", 16, "/o/g.s1m2")
    assert again.id == "s1m2" and again.run_id == "g.s1m2" and shards.coverage_problems(manifest) == []
    before = manifest.model_dump()
    assert shards.reassign(manifest, manifest.shard("s0"), "b", 10, "/x") is None
    assert manifest.model_dump() == before
    with pytest.raises(ValueError, match="outside"):
        shards.reassign(manifest, manifest.shard("s0"), "b", 11, "/x")


def test_a_done_shard_counts_whole_and_a_manifest_round_trips():
    manifest = three_shards(7)
    s = manifest.shard("s0")
    assert s.first_missing() == s.start
    s.remember({"state": "done", "samples_done": 3})
    assert s.first_missing() == s.stop
    again = GroupMap.model_validate_json(manifest.model_dump_json())
    assert again == manifest and again.shard("s0").seen["state"] == "done"


def test_coverage_problems_find_gaps_overlaps_and_overruns():
    manifest = three_shards()
    manifest.shards[1].start = 12
    assert "10..11 belong to no shard" in shards.coverage_problems(manifest)[0]
    manifest = three_shards()
    manifest.shards[1].start = 8
    assert "overlaps" in shards.coverage_problems(manifest)[0]
    manifest = three_shards()
    manifest.shards[2].stop = 31
    assert "past the 30 samples" in shards.coverage_problems(manifest)[0]


def test_a_shard_may_name_several_hosts():
    shard = Shard(id="s0", hosts=["head", "worker"], start=0, stop=4, run_id="r")
    assert shard.head == "head" and shard.label == "s0@head+worker"
    manifest = GroupMap(run_id="r", total=4, shards=[shard])
    assert manifest.host_names() == ["head", "worker"] and manifest.shards_on("worker") == [shard]


def probe(samples=10, digest="d1", engine="speculators-0.3", convention="output", fmt="data_{i}.pt",
          ids=(2, 4, 5, 7), model_type="deepseek_v3"):
    return {"dataset": {"samples": samples, "sha256": digest, "path": "/d.jsonl"},
            "stack": {"engine": engine, "convention": convention, "format": fmt, "layer_ids": list(ids),
                      "layer_ids_output": list(ids)},
            "model": {"model_type": model_type, "num_hidden_layers": 8, "hidden_size": 256}}


def statuses(records):
    return {r.name: r.status for r in records}


def test_mixed_stacks_are_refused_unless_convention_format_and_tensors_agree():
    same = agreement({"a": probe(), "b": probe(engine="hf-reference")})
    assert statuses(same) == {"group.dataset": "ok", "group.stack": "ok"}
    mixed = agreement({"a": probe(), "b": probe(engine="vllm-server", convention="input", fmt="hs_{i}.safetensors",
                                                ids=(3, 5, 6, 8))})
    assert statuses(mixed)["group.stack"] == "fail"
    bad = next(r for r in mixed if r.name == "group.stack")
    assert "hs_{i}.safetensors" in bad.summary and "data_{i}.pt" in bad.summary and bad.fix
    other_layers = agreement({"a": probe(), "b": probe(ids=(1, 4, 5, 7))})
    assert statuses(other_layers)["group.stack"] == "fail"
    other_data = agreement({"a": probe(), "b": probe(digest="d2")})
    assert statuses(other_data)["group.dataset"] == "fail"
    other_model = agreement({"a": probe(), "b": probe(model_type="llama")})
    assert statuses(other_model)["group.model"] == "fail"


def test_hosts_that_disagree_on_what_sample_i_is_are_a_usage_error(tmp_path):
    import yaml

    from specops.inventory import load_inventory

    base = {"address": "127.0.0.1", "python": "/usr/bin/python3", "model_path": "/m", "output_dir": "/o"}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"a": {**base, "seq_len": 64}, "b": {**base, "seq_len": 128}}}))
    inv = load_inventory(path)
    with pytest.raises(UsageError) as err:
        check_shared_params(list(inv.hosts.values()), {})
    assert "seq_len" in str(err.value) and "a=64" in str(err.value) and "--seq-len" in err.value.hint
    check_shared_params(list(inv.hosts.values()), {"seq_len": "96"})  # one flag for all settles it


def test_a_hung_step_is_reported_and_never_blocks_the_rest():
    release = threading.Event()
    closed = []

    def step(name):
        if name == "hung":
            release.wait(60)
        return HostReport(host=name, task="t")

    t0 = time.monotonic()
    reports = run_steps(["a", "hung", "b"], step, name_of=str, task="t", timeout=1, on_timeout=closed.append)
    waited = time.monotonic() - t0
    release.set()
    assert [r.host for r in reports] == ["a", "hung", "b"]
    assert reports[0].error is None and reports[2].error is None
    assert "no answer within 1s" in reports[1].error and reports[1].exit_code == 2
    assert closed == ["hung"]
    assert waited < 30, "the hung step held the others"


# --------------------------------------------------------------------------- the host side (stdlib, run here)

@pytest.fixture
def remote_pkg(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    for name in [m for m in sys.modules if m == "remote" or m.startswith("remote.")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_host_counts_the_rows_the_supervisor_reads(tmp_path, remote_pkg):
    import json

    from remote.extract.dataset import load_token_samples
    from remote.extract.shard import count_rows

    rows = [json.dumps({"input_ids": [i, i + 1]}) for i in range(7)]
    path = tmp_path / "d.jsonl"
    path.write_text(rows[0] + "\n\n" + "\n".join(rows[1:]) + "\n   \n")  # blank lines are skipped by both
    for max_samples in (None, 3, 7, 50):
        count, digest = count_rows(str(path), max_samples)
        read = load_token_samples({"dataset": str(path), "max_samples": max_samples}, "/nonexistent")
        assert count == len(read), max_samples
    assert count_rows(str(path), 3)[1] != count_rows(str(path), 4)[1]
    other = tmp_path / "e.jsonl"
    other.write_text("\n".join(rows) + "\n")  # the same rows, other blank lines: the same samples
    assert count_rows(str(other), None) == count_rows(str(path), None)


def test_the_host_lists_a_ranges_files_in_either_format(tmp_path, remote_pkg):
    import hashlib
    import json

    import blake3

    from remote.extract import shard

    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    for i in (3, 4, 6):
        (out / f"data_{i}.pt").write_bytes(b"x" * i)
    (out / ".partial-data_5.pt").write_bytes(b"half")
    (out / "data_9.pt").write_bytes(b"out of range")
    # a whole safetensors file (8-byte header length, JSON header, data) and one cut short:
    # only whole hs files count (they are renamed in without a per-file fsync)
    header = json.dumps({"token_ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (out / "hidden_states" / "hs_5.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    (out / "hidden_states" / "hs_7.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 3)
    listed = hashlib.sha256(b"xxx").hexdigest()
    (out / "manifest.json").write_text(json.dumps({"files": [{"path": "data_3.pt", "sha256": listed, "bytes": 3,
                                                              "tokens": 17}]}))
    got = shard.main({"action": "files", "output_dir": str(out), "start": 3, "stop": 8})["data"]
    assert [(f["index"], f["path"]) for f in got["files"]] == [(3, "data_3.pt"), (4, "data_4.pt"),
                                                                (5, "hidden_states/hs_5.safetensors"),
                                                                (6, "data_6.pt")]
    assert got["files"][0]["tokens"] == 17, "the manifest's entry is reused, not hashed again"
    assert got["files"][0]["sha256"] == listed, "an older run's sha256 entry keeps its own algorithm"
    assert got["files"][1]["blake3"] == blake3.blake3(b"xxxx").hexdigest(), "one no manifest lists: BLAKE3 here"
    assert got["first_missing"] == 7 and got["missing"] == 1 and got["hashed_here"] == 3


@pytest.mark.parametrize("text", ["a=1e308", "a=1e308,b=1e308", "a=1e7,b=1", "a=inf,b=1", "a=nan,b=1"])
def test_huge_or_odd_shard_weights_are_a_usage_error_naming_the_flag(text):
    with pytest.raises(UsageError) as err:
        shards.parse_shard_by(text, ["a", "b"] if "b=" in text else ["a"])
    assert "--shard-by" in str(err.value) and err.value.hint and err.value.code == 3


def test_split_is_exact_for_extreme_weight_ratios():
    # weights are ratios: the split normalizes them, so neither huge nor tiny ones overflow
    assert shards.split(12, {"a": 1e300, "b": 1e300, "c": 1e300}) == {"a": (0, 4), "b": (4, 8), "c": (8, 12)}
    assert shards.split(12, {"a": 1e-300, "b": 1.0}) == {"a": (0, 0), "b": (0, 12)}
    assert shards.split(12, {"a": 5e-324, "b": 1e308}) == {"a": (0, 0), "b": (0, 12)}


def test_moved_ids_stay_bounded_and_fit_the_host_for_any_user_run_id(remote_pkg):
    from remote.wire import protocol

    longest = "r" * protocol.USER_RUN_ID_MAX
    manifest = GroupMap(run_id=longest, total=30)
    manifest.shards = shards.plan(longest, 30, {"a": 1, "b": 1, "c": 1}, {"a": "/o", "b": "/o", "c": "/o"})
    shard = manifest.shard("s2")
    for step in range(1, 6):  # move, then move the moved range again and again
        moved = shards.reassign(manifest, shard, "ab"[step % 2], shard.start + 1, "/o")
        assert moved.id == f"s2m{step}" and protocol.RUN_ID_RE.match(moved.run_id)
        shard = moved
    assert len(shards.moved_run_id(longest, f"s{protocol.MOVE_LIMIT - 1}m{protocol.MOVE_LIMIT - 1}")) == \
        protocol.RUN_ID_MAX
    with pytest.raises(UsageError, match="longer than a host takes"):
        shards.moved_run_id("r" * 124, "s1m1")  # an id made before the rule: refused here, not on a host


def test_a_user_run_id_leaves_room_for_every_suffix():
    from specops.runid import check_run_id

    from specops import wire

    protocol = wire.protocol
    assert check_run_id("r" * protocol.USER_RUN_ID_MAX)
    with pytest.raises(UsageError) as err:
        check_run_id("r" * (protocol.USER_RUN_ID_MAX + 1))
    assert f"at most {protocol.USER_RUN_ID_MAX}" in str(err.value) and "--run-id" in str(err.value)
    assert protocol.USER_RUN_ID_MAX + protocol.MOVED_SUFFIX_MAX == protocol.RUN_ID_MAX == 128


@pytest.mark.parametrize("text, words", [(" , ", "names no move"), (",", "names no move"),
                                         ("a=b,a=c", "moves 'a' twice"), ("a=b, a = c", "twice")])
def test_reassign_refuses_nothing_and_a_host_moved_twice(text, words):
    from specops.runs.reassign import parse_reassign

    with pytest.raises(UsageError) as err:
        parse_reassign(text)
    assert "--reassign" in str(err.value) and words in str(err.value) and err.value.hint
    assert parse_reassign("a=b, c=b") == [("a", "b"), ("c", "b")]


def test_the_host_flags_a_file_whose_size_differs_from_its_manifest(tmp_path, remote_pkg):
    import hashlib
    import json

    from remote.extract import shard

    out = tmp_path / "out"
    out.mkdir()
    for i in range(3):
        (out / f"data_{i}.pt").write_bytes(b"x" * 100)
    good = hashlib.sha256(b"x" * 100).hexdigest()
    (out / "manifest.json").write_text(json.dumps({"files": [{"path": f"data_{i}.pt", "sha256": good, "bytes": 100}
                                                             for i in range(3)]}))
    with open(out / "data_1.pt", "r+b") as fh:
        fh.truncate(40)
    got = shard.main({"action": "files", "output_dir": str(out), "start": 0, "stop": 3})["data"]
    assert [f["index"] for f in got["files"]] == [0, 2], "the changed file is not passed on as the sample"
    assert all(f["sha256"] == good for f in got["files"]) and got["hashed_here"] == 0
    assert got["changed"] == [{"index": 1, "path": "data_1.pt", "bytes": 40, "manifest_bytes": 100,
                               "manifest_sha256": good}]
    assert got["first_missing"] == 1, "a cut never keeps a changed file"
