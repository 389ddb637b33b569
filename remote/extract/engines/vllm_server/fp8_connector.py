"""specops' fp8 hidden-states connector: quantize on the device, then copy half the bytes to the host.

Loaded by vLLM by name inside the server (never imported by specops itself, so it may import
torch, vLLM and hs-connectors at module level; ``tests/test_remote_stdlib.py`` names it as the
one module of the bundle that is not stdlib-only at import)::

    --kv-transfer-config '{"kv_connector": "SpecopsFP8HiddenStatesConnector",
        "kv_connector_module_path": "remote.extract.engines.vllm_server.fp8_connector", ...}'

hs-connectors 0.9's ``FP8HiddenStatesConnector`` keeps vLLM's copy out of the KV cache (a pinned
device-to-host copy of the bf16 states) and quantizes on the host CPU in its writer thread: the
CPU does the quantization and the host copy moves twice the bytes of the file. On the H200 that
held fp8 extraction to ~0.68 GB/s of states, 0.40 of plain prefill against 0.73 for bf16 (issue 43).

:class:`SpecopsFP8HiddenStatesConnector` changes only ``_submit_async_write``: it gathers the
request's slots from the cache on the cache's device, quantizes them there (one float32 scale per
token: on a GPU with vLLM's fused per-token kernel, one read of the bf16 states and one write of the
fp8 ones; elsewhere with hs-connectors' own ``quantize_tensor_to_fp8`` by token chunks, so the float32
temporary stays small), and copies the fp8 states and their scales to the host; the writer is vLLM's plain
``save_file`` (``ExampleHiddenStatesConnector._write_tensors``). The file holds what the stock fp8
connector writes: the same keys (``hidden_states`` float8_e4m3fn [T, L, H], ``hidden_states_scales``
float32 [T, 1, 1], ``token_ids``), the same per-token scheme (vLLM's kernel and hs-connectors' quantizer agree
within fp8 rounding: GPU round 22), so the trainer's fp8 backend
(``hs_connectors.transfer.FP8Transfer``) reads it. Everything else (lock files, writer pool,
``finished_sending`` bookkeeping, scheduler side) is inherited from the installed classes.

On a CPU host (the test host) the cache's device is the CPU: the same gather-quantize-save path runs
there with no stream and no pinned memory.

The engine loads it only when the installed classes still have what it uses
(:func:`remote.extract.engines.vllm_server.command.specops_fp8_problems`); otherwise it falls back to
hs-connectors' own connector and says so.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from functools import partial

import torch
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (ExampleHiddenStatesConnector,
                                                                                          PendingSave,
                                                                                          extract_from_kv_cache)

#: float32 elements of one quantization chunk (128 MiB): bounds the device's temporary at any length
CHUNK_ELEMENTS = 1 << 25


def quantize_by_tokens(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tensor_to_fp8`` of ``[T, ...]`` states, token chunk by token chunk on their device.

    The scale is per token, so each chunk's result is exactly the whole tensor's rows.
    """
    tokens = hidden_states.shape[0]
    per_token = max(1, hidden_states[0].numel()) if tokens else 1
    step = max(1, CHUNK_ELEMENTS // per_token)
    if tokens <= step:
        return quantize_tensor_to_fp8(hidden_states)
    parts = [quantize_tensor_to_fp8(hidden_states[i:i + step]) for i in range(0, tokens, step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@functools.lru_cache(maxsize=1)
def fused_quantizer():
    """vLLM's CUDA kernel for per-token dynamic fp8 (``scaled_fp8_quant(..., use_per_token_if_dynamic=True)``:
    scale = amax / fp8 max per row, values divided by it), or None where this vLLM build has none. The float32
    path moves ~13x the bytes through the device's memory (an upcast, abs, amax, divide and cast, each a pass),
    on the copy stream beside the model's forward."""
    try:
        from vllm import _custom_ops as ops
        if not hasattr(torch.ops._C, "dynamic_per_token_scaled_fp8_quant"):
            return None
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops.scaled_fp8_quant


def quantize_on_device(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The states ``[T, ...]`` quantized per token on a CUDA device: the fused kernel where vLLM has it (the
    scales shaped ``[T, 1, ...]`` as hs-connectors' are), else :func:`quantize_by_tokens`."""
    quantize = fused_quantizer() if hidden_states.is_cuda and hidden_states.shape[0] else None
    if quantize is None:
        return quantize_by_tokens(hidden_states)
    flat = hidden_states.reshape(hidden_states.shape[0], -1)
    try:
        states, scales = quantize(flat, use_per_token_if_dynamic=True)
    except RuntimeError:  # a build whose kernel refuses this shape or dtype: the float32 path writes the same file
        return quantize_by_tokens(hidden_states)
    return (states.view(hidden_states.shape),
            scales.view(hidden_states.shape[0], *([1] * (hidden_states.dim() - 1))))


class _CopyDone:
    """Stands in for the CUDA event on a CPU host: the copy is done when this object exists."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _sync_allowed():
    """vLLM's guard for a deliberate host-to-device copy (vLLM 0.32; older releases have none)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        return contextlib.nullcontext()
    return gpu_sync_allowed()


class SpecopsFP8HiddenStatesConnector(FP8HiddenStatesConnector):
    """``FP8HiddenStatesConnector``'s file, quantized on the device before the copy to the host."""

    #: the plain save: the states arrive quantized (FP8HiddenStatesConnector's would quantize again)
    _write_tensors = staticmethod(ExampleHiddenStatesConnector._write_tensors)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # rank 0 alone writes, as in the stock connector
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        if self._kv_cache.device.type == "cpu":
            # fresh tensors: the request's blocks may go back to the pool before the writer runs
            states, scales = quantize_by_tokens(extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens))
            done = _CopyDone()
        else:
            states, scales, done = self.quantize_and_copy_on_device(slot_mapping, num_tokens)
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone(), SCALES_KEY: scales}

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def quantize_and_copy_on_device(self, slot_mapping: torch.Tensor, num_tokens: int):
        """Gather, quantize and start the copy to pinned host memory on the connector's copy stream
        (after the model's writes on the default stream); returns the host tensors and the copy's event."""
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            with _sync_allowed():
                slots = slot_mapping.to(device=self._kv_cache.device, non_blocking=True)
            fp8_states, fp8_scales = quantize_on_device(extract_from_kv_cache(self._kv_cache, slots, num_tokens))
            states = torch.empty_like(fp8_states, device="cpu", pin_memory=True)
            states.copy_(fp8_states, non_blocking=True)
            scales = torch.empty_like(fp8_scales, device="cpu", pin_memory=True)
            scales.copy_(fp8_scales, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        return states, scales, done
