"""Benchmark: OpenMP threads spinning vs sleeping at barriers when two vLLM CPU servers share the cores.

Why the test hosts set ``OMP_WAIT_POLICY=PASSIVE`` (``templates/sshd_config.j2``, ``tests/conftest.py``):
``make test`` runs two xdist workers on a 2-core box, and each often has a vLLM CPU engine bound to both
cores. OpenMP's default spins at every barrier, burning the cores the other engine waits for. Per policy,
``--repeat`` times: two engines (the tiny Llama, eager, bound to every core of this machine, as specops's
server env binds a TP=1 rank) start together and each generates ``--rounds`` x 64 prompts x 64 tokens;
prints each pair's generate seconds and the ratio spin / passive. Measured 2026-12-03 with this script on an
AMD EPYC (family 25, 2 cores, AVX2): 161.9 and 161.8 s spinning, 128.2 and 128.1 s passive: 1.26x (410 s in all).
A first pair run by hand (before this script) on another 2-core EPYC gave 56.3/57.4 s against 29.3/28.7: 1.9x.

    .venv/bin/python scripts/bench_omp_wait.py [--repeat 1] [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINE = """
import sys, time
from vllm import LLM, SamplingParams
def main():
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=512, dtype="bfloat16")
    prompts = [{"prompt_token_ids": [1] + [(i * 7 + j) % 500 + 3 for j in range(40)]} for i in range(64)]
    t = time.monotonic()
    for _ in range(int(sys.argv[2])):
        llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    print(f"GENERATE_S {time.monotonic() - t:.1f}", flush=True)
if __name__ == "__main__":
    main()
"""


def pair(python: str, model: str, rounds: int, policy: str | None) -> list[float]:
    """Two engines started together; each one's generate seconds."""
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cores, OMP_NUM_THREADS=str(len(cores.split(","))),
               HF_HUB_OFFLINE="1", **({"OMP_WAIT_POLICY": policy} if policy else {}))
    procs = [subprocess.Popen([python, "-c", ENGINE, model, str(rounds)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    seconds = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        line = next((ln for ln in out.splitlines() if ln.startswith("GENERATE_S")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"an engine failed (exit {proc.returncode}); run it alone to see why")
        seconds.append(float(line.split()[1]))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    import tempfile

    from specops.testhost.hostenv import ensure_hostenv, make_overlay_env
    from specops.testhost.models import ensure_models

    # vLLM imported from an overlay, as the tests do: the cached env stays as its build left it
    base = ensure_hostenv(quiet=True, stack="modern")
    python = str(make_overlay_env(base, Path(tempfile.mkdtemp(prefix="bench-omp-")) / "env", rope_fix=False))
    model = str(ensure_models(Path(ensure_hostenv(quiet=True)))["llama"])  # the seed env builds them, as in tests
    spin, passive = [], []
    for i in range(args.repeat):
        t = time.monotonic()
        spin += pair(python, model, args.rounds, None)
        passive += pair(python, model, args.rounds, "PASSIVE")
        print(f"repeat {i + 1}: spinning {spin[-2:]} s, passive {passive[-2:]} s ({time.monotonic() - t:.0f} s)")
    print(f"two engines on {len(os.sched_getaffinity(0))} cores: generate {sum(spin) / len(spin):.1f} s spinning, "
          f"{sum(passive) / len(passive):.1f} s passive: spin / passive = {sum(spin) / sum(passive):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
