"""``specops fetch --run-id T --tensors`` of a train run, over SSH against the test host, without training.

The run dir is laid out as a finished train run leaves it (``status.json`` of kind ``train``,
``metrics.jsonl``, ``checkpoints/<epoch>/`` with speculators' files and its ``checkpoint_best``
link; the draft's ``config.json`` is the one speculators 0.9.0 wrote on the modern test host);
the weights are random bytes, which is all a download and its hash care about. The heavy test
(``tests/test_train_eval.py``) fetches a really trained draft and serves a copy of it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRAFT = REPO / "tests" / "fixtures" / "train" / "tiny_llama_draft"


def _specops(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "specops"), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300,
                          env={**os.environ, "COLUMNS": "250", **env})


def _tensors(inv, env, code=0) -> dict:
    proc = _specops("fetch", "--inventory", inv, "--run-id", "d1", "--tensors", "--json", env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    recs = {r["name"]: r for h in json.loads(proc.stdout)["hosts"] for r in h["records"]}
    return recs["fetch.tensors"]


def _train_run(work: Path, *, with_checkpoint: bool = True) -> Path:
    run_dir = work / "runs" / "d1"
    save = run_dir / "checkpoints"
    for epoch in (0, 1):
        ckpt = save / str(epoch)
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text((DRAFT / "config.json").read_text())
        (ckpt / "config.py").write_text("# speculators' config class, as it saves it beside config.json\n")
        (ckpt / "model.safetensors").write_bytes(os.urandom(3 << 20))  # more than one read of the download loop
        (ckpt / "optimizer_state_dict.pt").write_bytes(os.urandom(1 << 20))
        (ckpt / "training_state.json").write_text(json.dumps({"epoch": epoch, "global_step": 2 * epoch + 1}))
    (save / "checkpoint_best").symlink_to("1")
    rows = [{"kind": "train", "epoch": 0, "step": 0, "loss": 2.0, "accuracy": [0.1]},
            {"kind": "val", "epoch": 0, "loss": 1.5, "accuracy": [0.2]},
            {"kind": "train", "epoch": 1, "step": 1, "loss": 1.0, "accuracy": [0.3]},
            {"kind": "val", "epoch": 1, "loss": 0.5, "accuracy": [0.4]}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = {"run_id": "d1", "kind": "train", "state": "done", "checkpoints": str(save), "step": 1, "epoch": 1}
    if with_checkpoint:
        status["checkpoint"] = {"path": str(save / "1"), "epoch": 1, "global_step": 3}
    (run_dir / "status.json").write_text(json.dumps(status))
    return save


def test_the_best_draft_comes_whole_is_kept_when_there_and_a_junk_part_is_not_taken_for_it(make_inventory,
                                                                                            tmp_path):
    inv, env = make_inventory(), {"SPECOPS_RUNS": str(tmp_path / "runs")}
    save = _train_run(tmp_path / "work")
    best = tmp_path / "runs" / "th" / "d1" / "best"
    rec = _tensors(inv, env)
    assert rec["status"] == "ok" and "blake3 checked" in rec["summary"] and rec["detail"]["host_dir"] == str((save / "1").resolve()), rec
    assert sorted(rec["detail"]["downloaded"]) == ["config.py", "model.safetensors"] and rec["detail"]["kept"] == [
        "config.json"], rec  # config.json came with the checkpoint's config, before --tensors
    assert [p.name for p in sorted(best.iterdir())] == ["config.json", "config.py", "model.safetensors",
                                                        "training_state.json"]  # no optimizer state
    assert (best / "model.safetensors").read_bytes() == (save / "1" / "model.safetensors").read_bytes()
    serve = json.loads(rec["detail"]["serve"].split("--speculative-config ")[1].strip("'"))
    assert serve == {"method": "eagle3", "model": str(best.resolve()), "num_speculative_tokens": 3}

    # again: every file is there with its hash, nothing moves
    inode = (best / "model.safetensors").stat().st_ino
    again = _tensors(inv, env)
    assert again["detail"]["downloaded"] == [] and (best / "model.safetensors").stat().st_ino == inode, again

    # a .part that is not a prefix of the file (junk of a former download): resumed, fails its check, fetched whole
    (best / "model.safetensors").unlink()
    (best / "model.safetensors.part").write_bytes(os.urandom(1 << 20))
    junk = _tensors(inv, env)
    assert junk["detail"]["resumed"] == 1 and junk["detail"]["downloaded"] == ["model.safetensors"], junk
    assert (best / "model.safetensors").read_bytes() == (save / "1" / "model.safetensors").read_bytes()
    assert not (best / "model.safetensors.part").exists()

    # the best checkpoint moves to another epoch: its weights replace the former ones
    (save / "checkpoint_best").unlink()
    (save / "checkpoint_best").symlink_to("0")
    moved = _tensors(inv, env)
    assert moved["detail"]["host_dir"] == str((save / "0").resolve()) and moved["detail"]["downloaded"] == [
        "model.safetensors"], moved
    assert (best / "model.safetensors").read_bytes() == (save / "0" / "model.safetensors").read_bytes()


def test_a_train_run_without_a_checkpoint_yet_fails_with_when_to_fetch_again(make_inventory, tmp_path):
    inv, env = make_inventory(), {"SPECOPS_RUNS": str(tmp_path / "runs")}
    save = _train_run(tmp_path / "work", with_checkpoint=False)
    (save / "checkpoint_best").unlink()
    for epoch in (0, 1):  # nothing saved yet (epoch dirs that exist are fetched: the test below)
        shutil.rmtree(save / str(epoch))
    rec = _tensors(inv, env, code=1)
    assert rec["status"] == "fail" and "has no checkpoint yet" in rec["summary"], rec
    assert "specops status --run-id d1" in rec["fix"]


def test_during_training_fetch_tensors_brings_the_newest_epoch_checkpoint_saved_so_far(make_inventory, tmp_path):
    """Issue 38: while the run trains its status has no final checkpoint, yet epoch checkpoints exist."""
    inv, env = make_inventory(), {"SPECOPS_RUNS": str(tmp_path / "runs")}
    save = _train_run(tmp_path / "work", with_checkpoint=False)
    (save / "checkpoint_best").unlink()
    status_path = save.parent / "status.json"
    status = json.loads(status_path.read_text())
    status_path.write_text(json.dumps({**status, "state": "training", "epoch": 2}))  # epoch 2 is being trained
    rec = _tensors(inv, env)
    assert rec["status"] == "ok" and rec["detail"]["host_dir"] == str((save / "1").resolve()), rec
    assert "epoch 1's checkpoint, the newest so far" in rec["summary"], rec["summary"]


def test_eval_refuses_a_draft_config_that_is_no_object_and_a_dir_without_weights_before_any_load(make_inventory,
                                                                                                  tmp_path):
    """Issue 38: a config.json holding a list crashed eval; a dir without weights loaded the target first."""
    inv, env = make_inventory(), {"SPECOPS_RUNS": str(tmp_path / "runs")}
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    (listed / "model.safetensors").write_bytes(b"x")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((DRAFT / "config.json").read_text())
    for draft, says in ((listed, "holds a JSON list, not the object"), (bare, "holds no draft weights")):
        proc = _specops("eval", "--inventory", inv, "--draft", draft, "--from-run", "r1", "--json", env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        recs = {r["name"]: r for h in json.loads(proc.stdout)["hosts"] for r in h["records"]}
        rec = recs["eval.draft"]
        assert rec["status"] == "fail" and says in rec["summary"] and str(draft) in rec["summary"], rec
        assert rec["fix"] and "eval.server" not in recs, recs
