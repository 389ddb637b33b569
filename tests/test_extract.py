"""``specops extract`` end to end over real SSH: detach, follow, re-attach, abort, fetch.

The reference engine (transformers) keeps these fast; the vLLM/speculators engine at
TP=2 is proven in the tests marked ``vllm``.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest

from specops import jobs
from specops.exit_codes import ExitCode
from specops.extract import extract
from specops.host import Host
from specops.inventory import load_inventory
REPO_ROOT = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent


@pytest.fixture
def llama_inventory(make_inventory, tiny_models, tmp_path):
    return make_inventory(model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]),
                          engine="hf-reference", max_samples=6, seq_len=64, batch_size=2, tp=1,
                          output_dir=str(tmp_path / "out"))


def one_host(path):
    inv = load_inventory(path)
    return Host(inv.hosts["th"], inv)


def cli(*args, env=None, **kw):
    return subprocess.Popen([str(BIN / "specops"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, cwd=kw.get("cwd", REPO_ROOT),
                            env={**os.environ, "COLUMNS": "250", **(env or {})})


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_extract_follows_and_fetches_proof(llama_inventory, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    connects = []
    real_connect = paramiko.SSHClient.connect

    def counting_connect(client, *args, **kwargs):  # counts, then connects for real
        connects.append(kwargs.get("hostname"))
        return real_connect(client, *args, **kwargs)

    monkeypatch.setattr(paramiko.SSHClient, "connect", counting_connect)
    code = extract(load_inventory(llama_inventory), None, {}, run_id="r1", detach=False, force=False,
                   skip_preflight=True, as_json=True, tensors=True)
    assert code == ExitCode.SUCCESS
    assert len(connects) == 1, f"start, follow and fetch must share one SSH connection: {connects}"
    dest = tmp_path / "runs" / "th" / "r1"
    manifest = json.loads((dest / "manifest.json").read_text())
    summary = json.loads((dest / "summary.json").read_text())
    assert manifest["layer_convention"] == "output" and manifest["layer_ids"] == [2, 4, 5, 7]
    assert manifest["samples"] == 6 and len(manifest["files"]) == 6
    for entry in manifest["files"]:
        assert sha(tmp_path / "out" / "r1" / entry["path"]) == entry["sha256"]
        assert sha(dest / "samples" / entry["path"]) == entry["sha256"]
        assert [h["shape"][1] for h in entry["tensors"]["hidden_states"]] == [256] * 4
        assert {h["dtype"] for h in entry["tensors"]["hidden_states"]} == {"bfloat16"}
    assert all(layer["nan"] == 0 and layer["inf"] == 0 for layer in summary["layers"])
    assert (dest / "logs" / "supervisor.log").exists()

    # a second fetch resumes a partial file and verifies it
    victim = dest / "samples" / manifest["files"][0]["path"]
    data = victim.read_bytes()
    victim.unlink()
    (victim.with_name(victim.name + ".part")).write_bytes(data[: len(data) // 2])
    with one_host(llama_inventory) as host:
        rec = jobs.fetch_run(host, "r1", tensors=True, dest_root=tmp_path / "runs").records[-1]
    assert rec.status == "ok" and rec.detail["resumed"] == 1
    assert sha(victim) == manifest["files"][0]["sha256"]


def test_connection_killed_mid_run_then_reattach(llama_inventory, tmp_path):
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    follower = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r2", "--skip-preflight", "--skip-smoke",
                   "--max-samples", "12", env=env)
    with one_host(llama_inventory) as host:
        deadline = time.monotonic() + 120
        # kill the follower as soon as the run exists: its imports alone outlast this
        while not jobs.run_state(host, "r2").found:
            assert time.monotonic() < deadline, "run never started"
            time.sleep(0.2)
        follower.send_signal(signal.SIGKILL)  # the laptop vanishes: its SSH connection dies with it
        follower.wait()
        state = jobs.run_state(host, "r2")
        assert state.alive and not state.is_final
    # the same run id again re-attaches instead of starting a second copy
    again = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r2", "--skip-preflight", "--skip-smoke",
                "--max-samples", "12", "--json", env=env)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    with one_host(llama_inventory) as host:
        final = jobs.run_state(host, "r2")
    assert final.state == "done" and final.samples_done == 12
    assert (final.model_dump().get("attempt") or 1) == 1, "re-attaching must not restart the run"
    proc = cli("status", "--inventory", str(llama_inventory), "--run-id", "r2")
    proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.SUCCESS


def test_detach_status_abort_codes(llama_inventory, tmp_path):
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    proc = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r3", "--skip-preflight", "--skip-smoke",
               "--detach", "--max-samples", "24", env=env)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    st = cli("status", "--inventory", str(llama_inventory), "--run-id", "r3")
    st.communicate(timeout=60)
    assert st.returncode == ExitCode.JOB_RUNNING
    # a second run on a busy host is refused unless forced
    other = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r3b", "--skip-preflight", "--skip-smoke",
                "--detach", env=env)
    out, _ = other.communicate(timeout=120)
    assert other.returncode == ExitCode.FAILED and "already running extraction r3" in out
    ab = cli("abort", "--inventory", str(llama_inventory), "--run-id", "r3")
    ab.communicate(timeout=120)
    assert ab.returncode == 0
    st = cli("status", "--inventory", str(llama_inventory), "--run-id", "r3")
    st.communicate(timeout=60)
    assert st.returncode == ExitCode.JOB_ABORTED
    missing = cli("status", "--inventory", str(llama_inventory), "--run-id", "nope")
    missing.communicate(timeout=60)
    assert missing.returncode == ExitCode.JOB_NOT_FOUND


def test_bad_run_id_is_a_usage_error(llama_inventory):
    proc = cli("extract", "--inventory", str(llama_inventory), "--run-id", "../etc; rm -rf /", "--detach")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.USAGE and "--run-id" in err


@pytest.fixture(scope="module")
def patched_python(hostenv_python, tmp_path_factory):
    """An overlay env whose own speculators copy has the patch set applied."""
    from specops.testhost.hostenv import make_overlay_env

    python = make_overlay_env(hostenv_python, tmp_path_factory.mktemp("patched") / "env")
    proc = subprocess.run([str(python), "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                           "from remote import patcher; print(json.dumps(patcher.main({'action': 'apply', "
                           "'patches_root': sys.argv[1] + '/patches'})))", str(REPO_ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and '"fail"' not in proc.stdout, proc.stdout + proc.stderr
    return python


@pytest.mark.vllm
@pytest.mark.parametrize("model", ["deepseek_v3", "llama"])
def test_extract_tp2_speculators_over_ssh(make_inventory, tiny_models, patched_python, tmp_path, monkeypatch,
                                          model):
    """The real patched speculators 0.3.0 generator at TP=2, launched and followed over SSH."""
    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    path = make_inventory(
        python=str(patched_python), model_path=str(tiny_models[model]), dataset=str(tiny_models["dataset"]),
        engine="speculators-0.3", tp=2, max_samples=6, seq_len=96, batch_size=3,
        output_dir=str(tmp_path / "out"),
        env={"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    # the DeepSeek case also proves extract rehearses on a tiny twin first (the CLI default)
    code = extract(load_inventory(path), None, {}, run_id=f"tp2-{model}", detach=False, force=False,
                   skip_preflight=False, as_json=True, skip_smoke=model != "deepseek_v3")
    dest = tmp_path / "runs" / "th" / f"tp2-{model}"
    if code != ExitCode.SUCCESS:
        from specops.preflight import preflight

        fails = [(r.name, r.summary) for r in preflight(load_inventory(path), None)[0].records
                 if r.status == "fail"]
        status = (dest / "status.json").read_text() if dest.exists() else "no run"
        pytest.fail(f"extract exited {code}; preflight fails now: {fails}; status: {status}")
    manifest = json.loads((dest / "manifest.json").read_text())
    summary = json.loads((dest / "summary.json").read_text())
    assert manifest["engine"]["name"] == "speculators-0.3" and manifest["engine"]["tp"] == 2
    assert manifest["layer_ids"] == [2, 4, 5, 7] and manifest["layer_convention"] == "output"
    assert manifest["samples"] == 6
    for entry in manifest["files"]:
        assert sha(tmp_path / "out" / f"tp2-{model}" / entry["path"]) == entry["sha256"]
        layers = entry["tensors"]["hidden_states"]
        assert len(layers) == 4
        assert all(h["shape"] == [entry["tokens"], 256] and h["dtype"] == "bfloat16" for h in layers)
    assert all(layer["nan"] == 0 and layer["inf"] == 0 for layer in summary["layers"])
    assert summary["ok"] is True
    smoke_runs = [p.name for p in (tmp_path / "work" / "runs").iterdir() if p.name.startswith("smoke-")]
    assert bool(smoke_runs) == (model == "deepseek_v3")
