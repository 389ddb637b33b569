"""fp8 states on the vllm-server engine (issue 23, first slice): ``format: fp8`` / ``--format fp8``.

hs-connectors 0.9's ``FP8HiddenStatesConnector`` writes ``hidden_states`` as float8_e4m3fn
with one float32 scale per token (``hidden_states_scales`` [T, 1, 1]); its read side is
``hs_connectors.transfer.FP8Transfer``, which speculators 0.9's trainer uses only with
``--hidden-states-backend fp8`` (its default ``file`` backend reads the fp8 values without
their scales, silently wrong).

Light tests (no vLLM): the field and the flag, the seed engine's refusal, the digest and
verify's reader on a file made by hs-connectors' own quantizer, resume refusing to mix
formats, preflight's disk estimate and its fail when the host's hs-connectors has no fp8
connector.

Heavy tests (one CPU server start of ours, 1-2 min; marked ``vllm``): ``specops extract
--format fp8`` over SSH on the modern test host (its overlay carries the CPU fp8 connector:
the CPU copy of the bf16 one, hs-connectors' own write), against the session's shared bf16
Llama run on the same ids (``modern_ssh_run("llama", 1)``: same dataset, seq_len 128, 4
samples, the engine's default ids): speculators 0.9's own ``ArrowDataset`` through the fp8
backend equals the bf16 states within fp8 rounding, the default backend does not (the
trap), bytes per token bf16 vs fp8 are printed, and ``verify`` passes the fp8 run against
fp8's rounding floor.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _inventory_writer

REPO = Path(__file__).resolve().parents[1]
from specops_cli import specops  # noqa: E402
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
INPUT_DEFAULT = [2, 4, 5, 8]


def run_python(python, code: str, *args, timeout: int = 600) -> dict:
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(python), "-c", code, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])



# --------------------------------------------------------------------------- light: the field and the flag


def test_format_is_an_inventory_field_and_a_flag_and_the_seed_engine_refuses_fp8(tmp_path, tiny_models):
    import yaml

    from specops.errors import InventoryError, UsageError
    from specops.exit_codes import ExitCode
    from specops.inventory import load_inventory
    from specops.params import run_params

    def inventory(**fields):
        spec = {"address": "127.0.0.1", "python": "python3", "model_path": "/m", "output_dir": "/o", **fields}
        path = tmp_path / f"inv-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump({"hosts": {"h": spec}}))
        return load_inventory(path).hosts["h"]

    assert run_params(inventory())["format"] == "bf16"  # the default: what the model computes
    fp8 = inventory(format="fp8")
    assert run_params(fp8)["format"] == "fp8"
    assert run_params(fp8, format="bf16")["format"] == "bf16"  # the flag wins
    assert run_params(inventory(), format="fp8")["format"] == "fp8"
    with pytest.raises(InventoryError, match="format"):
        inventory(format="fp9")
    with pytest.raises(UsageError) as bad:
        run_params(inventory(), format="fp9")
    assert "--format 'fp9'" in str(bad.value) and "bf16, fp8" in str(bad.value)
    # the seed engine writes no fp8: a usage error naming the field and the fix, before any host is asked
    with pytest.raises(UsageError) as seed:
        run_params(inventory(engine="speculators-0.3"), format="fp8")
    assert seed.value.code == ExitCode.USAGE
    said = str(seed.value)
    assert "--format fp8" in said and "speculators-0.3" in said and "format: bf16" in said, said
    with pytest.raises(UsageError, match=r"h: format: fp8 needs the vllm-server engine; engine speculators-0.3"):
        run_params(inventory(format="fp8"), engine="speculators-0.3")

    # the CLI: exit 3, nothing ran (the host in this inventory does not exist)
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"h": {"address": "192.0.2.1", "python": "python3", "model_path": "/m",
                                                    "output_dir": "/o", "engine": "speculators-0.3"}}}))
    proc = specops("preflight", "--inventory", path, "--format", "fp8", timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "--format fp8 needs the vllm-server engine; engine speculators-0.3" in said and "hint: set format: bf16" in said, said
    assert "Traceback" not in said

    # engine auto resolved on the host to the seed engine: the run's plan refuses it, naming the field
    from remote.extract import runplan

    with pytest.raises(runplan.PlanError) as plan:
        runplan.resolve({"format": "fp8"}, {"num_hidden_layers": 8}, engine=("speculators-0.3", "speculators 0.3.0"))
    assert plan.value.field == "format" and "format: bf16" in str(plan.value)
    # and preflight says so in its own record, before any load
    from remote.probes import Context, layer_ids

    ctx = Context({"format": "fp8", "model_path": str(tiny_models["llama"]), "engine": "speculators-0.3",
                   "layer_ids": None, "layer_convention": None})
    ctx.engine = ("speculators-0.3", "speculators 0.3.0 installed")
    ctx.model = {"num_layers": 8}
    found = {r["name"]: r for r in layer_ids.probe(ctx)}
    assert found["params.format"]["status"] == "fail", found
    assert "format fp8 needs the vllm-server engine" in found["params.format"]["summary"]
    assert "format: bf16" in found["params.format"]["fix"]
    ok = runplan.resolve({"format": "fp8"}, {"num_hidden_layers": 8}, engine=("vllm-server", "given"))
    assert ok.state_format == "fp8" and ok.as_dict()["state_format"] == "fp8"
    assert runplan.resolve({}, {"num_hidden_layers": 8}, engine=("vllm-server", "given")).state_format == "bf16"


def test_the_status_record_and_the_summary_table_name_the_state_format(tmp_path):
    """``status`` (the host's ``job.status`` record, once the run's plan is made) and the summary table
    ``extract``/``fetch`` print say bf16 or fp8; a run before its plan says nothing of it."""
    from remote.run import job
    from specops.runs.hostjob import summary_table

    def said(**status):
        return job._status_payload("job.status", "r1", tmp_path, {"samples_done": 4, "samples_total": 4, **status})[
            "records"][0]["summary"]

    assert said(state="done", plan={"state_format": "fp8"}) == "run r1 done: 4/4 samples, fp8 states"
    assert said(state="extracting", plan={"state_format": "bf16"}).endswith("4/4 samples, bf16 states")
    assert said(state="pending") == "run r1 pending: 4/4 samples"
    assert "fp8 states)" in str(summary_table({"run_id": "r1", "state_format": "fp8"}).title)
    assert "bf16 states)" in str(summary_table({"run_id": "r0"}).title)  # an older summary: bf16


def test_resume_refuses_to_mix_formats_in_one_output_dir(tmp_path):
    from remote.extract import samples

    rows = [([1, 2, 3], [0, 1, 1])]
    bf16 = samples.run_identity(rows, model={"n": 8}, fmt="hs", layer_ids=[2, 4], layer_convention="input")
    fp8 = samples.run_identity(rows, model={"n": 8}, fmt="hs", layer_ids=[2, 4], layer_convention="input",
                               state_format="fp8")
    samples.claim_output_dir(tmp_path, "r1", fp8, (0, 1))
    samples.claim_output_dir(tmp_path, "r1", fp8, (0, 1))  # the same run again: a resume
    with pytest.raises(ValueError) as mixed:
        samples.claim_output_dir(tmp_path, "r1", bf16, (0, 1))
    text = str(mixed.value)
    assert "state_format" in text and "'fp8' -> 'bf16'" in text and "--format fp8" in text, text
    # an owner file of an older specops (no state_format) is a bf16 run's: a bf16 resume goes on, fp8 does not
    old = tmp_path / "old"
    legacy = {k: v for k, v in bf16.items() if k != "state_format"}
    samples.claim_output_dir(old, "r2", legacy, (0, 1))
    samples.claim_output_dir(old, "r2", bf16, (0, 1))
    with pytest.raises(ValueError, match="--format bf16"):
        samples.claim_output_dir(old, "r2", fp8, (0, 1))


def test_preflight_disk_estimate_halves_and_names_the_format():
    from remote.probes import Context, capacity

    def estimate(fmt, engine="vllm-server", free=1 << 50):
        ctx = Context({"max_samples": 1000, "seq_len": 8192, "engine": engine, "hidden_dtype_bytes": 2,
                       **({"format": fmt} if fmt else {})})
        ctx.model = {"hidden_size": 7168}
        ctx.layers = {"ids": [2, 30, 58, 61]}
        ctx.host = {"disk": {"output_dir": {"free_bytes": free, "measured_at": "/out"}}}
        record, = capacity.probe(ctx)
        return record

    bf16, fp8, default = estimate("bf16"), estimate("fp8"), estimate(None)
    assert default["detail"]["bytes"] == bf16["detail"]["bytes"] and bf16["detail"]["format"] == "bf16"
    ratio = fp8["detail"]["bytes"] / bf16["detail"]["bytes"]
    assert 0.49 < ratio < 0.51, ratio
    assert fp8["detail"]["format"] == "fp8" and "fp8" in fp8["summary"] and "0.50x bf16" in fp8["summary"]
    assert "hidden_states_scales" in fp8["summary"] and "bf16" in bf16["summary"]
    # half the disk: the measured speed, landed and on disk, said where fp8 is named (the H100 at real width)
    cost = "0.869 of plain prefill landed vs bf16's 0.875, 0.426 on disk vs bf16's 0.306 (H100 at DeepSeek-V3 width"
    assert cost in fp8["summary"] and fp8["detail"]["fp8_speed"]["fp8_of_plain"] == 0.869, fp8["summary"]
    short = estimate("bf16", free=1 << 30)
    assert short["status"] == "fail" and "format: fp8, about half the bytes" in short["fix"] and cost in short["fix"]
    # a Kimi-K2.5-sized token: 57 KB bf16 -> 28.7 KB fp8 (4 layers x 7168 + the scale and the id)
    per_token = {k: r["detail"]["bytes"] / (1000 * 8192) / 1000 for k, r in (("bf16", bf16), ("fp8", fp8))}
    print(f"\npreflight estimate per token (4 x 7168): bf16 {per_token['bf16']:.1f} kB, fp8 {per_token['fp8']:.1f} kB")


# --------------------------------------------------------------------------- light: files made by hs-connectors


DIGEST = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from remote.extract import samples
from remote.extract.sampleread import LayerStats
from remote.verify.run import load_sample

out = Path(sys.argv[1]) / "hidden_states"
out.mkdir(parents=True)
torch.manual_seed(0)
T, ids = 37, [4, 9, 2, 7]
x = (torch.randn(T, 4, 64) * torch.tensor([0.5, 2.0, 8.0, 60.0])[None, :, None]).to(torch.bfloat16)
q, scale = quantize_tensor_to_fp8(x)
token_ids = torch.arange(T, dtype=torch.long)
save_file({"hidden_states": q, SCALES_KEY: scale, "token_ids": token_ids}, str(out / "hs_0.safetensors"))
save_file({"hidden_states": x, "token_ids": token_ids}, str(out / "hs_1.safetensors"))
save_file({"hidden_states": q, "token_ids": token_ids}, str(out / "hs_2.safetensors"))
ids_sorted = sorted([2, 4, 5, 8])
d = samples.digest_hs_file(out / "hs_0.safetensors", [8, 2, 4, 5], ids_sorted, token_ids=token_ids.tolist(),
                           hidden_size=64, state_format="fp8")
deq = q.float() * scale
want = []
for lid in [8, 2, 4, 5]:
    st = LayerStats(lid)
    st.add(deq[:, ids_sorted.index(lid)])
    want.append(st.as_dict())
got = []
for lid, part in zip([8, 2, 4, 5], d["layers"]):
    st = LayerStats(lid)
    st.merge(part)
    got.append(st.as_dict())
wrong_format = samples.digest_hs_file(out / "hs_1.safetensors", ids_sorted, ids_sorted, state_format="fp8")
wrong_format2 = samples.digest_hs_file(out / "hs_0.safetensors", ids_sorted, ids_sorted, state_format="bf16")
no_scales = samples.digest_hs_file(out / "hs_2.safetensors", ids_sorted, ids_sorted)
manifest = {"layer_ids": [2, 4, 5, 8], "file_layer_ids": ids_sorted}
read = load_sample(out / "hs_0.safetensors", manifest)
# the digest widens fp8 by bits (sampleread._fp8_widener): every code but NaN's, each sign, subnormals and
# -0 included, tokens of very different scales, a layer against torch's own float8 cast; a NaN code is named
codes = torch.arange(256, dtype=torch.uint8)
finite = codes[(codes & 0x7F) != 0x7F]
every = finite[torch.randperm(finite.numel())].repeat(3)[:240].view(10, 1, 24).view(torch.float8_e4m3fn)
every_scale = torch.logspace(-8, 8, 10).view(10, 1, 1)
for name, states in (("every", every), ("nan", every.view(torch.uint8).clone().index_fill_(2, torch.tensor([3]), 0xFF)
                                        .view(torch.float8_e4m3fn))):
    save_file({"hidden_states": states, SCALES_KEY: every_scale, "token_ids": torch.arange(10)},
              str(out / f"hs_{name}.safetensors"))
every_digest = samples.digest_hs_file(out / "hs_every.safetensors", [1], [1], token_ids=list(range(10)),
                                      hidden_size=24, state_format="fp8")
x64 = every.float().double() * every_scale.double()
nan_digest = samples.digest_hs_file(out / "hs_nan.safetensors", [1], [1], state_format="fp8")
print(json.dumps({
    "problems": d["problems"], "tensors": d["tensors"], "bytes": d["bytes"],
    "stats": [[g["mean"], w["mean"], g["std"], w["std"], g["abs_max"], w["abs_max"], g["dtype"]]
              for g, w in zip(got, want)],
    "wrong_format": wrong_format["problems"], "wrong_format2": wrong_format2["problems"],
    "no_scales": no_scales["problems"],
    "every": {k: every_digest["layers"][0][k] for k in ("count", "total", "total_sq", "abs_max", "nan")},
    "every_want": {"count": 240, "total": float(x64.sum()), "total_sq": float((x64 * x64).sum()),
                   "abs_max": float(x64.abs().max()), "nan": 0},
    "nan_layer": {k: nan_digest["layers"][0][k] for k in ("nan", "count")}, "nan_problems": nan_digest["problems"],
    "present": sorted(samples.present_indices(out.parent, "hs")),
    "read_equal": all(torch.equal(h, deq[:, ids_sorted.index(lid)])
                      for lid, h in zip([2, 4, 5, 8], read["hidden_states"])),
    "read_format": read.get("state_format"), "read_scales": list(read["scales"].shape),
}))
"""


def test_the_digest_and_verify_read_an_fp8_file_dequantized(modern_hostenv_python, tmp_path):
    """A file written with hs-connectors' own quantizer: the manifest entry names fp8 and the scales,
    the statistics are of fp8 x scale, a file of the other format (or without scales) is refused,
    resume counts it, and verify's reader dequantizes it as FP8Transfer does."""
    got = run_python(modern_hostenv_python, DIGEST, tmp_path)
    assert got["problems"] == []
    assert got["tensors"]["hidden_states"] == {"layer_ids": INPUT_DEFAULT, "shape": [37, 4, 64],
                                               "dtype": "float8_e4m3fn"}
    assert got["tensors"]["hidden_states_scales"] == {"shape": [37, 1, 1], "dtype": "float32"}
    for g_mean, w_mean, g_std, w_std, g_max, w_max, dtype in got["stats"]:
        assert g_mean == pytest.approx(w_mean, rel=1e-4, abs=1e-5) and g_std == pytest.approx(w_std, rel=1e-4)
        assert g_max == pytest.approx(w_max, rel=1e-6) and dtype == "float8_e4m3fn"
    assert any("asked for fp8" in p for p in got["wrong_format"]), got["wrong_format"]
    assert any("asked for bf16" in p for p in got["wrong_format2"]), got["wrong_format2"]
    assert any("hidden_states_scales" in p for p in got["no_scales"]), got["no_scales"]
    assert got["present"] == [0, 1, 2]  # whole files by their headers, either format
    assert got["read_equal"] and got["read_format"] == "fp8" and got["read_scales"] == [37, 1]
    every, want = got["every"], got["every_want"]  # each code widened exactly, summed in float32 block by block
    assert every["count"] == want["count"] and every["nan"] == 0 and every["abs_max"] == pytest.approx(want["abs_max"],
                                                                                                    rel=1e-7)
    assert every["total"] == pytest.approx(want["total"], rel=1e-6, abs=1e-6 * want["abs_max"])
    assert every["total_sq"] == pytest.approx(want["total_sq"], rel=1e-6)
    assert got["nan_layer"] == {"nan": 10, "count": 230}, got  # 10 tokens' NaN codes found, not read as 480
    assert any("NaN" in p for p in got["nan_problems"]), got["nan_problems"]


CPU_FP8_CONNECTOR = r"""
import json, sys, tempfile
from pathlib import Path
import torch
from safetensors.torch import load_file
import _specops_cpu_fp8_hidden_states_connector as cpu_fp8
from _specops_cpu_hidden_states_connector import CpuHiddenStatesConnector, _CopyDone
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from hs_connectors.fp8_utils import quantize_tensor_to_fp8
from remote.extract.engines import vllm_server

cls = getattr(cpu_fp8, vllm_server.CPU_FP8_CONNECTOR_CLASS)
# the CPU copy of the bf16 connector, the fp8 write of hs-connectors' own class
path = Path(tempfile.mkdtemp()) / "hs.safetensors"
x = (torch.randn(5, 3, 16) * 3).to(torch.bfloat16)
cls._write_tensors({"hidden_states": x, "token_ids": torch.arange(5)}, _CopyDone(), str(path), None)
got = load_file(str(path))
q, s = quantize_tensor_to_fp8(x)
print(json.dumps({
    "copy_from": cls._submit_async_write.__qualname__, "write_from": cls._write_tensors.__qualname__,
    "mro": [c.__name__ for c in cls.__mro__[:4]],
    "keys": sorted(got), "dtype": str(got["hidden_states"].dtype), "scales": list(got["hidden_states_scales"].shape),
    "same": torch.equal(got["hidden_states"].view(torch.uint8), q.view(torch.uint8))
            and torch.equal(got["hidden_states_scales"], s),
    "module_found": vllm_server.fp8_connector_module(),
}))
"""


def test_the_cpu_fp8_connector_is_the_cpu_copy_with_hs_connectors_own_fp8_write(modern_vllm_python):
    """The test host's CPU fp8 connector adds no code of its own: the CPU connector's copy out of the
    KV cache, then FP8HiddenStatesConnector's quantize + save_file, which runs on a CPU torch and
    writes exactly what hs-connectors' quantizer makes (fp8 [T, L, H] + float32 scales [T, 1, 1])."""
    from remote.extract.engines import vllm_server
    from specops.testhost import hostenv

    assert hostenv.CPU_FP8_CONNECTOR_MODULE == vllm_server.CPU_FP8_CONNECTOR_MODULE
    assert hostenv.CPU_FP8_CONNECTOR_CLASS == vllm_server.CPU_FP8_CONNECTOR_CLASS
    got = run_python(modern_vllm_python, CPU_FP8_CONNECTOR)
    assert got["copy_from"] == "CpuHiddenStatesConnector._submit_async_write"
    assert got["write_from"] == "FP8HiddenStatesConnector._write_tensors"
    assert got["mro"] == ["CpuFP8HiddenStatesConnector", "CpuHiddenStatesConnector", "FP8HiddenStatesConnector",
                          "ExampleHiddenStatesConnector"]
    assert got["keys"] == ["hidden_states", "hidden_states_scales", "token_ids"]
    assert got["dtype"] == "torch.float8_e4m3fn" and got["scales"] == [5, 1, 1] and got["same"]
    # on a GPU host the engine loads hs-connectors' own class, its module read from the installed package
    assert got["module_found"] == "hs_connectors.fp8_hidden_states_connector"


SPECOPS_FP8_CONNECTOR = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import PendingSave
import _specops_cpu_fp8_hidden_states_connector as stock_cpu_fp8
from hs_connectors.fp8_utils import dequantize_fp8_tensor
from hs_connectors.transfer import FP8Transfer
from remote.extract.engines.vllm_server import fp8_connector
from remote.extract.engines.vllm_server import command
from remote.extract import sampleread as samples

torch.manual_seed(0)
blocks, layers, block_size, hidden = 9, 3, 16, 64
# a KV cache as the hidden-states layer holds it: [blocks, layers, block_size, hidden], bf16, with
# tokens of very different magnitudes (per-token scales) and a zero token (the scale's clamp)
cache = (torch.randn(blocks, layers, block_size, hidden) * torch.logspace(-3, 3, blocks).view(-1, 1, 1, 1))
cache[2, :, 5] = 0
cache = cache.to(torch.bfloat16)
out = Path(sys.argv[1])


def write(cls, name, chunk=None):
    conn = object.__new__(cls)  # the real class; vLLM's __init__ needs a whole engine config
    conn._is_tp_rank_zero, conn._kv_cache, conn._block_size = True, cache, block_size
    conn._req_futures, conn._lock_fds, conn._req_copy_events, conn.use_lock = {}, {}, {}, True
    conn._executor = ThreadPoolExecutor(2)
    if chunk:
        fp8_connector.CHUNK_ELEMENTS = chunk
    tokens = torch.arange(100, 100 + 70)  # 70 tokens over blocks 7, 2, 4, 0, 5 (last one partly)
    pending = PendingSave(req_id="r", filename=str(out / name / "hs_0.safetensors"), token_ids=tokens,
                          block_ids=[7, 2, 4, 0, 5])
    conn._submit_async_write(pending)
    conn._executor.shutdown(wait=True)
    assert not conn._req_futures and "r" in conn._req_copy_events and conn._req_copy_events["r"].query()
    return pending.filename


stock = write(getattr(stock_cpu_fp8, command.CPU_FP8_CONNECTOR_CLASS), "stock")
ours = write(getattr(fp8_connector, command.SPECOPS_FP8_CONNECTOR_CLASS), "specops")
chunked = write(getattr(fp8_connector, command.SPECOPS_FP8_CONNECTOR_CLASS), "chunked", chunk=layers * hidden * 8)
a, b, c = load_file(stock), load_file(ours), load_file(chunked)
with safe_open(ours, "pt") as f:
    metadata = f.metadata()
deq_a = dequantize_fp8_tensor(a["hidden_states"], a["hidden_states_scales"], torch.float32)
deq_b = dequantize_fp8_tensor(b["hidden_states"], b["hidden_states_scales"], torch.float32)
# one fp8 e4m3 ulp of the larger value: 2**-3 of its power of two, at least the token's subnormal step
mag = torch.maximum(deq_a.abs(), deq_b.abs())
ulp = torch.maximum(torch.exp2(torch.floor(torch.log2(mag.clamp(min=1e-30)))) * 2.0 ** -3,
                    a["hidden_states_scales"].float() * 2.0 ** -9)
# the trainer's fp8 backend (speculators' --hidden-states-backend fp8) reads our file
# the trainer's fp8 backend (speculators' --hidden-states-backend fp8) and specops' digest read our file
read = FP8Transfer(out / "specops").get_cached(0)
digest = samples.digest_hs_file(Path(ours), [0, 1, 2], [0, 1, 2], token_ids=list(range(100, 170)), hidden_size=hidden,
                                state_format="fp8")
truth = cache[[7, 2, 4, 0, 5]].permute(0, 2, 1, 3).reshape(-1, layers, hidden)[:70].float()
print(json.dumps({
    "keys": [sorted(a), sorted(b)], "dtypes": [{k: str(v.dtype) for k, v in x.items()} for x in (a, b)],
    "shapes": [{k: list(v.shape) for k, v in x.items()} for x in (a, b)],
    "bytes_equal": Path(stock).read_bytes() == Path(ours).read_bytes(),
    "chunked_bytes_equal": Path(chunked).read_bytes() == Path(ours).read_bytes(),
    "scales_equal": torch.equal(a["hidden_states_scales"], b["hidden_states_scales"]),
    "within_one_ulp": bool(((deq_a - deq_b).abs() <= ulp).all()),
    "tokens_equal": torch.equal(b["token_ids"], torch.arange(100, 170)),
    "nrmse_vs_cache": float((deq_b - truth).norm() / truth.norm()),
    "zero_token_scale": float(b["hidden_states_scales"][5 + 16]),
    "trainer_reads": sorted(read), "trainer_dtype": str(read["hidden_states"].dtype),
    "trainer_equal": torch.equal(read["hidden_states"], dequantize_fp8_tensor(b["hidden_states"], b["hidden_states_scales"])),
    "digest_problems": digest["problems"], "digest_tensors": digest.get("tensors"),
}))
"""


def test_specops_fp8_connector_writes_the_stock_connectors_file_quantized_where_the_cache_is(modern_vllm_python,
                                                                                             tmp_path):
    """specops' fp8 connector (remote/extract/engines/vllm_server/fp8_connector.py) on a real KV cache tensor
    (the CPU test host's: there the cache's device is the CPU, the same gather-quantize-save path): its file
    equals the stock CPU fp8 connector's (hs-connectors' own write) for the same request -- keys, dtypes, shapes,
    scales, bytes -- also when quantized in token chunks; the trainer's fp8 backend and specops' digest read it."""
    got = run_python(modern_vllm_python, SPECOPS_FP8_CONNECTOR, tmp_path)
    assert got["keys"][0] == got["keys"][1] == ["hidden_states", "hidden_states_scales", "token_ids"]
    assert got["dtypes"][0] == got["dtypes"][1] and got["dtypes"][1]["hidden_states"] == "torch.float8_e4m3fn"
    assert got["shapes"][0] == got["shapes"][1] and got["shapes"][1]["hidden_states_scales"] == [70, 1, 1]
    assert got["scales_equal"] and got["within_one_ulp"] and got["bytes_equal"], got
    assert got["chunked_bytes_equal"] and got["tokens_equal"]
    assert got["zero_token_scale"] == pytest.approx(1e-12)  # hs-connectors' clamp, kept
    assert got["nrmse_vs_cache"] < 0.05  # fp8's rounding of what the cache held, at the right slots
    # speculators' trainer (--hidden-states-backend fp8: FP8Transfer) dequantizes it; the digest takes it whole
    assert got["trainer_reads"] == ["hidden_states", "token_ids"] and got["trainer_dtype"] == "torch.bfloat16"
    assert got["trainer_equal"] and got["digest_problems"] == []
    assert got["digest_tensors"]["hidden_states"]["dtype"] == "float8_e4m3fn"


CONNECTOR_CHOICE = r"""
import json
from remote.drift import server
from remote.extract.engines import vllm_server as vs

rec = next(r for r in server.check({"model_path": "", "device": "cpu", "format": "fp8"})
           if r["name"] == "drift.server-connector")
print(json.dumps({"fp8": vs.pick_connector({"format": "fp8"}), "bf16": vs.pick_connector({"format": "bf16"}),
                  "stock_asked": vs.pick_connector({"format": "fp8", "kv_connector":
                      "hs_connectors.fp8_hidden_states_connector:FP8HiddenStatesConnector"}),
                  "problems": vs.fp8_fallback({}), "record": {k: rec.get(k) for k in ("status", "summary", "fix")},
                  "fallback": rec["detail"].get("specops_fp8_fallback"),
                  "gpu": [{k: r.get(k) for k in ("status", "summary", "fix")} for r in server.check(
                      {"model_path": "", "device": "cuda", "format": "fp8"}) if r["name"] == "drift.server-connector"]}))
"""


def test_format_fp8_takes_specops_connector_and_falls_back_to_the_stock_one_naming_why(
        modern_vllm_python, modern_hostenv_python, tmp_path):
    """The engine's connector for ``format: fp8`` is specops' own where the installed classes still have what
    it uses; an hs-connectors whose FP8HiddenStatesConnector overrides more than the write (planted here: its
    own copy) makes the engine load the stock one, and preflight's connector record warns, naming the reason."""
    import shutil

    from specops.testhost.hostenv import make_overlay_env, site_packages

    got = run_python(modern_vllm_python, CONNECTOR_CHOICE)
    assert got["fp8"] == ["SpecopsFP8HiddenStatesConnector", "remote.extract.engines.vllm_server.fp8_connector"]
    assert got["bf16"] == ["CpuHiddenStatesConnector", "_specops_cpu_hidden_states_connector"]
    assert got["stock_asked"] == ["FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector"]
    assert got["problems"] == [] and got["record"]["status"] == "ok", got
    assert "SpecopsFP8HiddenStatesConnector" in got["record"]["summary"]
    # a GPU host takes specops' too (its device path measured on an H100: GPU round 15)
    (gpu,) = got["gpu"]
    assert gpu["status"] == "ok" and "SpecopsFP8HiddenStatesConnector" in gpu["summary"], gpu

    python = make_overlay_env(modern_hostenv_python, tmp_path / "env", rope_fix=False, hidden_states_connector=True)
    installed = run_python(python, "import json, hs_connectors; print(json.dumps(hs_connectors.__file__))")
    drifted = site_packages(python) / "hs_connectors"
    shutil.copytree(Path(installed).parent, drifted)
    connector = drifted / "fp8_hidden_states_connector.py"
    connector.write_text(connector.read_text() + "\n    def _submit_async_write(self, pending):  # a newer copy\n"
                                                 "        return super()._submit_async_write(pending)\n")
    got = run_python(python, CONNECTOR_CHOICE)
    assert got["fp8"] == ["CpuFP8HiddenStatesConnector", "_specops_cpu_fp8_hidden_states_connector"], got
    assert any("now also defines _submit_async_write" in p for p in got["problems"]), got["problems"]
    assert got["record"]["status"] == "warn" and "falls back to CpuFP8HiddenStatesConnector" in got["record"]["summary"]
    assert "_submit_async_write" in got["record"]["summary"] and got["fallback"] == got["problems"]
    assert "format: bf16" in got["record"]["fix"]


CONNECTOR_OPTIONS = r"""
import json
from remote.extract.engines import vllm_server

given = {"shared_storage_path": "/run/server/storage"}
print(json.dumps({name: vllm_server.connector_options((name, module), given) for name, module in (
    (vllm_server.STOCK_CONNECTOR, None),
    (vllm_server.CPU_CONNECTOR_CLASS, vllm_server.CPU_CONNECTOR_MODULE),
    (vllm_server.CPU_FP8_CONNECTOR_CLASS, vllm_server.CPU_FP8_CONNECTOR_MODULE),
    (vllm_server.FP8_CONNECTOR_CLASS, vllm_server.fp8_connector_module()),
    ("NoSuchConnector", None))}))
"""


def test_the_connectors_options_are_read_from_the_installed_source(modern_vllm_python):
    """What the manifest records of the connector (``engine.connector_options``): every option vLLM 0.32's
    ``ExampleHiddenStatesConnector`` reads from ``kv_connector_extra_config``, with the value given or the
    connector's own default, found along the class's bases from its module (registered by name in vLLM,
    or out of tree: the test host's CPU connectors, hs-connectors' fp8 one), nothing imported."""
    got = run_python(modern_vllm_python, CONNECTOR_OPTIONS)
    stock = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
    want = {"allow_custom_save_path": False, "num_writer_threads": 8, "shared_storage_path": "/run/server/storage",
            "use_synchronization_lock": True}
    for name, module in (("ExampleHiddenStatesConnector", stock),
                         ("CpuHiddenStatesConnector", "_specops_cpu_hidden_states_connector"),
                         ("CpuFP8HiddenStatesConnector", "_specops_cpu_fp8_hidden_states_connector"),
                         ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")):
        found = got[name]
        assert found["class"] == name and found["module"] == module, found
        assert found["options"] == want and found["given"] == ["shared_storage_path"], found
        assert [f.rsplit("/", 1)[-1] for f in found["read_from"]] == \
            ["example_hidden_states_connector.py:ExampleHiddenStatesConnector"], found
    # a connector this vLLM does not know: only what was given, and no source read
    assert got["NoSuchConnector"]["options"] == {"shared_storage_path": "/run/server/storage"}
    assert got["NoSuchConnector"]["module"] is None and got["NoSuchConnector"]["read_from"] == []


def test_preflight_fails_with_the_fix_when_hs_connectors_lacks_the_fp8_connector(modern_hostenv_python, tmp_path):
    """An hs-connectors without FP8HiddenStatesConnector (an older release) in the host's python:
    preflight's connector check fails, naming it and the fix; with bf16 the same host passes."""
    from specops.testhost.hostenv import make_overlay_env, site_packages

    python = make_overlay_env(modern_hostenv_python, tmp_path / "env", rope_fix=False, hidden_states_connector=False)
    old = site_packages(python) / "hs_connectors"
    old.mkdir()
    (old / "__init__.py").write_text('"""an hs-connectors before fp8"""\n')
    (old / "transfer.py").write_text("class FileTransfer:\n    pass\n")
    code = r"""
import json, sys
from remote.drift import server
out = {}
for fmt in ("fp8", "bf16"):
    rec = next(r for r in server.check({"model_path": "", "device": "cuda", "format": fmt})
               if r["name"] == "drift.server-connector")
    out[fmt] = {k: rec.get(k) for k in ("status", "summary", "fix")}
print(json.dumps(out))
"""
    got = run_python(python, code)
    assert got["fp8"]["status"] == "fail", got
    assert "FP8HiddenStatesConnector" in got["fp8"]["summary"] and "format fp8" in got["fp8"]["summary"]
    assert "pip install 'hs-connectors>=0.9'" in got["fp8"]["fix"] and "format: bf16" in got["fp8"]["fix"]
    assert got["bf16"]["status"] == "ok", got


# --------------------------------------------------------------------------- heavy: a real fp8 run


@pytest.fixture(scope="module")
def modern_llama(testhost, modern_fixed_python, tiny_models, tmp_path_factory) -> dict:
    """An inventory of the modern test host set up exactly as the session's shared bf16 run (conftest
    ``modern_ssh_run``): same env, dataset, seq_len, samples and ids; bf16 unless a flag says fp8."""
    from specops.testhost.hostenv import cache_root

    tmp = tmp_path_factory.mktemp("modern-llama-fp8")
    env = {**OFFLINE, "VLLM_MLA_DISABLE": "1", "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}
    inventory = _inventory_writer(tmp, testhost, modern_fixed_python, "inventory")(
        model_path=str(tiny_models["llama"]), dataset=str(tiny_models["dataset"]), tp=1,
        seq_len=128, max_samples=4, batch_size=4, env=env)
    return {"tmp": tmp, "inventory": inventory}


def test_preflight_on_the_modern_host_checks_the_fp8_connector_and_halves_the_disk_estimate(modern_llama):
    """``specops preflight --format fp8`` over SSH: the connector the run will load is hs-connectors' fp8
    one (here the test host's CPU variant), and the disk estimate is about half the bf16 one, naming fp8."""
    found = {}
    for fmt in ("bf16", "fp8"):
        proc = specops("preflight", "--inventory", modern_llama["inventory"], "--format", fmt, "--json",
                       timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
        found[fmt] = {r["name"]: r for r in records_of(proc)}
    fp8, bf16 = found["fp8"], found["bf16"]
    assert fp8["drift.server-connector"]["status"] == "ok"
    assert "SpecopsFP8HiddenStatesConnector" in fp8["drift.server-connector"]["summary"]  # specops' own
    assert "CpuHiddenStatesConnector (" in bf16["drift.server-connector"]["summary"]
    assert "fp8" in fp8["capacity.output"]["summary"] and "bf16" in bf16["capacity.output"]["summary"]
    ratio = fp8["capacity.output"]["detail"]["bytes"] / bf16["capacity.output"]["detail"]["bytes"]
    assert 0.49 < ratio < 0.52, ratio
    print(f"\npreflight --format fp8: {fp8['capacity.output']['summary']}")


@pytest.fixture(scope="module")
def fp8_run(modern_llama) -> dict:
    """``specops extract --format fp8 --canary-samples 3 --tensors --json`` of the tiny Llama over SSH
    (preflight on, smoke off, as the shared bf16 run; one canary sample more than its default 2)."""
    tmp, inventory = modern_llama["tmp"], modern_llama["inventory"]
    runs = {"SPECOPS_RUNS": str(tmp / "runs")}
    t0 = time.monotonic()
    proc = specops("extract", "--inventory", inventory, "--run-id", "llama-fp8", "--skip-smoke", "--tensors",
                   "--json", "--format", "fp8", "--canary-samples", "3", env=runs)
    print(f"\nspecops extract llama-fp8 (modern, fp8): {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = tmp / "work" / "runs" / "llama-fp8"
    status = json.loads((run_dir / "status.json").read_text())
    return {"inventory": inventory, "run_dir": run_dir, "status": status, "out": Path(status["output_dir"]),
            "env": runs, "proc": proc, "dest": tmp / "runs" / "th" / "llama-fp8"}


@pytest.fixture(scope="module")
def bf16_run(modern_ssh_run) -> dict:
    run = modern_ssh_run("llama", 1)
    status = json.loads((run["run_dir"] / "status.json").read_text())
    return {**run, "status": status, "out": Path(status["output_dir"])}


def records_of(proc) -> list:
    """Every record of a ``--json`` run's output (preflight's and the run's)."""
    doc = json.loads(proc.stdout)
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "name" in node and "status" in node and "summary" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return found


@pytest.mark.vllm
def test_an_fp8_run_writes_fp8_files_and_says_so_everywhere(fp8_run):
    st = fp8_run["status"]
    assert st["state"] == "done" and st["engine"] == "vllm-server", st
    assert st["plan"]["state_format"] == "fp8"
    out, run_dir = fp8_run["out"], fp8_run["run_dir"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state_format"] == "fp8" and manifest["scales_key"] == "hidden_states_scales"
    assert manifest["hidden_states_backend"] == "fp8" and "--hidden-states-backend fp8" in manifest["format"]
    assert manifest["params"]["format"] == "fp8" and manifest["engine"]["state_format"] == "fp8"
    # specops' own fp8 connector (quantized where the cache is; here the CPU), no fallback
    assert manifest["engine"]["connector"] == \
        "remote.extract.engines.vllm_server.fp8_connector:SpecopsFP8HiddenStatesConnector"
    assert manifest["engine"]["fp8_connector_fallback"] is None
    # the connector's class, module and every option that shaped the files: given, or its own default
    options = manifest["engine"]["connector_options"]
    assert options["class"] == "SpecopsFP8HiddenStatesConnector", options
    assert options["module"] == "remote.extract.engines.vllm_server.fp8_connector"
    assert options["given"] == ["num_writer_threads", "shared_storage_path"], options
    # the writer threads: the connector's own 8 capped at the host's cores (writer_threads unset)
    assert options["options"]["num_writer_threads"] == min(8, len(os.sched_getaffinity(0)))
    assert options["options"]["use_synchronization_lock"] is True
    assert options["options"]["allow_custom_save_path"] is False
    assert options["options"]["shared_storage_path"] == str(run_dir / "storage"), options
    assert any(f.endswith("example_hidden_states_connector.py:ExampleHiddenStatesConnector")
               for f in options["read_from"]), options
    # the canary setting came from the laptop's flag and is in the plan, the params and the engine's record
    assert st["plan"]["canary_samples"] == 3 and manifest["params"]["canary_samples"] == 3
    assert manifest["engine"]["canary_samples"] == 3
    for entry in manifest["files"]:
        assert entry["tensors"]["hidden_states"]["dtype"] == "float8_e4m3fn"
        assert entry["tensors"]["hidden_states_scales"] == {"shape": [entry["tokens"], 1, 1], "dtype": "float32"}
    owner = json.loads((out / ".specops-output.json").read_text())
    assert owner["identity"]["state_format"] == "fp8"  # what a resume with another format is refused by
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["state_format"] == "fp8"
    assert all(layer["dtype"] == "float8_e4m3fn" and layer["std"] > 0 for layer in summary["layers"])
    # the laptop's copy keeps the format
    fetched = json.loads((fp8_run["dest"] / "manifest.json").read_text())
    assert fetched["state_format"] == "fp8" and fetched["scales_key"] == "hidden_states_scales"
    # the canary judged the fp8 samples against fp8's floor, and passed
    canary = json.loads((run_dir / "prompt_logprobs" / "canary.json").read_text())
    assert len(canary) == 3 and all(r["status"] == "ok" for r in canary), [r["summary"] for r in canary]
    assert sorted(r["detail"]["index"] for r in canary) == [0, 1, 2]
    assert "the fp8 floor" in json.dumps(canary) or '"floor_dtype": "fp8"' in json.dumps(canary), canary
    # fetch brought the canary's records and the engine's prompt logprobs back with the logs
    kept = sorted(p.name for p in (run_dir / "prompt_logprobs").iterdir())
    assert kept == ["canary.json", "prompt_logprobs_0.json", "prompt_logprobs_1.json", "prompt_logprobs_2.json"]
    fetched_dir = fp8_run["dest"] / "prompt_logprobs"
    assert sorted(p.name for p in fetched_dir.iterdir()) == kept
    assert all((fetched_dir / n).read_bytes() == (run_dir / "prompt_logprobs" / n).read_bytes() for n in kept)
    print(f"\nprompt_logprobs/ fetched: {sum((fetched_dir / n).stat().st_size for n in kept)} bytes in {len(kept)} "
          f"files for {sum(f['tokens'] for f in manifest['files'][:3])} tokens")


@pytest.mark.vllm
def test_status_and_the_run_summary_say_fp8(fp8_run):
    """``specops status`` names the run's state format in its record (people and --json), and the summary
    table ``fetch`` prints says it too."""
    said = specops("status", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8", env=fp8_run["env"],
                   timeout=300)
    assert said.returncode == 0 and "fp8 states" in said.stdout, said.stdout + said.stderr
    as_json = specops("status", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8", "--json",
                      env=fp8_run["env"], timeout=300)
    (record,) = [r for r in records_of(as_json) if r["name"] == "job.status"]
    assert record["summary"].endswith("4/4 samples, fp8 states"), record
    fetched = specops("fetch", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8", env=fp8_run["env"],
                      timeout=300)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert "summary of run llama-fp8" in fetched.stdout and "fp8 states)" in fetched.stdout, fetched.stdout


SPECULATORS_READ = r"""
import argparse, json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from hs_connectors import HiddenStatesBackend
from hs_connectors.fp8_utils import quantize_tensor_to_fp8
from speculators.train.data import ArrowDataset

fp8_out, bf16_out = Path(sys.argv[1]), Path(sys.argv[2])
# as `speculators train --hidden-states-backend fp8` builds it (speculators/train/cli.py)
args = argparse.Namespace(hidden_states_path=None)
fp8_backend = HiddenStatesBackend.registry["fp8"].from_train_args(args, str(fp8_out))
through_fp8 = ArrowDataset(max_len=512, datapath=fp8_out, transfer=fp8_backend, on_missing="raise")
through_default = ArrowDataset(max_len=512, datapath=fp8_out, on_missing="raise")   # the file backend
rows = []
for i in range(len(through_fp8)):
    bf16 = load_file(bf16_out / "hidden_states" / f"hs_{i}.safetensors")
    raw = load_file(fp8_out / "hidden_states" / f"hs_{i}.safetensors")
    want = bf16["hidden_states"].float()                                  # [T, L, H]
    a, b = through_fp8[i], through_default[i]
    assert torch.equal(a["input_ids"], bf16["token_ids"]) and torch.equal(b["input_ids"], bf16["token_ids"])
    got = torch.cat([a["hidden_states"].float(), a["verifier_last_hidden_states"].float()], dim=1)
    trap = torch.cat([b["hidden_states"].float(), b["verifier_last_hidden_states"].float()], dim=1)
    flat = want.flatten(1)
    scale = raw["hidden_states_scales"].float().reshape(-1, 1)
    err = (got - flat).abs()
    # fp8 e4m3 rounding: half a step of 2**-3 of the value, or of the smallest subnormal step (2**-9 of the
    # token's scale); the backend then returns bf16 (2**-8 of the value more)
    bound = flat.abs() * (2.0 ** -4 + 2.0 ** -8) + scale * 2.0 ** -9 + 1e-6
    q, s = quantize_tensor_to_fp8(bf16["hidden_states"])
    rows.append({
        "tokens": int(flat.shape[0]),
        "within_fp8_rounding": float((err <= bound).float().mean()), "worst_over_bound": float((err / bound).max()),
        "nrmse": float((got - flat).norm() / flat.norm()),
        "same_bytes_as_quantizing_the_bf16_run": bool(torch.equal(q.view(torch.uint8),
                                                                  raw["hidden_states"].view(torch.uint8))),
        "default_nrmse": float((trap - flat).norm() / flat.norm()),
        "default_dtype": str(b["hidden_states"].dtype), "fp8_dtype": str(a["hidden_states"].dtype),
        "raw_dtype": str(raw["hidden_states"].dtype),
    })
print(json.dumps(rows))
"""


@pytest.mark.vllm
def test_speculators_reads_fp8_through_the_fp8_backend_within_fp8_rounding_and_the_default_backend_is_wrong(
        fp8_run, bf16_run, modern_fixed_python):
    """speculators 0.9's own ArrowDataset: with the fp8 backend (FP8Transfer) the fp8 run's states equal
    the bf16 run's on the same ids within fp8 rounding; with the default (file) backend it returns the
    fp8 values without their scales -- the trap a draft would silently train on. Bytes per token printed."""
    fp8_manifest = json.loads((fp8_run["out"] / "manifest.json").read_text())
    bf16_manifest = json.loads((bf16_run["out"] / "manifest.json").read_text())
    # the same samples: ids, lengths, layer ids
    assert [(f["index"], f["tokens"]) for f in fp8_manifest["files"]] == \
        [(f["index"], f["tokens"]) for f in bf16_manifest["files"]]
    assert fp8_manifest["layer_ids"] == bf16_manifest["layer_ids"] == INPUT_DEFAULT
    assert bf16_manifest.get("state_format", "bf16") == "bf16"

    rows = run_python(modern_fixed_python, SPECULATORS_READ, fp8_run["out"], bf16_run["out"])
    assert len(rows) == 4
    for row in rows:
        assert row["raw_dtype"] == "torch.float8_e4m3fn" and row["fp8_dtype"] == "torch.bfloat16"
        # every value within fp8's rounding of the bf16 run's (allowing for a rare bf16 difference between two
        # server runs of the same ids; the print says how many files are byte-equal to quantizing the bf16 run's)
        assert row["within_fp8_rounding"] >= 0.999 and row["worst_over_bound"] < 4, row
        assert row["nrmse"] < 0.05, row
        assert row["default_nrmse"] > 0.5, row  # the trap: the file backend ignores the scales
    exact = sum(r["same_bytes_as_quantizing_the_bf16_run"] for r in rows)

    bf16_bytes = sum(f["bytes"] for f in bf16_manifest["files"])
    fp8_bytes = sum(f["bytes"] for f in fp8_manifest["files"])
    tokens = sum(f["tokens"] for f in fp8_manifest["files"])
    per_bf16, per_fp8 = bf16_bytes / tokens, fp8_bytes / tokens
    print(f"\nbytes per token on the same {tokens} tokens (tiny Llama, 4 layers x 256): bf16 {per_bf16:.1f}, "
          f"fp8 {per_fp8:.1f} ({per_fp8 / per_bf16:.3f}x); fp8 nrmse vs bf16 "
          f"{max(r['nrmse'] for r in rows):.2%} (fp8 backend), {min(r['default_nrmse'] for r in rows):.0%}+ "
          f"(default file backend); {exact}/4 files byte-equal to quantizing the bf16 run's; extraction "
          f"{bf16_run['status'].get('tokens_per_s')} tok/s bf16, {fp8_run['status'].get('tokens_per_s')} tok/s fp8 "
          f"(one run each, a noisy 2-core box)")
    assert 0.45 < per_fp8 / per_bf16 < 0.56, (per_bf16, per_fp8)


@pytest.mark.vllm
def test_verify_judges_an_fp8_run_against_fp8s_rounding_floor(fp8_run):
    proc = specops("verify", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8", "--samples", "2",
                   "--json", env=fp8_run["env"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    records = {r["name"]: r for r in records_of(proc)}
    layers = [records[f"verify.layer.{lid}"] for lid in INPUT_DEFAULT]
    assert all(r["status"] == "ok" for r in layers), [r["summary"] for r in layers]
    floor = records["verify.reference"]["detail"]["rounding_floor"]
    assert floor["dtype"] == "fp8" and floor["nrmse"], floor
    for r in layers:
        assert "the fp8 rounding floor" in r["summary"] and r["detail"]["cos_tol"] == 0.99, r["summary"]
    print("\nverify fp8: " + "; ".join(f"{r['name']}: nrmse {r['detail']['nrmse']:.2%}, "
                                       f"floor {r['detail']['floor_nrmse']:.2%} ({r['detail']['floor_ratio']:.2f}x)"
                                       for r in layers))


@pytest.mark.vllm
def test_verify_layer_and_logits_judge_an_fp8_run_against_fp8s_floor(fp8_run):
    """The two bounded references read fp8 samples dequantized and judge them against fp8's rounding:
    decoder layer 4 (input:4 -> input:5) in bf16 on its input rounded once more, its output stored
    with the token's scale; the logprobs of the last state against its fp8 re-rounding."""
    for reference in ("layer", "logits"):
        proc = specops("verify", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8", "--samples", "2",
                       "--reference", reference, "--json", env=fp8_run["env"], timeout=900)
        assert proc.returncode == 0, reference + "\n" + proc.stdout[-6000:] + proc.stderr[-3000:]
        records = records_of(proc)
        assert not [r["summary"] for r in records if r["status"] == "fail"], reference
        judged = {r["name"]: r for r in records}["verify.layer.4" if reference == "layer" else "verify.logits"]
        assert judged["status"] == "ok", judged["summary"]
        assert "fp8" in judged["summary"] or "fp8" in json.dumps(judged["detail"]), judged
        print(f"\nverify --reference {reference} (fp8): " + "; ".join(
            r["summary"][:220] for r in records if r["name"].startswith(("verify.layer", "verify.logits"))))


PLANT_NAN_SCALE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
path = Path(sys.argv[1]) / "hidden_states" / "hs_0.safetensors"
data = load_file(str(path))
scales = data["hidden_states_scales"].clone()
scales[2] = float("nan")
data["hidden_states_scales"] = scales
save_file(data, str(path))
print(json.dumps({"tokens": int(scales.shape[0])}))
"""


@pytest.mark.vllm
def test_verify_fails_a_nan_fp8_scale_naming_the_sample_and_token(fp8_run, modern_fixed_python):
    """A NaN per-token scale (digest updated) spoils every layer of its token once dequantized: verify fails
    it by name before any model load; it used to pass as "mostly agrees ... cosine mean nan", exit 0."""
    from test_smoke_verify_modern import copy_run, rewrite_manifest, run_python

    planted = copy_run(fp8_run, "llama-fp8-nan-scale")
    out = json.loads((planted / "status.json").read_text())["output_dir"]
    run_python(modern_fixed_python, PLANT_NAN_SCALE, out)
    rewrite_manifest(planted)
    proc = specops("verify", "--inventory", fp8_run["inventory"], "--run-id", "llama-fp8-nan-scale", "--samples",
                   "4", "--json", env=fp8_run["env"], timeout=900)
    assert proc.returncode != 0, proc.stdout[-4000:]
    states = {r["name"]: r for r in records_of(proc)}["verify.states"]
    assert states["status"] == "fail" and "hs_0.safetensors the fp8 scale of token 2 is NaN" in states["summary"]
    assert states["detail"]["places"] == [{"sample": "hidden_states/hs_0.safetensors", "layer": "scale", "token": 2,
                                           "what": "NaN"}], states["detail"]
