"""llama_4_scaling: how the reference applies it where transformers does not, and whether
the run's states show it.

vLLM 0.16 multiplies q (after RoPE) by
``1 + beta * log(1 + floor(pos / original_max_position_embeddings))`` in DeepseekV2
(``_get_llama_4_scaling``), Mistral, GLM-4-MoE-lite and LongCat attention. transformers
4.57's DeepseekV3 does NOT implement it, so its plain forward is not a reference past
that position. When the model's config has the block and the HF modeling module does
not mention it, the reference runs through :meth:`Llama4Scaling.attention`, an attention
function registered with transformers' ``AttentionInterface`` that applies exactly
that formula to the query (float32 positions, the formula of ``_get_llama_4_scaling``)
and then calls SDPA. The report says which reference computed the scaling.

When layers fail on a model with ``llama_4_scaling``, a second reference forward
*without* the scaling tells whether the capture matches that one: then the worker
dropped ``llama_4_scaling`` (:func:`llama4_record`).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from remote.verify.compare import REL_TOL, layer_numbers
from remote.wire import protocol

#: the name the attention function is registered under (one per loaded reference).
LLAMA4_ATTENTION = "specops_llama4_sdpa"


class Llama4Scaling:
    """vLLM's llama_4_scaling as a transformers attention function, for one reference model.

    Each instance registers its own attention function, so two references in one
    process (the fp32 one and the rounding floor's) never share the switch. ``active``
    says whether the function scales: off where transformers applies the scaling itself,
    and off inside :meth:`suspended`.
    """

    def __init__(self, config: dict):
        self.beta = float(config["beta"])
        self.original = float(config["original_max_position_embeddings"])
        self.active = True
        self.name = f"{LLAMA4_ATTENTION}_{id(self):x}"

    def register(self) -> str:
        """Register :meth:`attention` with transformers; returns the ``attn_implementation`` name."""
        from transformers import AttentionInterface

        AttentionInterface.register(self.name, self.attention)
        return self.name

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """SDPA with vLLM's llama_4_scaling applied to the query (while :attr:`active`).

        ``query`` is ``[batch, heads, tokens, head_dim]`` after RoPE, of one unpadded sample: its
        queries are the last of the keys' positions (all of them without a cache).
        """
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.active:
            query = self.scale(query, key.shape[-2] - query.shape[-2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def scale(self, query, first: int = 0):
        """``query`` ``[batch, heads, tokens, head_dim]`` of positions ``first..`` scaled by vLLM's formula."""
        import torch

        positions = torch.arange(first, first + query.shape[-2], device=query.device)
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original))
        return (query * scale[:, None]).to(query.dtype)

    @contextmanager
    def suspended(self):
        """Forwards without the scaling inside the block: the reference a worker that drops it matches."""
        saved, self.active = self.active, False
        try:
            yield
        finally:
            self.active = saved


def scaling_config(text: dict) -> dict | None:
    """The model's ``llama_4_scaling`` block (of its text config), or None."""
    scaling = text.get("llama_4_scaling")
    return scaling if isinstance(scaling, dict) else None


def hf_implements_llama4(model) -> bool:
    """Whether the transformers modeling module of ``model`` handles llama_4_scaling itself."""
    import inspect

    seen = set()
    for module in model.modules():
        mod = sys.modules.get(type(module).__module__)
        if mod is None or mod.__name__ in seen or not mod.__name__.startswith(("transformers", "transformers_modules")):
            continue
        seen.add(mod.__name__)
        try:
            if "llama_4_scaling" in inspect.getsource(mod):
                return True
        except (OSError, TypeError):
            continue
    return False


def llama4_record(reference, records: list[dict], loaded: list, recorder, layer_ids: list[int],
                  expected: dict) -> dict:
    """The ``verify.llama_4_scaling`` record: did the verified samples reach the scaling, and
    when layers fail, does the capture match a forward without it?

    :param reference: the :class:`remote.verify.reference.Reference` the layers were compared with.
    :param loaded: ``(manifest entry, sample)`` of every verified sample.
    """
    scaling = reference.scaling
    original = int(scaling["original_max_position_embeddings"])
    longest = max(len(d["input_ids"]) for _, d in loaded)
    past = sum(max(0, len(d["input_ids"]) - original) for _, d in loaded)
    detail = {"original_max_position_embeddings": original, "beta": scaling["beta"],
              "tokens_past": past, "longest_sample": longest, "applied_by": reference.scaling_by}
    if past == 0:
        return protocol.record("verify.llama_4_scaling", protocol.WARN,
                               f"no verified sample reaches position {original}: llama_4_scaling was not "
                               f"exercised (longest sample {longest} tokens)", detail=detail)
    layer_recs = [r for r in records if r["name"].startswith("verify.layer.")]
    if all(r["status"] == protocol.OK for r in layer_recs):
        return protocol.record("verify.llama_4_scaling", protocol.OK,
                               f"{past} token(s) past position {original} agree with the scaled reference "
                               f"(beta {scaling['beta']})", detail=detail)
    hook = reference.hook
    if hook is None or not hook.active:
        return protocol.record("verify.llama_4_scaling", protocol.SKIPPED,
                               "transformers applies llama_4_scaling itself; no unscaled reference to compare",
                               detail=detail)
    # A second reference without the scaling: which one does the capture match?
    without_s = []
    with hook.suspended():
        for _entry, data in loaded:
            streams = recorder.streams(reference.model, data["input_ids"])
            for lid, captured in zip(layer_ids, data["hidden_states"]):
                without_s.append(layer_numbers(captured, streams[expected[lid]])["nrmse"])
    worst_with = max(r["detail"]["nrmse"] for r in layer_recs)
    worst_without = max(without_s)
    detail.update(nrmse_with_scaling=worst_with, nrmse_without_scaling=worst_without)
    if worst_without <= 0.5 * worst_with and worst_without <= 2 * REL_TOL:
        return protocol.record(
            "verify.llama_4_scaling", protocol.FAIL,
            f"the capture matches a forward WITHOUT llama_4_scaling (nrmse {worst_without:.2%}) and not the "
            f"scaled one ({worst_with:.2%}): the worker drops llama_4_scaling past position {original}",
            detail=detail,
            fix="the worker must pass llama_4_scaling to every decoder layer, computed as the model's own "
                "forward does (patch set fix deepseek-llama4-scaling: specops patch, then specops preflight)")
    return protocol.record("verify.llama_4_scaling", protocol.WARN,
                           f"layers differ, but not because of llama_4_scaling (nrmse {worst_with:.2%} with it, "
                           f"{worst_without:.2%} without)", detail=detail)
