"""remote/drift/ (the static API-drift check) against the real speculators 0.3.0 and vLLM 0.16 CPU build.

The checker runs in the host env's python ($HOSTPY) in a subprocess, as it does on a
host. Copies of speculators are edited in tmp dirs (never the installed package) to
show that each finding follows the code: fix one call and only that finding goes.
"""
from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hostcall

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote import drift, patcher  # noqa: E402  stdlib only: safe in the controller's python
from remote.patcher import patchsets

PATCH_SET = REPO / "patches" / "speculators-0.3.0_vllm-0.12-0.16"
MANIFEST = json.loads((PATCH_SET / "manifest.json").read_text())

KNOWN_IDS = drift.KNOWN_IDS  # the ids the patch sets' `fixes` lists share with the checker

#: id -> text the reported speculators line must contain (read from the real file).
LINE_MUST_SHOW = {
    "scheduler-config-is-encoder-decoder": "SchedulerConfig(",
    "kv-cache-config-from-groups": "get_kv_cache_config_from_groups(",
    "scheduler-block-size": "Scheduler(",
    "request-block-hasher": "Request(",
    "two-phase-execute-model": "execute_model(",
    "embed-input-ids": "get_input_embeddings",
    "eagle3-support-check": "supports_eagle3(",
    "cuda-mem-get-info": "mem_get_info",
    "collective-rpc-unique-reply": "[0]",
    "deepseek-llama4-scaling": "layer(",
}

GEN = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"

#: id -> (file, old text, new text): the smallest hand fix of that one item.
HAND_FIXES = {
    "scheduler-config-is-encoder-decoder": (
        GEN, "scheduler_config=SchedulerConfig(\n",
        "scheduler_config=SchedulerConfig(\n                is_encoder_decoder=False,\n"),
    "kv-cache-config-from-groups": (GEN, "            kv_cache_specs=kv_cache_spec,\n", ""),
    "scheduler-block-size": (
        GEN, "            structured_output_manager=structured_output_manager,\n",
        "            structured_output_manager=structured_output_manager,\n"
        "            block_size=VLLM_BLOCK_SIZE,\n"),
    # Turning prefix caching off is the other way out: the check reads CacheConfig too.
    "request-block-hasher": (
        GEN, "            block_size=VLLM_BLOCK_SIZE,\n            gpu_memory_utilization",
        "            block_size=VLLM_BLOCK_SIZE,\n            enable_prefix_caching=False,\n"
        "            gpu_memory_utilization"),
    "two-phase-execute-model": (
        GEN, "self.executor.execute_model(scheduler_output)\n",
        "self.executor.execute_model(scheduler_output)\n"
        "            self.executor.sample_tokens(None)\n"),
    "embed-input-ids": (WORKER, "self.get_input_embeddings(input_ids)", "self.embed_input_ids(input_ids)"),
    # The gate is evaluated, not pattern-matched: "supports_eagle3 or supports_eagle" passes.
    "eagle3-support-check": (
        WORKER, "        if not supports_eagle3(model):\n",
        "        from vllm.model_executor.models.interfaces import supports_eagle\n\n"
        "        if not (supports_eagle3(model) or supports_eagle(model)):\n"),
    "cuda-mem-get-info": (
        GEN, "free_memory, _ = torch.cuda.mem_get_info()",
        "free_memory = min(self.executor.determine_available_memory())"),
    "collective-rpc-unique-reply": (
        GEN, "aux_hidden_states = captured_states_list[0]", "aux_hidden_states = captured_states_list"),
    "deepseek-llama4-scaling": (
        WORKER, "hidden_states=hidden_states, positions=positions, residual=residual\n",
        "hidden_states=hidden_states, positions=positions, residual=residual,\n"
        "            llama_4_scaling=None,\n"),
}

DEEPSEEK_CPU = {"model_family": "deepseek_v3", "device": "cpu", "model_has_llama_4_scaling": True}


def run_drift(hostpy: Path, params: dict, *, fresh: bool = False) -> dict:
    """``remote.drift.main(params)`` in the host env's python; returns its payload.

    Answered by the env's long-lived host process (``tests/hostcall.py``; drift's parsed-tree
    cache there is keyed by path, size and mtime, as in ``specops patch``'s own python), or with
    ``fresh``, by ``python -m remote.drift PARAMS`` in a new process, as a host runs it: for what
    only a cold process shows, such as the CPU time of a first check.
    """
    if not fresh:
        return hostcall.call(hostpy, "remote.drift:main", json.loads(json.dumps(params, default=str)), timeout=60)
    proc = subprocess.run(
        [str(hostpy), "-m", "remote.drift", json.dumps(params, default=str)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def by_id(payload: dict) -> dict:
    return {r["name"].split(".", 1)[1]: r for r in payload["records"]}


def drift_ids(payload: dict) -> set:
    return {k for k, r in by_id(payload).items() if r["status"] in ("warn", "fail")}


@pytest.fixture(scope="session")
def site_packages(hostenv_python) -> Path:
    out = subprocess.run(
        [str(hostenv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(out)


@pytest.fixture
def spec_copy(tmp_path, site_packages):
    """A writable copy of the installed speculators package; params that point at it."""
    root = tmp_path / "site"
    shutil.copytree(site_packages / "speculators", root / "speculators",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for meta in site_packages.glob("speculators-*.dist-info"):  # the version patch sets match on
        shutil.copytree(meta, root / meta.name)

    def params(**extra):
        # The copy is searched first; vLLM is still found in the env's own site-packages.
        return {"site_packages": str(root), **DEEPSEEK_CPU, **extra}

    return root, params


def edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel} no longer holds the text to edit: {old!r}"
    path.write_text(text.replace(old, new))


# ---------------------------------------------------------------- unpatched


def test_unpatched_reports_every_known_drift_with_file_and_line(hostenv_python, site_packages):
    payload = run_drift(hostenv_python, DEEPSEEK_CPU, fresh=True)  # a cold check's CPU time, as on a host
    records = by_id(payload)
    for drift_id in KNOWN_IDS:
        assert drift_id in records, f"drift.{drift_id} not reported; got {sorted(records)}"
        rec = records[drift_id]
        assert rec["status"] == "fail", rec
        assert rec["fix"], rec
        loc = rec["detail"]["locations"][0]
        assert Path(loc["file"]).is_relative_to(site_packages / "speculators")
        line = Path(loc["file"]).read_text().splitlines()[loc["line"] - 1]
        assert LINE_MUST_SHOW[drift_id] in line, (drift_id, loc, line)
        assert f"{Path(loc['file']).name}:{loc['line']}" in rec["summary"]
    assert "none" not in records
    # CPU seconds: other helpers' vLLM runs share these 2 cores and inflate wall time.
    assert payload["data"]["cpu_s"] < 1.0, payload["data"]


def test_llama_target_has_no_deepseek_items_and_cuda_host_only_warns(hostenv_python):
    payload = run_drift(hostenv_python, {"model_family": "llama", "device": "cuda"})
    ids = drift_ids(payload)
    records = by_id(payload)
    assert "eagle3-support-check" not in ids  # LlamaForCausalLM implements SupportsEagle3
    assert "deepseek-llama4-scaling" not in ids  # LlamaModel passes no extra layer argument
    assert "embed-input-ids" in ids
    assert records["cuda-mem-get-info"]["status"] == "warn"
    assert records["scheduler-block-size"]["status"] == "fail"


def test_dropped_llama4_scaling_warns_when_the_model_does_not_use_it(hostenv_python):
    payload = run_drift(hostenv_python, {**DEEPSEEK_CPU, "model_has_llama_4_scaling": False})
    rec = by_id(payload)["deepseek-llama4-scaling"]
    assert rec["status"] == "warn"
    assert "llama_4_scaling" in rec["summary"]


def test_target_comes_from_the_models_own_config(hostenv_python, tiny_models):
    """Preflight and patch pass model_path, not a family: the config decides."""
    for name, archs, scaling_status in (
        ("deepseek_v3", ["DeepseekV3ForCausalLM"], "fail"),  # config sets llama_4_scaling
        # text_config-wrapped: the wrapper meets the gate, the text model runs the layers
        ("kimi_k25", ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"], "warn"),
        ("llama", ["LlamaForCausalLM"], None),
    ):
        payload = run_drift(hostenv_python, {"model_path": str(tiny_models[name]), "device": "cpu"})
        records = by_id(payload)
        target = records["scheduler-block-size"]["detail"]["checked"]["targets"]
        assert [t["architecture"] for t in target] == archs, (name, target)
        got = records.get("deepseek-llama4-scaling", {}).get("status")
        assert got == scaling_status, (name, got)
        assert ("eagle3-support-check" in records) == (name != "llama")


def test_wrapper_model_without_model_attribute(hostenv_python, tiny_models, spec_copy):
    """Kimi-K2.5's vLLM class keeps its text model in .language_model: model.model is gone."""
    root, params = spec_copy
    kimi = {"model_path": str(tiny_models["kimi_k25"]), "model_family": None}
    records = by_id(run_drift(hostenv_python, params(**kimi)))
    rec = records["model-attr-model"]
    assert rec["status"] == "fail" and "KimiK25ForConditionalGeneration" in rec["summary"]
    loc = rec["detail"]["locations"][0]
    assert "model.model" in Path(loc["file"]).read_text().splitlines()[loc["line"] - 1]
    gate = records["eagle3-support-check"]["detail"]["locations"][0]["architectures"]
    assert "KimiK25ForConditionalGeneration" in gate
    # Reaching the text model through language_model (when there is one) clears it.
    edit(root, WORKER, "base_model = model.model",
         'base_model = getattr(model, "language_model", model).model')
    assert "model-attr-model" not in drift_ids(run_drift(hostenv_python, params(**kimi)))


def test_without_a_model_every_family_is_checked(hostenv_python):
    records = by_id(run_drift(hostenv_python, {"device": "cpu"}))
    archs = {t["architecture"] for t in records["scheduler-block-size"]["detail"]["checked"]["targets"]}
    assert archs == {"LlamaForCausalLM", "DeepseekV3ForCausalLM"}
    embed = records["embed-input-ids"]["detail"]["locations"][0]["architectures"]
    assert set(embed) == archs  # one finding at one place, found for both families
    assert records["deepseek-llama4-scaling"]["status"] == "warn"  # unknown model: cannot say fail
    assert records["eagle3-support-check"]["status"] == "fail"


def test_checker_imports_no_heavy_package(hostenv_python):
    code = (
        "import sys, json; from remote import drift; "
        f"drift.main({DEEPSEEK_CPU!r}); "
        "print(json.dumps(sorted(m for m in ('torch','vllm','speculators','transformers') if m in sys.modules)))"
    )
    out = subprocess.run([str(hostenv_python), "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == []


# ------------------------------------------------------------------ edited copies


@pytest.fixture(scope="module")
def copy_drift_ids(hostenv_python, site_packages, tmp_path_factory) -> set:
    """The drift ids of an unedited copy: the same for every copy, so checked once for all hand fixes."""
    root = tmp_path_factory.mktemp("pristine") / "site"
    shutil.copytree(site_packages / "speculators", root / "speculators", ignore=shutil.ignore_patterns("__pycache__"))
    for meta in site_packages.glob("speculators-*.dist-info"):
        shutil.copytree(meta, root / meta.name)
    return drift_ids(run_drift(hostenv_python, {"site_packages": str(root), **DEEPSEEK_CPU}))


@pytest.mark.parametrize("drift_id", KNOWN_IDS)
def test_hand_fix_removes_exactly_that_finding(hostenv_python, spec_copy, copy_drift_ids, drift_id):
    root, params = spec_copy
    before = copy_drift_ids
    assert drift_id in before
    edit(root, *HAND_FIXES[drift_id])
    after = drift_ids(run_drift(hostenv_python, params()))
    assert after == before - {drift_id}


def test_all_hand_fixes_together_leave_nothing(hostenv_python, spec_copy):
    root, params = spec_copy
    for fix in HAND_FIXES.values():
        edit(root, *fix)
    payload = run_drift(hostenv_python, params())
    assert [r["name"] for r in payload["records"]] == ["drift.none"], payload["records"]
    rec = payload["records"][0]
    assert rec["status"] == "ok"
    assert rec["detail"]["call_sites"] >= 20
    assert len(rec["detail"]["files"]) == 2


def test_names_gone_from_vllm_are_reported(hostenv_python, spec_copy):
    root, params = spec_copy
    edit(root, GEN, "from vllm.v1.request import Request, RequestStatus\n",
         "from vllm.v1.request import Request, RequestStatus, RequestGone\n"
         "from vllm.v1.no_such_module import Anything\n")
    records = by_id(run_drift(hostenv_python, params()))
    gone = records["import-request-gone"]
    assert gone["status"] == "fail" and "RequestGone" in gone["summary"]
    assert "vllm.v1.no_such_module" in records["import-vllm-v1-no-such-module"]["summary"]
    # A compat import guarded by try/except ImportError is not drift.
    edit(root, GEN, "from vllm.v1.no_such_module import Anything\n",
         "try:\n    from vllm.v1.no_such_module import Anything\nexcept ImportError:\n    Anything = None\n")
    assert "import-vllm-v1-no-such-module" not in drift_ids(run_drift(hostenv_python, params()))


def test_generic_signature_and_method_checks(hostenv_python, spec_copy):
    """Any call to a vLLM callable is bound, not just the known list."""
    root, params = spec_copy
    edit(root, GEN, "self.scheduler.add_request(req)\n",
         "self.scheduler.add_request(req, urgent=True)\n"
         "            self.scheduler.schedule_everything()\n")
    edit(root, GEN, "cache_config = CacheConfig(\n", "cache_config = CacheConfig(\n            block_sz=1,\n")
    records = by_id(run_drift(hostenv_python, params()))
    assert "'urgent'" in records["call-scheduler-add-request-urgent"]["summary"]
    assert "schedule_everything" in records["method-scheduler-schedule-everything"]["summary"]
    assert "'block_sz'" in records["call-cache-config-block-sz"]["summary"]


def test_cuda_call_behind_an_availability_guard_is_fine(hostenv_python, spec_copy):
    root, params = spec_copy
    edit(root, GEN, "        free_memory, _ = torch.cuda.mem_get_info()\n",
         "        if torch.cuda.is_available():\n"
         "            free_memory, _ = torch.cuda.mem_get_info()\n"
         "        else:\n"
         "            free_memory = min(self.executor.determine_available_memory())\n")
    assert "cuda-mem-get-info" not in drift_ids(run_drift(hostenv_python, params()))


def test_not_installed_is_a_clear_record(tmp_path, site_packages):
    """Run by a python without vLLM and speculators: the controller's own (stdlib-only module)."""
    import importlib.util

    if importlib.util.find_spec("vllm") or importlib.util.find_spec("speculators"):
        pytest.skip("this python has vllm or speculators installed")
    rec = run_drift(Path(sys.executable), {})["records"]
    assert [(r["name"], r["status"]) for r in rec] == [("drift.speculators", "skipped")]
    only_spec = tmp_path / "only_spec"
    shutil.copytree(site_packages / "speculators", only_spec / "speculators")
    rec = run_drift(Path(sys.executable), {"site_packages": str(only_spec)})["records"]
    assert [(r["name"], r["status"]) for r in rec] == [("drift.vllm", "fail")]
    assert "install vllm" in rec[0]["fix"]


def write_patch_set(patches: Path, name: str, speculators: str, vllm: str, fixes: list, **patched_sha) -> Path:
    """A patch set in the one manifest schema: the real set's diffs and hashes, other versions
    and fixes (``patched_sha``: file name -> a sha256_patched to claim instead). Checked with
    the loader ``specops patch`` uses, so drift is tested on sets the patcher accepts."""
    folder = patches / name
    folder.mkdir(parents=True)
    files = []
    for entry in MANIFEST["files"]:
        shutil.copy(PATCH_SET / entry["diff"], folder / entry["diff"])
        sha = patched_sha.get(Path(entry["path"]).name, entry["sha256_patched"])
        files.append(dict(entry, sha256_patched=sha))
    manifest = {"name": name, "speculators": speculators, "vllm": vllm, "files": files, "fixes": fixes}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    assert patchsets.load(folder / "manifest.json")["name"] == name
    return folder


def test_fix_names_the_matching_patch_set(hostenv_python, tmp_path):
    patches = tmp_path / "patches"
    write_patch_set(patches, "other-versions", "==0.4.0", ">=0.12,<0.17", list(KNOWN_IDS))
    write_patch_set(patches, "good-set", "==0.3.0", ">=0.12,<=0.16", ["scheduler-block-size"])
    records = by_id(run_drift(hostenv_python, {**DEEPSEEK_CPU, "patches_root": str(patches)}))
    assert records["scheduler-block-size"]["detail"]["patch_set"] == "good-set"
    assert "good-set" in records["scheduler-block-size"]["fix"]
    assert records["two-phase-execute-model"]["detail"]["patch_set"] is None  # 0.4.0 set does not match
    # The bundle layout: <_bundle_dir>/patches
    records = by_id(run_drift(hostenv_python, {**DEEPSEEK_CPU, "_bundle_dir": str(tmp_path)}))
    assert records["scheduler-block-size"]["detail"]["patch_set"] == "good-set"


def test_a_set_the_patcher_would_refuse_is_never_named(hostenv_python, site_packages, tmp_path):
    """Drift and ``specops patch`` read one schema and one matcher: overlapping sets, or a
    manifest with a range the patcher refuses, make both name no set, and drift says why."""
    patches = tmp_path / "patches"
    write_patch_set(patches, "a-set", "==0.3.0", ">=0.12,<0.17", list(KNOWN_IDS))
    write_patch_set(patches, "overlapping-set", "~=0.3.0", ">=0.16,<0.18", list(KNOWN_IDS))
    records = by_id(run_drift(hostenv_python, {**DEEPSEEK_CPU, "patches_root": str(patches)}))
    assert records["two-phase-execute-model"]["detail"]["patch_set"] is None
    refused = patcher.main({"action": "check", "patches_root": str(patches), "site_packages": str(site_packages)})
    assert "more than one patch set matches" in refused["records"][0]["summary"]

    shutil.rmtree(patches / "overlapping-set")
    manifest = json.loads((patches / "a-set" / "manifest.json").read_text())
    manifest["vllm"] = "0.12-0.16"
    (patches / "a-set" / "manifest.json").write_text(json.dumps(manifest))
    records = by_id(run_drift(hostenv_python, {**DEEPSEEK_CPU, "patches_root": str(patches)}))
    assert records["two-phase-execute-model"]["detail"]["patch_set"] is None
    warn = records["patch-sets"]
    assert warn["status"] == "warn" and "'>=0.12,<0.17'" in warn["summary"], warn


def test_fix_says_when_the_matching_patch_set_is_already_applied(hostenv_python, spec_copy, tmp_path):
    """A set whose patched sha256 is the file on disk is applied: "apply it" would be wrong."""
    root, params = spec_copy
    worker = root / WORKER
    write_patch_set(tmp_path / "patches", "claims-applied", "==0.3.0", ">=0.12,<0.17", list(KNOWN_IDS),
                    **{worker.name: hashlib.sha256(worker.read_bytes()).hexdigest()})
    records = by_id(run_drift(hostenv_python, params(patches_root=str(tmp_path / "patches"))))
    rec = records["embed-input-ids"]
    assert rec["detail"]["patch_set_applied"] is True
    assert "is applied but does not fix this case" in rec["fix"]


# ------------------------------------------------------------------ the patch set


def apply_patch_set(root: Path) -> None:
    """Apply the real patch set to a copy with the patcher's own strict hunk applier."""
    for entry in MANIFEST["files"]:
        path = root / entry["path"]
        hunks = patcher.parse_unified_diff((PATCH_SET / entry["diff"]).read_text(encoding="utf-8"))
        patched = patcher.apply_hunks(path.read_bytes().decode("utf-8"), hunks).encode("utf-8")
        assert hashlib.sha256(patched).hexdigest() == entry["sha256_patched"], entry["path"]
        path.write_bytes(patched)


def layer_loop_calls(tree) -> list:
    """Calls of the loop variable of ``for ... in ...layers...`` (the decoder layer calls)."""
    calls = []
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and "layers" in ast.unparse(loop.iter):
            names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
            calls += [c for c in ast.walk(loop) if isinstance(c, ast.Call)
                      and isinstance(c.func, ast.Name) and c.func.id in names]
    return calls


def replace_span(path: Path, node, new_text: str) -> None:
    """Replace the source of ``node`` (by its exact span) with ``new_text``."""
    lines = path.read_text().splitlines(keepends=True)
    start = sum(len(line) for line in lines[: node.lineno - 1]) + node.col_offset
    end = sum(len(line) for line in lines[: node.end_lineno - 1]) + node.end_col_offset
    text = "".join(lines)
    path.write_text(text[:start] + new_text + text[end:])


def plant_layer_call_without_scaling(path: Path) -> None:
    """The worker calls its layers as speculators 0.3.0 did, dropping llama_4_scaling."""
    calls = layer_loop_calls(ast.parse(path.read_text()))
    assert len(calls) == 1, f"expected one decoder-layer call in {path}, found {len(calls)}"
    replace_span(path, calls[0], "layer(positions, hidden_states, residual)")


def plant_scaling_never_stored(path: Path) -> None:
    """The layer call still passes **kwargs, but llama_4_scaling never gets into them."""
    tree = ast.parse(path.read_text())
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
        and t.slice.value == "llama_4_scaling" for t in n.targets)]
    if not stores:
        pytest.skip("the patched worker passes llama_4_scaling directly, not through a kwargs dict")
    for store in sorted(stores, key=lambda n: -n.lineno):
        replace_span(path, store, "pass")


def plant_without_call(method: str):
    def plant(path: Path) -> None:
        tree = ast.parse(path.read_text())
        stmts = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                 and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == method]
        assert stmts, f"the patched file never calls .{method}()"
        for stmt in sorted(stmts, key=lambda n: -n.lineno):
            replace_span(path, stmt, "pass")
    return plant


@pytest.mark.parametrize("family", ["deepseek_v3", "llama", None])
def test_patched_copy_has_no_drift(hostenv_python, spec_copy, family):
    root, params = spec_copy
    apply_patch_set(root)
    payload = run_drift(hostenv_python, params(model_family=family))
    assert [r["name"] for r in payload["records"]] == ["drift.none"], payload["records"]
    assert payload["records"][0]["detail"]["call_sites"] >= 20


def test_patcher_apply_then_revert_in_one_process(hostenv_python, spec_copy, tiny_models):
    """What `specops patch` does: apply, re-check in the same python (the AST cache must
    see the new files), revert, re-check."""
    root, _params = spec_copy
    base = {"site_packages": str(root), "patches_root": str(PATCH_SET.parent),
            "model_path": str(tiny_models["deepseek_v3"]), "device": "cpu"}
    script = (
        "import json, sys; from remote import drift, patcher\n"
        "p = json.loads(sys.argv[1]); ids = lambda: sorted(r['name'] for r in drift.main(p)['records'])\n"
        "out = {'before': ids()}\n"
        "out['apply'] = [r['status'] for r in patcher.main({**p, 'action': 'apply'})['records']]\n"
        "out['after'] = ids()\n"
        "out['revert'] = [r['status'] for r in patcher.main({**p, 'action': 'revert'})['records']]\n"
        "out['reverted'] = ids()\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(hostenv_python), "-c", script, json.dumps(base)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == sorted(f"drift.{i}" for i in KNOWN_IDS)
    assert "fail" not in out["apply"] and "changed" in out["apply"]
    assert out["after"] == ["drift.none"]
    assert "fail" not in out["revert"]
    assert out["reverted"] == out["before"]


@pytest.mark.parametrize("rel, plant, drift_id", [
    (WORKER, plant_layer_call_without_scaling, "deepseek-llama4-scaling"),
    (WORKER, plant_scaling_never_stored, "deepseek-llama4-scaling"),
    (GEN, plant_without_call("sample_tokens"), "two-phase-execute-model"),
], ids=["layer-call-drops-it", "kwargs-never-get-it", "no-sample-tokens"])
def test_planted_defect_in_patched_copy_is_caught(hostenv_python, spec_copy, rel, plant, drift_id):
    root, params = spec_copy
    apply_patch_set(root)
    plant(root / rel)
    payload = run_drift(hostenv_python, params())
    records = by_id(payload)
    assert set(records) == {drift_id}, payload["records"]
    assert records[drift_id]["status"] == "fail"  # the tiny DeepSeek-V3 config sets llama_4_scaling
    loc = records[drift_id]["detail"]["locations"][0]
    assert Path(loc["file"]) == root / rel


def test_patch_set_claims_every_known_id(hostenv_python):
    manifest = json.loads((PATCH_SET / "manifest.json").read_text())
    records = by_id(run_drift(hostenv_python, {**DEEPSEEK_CPU, "patches_root": str(PATCH_SET.parent)}))
    assert set(KNOWN_IDS) <= set(manifest["fixes"])
    for drift_id in KNOWN_IDS:
        assert records[drift_id]["detail"]["patch_set"] == PATCH_SET.name, records[drift_id]
        assert PATCH_SET.name in records[drift_id]["fix"]


# ------------------------------------------------------- unwrapping a wrapper model

UNWRAP = '        model = model if hasattr(model, "model") else model.language_model\n'


def test_patched_kimi_follows_the_workers_unwrap(hostenv_python, spec_copy, tiny_models):
    """The patched worker reaches Kimi-K2.5's text model through ``language_model``: the
    wrapper's gate and ``model.model`` findings go; unpatched, they are there."""
    root, params = spec_copy
    kimi = params(model_path=str(tiny_models["kimi_k25"]), model_family=None)
    before = by_id(run_drift(hostenv_python, kimi))
    assert before["model-attr-model"]["status"] == "fail"
    assert "KimiK25ForConditionalGeneration" in before["model-attr-model"]["summary"]
    assert before["eagle3-support-check"]["status"] == "fail"
    apply_patch_set(root)
    assert UNWRAP in (root / WORKER).read_text()
    for model in ("kimi_k25", "deepseek_v3", "llama"):
        payload = run_drift(hostenv_python, params(model_path=str(tiny_models[model]), model_family=None))
        assert [r["name"] for r in payload["records"]] == ["drift.none"], (model, payload["records"])


def test_unwrap_is_evaluated_per_class_not_matched_as_text(hostenv_python, spec_copy, tiny_models):
    """The unwrap's condition decides which class each target ends up with."""
    root, params = spec_copy
    apply_patch_set(root)
    kimi = params(model_path=str(tiny_models["kimi_k25"]), model_family=None)
    llama = params(model_path=str(tiny_models["llama"]), model_family=None)
    # Inverted: the wrapper (no .model) stays the wrapper, Llama is sent to a language_model it lacks.
    edit(root, WORKER, UNWRAP,
         '        model = model.language_model if hasattr(model, "model") else model\n')
    payload = run_drift(hostenv_python, kimi)
    records = by_id(payload)
    assert {"model-attr-model", "eagle3-support-check"} <= drift_ids(payload)
    assert "KimiK25ForConditionalGeneration" in records["model-attr-model"]["summary"]
    records = by_id(run_drift(hostenv_python, llama))
    assert "LlamaForCausalLM has no attribute 'language_model'" in \
        records["model-attr-language-model"]["summary"]
    # The same unwrap written as an if statement, or as getattr with a default, is understood.
    previous = '        model = model.language_model if hasattr(model, "model") else model\n'
    for form in ('        if not hasattr(model, "model"):\n            model = model.language_model\n',
                 '        model = getattr(model, "language_model", model)\n'):
        edit(root, WORKER, previous, form)
        previous = form
        for p in (kimi, llama):
            payload = run_drift(hostenv_python, p)
            assert [r["name"] for r in payload["records"]] == ["drift.none"], (form, payload["records"])


@pytest.mark.parametrize("test,platform,answer", [
    ("current_platform.is_rocm()", "cuda", False), ("current_platform.is_cuda()", "cuda", True),
    ("TYPE_CHECKING or current_platform.is_cuda()", "cpu", False),
    ("not current_platform.is_cpu()", "cpu", False), ("current_platform.is_cuda_alike()", "rocm", True),
    ('current_platform.device_type == "cpu"', "cpu", True), ("envs.VLLM_X", "cuda", None),
    ("current_platform.is_cpu() and envs.VLLM_X", "cuda", False)])
def test_per_platform_imports_follow_the_hosts_platform(test, platform, answer):
    """A vllm.models.<family> package's __init__ picks its implementation with these tests (vLLM 0.32+);
    a test about anything else keeps both branches (None)."""
    from remote.drift.pyindex import platform_test

    assert platform_test(ast.parse(test, mode="eval").body, platform) is answer
