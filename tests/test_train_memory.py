"""The training preflight's memory estimate (``train.memory``) and the host's listing of a draft's files.

Real inputs only: the draft speculators 0.9.0 trained on the modern test host
(``tests/fixtures/train/tiny_llama_draft/``: its ``config.json`` and the header of its
``model.safetensors``, every tensor's shape, as the trainer wrote them), real-sized target
configs (:mod:`specops.testhost.reference_models`), what nvidia-smi printed on the lent H200
(``tests/fixtures/gpu/env/gpus.csv``, ``tests/fixtures/nvidia-smi/gpus_busy.csv``) and this
machine's own ``/proc/meminfo``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from remote import train, trainmem
from remote.probes import host
from specops.testhost.reference_models import DEEPSEEK_V3_LIKE, KIMI_K25_LIKE, LLAMA_LIKE

FIX = Path(__file__).parent / "fixtures"
DRAFT = FIX / "train" / "tiny_llama_draft"
GiB = 1024 ** 3


def _h200(name="gpu/env/gpus.csv") -> list:
    return host.parse_gpus((FIX / name).read_text())


def test_the_parameter_count_is_the_trained_drafts_own():
    """Every tensor the trainer saved, counted from the checkpoint's header: the estimate's params minus
    the two it does not save (``verifier_lm_head``, ``verifier_norm``: ``_keys_to_ignore_on_save``)."""
    config = json.loads((DRAFT / "config.json").read_text())
    header = json.loads((DRAFT / "model.safetensors.header.json").read_text())
    saved = sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__" and k not in ("t2d", "d2t"))
    shape = trainmem.draft_shape(config)
    assert shape == {"hidden": 256, "vocab": 512, "draft_vocab": 512, "heads": 4, "kv_heads": 2, "head_dim": 64,
                     "intermediate": 512, "num_layers": 1, "num_aux": 3}
    p = trainmem.parameters(shape)
    assert p["trainable"] + p["frozen"] - shape["hidden"] * shape["draft_vocab"] - shape["hidden"] == saved == 1181440
    # the draft built from its target's config (what the preflight sees before any draft exists) is the same
    target = dict(config["transformer_layer_config"], num_hidden_layers=8)
    assert trainmem.draft_shape(target) == shape


def test_real_sized_targets_and_what_grows_with_the_vocab_and_the_sequence():
    llama = trainmem.estimate(LLAMA_LIKE, total_seq_len=8192)
    assert llama["params"]["trainable"] == 293_629_952  # fc 3h*h, one layer over 2h, norms
    assert llama["params"]["frozen"] == 3 * 128256 * 4096 + 4096  # embed_tokens, lm_head, verifier_lm_head, norm
    parts = llama["parts"]
    assert parts["grads"] == 4 * llama["params"]["trainable"]
    assert parts["optimizer"] == 2 * parts["grads"]
    assert parts["weights"] == 4 * (llama["params"]["trainable"] + llama["params"]["frozen"])
    # the logits over the full vocabulary dominate at 8192 tokens; a 32k draft vocab takes them down 4x
    small = trainmem.estimate(LLAMA_LIKE, total_seq_len=8192, draft_vocab_size=32000)
    assert llama["activations"]["logits"] > 5 * llama["activations"]["layers"]
    assert small["activations"]["logits"] * 4 <= llama["activations"]["logits"] < small["activations"]["logits"] * 4.1
    assert small["params"]["buffer_bytes"] == 128256 + 8 * 32000  # t2d bool, d2t int64
    assert trainmem.estimate(LLAMA_LIKE, total_seq_len=2048)["need_bytes"] < llama["need_bytes"]
    # a wrapped multimodal target (Kimi-K2.5) is sized from its text_config; MLA's head_dim is the rope dim
    kimi = trainmem.draft_shape(KIMI_K25_LIKE)
    assert (kimi["hidden"], kimi["vocab"], kimi["heads"], kimi["head_dim"]) == (7168, 129280, 64, 64)
    assert trainmem.draft_shape(DEEPSEEK_V3_LIKE)["intermediate"] == 18432  # its dense layers' width


def test_on_the_h200_a_llama_draft_fits_and_kimis_at_32k_tokens_does_not():
    free = trainmem.free_memory("cuda", {}, gpus=_h200())
    assert free["where"] == "GPU 0 (NVIDIA H200)" and free["free_bytes"] == 143156 * 2 ** 20
    ok = trainmem.judge(trainmem.estimate(LLAMA_LIKE, total_seq_len=8192), free)
    assert ok["status"] == "ok" and "GPU 0 (NVIDIA H200) has 139.8 GiB free" in ok["summary"], ok
    assert ok["detail"]["need_bytes"] < 0.9 * free["free_bytes"]
    bad = trainmem.judge(trainmem.estimate(KIMI_K25_LIKE, total_seq_len=32768), free)
    assert bad["status"] == "fail" and "short" in bad["summary"], bad
    assert "--draft-vocab-size" in bad["fix"] and "seq_len" in bad["fix"] and "more free memory" in bad["fix"]
    # within HEADROOM of what is free (another process holds 4.5 GiB of the busy fixture's GPU): a warn
    busy = trainmem.free_memory("cuda", {}, gpus=_h200("nvidia-smi/gpus_busy.csv"))
    assert busy["free_bytes"] == 138534 * 2 ** 20
    statuses = {}
    for tokens in range(8192, 32768, 256):
        rec = trainmem.judge(trainmem.estimate(LLAMA_LIKE, total_seq_len=tokens), busy)
        statuses.setdefault(rec["status"], rec)
    assert set(statuses) == {"ok", "warn", "fail"}, sorted(statuses)
    warn = statuses["warn"]
    assert "to spare, under 10%" in warn["summary"] and warn["fix"], warn


def test_cuda_visible_devices_picks_the_gpu_and_none_visible_is_unknown_not_ok():
    gpus = _h200()
    assert trainmem.free_memory("cuda", {"CUDA_VISIBLE_DEVICES": "0"}, gpus=gpus)["free_bytes"] == 143156 * 2 ** 20
    hidden = trainmem.free_memory("cuda", {"CUDA_VISIBLE_DEVICES": "1"}, gpus=gpus)
    assert "free_bytes" not in hidden and "no visible GPU" in hidden["why"]
    rec = trainmem.judge(trainmem.estimate(LLAMA_LIKE, total_seq_len=8192), hidden)
    assert rec["status"] == "skipped" and "free memory unknown" in rec["summary"]


def test_on_a_cpu_host_the_ram_available_is_what_it_is_compared_with():
    free = trainmem.free_memory("cpu")
    with open("/proc/meminfo") as fh:
        total = host.parse_meminfo(fh.read())["MemTotal"]
    assert free["where"] == "RAM (MemAvailable)" and 0 < free["free_bytes"] <= free["total_bytes"] == total
    config = json.loads((DRAFT / "config.json").read_text())
    est = trainmem.estimate(config, total_seq_len=128, device="cpu")
    assert est["activations"]["mask"] == 128 * 128 * 3  # sdpa on a CPU: a dense mask per TTT step
    assert trainmem.judge(est, free)["status"] == "ok"


def test_trainer_flags_given_as_extra_args_are_what_is_sized():
    args = ["--draft-vocab-size", "32000", "--total-seq-len=4096", "--ttt-steps", "x"]
    assert trainmem.flag_value(args, "--draft-vocab-size") == 32000
    assert trainmem.flag_value(args, "--total-seq-len") == 4096
    assert trainmem.flag_value(args, "--ttt-steps") is None and trainmem.flag_value(args, "--num-layers") is None


def _checkpoints(tmp_path) -> Path:
    save = tmp_path / "w" / "runs" / "t1" / "checkpoints"
    (save / "0").mkdir(parents=True)
    (save / "0" / "config.json").write_text((DRAFT / "config.json").read_text())
    (save / "0" / "model.safetensors").write_bytes(os.urandom(4096))
    (save / "0" / "optimizer_state_dict.pt").write_bytes(b"x" * 100)
    (save / "checkpoint_best").symlink_to("0")
    return save


def test_the_host_lists_a_drafts_files_with_sha256_through_the_best_link(tmp_path):
    import hashlib

    from remote import fsutil

    def digest(data: bytes) -> dict:  # computed apart from the host's helper, in the manifest's hash
        if fsutil.default_hash() == "blake3":
            import blake3

            return {"blake3": blake3.blake3(data).hexdigest()}
        return {"sha256": hashlib.sha256(data).hexdigest()}

    save = _checkpoints(tmp_path)
    out = train.main({"action": "files", "run_id": "t1", "work_dir": str(tmp_path / "w"),
                      "checkpoint": str(save / "checkpoint_best")})
    assert out["records"][0]["status"] == "ok", out
    assert out["data"]["dir"] == str((save / "0").resolve())
    assert out["data"]["files"] == [
        {"path": name, "bytes": (save / "0" / name).stat().st_size, **digest((save / "0" / name).read_bytes())}
        for name in ("config.json", "model.safetensors")]  # no optimizer state: a draft dir serves without it


def test_the_host_refuses_a_dir_outside_the_run_and_a_dir_without_weights(tmp_path):
    save = _checkpoints(tmp_path)
    outside = train.main({"action": "files", "run_id": "t1", "work_dir": str(tmp_path / "w"),
                          "checkpoint": str(tmp_path)})
    assert outside["records"][0]["status"] == "fail" and "not inside run t1's save path" in \
        outside["records"][0]["summary"]
    (save / "escape").symlink_to(tmp_path)
    assert train.main({"action": "files", "run_id": "t1", "work_dir": str(tmp_path / "w"),
                       "checkpoint": "escape"})["records"][0]["status"] == "fail"
    (save / "0" / "model.safetensors").unlink()
    empty = train.main({"action": "files", "run_id": "t1", "work_dir": str(tmp_path / "w"), "checkpoint": "0"})
    assert empty["records"][0]["status"] == "fail" and "holds no draft" in empty["records"][0]["summary"]
    # check and start still need the states run
    refused = train.main({"action": "check", "run_id": "t1", "work_dir": str(tmp_path / "w")})
    assert refused["records"][0]["name"] == "train.params" and "from_run" in refused["records"][0]["summary"]


def _plan(tmp_path, extra_args, device="cpu"):
    from remote.trainplan import TrainPlan

    return TrainPlan(run_id="t1", from_run="r1", states_run_dir=str(tmp_path / "r1"), data_path=str(tmp_path / "out"),
                     model_path=str(tmp_path / "model"), layer_ids=[2, 16, 29, 32], trainer_layer_ids=[2, 16, 29],
                     num_layers=32, state_format="bf16", backend="file", total_seq_len=2048, samples=4, tokens=8192,
                     sample_range=[0, 4], save_path=str(tmp_path / "ckpt"), epochs=1, device=device,
                     extra_args=extra_args)


def test_a_draft_vocab_size_without_vocab_maps_is_sized_as_the_full_vocab_speculators_then_trains(tmp_path):
    """speculators 0.9 warns and trains over the full vocab when --draft-vocab-size finds no maps to build from."""
    (tmp_path / "out").mkdir()
    plan = _plan(tmp_path, ["--draft-vocab-size", "32000", "--total-seq-len", "4096"])
    rec = trainmem.check(plan, LLAMA_LIKE)
    assert rec["detail"]["shape"]["draft_vocab"] == 128256 and rec["detail"]["total_seq_len"] == 4096
    assert "no d2t-32000.npy/t2d-32000.npy or token_freq.pt" in rec["detail"]["draft_vocab_ignored"]
    assert rec["detail"]["free"]["where"] == "RAM (MemAvailable)"
    import numpy as np

    # the maps as speculators caches them beside the data: t2d a mask over the target vocab, d2t the offsets
    t2d = np.zeros(128256, dtype=bool)
    t2d[:32000] = True
    np.save(tmp_path / "out" / "t2d-32000.npy", t2d)
    np.save(tmp_path / "out" / "d2t-32000.npy", np.zeros(32000, dtype=np.int64))
    rec = trainmem.check(plan, LLAMA_LIKE)
    assert rec["detail"]["shape"]["draft_vocab"] == 32000 and "draft_vocab_ignored" not in rec["detail"]
    assert trainmem.check(_plan(tmp_path, ["--draft-vocab-size=32000", "--token-freq-path", "/x.pt"]),
                          LLAMA_LIKE)["detail"]["shape"]["draft_vocab"] == 32000
