"""Which CPU kernel paths run on this CPU under which caps (ATen capability x oneDNN max ISA)."""
import json, os, traceback
import torch, torch.nn.functional as F
res = {"cap": torch.backends.cpu.get_cpu_capability(), "aten": os.environ.get("ATEN_CPU_CAPABILITY"),
       "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"), "torch": torch.__version__}
def attempt(name, fn):
    try:
        fn(); res[name] = "ok"
    except Exception as e:
        res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
for L in (40, 256, 1024):
    q = torch.randn(1, 4, L, 64, dtype=torch.bfloat16)
    attempt(f"sdpa_causal_{L}", lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    m = torch.ones(L, L, dtype=torch.bool).tril()
    attempt(f"sdpa_mask_{L}", lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=m))
a = torch.randn(256, 512, dtype=torch.bfloat16); w = torch.randn(1024, 512, dtype=torch.bfloat16)
attempt("linear", lambda: F.linear(a, w))
attempt("bmm", lambda: torch.bmm(a[None], w.t()[None]))
try:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    ds = DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1, max_position_embeddings=2048)
    for impl in ("sdpa", "eager"):
        model = DeepseekV3ForCausalLM._from_config(ds, torch_dtype=torch.bfloat16, attn_implementation=impl).eval()
        ids = torch.randint(0, 512, (1, 300))
        def fwd():
            with torch.no_grad(): model(ids)
        attempt(f"deepseek_v3_{impl}", fwd)
    ll = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)
    lm = LlamaForCausalLM._from_config(ll, torch_dtype=torch.bfloat16).eval()
    def lfwd():
        with torch.no_grad(): lm(torch.randint(0, 512, (1, 300)))
    attempt("llama_sdpa", lfwd)
except Exception:
    res["transformers"] = traceback.format_exc()[-400:]
print("RESULT " + json.dumps(res))
