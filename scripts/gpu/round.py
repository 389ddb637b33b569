#!/usr/bin/env python3
"""One device round on the lent H200: specops's host side, end to end, with what it printed kept.

Run from the repo root on the GPU machine, after the vLLM kit is staged (``/tmp/site``)::

    python3 scripts/gpu/round.py env                  # call 1: no kit needed (nvidia-smi, disk, versions)
    python3 scripts/gpu/round.py models               # call 2: random models + datasets on the GPU
    python3 scripts/gpu/round.py main [--steps ...]   # call 3: ssh, preflight, engine, compare, bench, jobs

Each step writes under ``/tmp/gpu-round/<step>/`` and the call ends with one archive in
``$OUT`` (``<label>.tar.gz``; the device tool brings back at most 8 files) plus
``summary.json``. Steps never stop the round: a failing step records its error and the
next one runs; ``--deadline`` seconds after the start no new step begins.

The host side runs exactly as over SSH from a laptop: ``scripts/gpu/loopback_ssh.py``
brings an SSH server up on 127.0.0.1 (OpenSSH when the machine has it, else asyncssh),
and the unchanged ``specops`` program (Fabric/paramiko, host-key checked) drives it
with an inventory whose hosts are that server. The engine runs standalone too
(``python -m remote.engines.vllm_server``), for numbers that need no supervisor.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
ROOT = Path(os.environ.get("GPU_ROUND_DIR", "/tmp/gpu-round"))
MODELS = Path(os.environ.get("GPU_MODELS_DIR", "/tmp/gpu-models"))
SSH_ROOT = Path("/tmp/specops-ssh")
T0 = time.monotonic()
#: seconds after the start by which every command has ended (the device call's limit is 600 s)
HARD_END_S = float(os.environ.get("GPU_ROUND_HARD_END_S", "575"))
SUMMARY: dict = {"steps": {}}
PY = sys.executable
#: the host python the inventory names, and the device (overridable to rehearse on a CPU machine)
HOST_PY = os.environ.get("GPU_ROUND_HOST_PYTHON", sys.executable)
DEVICE = os.environ.get("GPU_ROUND_DEVICE", "cuda")
#: the job env vLLM needs on this machine (../shared/gpu/README.md); NVLink multicast stays off.
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def log(*parts):
    print(f"[round {time.monotonic() - T0:7.1f}s]", *parts, flush=True)


def sh(cmd, out: Path | None = None, timeout=300, env=None, check=False) -> dict:
    """Run ``cmd`` (list or shell string); keep stdout+stderr in ``out``; never raises unless ``check``."""
    t = time.monotonic()
    timeout = max(5, min(timeout, HARD_END_S - (t - T0)))  # the call's own limit is never overrun
    try:
        proc = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})}, cwd=REPO, stdin=subprocess.DEVNULL)
        rc, text = proc.returncode, proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else "")
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, f"TIMEOUT after {timeout}s\n{exc.stdout or ''}\n{exc.stderr or ''}"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text if isinstance(text, str) else text.decode("utf-8", "replace"))
    res = {"rc": rc, "s": round(time.monotonic() - t, 2)}
    if check and rc != 0:
        raise RuntimeError(f"{cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))} -> rc {rc}: {text[-1500:]}")
    return res | {"text": text}


def last_json(text: str):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


class SmiSampler:
    """``memory.used`` of every GPU once a second while a block runs; keeps the peak."""

    def __init__(self):
        self.peak: dict = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout
                for line in text.splitlines():
                    idx, used = (int(x) for x in line.split(","))
                    self.peak[idx] = max(self.peak.get(idx, 0), used)
                self.samples += 1
            except Exception:
                pass
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=15)


def step(name, deadline_s=None):
    """Decorator: time the step, keep its result or error in SUMMARY, never raise."""
    def wrap(fn):
        def run(*args, **kwargs):
            if deadline_s and time.monotonic() - T0 > deadline_s:
                SUMMARY["steps"][name] = {"skipped": "deadline"}
                log("skip", name, "(deadline)")
                return None
            log("step", name)
            t = time.monotonic()
            try:
                res = fn(*args, **kwargs)
                SUMMARY["steps"][name] = {"ok": True, "s": round(time.monotonic() - t, 1), "result": res}
                return res
            except Exception as exc:  # a failing step never stops the round
                import traceback
                SUMMARY["steps"][name] = {"ok": False, "s": round(time.monotonic() - t, 1),
                                          "error": f"{type(exc).__name__}: {exc}",
                                          "traceback": traceback.format_exc()[-4000:]}
                log("FAILED", name, type(exc).__name__, str(exc)[:500])
                return None
        return run
    return wrap


# ============================================================================ call 1: env


def do_env():
    d = ROOT / "env"
    d.mkdir(parents=True, exist_ok=True)
    from remote.probes import host as hostprobe
    facts = {}
    for name, cmd in {
        "nvidia-smi.txt": ["nvidia-smi"],
        "gpus.csv": hostprobe.GPU_QUERY,
        "apps.csv": hostprobe.APPS_QUERY,
        "nvidia-smi-q-memory.txt": ["nvidia-smi", "-q", "-d", "MEMORY,COMPUTE"],
        "nvidia-smi-topo.txt": ["nvidia-smi", "topo", "-m"],
    }.items():
        facts[name] = sh(cmd, d / name, timeout=60)["rc"]
    probe = ("import shutil,sys,platform,os,importlib.metadata as m\n"
             "print({'python': sys.version, 'sshd': shutil.which('sshd'), 'usr_sbin_sshd': os.path.exists('/usr/sbin/sshd'),"
             " 'ssh_keygen': shutil.which('ssh-keygen'), 'ssh': shutil.which('ssh'), 'dropbear': shutil.which('dropbear'),"
             " 'os_release': open('/etc/os-release').read().splitlines()[:4], 'cpus': os.cpu_count(),"
             " 'user': os.getuid(), 'home': os.path.expanduser('~'),"
             " 'versions': {p: v(p) for p in ('torch','transformers','safetensors','tokenizers','numpy','jinja2',"
             " 'pyyaml','rich','pydantic','packaging','huggingface-hub','cryptography','paramiko','triton')}})\n")
    probe = ("import importlib.metadata as m\n"
             "def v(p):\n try:\n  return m.version(p)\n except Exception:\n  return None\n") + probe
    res = sh([PY, "-c", probe], d / "host.txt", timeout=60)
    facts["host"] = res["text"][:3000]
    sh("df -h /tmp / 2>&1; mount | grep -E ' / | /tmp ' ; free -g; ls /var/cache/apt/archives 2>&1 | head; "
       "env | grep -E '^(NCCL|TORCH|NVSHMEM|CUDA|PATH|LD_LIB)' ", d / "system.txt", timeout=60)
    # what one file write with fsync costs here (the extraction writes 33.5 MB per 1024-token sample at hidden 4096)
    disk = ("import os,time\nd='/tmp/fsync-test'\nos.makedirs(d,exist_ok=True)\nb=os.urandom(33554432)\n"
            "r={}\nfor mode in ('nosync','fsync'):\n t=time.perf_counter()\n for i in range(48):\n"
            "  p=f'{d}/f{i}'\n  with open(p,'wb') as f:\n   f.write(b)\n   f.flush()\n   (os.fsync(f.fileno()) if mode=='fsync' else None)\n"
            " dt=time.perf_counter()-t\n r[mode]={'files_per_s':round(48/dt,1),'GB_per_s':round(48*len(b)/dt/1e9,2)}\n"
            " [os.unlink(f'{d}/f{i}') for i in range(48)]\nimport hashlib\nt=time.perf_counter()\n"
            "[hashlib.sha256(b).hexdigest() for _ in range(16)]\nr['sha256_GB_per_s']=round(16*len(b)/(time.perf_counter()-t)/1e9,2)\nprint(r)\n")
    facts["disk"] = sh([PY, "-c", disk], d / "disk.txt", timeout=120)["text"][-400:]
    return facts


# ============================================================================ call 2: models


def do_models():
    res = sh([PY, "scripts/gpu/models.py", "--out", str(MODELS)], ROOT / "models" / "models.txt", timeout=400,
             env=VLLM_ENV, check=True)
    return last_json(res["text"])


# ============================================================================ call 3: main


def ssh_up():
    d = ROOT / "ssh"
    res = sh([PY, "scripts/gpu/loopback_ssh.py", "up", "--root", str(SSH_ROOT), "--kind",
              os.environ.get("GPU_ROUND_SSH_KIND", "auto")], d / "up.txt", timeout=60, check=True)
    info = last_json(res["text"])
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    import loopback_ssh
    work = "/tmp/specops-work"
    defaults = {"python": HOST_PY, "work_dir": work, "device": DEVICE, "tp": 1, "engine": "vllm-server",
                "env": VLLM_ENV, "dataset": str(MODELS / "chat.jsonl"), "max_samples": 24, "seq_len": 256,
                "batch_size": 8, "gpu_memory_utilization": 0.5}
    hosts = {
        "gpu-llama": {"model_path": str(MODELS / "llama"), "output_dir": "/tmp/specops-out/llama"},
        "gpu-wide": {"model_path": str(MODELS / "llama_wide"), "output_dir": "/tmp/specops-out/wide"},
        "gpu-deepseek": {"model_path": str(MODELS / "deepseek_v3"), "output_dir": "/tmp/specops-out/deepseek"},
        # the abort rehearsal: a pause after each batch keeps the run extracting long enough to abort it
        "gpu-deepseek-slow": {"model_path": str(MODELS / "deepseek_v3"), "output_dir": "/tmp/specops-out/ds-slow",
                              "batch_size": 2, "env": dict(VLLM_ENV, SPECOPS_BATCH_DELAY_S="3")},
    }
    inv = loopback_ssh.inventory(info, hosts, defaults)
    (ROOT / "inventory.yaml").write_text(inv)
    (d / "inventory.yaml").write_text(inv)
    return info


def specops(args, out_name, timeout=300):
    cmd = [PY, "-c", "from specops.main import program; program.run()", *args, "--inventory", str(ROOT / "inventory.yaml")]
    res = sh(cmd, ROOT / "cli" / out_name, timeout=timeout)
    return {"rc": res["rc"], "s": res["s"], "tail": res["text"][-1500:]}


def preflight_all():
    out = {}
    for host in ("gpu-llama", "gpu-wide", "gpu-deepseek"):
        res = specops(["preflight", "--on", host, "--json"], f"preflight_{host}.json", timeout=180)
        out[host] = {"rc": res["rc"], "s": res["s"]}
    out["facts"] = specops(["facts", "--on", "gpu-llama", "--json"], "facts.json", timeout=120)["rc"]
    out["preflight_text"] = specops(["preflight", "--on", "gpu-deepseek"], "preflight_deepseek.txt", timeout=180)["rc"]
    return out


def token_samples(model: str, dataset: str, n: int, seq_len: int, path: Path) -> Path:
    from remote.dataset import load_token_samples
    rows = load_token_samples({"dataset": dataset, "max_samples": n, "seq_len": seq_len}, model)
    with open(path, "w") as fh:
        for i, (ids, _) in enumerate(rows):
            fh.write(json.dumps({"index": i, "token_ids": ids}) + "\n")
    return path


def engine_run(name: str, model: Path, util=0.5, extra=None, compare=True, n=24, seq_len=256):
    """``python -m remote.engines.vllm_server`` on the GPU; memory plan vs log; HF comparison."""
    from remote import layers, modelconfig
    from remote.probes import gpu, host as hostprobe
    d = ROOT / "engine" / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    samples = token_samples(str(model), str(MODELS / "chat.jsonl"), n, seq_len, d / "samples.jsonl")
    gpus_before = hostprobe.parse_gpus(sh(hostprobe.GPU_QUERY, d / "gpus_before.csv")["text"].split("\n--- stderr")[0]) \
        if shutil.which("nvidia-smi") else [{"index": 0, "memory_total_mib": 0, "memory_free_mib": 0}]
    params = {"device": DEVICE, "gpu_memory_utilization": util, "seq_len": seq_len, "work_dir": str(d / "server"),
              **(extra or {})}
    with SmiSampler() as smi:
        res = sh([HOST_PY, "-m", "remote.engines.vllm_server", "--model", str(model), "--samples", str(samples),
                  "--out", str(d / "hs"), "--params", json.dumps(params)], d / "engine_stdout.txt", timeout=420,
                 env=VLLM_ENV)
    result = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
    result_small = {k: v for k, v in result.items() if k != "samples"}
    if result.get("samples"):
        result_small["samples_n"] = len(result["samples"])
        result_small["sample0"] = result["samples"][0]
    (d / "result.json").write_text(json.dumps(result, indent=1))
    log_text = (d / "server" / "logs" / "server.log").read_text(errors="replace") \
        if (d / "server" / "logs" / "server.log").exists() else ""
    config = modelconfig.read(str(model))
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    n_ids = len(result.get("layer_ids") or layers.default_layer_ids("vllm-server", modelconfig.num_layers(config))[0])
    plan = gpu.plan_from_config(config, gpu=gpus_before[0], util=util, weight_bytes=weight_bytes, tp=1,
                                n_layer_ids=n_ids, seq_len=seq_len)
    used = gpu.parse_engine_memory(log_text)
    memory = {"plan": plan, "engine": used, "smi_peak_used_mib": smi.peak, "smi_samples": smi.samples,
              "compare": gpu.compare(plan, used, smi.peak.get(0))}
    (d / "memory.json").write_text(json.dumps(memory, indent=1))
    out = {"engine": result_small, "memory_compare": memory["compare"]}
    if compare and result.get("samples"):
        file_ids = (result.get("engine") or {}).get("file_layer_ids") or sorted(result["layer_ids"])
        cmp = sh([PY, "scripts/gpu/hf_compare.py", "--model", str(model), "--files", str(d / "hs"),
                  "--layer-ids", ",".join(map(str, file_ids)), "--max", "8"], d / "hf_compare.txt", timeout=240,
                 env=VLLM_ENV)
        out["hf_compare"] = last_json(cmp["text"]) or {"rc": cmp["rc"], "tail": cmp["text"][-2000:]}
        if "deepseek" in name:  # MoE routing near-ties: is the gap numerics (bf16 too) or the GPU path?
            cmp = sh([PY, "scripts/gpu/hf_compare.py", "--model", str(model), "--files", str(d / "hs"),
                      "--layer-ids", ",".join(map(str, file_ids)), "--max", "8", "--dtype", "bfloat16"],
                     d / "hf_compare_bf16.txt", timeout=240, env=VLLM_ENV)
            out["hf_compare_bf16"] = last_json(cmp["text"]) or {"rc": cmp["rc"], "tail": cmp["text"][-2000:]}
    shutil.rmtree(d / "hs", ignore_errors=True)
    return out


def bench(n=512, reps=2, conc="32,64", kinds="plain,server_only,fast",
          once="specops@32,fast_durable@64,sustained@64", label="bench"):
    d = ROOT / label
    dataset = next(iter(sorted(MODELS.glob("bench_*.jsonl"))), None)
    res = sh([PY, "scripts/gpu/bench.py", "--model", str(MODELS / "llama_wide"),
              "--dataset", str(dataset), "--out", "/tmp/gpu-bench", "--n", str(n),
              "--reps", str(reps), "--concurrency", conc, "--kinds", kinds, "--once", once],
             d / "bench_stdout.txt", timeout=560, env=VLLM_ENV)
    for sub in ("extract_server", "plain_server"):
        src = Path("/tmp/gpu-bench") / sub / "logs" / "server.log"
        if src.exists():
            text = src.read_text(errors="replace")
            keep = [ln for ln in text.splitlines() if "POST /v1/completions" not in ln]
            (d / f"{sub}.log").write_text("\n".join(keep)[-600000:])
    if Path("/tmp/gpu-bench/bench.json").exists():
        shutil.copy("/tmp/gpu-bench/bench.json", d / "bench.json")
    got = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
    return {k: got.get(k) for k in ("best_tok_per_s", "ratios_vs_best_plain", "ratios_same_concurrency",
                                     "both_ready_s", "rc", "tail") if k in got}


def job_flow():
    """extract (detached + followed) / status / logs / fetch / verify on the tiny Llama; abort on DeepSeek."""
    out = {}
    out["extract"] = specops(["extract", "--on", "gpu-llama", "--run-id", "gpu-llama-1", "--skip-smoke"],
                             "extract_llama.txt", timeout=400)
    out["status"] = specops(["status", "--on", "gpu-llama", "--run-id", "gpu-llama-1", "--json"], "status_llama.json")
    out["logs"] = specops(["logs", "--on", "gpu-llama", "--run-id", "gpu-llama-1"], "logs_llama.txt")
    out["fetch"] = specops(["fetch", "--on", "gpu-llama", "--run-id", "gpu-llama-1"], "fetch_llama.txt")
    out["verify"] = specops(["verify", "--on", "gpu-llama", "--run-id", "gpu-llama-1", "--samples", "3", "--json"],
                            "verify_llama.json", timeout=300)
    fetched = REPO / "runs" / "gpu-llama" / "gpu-llama-1"
    if fetched.exists():
        shutil.copytree(fetched, ROOT / "cli" / "fetched_gpu-llama-1", dirs_exist_ok=True)
    return out


def abort_flow():
    host, rid = "gpu-deepseek-slow", "gpu-ds-abort"
    out = {"start": specops(["extract", "--on", host, "--run-id", rid, "--skip-smoke", "--detach"],
                            "extract_ds_detach.txt", timeout=120)}
    deadline = time.monotonic() + 240
    polls = 0
    while time.monotonic() < deadline:
        st = specops(["status", "--on", host, "--run-id", rid, "--json"], "status_ds_poll.json")
        polls += 1
        if any(f'"{s}"' in st["tail"] for s in ("extracting", "done", "failed")):
            break
        time.sleep(3)
    out["polls"] = polls
    time.sleep(4)  # a batch or two on disk first
    out["logs"] = specops(["logs", "--on", host, "--run-id", rid], "logs_ds_before_abort.txt")
    out["abort"] = specops(["abort", "--on", host, "--run-id", rid], "abort_ds.txt")
    out["status"] = specops(["status", "--on", host, "--run-id", rid, "--json"], "status_ds_aborted.json")
    out["fetch"] = specops(["fetch", "--on", host, "--run-id", rid], "fetch_ds_aborted.txt")
    out["leftover_gpu_procs"] = sh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                                   ROOT / "cli" / "gpu_apps_after_abort.csv")["text"][:500]
    fetched = REPO / "runs" / host / rid
    if fetched.exists():
        shutil.copytree(fetched, ROOT / "cli" / f"fetched_{rid}", dirs_exist_ok=True)
    return out


def smoke(host):
    return specops(["smoke", "--on", host, "--json"], f"smoke_{host}.json", timeout=400)


def pack(label: str):
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    SUMMARY["wall_s"] = round(time.monotonic() - T0, 1)
    (ROOT / f"summary-{label}.json").write_text(json.dumps(SUMMARY, indent=1, default=str))
    with tarfile.open(out / f"{label}.tar.gz", "w:gz") as tar:
        for path in sorted(ROOT.rglob("*")):
            if path.is_file() and path.stat().st_size < 8 << 20:
                tar.add(path, arcname=str(path.relative_to(ROOT)))
    shutil.copy(ROOT / f"summary-{label}.json", out / f"summary-{label}.json")
    log("packed", out / f"{label}.tar.gz", (out / f"{label}.tar.gz").stat().st_size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["env", "models", "main"])
    parser.add_argument("--steps", default="ssh,preflight,engine_llama,engine_deepseek,bench")
    parser.add_argument("--deadline", type=float, default=540)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    ROOT.mkdir(parents=True, exist_ok=True)
    label = args.label or args.phase
    if args.phase == "env":
        step("env")(do_env)()
    elif args.phase == "models":
        step("models")(do_models)()
    else:
        dl = args.deadline
        steps = {
            "ssh": lambda: step("ssh")(ssh_up)(),
            "preflight": lambda: step("preflight", dl)(preflight_all)(),
            "engine_llama": lambda: step("engine_llama", dl)(engine_run)("llama", MODELS / "llama"),
            "engine_deepseek": lambda: step("engine_deepseek", dl)(engine_run)("deepseek_v3", MODELS / "deepseek_v3"),
            "engine_dense": lambda: step("engine_dense", dl)(engine_run)("deepseek_dense", MODELS / "deepseek_dense"),
            "engine_wide": lambda: step("engine_wide", dl)(engine_run)("llama_wide", MODELS / "llama_wide", n=8),
            "jobs": lambda: step("jobs", dl)(job_flow)(),
            "bench": lambda: step("bench", dl)(bench)(),
            "abort": lambda: step("abort", dl)(abort_flow)(),
            "smoke_llama": lambda: step("smoke_llama", dl)(smoke)("gpu-llama"),
            "smoke": lambda: step("smoke", dl)(smoke)("gpu-deepseek"),
        }
        for name in args.steps.split(","):
            steps[name]()
    pack(label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
