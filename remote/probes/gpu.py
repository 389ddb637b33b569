"""GPU-only preflight facts: the driver's CUDA against the env's torch, and CUDA memory per TP rank.

Two questions a CPU host never asks, answered without importing torch or vLLM:

* **driver vs torch build.** A torch built for CUDA 13.0 (``2.11.0+cu130``) on a driver
  whose ``nvidia-smi`` banner says ``CUDA Version: 12.8`` fails at the first CUDA call,
  long after the model started loading. The banner is parsed from plain ``nvidia-smi``
  (:func:`parse_smi_banner`) and the build from torch's own ``torch/version.py``, read
  as text where ``importlib`` finds the package (:func:`torch_build`).
* **memory per rank.** What vLLM will do with ``gpu_memory_utilization x total``: the
  weights of one rank, the non-KV overhead of its profile run at the step budget the engine
  passes (:func:`overhead_terms`, :func:`engine_batched_tokens`), and the rest as KV cache, which with
  hidden-state extraction is shared by the model's own KV *and* the cache of captured
  states (``len(layer_ids) x hidden`` per token, not split over TP). The plan says how
  many tokens fit (:func:`plan_rank_memory`); vLLM logs what it really did
  (:func:`parse_engine_memory`: "Model loading took", "Available KV cache memory",
  "GPU KV cache size", CUDA graph memory), and :func:`compare` puts the two side by
  side, so a run's summary can show predicted vs used and tests can hold the numbers
  recorded on a real H200 (``tests/fixtures/gpu/``).

    >>> parse_smi_banner("| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |")
    {'smi_version': '580.159.04', 'driver_version': '580.159.04', 'cuda_version': '13.0'}
    >>> cuda_fit("13.0", "13.0")[0], cuda_fit("12.8", "13.0")[0]
    ('ok', 'fail')

The probe (:func:`probe`) runs after ``host`` (visible GPUs), ``model`` and
``checkpoint`` (weight bytes); on ``device: cpu`` it says skipped and runs nothing.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil

from remote.probes import Context
from remote.system import modelconfig
from remote.wire.layers import OUTPUT, default_layer_ids
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import GiB, MiB, human_bytes

#: The non-KV overhead of one rank is what vLLM's profile run takes before it sizes the KV cache
#: (``gpu_worker.determine_available_memory``: non-torch increase + torch peak + the CUDA graph
#: estimate). The torch peak is the allocator's largest moment of ``profile_run`` (one forward of
#: ``max_num_batched_tokens`` over ``min(tokens, max_num_seqs)`` requests with no attention metadata,
#: then the sampler warm-up on one row a request; torch.compile's first compile runs inside it), and
#: :func:`profile_moments` names the moments that can be it, read in vLLM 0.25.1 and 0.26.0 (the same
#: code on this path). Checked against every GPU fixture (tests/test_memory_plan.py).
#:
#: CUDA context, cuBLAS/NCCL workspaces and loaded kernels outside torch's allocator, per rank (vLLM 0.26
#: logs 0.23 GiB "for non-torch memory" at every width the fixtures have)
NON_TORCH_BYTES = int(0.23 * GiB)
#: what the profile's first GEMMs allocate and keep (cuBLAS(Lt) workspaces; fitted 0.028-0.035 GiB)
PROFILE_CONSTANT_BYTES = int(0.03 * GiB)
#: Inductor's L2-flush buffer while a compiled reduction autotunes at its first call (the L2 of an
#: H100/H200); only with CUDA graphs (compiled) on a cold compile cache
AUTOTUNE_FLUSH_BYTES = 50 * MiB
#: MLA's profile-time prefill workspace (``mla_attention.determine_chunked_prefill_workspace_size``):
#: ``max(min(max(8 x max_model_len, 4 x max_num_seqs x block), 64 Ki), max_num_seqs x block)`` tokens of
#: ``heads x (qk_nope + v_head)`` bf16, allocated and dropped where attention is skipped
MLA_WORKSPACE_MODEL_LENS, MLA_WORKSPACE_CAP_TOKENS = 8, 64 * 1024
#: bytes a logit of the sampler warm-up holds at its peak (``_dummy_sampler_run``) with a speculative config, as
#: every server specops plans has (extraction's ``extract_hidden_states``, a draft's): the rejection sampler's
#: bf16 and float32 copies, its probabilities and their reciprocal (14 without one)
SAMPLER_BYTES_PER_LOGIT = 30
#: the Triton top-k/top-p buffer's rows: the next power of two of the requests, at most the SMs of an
#: H100/H200 (132)
SAMPLER_TOPK_ROWS = 132
#: the CUDA graph pool (vLLM's "Estimated CUDA graph memory"): a floor plus the activations of the
#: largest captured batch (fitted on the fixtures' 0.09-0.19 GiB: 1.3 copies at 512 tokens).
GRAPH_BASE_BYTES = int(0.09 * GiB)
GRAPH_ACTIVATION_COPIES = 1.3
#: vLLM's largest captured batch (``max_cudagraph_capture_size``'s default)
GRAPH_MAX_CAPTURE_TOKENS = 512
#: vLLM's ``max_num_seqs`` default for the API server: 1024 on a GPU of 70 GiB or more (H100,
#: H200; A100 excepted), else 256 (``EngineArgs._set_default_args``).
MAX_NUM_SEQS_BIG_GPU, MAX_NUM_SEQS = 1024, 256
BIG_GPU_BYTES = 70 * GiB
#: vLLM's KV block: a request of ``max_model_len`` tokens holds whole blocks, and its log's "GPU KV cache
#: size" is the requests that fit times ``max_model_len`` (``kv_cache_utils.get_kv_cache_capacity``):
#: 0.945 of the room's tokens at 257, 0.896 at 129 in every fixture.
KV_BLOCK_TOKENS = 16
#: vLLM's CPU backend's block (its default ``block_size``): the CPU fixtures' 0.504 at 129, 0.669 at 257
CPU_KV_BLOCK_TOKENS = 128
#: fewer whole requests of ``seq_len`` tokens than this in the KV cache fails the check.
MIN_REQUESTS_IN_CACHE = 1

_BANNER = re.compile(r"NVIDIA-SMI\s+(?P<smi>[\w.-]+)\s+Driver Version:\s+(?P<driver>[\w.-]+)"
                     r"(?:\s+CUDA Version:\s+(?P<cuda>[\w.]+))?")
_TORCH_VERSION = re.compile(r"^__version__\s*(?::[^=]*)?=\s*['\"](?P<v>[^'\"]+)['\"]", re.M)
_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(?P<v>None|['\"][^'\"]*['\"])", re.M)

#: vLLM log lines the engine's memory is read from (vLLM 0.2x V1 engine wording).
_RANK = re.compile(r"\((?P<proc>[A-Za-z][\w]*) pid=\d+\)")
_LOG_PATTERNS = {
    "model_load_gib": re.compile(r"Model loading took (?P<v>[\d.]+) GiB(?: memory)? and (?P<s>[\d.]+) seconds"),
    "weights_load_s": re.compile(r"Loading weights took (?P<v>[\d.]+) seconds"),
    "available_kv_gib": re.compile(r"Available KV cache memory: (?P<v>-?[\d.]+) GiB"),
    "kv_cache_tokens": re.compile(r"[GC]PU KV cache size: (?P<v>[\d,]+) tokens"),
    # a CPU host's KV cache is VLLM_CPU_KVCACHE_SPACE, no profile: the worker says what it set
    "cpu_kvcache_gib": re.compile(r"Explicitly set \((?P<v>[\d.]+)/[\d.]+\) GiB for KV cache"),
    "max_concurrency": re.compile(r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<v>[\d.]+)x"),
    "graph_capture": re.compile(r"Graph capturing finished in (?P<s>[\d.]+) secs, took (?P<v>-?[\d.]+) GiB"),
    "cuda_graph_pool": re.compile(r"CUDA graph pool memory: (?P<v>[\d.]+) GiB \(actual\), (?P<e>[\d.]+) GiB"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<v>[\d.]+)"),
    "torch_compile_s": re.compile(r"torch\.compile took (?P<v>[\d.]+) s in total"),
    "attention_backend": re.compile(r"Using (?P<v>[A-Z0-9_]+) (?:attention )?backend"),
    "cudagraph_mode": re.compile(r"cudagraph_mode[=:]\s*(?:<?CUDAGraphMode\.)?(?P<v>[A-Z_]+)"),
    # vLLM 0.26+: the device's memory as CUDA sees it (an H100's is below nvidia-smi's memory.total)
    "device_total_gib": re.compile(r"Free memory on device \([\d.]+/(?P<v>[\d.]+) GiB\)"),
    "graph_estimate_gib": re.compile(r"Estimated CUDA graph memory: (?P<v>[\d.]+) GiB"),
    # vLLM 0.26+: the profile's own breakdown of the non-KV memory
    "peak_activation_gib": re.compile(r"GiB for weight, (?P<v>[\d.]+) GiB for peak activation"),
    "non_torch_gib": re.compile(r"GiB for peak activation, (?P<v>[\d.]+) GiB for non-torch memory"),
    # the step budget the server ran with: its compile range ends there (every vLLM 0.2x V1 start says it)
    "max_num_batched_tokens": re.compile(r"compile_ranges_endpoints'?[=:]\s*\[(?P<v>\d+)\]"),
}
#: the log facts that are the engine's (one per server), not a rank's
_ENGINE_KEYS = ("kv_cache_tokens", "max_concurrency", "init_engine_s", "cudagraph_mode", "max_num_batched_tokens")


# ------------------------------------------------------------------ pure parsers


def parse_smi_banner(text: str) -> dict | None:
    """Driver and CUDA version from the banner of plain ``nvidia-smi`` (None when absent)."""
    found = _BANNER.search(text or "")
    if not found:
        return None
    return {"smi_version": found.group("smi"), "driver_version": found.group("driver"),
            "cuda_version": found.group("cuda")}


def parse_torch_version_py(text: str) -> dict:
    """``torch/version.py`` -> ``{"torch_version": "2.11.0+cu130", "cuda": "13.0" or None}``."""
    version = _TORCH_VERSION.search(text or "")
    cuda = _TORCH_CUDA.search(text or "")
    cuda_value = None
    if cuda and cuda.group("v") != "None":
        cuda_value = cuda.group("v").strip("'\"") or None
    return {"torch_version": version.group("v") if version else None, "cuda": cuda_value}


def torch_build(find_spec=importlib.util.find_spec) -> dict | None:
    """The torch this python would import, read from its files (torch is not imported).

    :returns: ``{"torch_version", "cuda", "path"}``, or None when torch is not installed.
    """
    try:
        spec = find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as handle:
            facts = parse_torch_version_py(handle.read())
    except OSError:
        facts = {"torch_version": None, "cuda": None}
    facts["path"] = root
    return facts


def _version_tuple(text) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", str(text or ""))[:2]) or (0,)


def cuda_fit(driver_cuda, torch_cuda) -> tuple:
    """``(status, summary, fix)`` of a driver that supports CUDA ``driver_cuda`` running a
    torch built for ``torch_cuda``. Newer driver: fine. Same major, older minor: CUDA's
    minor-version compatibility usually carries it (warn: kernels built as PTX for the
    newer minor fail). Older major: every CUDA call fails."""
    if not torch_cuda:
        return (FAIL, "the env's torch is a CPU-only build (no CUDA) but device is cuda",
                "install the CUDA build of torch that vLLM pins, or set device: cpu")
    if not driver_cuda:
        return (WARN, f"the driver's CUDA version is unknown (nvidia-smi printed none); torch wants CUDA {torch_cuda}",
                "check `nvidia-smi` on the host")
    have, want = _version_tuple(driver_cuda), _version_tuple(torch_cuda)
    if have >= want:
        return OK, f"driver supports CUDA {driver_cuda}, torch is built for CUDA {torch_cuda}", None
    if have[:1] == want[:1]:
        return (WARN, f"driver supports CUDA {driver_cuda}, older than torch's CUDA {torch_cuda} (minor-version "
                      f"compatibility; PTX-only kernels would fail)",
                f"upgrade the NVIDIA driver to one that supports CUDA {torch_cuda}")
    return (FAIL, f"driver supports CUDA {driver_cuda} but torch is built for CUDA {torch_cuda}: every CUDA call fails",
            f"upgrade the NVIDIA driver to one that supports CUDA {torch_cuda}, or install a torch/vLLM built "
            f"for CUDA {driver_cuda}")


def parse_engine_memory(text: str) -> dict:
    """What a vLLM server log says about memory and start-up, per rank.

    Lines a worker prints carry ``(Worker pid=..)`` (TP=1), ``(Worker_TP<k> pid=..)``,
    or no prefix at all when the engine runs in the API server's process; those count
    as rank 0. KV-cache size lines come from the engine core and apply to every rank.

    :returns: ``{"ranks": {0: {...}, 1: {...}}, "engine": {...}}`` with numbers as floats
        (GiB, seconds) and ``kv_cache_tokens`` as an int.
    """
    ranks: dict = {}
    engine: dict = {}
    for line in (text or "").splitlines():
        proc = _RANK.search(line)
        name = proc.group("proc") if proc else ""
        rank = None
        if name.startswith("Worker"):
            found = re.search(r"_TP(\d+)", name)
            rank = int(found.group(1)) if found else 0
        for key, pattern in _LOG_PATTERNS.items():
            found = pattern.search(line)
            if not found:
                continue
            value = found.group("v")
            target = engine if key in _ENGINE_KEYS else ranks.setdefault(rank or 0, {})
            if key == "kv_cache_tokens":
                target[key] = int(value.replace(",", ""))
            elif key == "max_num_batched_tokens":
                target.setdefault(key, int(value))
            elif key == "max_concurrency":
                target[key] = float(value)
                target["max_model_len"] = int(found.group("len").replace(",", ""))
            elif key == "model_load_gib":
                target[key] = float(value)
                target["model_load_s"] = float(found.group("s"))
            elif key == "graph_capture":
                target["graph_capture_s"] = float(found.group("s"))
                target["graph_gib"] = float(value)
            elif key == "cuda_graph_pool":
                target["graph_pool_gib"] = float(value)
                target["graph_pool_estimated_gib"] = float(found.group("e"))
            elif key in ("attention_backend", "cudagraph_mode"):
                target.setdefault(key, value)
            else:
                target.setdefault(key, float(value))
    return {"ranks": dict(sorted(ranks.items())), "engine": engine}


# ------------------------------------------------------------------ the plan


def kv_bytes_per_token(text_cfg: dict, tp: int, dtype_bytes: int = 2) -> int:
    """The model's own KV cache bytes per token on one rank.

    MLA (DeepSeek-V3/Kimi) keeps one latent of ``kv_lora_rank + qk_rope_head_dim`` per
    layer, replicated on every rank; grouped-query attention keeps K and V of its KV
    heads, split over TP (replicated when there are fewer KV heads than ranks).
    """
    layers = int(modelconfig.num_layers(text_cfg) or 0)
    if text_cfg.get("kv_lora_rank") is not None:
        return layers * (int(text_cfg["kv_lora_rank"]) + int(text_cfg.get("qk_rope_head_dim") or 0)) * dtype_bytes
    heads = int(text_cfg.get("num_attention_heads") or 1)
    kv_heads = int(text_cfg.get("num_key_value_heads") or heads)
    head_dim = int(text_cfg.get("head_dim") or (int(text_cfg.get("hidden_size") or 0) // heads))
    per_rank = max(1, -(-kv_heads // max(tp, 1)))
    return layers * 2 * per_rank * head_dim * dtype_bytes


def hidden_state_bytes_per_token(hidden: int, captured_layers: int, dtype_bytes: int = 2) -> int:
    """The extraction cache's bytes per token: every captured layer's full hidden state."""
    return int(hidden) * int(captured_layers) * dtype_bytes


def activation_elements_per_token(text_cfg: dict, tp: int = 1) -> int:
    """bf16 elements per batched token of the widest layer's forward on one rank: the size the CUDA graph
    pool's estimate scales with (:data:`GRAPH_ACTIVATION_COPIES`, fitted); the profile's peak is
    :func:`profile_moments`'.

    * the residual stream, the norm's output and the layer's output: ``3 x hidden`` (not split by TP);
    * attention: grouped-query q, k, v and the output, ``(heads + 2 x kv_heads) x head_dim + heads x
      head_dim``; MLA's prefill the q/kv latents (``q_lora_rank``,
      ``kv_lora_rank + qk_rope_head_dim``), q, ``kv_b``'s output ``heads x (qk_nope + v_head)``, k and v
      padded to the qk head dim and the padded output (3 x ``heads x (qk_nope + qk_rope)``), the output;
    * a dense MLP's gate/up and activated halves, ``3 x intermediate``, where any layer is dense;
    * a MoE layer's fused workspaces, ``top_k x (3 x moe_intermediate + hidden)``, the shared experts'
      ``3 x moe_intermediate`` each, and the router's logits; added to the dense MLP's (the fused
      MoE workspace is a buffer kept across layers, a dense first layer's activations come on top).

    Heads, intermediates and experts' widths are split over ``tp``.
    """
    tp = max(int(tp), 1)
    hidden = int(text_cfg.get("hidden_size") or 0)
    heads = max(1, int(text_cfg.get("num_attention_heads") or 1) // tp)
    if text_cfg.get("kv_lora_rank") is not None:
        nope = int(text_cfg.get("qk_nope_head_dim") or 0)
        rope = int(text_cfg.get("qk_rope_head_dim") or 0)
        v_dim = int(text_cfg.get("v_head_dim") or nope)
        qk = nope + rope
        attention = (int(text_cfg.get("q_lora_rank") or 0) + int(text_cfg["kv_lora_rank"]) + rope + heads * qk
                     + heads * (nope + v_dim) + 3 * heads * max(qk, v_dim) + heads * v_dim)
    else:
        all_heads = int(text_cfg.get("num_attention_heads") or 1)
        head_dim = int(text_cfg.get("head_dim") or (hidden // all_heads))
        kv_heads = max(1, -(-int(text_cfg.get("num_key_value_heads") or all_heads) // tp))
        attention = (heads + 2 * kv_heads) * head_dim + heads * head_dim
    layers = int(modelconfig.num_layers(text_cfg) or 0)
    experts = int(text_cfg.get("n_routed_experts") or text_cfg.get("num_experts") or text_cfg.get("num_local_experts")
                  or 0)
    moe_width = int(text_cfg.get("moe_intermediate_size") or text_cfg.get("intermediate_size") or 0) // tp
    first_dense = int(text_cfg.get("first_k_dense_replace") or 0) if experts else layers
    dense = 3 * (int(text_cfg.get("intermediate_size") or 0) // tp) if first_dense > 0 else 0
    moe = 0
    if experts and first_dense < layers:
        top_k = int(text_cfg.get("num_experts_per_tok") or 1)
        shared = int(text_cfg.get("n_shared_experts") or 0)
        moe = top_k * (3 * moe_width + hidden) + shared * 3 * moe_width + 2 * experts
    return 3 * hidden + attention + dense + moe


def default_max_num_seqs(total_bytes: int, name: str = "") -> int:
    """vLLM's ``max_num_seqs`` default on a GPU of ``total_bytes`` (:data:`MAX_NUM_SEQS_BIG_GPU`)."""
    return MAX_NUM_SEQS_BIG_GPU if total_bytes >= BIG_GPU_BYTES and "A100" not in (name or "") else MAX_NUM_SEQS


#: :func:`profile_moments`' names in the preflight's words
PEAK_WORDS = {"attention": "the attention call", "dense_mlp": "a dense MLP", "norm_autotune": "a norm's autotune",
              "moe_exit": "a MoE layer's end", "sampler": "the sampler warm-up",
              "compile": "the compile's embedding benchmark"}


def _aux_before(layer_ids, layer: int) -> int:
    """Captured states alive when decoder layer ``layer`` (0-based) runs: the aux ids at or below it (vLLM
    captures id ``a`` before layer ``a``; the final state, id = num_layers, comes after the last)."""
    return sum(1 for a in layer_ids if int(a) <= layer)


def profile_moments(text_cfg: dict, *, tp: int, batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    layer_ids, eager: bool = False, block_tokens: int = KV_BLOCK_TOKENS) -> dict:
    """The torch allocator's candidate peaks of one rank's profile run (bytes), by moment.

    Read in vLLM 0.26.0 (0.25.1 is the same code here): ``gpu_model_runner.profile_run`` runs ``_dummy_run``
    with no attention metadata, so attention computes nothing (MLA allocates its prefill workspace and drops
    it), then ``_dummy_sampler_run`` on one row a request. The fused-MoE workspaces
    (``workspace13 + workspace2``, ``[T, top_k, max(moe_inter, hidden)]`` and ``[T, top_k, max(2 x moe_inter,
    hidden)]``) come from a manager that never shrinks; a compiled piece keeps its inputs (the attention's
    output, the old residual) for the whole piece; Inductor's first compile benchmarks the embedding gather's
    kernel on inputs of its own (``vocab x hidden`` and two ``[T, hidden]``) on a cold cache. ``T``: the step
    budget; heads, intermediates and the vocab split over ``tp``, the logits not (each rank samples).

    * ``attention``: the last layer's attention call: MLA's workspace, the MoE workspace, q, the output, the
      latents, the residual and the states captured so far (GQA: q, k, v, the output, residual, states);
    * ``dense_mlp``: a dense layer's gate/up and activated halves beside the piece's held inputs, the new
      residual and the states captured so far (the last dense layer's);
    * ``norm_autotune``: a compiled add + RMSNorm autotuning at its first call (dense layers);
    * ``moe_exit``: a MoE layer's end: the workspace, the held inputs, five ``[T, hidden]`` (residuals, the
      shared and routed outputs, the next norm's input) and the captured states, while the next norm tunes;
    * ``sampler``: the warm-up's logits (:data:`SAMPLER_BYTES_PER_LOGIT`), the top-k buffer, the forward's
      ``[T, hidden]`` output and the MoE workspace;
    * ``compile``: the embedding kernel's benchmark inputs (compiled only).

    ``block_tokens``: the KV block (``--block-size``), which MLA's workspace is a multiple of.
    """
    tp = max(int(tp), 1)
    tokens = int(batched_tokens)
    requests = min(int(max_num_seqs), tokens)
    hidden = int(text_cfg.get("hidden_size") or 0)
    vocab = int(text_cfg.get("vocab_size") or 0)
    layers = int(modelconfig.num_layers(text_cfg) or 0)
    all_heads = int(text_cfg.get("num_attention_heads") or 1)
    heads = max(1, all_heads // tp)
    compiled = not eager
    flush = AUTOTUNE_FLUSH_BYTES if compiled else 0
    const = PROFILE_CONSTANT_BYTES
    last = max(layers - 1, 0)
    captured = _aux_before(layer_ids, last)
    experts = int(text_cfg.get("n_routed_experts") or text_cfg.get("num_experts") or text_cfg.get("num_local_experts")
                  or 0)
    first_dense = int(text_cfg.get("first_k_dense_replace") or 0) if experts else layers
    moe_workspace = 0
    if experts and first_dense < layers:
        top_k = int(text_cfg.get("num_experts_per_tok") or 1)
        moe_width = int(text_cfg.get("moe_intermediate_size") or text_cfg.get("intermediate_size") or 0) // tp
        moe_workspace = 2 * (max(tokens * top_k * max(moe_width, hidden), tokens * hidden)
                             + tokens * top_k * max(2 * moe_width, hidden))
    moments = {}
    if text_cfg.get("kv_lora_rank") is not None:
        nope = int(text_cfg.get("qk_nope_head_dim") or 0)
        rope = int(text_cfg.get("qk_rope_head_dim") or 0)
        v_dim = int(text_cfg.get("v_head_dim") or nope)
        seqs = int(max_num_seqs)  # the scheduler's, not the dummy run's requests
        block = int(block_tokens)
        window = max(min(max(MLA_WORKSPACE_MODEL_LENS * int(max_model_len), 4 * seqs * block),
                         MLA_WORKSPACE_CAP_TOKENS), seqs * block)
        per_token = heads * (nope + rope) + heads * v_dim + int(text_cfg["kv_lora_rank"]) + rope \
            + hidden * (1 + captured)
        moments["attention"] = (2 * window * heads * (nope + v_dim) + (moe_workspace if first_dense < last else 0)
                                + 2 * tokens * per_token + const)
        attention_out = heads * v_dim
    else:
        head_dim = int(text_cfg.get("head_dim") or (hidden // all_heads))
        kv_heads = max(1, -(-int(text_cfg.get("num_key_value_heads") or all_heads) // tp))
        moments["attention"] = 2 * tokens * (2 * heads * head_dim + 2 * kv_heads * head_dim + hidden * (1 + captured)) \
            + const
        attention_out = heads * head_dim
    held = attention_out + hidden if compiled else 0
    if first_dense > 0:
        captured_dense = _aux_before(layer_ids, first_dense - 1 if experts else last)
        intermediate = int(text_cfg.get("intermediate_size") or 0) // tp
        moments["dense_mlp"] = 2 * tokens * (held + hidden + 3 * intermediate + captured_dense * hidden) + const
        moments["norm_autotune"] = 2 * tokens * (held + 2 * hidden + captured_dense * hidden) + flush + const
    if moe_workspace:
        moments["moe_exit"] = moe_workspace + 2 * tokens * (held + 5 * hidden + captured * hidden) + flush + const
    topk_rows = min(1 << max(min(SAMPLER_TOPK_ROWS, requests) - 1, 0).bit_length(), SAMPLER_TOPK_ROWS)
    moments["sampler"] = (SAMPLER_BYTES_PER_LOGIT * requests * vocab + 4 * topk_rows * vocab
                          + 2 * tokens * hidden + 4 * requests * hidden + moe_workspace + const)
    if compiled:
        moments["compile"] = 2 * (vocab // tp) * hidden + 4 * tokens * hidden
    return moments


def overhead_terms(text_cfg: dict, *, tp: int, batched_tokens: int, max_num_seqs: int, max_model_len: int,
                   layer_ids, eager: bool = False, block_tokens: int = KV_BLOCK_TOKENS) -> dict:
    """The non-KV overhead of one rank, term by term (bytes), as vLLM's profile run makes it: the largest of
    :func:`profile_moments` (``peak``, ``peak_phase`` names it; ``moments`` all of them) at ``batched_tokens``
    (the ``--max-num-batched-tokens`` the engine passes) and ``max_num_seqs``, the CUDA graph pool (none when
    ``eager``) and the memory outside torch. ``total``: the three together."""
    tokens = int(batched_tokens)
    moments = profile_moments(text_cfg, tp=tp, batched_tokens=tokens, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, layer_ids=layer_ids, eager=eager,
                              block_tokens=block_tokens)
    phase = max(moments, key=moments.get)
    capture = min(GRAPH_MAX_CAPTURE_TOKENS, 2 * int(max_num_seqs), tokens)
    act_bytes_per_token = 2 * activation_elements_per_token(text_cfg, tp)
    terms = {
        "non_torch": NON_TORCH_BYTES,
        "cuda_graphs": 0 if eager else GRAPH_BASE_BYTES + int(GRAPH_ACTIVATION_COPIES * act_bytes_per_token * capture),
    }
    return dict(terms, moments=moments, peak=moments[phase], peak_phase=phase,
                total=terms["non_torch"] + terms["cuda_graphs"] + moments[phase], batched_tokens=tokens,
                max_num_seqs=int(max_num_seqs), block_tokens=int(block_tokens))


def engine_batched_tokens(params: dict, config: dict) -> int:
    """The ``--max-num-batched-tokens`` the vllm-server engine will pass for this run: the command
    builder's own :func:`~remote.extract.engines.vllm_server.command.batched_tokens`, with chunked
    prefill resolved as the engine resolves it (the installed connector's verdict); a connector that
    cannot be read counts as chunked prefill off (one whole sample per step: the larger budget)."""
    from remote.extract.engines.vllm_server import chunking, command

    seq_len = int(params.get("seq_len") or 0)
    limit = modelconfig.text_value(config, "max_position_embeddings")
    max_model_len = min(seq_len + 1, int(limit)) if limit else seq_len + 1
    try:
        verdict = chunking.installed_verdict(command.pick_connector(params))
        chunked_on = chunking.resolve(params.get("chunked_prefill"), verdict)["on"]
    except Exception:  # noqa: BLE001 -- unreadable connector or a refused value: drift.server-chunking says which
        chunked_on = False
    return command.batched_tokens({**params, "chunked_prefill_on": chunked_on}, max_model_len)


def engine_max_num_seqs(params: dict) -> int | None:
    """The ``--max-num-seqs`` the vllm-server engine will pass: the command builder's own
    :func:`~remote.extract.engines.vllm_server.command.max_num_seqs` of the params the supervisor hands it
    (:func:`~remote.extract.engines.vllm_server.command.run_defaults`; no batch size: as given)."""
    from remote.extract.engines.vllm_server import command

    batch = params.get("batch_size")
    return command.max_num_seqs(command.run_defaults(params, batch) if batch else params)


def engine_block_tokens(params: dict) -> int:
    """The KV block the server will use: a ``--block-size`` in ``server_args`` (the inventory's check holds it to
    a positive whole number), else vLLM's default on a GPU (:data:`KV_BLOCK_TOKENS`)."""
    from remote.extract.engines.vllm_server import chunking

    given = chunking.flag_value(params.get("server_args") or [], "--block-size")
    return int(given) if given is not None and given.isdigit() and int(given) > 0 else KV_BLOCK_TOKENS


def cache_tokens(kv_room: int, per_token: int, seq_len: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The tokens vLLM says its cache holds ("GPU/CPU KV cache size"): the requests of ``max_model_len``
    (``seq_len + 1``) that fit, each in whole blocks of ``block_tokens``, times ``max_model_len``."""
    if not per_token:
        return 0
    max_model_len = int(seq_len) + 1
    request_bytes = per_token * -(-max_model_len // block_tokens) * block_tokens
    return max(0, int(kv_room)) * max_model_len // request_bytes


def plan_rank_memory(*, total_bytes: int, free_bytes: int, util: float, weight_bytes: int, tp: int,
                     kv_per_token: int, hs_per_token: int, seq_len: int, overhead: dict,
                     block_tokens: int = KV_BLOCK_TOKENS) -> dict:
    """What vLLM will make of one GPU at ``util``: weights, overhead, KV room, tokens that fit.

    vLLM refuses to start when the GPU has less free memory than ``util x total``; the
    KV cache gets ``util x total - weights - overhead`` (``overhead``: :func:`overhead_terms`)
    and is shared by the model's KV and the hidden-state cache, token for token.
    """
    budget = int(util * total_bytes)
    weights = int(weight_bytes) // max(int(tp), 1)
    kv_room = budget - weights - overhead["total"]
    per_token = kv_per_token + hs_per_token
    tokens = cache_tokens(kv_room, per_token, seq_len, block_tokens)
    return {"total_bytes": int(total_bytes), "free_bytes": int(free_bytes), "gpu_memory_utilization": util,
            "budget_bytes": budget, "weight_bytes": weights, "overhead_bytes": overhead["total"],
            "overhead_terms": overhead, "kv_room_bytes": kv_room,
            "kv_bytes_per_token": kv_per_token, "hidden_state_bytes_per_token": hs_per_token,
            "tokens_fit": int(tokens), "requests_fit": round(tokens / max(seq_len + 1, 1), 2),
            "fits_budget": free_bytes >= budget, "fits_weights": kv_room > 0}


def cuda_total_bytes(gpu: dict) -> int:
    """The device's memory as CUDA counts it, which vLLM's budget is ``gpu_memory_utilization`` of: nvidia-smi's
    ``memory.total`` less what the driver reserves (``used + free``; 480 MiB of an H100's 81,559, 615 of an
    H200's 143,771: vLLM 0.26 logs 79.18 GiB on the H100); ``memory.total`` where nvidia-smi gave no more."""
    used, free = gpu.get("memory_used_mib"), gpu.get("memory_free_mib")
    if isinstance(used, int) and isinstance(free, int):
        return (used + free) * MiB
    return (gpu.get("memory_total_mib") or 0) * MiB


def plan_from_config(config: dict, *, gpu: dict, util: float, weight_bytes: int, tp: int, layer_ids,
                     seq_len: int, batched_tokens: int, dtype_bytes: int = 2, max_num_seqs: int | None = None,
                     eager: bool = False, block_tokens: int = KV_BLOCK_TOKENS) -> dict:
    """:func:`plan_rank_memory` for a model config (``text_config`` unwrapped) and one GPU
    as :func:`remote.system.devices.parse_gpus` gives it, at the engine's ``batched_tokens``
    (:func:`engine_batched_tokens`) and ``max_num_seqs`` (None: vLLM's default for this GPU), capturing
    ``layer_ids`` (vLLM's ids: the final state is ``num_layers``), in KV blocks of ``block_tokens``."""
    text = modelconfig.text_config(config)
    hidden = int(text.get("hidden_size") or 0)
    total = cuda_total_bytes(gpu)
    seqs = int(max_num_seqs or default_max_num_seqs(total, gpu.get("name") or ""))
    limit = text.get("max_position_embeddings")
    max_model_len = min(int(seq_len) + 1, int(limit)) if limit else int(seq_len) + 1  # the engine's
    overhead = overhead_terms(text, tp=tp, batched_tokens=batched_tokens, max_num_seqs=seqs,
                              max_model_len=max_model_len, layer_ids=list(layer_ids), eager=eager,
                              block_tokens=block_tokens)
    return plan_rank_memory(
        total_bytes=total, free_bytes=(gpu.get("memory_free_mib") or 0) * MiB,
        util=util, weight_bytes=weight_bytes, tp=tp, kv_per_token=kv_bytes_per_token(text, tp, dtype_bytes),
        hs_per_token=hidden_state_bytes_per_token(hidden, len(layer_ids), dtype_bytes), seq_len=seq_len,
        overhead=overhead, block_tokens=block_tokens)


def compare(plan: dict, engine_memory: dict, smi_used_mib=None, rank: int = 0) -> dict:
    """Predicted (``plan``) vs what the engine did (``parse_engine_memory``) on ``rank``.

    :param smi_used_mib: ``memory.used`` of that rank's GPU while the server ran (nvidia-smi).
    :returns: rows ``{what: {"predicted", "used", "ratio"}}`` in bytes and tokens.
    """
    rank_facts = (engine_memory.get("ranks") or {}).get(rank) or (engine_memory.get("ranks") or {}).get(str(rank)) or {}
    eng = engine_memory.get("engine") or {}
    rows = {}

    def row(name, predicted, used):
        if used is None:
            return
        rows[name] = {"predicted": predicted, "used": used,
                      "ratio": round(used / predicted, 3) if predicted else None}

    gib = lambda v: None if v is None else int(float(v) * GiB)  # noqa: E731
    row("weight_bytes", plan["weight_bytes"], gib(rank_facts.get("model_load_gib")))
    row("kv_room_bytes", plan["kv_room_bytes"], gib(rank_facts.get("available_kv_gib")))
    row("tokens_fit", plan["tokens_fit"], eng.get("kv_cache_tokens"))
    if smi_used_mib is not None:
        row("gpu_used_bytes", plan["budget_bytes"], int(smi_used_mib) * MiB)
    if rank_facts.get("model_load_gib") is not None and rank_facts.get("available_kv_gib") is not None:
        # vLLM's own budget where its log says the device's total (else the plan's, from nvidia-smi)
        budget_used = (int(plan["gpu_memory_utilization"] * gib(rank_facts["device_total_gib"]))
                       if rank_facts.get("device_total_gib") else plan["budget_bytes"])
        overhead_used = budget_used - gib(rank_facts["model_load_gib"]) - gib(rank_facts["available_kv_gib"])
        row("overhead_bytes", plan["overhead_bytes"], overhead_used)
    terms = plan.get("overhead_terms") or {}
    if terms:  # the plan's own step budget and graph pool against the server's
        row("batched_tokens", terms["batched_tokens"], eng.get("max_num_batched_tokens"))
        row("cuda_graph_bytes", terms["cuda_graphs"], gib(rank_facts.get("graph_estimate_gib")))
    return rows


# ------------------------------------------------------------------ the probe


def _smi_banner():
    """The plain nvidia-smi banner facts, or (None, why)."""
    from remote.system import devices

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi is not on PATH"
    text, error = devices._run_smi([smi])
    if error:
        return None, error
    banner = parse_smi_banner(text)
    return banner, None if banner else "nvidia-smi printed no version banner"


def probe(ctx: Context) -> list:
    """``gpu.cuda`` (driver vs torch build) and ``gpu.memory`` (KV room per rank); skipped on CPU."""
    if ctx.params["device"] != "cuda":
        return [record("gpu.cuda", SKIPPED, "device=cpu: no GPU checks", detail={})]
    return [_cuda_record(ctx), _memory_record(ctx)]


def _cuda_record(ctx) -> dict:
    banner, why = _smi_banner()
    build = torch_build()
    detail = {"nvidia_smi": banner, "torch": build}
    ctx.host["cuda"] = detail
    if build is None:
        return record("gpu.cuda", FAIL, "torch is not installed in this python", detail=detail,
                      fix="point 'python' in the inventory at the env with vLLM (and its torch)")
    if banner is None:
        return record("gpu.cuda", WARN, f"cannot read the driver's CUDA version: {why}", detail=detail,
                      fix="check `nvidia-smi` on the host")
    status, summary, fix = cuda_fit(banner.get("cuda_version"), build.get("cuda"))
    summary = f"{summary} (driver {banner['driver_version']}, torch {build.get('torch_version')})"
    return record("gpu.cuda", status, summary, detail=detail, fix=fix)


def _memory_record(ctx) -> dict:
    from remote.probes.parallel import gpus_in_use

    gpus = gpus_in_use(ctx)  # every replica's GPUs: each holds its replica's share of the weights
    weight_bytes = ctx.checkpoint.get("data_bytes")
    if not gpus or not weight_bytes:
        why = "no GPU facts" if not gpus else "no checkpoint size"
        return record("gpu.memory", SKIPPED, f"{why} to plan memory with", detail={})
    try:
        config = modelconfig.read(ctx.params["model_path"])
    except modelconfig.ConfigError as exc:
        return record("gpu.memory", SKIPPED, f"model config unreadable: {exc.summary}", detail={})
    # vLLM's ids (input convention: id k is the state after k layers); no plan from the layer check: its default
    layer_ids = [int(i) + (1 if ctx.layers.get("convention") == OUTPUT else 0)
                 for i in ctx.layers.get("ids") or [] if isinstance(i, int)] \
        or default_layer_ids("vllm-server", int(modelconfig.num_layers(modelconfig.text_config(config)) or 4))[0]
    seq_len = ctx.params["seq_len"]
    util = ctx.params["gpu_memory_utilization"]
    tp = ctx.params["tp"]
    budget_tokens = engine_batched_tokens(ctx.params, config)
    plans = [dict(plan_from_config(config, gpu=g, util=util, weight_bytes=weight_bytes, tp=tp, layer_ids=layer_ids,
                                   seq_len=seq_len, dtype_bytes=ctx.params["hidden_dtype_bytes"],
                                   batched_tokens=budget_tokens, max_num_seqs=engine_max_num_seqs(ctx.params),
                                   eager=bool(ctx.params.get("enforce_eager")),
                                   block_tokens=engine_block_tokens(ctx.params)), index=g["index"])
             for g in gpus]
    worst = min(plans, key=lambda p: p["tokens_fit"])
    ctx.host["gpu_memory_plan"] = plans
    detail = {"ranks": plans, "layer_ids": len(layer_ids), "seq_len": seq_len, "max_num_batched_tokens": budget_tokens,
              "max_num_seqs": worst["overhead_terms"]["max_num_seqs"]}
    line = (f"per rank: {human_bytes(worst['weight_bytes'])} weights + ~{human_bytes(worst['overhead_bytes'])} "
            f"overhead at {budget_tokens:,} batched tokens and {worst['overhead_terms']['max_num_seqs']:,} "
            f"sequences (its peak: {PEAK_WORDS[worst['overhead_terms']['peak_phase']]}) "
            f"of {human_bytes(worst['budget_bytes'])} "
            f"({util} x {human_bytes(worst['total_bytes'])}); "
            f"KV room {human_bytes(max(worst['kv_room_bytes'], 0))} = ~{worst['tokens_fit']:,} tokens at "
            f"{worst['kv_bytes_per_token'] + worst['hidden_state_bytes_per_token']:,} B/token "
            f"({worst['hidden_state_bytes_per_token']:,} of it captured states)")
    if not worst["fits_weights"]:
        return record("gpu.memory", FAIL, "no room for the KV cache: " + line, detail=detail,
                      fix="raise tp or gpu_memory_utilization, or use a smaller/quantized checkpoint")
    if worst["requests_fit"] < MIN_REQUESTS_IN_CACHE:
        return record("gpu.memory", FAIL, f"the KV cache holds {worst['requests_fit']} requests of seq_len "
                      f"{seq_len}: " + line, detail=detail,
                      fix="lower seq_len, capture fewer layers, or raise gpu_memory_utilization / tp")
    return record("gpu.memory", OK, line + f", {worst['requests_fit']:.0f} requests of {seq_len} tokens",
                  detail=detail)
