"""A train run on a host with several GPUs starts one trainer per GPU under torchrun, and a failing rank is named.

No GPU here: the launcher's argv (:meth:`remote.train.plan.TrainPlan.launch_argv`) is run by the real
``torch.distributed.run`` of the modern test-host env (torch 2.13) on two CPU processes, with a
two-rank program in the trainer's place (speculators' distributed trainer needs an accelerator:
``No accelerator found``); rank 1 raises. What the supervisor reads back from that log is what it
reads from a real multi-GPU run: which rank failed first, and its own traceback.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.train import plan as trainplan  # noqa: E402
from remote.run.rootcause import last_traceback  # noqa: E402

RANKED = '''
import os, sys, time
rank = int(os.environ["RANK"])
print(f"Training epoch 1 started on rank {rank} of {os.environ['WORLD_SIZE']}", flush=True)
if rank == 1:
    raise RuntimeError("CUDA out of memory on rank 1 (planted)")
time.sleep(1)
'''


def plan(tmp_path) -> trainplan.TrainPlan:
    return trainplan.TrainPlan(
        run_id="t", from_run="x", states_run_dir=str(tmp_path), data_path=str(tmp_path), model_path=str(tmp_path),
        layer_ids=[2, 4, 5, 8], trainer_layer_ids=[2, 4, 5], num_layers=8, state_format="bf16", backend="file",
        total_seq_len=256, samples=4, tokens=1024, sample_range=[0, 4], save_path=str(tmp_path / "ckpt"), epochs=1)


def test_one_device_runs_the_trainer_itself_several_under_torchrun(tmp_path):
    p = plan(tmp_path)
    assert p.launch_argv("py", trainplan.TRAINER_MODULE, 1, tmp_path) == p.argv("py", trainplan.TRAINER_MODULE)
    argv = p.launch_argv("py", trainplan.TRAINER_MODULE, 8, tmp_path / "ranks")
    assert argv[:9] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8", "--log-dir",
                        str(tmp_path / "ranks"), "--tee"]
    assert argv[10:12] == ["-m", "speculators.train"] and argv[12:] == p.argv("py", trainplan.TRAINER_MODULE)[3:]


def test_torchrun_names_the_rank_that_failed(tmp_path, modern_hostenv_python):
    (tmp_path / "ranked_program.py").write_text(RANKED)
    argv = plan(tmp_path).launch_argv(str(modern_hostenv_python), "ranked_program", 2, tmp_path / "ranks")
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert trainplan.failing_rank(log) == 1, log
    found = last_traceback(trainplan.rank_lines(log, 1))
    assert found and found["type"] == "RuntimeError" and "rank 1 (planted)" in found["message"], log
    assert "Training epoch 1 started on rank 0 of 2" in trainplan.rank_lines(log, 0)
    assert list((tmp_path / "ranks").rglob("stdout.log")), "torchrun kept no per-rank log files"
