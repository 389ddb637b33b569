"""Runs at the start of every python process whose PYTHONPATH has this dir (see ``remote/system/cpu.py``).

Asks Linux for AMX tile permission, which vLLM's own CPU kernels use without asking (a
process that never asked dies with SIGILL at its first AMX instruction), then runs the
``sitecustomize`` this one shadows, if the env has one. Standard library only; never raises.
"""


def _ask_for_amx() -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    except Exception:  # not x86 Linux, or no libc: nothing to ask for
        pass


def _chain() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]  # realpath: a symlinked copy is us too
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_ask_for_amx()
try:
    _chain()
except Exception as exc:  # a broken sitecustomize of the env must not look like ours
    import sys

    print(f"sitecustomize of this env failed: {exc!r}", file=sys.stderr)
