"""``verify --reference layer`` on quantized checkpoints (``remote/verify/dequant.py``): fp8 with
128x128 block scales as DeepSeek-V3/R1 ship, compressed-tensors pack-quantized INT4 (group 32,
symmetric, routed experts only) as Kimi-K2.5 ships.

The unit test checks the dequantization against hand-computed values and against the
libraries that own the formats: compressed-tensors' ``pack_to_int32`` / ``unpack_from_int32``
/ ``dequantize``, and transformers' ``Fp8Dequantize`` (shapes it accepts; vLLM's
``block_dequant`` loop over partial blocks is written out by hand).

The end-to-end tests quantize a tiny model (the test host's DeepSeek-V3 and Kimi-K2.5 twins)
so that its dequantized weights are *exactly* representable in bf16 (every scale rounded up
to 4 significant bits: fp8/int4 value x scale then fits bf16's 8), save those dequantized
weights as the bf16 model, extract states from the bf16 model with transformers in bf16 (as
test_verify_layer's wide run does, no vLLM; for fp8 as a W8A8 engine: each linear's input
rounded to e4m3 per token in groups of 128), and point the layer check at the quantized copy:
it passes at its floor (for fp8 the bf16 layer with fp8 activations: bf16 weights alone would
fail a healthy W8A8 engine); a copy with one block's scales doubled fails naming that
layer while the others pass. Any other quantization is refused naming it.
"""
from __future__ import annotations

import json

import pytest

from test_smoke_verify_modern import run_python

#: argv: a JSON list of [run dir, model path]; verify --reference layer of each, in one process
VERIFY = ("import json, sys; from remote import verify; print(json.dumps([verify.main({'run_dir': run, "
          "'samples': 2, 'reference': 'layer', 'model_path': model}) for run, model in json.loads(sys.argv[1])]))")

UNIT = r"""
import json, torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization.lifecycle.forward import dequantize
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from remote.verify.dequant import fp8_block_dequant, pack_dequant, unpack_int32
out = {}
# fp8, by hand: a 3x5 weight in [2, 3] blocks (the last row block and column block partial)
w = torch.tensor([[1, -2, 0.5, 4, 8], [0.25, 1.5, -1, 2, -3], [6, -0.5, 1, 1, 2]]).to(torch.float8_e4m3fn)
s = torch.tensor([[2.0, 0.5], [3.0, 0.125]])
out["fp8_hand"] = fp8_block_dequant(w, s, (2, 3)).tolist()
# fp8 against vLLM's block_dequant loop (partial blocks) and transformers' Fp8Dequantize (whole blocks)
torch.manual_seed(0)
w = (torch.randn(300, 200) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
s = torch.rand(3, 2) + 0.01
loop = w.to(torch.float32)
for i in range(2):
    for j in range(3):
        loop[j * 128:min((j + 1) * 128, 300), i * 128:min((i + 1) * 128, 200)] *= s[j][i]
out["fp8_vs_block_dequant"] = bool(torch.equal(fp8_block_dequant(w, s, (128, 128)), loop))
w2, s2 = w[:256, :128], s[:2, :1]
hf = Fp8Dequantize(None)._dequantize_one(w2, s2, torch.float32)
out["fp8_vs_transformers"] = bool(torch.equal(fp8_block_dequant(w2, s2, (128, 128)), hf))
# int4, by hand: one word holds 8 values, value i in bits 4i..4i+3, offset by 8
q = torch.tensor([[-8, -1, 0, 1, 7, 3, -4, 2]], dtype=torch.int8)
word = sum(((int(v) + 8) << (4 * i)) for i, v in enumerate(q[0]))
word = word - (1 << 32) if word >= 1 << 31 else word
packed = pack_to_int32(q, 4)
out["int4_word"] = [int(packed[0, 0]), word]
out["int4_hand"] = pack_dequant(torch.tensor([[word]], dtype=torch.int32), torch.tensor([[0.5]]), 4, 32,
                               (1, 8)).tolist()
# int4 against compressed-tensors (100 columns: the last word and the last group partial)
q = torch.randint(-8, 8, (70, 100), dtype=torch.int8)
packed = pack_to_int32(q, 4)
scale = (torch.rand(70, 4) + 0.1).to(torch.bfloat16)
mine = pack_dequant(packed, scale, 4, 32, (70, 100))
ours = unpack_int32(packed, 4, 100)
out["int4_unpack"] = bool(torch.equal(ours.to(torch.int8), unpack_from_int32(packed, 4, torch.Size([70, 100]))))
out["int4_vs_by_hand"] = bool(torch.equal(mine, q.float() * scale.float().repeat_interleave(32, 1)[:, :100]))
from compressed_tensors.quantization import QuantizationArgs
args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
# (the library wants whole groups: its first 96 columns)
lib = dequantize(unpack_from_int32(packed[:, :12], 4, torch.Size([70, 96])), scale[:, :3], args=args,
                 dtype=torch.float32)
out["int4_vs_compressed_tensors_max"] = float((mine[:, :96] - lib).abs().max())
out["int4_scale_max"] = float(scale.float().abs().max())
print(json.dumps(out))
"""


def test_dequantization_matches_hand_values_and_the_format_libraries(modern_hostenv_python):
    out = run_python(modern_hostenv_python, UNIT)
    assert out["fp8_hand"] == [[2, -4, 1, 2, 4], [0.5, 3, -2, 1, -1.5], [18, -1.5, 3, 0.125, 0.25]], out
    assert out["fp8_vs_block_dequant"] and out["fp8_vs_transformers"], out
    assert out["int4_word"][0] == out["int4_word"][1], out
    assert out["int4_hand"] == [[-4, -0.5, 0, 0.5, 3.5, 1.5, -2, 1]], out
    assert out["int4_unpack"] and out["int4_vs_by_hand"], out
    # compressed-tensors dequantizes in the scale's dtype (bf16); ours is the exact float32 product
    assert out["int4_vs_compressed_tensors_max"] <= 8 * out["int4_scale_max"] * 2 ** -8, out


MAKE = r"""
import json, re, shutil, sys, random, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from remote.dev.server_run import write_run
from remote.verify import StreamRecorder, load_reference
kind, src, root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
dirs = {name: root / name for name in ("bf16", "quant", "quant-bad")}

def round4(s):  # up to 4 significant bits: a 4-bit value x this scale is exact in bf16
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ceil(m * 16) / 16, e)

def fp8(w, b=128):
    n, k = w.shape
    grid = torch.zeros((-(-n // b), -(-k // b)))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * b:(i + 1) * b, j * b:(j + 1) * b].abs().max() / 448
    grid = round4(torch.where(grid > 0, grid, torch.ones_like(grid)))
    full = grid.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": grid}, q.float() * full

def int4(w, g=32):
    n, k = w.shape
    amax = w.abs().reshape(n, k // g, g).amax(-1)
    scale = round4(torch.where(amax > 0, amax / 7, torch.ones_like(amax))).to(torch.bfloat16)
    full = scale.float().repeat_interleave(g, 1)
    q = torch.round(w / full).clamp(-8, 7).to(torch.int8)
    return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}, \
        q.float() * full

FP8_SKIP = re.compile(r"norm|mlp\.gate\.weight|e_score_correction_bias")
INT4 = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
for d in dirs.values():
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
index = json.loads((src / "model.safetensors.index.json").read_text())
weight_map, quantized = {}, 0
for shard in sorted(set(index["weight_map"].values())):
    plain, packed = {}, {}
    with safe_open(str(src / shard), framework="pt") as fh:
        for key in fh.keys():
            t = fh.get_tensor(key)
            if kind == "fp8":
                take = ".layers." in key and key.endswith(".weight") and t.ndim == 2 and not FP8_SKIP.search(key)
            else:
                take = bool(INT4.search(key))
            if take:
                parts, exact = (fp8 if kind == "fp8" else int4)(t.float())
                assert torch.equal(exact.to(torch.bfloat16).float(), exact), key
                t = exact.to(torch.bfloat16)
                base = key[:-len(".weight")]
                packed.update({f"{base}.{name}": v.contiguous() for name, v in parts.items()})
                quantized += 1
            else:
                packed[key] = t
            plain[key] = t
    save_file(plain, str(dirs["bf16"] / shard), metadata={"format": "pt"})
    for d in ("quant", "quant-bad"):
        save_file(packed, str(dirs[d] / shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in packed})
    if any(".layers.4." in k for k in packed):
        bad_shard = shard
shutil.copy(src / "model.safetensors.index.json", dirs["bf16"])
for d in ("quant", "quant-bad"):
    (dirs[d] / "model.safetensors.index.json").write_text(json.dumps(dict(index, weight_map=weight_map)))
    config = json.loads((dirs[d] / "config.json").read_text())
    if kind == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                                         "activation_scheme": "dynamic"}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 32, "dynamic": False,
                                                      "actorder": None, "observer": "minmax"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
            "kv_cache_scheme": None}
    (dirs[d] / "config.json").write_text(json.dumps(config))
# the damage: one block's scales doubled in decoder layer 4
with safe_open(str(dirs["quant-bad"] / bad_shard), framework="pt") as fh:
    tensors = {k: fh.get_tensor(k) for k in fh.keys()}
bad = next(k for k in sorted(tensors) if ".layers.4." in k and k.endswith(
    "self_attn.o_proj.weight_scale_inv" if kind == "fp8" else "experts.0.down_proj.weight_scale"))
tensors[bad] = tensors[bad].clone()
if kind == "fp8":
    tensors[bad][0, 0] *= 2
else:
    tensors[bad][:, 0] *= 2
save_file(tensors, str(dirs["quant-bad"] / bad_shard), metadata={"format": "pt"})
# the run: states from the bf16 model (transformers in bf16 as the engine), the manifest naming the quantized copy
reference = load_reference(str(dirs["bf16"]), "bfloat16", False)
recorder = StreamRecorder(reference.model)
if kind == "fp8":  # a W8A8 engine: each bf16 linear's input per token in groups of 128 to e4m3, fp32 products
    base_linear = torch.nn.functional.linear

    def w8a8(x, w, b=None):
        if w.dtype != torch.bfloat16:
            return base_linear(x, w, b)
        k = x.shape[-1]
        xg = torch.nn.functional.pad(x.float(), (0, (-k) % 128)).reshape(*x.shape[:-1], -1, 128)
        s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
        xq = ((xg / s).to(torch.float8_e4m3fn).float() * s).reshape(*x.shape[:-1], -1)[..., :k]
        return base_linear(xq, w.float(), None if b is None else b.float()).to(w.dtype)
    torch.nn.functional.linear = w8a8
run_dir = root / "run"
out = run_dir / "output" / "hidden_states"
out.mkdir(parents=True)
rnd, records, ids_kept = random.Random(5), [], [1, 4, 5, 7, 8]
for i, n in enumerate((40, 56)):
    ids = [rnd.randrange(3, 500) for _ in range(n)]
    streams = recorder.streams(reference.model, ids)
    name = f"hs_{i}.safetensors"
    save_file({"token_ids": torch.tensor(ids), "hidden_states": streams[ids_kept].transpose(0, 1).to(torch.bfloat16)
               .contiguous()}, str(out / name))
    records.append({"index": i, "file": name, "bytes": (out / name).stat().st_size, "tokens": n})
write_run(run_dir, str(dirs["quant"]), ids_kept, {"name": "vllm-server", "file_layer_ids": ids_kept}, records)
print(json.dumps({"quantized": quantized, "bad": bad, **{k: str(v) for k, v in dirs.items()}, "run": str(run_dir)}))
"""


def verify(python, pairs: list) -> list[dict]:
    """Each ``(run dir, model)`` verified in one ``python`` process (importing torch and transformers
    costs more than a tiny model's check): their records by name, in order."""
    payloads = run_python(python, VERIFY, json.dumps([[str(run), str(model)] for run, model in pairs]))
    return [{**{r["name"]: r for r in payload["records"]}, "_data": payload["data"]} for payload in payloads]


def summaries(recs: dict) -> str:
    return "\n".join(f"{k}: {v['status']}: {v['summary']}" for k, v in recs.items() if not k.startswith("_"))


QUANTIZED = {"fp8": "deepseek_v3", "int4": "kimi_k25"}


@pytest.fixture(scope="module")
def checked(modern_fixed_python, hostenv_python, tiny_models, tmp_path_factory) -> dict:
    """Each kind's quantized copies and run (MAKE, one process per kind: fp8's engine rounds every linear's
    input), then every check of them: the healthy and the doubled-scale copy of both kinds under transformers 5
    in one process, the healthy ones under transformers 4 in another. By kind: ``made``, ``recs``
    (transformers 5, healthy), ``seed`` (transformers 4, healthy), ``bad`` (transformers 5, doubled scale)."""
    made = {kind: run_python(modern_fixed_python, MAKE, kind, tiny_models[model], tmp_path_factory.mktemp(kind))
            for kind, model in QUANTIZED.items()}
    modern = verify(modern_fixed_python, [(made[k]["run"], made[k][copy]) for k in QUANTIZED
                                          for copy in ("quant", "quant-bad")])
    seed = verify(hostenv_python, [(made[k]["run"], made[k]["quant"]) for k in QUANTIZED])
    return {kind: {"made": made[kind], "recs": modern[2 * i], "bad": modern[2 * i + 1], "seed": seed[i]}
            for i, kind in enumerate(QUANTIZED)}


@pytest.mark.parametrize("kind,model,expect", [
    ("fp8", "deepseek_v3", {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}),
    ("int4", "kimi_k25", {"quant_method": "compressed-tensors", "num_bits": 4, "group_size": 32}),
])
def test_a_quantized_checkpoint_is_checked_dequantized_and_a_doubled_scale_fails(kind, model, expect, checked):
    assert QUANTIZED[kind] == model
    made, recs = checked[kind]["made"], checked[kind]["recs"]
    ref = recs["verify.reference"]
    assert ref["status"] == "ok", summaries(recs)
    assert {k: ref["detail"]["quantization"][k] for k in expect} == expect, ref["detail"]["quantization"]
    assert "dequantized to float32 from " in ref["summary"]
    for j in (0, 4, 7):
        layer = recs[f"verify.layer.{j}"]
        assert layer["status"] == "ok" and layer["detail"]["floor_ratio"] < 2.0, summaries(recs)
        if kind == "fp8":  # the floor holds the engine's fp8 activations; bf16 weights alone would fail it
            floor = layer["detail"]["floor"]
            assert "fp8 e4m3 activations" in floor["activations"] and "fp8 activations" in layer["summary"]
            assert layer["detail"]["nrmse"] > 2.5 * floor["nrmse_weights_only"], floor
        else:
            assert "activations" not in layer["detail"]["floor"]
    dequantized = {j: recs[f"verify.layer.{j}"]["detail"]["weights"]["dequantized"] for j in (0, 4, 7)}
    if kind == "fp8":  # every Linear: MLA's 5 + dense MLP's 3 (layer 0); + 8 experts x 3 + shared 3 (MoE)
        assert dequantized == {0: 8, 4: 5 + 24 + 3, 7: 5 + 24 + 3}, dequantized
    else:  # only the routed experts
        assert dequantized == {0: 0, 4: 24, 7: 24}, dequantized
    # transformers 4 (the seed env) dequantizes the same
    seed = checked[kind]["seed"]
    assert seed["verify.reference"]["summary"].startswith("transformers 4."), summaries(seed)
    for j in (0, 4, 7):
        assert seed[f"verify.layer.{j}"]["status"] == "ok", summaries(seed)
    # the same run against the copy with one block's scales doubled in decoder layer 4
    bad = checked[kind]["bad"]
    assert bad["verify.layer.4"]["status"] == "fail", summaries(bad)
    assert bad["verify.layer.4"]["detail"]["floor_ratio"] > 2.5, bad["verify.layer.4"]["summary"]
    for j in (0, 7):
        assert bad[f"verify.layer.{j}"]["status"] == "ok", summaries(bad)
    details = [recs[f"verify.layer.{j}"]["detail"] for j in (0, 4, 7)]
    ratios = ", ".join(f"{d['nrmse'] / d['floor'].get('nrmse_weights_only', float('nan')):.1f}x" for d in details)
    print(f"\n{kind}: {made['quantized']} weights quantized; healthy "
          + "; ".join(f"layer {j} {recs[f'verify.layer.{j}']['detail']['floor_ratio']:.2f}x" for j in (0, 4, 7))
          + f"; {made['bad']} doubled: layer 4 {bad['verify.layer.4']['detail']['floor_ratio']:.1f}x the floor"
          + (f"; healthy vs the bf16-weights-only floor: {ratios}" if kind == "fp8" else ""))


REFUSE = r"""
import json, sys
from remote.verify.dequant import scheme_of
from remote.verify.run import VerifyError
out = {}
for name, block in json.loads(sys.argv[1]).items():
    try:
        scheme = scheme_of({"model_type": "llama", "quantization_config": block}, "/models/m")
        out[name] = {"ok": scheme.describe()}
    except VerifyError as exc:
        out[name] = {"error": str(exc), "detail": exc.detail}
print(json.dumps(out))
"""


def test_other_quantizations_are_refused_naming_the_method_and_what_is_supported(modern_hostenv_python):
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                "group_size": 32}}
    blocks = {"awq": {"quant_method": "awq", "bits": 4},
              "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
              "ct-float": {"quant_method": "compressed-tensors", "format": "float-quantized",
                           "config_groups": {"group_0": group}},
              "ct-asym": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                          "config_groups": {"group_0": dict(group, weights=dict(group["weights"], symmetric=False))}},
              "ct-int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                          "config_groups": {"group_0": group}},
              "fp8-block": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    out = run_python(modern_hostenv_python, REFUSE, json.dumps(blocks))
    assert out["ct-int4"] == {"ok": "compressed-tensors int4 group 32"}
    assert out["fp8-block"] == {"ok": "fp8 128x128 blocks"}
    for name, why in (("awq", "quantized (awq, config.json quantization_config)"),
                      ("fp8-tensor", "fp8 without a weight_block_size"),
                      ("ct-float", "format 'float-quantized'"), ("ct-asym", "asymmetric int weights")):
        assert why in out[name]["error"] and "dequantizes fp8 with weight_block_size" in out[name]["error"], out[name]
