"""Test host only: hs-connectors' ``FP8HiddenStatesConnector``, made to run on the CPU build of vLLM.

``FP8HiddenStatesConnector`` (hs-connectors 0.9) subclasses vLLM's
``ExampleHiddenStatesConnector`` and overrides only ``_write_tensors``: it quantizes the
request's ``[T, L, H]`` states to float8_e4m3fn with one float32 scale per token
(``hidden_states_scales`` [T, 1, 1]) before ``save_file``. The copy out of the KV cache
is the stock one, which pins memory and dies on a CPU build (``pin_memory=True requires a
CUDA or other accelerator backend``), as the bf16 path does.

:class:`CpuFP8HiddenStatesConnector` takes the CPU copy of the test host's bf16 connector
(:mod:`cpu_hidden_states_connector`, whose ``_submit_async_write`` hands the tensors to
``self._write_tensors``) and the write of hs-connectors' own class, by inheritance alone::

    CpuFP8HiddenStatesConnector -> CpuHiddenStatesConnector (copy) -> FP8HiddenStatesConnector
        (quantize + save_file) -> ExampleHiddenStatesConnector

so the file is byte for byte what the installed hs-connectors writes (its
``quantize_tensor_to_fp8``, its key names), never a copy of its code that could drift.

Loaded by name, never imported by specops itself::

    --kv-transfer-config '{"kv_connector": "CpuFP8HiddenStatesConnector",
                           "kv_connector_module_path": "_specops_cpu_fp8_hidden_states_connector", ...}'

``specops.testhost.hostenv.make_overlay_env`` copies this file into a test host env
under that module name, beside the bf16 one it imports. A GPU host never gets it.
"""
from __future__ import annotations

from _specops_cpu_hidden_states_connector import CpuHiddenStatesConnector
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector


class CpuFP8HiddenStatesConnector(CpuHiddenStatesConnector, FP8HiddenStatesConnector):
    """The CPU copy of :class:`CpuHiddenStatesConnector`, the fp8 write of ``FP8HiddenStatesConnector``."""
