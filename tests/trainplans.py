"""A ``TrainPlan`` as the unit tests build it: a four-sample bf16 CPU run of the tiny Llama, fields overridable."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.train import plan as trainplan  # noqa: E402


def train_plan(**changes) -> trainplan.TrainPlan:
    fields = dict(run_id="t1", from_run="r1", states_run_dir="/w/runs/r1", data_path="/w/out", model_path="/m/llama",
                  layer_ids=[2, 4, 5, 8], trainer_layer_ids=[2, 4, 5], num_layers=8, state_format="bf16",
                  backend="file", total_seq_len=128, samples=4, tokens=270, sample_range=[0, 4],
                  save_path="/w/runs/t1/checkpoints", epochs=3, device="cpu")
    return trainplan.TrainPlan(**{**fields, **changes})
