"""remote/wire/manifest.py is the one schema of a run's ``manifest.json``: build, write, read, merge.

Every builder (the supervisor, the host-side merge, the laptop's group merge, the dev
tools) and every reader (verify, fetch, the shard listing) goes through it; these cases
check the schema itself, that a missing or wrong field is named, that an older manifest
still reads, that both merges keep their rules, and that the laptop loads this very file.
Fast: files on disk only, no vLLM, no SSH.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.extract import samples  # noqa: E402
from remote.wire import contract, layers
from remote.wire import manifest as schema  # noqa: E402
from specops import wire  # noqa: E402

IDENTITY = {"dataset_sha256": "ab" * 32, "dataset_samples": 8, "model": {"model_type": "llama"}, "format": "pt",
            "layer_ids": [2, 4, 5, 7], "layer_convention": "output"}


def entry(i: int, **more) -> dict:
    return {"path": samples.sample_name(i), "index": i, "blake3": f"{i:064x}", "bytes": 10 + i, "tokens": 3, **more}


def built(fmt=contract.PT, **more) -> dict:
    args = dict(run_id="R", fmt=fmt, engine={"name": "speculators-0.3", "tp": 1},
                model={"path": "/m", "config": {"model_type": "llama"}}, layer_ids=[2, 4, 5, 7],
                convention=layers.OUTPUT, sample_range=[0, 2], dataset_samples=8, tokens=6,
                files=[entry(0), entry(1)], identity=IDENTITY, versions={"python": "3.10"},
                params={"seq_len": 64, "_private": 1})
    args.update(more)
    return schema.build(**args)


def fields_of(doc: str) -> set:
    return {name for name, field in schema.FIELDS.items() if doc in field.docs.split()}


# --------------------------------------------------------------------------- build, write, read


def test_a_built_manifest_round_trips_and_holds_only_the_run_fields(tmp_path):
    doc = built()
    assert set(doc) <= fields_of("run") and "file_layer_ids" not in doc and "dataset_writer" not in doc
    assert doc["samples"] == 2 and doc["params"] == {"seq_len": 64}, "private params stay out"
    assert doc["format"] == schema.FORMAT_TEXT["pt"] == samples.FORMATS["pt"][2]
    assert doc["layer_convention_text"] == layers.CONVENTIONS["output"]
    path = schema.write_atomic(tmp_path / "out" / contract.MANIFEST, doc, temp_prefix=samples.TEMP_PREFIX)
    assert schema.read(path, schema.FOR_VERIFY) == doc == schema.read(path, schema.FOR_FETCH)
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"], "no temp file left"
    hs = built(contract.HS, dataset_writer="0-2", layer_ids=[5, 2])
    assert hs["file_layer_ids"] == [2, 5] and hs["dataset_writer"] == "0-2"
    assert set(hs) <= fields_of("run")


@pytest.mark.parametrize("doc, require, field, said", [
    ({"files": []}, schema.FOR_VERIFY, "layer_ids", "is missing"),
    ({"layer_ids": [2, 4], "layer_convention": "output", "files": None}, schema.FOR_VERIFY, "files", "is missing"),
    ({"layer_ids": "2,4"}, (), "layer_ids", 'is "2,4", expected a list of integers'),
    ({"layer_convention": "sideways"}, (), "layer_convention", "expected one of ['output', 'input']"),
    ({"sample_range": [4, 2]}, (), "sample_range", "expected [start, stop] with 0 <= start <= stop"),
    ({"files": [entry(0), {"path": "data_1.pt"}], "params": {}}, schema.FOR_FETCH, "files[1]",
     "has no digest (blake3 or sha256)"),
    ({"files": [entry(0, bytes="10")]}, (), "files[0].bytes", "expected a whole number >= 0"),
    ({"files": [entry(0, path="")]}, (), "files[0].path", "is missing"),
    ({"files": ["data_0.pt"]}, (), "files[0]", "expected an object"),
    ({"files": [entry(0)], "params": {}, "engine": "vllm"}, schema.FOR_FETCH, "engine", "expected an object"),
])
def test_a_missing_or_wrong_field_is_named(tmp_path, doc, require, field, said):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(schema.ManifestError) as caught:
        schema.read(path, require)
    assert caught.value.field == field and said in str(caught.value) and str(path) in str(caught.value)
    assert schema.read_quietly(path, require) is None


def test_a_file_that_is_no_manifest_is_refused_as_a_whole(tmp_path):
    for text, said in (("{half", "cannot be read as JSON"), ("[1, 2]", "holds list, expected a JSON object")):
        (tmp_path / "manifest.json").write_text(text)
        with pytest.raises(schema.ManifestError, match=said) as caught:
            schema.read(tmp_path / "manifest.json")
        assert caught.value.field is None
    with pytest.raises(FileNotFoundError):
        schema.read(tmp_path / "none.json")
    with pytest.raises(schema.ManifestError, match="files"):
        schema.write_atomic(tmp_path / "bad.json", {"files": "data_0.pt"})
    assert not (tmp_path / "bad.json").exists(), "a manifest that does not fit is never written"


def test_an_older_manifest_still_reads():
    """Fewer fields (no created_at, sample_range, identity, entry index or bytes), nulls, extra keys."""
    older = {"layer_ids": [2, 4, 5, 7], "layer_convention": "output", "model": {"path": "/m"},
             "params": {"trust_remote_code": False}, "engine": {"name": "transformers float32"}, "file_layer_ids": None,
             "something_new": 1, "files": [{"path": "data_0.pt", "sha256": "0" * 64, "tokens": 5}]}
    assert schema.check(older, schema.FOR_VERIFY) is older


# --------------------------------------------------------------------------- merge


def ranges(*parts):
    return [schema.Range(f"{lo}-{hi}", lo, hi, files, {"range": f"{lo}-{hi}"}) for lo, hi, files in parts]


def test_a_strict_merge_lists_every_sample_once_by_index_and_refuses_overlaps_and_doubles():
    got = schema.merge(ranges((2, 4, [entry(3), entry(2)]), (0, 2, [entry(0), entry(1)])), expected=[(0, 4), (4, 6)])
    assert [e["index"] for e in got["files"]] == [0, 1, 2, 3] and got["files"][2]["range"] == "2-4"
    assert got["samples"] == 4 and got["tokens"] == 12 and not got["complete"] and got["missing"] == [4, 5]
    with pytest.raises(schema.MergeError, match=r"ranges \[0, 3\) and \[2, 4\) overlap"):
        schema.merge(ranges((0, 3, []), (2, 4, [])))
    with pytest.raises(schema.MergeError, match=r"sample 5 is listed by range 0-2, outside \[0, 2\)") as caught:
        schema.merge(ranges((0, 2, [entry(5)])))
    assert caught.value.detail == {"index": 5}
    with pytest.raises(schema.MergeError, match="sample 1 is listed by range 0-2 twice"):
        schema.merge(ranges((0, 2, [entry(1), entry(1)])))


def test_a_loose_merge_leaves_out_what_lies_past_a_cut():
    got = schema.merge(ranges((0, 2, [entry(0), entry(2)]), (2, 4, [entry(3)])), strict=False)
    assert [(e["index"], e["range"]) for e in got["files"]] == [(0, "0-2"), (3, "2-4")]
    assert got["missing"] == [1, 2] and not got["complete"]


def test_the_host_merge_writes_one_merged_document(tmp_path):
    from remote.extract import merge

    out = tmp_path / "out"
    for lo, hi in ((0, 2), (2, 4)):
        samples.write_json_atomic(samples.shard_dir(out, lo, hi) / samples.CLAIM,
                                  {"run_id": "R", "sample_range": [lo, hi], "who": {"host": f"h{lo}"}})
        schema.write_atomic(samples.shard_dir(out, lo, hi) / contract.MANIFEST,
                            built(sample_range=[lo, hi], files=[entry(i) for i in range(lo, hi)]))
    got = merge.main({"output_dir": str(out), "run_id": "R", "ranges": [[0, 2], [2, 4], [4, 6]]})
    rec, = got["records"]
    assert rec["status"] == "warn" and got["data"]["missing"] == 2 and rec["detail"]["missing_ranges"] == [[4, 6]]
    doc = schema.read(out / contract.MANIFEST, schema.FOR_VERIFY)
    assert set(doc) <= fields_of("merged") and doc["merged_from"]["2-4"]["host"] == "h2"
    assert [(e["index"], e["range"], e["host"]) for e in doc["files"]] == [
        (0, "0-2", "h0"), (1, "0-2", "h0"), (2, "2-4", "h2"), (3, "2-4", "h2")]
    assert {k: doc[k] for k in schema.INHERITED} == {k: built().get(k) for k in schema.INHERITED}


def test_the_host_merge_names_the_field_a_range_lacks(tmp_path):
    from remote.extract import merge

    out = tmp_path / "out"
    samples.write_json_atomic(samples.shard_dir(out, 0, 2) / samples.CLAIM, {"run_id": "R", "sample_range": [0, 2]})
    samples.write_json_atomic(samples.shard_dir(out, 0, 2) / contract.MANIFEST,
                              {"run_id": "R", "files": [entry(0), entry(1)]})
    rec, = merge.main({"output_dir": str(out), "run_id": "R"})["records"]
    assert rec["status"] == "fail" and "field 'sample_range' is missing" in rec["summary"]
    assert not (out / contract.MANIFEST).exists()


def test_the_laptops_group_merge_is_the_same_merge(tmp_path, monkeypatch):
    from specops.result import HostReport
    from specops.runs.merge import merge
    from specops.runs.shardmap import GroupMap, Shard

    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    group = GroupMap(run_id="G", total=4, stack={"format": "pt", "layer_ids": [2, 4, 5, 7],
                                                      "convention": "output"},
                          shards=[Shard(id="s0", hosts=["a"], start=0, stop=2, run_id="G", output_dir="/o"),
                                  Shard(id="s1", hosts=["b"], start=2, stop=4, run_id="G", output_dir="/o")])
    canary = {"status": "ok", "asked": 2, "checked": 2, "samples": [0, 1], "summary": "ok: 2 samples"}
    report = {"chat_rule": "whole", "rows": 2, "samples": 2}
    schema.write_atomic(tmp_path / "runs" / "G" / "hosts" / "a" / "G" / contract.MANIFEST,
                        built(canary=canary, dataset_report=report))
    listing = {"s0": [entry(0), entry(1), entry(2)], "s1": [entry(3)]}  # s0's 2 lies past its range
    reports = {sid: HostReport(host=sid, task="fetch", data={"listing": {"files": files}})
               for sid, files in listing.items()}
    doc = merge(group, reports)
    assert doc == schema.read(tmp_path / "runs" / "G" / contract.MANIFEST)
    assert set(doc) <= fields_of("group") and doc["missing"] == [2] and not doc["complete"]
    assert [(e["index"], e["shard"], e["host"]) for e in doc["files"]] == [(0, "s0", "a"), (1, "s0", "a"),
                                                                          (3, "s1", "b")]
    assert doc["engines"] == {"s0": built()["engine"]} and doc["format"] == schema.FORMAT_TEXT["pt"]
    # each shard's canary verdict and dataset report, by shard (s1's manifest was not fetched: absent)
    assert doc["canaries"] == {"s0": canary} and doc["dataset_reports"] == {"s0": report}


# --------------------------------------------------------------------------- readers


def test_verify_names_the_field_its_run_lacks(tmp_path):
    from remote.verify.run import VerifyError, open_run

    run_dir = tmp_path / "R"
    run_dir.mkdir()
    (run_dir / contract.STATUS_FILE).write_text(json.dumps({"state": "done", "output_dir": str(tmp_path)}))
    for doc, name, said in (({"layer_ids": [2], "layer_convention": "output"}, "verify.run", "'files' is missing"),
                            ({"layer_ids": [2], "files": []}, "verify.convention", "no known layer convention (None)"),
                            ({"layer_ids": [2], "layer_convention": "x", "files": []}, "verify.convention", "('x')")):
        (run_dir / contract.MANIFEST).write_text(json.dumps(doc))
        with pytest.raises(VerifyError) as caught:
            open_run({"run_dir": str(run_dir)})
        rec, = caught.value.payload()["records"]
        assert rec["name"] == name and said in rec["summary"], rec
    (run_dir / contract.MANIFEST).write_text(json.dumps(built()))
    run = open_run({"run_dir": str(run_dir)})
    assert run.layer_ids == [2, 4, 5, 7] and run.convention == "output" and run.output_dir == tmp_path


def test_fetch_names_the_field_its_manifest_lacks(tmp_path):
    from specops.runs.hostjob import fetch_tensors

    (tmp_path / contract.MANIFEST).write_text(json.dumps({"files": [entry(0)]}))
    rec = fetch_tensors(None, tmp_path)
    assert rec.status == "fail" and "field 'params' is missing" in rec.summary and rec.detail == {"field": "params"}
    (tmp_path / contract.MANIFEST).unlink()
    assert "no manifest yet" in fetch_tensors(None, tmp_path).summary


def test_the_shard_listing_passes_over_a_manifest_that_does_not_fit(tmp_path):
    schema.write_atomic(samples.shard_dir(tmp_path, 0, 2) / contract.MANIFEST, built())
    (tmp_path / contract.MANIFEST).write_text(json.dumps({"files": [{"path": "data_9.pt", "bytes": "x"}]}))
    got = samples.manifest_entries(tmp_path)
    assert [e["path"] for e in got["files"]] == ["data_0.pt", "data_1.pt"]


def test_the_dev_server_run_builds_with_the_schema(tmp_path):
    from remote.dev import server_run

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8}))
    run_dir = tmp_path / "run"
    (run_dir / "output" / "hidden_states").mkdir(parents=True)
    (run_dir / "output" / "hidden_states" / "hs_0.safetensors").write_bytes(b"abc")
    doc = server_run.write_run(run_dir, str(model), [2, 4, 5, 8], {"name": "vllm-server"},
                               [{"file": "hs_0.safetensors", "index": 0, "bytes": 3, "tokens": 2}])
    assert set(doc) <= fields_of("run") and doc["file_layer_ids"] == [2, 4, 5, 8]
    assert schema.read(run_dir / contract.MANIFEST, schema.FOR_VERIFY) == doc
    assert schema.read(run_dir / "output" / contract.MANIFEST) == doc


# --------------------------------------------------------------------------- digests


def test_each_file_is_checked_in_its_own_entrys_algorithm_and_a_damaged_one_is_caught(tmp_path):
    import hashlib

    import blake3

    from remote.wire import fsutil

    path = tmp_path / "hs_0.safetensors"
    path.write_bytes(bytes(range(256)) * 4096)
    data = path.read_bytes()
    new = {"path": path.name, **fsutil.file_digest(path)}
    older = {"path": path.name, "sha256": hashlib.sha256(data).hexdigest()}  # what a run before BLAKE3 wrote
    assert new == {"path": path.name, "blake3": blake3.blake3(data).hexdigest()}, "this python has blake3"
    assert fsutil.buffer_digest(data) == fsutil.file_digest(path, threads=1) == {"blake3": new["blake3"]}
    assert schema.entry_digest(new) == ("blake3", new["blake3"]) and schema.entry_digest(older)[0] == "sha256"
    assert schema.file_matches(path, new) and schema.file_matches(path, older)
    with open(path, "r+b") as fh:  # one byte flipped, the size unchanged: only the digest sees it
        fh.seek(123_456)
        fh.write(bytes([data[123_456] ^ 1]))
    assert not schema.file_matches(path, new) and not schema.file_matches(path, older)
    with pytest.raises(schema.ManifestError, match="has no digest"):
        schema.file_matches(path, {"path": path.name})
    assert schema.digest_names([new]) == "blake3" and schema.digest_names([new, older]) == "blake3 and sha256"


def test_a_merge_of_ranges_hashed_with_blake3_and_sha256_keeps_each_files_own(tmp_path):
    """A host without blake3 (sha256, named) and one with it share an output dir: the merged
    manifest lists each file with the digest its host made, and every reader checks it so."""
    from remote.extract import merge

    out = tmp_path / "out"
    older = [{**entry(i), "sha256": f"{i:064x}"} for i in range(2)]
    for e in older:
        del e["blake3"]
    for lo, hi, files in ((0, 2, older), (2, 4, [entry(2), entry(3)])):
        samples.write_json_atomic(samples.shard_dir(out, lo, hi) / samples.CLAIM,
                                  {"run_id": "R", "sample_range": [lo, hi], "who": {"host": f"h{lo}"}})
        schema.write_atomic(samples.shard_dir(out, lo, hi) / contract.MANIFEST,
                            built(sample_range=[lo, hi], files=files))
    rec, = merge.main({"output_dir": str(out), "run_id": "R"})["records"]
    assert rec["status"] == "ok", rec
    doc = schema.read(out / contract.MANIFEST, schema.FOR_VERIFY)
    assert [schema.entry_digest(e)[0] for e in doc["files"]] == ["sha256", "sha256", "blake3", "blake3"]
    assert wire.manifest.read(out / contract.MANIFEST, ("files[].digest",))["files"] == doc["files"], "the laptop too"


FETCH_WITHOUT_BLAKE3 = """
import json, sys
from pathlib import Path
sys.modules["blake3"] = None  # a laptop without the blake3 package: `import blake3` fails
from specops.runs.hostjob import download_files
from specops import wire
dest = Path(sys.argv[1])
rec = download_files(None, "/nowhere", [{"path": "hs_0.safetensors", "bytes": 3, "blake3": "0" * 64}], dest)
older = download_files(None, "/nowhere", [{"path": "data_0.pt", "bytes": 3}], dest)
print(json.dumps({"status": rec.status, "summary": rec.summary, "fix": rec.fix, "default": wire.fsutil.default_hash(),
                  "bare": older.summary}))
"""


def test_fetch_of_a_blake3_manifest_on_a_laptop_without_blake3_fails_naming_the_fix(tmp_path):
    """Never a silent pass: the download stops before any file moves (no host is touched), saying what to install."""
    proc = subprocess.run([sys.executable, "-c", FETCH_WITHOUT_BLAKE3, str(tmp_path / "samples")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["status"] == "fail" and "cannot check the manifest's blake3 digests" in got["summary"], got
    assert "pip install blake3" in got["fix"] and got["default"] == "sha256"
    assert "have no digest" in got["bare"] and not (tmp_path / "samples").exists()


# --------------------------------------------------------------------------- the laptop's copy

LOAD_ON_LAPTOP = """
import json, sys
before = set(sys.modules)
from specops import wire
m = wire.manifest
print(json.dumps({"file": m.__file__, "same_contract": m.contract is wire.contract, "again": m is wire.manifest,
                  "new_remote": sorted(k for k in set(sys.modules) - before
                                       if k.split(".")[0] == "remote"), "name": m.__name__}))
"""


def test_the_laptop_imports_the_hosts_file_as_specops_wire_and_no_remote_package(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LOAD_ON_LAPTOP], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["file"]).resolve() == (REPO / "remote" / "wire" / "manifest.py").resolve()
    assert out["same_contract"] and out["again"] and out["new_remote"] == [], out
    assert out["name"] == "specops.wire.manifest"
    laptop = wire.manifest
    assert laptop.FIELDS == schema.FIELDS and laptop.ENTRY_FIELDS == schema.ENTRY_FIELDS
    assert laptop.contract is wire.contract and laptop.FOR_FETCH == schema.FOR_FETCH
