"""The patch set and the remote patcher, on a copy of the test host's real speculators 0.3.0.

Every test copies the installed ``speculators`` package (and its dist-info, so
``importlib.metadata`` finds it there) into a temporary site-packages and points the
patcher at it with ``site_packages``: the shared host env is never modified. The
patcher runs in the host env's python, as it does on a real host (vLLM's version is
read from that env's metadata).

The ``vllm`` tests then run the real ``VllmHiddenStatesGenerator`` from the patched
copy (``PYTHONPATH`` puts it first) on the tiny Llama and DeepSeek-V3 at TP=1 and TP=2,
and check its states against HF transformers and vLLM's own model forward. Those cases run
one after the other in one host-env process (``generator_runs``), each with its own generator
and ranks, each asserted by its own test.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hostcall
from specops.testhost.hostenv import own_vllm_metadata

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote import patcher  # noqa: E402  stdlib only: safe in the controller's python
from remote.system import versions
from remote.patcher import patchsets

SET_DIR = REPO / "patches" / "speculators-0.3.0_vllm-0.12-0.16"
MANIFEST = json.loads((SET_DIR / "manifest.json").read_text())
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"
DRIFT_IDS = {
    "scheduler-config-is-encoder-decoder", "kv-cache-config-from-groups",
    "scheduler-block-size", "request-block-hasher", "two-phase-execute-model",
    "embed-input-ids", "eagle3-support-check", "cuda-mem-get-info",
    "collective-rpc-unique-reply", "deepseek-llama4-scaling",
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected(rel: str, state: str) -> str:
    entry = next(f for f in MANIFEST["files"] if f["path"] == rel)
    return entry[f"sha256_{state}"]


def run_patcher(python: Path, **params) -> dict:
    """``remote.patcher.main(params)`` in the host env's python (its long-lived host process,
    ``tests/hostcall.py``); returns the payload."""
    params.setdefault("patches_root", str(REPO / "patches"))
    return hostcall.call(python, "remote.patcher:main", params, timeout=120)


def status_records(python: Path, patches_root: Path, site: Path) -> list:
    """``remote.patcher.status_records`` (what preflight reports) in the host env's python."""
    return hostcall.call(python, "remote.patcher:status_records",
                         {"patches_root": str(patches_root), "site_packages": str(site)})


def by_name(payload: dict) -> dict:
    return {r["name"]: r for r in payload["records"]}


@pytest.fixture(scope="session")
def host_site_packages(hostenv_python) -> Path:
    out = subprocess.run([str(hostenv_python), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def pristine_site(site: Path, hostenv_python: Path, host_site_packages: Path) -> Path:
    """``site`` made a site-packages dir holding a pristine copy of speculators 0.3.0."""
    site.mkdir(parents=True)
    shutil.copytree(host_site_packages / "speculators", site / "speculators",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for dist_info in host_site_packages.glob("speculators-*.dist-info"):
        shutil.copytree(dist_info, site / dist_info.name)
    own_vllm_metadata(hostenv_python, site)  # vLLM's first-import alias lands here, not in the shared env
    # The shared env may have been patched by a demo run: start from pristine anyway.
    if any(sha(site / f["path"]) == f["sha256_patched"] for f in MANIFEST["files"]):
        reverted = run_patcher(hostenv_python, action="revert", site_packages=str(site))
        assert protocol_worst(reverted) != "fail", reverted
    for f in MANIFEST["files"]:
        assert sha(site / f["path"]) == f["sha256_pristine"], f"{f['path']} is not pristine"
    return site


@pytest.fixture
def site(tmp_path, hostenv_python, host_site_packages) -> Path:
    """A pristine copy of speculators 0.3.0 in its own site-packages dir."""
    return pristine_site(tmp_path / "site-packages", hostenv_python, host_site_packages)


def patch_set_copy(tmp_path: Path, **manifest_changes) -> Path:
    """A patches root holding a copy of the real set with ``manifest_changes`` applied; returns the root."""
    root = tmp_path / "patches"
    shutil.copytree(SET_DIR, root / SET_DIR.name)
    manifest_path = root / SET_DIR.name / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(manifest_changes)
    manifest_path.write_text(json.dumps(manifest))
    return root


def protocol_worst(payload) -> str:
    from remote.wire import protocol

    return protocol.worst(payload["records"])


def snapshot(site: Path) -> dict:
    return {f["path"]: (site / f["path"]).read_bytes() for f in MANIFEST["files"]}


# --------------------------------------------------------------------------- the set
def test_manifest_names_every_drift_item_and_valid_specifiers():
    assert set(MANIFEST["fixes"]) >= DRIFT_IDS
    assert patchsets.problems(MANIFEST) == []
    assert versions.version_matches("0.3.0", MANIFEST["speculators"])
    assert versions.version_matches("0.16.0", MANIFEST["vllm"])
    assert versions.version_matches("0.12.0", MANIFEST["vllm"])
    assert not versions.version_matches("0.17.0", MANIFEST["vllm"])
    assert not versions.version_matches("0.11.2", MANIFEST["vllm"])


def test_every_drift_id_is_marked_in_the_patched_code(site):
    """Each fix is a commented change (``# specops[<id>]``) in the patched files."""
    text = "".join(patcher.apply_hunks((site / f["path"]).read_text(),
                                       patcher.parse_unified_diff((SET_DIR / f["diff"]).read_text()))
                   for f in MANIFEST["files"])
    for drift_id in DRIFT_IDS:
        assert f"# specops[{drift_id}]" in text, drift_id


def test_diffs_turn_pristine_into_the_manifest_sha(site):
    for f in MANIFEST["files"]:
        hunks = patcher.parse_unified_diff((SET_DIR / f["diff"]).read_text())
        pristine = (site / f["path"]).read_text()
        patched = patcher.apply_hunks(pristine, hunks)
        assert hashlib.sha256(patched.encode()).hexdigest() == f["sha256_patched"]
        assert patcher.apply_hunks(patched, hunks, reverse=True) == pristine


# --------------------------------------------------------------------------- hunk applier
ORIGINAL = "a\nb\nc\nd\ne\nf\n"
DIFF = textwrap.dedent("""\
    --- a/x.py
    +++ b/x.py
    @@ -2,3 +2,3 @@
     b
    -c
    +C
     d
    @@ -6,1 +6,2 @@
     f
    +g
    """)


def test_hunk_applier_applies_and_reverses():
    hunks = patcher.parse_unified_diff(DIFF)
    assert patcher.apply_hunks(ORIGINAL, hunks) == "a\nb\nC\nd\ne\nf\ng\n"
    assert patcher.apply_hunks("a\nb\nC\nd\ne\nf\ng\n", hunks, reverse=True) == ORIGINAL


def test_hunk_applier_refuses_shifted_or_changed_context():
    hunks = patcher.parse_unified_diff(DIFF)
    with pytest.raises(patcher.HunkMismatch):  # same lines one further down: no offset search
        patcher.apply_hunks("z\n" + ORIGINAL, hunks)
    with pytest.raises(patcher.HunkMismatch) as info:  # one context line differs
        patcher.apply_hunks(ORIGINAL.replace("d\n", "d \n"), hunks)
    assert info.value.hunk_index == 0 and info.value.found == ["b\n", "c\n", "d \n"]


def test_hunk_parser_checks_counts_and_no_newline_marker():
    with pytest.raises(ValueError, match="header says"):
        patcher.parse_unified_diff("@@ -1,2 +1,2 @@\n a\n-b\n+B\n+extra\n")
    hunks = patcher.parse_unified_diff("@@ -1 +1 @@\n-a\n\\ No newline at end of file\n+b\n")
    assert patcher.apply_hunks("a", hunks) == "b\n"


def test_tests_never_call_gnu_patch():
    """Patch sets are applied in tests with the patcher's own hunk applier only: hosts may lack
    GNU ``patch``, and a fuzzy applier would hide a diff that no longer fits."""
    gnu = re.compile(r"""[\[(]\s*["'](?:/usr/bin/)?patch["']|which\(\s*["']patch["']|["']patch -p""")
    offenders = [f"{path.name}:{n}" for path in sorted((REPO / "tests").glob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if gnu.search(line)]
    assert offenders == []


def test_patcher_package_keeps_its_public_names():
    """Callers say ``patcher.<name>``; the split into hunks/target/transaction keeps them all."""
    for name in ("main", "status_records", "Patcher", "PatchError", "HunkMismatch", "parse_unified_diff",
                 "apply_hunks", "unified_diff", "LOCK_FILE", "BACKUP_DIR", "APPLIED_FILE", "patch_lock"):
        assert hasattr(patcher, name), name


def test_range_form_manifest_is_refused_by_patch_and_preflight_alike(site, hostenv_python, tmp_path):
    """``0.12-0.16`` is no PEP 440 specifier: one refusal, naming the manifest and how to write it,
    from ``specops patch`` and from preflight's patch status (drift then names no set either)."""
    root = patch_set_copy(tmp_path, vllm="0.12-0.16")
    before = snapshot(site)
    refused = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site),
                                  patches_root=str(root)))["patch.set"]
    assert refused["status"] == "fail" and "manifest.json: vllm:" in refused["summary"]
    assert "'>=0.12,<0.17'" in refused["summary"] and refused["fix"]
    assert snapshot(site) == before
    [status] = status_records(hostenv_python, root, site)
    assert status["summary"] == refused["summary"]


# --------------------------------------------------------------------------- actions
def test_apply_apply_revert_apply(site, hostenv_python):
    status = by_name(run_patcher(hostenv_python, action="status", site_packages=str(site)))
    assert status["patch.set"]["status"] == "ok"
    assert status["patch.state"]["status"] == "warn"  # not applied yet

    first = run_patcher(hostenv_python, action="apply", site_packages=str(site))
    records = by_name(first)
    for rel in (GENERATOR, WORKER):
        assert records[f"patch.{rel}"]["status"] == "changed", first
        assert re.search(r"^\+\s*# specops", records[f"patch.{rel}"]["detail"]["diff"], re.M)
        assert sha(site / rel) == expected(rel, "patched")
        backup = site / ".specops-backup" / MANIFEST["name"] / rel
        assert sha(backup) == expected(rel, "pristine")
        # byte-compiled: a fresh .pyc of the patched source sits in __pycache__
        assert list((site / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"))

    again = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert {again[f"patch.{r}"]["status"] for r in (GENERATOR, WORKER)} == {"ok"}
    assert by_name(run_patcher(hostenv_python, action="status",
                               site_packages=str(site)))["patch.state"]["status"] == "ok"

    reverted = by_name(run_patcher(hostenv_python, action="revert", site_packages=str(site)))
    for rel in (GENERATOR, WORKER):
        assert reverted[f"patch.{rel}"]["status"] == "changed"
        assert sha(site / rel) == expected(rel, "pristine")

    third = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert {third[f"patch.{r}"]["status"] for r in (GENERATOR, WORKER)} == {"changed"}
    assert all(sha(site / r) == expected(r, "patched") for r in (GENERATOR, WORKER))


def test_revert_without_backup_reverses_the_diff(site, hostenv_python):
    run_patcher(hostenv_python, action="apply", site_packages=str(site))
    shutil.rmtree(site / ".specops-backup")
    reverted = by_name(run_patcher(hostenv_python, action="revert", site_packages=str(site)))
    assert reverted[f"patch.{WORKER}"]["status"] == "changed"
    assert all(sha(site / r) == expected(r, "pristine") for r in (GENERATOR, WORKER))


def test_check_mode_changes_nothing_and_shows_the_diff(site, hostenv_python):
    before = snapshot(site)
    mtimes = {r: (site / r).stat().st_mtime_ns for r in before}
    result = by_name(run_patcher(hostenv_python, action="check", site_packages=str(site)))
    assert snapshot(site) == before
    assert {r: (site / r).stat().st_mtime_ns for r in before} == mtimes
    assert not (site / ".specops-backup").exists()
    diff = result[f"patch.{WORKER}"]["detail"]["diff"]
    assert result[f"patch.{WORKER}"]["status"] == "changed"
    assert diff.startswith(f"--- a/{WORKER}\n+++ b/{WORKER}\n")
    assert "-            else self.get_input_embeddings(input_ids)" in diff
    # the shown diff is exactly what apply then does
    run_patcher(hostenv_python, action="apply", site_packages=str(site))
    applied = patcher.apply_hunks(before[WORKER].decode(), patcher.parse_unified_diff(diff))
    assert applied == (site / WORKER).read_text()
    again = by_name(run_patcher(hostenv_python, action="check", site_packages=str(site)))
    assert again[f"patch.{WORKER}"]["status"] == "ok"
    assert again[f"patch.{WORKER}"]["detail"]["diff"] == ""


def test_hand_edited_file_is_refused_and_untouched(site, hostenv_python):
    worker = site / WORKER
    text = worker.read_text()
    edited = text.replace("else self.get_input_embeddings(input_ids)",
                          "else self.embed_input_ids(input_ids)  # fixed by hand")
    assert edited != text
    worker.write_text(edited)
    before = snapshot(site)
    result = run_patcher(hostenv_python, action="apply", site_packages=str(site))
    records = by_name(result)
    refused = records[f"patch.{WORKER}"]
    assert refused["status"] == "fail" and WORKER in refused["summary"]
    assert "+            else self.embed_input_ids(input_ids)  # fixed by hand" in refused["detail"]["diff"]
    assert refused["detail"]["against"].startswith("pristine")
    assert refused["fix"]
    assert snapshot(site) == before  # neither file touched, the pristine one neither
    assert sha(site / GENERATOR) == expected(GENERATOR, "pristine")
    assert not (site / ".specops-backup").exists()


def test_edit_outside_patched_regions_is_refused_with_a_note(site, hostenv_python):
    worker = site / WORKER
    worker.write_text(worker.read_text() + "\n# local tweak\n")
    before = snapshot(site)
    refused = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert refused[f"patch.{WORKER}"]["status"] == "fail"
    assert "elsewhere" in refused[f"patch.{WORKER}"]["detail"]["note"]
    assert snapshot(site) == before


def test_failure_between_two_files_restores_everything(site, hostenv_python):
    before = snapshot(site)
    result = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site),
                                 inject_failure_after=1))
    rollback = result["patch.rollback"]
    assert rollback["status"] == "fail" and "InjectedFailure" in rollback["detail"]["error"]
    assert rollback["detail"]["restored"] == [GENERATOR]  # it had written the first file
    assert snapshot(site) == before

    run_patcher(hostenv_python, action="apply", site_packages=str(site))
    patched = snapshot(site)
    result = by_name(run_patcher(hostenv_python, action="revert", site_packages=str(site),
                                 inject_failure_after=1))
    assert result["patch.rollback"]["status"] == "fail"
    assert snapshot(site) == patched


def test_two_concurrent_runs_one_applies_one_is_refused(site, hostenv_python):
    holder_code = ("import json, sys; from remote import patcher; "
                   "print(json.dumps(patcher.main(json.loads(sys.argv[1]))))")
    params = {"action": "apply", "site_packages": str(site),
              "patches_root": str(REPO / "patches"), "hold_lock_s": 6}
    first = subprocess.Popen([str(hostenv_python), "-c", holder_code, json.dumps(params)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = site / patcher.LOCK_FILE
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the first run holds the lock
        if lock.exists() and f"pid {first.pid}" in lock.read_text():
            break
        time.sleep(0.05)
    else:
        first.kill()
        pytest.fail("the first run never took the lock")
    second = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    out, err = first.communicate(timeout=120)
    first_records = by_name(json.loads(out.strip().splitlines()[-1]))
    assert second["patch.lock"]["status"] == "fail"
    assert "another patch run holds" in second["patch.lock"]["summary"]
    assert f"pid {first.pid}" in second["patch.lock"]["detail"]["holder"]
    assert first_records[f"patch.{WORKER}"]["status"] == "changed"
    assert all(sha(site / r) == expected(r, "patched") for r in (GENERATOR, WORKER))


def test_lock_held_by_another_process_refuses_without_touching(site, hostenv_python):
    lock_path = site / patcher.LOCK_FILE
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(site)
        refused = by_name(run_patcher(hostenv_python, action="revert", site_packages=str(site)))
        assert refused["patch.lock"]["status"] == "fail"
        assert snapshot(site) == before
    applied = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert applied[f"patch.{GENERATOR}"]["status"] == "changed"


def test_no_matching_patch_set_is_refused_clearly(site, hostenv_python, tmp_path):
    root = patch_set_copy(tmp_path, vllm=">=0.17,<0.18")
    before = snapshot(site)
    result = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site),
                                 patches_root=str(root)))
    assert result["patch.set"]["status"] == "fail"
    assert "no patch set for speculators 0.3.0" in result["patch.set"]["summary"]
    assert "vllm>=0.17,<0.18" in result["patch.set"]["fix"]
    assert snapshot(site) == before


def test_status_records_for_preflight(site, hostenv_python, tmp_path):
    records = {r["name"]: r for r in status_records(hostenv_python, REPO / "patches", site)}
    assert records["patch.set"]["detail"]["set"] == MANIFEST["name"]
    assert records["patch.state"]["detail"]["applied"] is False
    assert records["patch.state"]["status"] == "warn" and records["patch.state"]["fix"]
    # no set for these versions: a warning for preflight (the engine may need none)
    root = tmp_path / "patches"
    shutil.copytree(SET_DIR, root / SET_DIR.name)
    manifest = json.loads((root / SET_DIR.name / "manifest.json").read_text())
    manifest["speculators"] = "==0.4.0"
    (root / SET_DIR.name / "manifest.json").write_text(json.dumps(manifest))
    [only] = status_records(hostenv_python, root, site)
    assert only["name"] == "patch.set" and only["status"] == "warn"
    assert "no patch set for speculators 0.3.0" in only["summary"]


# --------------------------------------------------------------------------- the real run
#: (model, TP, reference, layer order, all experts). "reversed" passes the default ids
#: last-first: the patched generator returns them in the order asked (upstream: model
#: order). "all experts" runs a view of a MoE model that selects every expert, so that
#: HF (float32) and vLLM (bf16) route alike and the HF comparison is a strict check.
#: Each case is two vLLM loads (about two minutes on 2 cores), so each covers a different
#: path: dense at TP=2 against both references; MoE in-process (TP=1) against both,
#: with the llama_4_scaling control. MoE routing across two ranks through the patched
#: generator is test_smoke_verify's DeepSeek-V3 TP=2 smoke and test_extract's README run
#: (both verified against transformers), the text_config wrapper across two ranks its
#: Kimi-K2.5 smoke (its twin's routing margins make the HF check strict).
SMOKE_CASES = [
    ("llama", 2, "auto", "reversed", False),
    ("deepseek_v3", 1, "auto", "default", True),
]


def smoke_case_id(model, tp, all_experts) -> str:
    return f"{model}-tp{tp}" + ("-all-experts" if all_experts else "")


def smoke_layer_ids(model_dir: Path, order: str) -> list:
    config = json.loads((model_dir / "config.json").read_text())
    n = config.get("text_config", config)["num_hidden_layers"]
    layer_ids = [2, n // 2, n - 3, n - 1]  # speculators 0.3.0's default, output convention
    return layer_ids[::-1] if order == "reversed" else layer_ids


#: One host-env process runs every generator case of this module, one after the other, on
#: one patched copy: importing torch, transformers, vLLM and speculators is paid once, not
#: five times. Each case is ``remote.dev.smoke_generator.run`` as its command line runs it
#: (its own generator, its own vLLM ranks, spawned with that case's environment), and each
#: case's ranks are shut down before the next one starts. Every case prints its own line.
GENERATOR_CASES = textwrap.dedent('''
    import gc, json, os, sys, traceback

    def refuse_duplicates(model):
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        try:
            VllmHiddenStatesGenerator(model, layer_ids=[2, 2, 5, 7])
        except ValueError as exc:
            return f"REFUSED {exc}"
        return "ACCEPTED"

    def smoke(case):
        from remote.dev import smoke_generator
        return smoke_generator.run(case["model"], tp=case["tp"], layer_ids=case["layer_ids"],
                                   reference=case["reference"], all_experts=case["all_experts"])

    def shut_down_ranks():
        """The ranks of the generator a case made (its executor's finalizer would run only at exit)."""
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
        gc.collect()
        for executor in [o for o in gc.get_objects() if isinstance(o, MultiprocExecutor)]:
            executor.shutdown()

    def report(case_id, env, fn, *args):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the case's ranks are spawned with it
        try:
            out = {"id": case_id, "result": fn(*args)}
        except BaseException as exc:  # reported per case: the next case still runs
            out = {"id": case_id, "error": f"{type(exc).__name__}: {exc}\\n{traceback.format_exc()[-6000:]}"}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            shut_down_ranks()
        except BaseException as exc:
            out.setdefault("shutdown_error", f"{type(exc).__name__}: {exc}")
        print("CASE " + json.dumps(out, default=str), flush=True)

    if __name__ == "__main__":  # vLLM spawns its ranks from this file: the guard is required
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        args = json.loads(sys.argv[1])
        report("duplicate-layer-ids", {}, refuse_duplicates, args["duplicate_model"])
        for case in args["cases"]:
            # TP=2 ranks each need their own core: else "Not enough allowed NUMA nodes"
            report(case["id"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if case["tp"] == 2 else {}, smoke, case)
''')


@pytest.fixture(scope="module")
def generator_runs(hostenv_python, host_site_packages, tiny_models, tmp_path_factory) -> dict:
    """Every generator case (:data:`SMOKE_CASES` and the duplicate-id refusal) on one patched copy,
    in one process. Returns ``site``, ``applied`` (the patcher's payload), ``cases`` (by id: the
    case's report, or its error) and ``tail`` (the process's output, for failures)."""
    work = tmp_path_factory.mktemp("generator")
    site = pristine_site(work / "site-packages", hostenv_python, host_site_packages)
    applied = run_patcher(hostenv_python, action="apply", site_packages=str(site))
    script = work / "generator_cases.py"
    script.write_text(GENERATOR_CASES)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_MLA_DISABLE="1")
    cases = [{"id": smoke_case_id(model, tp, all_experts), "model": str(tiny_models[model]), "tp": tp,
              "reference": reference, "layer_ids": smoke_layer_ids(Path(tiny_models[model]), order),
              "all_experts": all_experts}
             for model, tp, reference, order, all_experts in SMOKE_CASES]
    started = time.monotonic()
    proc = subprocess.run([str(hostenv_python), str(script),
                           json.dumps({"duplicate_model": str(tiny_models["llama"]), "cases": cases})],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3600)  # a hang guard: one loaded 2-core case took 600+ s
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[len("CASE "):])
            found[case["id"]] = case
    print(f"\ngenerator cases, one process: {time.monotonic() - started:.0f} s; "
          + ", ".join(f"{i} load {c['result'].get('load_s')} s" for i, c in found.items()
                      if isinstance(c.get("result"), dict)))
    return {"site": site, "applied": applied, "cases": found,
            "tail": f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"}


def generator_case(runs: dict, case_id: str):
    """That case's result; its own error (or the process's tail) when it has none."""
    case = runs["cases"].get(case_id)
    assert case is not None and "result" in case, (case or {}).get("error", "never reported") + runs["tail"]
    assert "shutdown_error" not in case, case["shutdown_error"]
    return case["result"]


@pytest.mark.vllm
@pytest.mark.parametrize("model,tp,reference,order,all_experts", SMOKE_CASES,
                         ids=[smoke_case_id(m, tp, a) for m, tp, _, _, a in SMOKE_CASES])
def test_patched_generator_extracts_correct_states(model, tp, reference, order, all_experts,
                                                   generator_runs, tiny_models):
    assert protocol_worst(generator_runs["applied"]) == "changed", generator_runs["applied"]
    config = json.loads((Path(tiny_models[model]) / "config.json").read_text())
    layer_ids = smoke_layer_ids(Path(tiny_models[model]), order)
    report = generator_case(generator_runs, smoke_case_id(model, tp, all_experts))
    assert report["speculators_file"].startswith(str(generator_runs["site"]))  # the patched copy ran
    assert report["checks"] and report["ok"], json.dumps(report["checks"])
    assert report["layer_ids"] == layer_ids
    assert len(report["samples"]) == len(report["prompt_tokens"]) > 10  # text-sorted ids would bite
    assert report["chunked_requests"], "the batch must span a chunked prefill"
    assert len(report["steps"]) >= 3 and max(report["steps"]) == 32  # max_num_seqs bites too
    for sample, tokens in zip(report["samples"], report["prompt_tokens"]):
        assert sample["shapes"] == [[tokens, 256]] * 4 and set(sample["dtypes"]) == {"bfloat16"}
        assert not any(sample["nan"])
    if reference != "hf":
        assert report["vllm_reference_max_rel_err"] <= 1e-3
        if report["llama_4_scaling"]:
            assert report["checks"]["control_detects_missing_scaling"]
    dense = "n_routed_experts" not in config.get("text_config", config)
    if reference != "vllm" and (dense or all_experts):
        assert report["checks"]["hf_reference"] and report["hf_reference_min_agreement"] >= 0.9


def test_patched_generator_refuses_duplicate_layer_ids(generator_runs):
    """Upstream keeps a set of ids and silently returns fewer layers; patched, it refuses."""
    assert protocol_worst(generator_runs["applied"]) == "changed", generator_runs["applied"]
    said = generator_case(generator_runs, "duplicate-layer-ids")
    assert "REFUSED Duplicate layer ids [2, 2, 5, 7]" in said, said


def test_all_experts_view_keeps_weights_and_selects_every_expert(tiny_models, tmp_path):
    from remote.dev.smoke_generator import all_experts_twin

    for name in ("deepseek_v3", "kimi_k25"):
        source = Path(tiny_models[name])
        view = Path(all_experts_twin(str(source), str(tmp_path / name)))
        config = json.loads((view / "config.json").read_text())
        text = config.get("text_config", config)
        assert text["num_experts_per_tok"] == text["n_routed_experts"] > 1
        original = json.loads((source / "config.json").read_text())
        assert original.get("text_config", original)["num_experts_per_tok"] < text["n_routed_experts"]
        for shard in source.glob("*.safetensors"):
            assert (view / shard.name).resolve() == shard.resolve()
    with pytest.raises(ValueError, match="not a MoE model"):
        all_experts_twin(str(tiny_models["llama"]), str(tmp_path / "llama"))


# --------------------------------------------------------------------------- upgrades
def older_revision(tmp_path: Path, site: Path) -> tuple[Path, dict]:
    """A patches root holding an earlier revision of the real set (same name and versions):
    each file's patched text has one extra comment line, its diff and sha256_patched made
    from that text. Returns (root, {rel: sha256 of the older patched file})."""
    root = tmp_path / "older-patches"
    shutil.copytree(SET_DIR, root / SET_DIR.name)
    manifest = json.loads((SET_DIR / "manifest.json").read_text())
    older = {}
    for entry in manifest["files"]:
        pristine = (site / entry["path"]).read_text()
        patched = patcher.apply_hunks(pristine, patcher.parse_unified_diff((SET_DIR / entry["diff"]).read_text()))
        lines = patched.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if "# specops[" in line)
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
        lines.insert(at, f"{indent}# specops: older revision of this hunk\n")
        text = "".join(lines)
        (root / SET_DIR.name / entry["diff"]).write_text(patcher.unified_diff(pristine, text, entry["path"]))
        entry["sha256_patched"] = older[entry["path"]] = hashlib.sha256(text.encode()).hexdigest()
    (root / SET_DIR.name / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root, older


def applied_record(site: Path) -> dict:
    return json.loads((site / ".specops-backup" / MANIFEST["name"] / "applied.json").read_text())


def test_apply_upgrades_a_host_patched_by_an_earlier_revision(site, hostenv_python, tmp_path):
    old_root, older = older_revision(tmp_path, site)
    first = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site),
                                patches_root=str(old_root)))
    assert {first[f"patch.{r}"]["status"] for r in (GENERATOR, WORKER)} == {"changed"}
    assert all(sha(site / r) == older[r] for r in (GENERATOR, WORKER))
    record = applied_record(site)
    assert {r: f["sha256_written"] for r, f in record["files"].items()} == older
    assert record["revision"] == hashlib.sha256((old_root / SET_DIR.name / "manifest.json").read_bytes()).hexdigest()

    # The current set sees what the earlier one wrote: status warns, check shows the diff.
    state = by_name(run_patcher(hostenv_python, action="status", site_packages=str(site)))["patch.state"]
    assert state["status"] == "warn" and "earlier revision" in state["summary"], state
    assert set(state["detail"]["files"].values()) == {"earlier-revision"}
    before = snapshot(site)
    checked = by_name(run_patcher(hostenv_python, action="check", site_packages=str(site)))
    assert snapshot(site) == before
    rec = checked[f"patch.{WORKER}"]
    assert rec["status"] == "changed" and "upgraded from an earlier revision" in rec["summary"]
    assert re.search(r"^-\s*# specops: older revision of this hunk$", rec["detail"]["diff"], re.M)
    new_worker = patcher.apply_hunks(before[WORKER].decode(), patcher.parse_unified_diff(rec["detail"]["diff"]))
    assert hashlib.sha256(new_worker.encode()).hexdigest() == expected(WORKER, "patched")

    upgraded = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    for rel in (GENERATOR, WORKER):
        rec = upgraded[f"patch.{rel}"]
        assert rec["status"] == "changed", upgraded
        assert f"upgraded from an earlier revision of {MANIFEST['name']}" in rec["summary"]
        assert sha(site / rel) == expected(rel, "patched")
        assert sha(site / ".specops-backup" / MANIFEST["name"] / rel) == expected(rel, "pristine")
    record = applied_record(site)
    assert record["revision"] == hashlib.sha256((SET_DIR / "manifest.json").read_bytes()).hexdigest()
    assert all(record["files"][r]["sha256_written"] == expected(r, "patched") for r in (GENERATOR, WORKER))
    assert by_name(run_patcher(hostenv_python, action="status",
                               site_packages=str(site)))["patch.state"]["status"] == "ok"


def test_failed_upgrade_rolls_back_to_the_earlier_revision(site, hostenv_python, tmp_path):
    old_root, older = older_revision(tmp_path, site)
    run_patcher(hostenv_python, action="apply", site_packages=str(site), patches_root=str(old_root))
    before, record = snapshot(site), applied_record(site)
    result = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site),
                                 inject_failure_after=1))
    assert result["patch.rollback"]["status"] == "fail"
    assert result["patch.rollback"]["detail"]["restored"] == [GENERATOR]
    assert snapshot(site) == before and applied_record(site) == record


def test_hand_edit_after_an_earlier_revision_is_still_refused(site, hostenv_python, tmp_path):
    old_root, _older = older_revision(tmp_path, site)
    run_patcher(hostenv_python, action="apply", site_packages=str(site), patches_root=str(old_root))
    worker = site / WORKER
    worker.write_text(worker.read_text() + "\n# local tweak\n")
    before = snapshot(site)
    for action in ("apply", "revert"):
        refused = by_name(run_patcher(hostenv_python, action=action, site_packages=str(site)))
        rec = refused[f"patch.{WORKER}"]
        assert rec["status"] == "fail" and "earlier revision" in rec["summary"], rec
        assert "+# local tweak" in rec["detail"]["diff"]  # shown against the pristine backup
        assert snapshot(site) == before
    state = by_name(run_patcher(hostenv_python, action="status", site_packages=str(site)))["patch.state"]
    assert state["status"] == "fail"


def test_revert_after_an_earlier_revision_restores_pristine(site, hostenv_python, tmp_path):
    old_root, _older = older_revision(tmp_path, site)
    run_patcher(hostenv_python, action="apply", site_packages=str(site), patches_root=str(old_root))
    reverted = by_name(run_patcher(hostenv_python, action="revert", site_packages=str(site)))
    for rel in (GENERATOR, WORKER):
        assert reverted[f"patch.{rel}"]["status"] == "changed", reverted
        assert sha(site / rel) == expected(rel, "pristine")
    assert not (site / ".specops-backup" / MANIFEST["name"] / "applied.json").exists()
    assert by_name(run_patcher(hostenv_python, action="status",
                               site_packages=str(site)))["patch.state"]["status"] == "warn"


def test_earlier_revision_without_a_pristine_backup_is_refused(site, hostenv_python, tmp_path):
    """The record alone is not enough: upgrading needs the pristine text it kept."""
    old_root, _older = older_revision(tmp_path, site)
    run_patcher(hostenv_python, action="apply", site_packages=str(site), patches_root=str(old_root))
    (site / ".specops-backup" / MANIFEST["name"] / WORKER).write_text("not the pristine file\n")
    before = snapshot(site)
    refused = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert refused[f"patch.{WORKER}"]["status"] == "fail"
    assert snapshot(site) == before


def test_apply_on_a_patched_host_without_a_record_writes_one(site, hostenv_python):
    """Hosts patched before records existed get one on the next apply, so that they can
    be upgraded by the revision after."""
    run_patcher(hostenv_python, action="apply", site_packages=str(site))
    (site / ".specops-backup" / MANIFEST["name"] / "applied.json").unlink()
    before = snapshot(site)
    again = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert {again[f"patch.{r}"]["status"] for r in (GENERATOR, WORKER)} == {"ok"}
    assert snapshot(site) == before
    assert all(applied_record(site)["files"][r]["sha256_written"] == expected(r, "patched")
               for r in (GENERATOR, WORKER))
