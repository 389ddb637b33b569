"""The HF transformers reference engine: one plain forward pass per sample on CPU.

It is the independent check of the fast engines: the same token ids through
``transformers`` give the states a vLLM-based engine must agree with (within bf16
tolerance). Layer ids use the ``output`` convention (``remote.wire.layers``): id ``i`` is
the output of 0-based decoder layer ``i``, captured with a forward hook on the layer
itself. A hook, rather than ``output_hidden_states``, because HF applies the final
norm to ``hidden_states[N]`` while speculators captures the last layer *before* the
norm; the hook sees exactly what the layer returned, for every layer alike.

TP is ignored (one process); samples run one at a time, so no padding can leak in.
"""
from __future__ import annotations

from remote.system import modelconfig
from remote.wire.contract import HF_REFERENCE

from . import Engine


class HFReferenceEngine(Engine):
    name = HF_REFERENCE
    in_process = True

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._maybe_inject("load")
        dtype = getattr(torch, self.params.get("dtype") or "bfloat16")
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=dtype,
                trust_remote_code=bool(self.params.get("trust_remote_code", True)),
            ).eval()
            self.loaded_as = "AutoModelForCausalLM"
        except (OSError, ValueError, KeyError) as exc:
            # Multimodal wrappers (Kimi-K2.5: text model under text_config, remote code
            # that may not ship with the checkpoint): run the text model alone.
            self.model = load_text_model(self.model_path, dtype, exc).eval()
            self.loaded_as = "text_config model (language_model.* weights)"
        self.layers = decoder_layers(self.model)
        top = max(self.layer_ids)
        if top >= len(self.layers):
            raise ValueError(f"layer id {top} is out of range: the model has {len(self.layers)} "
                             f"decoder layers")
        self._captured = {}
        self._hooks = [self.layers[lid].register_forward_hook(self._hook(lid))
                       for lid in self.layer_ids]

    def _hook(self, layer_id: int):
        def capture(_module, _inputs, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self._captured[layer_id] = hidden.detach()
        return capture

    def extract(self, batch):
        import torch

        self._maybe_inject("extract")
        results = []
        with torch.inference_mode():
            for ids in batch:
                self._captured.clear()
                x = torch.tensor([list(ids)], dtype=torch.long)
                self.model(input_ids=x, use_cache=False)
                results.append([self._captured[lid][0].clone() for lid in self.layer_ids])
        return results

    def close(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        self.model = None

    def describe(self) -> dict:
        return {"name": self.name, "tp": 1, "tp_requested": self.tp,
                "loaded_as": getattr(self, "loaded_as", None),
                "note": "transformers forward on CPU, one sample at a time; TP ignored"}


def load_text_model(model_path: str, dtype, original: Exception):
    """The causal LM under ``text_config``, with the ``language_model.`` weights.

    Only for checkpoints small enough to load in full on CPU (test twins); every
    weight of the text model must be found, or it raises.
    """
    import json
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = modelconfig.read(model_path)
    text = modelconfig.text_config(config)
    if not modelconfig.is_wrapped(config) or "model_type" not in text:
        raise original
    text_config = AutoConfig.for_model(**text)
    model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    prefix = "language_model."
    state = {}
    for shard in shards:
        for key, tensor in load_file(os.path.join(model_path, shard)).items():
            if key.startswith(prefix):
                state[key[len(prefix):]] = tensor
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if "rotary_emb" not in k]
    if missing or not state:
        raise ValueError(f"{model_path}: the text model's weights are not all under "
                         f"'{prefix}*' (missing {missing[:5]}, {len(missing)} in all); "
                         f"loading it as a causal LM failed first with: {original}") from original
    return model.to(dtype)


def decoder_layers(model):
    """The model's list of decoder layers (``model.model.layers`` for Llama/DeepSeek).

    Multimodal wrappers put the text model deeper (``language_model.model.layers``);
    the shortest-named ``ModuleList`` called ``layers`` is the text stack.
    """
    import torch

    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers"]
    if not found:
        raise ValueError(f"{type(model).__name__}: no decoder layer list (a ModuleList named "
                         f"'layers') found")
    return min(found, key=lambda nm: nm[0].count("."))[1]
