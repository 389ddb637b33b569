"""Smoke-run the real speculators 0.3.0 ``VllmHiddenStatesGenerator`` and check its states.

This is the proof that a patch set works: it constructs the *installed* generator (so
run it with the patched package first on ``sys.path``), extracts hidden states for a
batch of prompts, and compares every request, layer and token against a reference:

``hf``     a transformers float32 forward of the same checkpoint, with forward hooks on
           the decoder layers (HF's ``hidden_states[N]`` is post-norm, the hooks give
           the pre-norm residual stream the generator captures: ``output`` convention,
           see ``remote/wire/layers.py``).
``vllm``   vLLM's *own* model forward (the patched forward removed, hooks on the layers),
           run in the same workers. This is the reference for what HF cannot do, such as
           DeepSeek's ``llama_4_scaling`` past ``original_max_position_embeddings``.

For MoE models the HF comparison is only a figure (bf16 and float32 routers pick other
experts for near-tie tokens), unless ``--all-experts`` runs a view of the model that
selects every expert: then it is a strict check too. A Kimi-K2.5 wrapper is compared
through its DeepSeek-V3 text model, built in HF from ``text_config``.

The default batch has 43 prompts (more than 10, so text-sorted request ids would
reorder it; more than the generator's ``max_num_seqs`` of 32, so it takes several
scheduler steps) with 9,000+ tokens in all (more than ``max_num_batched_tokens``, so a
long request is prefilled in chunks across steps). When the model has
``llama_4_scaling``, a negative control runs vLLM's forward with the scaling dropped
and must *disagree* past the boundary and agree before it: the check can fail.

Usage (in the host env's python, from the checkout's root; it starts vLLM, hence the ``__main__`` guard)::

    python -m remote.dev.smoke_generator --model /models/tiny-llama --tp 2 --layers 2,4,5,7

It prints one JSON object. ``main(params)`` returns the same as a protocol payload.
Stdlib-only at import time: torch/transformers/vllm/speculators load inside ``run``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

try:  # run as ``python -m remote.dev.smoke_generator`` or imported as ``remote.dev.smoke_generator``
    from remote.system import modelconfig
    from remote.wire import protocol
except ImportError:  # pragma: no cover - run as a plain file: the checkout's root is three levels up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from remote.system import modelconfig
    from remote.wire import protocol

#: Prompt lengths of the default batch: 30 short requests, then 13 long ones. Step 1
#: holds 32 requests (max_num_seqs), step 2 hits 8192 tokens (the generator's smallest
#: max_num_batched_tokens) inside the last request, step 3 finishes it. Most reach
#: past any small original_max_position_embeddings.
DEFAULT_LENGTHS = tuple(4 + (7 * i) % 37 for i in range(30)) + (
    5, 17, 33, 64, 100, 250, 400, 700, 900, 1200, 1500, 1990, 1200)

#: Agreement with HF, per token: bf16 vLLM vs float32 HF differ by rounding, ~1e-2
#: relative; a misattributed token or a wrong layer differs by O(1). MoE models
#: route some near-tie tokens to other experts in bf16 (vLLM's router runs in the
#: model dtype, HF's in float32), so for them a few tokens may differ more: each
#: request must have at least HF_MIN_AGREEMENT of its (layer, token) rows within
#: HF_TOKEN_REL_ERR. A request given another request's states agrees on ~none.
HF_TOKEN_REL_ERR = 0.1
HF_MIN_AGREEMENT = 0.9
#: MoE models: a token whose router scores nearly tie picks other experts in vLLM
#: (bf16) than in HF (float32), and its state differs by O(10%) from that layer on.
#: Measured on the tiny random twins: DeepSeek-V3 80-90% of rows agree, Kimi-K2.5
#: only 20%; with every expert selected (``all_experts``) 100% agree within 3%.
#: So for MoE the HF comparison is a check only with ``all_experts``, else a figure.
#: Two vLLM forwards over the same batch run the same kernels on the same inputs.
VLLM_MAX_REL_ERR = 1e-3


def make_prompts(vocab_size: int, lengths=DEFAULT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Deterministic random token ids (ids 3.. avoid the usual special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def _install_vllm_reference(worker, drop_llama_4_scaling: bool = False):
    """Worker-side: capture through vLLM's own ``Model.forward`` instead of the patched one.

    Called through ``collective_rpc`` (cloudpickled by value). Removes the instance
    ``forward`` the extension installed, so the class's own forward (with its own
    ``llama_4_scaling``) runs, and hooks the target layers to feed the extension's
    per-request store. ``drop_llama_4_scaling`` is the negative control.
    """
    from vllm.distributed import get_tp_group

    model = worker.model_runner.model
    if not hasattr(model, "model") and hasattr(model, "language_model"):
        model = model.language_model  # a multimodal wrapper (Kimi-K2.5)
    base_model = model.model
    base_model.__dict__.pop("forward", None)
    for handle in getattr(base_model, "_specops_ref_hooks", []):
        handle.remove()
    if drop_llama_4_scaling:
        base_model._specops_saved_scaling = getattr(base_model.config, "llama_4_scaling", None)
        base_model.config.llama_4_scaling = None
    elif hasattr(base_model, "_specops_saved_scaling"):
        base_model.config.llama_4_scaling = base_model._specops_saved_scaling
    targets = sorted(worker._layer_ids)
    collected = {}

    def hook_for(layer_id):
        def hook(module, args, output):
            if get_tp_group().rank_in_group != 0:
                return
            hidden_states, residual = output
            collected[layer_id] = (hidden_states + residual).clone()
            if layer_id == targets[-1]:  # the last target runs last: store the step
                worker._store_captured_states([collected[i] for i in targets])
                collected.clear()
        return hook

    base_model._specops_ref_hooks = [
        base_model.layers[i].register_forward_hook(hook_for(i)) for i in targets
    ]
    return True


def _record_steps(scheduler) -> list:
    """Wrap ``scheduler.schedule`` to log each step's request ids (no behaviour change)."""
    steps = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            steps.append(set(output.num_scheduled_tokens))
        return output

    scheduler.schedule = recording_schedule
    return steps


def _compare(got, want, rows=None) -> float:
    """Max relative error: max|got-want| / max|want| over ``rows`` (all by default)."""
    got = got.float()
    want = want.float()
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _hf_text_model(model_dir, config: dict):
    """The HF causal LM of ``model_dir``, float32; a wrapper's text model when it has one.

    Kimi-K2.5 needs remote code in HF, but its text model is plain DeepSeek-V3: built
    from ``text_config``, with the checkpoint's ``language_model.`` tensors.
    """
    import glob

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not modelconfig.is_wrapped(config):
        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    from safetensors.torch import load_file

    text = dict(modelconfig.text_config(config))
    hf_config = AutoConfig.for_model(text.pop("model_type"), **text)
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    prefix = "language_model."
    weights = {}
    for shard in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        weights.update({k[len(prefix):]: v.float() for k, v in load_file(shard).items()
                        if k.startswith(prefix)})
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"text model weights do not fit: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model


def _hf_states(model_dir, prompts, layer_ids, config: dict):
    """Output of each decoder layer in ``layer_ids`` (pre-norm residual stream), float32."""
    import torch

    model = _hf_text_model(model_dir, config)
    model.eval()
    captured = {}
    layers = model.model.layers
    handles = [
        layers[i].register_forward_hook(
            lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in layer_ids
    ]
    results = []
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]), use_cache=False)
            results.append([captured[i][0].clone() for i in layer_ids])
    for h in handles:
        h.remove()
    return results


def _describe(samples) -> list[dict]:
    import torch

    return [
        {
            "tokens": int(s["input_ids"].shape[0]),
            "shapes": [list(h.shape) for h in s["hidden_states"]],
            "dtypes": [str(h.dtype).replace("torch.", "") for h in s["hidden_states"]],
            "nan": [int(torch.isnan(h).sum()) for h in s["hidden_states"]],
            "inf": [int(torch.isinf(h).sum()) for h in s["hidden_states"]],
        }
        for s in samples
    ]


def _token_agreement(got, want, rows=None, tol=HF_TOKEN_REL_ERR) -> tuple[int, int]:
    """(rows within ``tol``, rows compared); per-row error is scaled by max|want|."""
    got = got.float()
    want = want.float()
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.numel() == 0:
        return 0, 0
    per_row = (got - want).abs().amax(-1) / want.abs().max().clamp_min(1e-12)
    return int((per_row <= tol).sum()), int(per_row.numel())


def _per_request_agreement(samples, references, rows_for=None) -> list[float]:
    fractions = []
    for i, (sample, ref) in enumerate(zip(samples, references)):
        rows = rows_for(i) if rows_for else None
        counts = [_token_agreement(h, r, rows) for h, r in zip(sample["hidden_states"], ref)]
        fractions.append(sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts)))
    return fractions


def _per_request_errors(samples, references, rows_for=None) -> list[float]:
    errs = []
    for i, (sample, ref) in enumerate(zip(samples, references)):
        rows = rows_for(i) if rows_for else None
        errs.append(max(_compare(h, r, rows) for h, r in zip(sample["hidden_states"], ref)))
    return errs


def all_experts_twin(model_dir: str, out_dir: str) -> str:
    """A view of ``model_dir`` whose MoE layers select every expert (no routing choice).

    Same weights (symlinked), ``num_experts_per_tok = n_routed_experts`` in the (text)
    config: vLLM and HF then run the same experts for every token, and differences
    left are numerics. Used for an exact-enough HF comparison of MoE models.
    """
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if name != "config.json" and not os.path.exists(os.path.join(out_dir, name)):
            os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(out_dir, name))
    config = modelconfig.read(model_dir)
    text = modelconfig.text_config(config)  # edited in place: written back inside ``config``
    experts = text.get("n_routed_experts") or text.get("num_local_experts")
    if not experts:
        raise ValueError(f"{model_dir} is not a MoE model: no n_routed_experts")
    text["num_experts_per_tok"] = experts
    if text.get("n_group"):  # group-limited routing: keep every group
        text["topk_group"] = text["n_group"]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=1)
    return out_dir


def run(model_dir: str, tp: int = 1, layer_ids=None, lengths=DEFAULT_LENGTHS,
        reference: str = "auto", max_model_len: int = 2048, all_experts: bool = False) -> dict:
    """Construct the real generator, extract, check. Returns a JSON-able report."""
    if all_experts:
        import tempfile

        model_dir = all_experts_twin(model_dir, tempfile.mkdtemp(prefix="specops-all-experts-"))
    import time
    import types

    import speculators
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    # config.json as data: a wrapper (Kimi-K2.5) may need remote code for AutoConfig.
    config = modelconfig.read(model_dir)
    text_config = types.SimpleNamespace(**modelconfig.text_config(config))
    num_layers = text_config.num_hidden_layers
    scaling = getattr(text_config, "llama_4_scaling", None)
    prompts = make_prompts(text_config.vocab_size, lengths)
    report = {
        "model": str(model_dir), "model_type": config.get("model_type"), "tp": tp,
        "speculators_file": speculators.__file__, "num_layers": num_layers,
        "prompt_tokens": [len(p) for p in prompts], "llama_4_scaling": scaling,
        "all_experts": all_experts,
        "checks": {},
    }

    started = time.monotonic()
    generator = VllmHiddenStatesGenerator(
        model_dir, layer_ids=layer_ids, max_model_len=max_model_len,
        tensor_parallel_size=tp,
    )
    report["load_s"] = round(time.monotonic() - started, 1)
    layer_ids = list(generator.layer_ids)  # the patched generator keeps this order
    report["layer_ids"] = layer_ids
    steps = _record_steps(generator.scheduler)
    started = time.monotonic()
    samples = generator.generate(prompts)
    report["generate_s"] = round(time.monotonic() - started, 1)
    # Which requests each scheduler step ran: shows chunked prefill was exercised.
    report["steps"] = [len(step) for step in steps]
    report["chunked_requests"] = sorted(
        {rid for rid in set().union(*steps) if sum(rid in step for step in steps) > 1})
    steps.clear()
    report["samples"] = _describe(samples)
    checks = report["checks"]
    checks["count"] = len(samples) == len(prompts) and all(
        len(s["hidden_states"]) == len(layer_ids) for s in samples)
    checks["shapes"] = all(
        list(h.shape) == [len(p), text_config.hidden_size]
        for s, p in zip(samples, prompts) for h in s["hidden_states"])
    checks["input_ids"] = all(s["input_ids"].tolist() == p for s, p in zip(samples, prompts))
    checks["finite"] = all(not any(d["nan"]) and not any(d["inf"]) for d in report["samples"])

    boundary = scaling["original_max_position_embeddings"] if scaling else None
    if reference in ("auto", "vllm"):
        if __name__ != "__main__":  # workers may not import this module: ship it by value
            import cloudpickle

            cloudpickle.register_pickle_by_value(sys.modules[__name__])
        generator.executor.collective_rpc(_install_vllm_reference)
        ref = generator.generate(prompts)
        errs = _per_request_errors(samples, [r["hidden_states"] for r in ref])
        report["vllm_reference_max_rel_err"] = max(errs)
        checks["vllm_reference"] = max(errs) <= VLLM_MAX_REL_ERR
        if scaling:
            generator.executor.collective_rpc(_install_vllm_reference, args=(True,))
            control = generator.generate(prompts)
            controls = [r["hidden_states"] for r in control]
            before = _per_request_errors(samples, controls, lambda i: slice(0, boundary))
            past = [e for i, e in enumerate(_per_request_errors(
                samples, controls, lambda i: slice(boundary, None))) if len(prompts[i]) > boundary]
            report["control_unscaled_rel_err"] = {"before_boundary_max": max(before),
                                                  "past_boundary_min": min(past)}
            # Unscaled agrees before the boundary (scaling is 1 there) and must not after,
            # in every request that reaches past it: the reference check can fail.
            checks["control_detects_missing_scaling"] = (
                max(before) <= VLLM_MAX_REL_ERR and min(past) > VLLM_MAX_REL_ERR)
    if reference in ("auto", "hf"):
        # HF transformers knows no llama_4_scaling: compare only where it is 1. The
        # model is causal, so the prompts' heads up to the boundary are all HF needs.
        rows = (lambda i: slice(0, boundary)) if scaling else None
        hf = _hf_states(model_dir, [p[:boundary] for p in prompts] if scaling else prompts,
                        layer_ids, config)
        errs = _per_request_errors(samples, hf, rows)
        agreement = _per_request_agreement(samples, hf, rows)
        report["hf_reference_max_rel_err"] = max(errs)
        report["hf_reference_min_agreement"] = min(agreement)
        report["hf_reference_rows"] = f"positions < {boundary}" if scaling else "all"
        is_moe = bool(getattr(text_config, "n_routed_experts", None)
                      or getattr(text_config, "num_local_experts", None))
        if is_moe and not all_experts:
            report["hf_reference_note"] = ("MoE routing choices differ between bf16 vLLM and "
                                           "float32 HF for near-tie tokens: a figure, not a "
                                           "check; use --all-experts for the check")
        else:
            report["hf_reference_min_agreement_required"] = HF_MIN_AGREEMENT
            checks["hf_reference"] = min(agreement) >= HF_MIN_AGREEMENT
    del generator
    if all_experts:
        import shutil

        shutil.rmtree(model_dir, ignore_errors=True)  # symlinks and one config.json
    report["ok"] = all(checks.values())
    return report


def main(params: dict) -> dict:
    """Protocol entry: ``params`` = {"model", "tp", "layer_ids", "reference"}."""
    report = run(params["model"], tp=int(params.get("tp", 1)),
                 layer_ids=params.get("layer_ids"), reference=params.get("reference", "auto"),
                 all_experts=bool(params.get("all_experts")))
    failed = sorted(name for name, ok in report["checks"].items() if not ok)
    status = protocol.OK if report["ok"] else protocol.FAIL
    summary = (f"generator extracted {len(report['samples'])} samples x "
               f"{len(report['layer_ids'])} layers at TP={report['tp']}"
               + (f"; failed checks: {', '.join(failed)}" if failed else "; states match"))
    rec = protocol.record("smoke.generator", status, summary, detail=report,
                          fix=None if report["ok"] else
                          "apply the patch set (fab patch) and read detail.checks")
    return protocol.payload([rec], **report)


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model dir (HF layout)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer ids (output convention); default: the generator's")
    parser.add_argument("--reference", choices=("auto", "hf", "vllm", "none"), default="auto")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--all-experts", action="store_true",
                        help="MoE: run a view of the model that selects every expert, so HF "
                             "and vLLM route alike and the HF comparison is a check")
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = _parse_args(sys.argv[1:])
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else DEFAULT_LENGTHS
    result = run(args.model, tp=args.tp, layer_ids=layers, lengths=lengths,
                 reference=args.reference, all_experts=args.all_experts)
    print("SMOKE-JSON " + json.dumps(result, default=str), flush=True)
    sys.exit(0 if result["ok"] else 1)
