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

from specops.runs import hostjob
from specops.exit_codes import ExitCode
from specops.runs.run import extract
from specops.transport.host import Host
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


def blake3_of(path):
    """A file's BLAKE3: what a run's manifest names where the host has blake3 (the test host's env does)."""
    import blake3

    return blake3.blake3(Path(path).read_bytes()).hexdigest()


def test_extract_follows_and_fetches_proof(llama_inventory, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    connects = []
    real_connect = paramiko.SSHClient.connect

    def counting_connect(client, *args, **kwargs):  # counts, then connects for real
        connects.append(kwargs.get("hostname"))
        return real_connect(client, *args, **kwargs)

    monkeypatch.setattr(paramiko.SSHClient, "connect", counting_connect)
    code = extract(load_inventory(llama_inventory), None, {}, run_id="r1", detach=False, force=False,
                   skip_preflight=True, skip_smoke=True, as_json=True, tensors=True)
    assert code == ExitCode.SUCCESS
    assert len(connects) == 1, f"start, follow and fetch must share one SSH connection: {connects}"
    dest = tmp_path / "runs" / "th" / "r1"
    manifest = json.loads((dest / "manifest.json").read_text())
    summary = json.loads((dest / "summary.json").read_text())
    assert manifest["layer_convention"] == "output" and manifest["layer_ids"] == [2, 4, 5, 7]
    assert manifest["samples"] == 6 and len(manifest["files"]) == 6
    for entry in manifest["files"]:
        assert blake3_of(tmp_path / "out" / "r1" / entry["path"]) == entry["blake3"] and "sha256" not in entry
        assert blake3_of(dest / "samples" / entry["path"]) == entry["blake3"]
        assert [h["shape"][1] for h in entry["tensors"]["hidden_states"]] == [256] * 4
        assert {h["dtype"] for h in entry["tensors"]["hidden_states"]} == {"bfloat16"}
    assert all(layer["nan"] == 0 and layer["inf"] == 0 for layer in summary["layers"])
    assert (dest / "logs" / "supervisor.log").exists()
    # skip_smoke starts no rehearsal run on a twin
    assert not [p.name for p in (tmp_path / "work" / "runs").iterdir() if p.name.startswith("smoke-")]

    # a second fetch resumes a partial file and verifies it
    victim = dest / "samples" / manifest["files"][0]["path"]
    data = victim.read_bytes()
    victim.unlink()
    (victim.with_name(victim.name + ".part")).write_bytes(data[: len(data) // 2])
    with one_host(llama_inventory) as host:
        rec = hostjob.fetch_run(host, "r1", tensors=True, dest_root=tmp_path / "runs").records[-1]
    assert rec.status == "ok" and rec.detail["resumed"] == 1 and "verified by blake3" in rec.summary
    assert blake3_of(victim) == manifest["files"][0]["blake3"]


def test_an_older_runs_sha256_manifest_still_fetches_lists_and_verifies_and_blake3_catches_damage(
        llama_inventory, tmp_path):
    """A run made before BLAKE3 (its manifest's entries carry ``sha256``) still fetches (each file checked by
    sha256), lists for a resume (the shard listing passes the manifest's sha256 on, nothing hashed again) and
    verifies; under the BLAKE3 manifest a byte changed on the host (same size) fails fetch and verify."""
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    common = ["--inventory", str(llama_inventory), "--run-id", "old"]
    run = cli("extract", *common, "--skip-preflight", "--skip-smoke", "--json", "--max-samples", "3", env=env)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    out_dir, run_dir = tmp_path / "out" / "old", tmp_path / "work" / "runs" / "old"
    new = json.loads((run_dir / "manifest.json").read_text())
    older = dict(new, files=[{**{k: v for k, v in e.items() if k != "blake3"}, "sha256": sha(out_dir / e["path"])}
                             for e in new["files"]])
    manifests = [run_dir / "manifest.json", *out_dir.glob("**/manifest.json")]  # the run's, its range's, the dir's
    for path in manifests:  # as an older specops wrote them
        path.write_text(json.dumps(older))

    with one_host(llama_inventory) as host:
        fetched = hostjob.fetch_run(host, "old", tensors=True, dest_root=tmp_path / "runs").records[-1]
        listing = host.run_task("shard", {"action": "files", "output_dir": str(out_dir), "start": 0, "stop": 3})
    assert fetched.status == "ok" and "3 sample file(s) verified by sha256" in fetched.summary, fetched
    assert [(f["path"], f["sha256"]) for f in listing["data"]["files"]] == [(e["path"], e["sha256"])
                                                                           for e in older["files"]]
    assert listing["data"]["hashed_here"] == 0 and not any("blake3" in f for f in listing["data"]["files"])
    checked = cli("verify", *common, "--samples", "1", "--json", env=env)
    said, err = checked.communicate(timeout=600)
    recs = {r["name"]: r for r in json.loads(said)["hosts"][0]["records"]}
    assert recs["verify.run"]["status"] == "ok" and "sha256 match" in recs["verify.run"]["summary"], said[-3000:]

    for path in manifests:  # the run's own BLAKE3 manifests back; one byte of a sample changed
        path.write_text(json.dumps(new))
    victim = out_dir / new["files"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with one_host(llama_inventory) as host:
        caught = hostjob.fetch_run(host, "old", tensors=True, dest_root=tmp_path / "again").records[-1]
    assert caught.status == "fail" and "1 sample file(s) do not match the manifest blake3" in caught.summary, caught
    assert caught.detail["bad"] == [new["files"][0]["path"]]
    checked = cli("verify", *common, "--samples", "3", "--json", env=env)
    said, err = checked.communicate(timeout=600)
    assert checked.returncode != 0
    recs = {r["name"]: r for r in json.loads(said)["hosts"][0]["records"]}
    assert "differ from the manifest blake3" in recs["verify.files"]["summary"], said[-3000:]


def test_connection_killed_mid_run_then_reattach(llama_inventory, tmp_path):
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    follower = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r2", "--skip-preflight", "--skip-smoke",
                   "--max-samples", "12", env=env)
    with one_host(llama_inventory) as host:
        deadline = time.monotonic() + 120
        # kill the follower as soon as the run exists: its imports alone outlast this
        while not hostjob.run_state(host, "r2").found:
            assert time.monotonic() < deadline, "run never started"
            time.sleep(0.2)
        follower.send_signal(signal.SIGKILL)  # the laptop vanishes: its SSH connection dies with it
        follower.wait()
        state = hostjob.run_state(host, "r2")
        assert state.alive and not state.is_final
    # the same run id again re-attaches instead of starting a second copy
    again = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r2", "--skip-preflight", "--skip-smoke",
                "--max-samples", "12", "--json", env=env)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    with one_host(llama_inventory) as host:
        final = hostjob.run_state(host, "r2")
    assert final.state == "done" and final.samples_done == 12
    assert (final.model_dump().get("attempt") or 1) == 1, "re-attaching must not restart the run"
    proc = cli("status", "--inventory", str(llama_inventory), "--run-id", "r2")
    proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.SUCCESS


def test_detach_status_abort_codes(make_inventory, tiny_models, tmp_path):
    # a pause after each batch keeps the run going until the abort reaches it, however loaded the box
    llama_inventory = make_inventory(model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]),
                                     engine="hf-reference", max_samples=6, seq_len=64, batch_size=2, tp=1,
                                     output_dir=str(tmp_path / "out"), env={"SPECOPS_BATCH_DELAY_S": "5"})
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    # the CLI's default: a rehearsal on a tiny twin of the model first (here on the reference engine)
    proc = cli("extract", "--inventory", str(llama_inventory), "--run-id", "r3", "--skip-preflight",
               "--detach", "--max-samples", "24", env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert [p.name for p in (tmp_path / "work" / "runs").iterdir() if p.name.startswith("smoke-")]
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


@pytest.mark.vllm
def test_readme_extract_tp2_then_verify_over_ssh(make_inventory, tiny_models, patched_python, tmp_path):
    """README: ``specops extract`` (tiny DeepSeek-V3, TP=2, the real patched speculators 0.3.0
    generator, preflight first), then ``specops verify --samples 2``. Before near-ties were
    matched verify exited 1 on a 2-core EPYC. (The rehearsal on a twin that the CLI runs by
    default is test_detach_status_abort_codes's; smoke at TP=2 is test_smoke_verify's.)

    One model: the same path on Llama (a vLLM TP=2 load each) is walked by
    test_smoke_verify's Llama TP=2 smoke and test_patch_remote's generator checks.
    """
    path = make_inventory(
        python=str(patched_python), model_path=str(tiny_models["deepseek_v3"]), dataset=str(tiny_models["dataset"]),
        engine="speculators-0.3", tp=2, max_samples=8, seq_len=128, batch_size=4,
        output_dir=str(tmp_path / "out"),
        env={"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    env = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    common = ["--inventory", str(path), "--run-id", "readme"]
    run = cli("extract", *common, "--skip-smoke", "--json", env=env)
    out, err = run.communicate(timeout=1200)
    assert run.returncode == 0, out[-4000:] + err[-4000:]  # the JSON names a preflight or smoke failure
    dest = tmp_path / "runs" / "th" / "readme"
    manifest = json.loads((dest / "manifest.json").read_text())
    summary = json.loads((dest / "summary.json").read_text())
    assert manifest["engine"]["name"] == "speculators-0.3" and manifest["engine"]["tp"] == 2
    assert manifest["layer_ids"] == [2, 4, 5, 7] and manifest["layer_convention"] == "output"
    assert manifest["samples"] == 8
    for entry in manifest["files"]:
        assert blake3_of(tmp_path / "out" / "readme" / entry["path"]) == entry["blake3"]
        layers = entry["tensors"]["hidden_states"]
        assert len(layers) == 4
        assert all(h["shape"] == [entry["tokens"], 256] and h["dtype"] == "bfloat16" for h in layers)
    assert all(layer["nan"] == 0 and layer["inf"] == 0 for layer in summary["layers"])
    assert summary["ok"] is True

    checked = cli("verify", *common, "--samples", "2", "--json", env=env)
    out, err = checked.communicate(timeout=600)
    assert checked.returncode == 0, out[-4000:] + err[-3000:]
    recs = {r["name"]: r for r in json.loads(out)["hosts"][0]["records"]}
    for lid in (2, 4, 5, 7):
        layer = recs[f"verify.layer.{lid}"]
        assert layer["status"] == "ok", layer["summary"]
        assert layer["detail"]["nrmse"] < 0.03 and layer["detail"]["cos_min"] > 0.999, layer["summary"]
    routing = recs["verify.routing"]
    assert routing["status"] == "ok" and routing["detail"]["flips"], routing["summary"]
    assert recs["verify.layer.7"]["detail"]["raw"]["agree"] < recs["verify.layer.7"]["detail"]["tokens"]
    assert recs["verify.llama_4_scaling"]["status"] == "ok"
