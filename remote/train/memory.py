"""The memory a draft's training needs, against what the device has free (stdlib only).

Before a train run starts, ``train.memory`` estimates what speculators' trainer will hold
on its one device and compares it with the free memory there: the first visible GPU's
``memory.free`` from nvidia-smi (:func:`remote.system.devices.query_nvidia_smi`) on a CUDA
host, ``MemAvailable`` on a CPU host. A run that cannot fit dies with an OOM minutes in,
after loading its data; this says so, with the numbers, before anything loads.

The draft is the one speculators >= 0.9 builds for EAGLE-3 (``models/eagle3/core.py``,
``model.py``, ``train/cli.py``), read off the target's config (or a draft's own
``config.json``: ``transformer_layer_config``, ``draft_vocab_size``)::

    >>> shape = draft_shape({"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
    ...                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128})
    >>> parameters(shape)["trainable"], parameters(shape)["frozen"]
    (293629952, 1576013824)

* **frozen**: ``embed_tokens`` (vocab x hidden), ``lm_head`` and ``verifier_lm_head``
  (hidden x draft vocab each; 0.9 freezes both: ``model.py`` ``load_verifier_weights``),
  ``verifier_norm``; the vocab maps (``t2d`` bool, ``d2t`` int64) when the draft vocab is smaller.
* **trainable**: ``fc`` (aux states x hidden -> hidden) and its ``input_norm``, the first
  decoder layer (q/k/v over 2 x hidden, o, the gated MLP of the target's
  ``intermediate_size``, else 3 x hidden, three norms), further layers at hidden, ``norm``.
* **bytes**: master weights fp32 (the trainer's ``hidden_states_dtype`` only sets autocast),
  fp32 grads and AdamW's two fp32 moments for the trainable ones (Muon keeps one: fewer).
* **activations** (rough, one packed batch of ``total_seq_len`` tokens, every TTT step kept
  for the backward): the states read (aux + final, bf16), per step per layer the layer's
  bf16 intermediates, per step the fp32 logits over the draft vocab (draft, target, their
  log-softmax and grad: :data:`LOGIT_COPIES`), a dense mask where attention is not flex.
"""
from __future__ import annotations

import os

from remote.system import modelconfig
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import GiB, MiB, human_bytes

#: fp32 master weights, fp32 grads, AdamW's exp_avg + exp_avg_sq in fp32.
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_STATES, STATE_BYTES = 4, 4, 2, 4
#: bf16: the states the dataloader hands over and the autocast activations.
ACT_BYTES = 2
#: speculators' defaults: ``--ttt-steps 3``, ``--num-layers 1``, 3 aux states (``[2, n//2, n-3]``).
TTT_STEPS, NUM_LAYERS, NUM_AUX = 3, 1, 3
#: fp32 copies of a step's logits alive at the loss: the draft's, the target's, a log-softmax, the grad.
LOGIT_COPIES = 4
#: what a trainer process holds beyond the model: the CUDA context and allocator pools (GPU), or
#: python with torch and transformers imported (CPU). A floor.
RUNTIME_BYTES = 1 * GiB
#: what the bf16 intermediates above leave out (norms upcast to fp32, attention's own buffers, the
#: allocator's rounding), measured: on the H200 (round 10: the 8B-like draft, 8192 tokens a step) the
#: trainer's own profile held 10.5 GiB at the end of its forward with 3.6 GiB of weights and AdamW, i.e.
#: ~6.8 GiB of activations where the parts above come to 4.4 GiB; nvidia-smi's peak was 1.22x the
#: estimate without this factor. Scales the states and layers parts.
ACTIVATION_FACTOR = 1.6
#: below this much headroom (of free memory) the run is a warn: allocator fragmentation, a second batch shape.
HEADROOM = 0.10


def _num(layer: dict, key: str):
    value = layer.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None


def draft_shape(config: dict, *, draft_vocab_size: int | None = None, num_layers: int | None = None,
                num_aux: int | None = None) -> dict:
    """The dims of the EAGLE-3 draft speculators builds for ``config``.

    ``config`` is the target's ``config.json`` (a wrapper's ``text_config`` is read) or a
    speculators draft's own (``transformer_layer_config`` + ``draft_vocab_size`` +
    ``eagle_aux_hidden_state_layer_ids``). Heads as ``train/cli.py`` resolves them: a
    ``head_dim`` that does not divide into the heads sets their count.

    :raises ValueError: the config has no ``hidden_size`` or ``vocab_size``.
    """
    if isinstance(config.get("transformer_layer_config"), dict):
        layer = config["transformer_layer_config"]
        draft_vocab_size = draft_vocab_size or _num(config, "draft_vocab_size")
        num_layers = num_layers or _num(layer, "num_hidden_layers")
        num_aux = num_aux or len(config.get("eagle_aux_hidden_state_layer_ids") or []) or None
    else:
        layer = modelconfig.text_config(config)
    hidden, vocab = _num(layer, "hidden_size"), _num(layer, "vocab_size")
    if not hidden or not vocab:
        raise ValueError(f"the config has no {'hidden_size' if not hidden else 'vocab_size'}")
    heads = _num(layer, "num_attention_heads") or 1
    kv_heads = _num(layer, "num_key_value_heads") or heads
    # transformers' DeepseekV3Config sets head_dim to qk_rope_head_dim; config.json does not carry it
    head_dim = _num(layer, "head_dim") or (_num(layer, "qk_rope_head_dim") if "kv_lora_rank" in layer else None)
    if head_dim and hidden % heads and not hidden % head_dim:
        heads = hidden // head_dim
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    head_dim = head_dim or hidden // heads
    return {"hidden": hidden, "vocab": vocab, "draft_vocab": int(draft_vocab_size or vocab),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "intermediate": _num(layer, "intermediate_size") or 3 * hidden,
            "num_layers": int(num_layers or NUM_LAYERS), "num_aux": int(num_aux or NUM_AUX)}


def _layer_params(s: dict, input_width: int) -> int:
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    attention = input_width * (q + 2 * kv) + q * s["hidden"]
    mlp = 3 * s["hidden"] * s["intermediate"]
    return attention + mlp + 2 * s["hidden"]  # + input and post-attention norms


def parameters(s: dict) -> dict:
    """``{"trainable", "frozen", "buffer_bytes"}`` of the draft :func:`draft_shape` describes."""
    h, dv = s["hidden"], s["draft_vocab"]
    first = _layer_params(s, 2 * h) + h  # + hidden_norm
    trainable = s["num_aux"] * h * h + s["num_aux"] * h + first + (s["num_layers"] - 1) * _layer_params(s, h) + h
    frozen = s["vocab"] * h + 2 * h * dv + h
    buffers = (s["vocab"] + 8 * dv) if dv != s["vocab"] else 0
    return {"trainable": trainable, "frozen": frozen, "buffer_bytes": buffers}


def activation_bytes(s: dict, total_seq_len: int, *, ttt_steps: int = TTT_STEPS, flex_attention: bool = True) -> dict:
    """A rough peak of one batch's activations, by part (bytes)."""
    t, h = int(total_seq_len), s["hidden"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = t * (2 * h + q + 2 * kv + q + 2 * h + 3 * s["intermediate"] + 4 * h) * ACT_BYTES
    states = t * (s["num_aux"] + 1) * h * ACT_BYTES + t * s["num_aux"] * h * ACT_BYTES
    out = {"states": int(states * ACTIVATION_FACTOR),
           "layers": int(per_layer * s["num_layers"] * ttt_steps * ACTIVATION_FACTOR),
           "logits": t * s["draft_vocab"] * 4 * LOGIT_COPIES * ttt_steps,
           "mask": 0 if flex_attention else t * t * ttt_steps}
    return out


def estimate(config: dict, *, total_seq_len: int, device: str = "cuda", draft_vocab_size: int | None = None,
             num_layers: int | None = None, ttt_steps: int | None = None, num_aux: int | None = None) -> dict:
    """What training this draft needs on its device, by part; ``need_bytes`` the sum."""
    s = draft_shape(config, draft_vocab_size=draft_vocab_size, num_layers=num_layers, num_aux=num_aux)
    p = parameters(s)
    parts = {"weights": (p["trainable"] + p["frozen"]) * WEIGHT_BYTES + p["buffer_bytes"],
             "grads": p["trainable"] * GRAD_BYTES,
             "optimizer": p["trainable"] * OPTIMIZER_STATES * STATE_BYTES}
    acts = activation_bytes(s, total_seq_len, ttt_steps=int(ttt_steps or TTT_STEPS),
                            flex_attention=device == "cuda")  # a CPU run passes --draft-attn-impl sdpa
    parts["activations"] = sum(acts.values())
    parts["runtime"] = RUNTIME_BYTES
    return {"shape": s, "params": p, "total_seq_len": int(total_seq_len), "ttt_steps": int(ttt_steps or TTT_STEPS),
            "parts": parts, "activations": acts, "need_bytes": sum(parts.values())}


def free_memory(device: str, env: dict | None = None, *, gpus: list | None = None, meminfo: dict | None = None
                ) -> dict:
    """Where the trainer runs and what it has free: ``{"where", "free_bytes", "total_bytes"}`` (``why`` when unknown).

    ``gpus`` (:func:`remote.system.devices.parse_gpus` rows) and ``meminfo``
    (:func:`remote.system.devices.parse_meminfo`) are read from the host when not given. The
    trainer takes the first GPU ``CUDA_VISIBLE_DEVICES`` (the job's ``env`` first) leaves it.
    """
    from remote.system import devices

    if device != "cuda":
        if meminfo is None:
            try:
                meminfo = devices.read_meminfo()
            except OSError as exc:
                return {"where": "RAM", "why": f"cannot read /proc/meminfo: {exc}"}
        free = meminfo.get("MemAvailable", meminfo.get("MemFree"))
        return {"where": "RAM (MemAvailable)", "free_bytes": free, "total_bytes": meminfo.get("MemTotal")}
    if gpus is None:
        import shutil

        smi = shutil.which("nvidia-smi")
        if smi is None:
            return {"where": "GPU", "why": "nvidia-smi is not on PATH"}
        found = devices.query_nvidia_smi(smi)
        if found["error"]:
            return {"where": "GPU", "why": f"nvidia-smi: {found['error']}"}
        gpus = found["gpus"]
    cvd = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    visible = devices.visible_gpus(gpus, cvd)
    if not visible:
        return {"where": "GPU", "why": f"no visible GPU (CUDA_VISIBLE_DEVICES={cvd!r})"}
    gpu = visible[0]
    return {"where": f"GPU {gpu['index']} ({gpu['name']})", "free_bytes": (gpu["memory_free_mib"] or 0) * MiB,
            "total_bytes": (gpu["memory_total_mib"] or 0) * MiB, "gpu": gpu}


def _count(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10e6 else f"{n / 1e6:.2f}M"


def judge(est: dict, free: dict) -> dict:
    """The ``train.memory`` record: ok with :data:`HEADROOM` to spare, warn with less, fail when it does not fit."""
    parts, need = est["parts"], est["need_bytes"]
    s = est["shape"]
    p, logits = est["params"], est["activations"]["logits"]
    line = (f"{human_bytes(need)}: weights {human_bytes(parts['weights'])} ({_count(p['trainable'])} trainable + "
            f"{_count(p['frozen'])} frozen, fp32), grads + AdamW {human_bytes(parts['grads'] + parts['optimizer'])}, "
            f"activations ~{human_bytes(parts['activations'])} ({est['total_seq_len']} tokens x {est['ttt_steps']} "
            f"TTT steps, logits over {s['draft_vocab']} draft tokens {human_bytes(logits)})")
    detail = {**est, "free": {k: v for k, v in free.items() if k != "gpu"}}
    if free.get("free_bytes") is None:
        return record("train.memory", SKIPPED, f"needs about {line}; free memory unknown: {free.get('why')}",
                      detail=detail)
    have = int(free["free_bytes"])
    where = f"{free['where']} has {human_bytes(have)} free"
    if need <= have * (1 - HEADROOM):
        return record("train.memory", OK, f"needs about {line}; {where}", detail=detail)
    acts = est["activations"]
    fixes = []
    if acts["logits"] >= max(acts["layers"], parts["weights"] / 2):
        fixes.append(f"a smaller draft vocabulary (speculators' --draft-vocab-size, e.g. 32000, with a token_freq.pt "
                     f"in the data path: the logits over {s['draft_vocab']} tokens take {human_bytes(acts['logits'])})")
    if parts["activations"] > parts["weights"]:
        fixes.append(f"a shorter seq_len for the extraction (the trainer's --total-seq-len, now "
                     f"{est['total_seq_len']})")
    fixes.append("a GPU with more free memory (stop what else runs on it, or pick another: CUDA_VISIBLE_DEVICES "
                 "in the inventory's env)" if "gpu" in free else "a host with more available RAM")
    status = WARN if need <= have else FAIL
    summary = (f"needs about {line}; {where}" + (f" ({human_bytes(have - need)} to spare, under {HEADROOM:.0%})"
                                                  if status == WARN else f": {human_bytes(need - have)} short"))
    return record("train.memory", status, summary, detail=detail, fix="; or ".join(fixes))


def flag_value(args, flag: str):
    """An integer flag's value in a trainer argv (the last one given), else None."""
    args = [str(a) for a in args or []]
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def draft_vocab(extra_args, data_path) -> tuple[int | None, str | None]:
    """The ``--draft-vocab-size`` the trainer will really use, and why one given is not.

    speculators builds the vocab maps from ``d2t-<N>.npy``/``t2d-<N>.npy`` in the data path,
    ``--d2t-path``/``--t2d-path``, or a token frequency file (``--token-freq-path``, else
    ``<data>/token_freq.pt``); with none of them it warns in its log and trains over the
    full vocab (``train/cli.py`` ``parse_vocab_mappings``), so that is what is sized.
    """
    from pathlib import Path

    size = flag_value(extra_args, "--draft-vocab-size")
    if size is None:
        return None, None
    args = [str(a) for a in extra_args or []]
    data = Path(str(data_path or "."))
    if any(a.split("=")[0] in ("--d2t-path", "--t2d-path", "--token-freq-path") for a in args) or \
            (data / f"d2t-{size}.npy").is_file() and (data / f"t2d-{size}.npy").is_file() or \
            (data / "token_freq.pt").is_file():
        return size, None
    return None, (f"--draft-vocab-size {size} has no vocab maps to use (no d2t-{size}.npy/t2d-{size}.npy or "
                  f"token_freq.pt in {data}): speculators trains over the full vocab")


def plan_estimate(plan, config: dict) -> tuple[dict, str | None]:
    """:func:`estimate` for a :class:`remote.train.plan.TrainPlan` (the trainer flags it passes read), and why
    a ``--draft-vocab-size`` given is not used (:func:`draft_vocab`); the preflight's and the run's one estimate.

    :raises ValueError: the draft cannot be sized from ``config``.
    """
    extra = plan.extra_args
    vocab, ignored = draft_vocab(extra, plan.data_path)
    est = estimate(config, total_seq_len=flag_value(extra, "--total-seq-len") or plan.total_seq_len,
                   device="cuda" if plan.device == "cuda" else "cpu", draft_vocab_size=vocab,
                   num_layers=flag_value(extra, "--num-layers"), ttt_steps=flag_value(extra, "--ttt-steps"),
                   num_aux=len(plan.trainer_layer_ids) or None)
    return est, ignored


def check(plan, config: dict, env: dict | None = None, free: dict | None = None) -> dict:
    """``train.memory`` for a :class:`remote.train.plan.TrainPlan` on this host, now (``free``: what is free where
    the trainer runs, when that is not this host: a ``why`` without ``free_bytes`` says the estimate alone)."""
    try:
        est, ignored = plan_estimate(plan, config)
    except ValueError as exc:
        return record("train.memory", SKIPPED, f"cannot size the draft from {plan.model_path}: {exc}", detail={})
    rec = judge(est, free or free_memory("cuda" if plan.device == "cuda" else "cpu", env))
    if ignored:
        rec["detail"]["draft_vocab_ignored"] = ignored
        rec["summary"] += f" ({ignored})"
    return rec
