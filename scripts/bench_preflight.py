"""Benchmark: `specops preflight` against the naive way, side by side in one run.

The naive way is what people type today: one ``ssh host python -c ...`` per check,
each a new SSH connection and a new python that imports what it needs (torch, vllm,
transformers, safetensors). specops runs every check in one python over one
connection and reads files and metadata instead of importing.

Both run against the built-in test host (``specops testhost.up``) on the tiny
DeepSeek-V3, alternating, ``--repeat`` times; we print medians and the ratio. The
AutoConfig check (a transformers import in a child) is timed apart, as the issue asks.

    .venv/bin/python scripts/bench_preflight.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.preflight import preflight_params
from specops.testhost.sshd import ALIAS, TestHost

INVENTORY = Path(__file__).resolve().parents[1] / "inventory.yaml"


def naive_commands(python: str, model: str, dataset: str, out: str) -> list[tuple[str, str]]:
    """(check, python source) pairs, one ssh round trip and one python each."""
    return [
        ("host", "import os, shutil; print(os.cpu_count(), shutil.disk_usage('/'))"),
        ("gpu", "import subprocess, shutil; shutil.which('nvidia-smi') and subprocess.run(['nvidia-smi'])"),
        ("torch", "import torch; print(torch.__version__, torch.cuda.is_available())"),
        ("vllm", "import vllm; print(vllm.__version__)"),
        ("speculators", "import importlib.metadata as m, speculators; print(m.version('speculators'))"),
        ("transformers", "import transformers, safetensors; print(transformers.__version__)"),
        ("config", f"import json; c = json.load(open({model + '/config.json'!r})); print(c.get('model_type'))"),
        ("shards", "import json, os; d = {m!r}; idx = json.load(open(d + '/model.safetensors.index.json')); "
                   "print([f for f in set(idx['weight_map'].values()) if not os.path.exists(d + '/' + f)])"
                   .format(m=model)),
        ("headers", "import glob; from safetensors import safe_open; "
                    f"print(sum(len(safe_open(f, 'pt').keys()) for f in glob.glob({model + '/*.safetensors'!r})))"),
        ("tokenizer", f"from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained({model!r}); "
                      "print(bool(t.chat_template))"),
        ("dataset", f"import json; print(sum(1 for l in open({dataset!r}) if json.loads(l)))"),
        ("drift", "import inspect; from vllm.config import SchedulerConfig; from vllm.v1.core.sched.scheduler "
                  "import Scheduler; print(inspect.signature(SchedulerConfig), inspect.signature(Scheduler))"),
        ("disk", f"import shutil, os; os.makedirs({out!r}, exist_ok=True); print(shutil.disk_usage({out!r}))"),
    ]


def run_naive(ssh_config: str, python: str, commands) -> float:
    t0 = time.perf_counter()
    for name, source in commands:
        cmd = f"{python} -c {shlex.quote(source)}"
        proc = subprocess.run(["ssh", "-F", ssh_config, ALIAS, cmd], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"naive check {name} failed: {proc.stderr[-500:]}")
    return time.perf_counter() - t0


def run_specops(host: Host, skip_autoconfig: bool) -> tuple[float, dict]:
    params = preflight_params(host, {}, skip_autoconfig=skip_autoconfig)
    t0 = time.perf_counter()
    with host:  # a fresh connection each time, as a CLI call would make
        payload = host.run_task("preflight", params)
    return time.perf_counter() - t0, payload["data"].get("seconds", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    info = TestHost().info()
    if not info["running"]:
        raise SystemExit("the test host is not running: .venv/bin/specops testhost.up")
    inv = load_inventory(INVENTORY)
    spec = inv.hosts["testhost"]
    python = spec.python.replace("~", str(Path.home()), 1)
    expand = lambda p: p.replace("~", str(Path.home()), 1)  # noqa: E731 (same machine as the host)
    commands = naive_commands(python, expand(spec.model_path), expand(spec.dataset), expand(spec.output_dir))
    run_specops(Host(spec, inv), True)  # warm: bundle uploaded, page cache filled
    ours, ours_full, naive, remote_static = [], [], [], []
    for _ in range(args.repeat):
        seconds, inner = run_specops(Host(spec, inv), skip_autoconfig=True)
        ours.append(seconds)
        remote_static.append(inner.get("static", 0) + inner.get("drift", 0) + inner.get("patch", 0))
        ours_full.append(run_specops(Host(spec, inv), skip_autoconfig=False)[0])
        naive.append(run_naive(info["ssh_config"], python, commands))
    med = statistics.median
    print(f"checks in the naive run: {len(commands)} ssh commands ({', '.join(n for n, _ in commands)})")
    print(f"specops preflight, static checks, whole round trip (median of {args.repeat}): {med(ours):.2f} s")
    print(f"  of which on the host (static probes + drift + patch status):          {med(remote_static):.2f} s")
    print(f"specops preflight with the AutoConfig check (timed apart):               {med(ours_full):.2f} s")
    print(f"  AutoConfig check adds:                                                  "
          f"{med(ours_full) - med(ours):.2f} s")
    print(f"naive, one ssh + one python per check:                                   {med(naive):.2f} s")
    print(f"ratio naive / specops (static):                                          {med(naive) / med(ours):.1f}x")
    print(f"targets: static <= 3 s -> {'met' if med(ours) <= 3 else 'MISSED'}; "
          f">= 5x faster -> {'met' if med(naive) / med(ours) >= 5 else 'MISSED'}")


if __name__ == "__main__":
    main()
