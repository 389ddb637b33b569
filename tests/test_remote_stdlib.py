"""Every module under remote/ imports with the standard library alone, in the host's python.

The bundle runs in whatever python env a host has, and the controller's preflight must
answer on a host whose vLLM would crash on import. So no module may import torch,
transformers, vLLM, speculators (or anything else installed) at import time: they load
inside the function that needs them. This walks the real bundle (what ships), not a
hand-written list, and imports each module in the host env's python started with
``-I -S``: isolated, and without site-packages, so an import of anything installed
fails right there and names the module.
"""
from __future__ import annotations

import io
import json
import subprocess
import zipfile
from pathlib import Path

from specops.bundle import DEV_ONLY, build_bundle

REPO = Path(__file__).resolve().parents[1]

IMPORT_EACH = r"""
import importlib, json, sys, traceback
sys.path.insert(0, sys.argv[1])
failed = {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc().strip().splitlines()[-1]
print(json.dumps({"failed": failed, "site": [p for p in sys.path if "site-packages" in p],
                  "loaded": sorted(sys.modules)}))
"""


def bundle_modules(root: Path) -> list:
    """Dotted names of every module in ``root/remote`` (packages by their ``__init__``)."""
    names = []
    for path in sorted((root / "remote").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_bundled_module_imports_with_the_standard_library_only(hostenv_python, tmp_path):
    bundle = build_bundle()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        zf.extractall(tmp_path)
    modules = bundle_modules(tmp_path)
    # the walk really covers the modules the old hand-written lists missed
    for expected in ("remote.drift", "remote.preflight", "remote.probes.model", "remote.verify", "remote.smoke",
                     "remote.facts", "remote.layers", "remote.versions", "remote.tinymodel"):
        assert expected in modules, expected
    proc = subprocess.run([str(hostenv_python), "-I", "-S", "-c", IMPORT_EACH, str(tmp_path), json.dumps(modules)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["site"] == []  # -S: nothing installed is reachable, so any such import fails
    assert out["failed"] == {}, out["failed"]
    heavy = {"torch", "transformers", "vllm", "speculators", "safetensors", "numpy"}
    assert heavy & {m.split(".")[0] for m in out["loaded"]} == set()


def test_the_walk_catches_a_module_that_imports_an_installed_package(hostenv_python, tmp_path):
    """The check can fail: a planted ``import torch`` at module level is named."""
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "__init__.py").write_text("")
    (tmp_path / "remote" / "eager.py").write_text("import torch\n")
    modules = bundle_modules(tmp_path)
    assert modules == ["remote", "remote.eager"]
    proc = subprocess.run([str(hostenv_python), "-I", "-S", "-c", IMPORT_EACH, str(tmp_path), json.dumps(modules)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    failed = json.loads(proc.stdout)["failed"]
    assert list(failed) == ["remote.eager"] and "torch" in failed["remote.eager"]


def test_the_bundle_leaves_the_development_tools_in_the_checkout(tmp_path):
    """``remote/dev`` (tests' and scripts' tools) is in the checkout and in no bundle a host gets."""
    assert DEV_ONLY == ("remote/dev",)
    dev = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "remote" / "dev").rglob("*.py"))
    assert {"remote/dev/smoke_generator.py", "remote/dev/server_run.py", "remote/dev/bench_prefill.py"} <= set(dev)
    bundle = build_bundle()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        names = zf.namelist()
    assert names == list(bundle.files)
    assert [n for n in names if n.startswith("remote/dev")] == []
    assert "remote/tinymodel.py" in names and "remote/protocol.py" in names
    # a file added under remote/dev changes nothing a host gets
    root = tmp_path / "tree"
    for rel in ["remote/__init__.py", *dev]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((REPO / rel).read_bytes())
    before = build_bundle(root)
    (root / "remote" / "dev" / "new_tool.py").write_text("print('dev only')\n")
    assert build_bundle(root).digest == before.digest
