"""``specops patch`` over real SSH on a host env's own speculators 0.3.0 copy.

Each test gets an overlay env (sees the cached vLLM env, owns a speculators copy), so
the shared env stays pristine.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.patch import patch, patch_step
from specops.testhost.hostenv import make_overlay_env, site_packages

TARGETS = ("speculators/data_generation/vllm_hidden_states_generator.py",
           "speculators/data_generation/custom_worker.py")


@pytest.fixture
def overlay(hostenv_python, tmp_path):
    python = make_overlay_env(hostenv_python, tmp_path / "env")
    return python, site_packages(python)


@pytest.fixture
def inventory(make_inventory, overlay):
    return load_inventory(make_inventory(python=str(overlay[0])))


def digests(site: Path) -> dict:
    return {t: hashlib.sha256((site / t).read_bytes()).hexdigest() for t in TARGETS}


def statuses(report) -> dict:
    return {r.name: r.status for r in report.records}


def test_check_apply_again_revert_apply(inventory, overlay):
    _, site = overlay
    pristine = digests(site)

    (check,) = patch(inventory, None, "check")
    assert not check.failed and digests(site) == pristine  # check mode writes nothing
    diffs = [r.detail.get("diff", "") for r in check.records if r.status == "changed"]
    assert len(diffs) == 2 and all(d.startswith("--- a/") and "+" in d for d in diffs)

    (applied,) = patch(inventory, None, "apply")
    assert not applied.failed, applied.records
    assert [statuses(applied)[f"patch.{t}"] for t in TARGETS] == ["changed", "changed"]
    assert statuses(applied)["patch.drift-after"] == "ok"  # static drift check is clean now
    patched = digests(site)
    assert patched != pristine

    (again,) = patch(inventory, None, "apply")
    assert [statuses(again)[f"patch.{t}"] for t in TARGETS] == ["ok", "ok"]
    assert digests(site) == patched

    (status,) = patch(inventory, None, "status")
    assert statuses(status)["patch.state"] == "ok"

    (reverted,) = patch(inventory, None, "revert")
    assert not reverted.failed and digests(site) == pristine
    (reapplied,) = patch(inventory, None, "apply")
    assert not reapplied.failed and digests(site) == patched


def test_hand_edited_file_is_refused_and_untouched(inventory, overlay):
    _, site = overlay
    worker = site / TARGETS[1]
    text = worker.read_text()
    assert "if not supports_eagle3(model):" in text
    # a hand fix inside a region the patch set changes, as people did before specops
    worker.write_text(text.replace("if not supports_eagle3(model):", "if False:  # a local hack"))
    before = digests(site)
    (report,) = patch(inventory, None, "apply")
    assert report.failed
    failed = [r for r in report.records if r.status == "fail"]
    assert any("custom_worker.py" in r.summary for r in failed)
    assert any("a local hack" in str(r.detail) for r in failed)  # shows how it differs
    assert digests(site) == before


def test_failure_between_files_restores_everything(inventory, overlay):
    _, site = overlay
    before = digests(site)
    with Host(inventory.hosts["th"], inventory) as host:
        report = patch_step(host, "apply", extra={"inject_failure_after": 1})
    assert report.failed
    assert digests(site) == before


def test_two_concurrent_runs_one_applies_one_refused(inventory, overlay):
    _, site = overlay
    results = {}

    def run(name, extra):
        with Host(inventory.hosts["th"], inventory) as host:
            results[name] = patch_step(host, "apply", extra=extra)

    first = threading.Thread(target=run, args=("first", {"hold_lock_s": 4}))
    first.start()
    import time
    time.sleep(1.5)
    run("second", {})
    first.join()
    assert not results["first"].failed
    assert results["second"].failed
    assert any("lock" in r.summary.lower() or "another" in r.summary.lower()
               for r in results["second"].records if r.status == "fail")
    (again,) = patch(inventory, None, "apply")
    assert [statuses(again)[f"patch.{t}"] for t in TARGETS] == ["ok", "ok"]
