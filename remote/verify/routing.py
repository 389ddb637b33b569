"""MoE routing: where a router's near-tie lets a bf16 engine and the fp32 reference pick
different experts, recompute the token with the engine's choice instead of failing it.

DeepSeek-V3-style group-limited routers (which Kimi-K2/K2.5 use too; transformers 4
picks experts in ``get_topk_indices``, transformers 5 in the router's ``forward``, and
:class:`RouterControl` hooks either). A router picks the best experts by score; when
two candidates score within bf16 rounding of each other, a bf16 engine and the fp32
reference can pick different ones, and that token's state then differs by 10-40 % from
that layer on -- with both sides right. On the test host's tiny DeepSeek-V3 (random
router, no margins) this hits 20 of 232 tokens on a 2-core AMD EPYC (AVX2 kernels):
before this check, layer 7 read "DIFFERS, nrmse 7.57 %, cosine min 0.949, 203/232
tokens agree", and which tokens flip depends on the machine's GEMM kernels (ISA,
library), so the verdict did too. Now the reference records, per router and token, its
choice, the runner-up choices, and each gap against what the engine's own measured
error (``epsilon``, the median per-token error) and bf16 rounding of the logits can
move it (``RouterDecisions.z``). Layer by layer, a token that disagrees at the next
captured layer and sits within ``NEAR_TIE_SIGMAS`` of a tie is recomputed with the
runner-up choice, kept when that brings it back to bf16 noise (:func:`match_routing`).
Layer records then count agreement against the engine-matched reference (the raw
numbers stay in ``detail.raw``), and ``verify.routing`` lists every token that took
another expert: layer, token, both choices, score gap, sigmas. On that run: 232/232
agree, nrmse 0.78-0.94 %, cosine >= 0.99995. Only near-ties are ever tried, so a wrong
extraction (a dropped scaling, a shifted layer, a kernel that routes wrongly) still
fails.
"""
from __future__ import annotations

from remote.verify.compare import BF16_REL, REL_TOL, token_errors
from remote.wire import protocol

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

    @classmethod
    def joined(cls, parts: list) -> "RouterDecisions":
        """The decisions of consecutive token chunks of one forward as one (tokens in order)."""
        import torch

        if len(parts) == 1:
            return parts[0]
        whole = cls.__new__(cls)
        for name in ("natural", "own", "readable"):
            setattr(whole, name, torch.cat([getattr(p, name) for p in parts]))
        whole.options = {kind: (torch.cat([p.options[kind][0] for p in parts]),
                                [tuple(torch.cat([p.options[kind][1][i][n] for p in parts]) for n in range(3))
                                 for i in range(len(parts[0].options[kind][1]))])
                         for kind in parts[0].options}
        return whole

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
    exactly as the router gathers them for its own choice). A forward that runs a layer on
    chunks of tokens (:func:`remote.verify.layerload.forward`) calls its router once per chunk:
    the chunk's first position (the layer's ``position_ids``) places its tokens, and a chunk
    at position 0 starts a new forward.
    """

    def __init__(self, layers):
        self.routers, self.specs, self.decisions, self.forced, self._inputs = {}, {}, {}, {}, {}
        #: layer -> the first position of the tokens its router sees now; the chunks of this forward
        self._first, self._parts = {}, {}
        self._hooks = []
        for index, layer in enumerate(layers):
            router = next((m for m in layer.modules() if is_group_topk_router(m)), None)
            if router is None:
                continue
            self.routers[index] = router
            self.specs[index] = spec = router_spec(router)
            self._hooks.append(router.register_forward_pre_hook(self._keep_input(index)))
            self._hooks.append(layer.register_forward_pre_hook(self._keep_position(index), with_kwargs=True))
            if spec["hook"] == "topk":
                router.get_topk_indices = self._wrap(index, router.get_topk_indices)
            else:
                router.forward = self._wrap_forward(index, router.forward)

    def _keep_input(self, index):
        def keep(_module, args):
            self._inputs[index] = args[0].detach() if args else None
        return keep

    def _keep_position(self, index):
        def keep(_module, _args, kwargs):
            positions = kwargs.get("position_ids")
            self._first[index] = int(positions.reshape(-1)[0]) if positions is not None and positions.numel() else 0
        return keep

    def _decide(self, index, scores, natural):
        """Record the decisions of one router call; the expert choice to use (forced or natural)."""
        router_input = self._inputs.get(index)
        first = self._first.get(index, 0)
        if router_input is None:  # called without a positional input: nothing to judge
            self.decisions.pop(index, None)
            self._parts[index] = None
        else:
            part = RouterDecisions(self.routers[index], scores, natural, router_input, self.specs[index])
            parts = self._parts.get(index) if first else []
            if parts is not None:
                self._parts[index] = parts = parts + [part]
                self.decisions[index] = RouterDecisions.joined(parts)
        forced = self.forced.get(index)
        if not forced:
            return natural
        chosen = natural.clone().reshape(-1, natural.shape[-1])
        for token, experts in forced.items():
            if first <= token < first + chosen.shape[0]:
                chosen[token - first] = experts.to(chosen.dtype)
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
