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
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from specops.transport.bundle import DEV_ONLY, DEV_TRAVELS, build_bundle

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


#: modules vLLM imports by name inside its own server (``kv_connector_module_path``), never specops: they
#: subclass installed classes at import, so they import torch, vLLM and hs-connectors there
LOADED_BY_VLLM = {
    "remote.extract.engines.vllm_server.fp8_connector": "specops' fp8 connector, a subclass of hs-connectors' "
                                                        "FP8HiddenStatesConnector, loaded by vLLM's connector factory",
}


def bundle_modules(root: Path) -> list:
    """Dotted names of every module in ``root/remote`` (packages by their ``__init__``), but those vLLM loads."""
    names = []
    for path in sorted((root / "remote").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [n for n in names if n not in LOADED_BY_VLLM]


def test_the_modules_vllm_loads_ship_and_nothing_of_specops_imports_them():
    """An exemption names a module that exists, and no other module of the bundle imports it (only vLLM may)."""
    import ast

    for name in LOADED_BY_VLLM:
        assert (REPO / (name.replace(".", "/") + ".py")).is_file(), name
    for path in (REPO / "remote").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
                assert not set(names) & set(LOADED_BY_VLLM) and not any(
                    a.name == "fp8_connector" for a in node.names), f"{path} imports {names}"
            elif isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & set(LOADED_BY_VLLM), path


def test_every_bundled_module_imports_with_the_standard_library_only(hostenv_python, tmp_path):
    bundle = build_bundle()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        zf.extractall(tmp_path)
    modules = bundle_modules(tmp_path)
    # the walk really covers the modules the old hand-written lists missed
    for expected in ("remote.drift", "remote.probes.preflight", "remote.probes.model", "remote.verify", "remote.extract.smoke",
                     "remote.system.facts", "remote.wire.layers", "remote.system.versions", "remote.extract.tinymodel"):
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
    """``remote/dev`` (tests' and scripts' tools) is in the checkout and in no bundle a host gets,
    but for the test hooks' behaviour."""
    assert DEV_ONLY == ("remote/dev",)
    dev = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "remote" / "dev").rglob("*.py"))
    assert {"remote/dev/smoke_generator.py", "remote/dev/server_run.py", "remote/dev/bench_prefill.py"} <= set(dev)
    bundle = build_bundle()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        names = zf.namelist()
    assert names == list(bundle.files)
    # of remote/dev only what an armed test hook does travels (remote/run/faults.py); the tools stay
    assert [n for n in names if n.startswith("remote/dev")] == list(DEV_TRAVELS)
    assert "remote/extract/tinymodel.py" in names and "remote/wire/protocol.py" in names
    # a file added under remote/dev changes nothing a host gets
    root = tmp_path / "tree"
    for rel in ["remote/__init__.py", *dev]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((REPO / rel).read_bytes())
    before = build_bundle(root)
    (root / "remote" / "dev" / "new_tool.py").write_text("print('dev only')\n")
    assert build_bundle(root).digest == before.digest


def test_an_armed_test_hook_without_its_behaviour_is_refused_by_name(tmp_path):
    """A host task sent by an installed program (no ``remote/dev``) refuses an armed hook
    instead of ignoring it; unarmed, every fault point is a no-op there."""
    root = tmp_path / "tree"
    for rel in ["remote/__init__.py", "remote/run/faults.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((REPO / rel).read_bytes())
    script = ("from remote.run import faults\n"
              "faults.engine_step({}, 'load'); faults.file_written(3, None); faults.lock_held(0)\n"
              "assert faults.batch_delay_s({}) == 0\n"
              "faults.engine_step({'inject_failure': {'at': 'load'}}, 'load')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECOPS_BATCH_DELAY_S")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: a test hook is armed, but this program's bundle has no remote/dev/faults.py" in proc.stderr
    # from the checkout the same call raises where the hook said
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=env)
    assert "InjectedFailure: injected failure at load on rank 0" in proc.stderr, proc.stderr
