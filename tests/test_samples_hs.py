"""The ``hs`` sample file's one read: checks, digest (BLAKE3, else sha256) and layer statistics, and the resume rule.

Runs ``remote/extract/samples.py`` in the modern test-host env (torch 2.13 + safetensors), on
files written by safetensors itself, the way vLLM's hidden-states connector writes them.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import hashlib, json, math, sys
import torch
from safetensors.torch import save_file
from remote.extract import samples

out = sys.argv[1]
T, L, H = 40, 4, 48
torch.manual_seed(0)
states = (torch.randn(T, L, H) * torch.tensor([1.0, 3.0, 0.5, 8.0]).view(1, L, 1)).to(torch.bfloat16)
ids = torch.arange(100, 100 + T, dtype=torch.int64)
file_ids, asked = [2, 4, 5, 8], [8, 2, 5, 4]
res = {}

def write(name, tensors):
    save_file(tensors, f"{out}/{name}")
    return f"{out}/{name}"

good = write("hs_0.safetensors", {"token_ids": ids, "hidden_states": states})
d = samples.digest_hs_file(good, asked, file_ids, token_ids=ids.tolist(), hidden_size=H)
res["good_problems"] = d["problems"]
import blake3
res["hash"] = d["hash"] == {"blake3": blake3.blake3(open(good, "rb").read()).hexdigest()}
# a host python without blake3 (no vLLM) names sha256 instead: the same one read, another digest
from remote.wire import fsutil
sys.modules["blake3"] = None  # what an absent package looks like to `import`
fsutil.default_hash.cache_clear()
res["fallback"] = samples.digest_hs_file(good, asked, file_ids)["hash"] == {
    "sha256": hashlib.sha256(open(good, "rb").read()).hexdigest()}
del sys.modules["blake3"]
fsutil.default_hash.cache_clear()
res["tensors"] = d["tensors"]
# the digest's statistics equal the float64 ones computed from the loaded tensors
merged, direct = [], []
for lid, part in zip(asked, d["layers"]):
    a, b = samples.LayerStats(lid), samples.LayerStats(lid)
    a.merge(part)
    b.add(states[:, file_ids.index(lid)])
    merged.append(a.as_dict()); direct.append(b.as_dict())
res["stats_close"] = all(
    m["shape"] == s["shape"] and m["dtype"] == s["dtype"] and m["abs_max"] == s["abs_max"]
    and math.isclose(m["std"], s["std"], rel_tol=1e-5) and abs(m["mean"] - s["mean"]) <= 1e-5 * s["std"]
    for m, s in zip(merged, direct))
# the statistics go a block of tokens at a time (remote/extract/sampleread.py STATS_BLOCK_BYTES): 7 rows a block here,
# the last one short, give the same numbers as one block
from remote.extract import sampleread
whole_block, sampleread.STATS_BLOCK_BYTES = sampleread.STATS_BLOCK_BYTES, 4 * H * 7
blocked = samples.digest_hs_file(good, asked, file_ids)["layers"]
sampleread.STATS_BLOCK_BYTES = whole_block
res["blocks_agree"] = all(b["abs_max"] == p["abs_max"] and b["count"] == p["count"]
                          and math.isclose(b["total_sq"], p["total_sq"], rel_tol=1e-5)
                          and abs(b["total"] - p["total"]) <= 1e-4 * math.sqrt(p["total_sq"])
                          for b, p in zip(blocked, d["layers"]))
res["layer_order"] = [m["layer_id"] for m in merged]
res["std_by_layer"] = [round(m["std"], 1) for m in merged]

res["echo"] = samples.digest_hs_file(good, asked, file_ids, token_ids=list(range(T)))["problems"]
res["width"] = samples.digest_hs_file(good, asked, file_ids, hidden_size=64)["problems"]
res["layers"] = samples.digest_hs_file(good, asked, [2, 4, 5])["problems"]
bad = states.clone(); bad[3, 1, 7] = float("nan"); bad[5, 1, 9] = float("inf"); bad[6, 1, 1] = float("-inf")
nan = write("hs_1.safetensors", {"token_ids": ids, "hidden_states": bad})
dn = samples.digest_hs_file(nan, asked, file_ids)
sampleread.STATS_BLOCK_BYTES = 4 * H * 7
res["nan_blocked"] = samples.digest_hs_file(nan, asked, file_ids)["problems"]
sampleread.STATS_BLOCK_BYTES = whole_block
res["nan"] = dn["problems"]
res["nan_counts"] = [(p["nan"], p["inf"]) for p in dn["layers"]]
res["lacks"] = samples.digest_hs_file(write("hs_2.safetensors", {"hidden_states": states}), asked, file_ids)["problems"]
res["int32_ids"] = samples.digest_hs_file(write("hs_3.safetensors", {"token_ids": ids.int(), "hidden_states": states}),
                                         asked, file_ids)["problems"]
raw = open(good, "rb").read()
open(f"{out}/hs_4.safetensors", "wb").write(raw[:-100])       # cut short (a power loss after the rename)
open(f"{out}/hs_5.safetensors", "wb").write(raw + b"\0" * 8)  # longer than declared
open(f"{out}/hs_6.safetensors", "wb").write(b"")               # empty
open(f"{out}/hs_7.safetensors", "wb").write((10**9).to_bytes(8, "little") + b"{}")  # absurd header length
res["short"] = samples.hs_file_problem(f"{out}/hs_4.safetensors")
res["long"] = samples.hs_file_problem(f"{out}/hs_5.safetensors")
res["empty"] = samples.hs_file_problem(f"{out}/hs_6.safetensors")
res["absurd"] = samples.hs_file_problem(f"{out}/hs_7.safetensors")
res["short_digest"] = samples.digest_hs_file(f"{out}/hs_4.safetensors", asked, file_ids)["problems"]
print(json.dumps(res))
"""


def run_in_modern_env(python: Path, out: Path) -> dict:
    proc = subprocess.run([str(python), "-c", SCRIPT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_read_checks_hashes_and_summarises(modern_hostenv_python, tmp_path):
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    res = run_in_modern_env(modern_hostenv_python, hs)
    assert res["good_problems"] == [] and res["hash"], "the manifest's digest, named: blake3 where the host has it"
    assert res["fallback"], "a python without blake3 names sha256"
    assert res["tensors"] == {"token_ids": {"shape": [40], "dtype": "int64"},
                              "hidden_states": {"layer_ids": [2, 4, 5, 8], "shape": [40, 4, 48], "dtype": "bfloat16"}}
    # statistics in the order asked, each from its own slice of the file's layer axis
    assert res["stats_close"] and res["blocks_agree"] and res["layer_order"] == [8, 2, 5, 4]
    assert res["std_by_layer"] == pytest.approx([8.0, 1.0, 0.5, 3.0], rel=0.1)
    assert res["echo"] == ["token_ids do not echo the request (40 ids back, 40 sent)"]
    assert "expected a float [40, 4, 64]" in res["width"][0]
    assert "expected a float [40, 3, H]" in res["layers"][0]
    assert res["nan"] == res["nan_blocked"] == ["hidden_states has NaN/Inf: layer 4: 1 NaN, 2 Inf"]
    assert res["nan_counts"] == [[0, 0], [0, 0], [0, 0], [1, 2]]
    assert res["lacks"] == ["file lacks ['token_ids'] (has ['hidden_states'])"]
    assert res["int32_ids"] == ["token_ids is I32 [40], expected int64 [T]"]
    assert "cut short or padded" in res["short"] and "cut short or padded" in res["long"]
    assert res["empty"] == "0 bytes: shorter than a safetensors header"
    assert "does not fit" in res["absurd"]
    assert res["short_digest"] == [res["short"]]


def test_resume_counts_only_whole_files(modern_hostenv_python, tmp_path):
    """A file renamed in but cut short by a power loss (no per-file fsync) is redone, not counted."""
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    run_in_modern_env(modern_hostenv_python, hs)
    (hs / "hs_9.txt").write_text("not a sample")
    proc = subprocess.run(
        [str(modern_hostenv_python), "-c",
         "import sys, json; from remote.extract import samples; "
         "print(json.dumps(sorted(samples.present_indices(sys.argv[1], samples.HS))))", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    # 0..3 are whole files (1..3 have bad content, which the run's digest rejects); 4..7 are not whole
    assert json.loads(proc.stdout) == [0, 1, 2, 3]
