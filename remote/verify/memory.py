"""What a reference holds: its peak resident memory, measured, and an allocator that gives it back.

:class:`PeakMemory` reads the process's peak RSS from the moment a check starts (Linux), so
``verify.reference`` can report what one decoder layer (or the final norm and ``lm_head``)
really cost against what it should. :func:`warm_up` spends the process's one-time costs (the
thread pool, the BLAS library's packing buffers) before that baseline;
:func:`heap_returns_memory` and :func:`trim_heap` keep freed tensors from staying resident
under the next layer. Stdlib only at import.
"""
from __future__ import annotations

import gc

#: tokens of :func:`warm_up`'s matmuls
WARM_UP_TOKENS = 128


class PeakMemory:
    """This process's peak resident memory from now on, above what it holds now.

    Linux keeps the peak in ``/proc/self/status`` (``VmHWM``) and resets it to the current
    RSS when ``5`` is written to ``/proc/self/clear_refs``; elsewhere the lifetime peak of
    ``getrusage`` is the best there is (then an upper bound that may include earlier work)."""

    def __init__(self):
        self.resettable = False
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.resettable = True
        except OSError:
            pass
        self.start = self.rss()

    @classmethod
    def rss(cls):
        """This process's resident memory now (bytes), or None off Linux."""
        return cls._status("VmRSS")

    @staticmethod
    def _status(key: str):
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def report(self, layer_bytes: int, sample_bytes: int, whole_bytes: int) -> dict:
        import resource

        hwm = self._status("VmHWM") if self.resettable else None
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = self.start or 0
        bound = layer_bytes + sample_bytes
        return {"peak_rss_bytes": hwm - start, "process_peak_rss_bytes": hwm, "start_rss_bytes": start,
                "how": "VmHWM after clear_refs" if self.resettable else "getrusage ru_maxrss (lifetime peak)",
                "layer_fp32_bytes": layer_bytes, "samples_bytes": sample_bytes, "bound_bytes": bound,
                "ratio_to_bound": round((hwm - start) / bound, 3) if bound else None,
                "whole_model_fp32_bytes": whole_bytes, "device": "cpu"}


#: glibc's ``mallopt`` parameter for the size above which an allocation gets its own mapping
M_MMAP_THRESHOLD = -3
#: allocations from this size up get their own mapping (:func:`heap_returns_memory`)
MMAP_THRESHOLD_BYTES = 128 * 1024


def heap_returns_memory() -> bool:
    """Make freed tensors go back to the system (glibc; elsewhere nothing is done, False).

    glibc serves allocations below a threshold that grows with the largest block freed (up to
    32 MiB) from its heap, and a heap fragmented by many such tensors (a MoE layer's experts,
    a few MiB each) keeps their pages after they are freed: measured on a DeepSeek-V3-like
    layer, ~100 MiB of the layer checked before stayed resident under the next one. A fixed
    threshold of 128 KiB maps every tensor on its own and unmaps it when freed; :func:`trim_heap`
    returns what the heap still holds free between layers."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def warm_up(hf_config) -> None:
    """The first matmuls and attention of a process start its thread pool and the BLAS library's
    packing buffers, sized by the matrices they meet (tens of MiB at real widths, kept for the
    process's life): do that before the memory baseline, on the model's own widths (a transient
    weight of its MLP's shape), so the peak above the baseline is the check's own."""
    import torch

    hidden = int(getattr(hf_config, "hidden_size", 64) or 64)
    wide = max(int(getattr(hf_config, name, 0) or 0) for name in ("intermediate_size", "moe_intermediate_size"))
    wide = wide or 4 * hidden
    heads = int(getattr(hf_config, "num_attention_heads", 2) or 2)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(WARM_UP_TOKENS, hidden, dtype=dtype)
            w = torch.randn(wide, hidden, dtype=dtype)
            torch.nn.functional.linear(torch.nn.functional.linear(x, w), w.t()).softmax(-1)
            del w
            q = torch.randn(1, heads, WARM_UP_TOKENS, 64, dtype=dtype)
            mask = torch.zeros(1, 1, WARM_UP_TOKENS, WARM_UP_TOKENS, dtype=dtype)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
