"""The test host's tiny models and chat dataset, built once and cached (controller side).

``reference_models.py`` (beside this file, with ``remote/extract/tinymodel.py``'s twin machinery)
does the building inside the host env's python (it needs torch and transformers, which
the controller does not have). The result is cached under ``<cache_root>/models/<hash>``
where the hash covers both builders' bytes and the python version, so changing a
builder rebuilds and nothing else does.

Run it directly: ``python -m specops.testhost.models`` prints the paths as JSON.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specops.testhost.hostenv import cache_root
from specops.transport.assets import asset, asset_root

#: What the builder writes, relative to the cache dir; also what callers get back.
LAYOUT = {"llama": "llama", "deepseek_v3": "deepseek_v3", "kimi_k25": "kimi_k25",
          "dataset": "chat.jsonl"}
COMPLETE_MARKER = ".specops-complete"
#: the DFlash family's trainer defaults are sized for GPUs (5 draft layers, 512 anchors of a 16-token block: ~37 s a
#: step on 2 CPU cores); one layer and 32 anchors train the tiny targets in ~0.1 s a step (``specops train`` flags)
SMALL_DFLASH_TRAINER_ARGS = ("--trainer-arg=--num-layers=1", "--trainer-arg=--max-anchors=32")
#: the reference set's builder; it runs by path in the host env, with ``remote/`` on its path.
REFERENCE_BUILDER = Path(__file__).resolve().parent / "reference_models.py"
#: runs REFERENCE_BUILDER as ``__main__`` without putting its folder first on ``sys.path``
#: (``python FILE`` would, and this package's module names would shadow installed ones).
_RUN_BY_PATH = ("import runpy, sys; path = sys.argv.pop(1); sys.argv[0] = path; "
                "runpy.run_path(path, run_name='__main__')")


def models_hash(python: Path) -> str:
    ver = subprocess.run(
        [str(python), "-c", "import sys;print(sys.version.split()[0])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    digest = hashlib.sha256((asset("remote") / "extract" / "tinymodel.py").read_bytes())
    digest.update(REFERENCE_BUILDER.read_bytes())
    digest.update(f"\0python={ver}".encode())
    return digest.hexdigest()[:16]


def _paths(root: Path) -> dict[str, Path]:
    return {name: root / rel for name, rel in LAYOUT.items()}


def ensure_models(python: Path, quiet: bool = True) -> dict[str, Path]:
    """Return the tiny models' paths, building them with ``python`` when not cached.

    :param python: the host env's python (has torch, transformers, tokenizers).
    :returns: ``{"llama", "deepseek_v3", "kimi_k25"}`` -> model dir, ``"dataset"`` -> JSONL.
    :raises subprocess.CalledProcessError: when the builder fails (its output is
        attached); nothing half-built is left in the cache.
    """
    target = cache_root() / "models" / models_hash(Path(python))
    if (target / COMPLETE_MARKER).exists():
        return _paths(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two concurrent callers (two pytest sessions, two helpers) must not both build.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE_MARKER).exists():
            return _paths(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            env = dict(os.environ, PYTHONPATH=str(asset_root()), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1")
            subprocess.run(
                [str(python), "-c", _RUN_BY_PATH, str(REFERENCE_BUILDER), "--out", str(staging)],
                cwd=asset_root(), env=env, check=True,
                stdout=subprocess.PIPE if quiet else None,
                stderr=subprocess.STDOUT if quiet else None,
            )
            os.chmod(staging, 0o755)  # mkdtemp makes it 0700; the sshd test user reads it
            (staging / COMPLETE_MARKER).write_text(json.dumps(LAYOUT) + "\n")
            shutil.rmtree(target, ignore_errors=True)  # a leftover without marker
            os.rename(staging, target)  # same filesystem: atomic
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return _paths(target)


if __name__ == "__main__":
    from specops.testhost.hostenv import ensure_hostenv

    paths = ensure_models(ensure_hostenv(quiet=True), quiet="--verbose" not in sys.argv)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
