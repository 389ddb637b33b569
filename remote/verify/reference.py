"""The transformers reference: the run's own model, one sample at a time, no padding, no
KV cache, in float32 by default on CPU.

The residual stream is taken with forward hooks on every decoder layer
(``stream[0]`` = embeddings, ``stream[k]`` = output of layer ``k-1``,
:class:`StreamRecorder`): HF applies the final norm to ``hidden_states[N]``, while the
engines capture the last layer *before* that norm, and a hook sees exactly what each
layer returned. A recorded layer id maps to a stream index through its recorded
convention (``remote.wire.layers.hf_hidden_state_index``: ``output:i`` -> ``stream[i+1]``,
``input:i`` -> ``stream[i]``; ``input:N`` is the last layer's output before the norm).
It runs under transformers 4 (the seed stack) and 5 (the modern stack) alike. A model
with ``llama_4_scaling`` gets it as vLLM computes it (:mod:`remote.verify.scaling`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from remote.system import modelconfig
from remote.verify.compare import COS_TOL, FLOOR_FACTOR, FLOOR_MIN, REL_TOL, WARN_SHARE
from remote.verify.scaling import Llama4Scaling, hf_implements_llama4, scaling_config
from remote.wire import protocol


@dataclass
class Reference:
    """A loaded reference and how it treats llama_4_scaling.

    ``hook`` is the attention function that applies ``scaling`` (None when the config has
    none); it is ``active`` unless transformers applies the scaling itself.
    """

    model: object
    #: the model's (text) config as a dict.
    text: dict
    #: which loader built it, for the report.
    how: str
    #: the config's ``llama_4_scaling`` block, or None.
    scaling: dict | None
    hook: Llama4Scaling | None

    @property
    def scaling_by(self) -> str | None:
        """Who applies ``llama_4_scaling`` in this reference, for the report (None: no scaling)."""
        if self.scaling is None:
            return None
        if self.hook is not None and self.hook.active:
            return "specops attention hook (vLLM _get_llama_4_scaling formula; transformers lacks it)"
        return "transformers itself"


def load_reference(model_path: str, dtype: str, trust_remote_code: bool) -> Reference:
    """The HF causal LM of the run's model (a ``text_config`` wrapper loads its text model)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = modelconfig.read(model_path)
    text = modelconfig.text_config(config)
    scaling = scaling_config(text)
    kwargs = {"dtype": getattr(torch, dtype)}
    hook = Llama4Scaling(scaling) if scaling is not None else None
    if hook is not None:
        kwargs["attn_implementation"] = hook.register()
    if text is config:
        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=trust_remote_code, **kwargs)
        how = "AutoModelForCausalLM"
    else:
        # The wrapper (e.g. kimi_k25) is remote code we may not have; its text model is a
        # plain transformers model whose weights sit under ``language_model.``.
        from remote.extract.tinymodel import _hf_config_class

        config_cls = _hf_config_class(text)
        hf_config = config_cls(**{k: v for k, v in text.items() if k != "model_type"})
        model = load_prefixed(Path(model_path), WRAPPED_PREFIX, hf_config, kwargs)
        how = f"{type(model).__name__} from text_config (weights under {WRAPPED_PREFIX})"
    model.eval()
    if hook is not None:
        hook.active = not hf_implements_llama4(model)
    return Reference(model=model, text=text, how=how, scaling=scaling, hook=hook)


def reference_record(reference: Reference, model_path: str, dtype: str, num_layers: int) -> dict:
    """The ``verify.reference`` record: which forward the layers are compared with, and the thresholds."""
    import transformers

    scaling = reference.scaling
    return protocol.record(
        "verify.reference", protocol.OK,
        f"transformers {transformers.__version__} {dtype} forward of {Path(model_path).name} on CPU "
        f"({reference.how})" + (f"; llama_4_scaling by {reference.scaling_by}" if scaling else ""),
        detail={"model_path": str(model_path), "dtype": dtype, "loader": reference.how, "num_layers": num_layers,
                "llama_4_scaling": scaling, "llama_4_scaling_by": reference.scaling_by,
                "thresholds": {"rel_tol": REL_TOL, "cos_tol": COS_TOL, "warn_share": WARN_SHARE,
                               "floor_factor": FLOOR_FACTOR, "floor_min": FLOOR_MIN}})


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
    from remote.extract.engines.hf_reference import decoder_layers as find

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
