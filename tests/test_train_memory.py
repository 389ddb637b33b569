"""The training preflight's memory estimate (``train.memory``), the memory the trainer really holds
(:mod:`remote.train.memuse`, sampled by the train supervisor) and the host's listing of a draft's files.

Real inputs only: the draft speculators 0.9.0 trained on the modern test host
(``tests/fixtures/train/tiny_llama_draft/``: its ``config.json`` and the header of its
``model.safetensors``, every tensor's shape, as the trainer wrote them), real-sized target
configs (:mod:`specops.testhost.reference_models`), what nvidia-smi printed on the lent H200
(``tests/fixtures/gpu/env/gpus.csv``, ``tests/fixtures/nvidia-smi/gpus_busy.csv`` and
``apps_busy.csv``: a torch process holding 4 GiB), this machine's own ``/proc/meminfo`` and this
test's own child processes (the sampler reads their ``/proc``). The real trainer's measured peak
is asserted where a real training run ends (``tests/test_train_fp8.py``).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from remote.train import memuse, task as train, memory as trainmem
from remote.system import devices, procscan
from remote.wire import words
from specops.testhost.reference_models import DEEPSEEK_V3_LIKE, KIMI_K25_LIKE, LLAMA_LIKE

FIX = Path(__file__).parent / "fixtures"
DRAFT = FIX / "train" / "tiny_llama_draft"
GiB = 1024 ** 3


def _h200(name="gpu/env/gpus.csv") -> list:
    return devices.parse_gpus((FIX / name).read_text())


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
        total = devices.parse_meminfo(fh.read())["MemTotal"]
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

    from remote.wire import fsutil

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
    from remote.train.plan import TrainPlan

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


def test_the_run_measures_against_the_preflights_own_estimate(tmp_path):
    """The supervisor's ``estimate_bytes`` is :func:`remote.train.memory.plan_estimate`, which ``train.memory`` reports."""
    (tmp_path / "out").mkdir()
    plan = _plan(tmp_path, ["--total-seq-len", "4096"])
    est, ignored = trainmem.plan_estimate(plan, LLAMA_LIKE)
    assert est["need_bytes"] == trainmem.check(plan, LLAMA_LIKE)["detail"]["need_bytes"] and ignored is None


#: what the grandchild allocates (and writes to, so that it is resident), then frees before it says it is ready
ALLOC = 200 * 2 ** 20
def _tree(tmp_path):
    """A real child and grandchild: (child Popen, grandchild pid) once the grandchild held ALLOC and let it go."""
    script = tmp_path / "tree.py"
    ready = tmp_path / "grandchild.pid"
    script.write_text(f"""import subprocess, sys, time, os
if len(sys.argv) > 2:
    held = bytearray(b"x") * {ALLOC}
    del held  # gone from VmRSS; VmHWM, the process's own peak, keeps it
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
else:
    subprocess.Popen([sys.executable, __file__, sys.argv[1], "grandchild"])
time.sleep(600)
""")
    child = subprocess.Popen([sys.executable, str(script), str(ready)])
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert child.poll() is None and time.monotonic() < deadline, "the grandchild never got ready"
        time.sleep(0.05)
    return child, int(ready.read_text())


def test_the_sampler_walks_the_trainers_tree_and_keeps_a_peak_between_samples(tmp_path):
    child, grandchild = _tree(tmp_path)
    try:
        tree = procscan.process_tree(child.pid)
        assert tree[0] == child.pid and grandchild in tree and set(tree) == {child.pid, grandchild}, tree
        assert procscan.process_tree(grandchild) == [grandchild]
        sampler = memuse.MemorySampler(child.pid, estimate_bytes=2 * ALLOC)
        assert sampler.sample() is True  # the first sample: the peak grew from nothing
        memory = sampler.as_dict()
        # freed before the first sample, the grandchild's 200 MiB is still its VmHWM: the peak covers it
        assert sampler.hwm[grandchild] >= ALLOC and memory["peak_bytes"] >= ALLOC, memory
        assert memory["where"] == "RAM" and memory["source"] == "/proc VmRSS/VmHWM" and memory["samples"] == 1
        assert memory["processes"] == 2 and memory["estimate_bytes"] == 2 * ALLOC
        assert memory["peak_over_estimate"] == round(memory["peak_bytes"] / (2 * ALLOC), 3)
        # on its daemon thread: the peak handed to on_update as it grows, and final at stop()
        updates = []
        running = memuse.MemorySampler(child.pid, on_update=updates.append, every_s=0.05).start()
        deadline = time.monotonic() + 120
        while not updates:
            assert time.monotonic() < deadline, "the sampler never reported"
            time.sleep(0.05)
        final = running.stop()
        assert final["samples"] >= 1 and final["peak_bytes"] >= ALLOC and updates[0]["peak_bytes"] >= ALLOC
        assert final["peak_over_estimate"] is None and "why" not in final
    finally:
        for pid in (grandchild, child.pid):
            os.kill(pid, 9)
        child.wait()
    # the trainer gone: nothing held, nothing raised
    gone = memuse.MemorySampler(child.pid)
    assert gone.sample() is False and gone.as_dict()["peak_bytes"] == 0


def test_sampling_that_breaks_ends_with_why_and_never_raises(tmp_path):
    """A CUDA run whose nvidia-smi cannot run: the sampling stops and says why; the run goes on."""
    missing = str(tmp_path / "nvidia-smi")
    sampler = memuse.MemorySampler(os.getpid(), estimate_bytes=GiB, smi=missing, where="GPU 0 (NVIDIA H200)")
    final = sampler.start().stop()
    assert final["samples"] == 0 and final["peak_bytes"] == 0 and "nvidia-smi" in final["why"], final
    assert final["where"] == "GPU 0 (NVIDIA H200)" and final["source"] == "nvidia-smi --query-compute-apps"
    assert words.usage_line(final).startswith("memory not measured (GPU 0 (NVIDIA H200)): RuntimeError: nvidia-smi")


def test_the_gpu_memory_of_the_trainers_pids_from_what_nvidia_smi_printed_on_the_h200():
    """``--query-compute-apps`` as the lent H200 printed it: idle (nothing) and with a torch process holding
    4 GiB (pid 429: 4614 MiB, its CUDA context included); only the tree's pids count."""
    assert devices.parse_apps((FIX / "gpu/env/apps.csv").read_text()) == []
    assert memuse.gpu_use([], [429]) == {}
    apps = devices.parse_apps((FIX / "nvidia-smi/apps_busy.csv").read_text())
    assert apps == [{"gpu_uuid": "GPU-7aed90a3-46c5-b801-8988-afc1a8581ad2", "pid": 429, "used_memory_mib": 4614,
                     "process_name": "python3"}]
    gpus = _h200("nvidia-smi/gpus_busy.csv")
    assert memuse.gpu_use(apps, [428, 429], gpus) == {0: 4614 * 2 ** 20}
    assert memuse.gpu_use(apps, [430], gpus) == {}
    # a GPU nvidia-smi's --query-gpu did not list is named by its UUID rather than dropped
    assert memuse.gpu_use(apps, [429]) == {"GPU-7aed90a3-46c5-b801-8988-afc1a8581ad2": 4614 * 2 ** 20}


def test_the_measured_peak_in_words_in_the_train_run_record_and_the_status(tmp_path):
    from remote.run import job
    from specops.result import RunStatus
    from specops.train import progress_line, run_record

    gpu = {"where": "GPU 0 (NVIDIA H200)", "source": memuse.GPU_SOURCE, "peak_bytes": int(4.8 * GiB),
           "estimate_bytes": int(5.5 * GiB), "peak_over_estimate": words.ratio(int(4.8 * GiB), int(5.5 * GiB)),
           "samples": 300}
    assert gpu["peak_over_estimate"] == 0.873
    line = "peak 4.8 GiB on GPU 0 (NVIDIA H200), 0.87x the 5.5 GiB estimated"
    assert words.usage_line(gpu) == line
    ram = {"where": "RAM", "peak_bytes": 706105344, "estimate_bytes": None, "peak_over_estimate": None}
    assert words.usage_line(ram) == "peak 673.4 MiB in RAM (no estimate to compare with)"
    assert words.usage_line({**gpu, "why": "RuntimeError: nvidia-smi: x"}).endswith(
        "estimated (sampling stopped early: RuntimeError: nvidia-smi: x)")
    assert words.usage_line(None) is None
    status = {"run_id": "d1", "kind": "train", "state": "done", "step": 90, "epoch": 19, "loss": 0.009,
              "accuracy": [0.46], "checkpoint": {"path": "/w/ckpt/19"}, "memory": gpu}
    rec = run_record("d1", RunStatus(**status))
    assert rec.summary.endswith(f"checkpoint /w/ckpt/19; {line}") and rec.detail["memory"] == gpu, rec
    failed = run_record("d1", RunStatus(**{**status, "state": "failed", "error": {"type": "OutOfMemoryError",
                                                                                   "message": "CUDA out of memory"}}))
    assert failed.summary == f"run d1 failed: OutOfMemoryError: CUDA out of memory; {line}"
    assert run_record("d1", RunStatus(**{k: v for k, v in status.items() if k != "memory"})).summary.endswith("/19")
    # specops status of a train run (the host's job.status record) and the follow's progress line: the peak so far
    running = {**status, "state": "training", "samples_done": 40, "samples_total": 90}
    payload = job._status_payload("job.status", "d1", tmp_path, running)
    assert payload["records"][0]["summary"] == f"run d1 training: 40/90 samples; {line}", payload["records"]
    assert progress_line("h", running).plain.endswith("peak 4.8 GiB (0.87x est.)")
    # a phase or host name holding brackets is printed as written, never read as rich markup
    odd = progress_line("[/x]host", {"state": "running", "phase": "loading [bold]shard[/bold] 2"})
    assert odd.plain == "[/x]host  running  loading [bold]shard[/bold] 2"
