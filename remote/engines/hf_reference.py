"""The HF transformers reference engine: one plain forward pass per sample on CPU.

It is the independent check of the fast engines: the same token ids through
``transformers`` give the states a vLLM-based engine must agree with (within bf16
tolerance). Layer ids use the ``output`` convention (``remote.layers``): id ``i`` is
the output of 0-based decoder layer ``i``, captured with a forward hook on the layer
itself. A hook, rather than ``output_hidden_states``, because HF applies the final
norm to ``hidden_states[N]`` while speculators captures the last layer *before* the
norm; the hook sees exactly what the layer returned, for every layer alike.

TP is ignored (one process); samples run one at a time, so no padding can leak in.
"""
from __future__ import annotations

from . import Engine


class HFReferenceEngine(Engine):
    name = "hf-reference"
    in_process = True

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._maybe_inject("load")
        dtype = self.params.get("dtype") or "bfloat16"
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=getattr(torch, dtype),
            trust_remote_code=bool(self.params.get("trust_remote_code", True)),
        ).eval()
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
                "note": "transformers forward on CPU, one sample at a time; TP ignored"}


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
