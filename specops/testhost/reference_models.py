"""The test host's reference set: three tiny twins of real model families and a chat dataset.

``llama/``, ``deepseek_v3/`` (DeepSeek-V3 with ``llama_4_scaling``), ``kimi_k25/`` (a
``text_config`` wrapper with a vision tower config) and ``chat.jsonl``, built by the
twin machinery of :mod:`remote.extract.tinymodel` from the real-sized configs below, with a small
word-level reference tokenizer. This is test-host knowledge, not something a real host
needs, so it lives with the test host and travels in no bundle.

It runs in the host env's python (it needs torch, transformers and tokenizers), with the
``remote/`` tree on its path; :func:`specops.testhost.models.ensure_models` runs it by
path and caches the result::

    python specops/testhost/reference_models.py --out DIR    # PYTHONPATH=<dir holding remote/>

It prints a JSON dict of the paths. At import it needs the standard library and
``remote`` alone (heavy packages load inside the functions), like ``remote/`` itself.

What was found about Kimi-K2.5 (``model_type: kimi_k25``), checked on the test host:

* transformers 4.57 has no ``kimi_k25``: ``AutoConfig.from_pretrained(dir,
  trust_remote_code=False)`` raises ``ValueError`` ("contains custom code ... pass
  trust_remote_code=True"), and with ``trust_remote_code`` left at ``None`` it
  *asks on stdin* first, so callers must pass False (and close stdin). The text
  model is plain DeepSeek-V3: ``DeepseekV3Config(**config["text_config"])`` builds
  it, and its weights are the checkpoint's tensors minus the ``language_model.``
  prefix.
* vLLM 0.16 ships its own ``KimiK25Config`` (``vllm/transformers_utils/configs/
  kimi_k25.py``, no remote code needed for the config) and
  ``KimiK25ForConditionalGeneration`` (``models/kimi_k25.py``): the language model
  is ``DeepseekV2ForCausalLM`` built from ``text_config`` under the prefix
  ``language_model`` (weights ``language_model.model.layers.N...``,
  ``language_model.lm_head.weight``; the legacy ``language_model.layers.`` is
  mapped too). With ``limit_mm_per_prompt={"vision_chunk": 0}`` the vision tower
  and projector are skipped (no vision weights needed), but start-up still builds
  the media processor with ``AutoImageProcessor.from_pretrained(model,
  trust_remote_code=True)``, i.e. the checkpoint's own remote code. A real
  Kimi-K2.5 ships that code; our tiny twin ships a text-only stand-in
  (``KIMI_K25_PROCESSOR_SOURCE``). So the tiny twin loads and generates in vLLM 0.16
  CPU at TP=1 and TP=2 with ``VLLM_MLA_DISABLE=1`` and that limit. Without the
  limit, start-up profiles with dummy media and the stand-in refuses (by design).

``llama_4_scaling``: vLLM 0.16 ``DeepseekV2Model.forward`` reads exactly
``original_max_position_embeddings`` and ``beta`` and multiplies q by
``1 + beta * log(1 + floor(pos / original_max_position_embeddings))``. With
``original_max_position_embeddings = 16`` every position >= 16 is scaled, so any
test sequence longer than 16 tokens sees it (tests/test_tinymodels.py proves it:
same weights with and without the key give identical logprobs before position 16
and different ones after). transformers 4.57's DeepseekV3 does NOT implement
``llama_4_scaling``, so an HF reference of this model differs from vLLM's states at
positions >= 16 by design; compare HF and vLLM only on the first 16 positions, or
drop the key for such a comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from remote.extract.tinymodel import (MIN_LAYERS, REFERENCE_VOCAB, ROLE_TOKENS, SPECIAL_TOKENS, build_model,
                                      reference_vocab, shrink_config, write_chat_dataset)

#: Renders ``<|start|>ROLE<|message|>TEXT<|end|>`` per message. speculators 0.3.0
#: finds the assistant spans by the ``<...assistant`` marker and the text after the
#: last assistant message, which this layout gives it unambiguously.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)
#: The Kimi-K2.5 checkpoint's image processor is remote code that vLLM 0.16 loads
#: even for text-only use (``KimiK25ProcessingInfo.__init__``). The reference twin
#: ships this text-only stand-in, written by us, beside its weights: it satisfies
#: the attributes vLLM reads at start-up and refuses any real image or video.
KIMI_K25_PROCESSOR_MODULE = "kimi_k25_text_only_processor"
KIMI_K25_PROCESSOR_SOURCE = '''"""Text-only stand-in for Kimi-K2.5's remote-code media processor (tiny test twin).

vLLM 0.16 builds the media processor whenever it starts a kimi_k25 model, even with
limit_mm_per_prompt={"vision_chunk": 0}. This stand-in lets the text model load; it
cannot process media. Written by specops (specops/testhost/reference_models.py), not by Moonshot AI.
"""
from transformers.image_processing_utils import BaseImageProcessor


class TextOnlyKimiK25ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.num_frames_per_chunk = num_frames_per_chunk

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(
            "this tiny Kimi-K2.5 twin is text-only: start vLLM with "
            "limit_mm_per_prompt={'vision_chunk': 0}")

    media_tokens_calculator = _refuse
    preprocess = _refuse
    split_video_chunks = _refuse
'''


# --------------------------------------------------------------------------- tokenizer

def reference_tokenizer():
    """A small WordLevel PreTrainedTokenizerFast with bos/eos/pad/unk and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = reference_vocab()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)},
                                     unk_token=SPECIAL_TOKENS["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS["bos"], eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"], unk_token=SPECIAL_TOKENS["unk"],
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_ids() -> dict:
    """The reference tokenizer's pad/bos/eos ids, as the models' configs name them."""
    vocab = reference_vocab()
    return {"pad_token_id": vocab.index(SPECIAL_TOKENS["pad"]),
            "bos_token_id": vocab.index(SPECIAL_TOKENS["bos"]),
            "eos_token_id": vocab.index(SPECIAL_TOKENS["eos"])}


# --------------------------------------------------------------------------- references

#: Real-sized configs (public key layout, trimmed) that the reference twins are shrunk from.
LLAMA_LIKE = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 128256,
}
DEEPSEEK_V3_LIKE = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1,
    # vLLM 0.16 reads exactly these two keys; 16 makes every position >= 16 scaled.
    "llama_4_scaling": {"original_max_position_embeddings": 16, "beta": 0.5},
}
KIMI_K25_LIKE = {
    "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                 "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "media_placeholder_token_id": 0, "pad_token_id": 0,
    "text_config": dict({k: v for k, v in DEEPSEEK_V3_LIKE.items() if k != "llama_4_scaling"},
                        n_routed_experts=384, n_group=1, topk_group=1,
                        first_k_dense_replace=1, num_attention_heads=64),
    "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14,
                      "hidden_size": 1152, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "intermediate_size": 4304,
                      "merge_kernel_size": [2, 2], "mm_hidden_size": 1152},
}


def reference_configs() -> dict:
    """The three reference twins' configs, each shrunk from a real-sized config."""
    ids = token_ids()
    out = {}
    for name, real in (("llama", LLAMA_LIKE), ("deepseek_v3", DEEPSEEK_V3_LIKE),
                       ("kimi_k25", KIMI_K25_LIKE)):
        tiny = shrink_config(real, num_layers=MIN_LAYERS, vocab_size=REFERENCE_VOCAB)
        target = tiny["text_config"] if "text_config" in tiny else tiny
        target.update(ids)
        target["max_position_embeddings"] = 2048
        out[name] = tiny
    out["kimi_k25"]["pad_token_id"] = ids["pad_token_id"]
    out["kimi_k25"]["media_placeholder_token_id"] = REFERENCE_VOCAB - 1
    return out


def make_reference_models(out_root) -> dict:
    """Build the test host's tiny models and chat dataset under ``out_root``.

    :returns: ``{"llama": Path, "deepseek_v3": Path, "kimi_k25": Path, "dataset": Path}``.
    """
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for seed, (name, config) in enumerate(reference_configs().items()):
        paths[name] = build_model(config, out_root / name, num_shards=3, seed=seed,
                                  tokenizer=reference_tokenizer())
    write_text_only_kimi_processor(paths["kimi_k25"])
    paths["dataset"] = write_chat_dataset(out_root / "chat.jsonl")
    return paths


def write_text_only_kimi_processor(out_dir) -> Path:
    """Put the text-only media processor stand-in (and its preprocessor_config.json) in a model dir."""
    out_dir = Path(out_dir)
    (out_dir / f"{KIMI_K25_PROCESSOR_MODULE}.py").write_text(KIMI_K25_PROCESSOR_SOURCE)
    preprocessor = {
        "auto_map": {"AutoImageProcessor":
                     f"{KIMI_K25_PROCESSOR_MODULE}.TextOnlyKimiK25ImageProcessor"},
        "image_processor_type": "TextOnlyKimiK25ImageProcessor",
        "num_frames_per_chunk": 4,
        # the real checkpoint's media settings: vLLM >= 0.2x builds its own fused processor
        # from them at start-up, text-only or not
        "media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                           "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2,
                           "temporal_merge_kernel_size": 4, "fixed_output_tokens": None,
                           "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
                           "sample_fps": 2.0, "timestamp_mode": "hh:mm:ss.fff", "config_type": "image"},
    }
    path = out_dir / "preprocessor_config.json"
    path.write_text(json.dumps(preprocessor, indent=2) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reference_models.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write into")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    paths = make_reference_models(args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
