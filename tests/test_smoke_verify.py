"""``smoke`` and ``verify`` for real: tiny twins through the real vLLM CPU build and the
real (patched) speculators 0.3.0, over real SSH, checked against transformers.

Every env the extraction runs in is a throwaway overlay (``make_overlay_env``): the
shared cached host env is never patched. Kinds of overlay used here:

* ``patched``   the real patch set applied (``remote.patcher``) -- the healthy host;
* ``unpatched`` speculators 0.3.0 as released -- smoke must fail with the root cause;
* ``no-llama4`` patched, then the PLANTED DEFECT: the worker's ``llama_4_scaling`` is
  replaced by ``None`` in the overlay's own copy of custom_worker.py -- verify must fail.

vLLM CPU rope: vLLM 0.16's CPU rotary op (``RotaryEmbedding.forward_cpu``) rotates a
3-D ``[tokens, heads, dim]`` query wrongly (5-6 abs error vs forward_native on unit
inputs; 2-D inputs are fine). Llama passes 2-D q/k; DeepSeek's non-MLA attention (the
only one vLLM runs on CPU) passes a 3-D ``q_pe``, so every DeepSeek state past position
0 is wrong on a CPU host -- fp32 transformers vs vLLM: 35-43 % nrmse from layer 0 on
the sharp twin (found by verify itself). GPU hosts use the CUDA op and MLA. The
overlays (make_overlay_env) carry specops/testhost/vllm_cpu_rope_fix.py (forward_native for 3-D inputs), so that
what is tested is speculators and the worker, not that CPU kernel;
``test_verify_catches_the_vllm_cpu_rope_bug`` proves verify sees the bug without it.

Kimi-K2.5 (``text_config`` wrapper): the tiny reference model lacks the remote-code
``configuration_kimi_k25.py`` its ``auto_map`` names; a real checkpoint ships it, so the
Kimi target here gets a stand-in on disk (``KIMI_CONFIG``), and the twin must carry it.

Wall time: 7.5 minutes for the whole file on the 2-core box (12 while other vLLM jobs
ran: a vLLM TP=2 load takes 25-150 s depending on that load); see
scripts/bench_smoke.py for per-model smoke times.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.result import HostReport
from specops.smoke import smoke_step
from specops.verify import verify_step

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
def cli_env() -> dict:
    return {**os.environ, **OFFLINE, "COLUMNS": "250"}


WORKER = "speculators/data_generation/custom_worker.py"
LLAMA4_LINE = 'layer_kwargs["llama_4_scaling"] = llama_4_scaling'


def site_of(python) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def make_env(base_python, dest: Path, kind: str = "patched", rope_fix: bool = True) -> Path:
    """An overlay env of ``kind`` (patched | unpatched | no-llama4); returns its python."""
    from specops.testhost.hostenv import make_overlay_env

    python = make_overlay_env(base_python, dest, rope_fix=rope_fix)
    site = site_of(python)
    if kind in ("patched", "no-llama4"):
        code = ("import json,sys; from remote import patcher; "
                "print(json.dumps(patcher.main({'action': 'apply', 'site_packages': sys.argv[1]})))")
        out = subprocess.run([str(python), "-c", code, str(site)], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}, check=True)
        records = json.loads(out.stdout.strip().splitlines()[-1])["records"]
        assert all(r["status"] != "fail" for r in records), records
    if kind == "no-llama4":
        worker = site / WORKER
        text = worker.read_text()
        assert text.count(LLAMA4_LINE) == 1, "the patched worker changed; update the planted defect"
        worker.write_text(text.replace(LLAMA4_LINE, 'layer_kwargs["llama_4_scaling"] = None  # PLANTED DEFECT'))
    return python


def vllm_env(tp: int) -> dict:
    env = {**OFFLINE, "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return env


def write_inventory(path: Path, testhost: dict, **fields) -> Path:
    host = {"address": "127.0.0.1", "port": testhost["port"], "user": testhost["user"],
            "key": testhost["key"], "known_hosts": testhost["known_hosts"], "device": "cpu",
            "engine": "speculators-0.3", "seq_len": 96, "batch_size": 4}
    host.update(fields)
    path.write_text(yaml.safe_dump({"hosts": {"th": host}}))
    return path


def host_for(tmp: Path, testhost: dict, python, model, dataset, tp: int, **fields) -> Host:
    """The test host with ``python`` as its env; work dir ``tmp/work`` unless ``work_dir`` says otherwise."""
    fields = {"work_dir": str(tmp / "work"), "output_dir": str(tmp / "real-output"), **fields}
    inv = load_inventory(write_inventory(
        tmp / f"inventory-{time.monotonic_ns()}.yaml", testhost, python=str(python), model_path=str(model),
        dataset=str(dataset), tp=tp, env=vllm_env(tp), **fields))
    return Host(inv.hosts["th"], inv)


def by_name(report) -> dict:
    return {r.name: r for r in report.records}


def assert_healthy_smoke(report, model_type: str, layers=(2, 4, 5, 7)):
    recs = by_name(report)
    assert not report.failed, [(r.name, r.status, r.summary) for r in report.records if r.status != "ok"]
    twin = recs["smoke.twin"]
    assert twin.status in ("ok", "changed") and twin.detail["layers"] == 8
    assert twin.detail["model_type"] == model_type
    assert recs["smoke.run"].status == "ok"
    for lid in layers:
        layer = recs[f"verify.layer.{lid}"]
        assert layer.status == "ok", layer.summary
        assert layer.detail["rel_max"] < layer.detail["rel_tol"] and layer.detail["cos_min"] > 0.999
    assert recs["verify.convention"].status == "ok"
    # the smoke samples never land in the real output dir
    assert "real-output" not in json.dumps(report.data.get("status", {}).get("output_dir"))
    return recs


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def envs(tmp_path_factory, hostenv_python):
    root = tmp_path_factory.mktemp("smoke-envs")
    return {"patched": make_env(hostenv_python, root / "patched")}


@pytest.fixture(scope="module")
def deepseek_root(tmp_path_factory) -> Path:
    """The DeepSeek-V3 smokes' dir: their host work dir is ``<it>/work``, so the first smoke builds the twin
    (9-15 s of transformers) and the others, in other envs, run it as built -- what they test is their env
    (the Kimi test below shows a build, then a reuse)."""
    return tmp_path_factory.mktemp("smoke-ds")


def deepseek_work(deepseek_root: Path) -> dict:
    return {"work_dir": str(deepseek_root / "work")}


@pytest.fixture(scope="module")
def deepseek_smoke(deepseek_root, testhost, envs, tiny_models):
    """One healthy smoke run on the tiny DeepSeek-V3 at TP=2 (shared by several tests)."""
    tmp = deepseek_root
    with host_for(tmp, testhost, envs["patched"], tiny_models["deepseek_v3"], tiny_models["dataset"], 2) as host:
        t0 = time.monotonic()
        report = smoke_step(host, {}, samples=3, verify_samples=3)
        report.data["wall_s"] = time.monotonic() - t0
    return tmp, report


# --------------------------------------------------------------------------- smoke, healthy

@pytest.mark.vllm
def test_smoke_deepseek_v3_tp2_passes_and_verifies_llama_4_scaling(deepseek_smoke):
    _, report = deepseek_smoke
    recs = assert_healthy_smoke(report, "deepseek_v3")
    twin = recs["smoke.twin"].detail
    assert twin["llama_4_scaling"] == {"original_max_position_embeddings": 16, "beta": 0.5}
    assert any("router bias" in note for note in twin["notes"])
    scaling = recs["verify.llama_4_scaling"]
    assert scaling.status == "ok" and scaling.detail["tokens_past"] > 50, scaling.summary
    assert "specops attention hook" in recs["verify.reference"].summary
    assert report.data["status"]["phase_seconds"]["load"] > 0


KIMI_CONFIG = '''"""Stand-in for Kimi-K2.5's remote-code configuration (tests only: every real Kimi-K2.5
checkpoint ships its own configuration_kimi_k25.py; the tiny reference model has none)."""
from transformers import PretrainedConfig
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config or {}
        super().__init__(**kwargs)
'''


@pytest.fixture
def kimi_with_remote_code(tmp_path, tiny_models) -> Path:
    """The tiny Kimi-K2.5 plus the remote-code config its auto_map names (as a real checkpoint has)."""
    target = tmp_path / "kimi_k25"
    shutil.copytree(tiny_models["kimi_k25"], target)
    (target / "configuration_kimi_k25.py").write_text(KIMI_CONFIG)
    return target


@pytest.mark.vllm
# TP=2 only: the wrapper and its remote code must reach both worker processes; the TP=1
# path of the same text model (DeepSeek-V3) runs in the two defect tests below, and
# test_patch_remote checks its states against transformers at TP=1. Through the CLI, as a
# user runs it (Llama's TP=2 path is test_extract.py's and test_patch_remote's); the next
# smoke of the same model finds its twin built and uses it as it is.
def test_smoke_kimi_k25_text_config_through_the_cli_and_the_twin_is_reused(tmp_path, testhost, envs, tiny_models,
                                                                          kimi_with_remote_code):
    inv = write_inventory(tmp_path / "inventory.yaml", testhost, python=str(envs["patched"]),
                          model_path=str(kimi_with_remote_code), dataset=str(tiny_models["dataset"]), tp=2,
                          env=vllm_env(2), work_dir=str(tmp_path / "work"), output_dir=str(tmp_path / "real-output"))
    proc = subprocess.run([str(BIN / "specops"), "smoke", "--inventory", str(inv), "--samples", "2", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=cli_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = HostReport.model_validate(json.loads(proc.stdout)["hosts"][0])
    recs = by_name(report)
    assert recs["smoke.run"].status == "ok" and "tp=2" in recs["smoke.run"].summary
    twin = recs["smoke.twin"].detail
    assert twin["wrapped"] is True and twin["model_type"] == "kimi_k25" and twin["layers"] == 8
    # the target's remote code is on disk, so the twin carries it (the generator loads it)
    assert twin["remote_code"] == ["configuration_kimi_k25.py", "kimi_k25_text_only_processor.py"]
    assert_healthy_smoke(report, "kimi_k25")
    assert "text_config" in recs["verify.reference"].summary  # the reference needs no remote code
    assert not (tmp_path / "real-output").exists()
    assert recs["smoke.twin"].status == "changed"
    with Host(load_inventory(inv).hosts["th"], load_inventory(inv)) as th:
        again = th.run_task("smoke", {"model_path": str(kimi_with_remote_code), "work_dir": str(tmp_path / "work"),
                                      "dataset": str(tiny_models["dataset"]), "samples": 2})
    reused = again["records"][0]
    assert reused["status"] == "ok" and reused["detail"]["built"] is False
    assert reused["detail"]["twin_dir"] == twin["twin_dir"]


# --------------------------------------------------------------------------- smoke, failing

@pytest.mark.vllm
def test_smoke_fails_with_root_cause_on_unpatched_speculators(tmp_path, testhost, hostenv_python, tiny_models,
                                                              deepseek_root):
    python = make_env(hostenv_python, tmp_path / "unpatched", kind="unpatched")
    with host_for(tmp_path, testhost, python, tiny_models["deepseek_v3"], tiny_models["dataset"], 2,
                  **deepseek_work(deepseek_root)) as host:
        report = smoke_step(host, {}, samples=2)
    recs = by_name(report)
    run = recs["smoke.run"]
    assert run.status == "fail" and report.failed
    err = run.detail["error"]
    assert err["type"] and err["message"], err  # never an empty root cause
    assert "is not patched for this vLLM" in err["message"] and "fab patch" in err["message"]
    assert "is_encoder_decoder" in err["message"]  # the first drift item of FACTS.md, named
    assert "Traceback (most recent call last)" in run.detail["traceback"]
    assert f"{err['type']}: {err['message']}" in run.summary and run.fix
    assert not any(name.startswith("verify.") for name in recs)  # nothing to verify


# --------------------------------------------------------------------------- verify catches defects

@pytest.mark.vllm
def test_verify_catches_a_worker_that_drops_llama_4_scaling(tmp_path, testhost, hostenv_python, tiny_models,
                                                            deepseek_root):
    python = make_env(hostenv_python, tmp_path / "no-llama4", kind="no-llama4")
    with host_for(tmp_path, testhost, python, tiny_models["deepseek_v3"], tiny_models["dataset"], 1,
                  **deepseek_work(deepseek_root)) as host:
        report = smoke_step(host, {}, samples=3, verify_samples=3)
        # the same run through the check that scales: one decoder layer of the twin's weights
        layered = verify_step(host, report.data["run_id"], samples=3, reference="layer")
    recs = by_name(report)
    assert recs["smoke.run"].status == "ok"  # the defect runs without an error: the silent kind
    assert report.failed
    layers = [recs[f"verify.layer.{lid}"] for lid in (2, 4, 5, 7)]
    assert all(r.status == "fail" for r in layers), [r.summary for r in layers]
    for r in layers:
        assert r.detail["nrmse"] > 0.10 and r.detail["rel_max"] > 0.10, r.summary
        # the first 16 positions are untouched by the scaling: they still agree
        assert r.detail["first_bad_position"] >= 16, r.detail
    scaling = recs["verify.llama_4_scaling"]
    assert scaling.status == "fail" and "drops llama_4_scaling" in scaling.summary
    assert scaling.detail["nrmse_without_scaling"] < 0.05 < 0.10 < scaling.detail["nrmse_with_scaling"]
    assert recs["verify.convention"].status == "ok"  # right layers, wrong numbers
    # --reference layer: output:4 -> output:5 (the one consecutive pair of 2,4,5,7) is decoder layer 5
    lrecs = by_name(layered)
    assert layered.failed
    layer5 = lrecs["verify.layer.5"]
    assert layer5.status == "fail" and layer5.detail["floor_ratio"] > 5, layer5.summary  # measured 9.1x
    assert layer5.detail["first_bad_position"] >= 16, layer5.detail  # positions before the window agree
    scaling = lrecs["verify.llama_4_scaling"]
    assert scaling.status == "fail" and "drops llama_4_scaling" in scaling.summary, scaling.summary
    assert scaling.detail["nrmse_without_scaling"] <= 0.5 * scaling.detail["nrmse_with_scaling"], scaling.detail
    assert lrecs["verify.convention"].status == "warn", lrecs["verify.convention"].summary  # not a shift
    print(f"\ndropped llama_4_scaling, layer check: {layer5.summary}; {scaling.summary}")


@pytest.mark.vllm
def test_verify_cli_on_a_finished_run(deepseek_smoke, testhost, envs, tiny_models):
    tmp, report = deepseek_smoke
    inv = write_inventory(tmp / "inventory-cli.yaml", testhost, python=str(envs["patched"]),
                          model_path=str(tiny_models["deepseek_v3"]), dataset=str(tiny_models["dataset"]), tp=2,
                          env=vllm_env(2), work_dir=str(tmp / "work"), output_dir=str(tmp / "real-output"))
    ok = subprocess.run([str(BIN / "specops"), "verify", "--inventory", str(inv), "--run-id", report.data["run_id"],
                         "--samples", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO,
                        env=cli_env())
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    recs = {r["name"]: r for r in json.loads(ok.stdout)["hosts"][0]["records"]}
    assert recs["verify.run"]["status"] == "ok" and "1 of 3 sample(s)" in recs["verify.run"]["summary"]
    missing = subprocess.run([str(BIN / "specops"), "verify", "--inventory", str(inv), "--run-id", "no-such-run"],
                             capture_output=True, text=True, timeout=300, cwd=REPO, env=cli_env())
    assert missing.returncode == 1 and "no run at" in missing.stdout


@pytest.mark.vllm
def test_verify_names_an_off_by_one_layer(deepseek_smoke, testhost, envs, tiny_models):
    """A copy of a real run whose manifest says layer i-1 where the worker captured layer i."""
    tmp, report = deepseek_smoke
    run_id = report.data["run_id"]
    runs = tmp / "work" / "runs"
    shifted = runs / "shifted"
    shutil.copytree(runs / run_id, shifted)
    status = json.loads((shifted / "status.json").read_text())
    status["output_dir"] = str(shifted / "samples")
    (shifted / "status.json").write_text(json.dumps(status))
    manifest = json.loads((shifted / "manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 4, 5, 7]
    manifest["layer_ids"] = [1, 3, 4, 6]
    (shifted / "manifest.json").write_text(json.dumps(manifest))
    with host_for(tmp, testhost, envs["patched"], tiny_models["deepseek_v3"], tiny_models["dataset"], 2) as host:
        checked = verify_step(host, "shifted", samples=2)
    recs = by_name(checked)
    assert checked.failed
    for lid in (1, 3, 4, 6):
        layer = recs[f"verify.layer.{lid}"]
        assert layer.status == "fail" and layer.detail["nrmse"] > 0.2, layer.summary
    conv = recs["verify.convention"]
    assert conv.status == "fail"
    assert conv.summary.startswith("captured layer 1 (output convention")
    assert "matches the output of layer 2" in conv.summary and "off by +1" in conv.summary
    assert conv.detail["best_index"] == {"1": 3, "3": 5, "4": 6, "6": 8}


@pytest.mark.vllm
def test_verify_catches_the_vllm_cpu_rope_bug(tmp_path, testhost, hostenv_python, tiny_models, deepseek_root):
    """Without the rope fix, vLLM 0.16 CPU computes DeepSeek's q rope wrongly: verify says so."""
    python = make_env(hostenv_python, tmp_path / "no-rope-fix", rope_fix=False)
    with host_for(tmp_path, testhost, python, tiny_models["deepseek_v3"], tiny_models["dataset"], 1,
                  **deepseek_work(deepseek_root)) as host:
        report = smoke_step(host, {"layer_ids": "0,1,2,7"}, samples=2)
        layered = verify_step(host, report.data["run_id"], samples=2, reference="layer")
    recs = by_name(report)
    assert recs["smoke.run"].status == "ok" and report.failed
    layer0 = recs["verify.layer.0"]  # a dense layer: attention alone already differs
    assert layer0.status == "fail" and layer0.detail["nrmse"] > 0.2, layer0.summary
    assert layer0.detail["first_bad_position"] == 1  # position 0 has no rotation to get wrong
    assert recs["verify.llama_4_scaling"].status == "warn"  # not blamed on the scaling
    # --reference layer: decoder layer 0 on its embedding rows -> output:0, layers 1 and 2 on the captured pairs
    lrecs = by_name(layered)
    assert layered.failed
    first = lrecs["verify.layer.0"]
    assert first.status == "fail" and first.detail["input_from"] == "embedding rows", first.summary
    assert first.detail["floor_ratio"] > 10 and first.detail["first_bad_position"] == 1, first.summary
    assert lrecs["verify.llama_4_scaling"].status != "fail", lrecs["verify.llama_4_scaling"].summary
    print("\nvLLM 0.16's CPU rope, layer check: " + "; ".join(
        f"layer {j}: {lrecs[f'verify.layer.{j}'].status} {lrecs[f'verify.layer.{j}'].detail['floor_ratio']:.1f}x floor"
        for j in (0, 1, 2)))


# --------------------------------------------------------------------------- verify and MoE routing
#
# A router's near-tie goes either way in bf16: which tokens flip depends on the CPU's
# kernels (measured: the same bf16 forward with ATen's AVX2 vs DEFAULT kernels leaves
# 203 vs 206 of 232 tokens agreeing at layer 7 against the fp32 reference), so a
# verdict that counted flips as errors changed from machine to machine. These tests
# pin the rule: a flip at a near-tie is named and recomputed, a swap the router was
# sure about is an error.

#: A stand-in engine, run in the host env: the transformers forward verify itself uses,
#: in ``dtype``, with chosen tokens routed to other experts at the first MoE layer,
#: written as a finished run (one bf16 sample). argv: model, then JSON ``[[run dir, dtype,
#: plant], ...]`` (several runs, one process: one import of torch), plant:
#: ``none``; ``near-tie`` (the router's closest call that visibly matters, taken the
#: other way); ``wide`` (every 3rd token to its runner-up expert where the router wins
#: by > 10x the near-tie limit: a routing bug). One JSON line a run, in order.
ENGINE_SCRIPT = r"""
import json, random, sys
from pathlib import Path
import torch
from remote import verify
from remote.extract import samples

def write_run(model_path, run_dir, dtype, plant):
    reference = verify.load_reference(model_path, dtype, False)
    model, text = reference.model, reference.text
    assert reference.scaling_by.startswith("specops attention hook"), reference.scaling_by
    recorder = verify.StreamRecorder(model)
    route = verify.RouterControl(recorder.layers)
    rng = random.Random(7)
    ids = [rng.randrange(3, text["vocab_size"]) for _ in range(112)]
    layer_ids = [2, 4, 5, 7]
    natural = recorder.streams(model, ids)
    layer = min(route.routers)
    decisions = route.decisions[layer]
    at = min(i + 1 for i in layer_ids if i >= layer)
    options = sorted((decisions.z(kind, t, verify.BF16_REL), t, kind) for t in range(len(ids))
                     for kind in decisions.options if decisions.choice(kind, t) is not None)
    planted = {}
    if plant == "near-tie":
        for z, t, kind in options:
            if z > 1:
                break
            route.forced = {layer: {t: decisions.choice(kind, t)}}
            moved = recorder.streams(model, ids)[at][t]
            if float((moved - natural[at][t]).norm() / natural[at][t].norm()) > 0.1:
                planted = {t: decisions.choice(kind, t)}
                break
    elif plant == "wide":
        last = "expert#%d" % (route.routers[layer].top_k - 1)
        planted = {t: decisions.choice(kind, t) for z, t, kind in options
                   if kind == last and t % 3 == 0 and z > 10 * verify.NEAR_TIE_SIGMAS}
    route.forced = {layer: planted}
    streams = recorder.streams(model, ids)
    out = run_dir / "samples"
    out.mkdir(parents=True)
    path = samples.save_sample(out, 0, torch.tensor(ids), [streams[i + 1].to(torch.bfloat16) for i in layer_ids],
                               torch.ones(len(ids), dtype=torch.long))
    manifest = {"layer_ids": layer_ids, "layer_convention": "output", "model": {"path": model_path},
                "params": {"trust_remote_code": False}, "engine": {"name": "transformers " + dtype},
                "files": [{"path": path.name, "sha256": samples.sha256_file(path), "tokens": len(ids)}]}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "status.json").write_text(json.dumps({"state": "done", "output_dir": str(out)}))
    return {"layer": layer, "tokens": len(ids), "capability": torch.backends.cpu.get_cpu_capability(),
            "planted": {str(t): sorted(e.tolist()) for t, e in planted.items()}}

for run_dir, dtype, plant in json.loads(sys.argv[2]):
    print(json.dumps(write_run(sys.argv[1], Path(run_dir), dtype, plant)), flush=True)
"""


def engine_runs(python, model, runs: list, env=None) -> list[dict]:
    """Write finished runs (``[(run_dir, dtype, plant), ...]``) with :data:`ENGINE_SCRIPT` in one process;
    returns what each planted."""
    jobs = json.dumps([[str(run_dir), dtype, plant] for run_dir, dtype, plant in runs])
    proc = subprocess.run([str(python), "-c", ENGINE_SCRIPT, str(model), jobs], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(runs):]]
    assert len(said) == len(runs), proc.stdout[-3000:]
    return said


#: the runs the routing tests verify that this CPU's own kernels make: written once for the module
PLANTED_RUNS = {"near-tie": ("float32", "near-tie"), "wide": ("float32", "wide"), "bf16-native": ("bfloat16", "none")}


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory, hostenv_python, tiny_models) -> dict:
    """Name -> (run dir, what it planted) for :data:`PLANTED_RUNS`; a test copies one into its host's runs."""
    root = tmp_path_factory.mktemp("planted")
    runs = [(root / name, dtype, plant) for name, (dtype, plant) in PLANTED_RUNS.items()]
    said = engine_runs(hostenv_python, tiny_models["deepseek_v3"], runs)
    return {name: (run_dir, info) for (run_dir, _, _), name, info in zip(runs, PLANTED_RUNS, said)}


def planted_run(planted_runs: dict, tmp_path: Path, name: str) -> dict:
    """Copy the module's run ``name`` into this test's host (``tmp_path/work/runs/NAME``); what it planted."""
    run_dir, info = planted_runs[name]
    shutil.copytree(run_dir, tmp_path / "work" / "runs" / name)
    return info


@pytest.fixture
def verify_host(tmp_path, testhost, envs, tiny_models):
    """The test host, its work_dir at ``tmp_path/work`` (runs go under ``work/runs``)."""
    with host_for(tmp_path, testhost, envs["patched"], tiny_models["deepseek_v3"], tiny_models["dataset"], 1) as host:
        yield host


LAYERS = (2, 4, 5, 7)


def test_verify_names_an_expert_flip_at_a_router_near_tie(tmp_path, planted_runs, verify_host):
    from remote.verify import NEAR_TIE_SIGMAS

    planted = planted_run(planted_runs, tmp_path, "near-tie")
    assert len(planted["planted"]) == 1, planted
    (token, experts), = planted["planted"].items()
    report = verify_step(verify_host, "near-tie", samples=1)
    recs = by_name(report)
    assert not report.failed, [(r.name, r.summary) for r in report.records if r.status != "ok"]
    for lid in LAYERS:
        layer = recs[f"verify.layer.{lid}"]
        assert layer.status == "ok" and layer.detail["agree"] == planted["tokens"], layer.summary
        # against the reference's own choice it differs (and may drag a later token along
        # through attention): what the verdict used to count as a wrong extraction
        assert layer.detail["rerouted"] == 1 and layer.detail["raw"]["agree"] < planted["tokens"], layer.detail
        assert "1 recomputed with the engine's expert choice" in layer.summary
    routing = recs["verify.routing"]
    assert routing.status == "ok"
    flips = routing.detail["flips"]
    assert [(f["layer"], f["token"], f["engine_experts"]) for f in flips] == [(planted["layer"], int(token), experts)]
    assert flips[0]["sigmas"] <= NEAR_TIE_SIGMAS and flips[0]["error_after"] < 0.02 < 0.1 < flips[0]["error_before"]
    assert f"layer {planted['layer']} token {token}: experts" in routing.summary
    assert "not a wrong extraction" in routing.summary


def test_verify_fails_experts_swapped_where_the_router_is_sure(tmp_path, planted_runs, verify_host):
    planted = planted_run(planted_runs, tmp_path, "wide")
    swapped = {int(t) for t in planted["planted"]}
    assert len(swapped) > 0.1 * planted["tokens"], planted  # enough to fail, not just warn
    report = verify_step(verify_host, "wide", samples=1)
    recs = by_name(report)
    assert report.failed
    for lid in LAYERS:
        layer = recs[f"verify.layer.{lid}"]
        assert layer.status == "fail" and layer.fix, layer.summary
    # (a swap between two experts that happen to compute alike may stay within tolerance)
    disagreeing = set(report.data["per_sample"][0]["disagreeing_tokens"])
    assert len(swapped & disagreeing) >= 0.9 * len(swapped), (swapped, disagreeing)
    # no wide-margin swap is passed off as rounding
    assert not swapped & {f["token"] for f in recs["verify.routing"].detail["flips"]}
    assert recs["verify.convention"].status == "ok"


def test_verify_passes_a_bf16_engine_on_two_cpu_kernel_paths(tmp_path, hostenv_python, tiny_models, planted_runs,
                                                              verify_host):
    """The same bf16 forward with this CPU's best ATen kernels and with the plain ones:
    near-ties go different ways, the verdict stays the same.

    The plain path caps oneDNN too: on an AMX CPU, ATen capped alone still packs bf16
    attention for AMX and raises "pack_vnni2 is only supported when avx512 is supported"
    (tests/fixtures/cpu/intel_xeon_amx_torch_paths.json); on an AVX2-only CPU the cap is a no-op.
    """
    from remote.verify import NEAR_TIE_SIGMAS

    flipped = {}
    plain = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    for path, env in (("native", {}), ("default", plain)):
        if path == "native":  # this CPU's own kernels: the module's run
            info = planted_run(planted_runs, tmp_path, "bf16-native")
        else:  # the plain kernels are chosen at import: a process of its own
            info, = engine_runs(hostenv_python, tiny_models["deepseek_v3"],
                                [(tmp_path / "work" / "runs" / f"bf16-{path}", "bfloat16", "none")], env=env)
        assert path == "native" or info["capability"] == "DEFAULT", info
        report = verify_step(verify_host, f"bf16-{path}", samples=1)
        recs = by_name(report)
        assert not report.failed, [(r.name, r.summary) for r in report.records if r.status != "ok"]
        assert all(recs[f"verify.layer.{lid}"].status == "ok" for lid in LAYERS)
        last = recs["verify.layer.7"].detail
        assert last["nrmse"] < 0.02 and last["cos_min"] > 0.999, last
        flips = recs["verify.routing"].detail["flips"]
        # a random router ties often: some tokens do flip, and every one is a near-tie
        assert flips and last["raw"]["agree"] < last["tokens"], last
        assert all(f["sigmas"] <= NEAR_TIE_SIGMAS for f in flips)
        flipped[info["capability"]] = sorted((f["layer"], f["token"]) for f in flips)
    print("tokens that took other experts, by ATen kernel path:", flipped)


# README's extract-then-verify of the tiny DeepSeek-V3 at TP=2 is
# test_extract.py::test_readme_extract_tp2_then_verify_over_ssh (one vLLM run for both).


# --------------------------------------------------------------------------- fast checks (no vLLM)

def test_verify_refuses_a_run_that_is_not_done(tmp_path, hostenv_python):
    run_dir = tmp_path / "work" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "extracting"}))
    code = ("import json,sys; from remote import verify; "
            "print(json.dumps(verify.main({'run_id': 'r1', 'work_dir': sys.argv[1]})))")
    out = subprocess.run([str(hostenv_python), "-c", code, str(tmp_path / "work")], cwd=REPO, check=True,
                         capture_output=True, text=True, env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)})
    rec = json.loads(out.stdout.strip().splitlines()[-1])["records"][0]
    assert rec["status"] == "fail" and "'extracting', not done" in rec["summary"] and rec["fix"]


def test_smoke_and_verify_import_only_the_standard_library(hostenv_python):
    code = ("import sys; import remote.extract.smoke, remote.verify; "
            "bad = [m for m in ('torch', 'transformers', 'vllm', 'safetensors', 'speculators') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_smoke_uses_synthetic_samples_without_a_dataset(tmp_path, hostenv_python, tiny_models):
    code = ("import json,sys; from remote.extract import smoke; "
            "print(json.dumps(smoke.main(json.loads(sys.argv[1]))))")
    params = {"model_path": str(tiny_models["llama"]), "work_dir": str(tmp_path / "work"),
              "dataset": str(tmp_path / "missing.jsonl"), "samples": 3}
    out = subprocess.run([str(hostenv_python), "-c", code, json.dumps(params)], cwd=REPO, check=True,
                         capture_output=True, text=True, env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)})
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    recs = {r["name"]: r for r in payload["records"]}
    assert recs["smoke.twin"]["status"] == "changed"
    assert recs["smoke.samples"]["status"] == "warn" and "not found" in recs["smoke.samples"]["summary"]
    rows = Path(payload["data"]["dataset"]).read_text().splitlines()
    assert len(rows) == 3 and all("conversations" in json.loads(r) for r in rows)
    twin = Path(payload["data"]["twin_dir"])
    # the twin keeps the target's tokenizer (same files) and is not the target
    assert (twin / "tokenizer.json").read_bytes() == (Path(tiny_models["llama"]) / "tokenizer.json").read_bytes()
    assert twin != Path(tiny_models["llama"])


# --------------------------------------------------------------------------- verify and remote code

#: A model that loads only as remote code: the tiny Llama under a model_type transformers
#: does not know, its config and model classes in files beside config.json (as a real
#: remote-code checkpoint ships them).
REMOTE_CODE_FILES = {
    "configuration_specops_llama.py": (
        "from transformers import LlamaConfig\n\n\n"
        "class SpecopsLlamaConfig(LlamaConfig):\n    model_type = \"specops_llama\"\n"),
    "modeling_specops_llama.py": (
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_specops_llama import SpecopsLlamaConfig\n\n\n"
        "class SpecopsLlamaForCausalLM(LlamaForCausalLM):\n    config_class = SpecopsLlamaConfig\n"),
}

#: A finished fp32 run of that model, its states from transformers' own
#: ``output_hidden_states`` (not from verify's code), the run's ``trust_remote_code`` true.
#: argv: model, run dir.
REMOTE_CODE_RUN = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from remote.extract import samples

model_path, run_dir = sys.argv[1], Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=True, dtype=torch.float32).eval()
ids = [(7 * t) % 500 + 3 for t in range(40)]
layer_ids = [2, 4, 5]
with torch.inference_mode():
    hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
out = run_dir / "samples"
out.mkdir(parents=True)
path = samples.save_sample(out, 0, torch.tensor(ids), [hidden[i + 1][0] for i in layer_ids],
                           torch.ones(len(ids), dtype=torch.long))
manifest = {"layer_ids": layer_ids, "layer_convention": "output", "model": {"path": model_path},
            "params": {"trust_remote_code": True}, "engine": {"name": "transformers float32"},
            "files": [{"path": path.name, "sha256": samples.sha256_file(path), "tokens": len(ids)}]}
(run_dir / "manifest.json").write_text(json.dumps(manifest))
(run_dir / "status.json").write_text(json.dumps({"state": "done", "output_dir": str(out)}))
print(json.dumps({"class": type(model).__name__}))
"""


def test_verify_trusts_remote_code_as_the_run_did_unless_the_inventory_says(tmp_path, testhost, hostenv_python,
                                                                           tiny_models):
    """A run made with ``trust_remote_code: true`` is verified with it when the inventory is
    silent; an inventory that sets it explicitly still decides."""
    model = tmp_path / "specops_llama"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="specops_llama", architectures=["SpecopsLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_specops_llama.SpecopsLlamaConfig",
                            "AutoModelForCausalLM": "modeling_specops_llama.SpecopsLlamaForCausalLM"})
    (model / "config.json").write_text(json.dumps(config))
    for name, text in REMOTE_CODE_FILES.items():
        (model / name).write_text(text)
    modules = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    proc = subprocess.run([str(hostenv_python), "-c", REMOTE_CODE_RUN, str(model), str(tmp_path / "work" / "runs" / "rc")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **OFFLINE, **modules, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["class"] == "SpecopsLlamaForCausalLM"

    def verify_with(**fields):
        inv = load_inventory(write_inventory(
            tmp_path / f"inventory-{time.monotonic_ns()}.yaml", testhost, python=str(hostenv_python),
            model_path=str(model), work_dir=str(tmp_path / "work"), output_dir=str(tmp_path / "out"),
            env={**OFFLINE, **modules}, **fields))
        with Host(inv.hosts["th"], inv) as host:
            return verify_step(host, "rc", samples=1)

    report = verify_with()  # the inventory says nothing: the run's own choice
    recs = by_name(report)
    assert not report.failed, [(r.name, r.status, r.summary) for r in report.records if r.status != "ok"]
    assert "AutoModelForCausalLM" in recs["verify.reference"].summary
    assert [recs[f"verify.layer.{lid}"].detail["nrmse"] < 1e-5 for lid in (2, 4, 5)] == [True] * 3

    refused = verify_with(trust_remote_code=False)  # said explicitly: the inventory wins
    assert refused.failed
    assert "trust_remote_code" in json.dumps([(r.summary, r.detail) for r in refused.records if r.status == "fail"])
