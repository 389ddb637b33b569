"""The host side of ``extract``: job verbs, the supervisor and the engines, for real.

Every call goes through the host env's python in a subprocess (``remote.run.job.main``),
exactly as the controller's entry script would make it; the supervisor is a real
detached process, the models are the tiny test models, vLLM is the real CPU build.
Tensors are checked by a small script in the same python (the controller has no torch).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops.testhost.hostenv import own_vllm_metadata

REPO = Path(__file__).resolve().parents[1]
FINAL = ("done", "failed", "aborted")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: vLLM on this 2-core CPU box (FACTS.md).
VLLM_ENV = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
#: vLLM bf16 vs transformers bf16: rounding differs by ~1-2 % of a layer's abs max; a
#: wrong layer or a misattributed token differs by O(100 %).
BF16_REL_TOL = 0.05


# --------------------------------------------------------------------------- helpers

def host_env():
    return {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}


def job(python, **params) -> dict:
    """``remote.run.job.main(params)`` in the host env's python; returns the payload."""
    # a call that hangs says where before it is killed (one status call once hung for 120 s in CI)
    code = ("import faulthandler,json,sys; faulthandler.dump_traceback_later(150, exit=True); "
            "from remote.run import job; print(json.dumps(job.main(json.loads(sys.argv[1]))))")
    out = subprocess.run([str(python), "-c", code, json.dumps(params)], cwd=REPO, env=host_env(),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_final(python, params, timeout=300, until=None) -> dict:
    """Poll ``status`` until a final state (or ``until(status)``); returns the status."""
    deadline = time.monotonic() + timeout
    on_disk = Path(params["work_dir"]) / "runs" / params["run_id"] / "status.json"
    while time.monotonic() < deadline:
        st = job(python, **dict(params, action="status"))["data"]["status"]
        if st["state"] in FINAL or (until and until(st)):
            return st
        # A status call is a python start (a second on a busy 2-core box): between calls,
        # watch status.json itself and call again as soon as it shows what we wait for.
        # The call still decides (it also sees a supervisor that died without a word).
        next_call = min(deadline, time.monotonic() + 5.0)
        while time.monotonic() < next_call:
            time.sleep(0.3)
            try:
                disk = json.loads(on_disk.read_text())
            except (OSError, ValueError):
                continue
            if disk.get("state") in FINAL or (until and until(disk)):
                break
    logs = job(python, **dict(params, action="logs"))["data"]["logs"]
    raise AssertionError(f"run did not finish in {timeout}s: {st}\n" +
                         "\n".join(f"== {k}\n{v['text'][-3000:]}" for k, v in logs.items()))


INSPECT = r"""
import json, sys, torch
out = []
for path in sys.argv[1:]:
    d = torch.load(path, map_location="cpu", weights_only=True)
    out.append({"keys": sorted(d), "input_ids": [str(d["input_ids"].dtype), list(d["input_ids"].shape)],
                "loss_mask": [str(d["loss_mask"].dtype), list(d["loss_mask"].shape), int(d["loss_mask"].sum())],
                "layers": [[str(h.dtype), list(h.shape)] for h in d["hidden_states"]]})
print(json.dumps(out))
"""


def inspect_samples(python, paths) -> list[dict]:
    out = subprocess.run([str(python), "-c", INSPECT, *map(str, paths)], env=host_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


COMPARE = r"""
import json, sys, torch
a_dir, b_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
worst, wrong_layer = 0.0, float("inf")
for i in range(n):
    a = torch.load(f"{a_dir}/data_{i}.pt", weights_only=True)
    b = torch.load(f"{b_dir}/data_{i}.pt", weights_only=True)
    assert a["input_ids"].tolist() == b["input_ids"].tolist(), i
    assert a["loss_mask"].tolist() == b["loss_mask"].tolist(), i
    rel = lambda x, y: float((x.float() - y.float()).abs().max() / y.float().abs().max())
    for x, y in zip(a["hidden_states"], b["hidden_states"]):
        worst = max(worst, rel(x, y))
    # the same check against the neighbouring layer must fail: the comparison can tell
    wrong_layer = min(wrong_layer, rel(a["hidden_states"][0], b["hidden_states"][1]))
print(json.dumps({"worst": worst, "wrong_layer": wrong_layer}))
"""


def compare_runs(python, a_dir, b_dir, n) -> dict:
    out = subprocess.run([str(python), "-c", COMPARE, str(a_dir), str(b_dir), str(n)], env=host_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def blake3_of(path) -> str:
    """A file's BLAKE3: the digest a run's manifest names where the host has blake3 (both test-host envs do)."""
    import blake3

    return blake3.blake3(Path(path).read_bytes()).hexdigest()


def assert_proof(python, out_dir: Path, run_dir: Path, samples: int, layer_ids, hidden: int):
    """Every sample: 4 layers of [tokens, hidden] bf16; manifest blake3 match; no NaN/Inf."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    assert (run_dir / "manifest.json").read_text() == (out_dir / "manifest.json").read_text()
    assert manifest["samples"] == samples and len(manifest["files"]) == samples
    assert manifest["layer_ids"] == layer_ids and manifest["layer_convention"] == "output"
    assert "output of 0-based decoder layer" in manifest["layer_convention_text"]
    assert manifest["versions"]["torch"] and manifest["versions"]["transformers"]
    names = sorted(p.name for p in out_dir.glob("data_*.pt"))
    assert names == sorted(f"data_{i}.pt" for i in range(samples))
    for entry in manifest["files"]:
        assert blake3_of(out_dir / entry["path"]) == entry["blake3"], entry["path"]
    facts = inspect_samples(python, [out_dir / f"data_{i}.pt" for i in range(samples)])
    for entry, fact in zip(manifest["files"], facts):
        tokens = entry["tokens"]
        assert fact["keys"] == ["hidden_states", "input_ids", "loss_mask"]
        assert fact["input_ids"] == ["torch.int64", [tokens]]
        assert fact["loss_mask"][:2] == ["torch.int64", [tokens]]
        assert fact["layers"] == [["torch.bfloat16", [tokens, hidden]]] * len(layer_ids)
    assert summary["ok"] is True and summary["samples"] == samples
    assert [layer["layer_id"] for layer in summary["layers"]] == layer_ids
    for layer in summary["layers"]:
        assert layer["nan"] == 0 and layer["inf"] == 0 and layer["dtype"] == "bfloat16"
        assert layer["std"] > 0 and layer["abs_max"] > 0
        assert layer["shape"] == [manifest["tokens"], hidden]
    assert set(summary["phase_seconds"]) >= {"tokenize", "finalize"}
    return manifest, summary


def pid_gone(pid, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


def group_members(pgid, settle_s=15.0) -> list[int]:
    """Live (not zombie) processes of a process group, after up to ``settle_s`` for
    signalled ones to go (zombies wait on a non-reaping init and are not counted)."""
    deadline = time.monotonic() + settle_s
    while True:
        live = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                live.append(int(stat.parent.name))
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


@pytest.fixture
def hf_params(tmp_path, tiny_models):
    return dict(run_id="r1", work_dir=str(tmp_path / "work"), model_path=str(tiny_models["llama"]),
                dataset=str(tiny_models["dataset"]), output_dir=str(tmp_path / "out"),
                engine="hf-reference", max_samples=6, seq_len=64, batch_size=2, env=OFFLINE)


# --------------------------------------------------------------------------- hf-reference

def test_hf_reference_end_to_end(hostenv_python, hf_params, tmp_path):
    started = job(hostenv_python, action="start", **hf_params)
    assert started["records"][0]["status"] == "changed", started
    st = wait_final(hostenv_python, hf_params)
    assert st["state"] == "done", st
    assert st["samples_done"] == st["samples_total"] == 6 and st["error"] is None
    assert st["tokens_done"] == st["tokens_total"] > 0 and st["tokens_per_s"] > 0
    run_dir = tmp_path / "work" / "runs" / "r1"
    manifest, _ = assert_proof(hostenv_python, tmp_path / "out", run_dir, 6, [2, 4, 5, 7], 256)
    assert manifest["engine"]["name"] == "hf-reference"
    assert manifest["model"]["config"]["model_type"] == "llama"
    assert all(e["tokens"] <= 64 for e in manifest["files"])
    masks = [f["loss_mask"][2] for f in inspect_samples(hostenv_python, sorted((tmp_path / "out").glob("data_*.pt")))]
    assert all(0 < m for m in masks), "assistant tokens must be in the loss mask"
    assert not list((tmp_path / "out").glob(".partial-*"))

    # logs: a first call tails, a second call with the returned offsets brings only new bytes
    first = job(hostenv_python, action="logs", **hf_params)["data"]
    assert "supervisor.log" in first["logs"] and "run r1" in first["logs"]["supervisor.log"]["text"]
    again = job(hostenv_python, action="logs", offsets=first["offsets"], **hf_params)["data"]
    assert all(v["text"] == "" for v in again["logs"].values())


def test_same_run_id_never_starts_twice(hostenv_python, hf_params, tmp_path):
    params = dict(hf_params, batch_size=1, batch_delay_s=0.7)
    first = job(hostenv_python, action="start", **params)
    pid = first["data"]["pid"]
    second = job(hostenv_python, action="start", **params)
    assert second["records"][0]["status"] == "ok" and second["data"]["already"] == "running"
    assert second["data"]["status"]["state"] in ("pending", "loading", "extracting")
    assert int((tmp_path / "work" / "runs" / "r1" / "pid").read_text()) == pid
    # another run on the same host is refused while this one lives, unless forced
    other = dict(params, run_id="r2", output_dir=str(tmp_path / "out2"))
    refused = job(hostenv_python, action="start", **other)["records"][0]
    assert refused["status"] == "fail" and "already running extraction r1" in refused["summary"]
    assert refused["fix"]
    # the same run id with other parameters is refused (it would mix two runs' samples)
    changed = job(hostenv_python, action="start", **dict(params, seq_len=32))["records"][0]
    assert changed["status"] == "fail" and "seq_len" in changed["summary"]
    assert wait_final(hostenv_python, params)["state"] == "done"
    done = job(hostenv_python, action="start", **params)
    assert done["records"][0]["status"] == "ok" and done["data"]["already"] == "done"
    assert len(list((tmp_path / "work" / "runs").iterdir())) == 2  # r1 + the lock file


def test_resume_after_sigkill(hostenv_python, hf_params, tmp_path):
    params = dict(hf_params, max_samples=8, batch_size=1, batch_delay_s=0.8)
    pid = job(hostenv_python, action="start", **params)["data"]["pid"]
    st = wait_final(hostenv_python, params, until=lambda s: (s.get("samples_done") or 0) >= 3)
    assert st["state"] == "extracting", st
    os.killpg(pid, signal.SIGKILL)  # the supervisor leads its own group: nothing else is hit
    assert pid_gone(pid)
    died = job(hostenv_python, action="status", **params)
    st = died["data"]["status"]
    assert died["records"][0]["status"] == "fail" and st["state"] == "failed"
    assert st["error"]["type"] == "SupervisorDied" and "SIGKILL" in st["error"]["message"]
    out = tmp_path / "out"
    kept = sorted(out.glob("data_*.pt"))
    assert 3 <= len(kept) < 8
    inspect_samples(hostenv_python, kept)  # every file that counts loads: nothing torn
    (out / ".partial-torn.pt").write_bytes(b"half a pickle")  # what a kill mid-write leaves

    again = job(hostenv_python, action="start", **params)
    assert again["records"][0]["status"] == "changed" and again["data"]["resumed"] is True
    st = wait_final(hostenv_python, params)
    assert st["state"] == "done", st
    assert st["attempt"] == 2 and st["resumed_from"] == len(kept)
    assert st["previous_error"]["type"] == "SupervisorDied"
    assert not (out / ".partial-torn.pt").exists()
    manifest, _ = assert_proof(hostenv_python, out, tmp_path / "work" / "runs" / "r1", 8, [2, 4, 5, 7], 256)
    # the samples written before the kill were kept, not redone
    assert all(blake3_of(p) == e["blake3"] for p, e in zip(kept, manifest["files"]))


def test_a_failed_sample_write_fails_the_run_with_its_cause(hostenv_python, hf_params, tmp_path):
    """Samples are written on a writer thread while the engine runs on: a write that fails
    there still fails the run, naming the sample and the cause, and the samples written
    before it stay for the resume."""
    params = dict(hf_params, max_samples=8, batch_size=1, batch_delay_s=0.8)
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params, until=lambda s: (s.get("samples_done") or 0) >= 2)
    assert st["state"] == "extracting", st
    out = tmp_path / "out"
    blocker = out / "data_6.pt"  # a directory where sample 6 must land: its rename fails
    blocker.mkdir()
    (blocker / "keep").write_text("x")
    st = wait_final(hostenv_python, params)
    assert st["state"] == "failed", st
    err = st["error"]
    assert err["type"] == "WriteFailed" and err["rank"] is None, err
    assert err["message"].startswith(f"writing sample 6 (data_6.pt) in {out} failed: IsADirectoryError"), err
    assert "IsADirectoryError" in err["traceback"]  # the original error's traceback is kept
    assert sorted(p.name for p in out.glob("data_*.pt") if p.is_file()) == [f"data_{i}.pt" for i in range(6)]
    assert not list(out.glob(".partial-*"))
    assert st["samples_done"] == 6  # progress counts only what is on disk

    shutil.rmtree(blocker)
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params)
    assert st["state"] == "done" and st["resumed_from"] == 6, st
    assert_proof(hostenv_python, out, tmp_path / "work" / "runs" / "r1", 8, [2, 4, 5, 7], 256)


def test_abort_stops_the_group(hostenv_python, hf_params):
    params = dict(hf_params, max_samples=20, batch_size=1, batch_delay_s=1.0)
    pid = job(hostenv_python, action="start", **params)["data"]["pid"]
    wait_final(hostenv_python, params, until=lambda s: s["state"] == "extracting")
    res = job(hostenv_python, action="abort", grace_s=10, **params)
    assert res["records"][0]["status"] == "changed", res
    assert pid_gone(pid) and group_members(pid) == []
    st = job(hostenv_python, action="status", **params)["data"]["status"]
    assert st["state"] == "aborted" and not st["alive"]
    assert job(hostenv_python, action="abort", **params)["records"][0]["status"] == "skipped"


def test_injected_failure_in_process_engine(hostenv_python, hf_params):
    params = dict(hf_params, inject_failure={"rank": 0, "at": "extract", "message": "reference blew up"})
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params)
    err = st["state"] == "failed" and st["error"]
    assert err, st
    assert (err["rank"], err["type"], err["message"]) == (0, "InjectedFailure", "reference blew up")
    assert "Traceback (most recent call last)" in err["traceback"] and "hf_reference.py" in err["traceback"]
    res = job(hostenv_python, action="status", **params)["records"][0]
    assert res["status"] == "fail" and "reference blew up" in res["summary"] and res["fix"]


def test_nan_in_a_layer_fails_the_run(hostenv_python, hf_params, tiny_models, tmp_path):
    """A checkpoint whose layer 3 weights are NaN: the run fails and names the layers."""
    broken = tmp_path / "llama-nan"
    shutil.copytree(tiny_models["llama"], broken)
    poison = r"""
import sys, glob
from safetensors.torch import load_file, save_file
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    t = load_file(f)
    hit = [k for k in t if "layers.3.mlp.down_proj" in k]
    for k in hit:
        t[k].fill_(float("nan"))
    if hit:
        save_file(t, f, metadata={"format": "pt"})
"""
    subprocess.run([str(hostenv_python), "-c", poison, str(broken)], check=True, env=host_env())
    params = dict(hf_params, model_path=str(broken))
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params)
    assert st["state"] == "failed" and st["error"]["type"] == "NonFiniteStates", st
    assert "sample 0" in st["error"]["message"] and "layer 4" in st["error"]["message"]
    assert "layer 2:" not in st["error"]["message"]  # layer 2 runs before the poison
    assert {b["layer_id"] for b in st["error"]["detail"]["layers"]} == {4, 5, 7}
    assert not list((tmp_path / "out").glob("data_*.pt"))  # a bad sample never counts as done


def test_bad_layer_ids_fail_before_loading(hostenv_python, hf_params):
    params = dict(hf_params, layer_ids=[2, 4, 4, 7])
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params)
    assert st["state"] == "failed" and "duplicate layer ids [4]" in st["error"]["message"]
    assert "load" not in st["phase_seconds"]


# --------------------------------------------------------------------------- data-parallel replica processes

#: two replica processes of an in-process engine (remote/extract/engines/replicas.py; the hf-reference
#: engine: the cheapest real one), one core each: a batch split between them, then dp1 killed: the next
#: batch fails naming it (on_replica_loss: fail), and with the policy turned to continue it all goes to dp0.
#: ``orphan``: this process dies (SIGKILL: no cleanup runs) while its replicas still load.
REPLICAS = r"""
import json, os, signal, sys, time
from remote.extract.engines.replicas import ReplicaFailed, Replicas
model, case = sys.argv[1], sys.argv[2]
cores = sorted(os.sched_getaffinity(0))
sets = [cores[:len(cores) // 2], cores[len(cores) // 2:]]
params = {"device": "cpu", "seq_len": 64, "trust_remote_code": False}
replicas = Replicas("hf-reference", model, 1, [2, 4, 5, 7], params, None, sets)
replicas.start()
print(json.dumps({"pids": [p.pid for p in replicas.procs]}), flush=True)
if case == "orphan":
    time.sleep(2.0)
    os.kill(os.getpid(), signal.SIGKILL)
replicas.wait_ready()
batch = [[1 + (i * 7 + j) % 200 for j in range(5 + i)] for i in range(4)]
first = replicas.extract(batch)
out = {"shapes": [[list(h.shape) for h in layers] for layers in first], "samples": list(replicas.samples)}
os.kill(replicas.procs[1].pid, signal.SIGKILL)
try:
    replicas.extract(batch)
except ReplicaFailed as exc:
    out.update(failed=exc.record)
replicas.params["on_replica_loss"] = "continue"
again = replicas.extract(batch)
out.update(equal=all(bool((a == b).all()) for x, y in zip(first, again) for a, b in zip(x, y)),
           after=list(replicas.samples), lost=replicas.lost)
replicas.close(5)
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("case", ["two", "orphan"])
def test_replica_processes_split_a_batch_and_a_killed_one_is_named(case, hostenv_python, tiny_models, tmp_path):
    run_dir, said = tmp_path / "run", tmp_path / "said.txt"
    with open(said, "w") as out:  # a file, not a pipe: the run returns when this process ends, not its children
        proc = subprocess.run([str(hostenv_python), "-c", REPLICAS, str(tiny_models["llama"]), case], cwd=REPO,
                              env={**host_env(), "SPECOPS_RUN_DIR": str(run_dir)}, stdout=out,
                              stderr=subprocess.STDOUT, timeout=300)
    text = said.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert lines and "pids" in lines[0], text[-4000:]
    pids = lines[0]["pids"]
    if case == "orphan":  # they die with it at once (PR_SET_PDEATHSIG), not when their load ends seconds later
        assert proc.returncode == -signal.SIGKILL
        assert all(pid_gone(pid, timeout=0.5) for pid in pids), pids
        return
    assert proc.returncode == 0, text[-4000:]
    for name in ("dp0", "dp1"):  # each replica's own log
        assert f"replica {name} (pid" in (run_dir / "logs" / name / "replica.log").read_text()
    out = lines[-1]
    assert out["samples"] == [2, 2] and [len(layers) for layers in out["shapes"]] == [4] * 4
    assert [layers[0] for layers in out["shapes"]] == [[5 + i, 256] for i in range(4)]
    err = out["failed"]  # on_replica_loss: fail: the error names the replica and how it died
    assert err["replica"] == "dp1" and err["where"] == "dp1/replica process", err
    assert err["message"].startswith("dp1: ") and "SIGKILL" in err["message"], err
    # continue: the batch went to dp0 alone, the same states; the loss is recorded
    assert out["equal"] and out["after"] == [6, 2], out
    assert [x["replica"] for x in out["lost"]] == ["dp1"] and "SIGKILL" in out["lost"][0]["error"]
    assert all(pid_gone(pid, timeout=15) for pid in pids), pids


# --------------------------------------------------------------------------- vLLM engine

@pytest.fixture(scope="session")
def patched_speculators(tmp_path_factory, hostenv_python):
    """A patched COPY of speculators 0.3.0 (the shared host env is never modified).

    Put first on PYTHONPATH of the job (and so of every vLLM worker it spawns).
    """
    # The patch set ships with the repo: a missing one is a broken checkout, never a reason to skip.
    assert list((REPO / "patches").glob("*/manifest.json")), "no patch set with a manifest.json under patches/"
    site = Path(subprocess.run(
        [str(hostenv_python), "-c", "import speculators, os; print(os.path.dirname(os.path.dirname(speculators.__file__)))"],
        capture_output=True, text=True, check=True, env=host_env()).stdout.strip())
    copy = tmp_path_factory.mktemp("patched-site")
    shutil.copytree(site / "speculators", copy / "speculators")
    for dist in site.glob("speculators-*.dist-info"):
        shutil.copytree(dist, copy / dist.name)
    own_vllm_metadata(hostenv_python, copy)  # vLLM's first-import alias lands here, not in the shared env
    code = ("import json,sys; from remote import patcher; "
            "print(json.dumps(patcher.main({'action': 'apply', 'site_packages': sys.argv[1]})))")
    out = subprocess.run([str(hostenv_python), "-c", code, str(copy)], cwd=REPO, env=host_env(),
                         capture_output=True, text=True, check=True)
    records = json.loads(out.stdout.strip().splitlines()[-1])["records"]
    assert all(r["status"] != "fail" for r in records), records
    return copy


def vllm_params(tmp_path, model, dataset, patched, run_id="v1", **extra):
    return dict(run_id=run_id, work_dir=str(tmp_path / "work"), model_path=str(model), dataset=str(dataset),
                output_dir=str(tmp_path / f"out-{run_id}"), engine="speculators-0.3", tp=2, max_samples=6,
                seq_len=96, batch_size=3, env={**VLLM_ENV, "PYTHONPATH": str(patched)}, **extra)


@pytest.mark.vllm
def test_speculators_tp2_llama_agrees_with_hf_reference(hostenv_python, tiny_models, patched_speculators, tmp_path):
    params = vllm_params(tmp_path, tiny_models["llama"], tiny_models["dataset"], patched_speculators)
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params, timeout=420)
    assert st["state"] == "done", st
    run_dir = tmp_path / "work" / "runs" / "v1"
    manifest, summary = assert_proof(hostenv_python, tmp_path / "out-v1", run_dir, 6, [2, 4, 5, 7], 256)
    assert manifest["engine"]["name"] == "speculators-0.3" and manifest["engine"]["tp"] == 2
    assert manifest["engine"]["patched"] is True
    assert str(patched_speculators) in manifest["engine"]["generator_file"]
    logs = sorted(p.name for p in (run_dir / "logs").glob("*.log"))
    assert logs == ["rank0.log", "rank1.log", "supervisor.log"]
    for rank in (0, 1):  # each worker's output went to its own file
        text = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"Worker_TP{rank}" in text and f"Worker_TP{1 - rank}" not in text

    ref = dict(params, run_id="h1", engine="hf-reference", tp=1, output_dir=str(tmp_path / "out-h1"), env=OFFLINE)
    job(hostenv_python, action="start", force=True, **ref)
    assert wait_final(hostenv_python, ref)["state"] == "done"
    cmp = compare_runs(hostenv_python, tmp_path / "out-v1", tmp_path / "out-h1", 6)
    assert cmp["worst"] < BF16_REL_TOL, cmp
    assert cmp["wrong_layer"] > 4 * BF16_REL_TOL, cmp


# DeepSeek-V3 at TP=2 through the patched generator, over SSH and verified against transformers:
# tests/test_extract.py::test_readme_extract_tp2_then_verify_over_ssh (one vLLM run for both).


@pytest.mark.vllm
@pytest.mark.parametrize("at", ["load", "extract"])
def test_failure_in_tp_rank_1_comes_back_with_root_cause(at, hostenv_python, tiny_models, patched_speculators,
                                                         tmp_path):
    message = f"rank one broke during {at}"
    params = vllm_params(tmp_path, tiny_models["llama"], tiny_models["dataset"], patched_speculators,
                         run_id=f"x-{at}", worker_error_grace_s=5,
                         inject_failure={"rank": 1, "at": at, "message": message})
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params, timeout=420)
    err = st["error"]
    assert st["state"] == "failed", st
    assert (err["rank"], err["type"], err["message"]) == (1, "InjectedFailure", message)
    assert "Traceback (most recent call last)" in err["traceback"] and message in err["traceback"]
    assert "vllm" in err["traceback"]  # raised inside vLLM's own worker code path
    run_dir = tmp_path / "work" / "runs" / f"x-{at}"
    assert message in (run_dir / "logs" / "rank1.log").read_text()
    assert message not in (run_dir / "logs" / "rank0.log").read_text()
    # Either the driver raised vLLM's generic error (kept as reported_as; at load it is
    # "... an exception in a background process") or it was still blocked on the failed
    # rank and the supervisor's watchdog stopped the run; the cause is rank 1's either way.
    if "reported_as" in err:
        assert err["reported_as"]["message"] != message
        if at == "load":
            assert "background process" in err["reported_as"]["message"]
    else:
        assert "still waiting" in err["note"]
    assert pid_gone(st["pid"])
    assert group_members(st["pid"]) == [], "workers of a failed run must not linger"


# A rank's hard death (no exception anywhere, only faulthandler's dump in its log) is
# tests/test_signals.py::test_a_rank_killed_by_a_signal_is_named_on_the_seed_engine.


def test_last_traceback_reads_prefixed_worker_logs():
    """The log parser behind the root cause, on vLLM-prefixed lines (runs without torch)."""
    from remote.run.rootcause import last_traceback

    log = "\n".join([
        "(Worker_TP1 pid=7) INFO loading",
        "(Worker_TP1 pid=7) Traceback (most recent call last):",
        '(Worker_TP1 pid=7)   File "a.py", line 1, in <module>',
        "(Worker_TP1 pid=7)     old()",
        "(Worker_TP1 pid=7) KeyError: 'stale'",
        "(Worker_TP1 pid=7) ERROR 11-29 [multiproc_executor.py:783] WorkerProc failed.",
        "(Worker_TP1 pid=7) Traceback (most recent call last):",
        '(Worker_TP1 pid=7)   File "b.py", line 2, in load',
        "(Worker_TP1 pid=7)     raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB')",
        "(Worker_TP1 pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB",
        "(Worker_TP1 pid=7) INFO shutting down",
    ])
    found = last_traceback(log)
    assert found["type"] == "OutOfMemoryError"
    assert found["message"] == "CUDA out of memory. Tried to allocate 2 GiB"
    assert 'File "b.py"' in found["traceback"] and "stale" not in found["traceback"]
    assert last_traceback("INFO all good\n") is None
    fatal = last_traceback(log + "\nFatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n")
    assert (fatal["type"], fatal["message"]) == ("FatalError", "Segmentation fault")


def test_root_cause_prefers_the_rank_that_failed_over_the_peers_that_lost_it(tmp_path):
    """A rank's own error beats a peer's "connection reset" and the driver's generic message (stdlib only)."""
    from remote.run.rootcause import root_cause
    from remote.run.rundir import RunPaths

    paths = RunPaths(tmp_path / "run")
    paths.errors.mkdir(parents=True)
    paths.logs.mkdir()
    (paths.errors / "rank0.json").write_text(json.dumps(
        {"rank": 0, "type": "RuntimeError", "message": "Connection reset by peer", "time": 1.0}))
    (paths.errors / "rank1.json").write_text(json.dumps(
        {"rank": 1, "type": "KeyError", "message": "'llama_4_scaling'", "time": 2.0}))
    err = root_cause(paths, RuntimeError("Worker failed with error 'see above'"))
    assert (err["rank"], err["type"], err["source"]) == (1, "KeyError", "errors/rank1.json")
    assert err["reported_as"] == {"type": "RuntimeError", "message": "Worker failed with error 'see above'"}
    assert err["other_errors"] == [{"rank": 0, "type": "RuntimeError", "message": "Connection reset by peer",
                                    "source": "errors/rank0.json"}]
    # nothing recorded anywhere: the supervisor's own exception is the cause
    empty = RunPaths(tmp_path / "empty")
    empty.errors.mkdir(parents=True)
    empty.logs.mkdir()
    assert root_cause(empty, ValueError("bad layer ids"))["type"] == "ValueError"


def test_pre_tokenized_dataset_rows_are_truncated_and_bad_rows_named(tmp_path):
    """The dataset reader on pre-tokenized rows: no tokenizer, so no transformers (stdlib only)."""
    from remote.extract.dataset import load_token_samples

    data = tmp_path / "tok.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n\n{"input_ids": [4, 5]}\n')
    assert load_token_samples({"dataset": str(data), "seq_len": 2}, "/no/model") == [([1, 2], [0, 1]), ([4, 5], [1, 1])]
    assert load_token_samples({"dataset": str(data), "max_samples": 1}, "/no/model") == [([1, 2, 3], [0, 1, 1])]
    data.write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match=r"tok.jsonl:1: loss_mask has 1 entries for 2 input_ids"):
        load_token_samples({"dataset": str(data)}, "/no/model")


def test_status_of_a_supervisor_that_died_unrecorded(tmp_path):
    """A dead pid with a live state is a failure; the log's traceback names why (stdlib only)."""
    from remote.run import job as job_module

    run_dir = tmp_path / "work" / "runs" / "gone"
    (run_dir / "logs").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "pid").write_text(f"{dead.pid}\n")
    (run_dir / "status.json").write_text(json.dumps({"run_id": "gone", "state": "loading", "heartbeat_unix": 0,
                                                     "samples_done": 0, "samples_total": 6}))
    (run_dir / "logs" / "supervisor.log").write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n")
    res = job_module.main({"action": "status", "run_id": "gone", "work_dir": str(tmp_path / "work")})
    st = res["data"]["status"]
    assert res["records"][0]["status"] == "fail" and st["state"] == "failed"
    assert st["error"]["type"] == "JSONDecodeError" and "without recording a result" in st["error"]["message"]
    # the verdict is written back: every later reader agrees
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"

    (run_dir / "logs" / "supervisor.log").write_text("loading weights\n")
    (run_dir / "status.json").write_text(json.dumps({"run_id": "gone", "state": "extracting", "heartbeat_unix": 0}))
    st = job_module.main({"action": "status", "run_id": "gone", "work_dir": str(tmp_path / "work")})["data"]["status"]
    assert st["error"]["type"] == "SupervisorDied" and "SIGKILL" in st["error"]["message"]


def test_output_dir_of_another_run_is_refused(hostenv_python, hf_params, tmp_path):
    job(hostenv_python, action="start", **hf_params)
    assert wait_final(hostenv_python, hf_params)["state"] == "done"
    before = {p.name: sha256(p) for p in (tmp_path / "out").glob("data_*.pt")}
    other = dict(hf_params, run_id="r9")  # same output dir, another run: must not "resume" r1's samples
    job(hostenv_python, action="start", **other)
    st = wait_final(hostenv_python, other)
    assert st["state"] == "failed" and "holds the samples of run 'r1'" in st["error"]["message"], st
    assert {p.name: sha256(p) for p in (tmp_path / "out").glob("data_*.pt")} == before


def test_hf_reference_runs_the_text_model_of_a_kimi_k25_wrapper(hostenv_python, hf_params, tiny_models, tmp_path):
    """Kimi-K2.5 keeps its text model under text_config and needs remote code HF cannot
    find in the twin: the reference engine runs the text model with its own weights."""
    params = dict(hf_params, model_path=str(tiny_models["kimi_k25"]), max_samples=3)
    job(hostenv_python, action="start", **params)
    st = wait_final(hostenv_python, params)
    assert st["state"] == "done", st
    text = json.loads((Path(tiny_models["kimi_k25"]) / "config.json").read_text())["text_config"]
    n = text["num_hidden_layers"]
    manifest, _ = assert_proof(hostenv_python, tmp_path / "out", tmp_path / "work" / "runs" / "r1", 3,
                               [2, n // 2, n - 3, n - 1], text["hidden_size"])
    assert manifest["engine"]["loaded_as"].startswith("text_config model")
    assert manifest["model"]["config"]["text_config"]["model_type"] == text["model_type"]


def test_logs_tail_first_then_follow_new_files_from_their_start(tmp_path):
    from remote.run import job as job_module

    run_dir = tmp_path / "work" / "runs" / "lg"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "supervisor.log").write_text("x" * 100 + "END\n")
    base = {"action": "logs", "run_id": "lg", "work_dir": str(tmp_path / "work")}
    first = job_module.main(dict(base, tail_bytes=10))["data"]
    assert first["logs"]["supervisor.log"]["text"] == "xxxxxx" + "END\n"
    (run_dir / "logs" / "rank1.log").write_text("rank one starts\n" + "y" * 50)
    with open(run_dir / "logs" / "supervisor.log", "a") as fh:
        fh.write("more\n")
    nxt = job_module.main(dict(base, offsets=first["offsets"], tail_bytes=10))["data"]
    assert nxt["logs"]["supervisor.log"]["text"] == "more\n"
    assert nxt["logs"]["rank1.log"]["text"].startswith("rank one starts")
    assert nxt["offsets"] == {"supervisor.log": 109, "rank1.log": 66}


def test_layer_ids_resolve_with_their_convention():
    """Defaults are the engine's own; ids given in the other convention are converted, never mixed."""
    from remote.extract import runplan

    def resolve_layer_ids(params, engine, n):  # the run's plan for a model of n layers
        plan = runplan.resolve(params, {"num_hidden_layers": n}, engine=(engine, "given")).require()
        return plan.layer_ids, plan.convention

    assert resolve_layer_ids({}, "speculators-0.3", 8) == ([2, 4, 5, 7], "output")
    assert resolve_layer_ids({"layer_ids": [3, 5, 6, 8], "layer_convention": "input"},
                             "hf-reference", 8) == ([2, 4, 5, 7], "output")
    with pytest.raises(ValueError, match="out of range 0..7"):
        resolve_layer_ids({"layer_ids": [2, 8]}, "speculators-0.3", 8)
    # 0.3.0's own rule collides at N=6 ([2, 3, 3, 5]): the default moves to distinct ids; given ids still may not repeat
    assert resolve_layer_ids({}, "speculators-0.3", 6) == ([2, 3, 4, 5], "output")
    with pytest.raises(ValueError, match="duplicate layer ids"):
        resolve_layer_ids({"layer_ids": [2, 3, 3, 5]}, "speculators-0.3", 6)
