"""Which build (CPU or CUDA) an installed torch-family package is, read from its files.

PyPI's default Linux wheels of torchvision, torchaudio and torchcodec are CUDA builds:
their extension modules link ``libtorch_cuda.so`` / ``libc10_cuda.so`` and often bundle
a CUDA runtime (``torchvision.libs/libcudart.*.so``). Beside a CPU build of torch those
libraries are not there, so the extension does not load and the package's first
``import`` dies (``operator torchvision::nms does not exist``), taking every package
that imports it (speculators, through transformers) down with it. Nothing here imports
anything: the evidence is the version's local label, the files the distribution's
``RECORD`` lists, and the ``DT_NEEDED`` entries of its ELF extension modules::

    >>> addon_build(versions.distribution("torchvision"))
    {'name': 'torchvision', 'version': '0.28.0', 'build': 'cuda',
     'evidence': ['bundles torchvision.libs/libcudart.faf08d9a.so.13', 'torchvision/_C.so needs libc10_cuda.so']}
"""
from __future__ import annotations

import importlib.util
import os
import re
import struct

from remote.system import versions

#: torch's companions whose CUDA builds break beside a CPU torch (and their import breaks speculators').
TORCH_ADDONS = ("torchvision", "torchaudio", "torchcodec")
#: shared-library name prefixes that only a CUDA (or ROCm) build links or bundles.
GPU_LIBRARIES = ("libcudart", "libcuda.so", "libc10_cuda", "libtorch_cuda", "libnvjpeg", "libcublas", "libcudnn",
                 "libnvrtc", "libcufft", "libcurand", "libcusparse", "libnccl", "libnvToolsExt", "libnpp",
                 "libamdhip64", "libc10_hip", "libtorch_hip")
#: at most this many extension modules are read per distribution (headers and the dynamic section only).
MAX_EXTENSIONS = 32
_REQUIREMENT = re.compile(r"^\s*torch\s*\(?\s*(?P<spec>[^;()]*?)\s*\)?\s*(?:;(?P<marker>.*))?$")


def _gpu_library(name: str) -> bool:
    base = os.path.basename(name)
    return any(base.startswith(prefix) for prefix in GPU_LIBRARIES)


def elf_needed(path) -> list[str] | None:
    """The ``DT_NEEDED`` names of an ELF shared object, or None when it is not one (or unreadable).

    Reads the program headers, the ``PT_DYNAMIC`` segment and the string table it
    points at: a few KiB of a file that may be hundreds of MiB.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF":
                return None
            is64, end = head[4] == 2, "<" if head[5] == 1 else ">"
            if is64:
                (phoff,) = struct.unpack(end + "Q", head[32:40])
                phentsize, phnum = struct.unpack(end + "HH", head[54:58])
            else:
                (phoff,) = struct.unpack(end + "I", head[28:32])
                phentsize, phnum = struct.unpack(end + "HH", head[42:46])
            fh.seek(phoff)
            table = fh.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                entry = table[i * phentsize:(i + 1) * phentsize]
                if is64:
                    p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack(end + "IIQQQQ", entry[:40])
                else:
                    p_type, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack(end + "IIIII", entry[:20])
                if p_type == 1:  # PT_LOAD: maps addresses to file offsets
                    loads.append((p_vaddr, p_offset, p_filesz))
                elif p_type == 2:  # PT_DYNAMIC
                    dynamic = (p_offset, p_filesz)
            if dynamic is None:
                return []
            fh.seek(dynamic[0])
            data = fh.read(dynamic[1])
            size, fmt = (16, end + "qQ") if is64 else (8, end + "iI")
            needed, strtab, strsz = [], None, None
            for off in range(0, len(data) - size + 1, size):
                tag, value = struct.unpack(fmt, data[off:off + size])
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED: an offset into the string table
                    needed.append(value)
                elif tag == 5:  # DT_STRTAB (an address)
                    strtab = value
                elif tag == 10:  # DT_STRSZ
                    strsz = value
            if not needed or strtab is None or strsz is None:
                return []
            offset = next((strtab - vaddr + start for vaddr, start, filesz in loads
                           if vaddr <= strtab < vaddr + filesz), None)
            if offset is None:
                return None
            fh.seek(offset)
            strings = fh.read(strsz)
    except (OSError, struct.error):
        return None
    names = []
    for start in needed:
        stop = strings.find(b"\0", start)
        names.append(strings[start:stop if stop >= 0 else len(strings)].decode("utf-8", "replace"))
    return names


def _local_label(version: str) -> str:
    return version.partition("+")[2].lower()


def addon_build(dist) -> dict:
    """``{"name", "version", "build": "cuda" | "cpu", "evidence": [...], "torch_pin"}`` of one distribution.

    ``build`` is ``cuda`` when the version's local label says so (``+cu128``, ``+rocm6.2``)
    or when the distribution bundles or links a GPU library; ``cpu`` otherwise.
    ``torch_pin`` is the torch version its metadata requires (``==2.13.0``), or None.
    """
    name, version = dist.metadata["Name"], dist.version
    label = _local_label(version)
    evidence = []
    if label.startswith(("cu", "rocm")):
        evidence.append(f"version label +{label}")
    files = [str(f) for f in (dist.files or [])]
    bundled = sorted({f for f in files if _gpu_library(f) and ".dist-info" not in f})
    evidence += [f"bundles {f}" for f in bundled[:3]]
    if not label.startswith("cpu"):
        extensions = [f for f in files if re.search(r"\.so(\.|$)", f) and f not in bundled][:MAX_EXTENSIONS]
        for rel in extensions:
            needed = elf_needed(dist.locate_file(rel)) or []
            gpu = [n for n in needed if _gpu_library(n)]
            if gpu:
                evidence.append(f"{rel} needs {', '.join(gpu[:3])}")
    pin = None
    for req in dist.requires or []:
        found = _REQUIREMENT.match(req)
        if found and not (found["marker"] and "extra" in found["marker"]):
            pin = found["spec"] or None
    return {"name": name, "version": version, "build": "cuda" if evidence else "cpu",
            "evidence": evidence, "torch_pin": pin}


def torch_build(dirs=None) -> dict:
    """``{"version", "build": "cuda" | "cpu" | None}`` of the installed torch (None: not installed).

    A CUDA torch ships ``torch/lib/libtorch_cuda.so`` (PyPI's default Linux wheel, which
    also runs on a CPU); the CPU build (``+cpu``) has no such file.
    """
    version = versions.installed_version("torch", dirs)
    if version is None:
        return {"version": None, "build": None}
    label = _local_label(version)
    if label.startswith(("cu", "rocm")):
        return {"version": version, "build": "cuda"}
    if label.startswith("cpu"):
        return {"version": version, "build": "cpu"}
    try:
        spec = importlib.util.find_spec("torch")  # a top-level find_spec does not run the package
    except (ImportError, ValueError):
        spec = None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib") if spec and \
        spec.submodule_search_locations else None
    gpu = bool(lib) and any(os.path.exists(os.path.join(lib, f"lib{n}.so")) for n in ("torch_cuda", "torch_hip"))
    return {"version": version, "build": "cuda" if gpu else "cpu"}


def installed_addons(dirs=None) -> list[dict]:
    """:func:`addon_build` of every installed one of :data:`TORCH_ADDONS`."""
    found = []
    for name in TORCH_ADDONS:
        dist = versions.distribution(name, dirs)
        if dist is not None:
            found.append(addon_build(dist))
    return found
