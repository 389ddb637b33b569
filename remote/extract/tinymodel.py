"""Tiny random "twins" of real checkpoints, and the synthetic chat dataset.

A tiny twin keeps everything that decides *how* a model is loaded and run
(``model_type``, ``architectures``, the DeepSeek family keys such as
``scoring_func`` / ``topk_method`` / ``llama_4_scaling``, MoE routing keys, a
``text_config`` wrapping) and shrinks everything that decides *how big* it is
(layers, hidden size, heads, experts, vocab). Weights are random bf16, written as
several safetensors shards with an index json, like a real download. Nothing is
ever fetched from a model hub.

``python -m remote.extract.tinymodel --out DIR --twin-of /models/Kimi-K2.5`` builds the tiny
twin of a real checkpoint from its ``config.json`` (and copies its tokenizer files and
remote code); ``specops smoke`` builds one the same way (:mod:`remote.extract.smoke`), with a
chat dataset from :func:`write_chat_dataset` where the host has none. The test host's
reference set (three twins of real-sized configs, a small reference tokenizer) is built
from these pieces by ``specops/testhost/reference_models.py``, which real hosts never get.

Checkpoints are written the way ``save_pretrained`` writes them, so they load under
transformers 4 and 5 alike: one tensor per routed expert, as real DeepSeek/Kimi
downloads have them (transformers 5 fuses experts in memory and splits them on save).

Sizes that matter (checked on vLLM 0.16's CPU build): head_dim 64
(the CPU attention backend refuses 16), at least 8 layers (speculators 0.3.0's
default layer ids ``[2, N//2, N-3, N-1]`` collide below that). DeepSeek MLA dims
are ``qk_nope 32 + qk_rope 32 = 64`` so that with ``VLLM_MLA_DISABLE=1`` the
plain attention path runs with head size 64.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

from remote.system import modelconfig

#: The smallest layer count whose speculators 0.3.0 default layer ids don't collide.
MIN_LAYERS = 8
HIDDEN = 256
HEADS = 4
HEAD_DIM = 64
INTERMEDIATE = 512
MOE_INTERMEDIATE = 64
ROUTED_EXPERTS = 8
MAX_EXPERTS_PER_TOKEN = 2
#: MLA dims: nope + rope = 64 = the head size the CPU attention accepts.
MLA_DIMS = {"q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 32, "v_head_dim": 64}
#: The MLA dims that fix attention's head sizes. vLLM's MLA attention accepts only the
#: real ones: its latent cache holds kv_lora_rank + qk_rope_head_dim values per token and
#: ``MLACommonBackend`` supports 576 or 320 of them (``MLA_DIMS`` make 96: on the H200,
#: vLLM 0.25 picked TRITON_MLA and failed the first request with "Head dimension 96 is not
#: supported by MLA."). So a twin meant for a GPU keeps these from its target
#: (``shrink_config(..., keep_mla_head_dims=True)``); ``q_lora_rank`` is only a
#: projection's rank and is shrunk either way.
MLA_HEAD_DIM_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
TINY_VISION = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
               "intermediate_size": 128}
#: Keys whose presence (not value) would make a loader expect a different checkpoint.
DROPPED_KEYS = ("quantization_config", "compression_config")
#: Reference vocabulary size (special tokens + words): the chat dataset's words come from
#: it, and the test host's reference tokenizer (and its models' vocab_size) is exactly it.
REFERENCE_VOCAB = 512

SPECIAL_TOKENS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|end|>", "unk": "<|unk|>"}
ROLE_TOKENS = ("<|start|>", "<|message|>")

_WORDS = """
the a an and or but if then so because of to in on at by for with from about into over
under after before between through during without again is are was were be been being
have has had do does did will would can could should may might must shall i you he she it
we they me him her us them my your his its our their this that these those what which who
whom whose when where why how all any both each few more most other some such no not only
own same than too very just now here there up down out off once model layer state token
head weight shard index host server data train test run load save read write check patch
fix error value number word text chat user assistant system question answer hello please
thanks yes good new old first last long short big small fast slow red blue green cat dog
bird fish tree river stone cloud rain sun moon star light dark day night time year week
world city house road book paper letter music song game story idea plan work help make
take give find tell ask show try call keep start stop turn move live feel think know see
look want need use like go come get put seem leave begin . , ? ! : ; ' -
""".split()
_SYLLABLES = "ka ko ru mi ta ne so lu pe di va zo".split()


# --------------------------------------------------------------------------- configs

def shrink_config(config: dict, num_layers: int = MIN_LAYERS, vocab_size: int | None = None, *,
                  keep_mla_head_dims: bool = False) -> dict:
    """Return the tiny twin's config.json dict for a real model's config.json dict.

    :param config: the real ``config.json`` as a dict (not changed).
    :param num_layers: decoder layers of the twin; at least 8 (see ``MIN_LAYERS``).
    :param vocab_size: the twin's vocab; ``None`` keeps the real one (right when the
        twin reuses the real tokenizer).
    :param keep_mla_head_dims: for an MLA model (DeepSeek-V2/V3, Kimi), keep the target's
        ``MLA_HEAD_DIM_KEYS`` instead of ``MLA_DIMS``: what a twin that runs on a GPU
        needs (vLLM's CUDA MLA kernels reject tiny latent/rope dims), while the default
        tiny dims are what vLLM's CPU attention accepts. No effect on other models.
    :returns: a new dict; a wrapper (``text_config``, ``language_config``) stays one (the text model
        inside is shrunk, a ``vision_config`` beside it is shrunk too).
    :raises ValueError: for ``num_layers < 8``.

    >>> tiny = shrink_config({"model_type": "llama", "hidden_size": 4096,
    ...     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8})
    >>> tiny["hidden_size"], tiny["num_hidden_layers"], tiny["num_key_value_heads"]
    (256, 8, 2)
    """
    if num_layers < MIN_LAYERS:
        raise ValueError(
            f"num_layers={num_layers}: use at least {MIN_LAYERS}, or speculators 0.3.0's "
            f"default EAGLE-3 layer ids [2, N//2, N-3, N-1] collide and layers go missing")
    tiny = copy.deepcopy(config)
    for key in DROPPED_KEYS:
        tiny.pop(key, None)
    wrapper = modelconfig.wrapper_key(tiny)
    if wrapper is not None:
        tiny[wrapper] = _shrink_text(tiny[wrapper], num_layers, vocab_size, keep_mla_head_dims)
        if isinstance(tiny.get("vision_config"), dict):
            tiny["vision_config"] = _shrink_vision(tiny["vision_config"])
        if "vocab_size" in tiny and vocab_size is not None:
            tiny["vocab_size"] = vocab_size
        return tiny
    return _shrink_text(tiny, num_layers, vocab_size, keep_mla_head_dims)


def _shrink_text(cfg: dict, num_layers: int, vocab_size: int | None, keep_mla_head_dims: bool = False) -> dict:
    cfg = copy.deepcopy(cfg)
    for key in DROPPED_KEYS:
        cfg.pop(key, None)
    heads = cfg.get("num_attention_heads", HEADS)
    kv_heads = cfg.get("num_key_value_heads") or heads
    cfg.update(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=num_layers,
               intermediate_size=INTERMEDIATE,
               # Keep grouped-query attention grouped (and divisible by TP=2).
               num_key_value_heads=HEADS if kv_heads >= heads else HEADS // 2)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    if _is_mla(cfg):
        # DeepSeek-V2-Lite style models have q_lora_rank null (a plain q_proj): keep that.
        plain_q = "q_lora_rank" in cfg and cfg["q_lora_rank"] is None
        kept = {key: cfg[key] for key in MLA_HEAD_DIM_KEYS if key in cfg} if keep_mla_head_dims else {}
        cfg.update(MLA_DIMS)
        cfg.update(kept)
        if plain_q:
            cfg["q_lora_rank"] = None
        cfg["num_key_value_heads"] = HEADS
        if "head_dim" in cfg:  # transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim
            cfg["head_dim"] = cfg["qk_rope_head_dim"]
    else:
        cfg["head_dim"] = HEAD_DIM
    _shrink_moe(cfg, num_layers)
    return cfg


def _is_mla(cfg: dict) -> bool:
    return "kv_lora_rank" in cfg and "qk_rope_head_dim" in cfg


def _shrink_moe(cfg: dict, num_layers: int) -> None:
    """Few experts, routing keys kept consistent: top-k <= experts, groups divide experts."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            cfg[key] = ROUTED_EXPERTS
    if cfg.get("num_experts_per_tok"):
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], MAX_EXPERTS_PER_TOKEN)
    if cfg.get("n_group"):
        # 4 groups of 2 experts: the noaux_tc group score (sum of a group's top-2) still works.
        cfg["n_group"] = 1 if cfg["n_group"] == 1 else 4
        cfg["topk_group"] = min(cfg.get("topk_group") or 1, max(1, cfg["n_group"] // 2))
    if cfg.get("n_shared_experts"):
        cfg["n_shared_experts"] = 1
    if cfg.get("first_k_dense_replace"):
        cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], 1)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.get(key):
            cfg[key] = MOE_INTERMEDIATE
    for key in ("num_nextn_predict_layers",):
        if key in cfg:
            cfg[key] = 0  # MTP layers are not part of the decoder stack we extract from


def _shrink_vision(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for key, value in TINY_VISION.items():
        if key in cfg or key == "hidden_size":
            cfg[key] = value
    if "mm_hidden_size" in cfg:
        cfg["mm_hidden_size"] = TINY_VISION["hidden_size"]
    return cfg


# --------------------------------------------------------------------------- weights

def _hf_config_class(cfg: dict):
    """The transformers config class for a (text) config dict, without remote code."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    by_arch = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
               "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}
    for arch in cfg.get("architectures") or []:
        if arch in by_arch:
            return CONFIG_MAPPING[by_arch[arch]]
    raise ValueError(
        f"config model_type={model_type!r} (architectures={cfg.get('architectures')}) is "
        f"unknown to transformers without remote code; add its architecture to "
        f"remote.extract.tinymodel._hf_config_class's by_arch table")


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _split_shards(tensors: dict, num_shards: int) -> list[dict]:
    """Cut tensors (in layer order) into ``num_shards`` contiguous, byte-balanced groups."""
    names = sorted(tensors, key=_natural_key)
    if len(names) < num_shards:
        raise ValueError(f"{len(names)} tensors cannot fill {num_shards} shards")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards, current, filled = [], {}, 0
    for i, name in enumerate(names):
        current[name] = tensors[name]
        filled += tensors[name].numel() * tensors[name].element_size()
        left_names, left_shards = len(names) - i - 1, num_shards - len(shards) - 1
        if left_shards and (filled >= total * (len(shards) + 1) / num_shards
                            or left_names == left_shards):
            shards.append(current)
            current = {}
    shards.append(current)
    return shards


def write_shards(tensors: dict, out_dir: Path, num_shards: int) -> dict:
    """Write bf16 safetensors shards plus ``model.safetensors.index.json``; return the index."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for i, shard in enumerate(_split_shards(tensors, num_shards), start=1):
        filename = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out_dir / filename),
                  metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = filename
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def _random_text_model(text_cfg: dict, seed: int):
    """Random-weight causal LM for a text config; returns (model, full config dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    config_cls = _hf_config_class(text_cfg)
    known = {k: v for k, v in text_cfg.items() if k != "model_type"}
    hf_config = config_cls(**known)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    # to_diff_dict drops transformers' generic defaults (id2label, top_k, ...), as
    # save_pretrained does; then our keys win: original model_type, extra family keys.
    full = hf_config.to_diff_dict()
    full.update(text_cfg)
    full["torch_dtype"] = "bfloat16"
    return model, full


def checkpoint_tensors(model) -> dict:
    """The tensors a checkpoint of ``model`` holds, named as real checkpoints name them.

    transformers 5 fuses a MoE's routed experts in memory (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``), so its ``state_dict()`` is not what a DeepSeek/Kimi download holds
    (``mlp.experts.{j}.gate_proj.weight`` ...); ``save_pretrained`` converts back to the
    per-expert layout that vLLM and transformers 4 load. transformers 4 writes its
    ``state_dict()`` as is. Either way, what ``save_pretrained`` wrote is what we shard.
    """
    import tempfile

    from safetensors.torch import load_file

    tensors = {}
    with tempfile.TemporaryDirectory(prefix="specops-tiny-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
    if not tensors:
        raise ValueError(f"save_pretrained wrote no safetensors for {type(model).__name__}")
    return tensors


#: where a wrapper's checkpoint keeps the language model's weights, by the config key that
#: wraps it: Kimi-K2.5 (``text_config``) and DeepSeek-VL2 (``language_config``), as vLLM loads them.
WRAPPED_WEIGHT_PREFIX = {"text_config": "language_model.", "language_config": "language."}


def build_model(config: dict, out_dir, *, num_shards: int = 3, seed: int = 0,
                tokenizer_dir=None, tokenizer=None) -> Path:
    """Write a random-weight checkpoint for ``config`` (already tiny) into ``out_dir``.

    :param config: a config.json dict, e.g. from :func:`shrink_config`. A
        wrapper (``text_config`` or ``language_config``) builds the text model inside and
        stores its weights under :data:`WRAPPED_WEIGHT_PREFIX`.
    :param num_shards: safetensors shards to write (>= 2 makes the index matter).
    :param tokenizer_dir: copy this checkpoint's tokenizer files.
    :param tokenizer: or save this tokenizer object (``save_pretrained``); its size must
        equal the config's vocab_size. One of the two is needed.
    :returns: ``out_dir`` as a Path.
    :raises ValueError: for neither or both of ``tokenizer_dir`` and ``tokenizer``.
    """
    if (tokenizer_dir is None) == (tokenizer is None):
        raise ValueError("build_model needs exactly one of tokenizer_dir and tokenizer")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapper = modelconfig.wrapper_key(config)
    text_cfg = modelconfig.text_config(config)
    model, full_text_cfg = _random_text_model(text_cfg, seed)
    prefix = WRAPPED_WEIGHT_PREFIX[wrapper] if wrapper else ""
    tensors = {prefix + name: tensor for name, tensor in checkpoint_tensors(model).items()}
    write_shards(tensors, out_dir, num_shards)
    if wrapper:
        written = copy.deepcopy(config)
        written[wrapper] = full_text_cfg
        written.setdefault("torch_dtype", "bfloat16")
    else:
        written = full_text_cfg
    (out_dir / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    generation = {k: text_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if text_cfg.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    else:
        tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    return out_dir


TOKENIZER_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json",
                           "chat_template*", "*.tiktoken", "tiktoken*", "vocab*", "merges.txt",
                           "tokenization_*.py")


def copy_tokenizer(src, dst) -> list[str]:
    """Copy a checkpoint's tokenizer files (incl. remote-code tokenizers); returns names."""
    src, copied = Path(src), []
    for pattern in TOKENIZER_FILE_PATTERNS:
        for path in sorted(src.glob(pattern)):
            if path.is_file():
                shutil.copy2(path, Path(dst) / path.name)
                copied.append(path.name)
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src} (looked for {TOKENIZER_FILE_PATTERNS})")
    return copied


# --------------------------------------------------------------------------- dataset

def reference_vocab(size: int = REFERENCE_VOCAB) -> list[str]:
    """Special tokens, then common words, then made-up syllable words up to ``size``."""
    vocab = list(SPECIAL_TOKENS.values()) + list(ROLE_TOKENS)
    for word in _WORDS:
        if word not in vocab:
            vocab.append(word)
    for a in _SYLLABLES:
        for b in _SYLLABLES:
            for c in ("", "n", "r"):
                if len(vocab) >= size:
                    return vocab
                vocab.append(a + b + c)
    return vocab


def write_chat_dataset(path, num_records: int = 24, seed: int = 0) -> Path:
    """A chat JSONL in the ShareGPT-like shape speculators 0.3.0 reads.

    ``speculators.data_generation.preprocessing`` takes the ``conversations`` column
    and accepts ``role``/``content`` (or ``from``/``value``) per turn, with roles
    user/assistant (or human/gpt). Every word is in the reference vocab, lengths
    vary (about 20 to 150 tokens templated), and every 4th record has two rounds.
    """
    rng = random.Random(seed)
    words = [w for w in reference_vocab() if not w.startswith("<|")]

    def sentence(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    path = Path(path)
    with path.open("w") as fh:
        for i in range(num_records):
            rounds = 2 if i % 4 == 3 else 1
            turns = []
            for _ in range(rounds):
                turns.append({"role": "user", "content": sentence(4, 16)})
                turns.append({"role": "assistant", "content": sentence(8, 48)})
            fh.write(json.dumps({"id": f"chat-{i:03d}", "conversations": turns}) + "\n")
    return path


# --------------------------------------------------------------------------- twins

#: Files besides the tokenizer that a twin takes from the real checkpoint: remote code
#: (config, modeling, processors) and processor configs, so it loads the way the real one does.
TWIN_EXTRA_PATTERNS = ("*.py", "preprocessor_config.json", "processor_config.json")


def build_twin(model_dir, out_dir, *, num_layers: int = MIN_LAYERS, num_shards: int = 3,
               tiny_config: dict | None = None) -> Path:
    """Tiny twin of the checkpoint in ``model_dir``: its config shrunk, random weights,
    its own tokenizer, remote code and processor configs copied. No weights are read.

    :param tiny_config: the twin's config when the caller has already shrunk (and
        adjusted) it; default ``shrink_config`` of the checkpoint's config.json.
    """
    model_dir = Path(model_dir)
    if tiny_config is None:
        tiny_config = shrink_config(modelconfig.read(model_dir), num_layers=num_layers)
    out = build_model(tiny_config, out_dir, num_shards=num_shards, tokenizer_dir=model_dir)
    for pattern in TWIN_EXTRA_PATTERNS:
        for path in sorted(model_dir.glob(pattern)):
            if path.is_file() and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.extract.tinymodel", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write into")
    parser.add_argument("--twin-of", required=True, help="the real checkpoint dir to build a tiny twin of")
    parser.add_argument("--layers", type=int, default=MIN_LAYERS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    twin = build_twin(args.twin_of, args.out, num_layers=args.layers)
    print(json.dumps({"twin": str(twin)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
