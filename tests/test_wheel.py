"""The program as users install it: a wheel in a fresh venv outside the repo.

``pip install .``, pipx and ``uv tool install`` put specops in site-packages with no
checkout beside it. The templates, the remote code and the patch sets must travel
inside the wheel (the development tools of ``remote/dev`` must not); this builds one,
installs it in a new venv, and drives the real test host from a directory that is not the repo.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specops.transport.bundle import is_dev_only

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_specops(tmp_path_factory) -> Path:
    """``specops`` from a wheel of this checkout, in a venv that has never seen the repo."""
    root = tmp_path_factory.mktemp("wheel")
    wheels = root / "dist"
    # Build from a clean copy: setuptools reuses an in-tree build/ dir, which would ship
    # files that were deleted from the checkout since the last local build.
    source = root / "source"
    skipped = shutil.ignore_patterns(".git", ".venv", "build", "dist", "__pycache__", "*.egg-info", ".pytest_cache")
    # the local runs/ dir at the top only: specops/runs/ is a package of the program
    shutil.copytree(REPO, source, ignore=lambda where, names: set(skipped(where, names)) | (
        {"runs"} & set(names) if Path(where) == REPO else set()))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-input", "-q",
                    "--disable-pip-version-check", "-w", str(wheels), str(source)], check=True, timeout=600)
    wheel = next(wheels.glob("specops-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n[len("specops/_assets/"):] for n in names if n.startswith("specops/_assets/"))
    in_checkout = sorted(path.relative_to(REPO).as_posix() for tree in ("templates", "remote", "patches")
                         for path in (REPO / tree).rglob("*")
                         if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc")
    dev_tools = [rel for rel in in_checkout if rel.startswith("remote/dev/")]
    assert "remote/dev/smoke_generator.py" in dev_tools  # the checkout has them: the wheel leaves them out
    assert [n for n in shipped if n.startswith("remote/dev/")] == [], "the wheel ships remote/dev"
    # a checkout's bundle also carries the test hooks' behaviour (remote/dev/faults.py); the wheel does not
    assert not is_dev_only("remote/dev/faults.py") and is_dev_only("remote/dev/smoke_generator.py")
    product = [rel for rel in in_checkout if not rel.startswith("remote/dev/")]
    assert shipped == product, "the wheel's templates/remote/patches differ from the checkout's"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # the locked versions, like bootstrap; the wheel's own requirements decide what is needed
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-input", "--disable-pip-version-check",
                    "-c", str(REPO / "requirements.lock"), str(wheel)], check=True, timeout=900)
    return venv / "bin" / "specops"


def run_installed(specops: Path, *args, cwd: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(specops), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, timeout=600)


def test_installed_wheel_drives_the_test_host_from_elsewhere(installed_specops, make_inventory, tiny_models,
                                                             tmp_path):
    inventory = make_inventory(model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]), tp=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run_installed(installed_specops.parent / "python", "-c",
                          "import specops.transport.assets as a; print(a.asset_root())", cwd=elsewhere)
    assert where.returncode == 0, where.stderr
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout

    facts = run_installed(installed_specops, "facts", "--inventory", str(inventory), "--json", cwd=elsewhere)
    assert facts.returncode == 0, facts.stderr[-3000:]
    assert json.loads(facts.stdout)["hosts"][0]["records"]

    pre = run_installed(installed_specops, "preflight", "--inventory", str(inventory), "--json", cwd=elsewhere)
    doc = json.loads(pre.stdout)
    names = {r["name"]: r for r in doc["hosts"][0]["records"]}
    assert names["packages.vllm"]["status"] == "ok", names["packages.vllm"]
    assert names["checkpoint.headers"]["status"] == "ok"
    # the unpatched test host env has speculators/vLLM drift: a plain failure (1), never internal (4)
    assert pre.returncode == doc["exit_code"] == 1, pre.stderr[-3000:]
    assert {r["area"] for r in doc["hosts"][0]["records"] if r["status"] == "fail"} <= {"drift", "patch"}

    check = run_installed(installed_specops, "patch", "--check", "--inventory", str(inventory), "--json",
                          cwd=elsewhere)
    assert check.returncode == 0, check.stderr[-3000:]
    records = json.loads(check.stdout)["hosts"][0]["records"]
    assert any(isinstance(r["detail"], dict) and "+++" in str(r["detail"].get("diff", "")) for r in records), records
