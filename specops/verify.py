"""``specops verify``: recompute a few samples of a finished run with an independent
reference and compare every captured layer.

The work happens on the host (``remote/verify/``): a transformers forward of the
run's own model on the same token ids (float32, CPU; ``llama_4_scaling`` applied the
way vLLM does when transformers lacks it), per layer max abs difference, relative
error, nrmse and cosine, a best-match search that names an off-by-one layer, and a
second, unscaled reference that names a worker dropping ``llama_4_scaling``. It reads
both sample formats (``data_{i}.pt`` of speculators 0.3, ``hs_{i}.safetensors`` of the
``vllm-server`` engine) in the layer convention the run recorded, under transformers 4
or 5, whichever the host has.

A layer also fails when its error, though within the per-token tolerances for every
token, is well above what rounding to the capture's dtype does to this model (the same
forward in bf16 with the same experts): that is how a CPU kernel bug that moves every
token of a small random model by 3 % is told from bf16 noise at 0.6-0.9 %.

MoE models (DeepSeek-V3, Kimi): where a router's best experts score within bf16
rounding of each other, the bf16 engine and the fp32 reference may pick differently,
and which tokens do depends on the machine's kernels. Verify recomputes such a token
with the engine's choice and reports it in ``verify.routing`` (layer, token, both
choices, score gap) instead of failing the layer; a swap the router was sure about
still fails. The README run on the test host (tiny DeepSeek-V3, TP=2), 2-core EPYC::

    >>> [(r.name, r.status) for r in verify_step(host, "v1", samples=2).records][2:7]
    [('verify.layer.2', 'ok'), ('verify.layer.4', 'ok'), ('verify.layer.5', 'ok'),
     ('verify.layer.7', 'ok'), ('verify.routing', 'ok')]
    >>> verify_step(host, "v1", samples=2).records[6].summary
    '20 of 232 token(s) took other experts than the fp32 reference where the router's
     scores nearly tie (...): recomputed with the engine's choice they agree -- rounding,
     not a wrong extraction (first: data_3.pt layer 1 token 6: experts [1, 2] -> [1, 7], ...)'

(before, the same run read ``verify.layer.7 fail: DIFFERS ... nrmse 7.57 %, 203/232
tokens agree``; a planted wrong extraction still reads ``fail``.)

``--reference layer`` checks a real-size run with one decoder layer of weights in memory:
for each decoder layer ``j`` whose input and output the run captured (two consecutive
ids, e.g. ``input:4,5``; layer 0's input may come from the checkpoint's embedding rows),
layer ``j``'s tensors alone are read from the checkpoint, run in float32 on the captured
input through the model's own transformers layer class, and compared with the captured
output against that layer's bf16 rounding floor. A failing layer is tried with its
neighbours' weights to name states shifted by one. ``verify.reference`` prints the peak
host memory; ``verify.coverage`` says which layer kinds (first, last, dense, MoE) were
checked and which no captured pair reaches. Quantized checkpoints (fp8 blocks, compressed-
tensors pack-quantized) are dequantized as each layer loads; other quantizations are refused.
"""
from __future__ import annotations

from specops.result import HostReport
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload

#: ``hf``: the whole model in transformers (twins, small models); ``layer``: each captured
#: decoder layer alone, one layer of weights in memory (``remote/verify/layer.py``); ``logits``: the last
#: captured state through the final norm and lm_head against the engine's prompt logprobs
#: (``remote/verify/logits.py``).
REFERENCES = ("hf", "layer", "logits")


def verify_params(host: Host, run_id: str, samples: int = 3, reference: str = "hf") -> dict:
    params = {"run_id": run_id, "work_dir": host.spec.work_dir, "samples": int(samples),
              "reference": reference, "env": dict(host.spec.env)}
    # unset in the inventory: the host falls back to what the run recorded
    if "trust_remote_code" in host.spec.model_fields_set:
        params["trust_remote_code"] = host.spec.trust_remote_code
    return params


def verify_step(host: Host, run_id: str, samples: int = 3, reference: str = "hf") -> HostReport:
    """Verify one run on one host; one record per layer plus run, reference, convention,
    routing (MoE models with a DeepSeek-V3-style router) and llama_4_scaling (when the
    model has it). On a host behind Slurm it runs on a compute node through ``srun`` (``verify.node`` names
    it), never on the login node."""
    from specops.slurm import launcher

    payload = host.run_task("verify", verify_params(host, run_id, samples, reference),
                            launcher=launcher(host.spec, "verify"))
    return report_from_payload(host.name, "verify", payload)
