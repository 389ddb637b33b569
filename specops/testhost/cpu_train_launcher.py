"""speculators' trainer on a CPU-only host: ``python -m _specops_cpu_train_launcher <train flags>``.

Test hosts only (the test host's overlay env carries this file as the module
``_specops_cpu_train_launcher``; a GPU host never gets it). speculators 0.9.0's trainer
assumes an accelerator in five places, each patched here before the same
``main(TrainConfig.resolve())`` that ``python -m speculators.train`` runs:

* ``speculators.train.trainer.get_local_rank`` is the device the model moves to: "cpu";
* ``Trainer.device_type`` falls back to "cuda" when torch has no accelerator (the
  autocast and the batches' device): "cpu";
* ``torch.accelerator.synchronize`` (the step timer) has no device to wait for: a no-op;
* ``speculators.train.checkpointer.get_current_device`` (where a resumed checkpoint is read
  to) says "cuda:0" without an accelerator, and safetensors then asks for pinned memory:
  "cpu".

* ``speculators.train.distributed.maybe_setup_distributed`` (under torchrun) asks the accelerator for
  its device and backend ("No accelerator found" on a CPU host): here it joins the process group
  with gloo, torch's CPU backend, and fills the same module state (ranks, world, SP/DP groups).

``SPECOPS_BATCH_DELAY_S`` in the run's env (a test's fault point, :mod:`remote.run.faults`)
pauses after every optimizer step, so a test can act mid-training on a fast machine.
"""
import os
import time

import speculators.train.checkpointer as _checkpointer
import speculators.train.cli as _cli
import speculators.train.distributed as _distributed
import speculators.train.trainer as _trainer
import torch
from speculators.train.cli import main
from speculators.train.config import TrainConfig
from torch.optim.optimizer import register_optimizer_step_post_hook

_trainer.get_local_rank = lambda: "cpu"
_checkpointer.get_current_device = lambda: "cpu"
_setup_model = _trainer.Trainer.setup_model


def _setup_model_on_cpu(self, *args, **kwargs):
    self.device_type = "cpu"
    return _setup_model(self, *args, **kwargs)


_trainer.Trainer.setup_model = _setup_model_on_cpu
torch.accelerator.synchronize = lambda *args, **kwargs: None
_setup_distributed = _distributed.maybe_setup_distributed


def _setup_distributed_on_cpu(sp_size: int = 1) -> None:
    if "LOCAL_RANK" not in os.environ:  # one process: nothing to join
        return _setup_distributed(sp_size)
    torch.distributed.init_process_group("gloo")
    _distributed._local_rank = int(os.environ["LOCAL_RANK"])
    _distributed._is_distributed = True
    _distributed._rank = torch.distributed.get_rank()
    _distributed._world_size = torch.distributed.get_world_size()
    _distributed._init_sp_process_groups(_distributed._rank, _distributed._world_size, sp_size)
    print(f"[cpu launcher] rank {_distributed._rank} of {_distributed._world_size} joined (gloo)", flush=True)


_distributed.maybe_setup_distributed = _cli.maybe_setup_distributed = _setup_distributed_on_cpu

_step_delay_s = float(os.environ.get("SPECOPS_BATCH_DELAY_S") or 0)
if _step_delay_s:
    register_optimizer_step_post_hook(lambda *args: time.sleep(_step_delay_s))

if __name__ == "__main__":
    main(TrainConfig.resolve())
