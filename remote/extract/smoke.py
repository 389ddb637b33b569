"""``fab smoke``, host side: build (or reuse) the tiny random twin of the target model.

The controller (``specops/smoke.py``) then runs the *exact* extraction path on the
twin -- same engine, same installed (patched) speculators, same TP size, same
supervisor, through ``remote/run/job.py`` -- and verifies the result. This module only
prepares what that run needs::

    <work_dir>/smoke/<twin hash>/model/          the twin (config, shards, index, tokenizer,
                                                 remote code and processor configs)
    <work_dir>/smoke/<twin hash>/samples.jsonl   a handful of the target's dataset rows
                                                 (synthetic chat records when it has none)

The twin comes from :mod:`remote.extract.tinymodel` (``shrink_config`` + ``build_model``):
same ``model_type``, ``architectures``, family keys and ``text_config`` wrapping,
8 layers, hidden 256, random bf16 weights, the target's own tokenizer. The hash
covers the target's config.json, its tokenizer files, the builder's source and this
recipe, so an unchanged target reuses its twin (``smoke.twin`` ok) and anything that
matters rebuilds it (``changed``).

The twin is also made *numerically sensitive*, so that ``fab verify`` on the smoke
run can see a worker that computes the wrong thing (measured on the tiny DeepSeek-V3,
transformers fp32 vs the same forward with the defect):

* **sharp attention**: random init (std 0.02) leaves attention logits at std 0.06, so
  softmax is almost uniform and anything that scales q (``llama_4_scaling``, a wrong
  softmax scale) changes the states by < 1 %, below bf16 noise. The q projection is
  multiplied by ``ATTENTION_SHARPNESS`` (16: logit std 1.0, as in trained models);
  then dropping ``llama_4_scaling`` moves the states by 16-22 % (nrmse) against
  ~1-2 % of bf16 noise.
* **wide routing margins** (``noaux_tc`` routers, i.e. DeepSeek-V3 / Kimi): random
  router scores sit within bf16 rounding of each other, and a reference in another
  precision picks other experts for ~5 % of tokens (those tokens then differ by up to
  56 %). The twin's ``e_score_correction_bias`` gives the first ``top_k`` experts
  +``ROUTING_MARGIN``, so every implementation selects the same experts; the gating
  weights (scores without the bias) still vary per token.
* **llama_4_scaling reached**: ``original_max_position_embeddings`` of the block is cut
  to ``LLAMA4_TWIN_ORIGINAL_MAX`` (16) so that short smoke samples cross it; ``beta``
  is kept.

**MLA on a GPU.** The twin's tiny MLA dims (``tinymodel.MLA_DIMS``: latent 64, rope 32)
are what vLLM's CPU attention accepts, but vLLM's MLA attention on a GPU accepts only
the real ones (a latent cache of kv_lora_rank + qk_rope_head_dim = 576 or 320 values per
token; the tiny twin's 96 failed its first request on the H200: "Head dimension 96 is
not supported by MLA."). For ``device: cuda`` the twin of an MLA model therefore keeps
the target's ``tinymodel.MLA_HEAD_DIM_KEYS`` (512 / 128 / 64 / 128 for DeepSeek-V3): the
GPU run exercises the MLA kernels the real model will (FLASH_ATTN_MLA on Hopper).
Everything else stays tiny (the DeepSeek-V3 twin: 21.5 MB instead of 9.9 MB), and the
choice is part of the twin's hash only where it changes the twin.

**On the real model** (``real``: ``specops smoke --real``, ``extract --smoke-real``): no twin.
:func:`prepare_real` resolves the run's plan and hands back the target itself, the first
``samples`` rows of the run's dataset and the ids a short verification run captures -- the
run's own plus a consecutive pair for each kind of layer (:mod:`remote.verify.pairs`) -- so
that ``verify --reference layer`` checks those decoder layers of the real checkpoint alone.

Parameters (:data:`SPEC`): the run's own (:data:`remote.wire.argspec.RUN_ARGS`), of which it
reads ``model_path``, ``work_dir`` (both required), ``dataset``, ``seq_len`` (capped at
``SMOKE_SEQ_LEN``), ``device`` (the run's; ``cuda`` keeps MLA head dims) and ``env``; and
``samples`` (4), ``layers`` (8), ``rebuild`` (false).

Stdlib only at import; torch and transformers are imported by the builder.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from remote.extract import runplan
from remote.system import modelconfig
from remote.wire import fsutil, layers, protocol
from remote.wire.argspec import RUN_ARGS, Arg, Spec

#: Bump when the recipe below changes in a way the hashed inputs do not show.
TWIN_RECIPE = "1"
ATTENTION_SHARPNESS = 16.0
ROUTING_MARGIN = 10.0
LLAMA4_TWIN_ORIGINAL_MAX = 16
#: Smoke samples are cut to this many tokens (enough to cross the twin's llama_4 limit).
SMOKE_SEQ_LEN = 128
DEFAULT_SAMPLES = 4
#: Parameter name endings of the query projection (MLA q_b_proj, or a plain q_proj).
Q_PROJ_SUFFIXES = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")
ROUTER_BIAS_SUFFIX = "e_score_correction_bias"

#: the run's parameters (the laptop sends the real run's), and the twin's own.
SPEC = Spec("smoke", RUN_ARGS, {
    "model_path": RUN_ARGS["model_path"].but(required=True, doc="the target model: the twin copies its config"),
    "work_dir": RUN_ARGS["work_dir"].but(required=True),
    "seq_len": RUN_ARGS["seq_len"].but(default=SMOKE_SEQ_LEN, doc=f"capped at {SMOKE_SEQ_LEN}"),
    "samples": Arg("int", DEFAULT_SAMPLES, min=1, doc="rows of the target's dataset to extract"),
    "layers": Arg("int", 8, min=1, doc="the twin's depth"),
    "rebuild": Arg("bool", False, doc="build the twin again even when its hash is unchanged"),
    "real": Arg("bool", False, doc="no twin: a short verification run of the target itself, with ids that give "
                                   "the layer check a pair per kind of layer (remote.verify.pairs)"),
})


@SPEC.task
def main(params: dict) -> dict:
    return protocol.run_in_job_env(prepare, params)


class SmokeError(protocol.TaskError):
    """A refusal of this task (see protocol.TaskError)."""


# --------------------------------------------------------------------------- the twin

def target_config(model_path: Path) -> dict:
    try:
        return modelconfig.read(model_path)
    except modelconfig.ConfigError as exc:
        missing = not model_path.is_dir() or not (model_path / modelconfig.CONFIG_FILE).exists()
        raise SmokeError("smoke.twin", exc.summary,
                         "set model_path (inventory or --model) to the checkpoint directory" if missing
                         else exc.fix) from None


def keeps_mla_head_dims(config: dict, device) -> bool:
    """True when the twin of ``config`` keeps the target's MLA head dims: an MLA model for a GPU."""
    from remote.extract import tinymodel

    on_gpu = str(device or "").lower().startswith("cuda")
    return on_gpu and tinymodel._is_mla(modelconfig.text_config(config))


def twin_hash(model_path: Path, config: dict, num_layers: int, device=None) -> str:
    """Content hash of everything the twin is built from (the device only where it changes the twin)."""
    from remote.extract import tinymodel

    digest = hashlib.sha256()
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(f"\0layers={num_layers}\0recipe={TWIN_RECIPE}\0".encode())
    if keeps_mla_head_dims(config, device):
        digest.update(b"mla_head_dims=target\0")
    digest.update(Path(tinymodel.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    for pattern in tinymodel.TOKENIZER_FILE_PATTERNS + tinymodel.TWIN_EXTRA_PATTERNS:
        for path in sorted(model_path.glob(pattern)):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def twin_config(config: dict, num_layers: int, device=None) -> tuple[dict, list[str]]:
    """The shrunk config plus the twin-only changes (listed in the returned notes)."""
    from remote.extract import tinymodel

    keep = keeps_mla_head_dims(config, device)
    tiny = tinymodel.shrink_config(config, num_layers=num_layers, keep_mla_head_dims=keep)
    text = modelconfig.text_config(tiny)
    notes = []
    if keep:
        notes.append("MLA head dims kept from the target for the GPU's MLA kernels: " + ", ".join(
            f"{key} {text[key]}" for key in tinymodel.MLA_HEAD_DIM_KEYS if key in text))
    scaling = text.get("llama_4_scaling")
    if isinstance(scaling, dict) and int(scaling.get("original_max_position_embeddings") or 0) > \
            LLAMA4_TWIN_ORIGINAL_MAX:
        notes.append(f"llama_4_scaling.original_max_position_embeddings "
                     f"{scaling['original_max_position_embeddings']} -> {LLAMA4_TWIN_ORIGINAL_MAX} "
                     f"(short smoke samples reach it)")
        text["llama_4_scaling"] = dict(scaling, original_max_position_embeddings=LLAMA4_TWIN_ORIGINAL_MAX)
    return tiny, notes


def condition_weights(model_dir: Path, text_config: dict) -> list[str]:
    """Sharpen attention and widen routing margins in the written shards (see module doc)."""
    import torch
    from safetensors.torch import load_file, save_file

    top_k = int(text_config.get("num_experts_per_tok") or 0)
    sharpened = biased = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        changed = False
        for name, tensor in tensors.items():
            if name.endswith(Q_PROJ_SUFFIXES):
                tensors[name] = (tensor.float() * ATTENTION_SHARPNESS).to(tensor.dtype)
                sharpened += 1
                changed = True
            elif name.endswith(ROUTER_BIAS_SUFFIX) and top_k:
                bias = torch.zeros_like(tensor)
                bias[:top_k] = ROUTING_MARGIN
                tensors[name] = bias
                biased += 1
                changed = True
        if changed:
            save_file(tensors, str(shard), metadata={"format": "pt"})
    notes = [f"q projection x{ATTENTION_SHARPNESS:g} in {sharpened} layer(s) (sharp attention)"]
    if biased:
        notes.append(f"router bias +{ROUTING_MARGIN:g} on experts 0..{top_k - 1} in {biased} layer(s) "
                     f"(same expert choice in every precision)")
    return notes


def build_twin(model_path: Path, out_dir: Path, config: dict, num_layers: int, device=None) -> list[str]:
    """Build the twin into ``out_dir`` (which must not exist); returns the twin-only notes."""
    from remote.extract import tinymodel

    tiny, notes = twin_config(config, num_layers, device)
    # Remote code and processor configs travel as files (tinymodel copies them): whether
    # they run is decided by the loaders, exactly as for the target.
    tinymodel.build_twin(model_path, out_dir, num_shards=2, tiny_config=tiny)
    text = modelconfig.text_config(tiny)
    notes += condition_weights(out_dir, text)
    return notes




def ensure_twin(model_path: Path, root: Path, num_layers: int, rebuild: bool, device=None) -> dict:
    """The twin dir, built once per hash (atomic rename, one builder at a time)."""
    config = target_config(model_path)
    digest = twin_hash(model_path, config, num_layers, device)
    twin_dir = root / digest / "model"
    info_path = root / digest / "twin.json"
    t0 = time.monotonic()
    with fsutil.FileLock(root / f"{digest}.lock"):
        if rebuild and twin_dir.exists():
            shutil.rmtree(twin_dir)
        built = not (twin_dir / modelconfig.CONFIG_FILE).exists() or not info_path.exists()
        if built:
            staging = root / digest / f".model-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            try:
                notes = build_twin(model_path, staging, config, num_layers, device)
                shutil.rmtree(twin_dir, ignore_errors=True)
                os.rename(staging, twin_dir)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            info = {"hash": digest, "target": str(model_path), "notes": notes,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_s": round(time.monotonic() - t0, 2)}
            info_path.write_text(json.dumps(info, indent=1) + "\n")
        info = json.loads(info_path.read_text())
    twin_cfg = modelconfig.read(twin_dir)
    text = modelconfig.text_config(twin_cfg)
    size = sum(p.stat().st_size for p in twin_dir.glob("*.safetensors"))
    return dict(info, built=built, seconds=round(time.monotonic() - t0, 2), twin_dir=str(twin_dir),
                root=str(root / digest), bytes=size,
                layers=modelconfig.num_layers(twin_cfg), hidden_size=text.get("hidden_size"),
                model_type=twin_cfg.get("model_type"), architectures=twin_cfg.get("architectures"),
                wrapped=modelconfig.is_wrapped(twin_cfg),
                llama_4_scaling=text.get("llama_4_scaling"),
                remote_code=sorted(p.name for p in twin_dir.glob("*.py")))


# --------------------------------------------------------------------------- samples

def write_samples(dataset, dest: Path, count: int) -> dict:
    """The first ``count`` rows of the target's dataset (across its inputs, in order), or synthetic chat
    records."""
    from remote.extract.dataset import DatasetError, input_rows, inputs_of

    rows, source = [], "synthetic"
    inputs = inputs_of(dataset)
    found = [p for p in inputs if p.exists()]
    if inputs and len(found) == len(inputs):
        try:
            for _, _, raw in input_rows(dataset):
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    try:
                        json.loads(line)
                    except ValueError:
                        continue
                    rows.append(line)
                if len(rows) >= count:
                    break
        except (DatasetError, OSError, ImportError):
            rows = []
        source = ", ".join(map(str, inputs)) if rows else "synthetic"
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    if rows:
        tmp.write_text("\n".join(rows) + "\n")
    else:
        from remote.extract import tinymodel

        tinymodel.write_chat_dataset(tmp, num_records=count)
    os.replace(tmp, dest)
    why = None
    if source == "synthetic":
        shown = ", ".join(map(str, inputs))
        why = "no dataset given" if not inputs else f"dataset {shown} not found on the host" \
            if len(found) < len(inputs) else f"no JSON rows in {shown}"
    return {"path": str(dest), "rows": len(rows) or count, "source": source, "why_synthetic": why}


# --------------------------------------------------------------------------- task

def prepare(params: dict) -> dict:
    """The twin and its samples (``params``: :data:`SPEC`, checked); with ``real``, the target's own
    verification run instead (:func:`prepare_real`)."""
    if params.get("real"):
        return prepare_real(params)
    model_path = Path(params["model_path"])
    root = Path(params["work_dir"]) / "smoke"
    count = params["samples"]
    try:
        twin = ensure_twin(model_path, root, params["layers"], params["rebuild"], params["device"])
    except SmokeError:
        raise
    except Exception as exc:
        import traceback

        raise SmokeError("smoke.twin", f"building the tiny twin of {model_path} failed: "
                         f"{type(exc).__name__}: {exc}",
                         "the target's config.json has keys the twin builder cannot shrink; see "
                         "detail.traceback (remote/extract/tinymodel.py) and report it",
                         detail={"traceback": traceback.format_exc()}) from None
    data = write_samples(params["dataset"], Path(twin["root"]) / "samples.jsonl", count)
    seq_len = min(params["seq_len"], SMOKE_SEQ_LEN)
    how = "built" if twin["built"] else "reused"
    summary = (f"tiny twin {how} in {twin['seconds']:.1f}s: {twin['model_type']} "
               f"{'/'.join(twin['architectures'] or [])}, {twin['layers']} layers, hidden "
               f"{twin['hidden_size']}, {twin['bytes'] / 1e6:.1f} MB"
               + (", text_config-wrapped" if twin["wrapped"] else ""))
    records = [
        protocol.record("smoke.twin", protocol.CHANGED if twin["built"] else protocol.OK, summary,
                        detail=twin),
        protocol.record("smoke.samples", protocol.OK if data["source"] != "synthetic" else protocol.WARN,
                        f"{data['rows']} sample(s) from {data['source']}"
                        + (f" ({data['why_synthetic']})" if data["why_synthetic"] else ""),
                        detail=data),
    ]
    return protocol.payload(records, twin_dir=twin["twin_dir"], twin_hash=twin["hash"],
                            dataset=data["path"], samples=count, seq_len=seq_len, twin=twin,
                            layer_ids_note=twin_layer_ids_note(params, twin["layers"]))


def prepare_real(params: dict) -> dict:
    """A short verification run of the target itself: the run's plan (engine, convention, ids), the
    ids it captures instead -- the run's own plus a consecutive pair for each kind of layer
    (:func:`remote.verify.pairs.verification_ids`) -- and the first ``samples`` rows of the run's
    dataset. The run's ``seq_len`` is kept: the real run's samples, cut as it cuts them."""
    from remote.verify import pairs

    model_path = Path(params["model_path"])
    config = target_config(model_path)
    try:
        plan = runplan.resolve(params, config)
    except runplan.PlanError as exc:
        raise SmokeError("smoke.target", str(exc), f"set {exc.field} (inventory or flag) as preflight says") from None
    if plan.problems:
        raise SmokeError("smoke.target", f"the run's layer ids cannot be captured: {'; '.join(plan.problems)}",
                         "fix --layer-ids (specops preflight shows the plan)")
    try:
        chosen = pairs.verification_ids(model_path, config, plan.convention, plan.layer_ids)
    except Exception as exc:  # noqa: BLE001 -- a checkpoint the layer check cannot read: said, with its fix
        fix = getattr(exc, "fix", None) or "run specops preflight: it checks the checkpoint"
        raise SmokeError("smoke.target", f"the layers of {model_path.name} cannot be planned for the layer "
                         f"check: {getattr(exc, 'summary', None) or exc}", fix) from None
    digest = hashlib.sha256(json.dumps([str(model_path), chosen["layer_ids"], params["dataset"]]).encode())
    root = Path(params["work_dir"]) / "smoke" / "real"
    root.mkdir(parents=True, exist_ok=True)
    count = params["samples"]
    data = write_samples(params["dataset"], root / f"samples-{digest.hexdigest()[:12]}.jsonl", count)
    conv = plan.convention
    checked = ", ".join(f"{j} ({', '.join(k)})" for j, k in chosen["layers"].items())
    summary = (f"verification run of {model_path.name} itself ({plan.engine}): ids {conv}:{chosen['layer_ids']} "
               f"= the run's {plan.layer_ids} + {chosen['extra']}, so that decoder layers {checked} are checked "
               f"alone; one load of the real model")
    records = [
        protocol.record("smoke.target", protocol.OK, summary,
                        detail=dict(chosen, engine=plan.engine, run_layer_ids=plan.layer_ids,
                                    model_path=str(model_path))),
        protocol.record("smoke.samples", protocol.OK if data["source"] != "synthetic" else protocol.WARN,
                        f"{data['rows']} sample(s) from {data['source']}"
                        + (f" ({data['why_synthetic']})" if data["why_synthetic"] else ""), detail=data),
    ]
    return protocol.payload(records, twin_dir=str(model_path), twin_hash=digest.hexdigest()[:16],
                            dataset=data["path"], samples=count, seq_len=int(params["seq_len"]),
                            layer_ids=chosen["layer_ids"], layer_convention=conv, engine=plan.engine,
                            real=True, checked_layers=sorted(chosen["layers"]))


def twin_layer_ids_note(params: dict, twin_layers) -> str | None:
    """Why the run's layer ids name no layers of the twin (its run then takes the engine's default
    ids, which exercise the same capture code), or None when they fit: each id range-checked in
    the convention it was typed in (``layer_convention``, else the engine's own, as the run's plan
    reads it)."""
    given = params.get("layer_ids")
    if not given or type(twin_layers) is not int:
        return None
    try:
        engine, _ = runplan.resolve_engine(params.get("engine"))
    except runplan.PlanError:
        return None  # the twin's run says why no engine fits
    typed = params.get("layer_convention") or layers.ENGINE_CONVENTION[engine]
    ints = [x for x in given if type(x) is int]
    if not ints or max(ints) <= layers.top_id(typed, twin_layers):
        return None  # ids that fit, or ids the twin's run refuses by name
    return f"layer ids {list(given)} exceed the twin's {twin_layers} layers; the twin uses the engine's default ids"
