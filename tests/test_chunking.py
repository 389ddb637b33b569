"""When chunked prefill is safe for the hidden-states connector, read from its source (stdlib only).

The installed connectors (vLLM 0.32 on the modern test host, its CPU and fp8 subclasses) are
read for real in tests/test_long_samples.py; here, the rule on the shapes connectors have had.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from remote.extract.engines.vllm_server.chunking import when_it_writes

REPO = Path(__file__).resolve().parents[1]


def chain(source: str) -> list:
    """The classes of ``source``, last first (a subclass is written after its base)."""
    tree = ast.parse(source)
    return [("x.py", node) for node in reversed(tree.body) if isinstance(node, ast.ClassDef)]


WRITES_WHEN_FINISHED = '''
class ExampleHiddenStatesConnector:
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass  # Extraction happens in get_finished once all tokens are done.

    def _write_tensors(self, tensors, filename):
        save_file(tensors, filename)

    def _submit_async_write(self, pending):
        self._executor.submit(self._write_tensors, {}, pending.path)

    def get_finished(self, finished_req_ids):
        for pending in self._meta.pending_saves:
            self._submit_async_write(pending)
        return None, None
'''

WRITES_EVERY_STEP = '''
class ExampleHiddenStatesConnector:
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._stash(kv_layer)

    def wait_for_save(self):
        for path, tensors in self._stashed.items():
            safetensors.torch.save_file(tensors, path)

    def get_finished(self, finished_req_ids):
        return None, None
'''


def test_a_connector_that_writes_in_get_finished_allows_chunked_prefill():
    said = when_it_writes(chain(WRITES_WHEN_FINISHED))
    assert said["safe"] and said["writes_in"] == ["get_finished"], said
    assert "ExampleHiddenStatesConnector writes in get_finished" in said["why"]


def test_a_connector_that_writes_every_step_keeps_chunked_prefill_off():
    said = when_it_writes(chain(WRITES_EVERY_STEP))
    assert not said["safe"] and said["writes_in"] == ["wait_for_save"], said
    assert "chunk by chunk" in said["why"]


def test_a_subclass_overriding_the_write_is_judged_by_its_own_method():
    """The nearest definition wins, as at run time: a CPU subclass that writes synchronously from
    the same place keeps the base's verdict; one that moves the write to every step loses it."""
    same_place = WRITES_WHEN_FINISHED + '''
class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        self._write_tensors({}, pending.path)
'''
    assert when_it_writes(chain(same_place))["safe"]
    per_step = WRITES_WHEN_FINISHED + '''
class EagerConnector(ExampleHiddenStatesConnector):
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        torch.save(kv_layer, self._path(layer_name))
'''
    said = when_it_writes(chain(per_step))
    assert not said["safe"] and said["writes_in"] == ["save_kv_layer", "get_finished"], said


def test_a_connector_whose_writes_cannot_be_seen_is_not_trusted():
    said = when_it_writes(chain("class Opaque:\n    def get_finished(self, ids):\n        return self._impl(ids)\n"))
    assert not said["safe"] and said["writes_in"] == [] and "stays off" in said["why"]


def test_what_a_run_asks_for_meets_what_the_connector_allows():
    from remote.extract.engines.vllm_server.chunking import resolve

    safe, unsafe = when_it_writes(chain(WRITES_WHEN_FINISHED)), when_it_writes(chain(WRITES_EVERY_STEP))
    assert resolve(None, safe)["on"] and resolve("auto", safe)["on"] and resolve("on", safe)["on"]
    assert not resolve("auto", unsafe)["on"] and "chunk by chunk" in resolve("auto", unsafe)["why"]
    assert not resolve("off", safe)["on"]
    with pytest.raises(ValueError, match=r"chunked_prefill: on, but .* set chunked_prefill: auto or off"):
        resolve("on", unsafe)
    with pytest.raises(ValueError, match=r"chunked_prefill 'yes' must be one of auto, on, off"):
        resolve("yes", safe)


def test_prefix_caching_is_refused_by_name():
    from remote.extract.engines.vllm_server.chunking import refused_flags

    assert refused_flags(["--max-num-seqs", "4", "--enable-prefix-caching"]) == ["--enable-prefix-caching"]
    assert refused_flags(["--enable-prefix-caching=true"]) == ["--enable-prefix-caching=true"]
    assert refused_flags(["--no-enable-prefix-caching"]) == [] and refused_flags(None) == []


def test_server_args_are_checked_as_vllm_reads_them_underscores_dotted_keys_and_prefixes():
    """vLLM's FlexibleArgumentParser turns ``_`` into ``-`` in a ``--`` name and reads ``--name.key=v`` as
    part of ``--name``; argparse takes a unique prefix for the flag: each spelling is refused as the flag."""
    from remote.extract.engines.vllm_server.chunking import refused_flags, server_args_problem

    for spelling in ("--enable_prefix_caching", "--enable_prefix-caching=true", "--enable-prefix"):
        assert refused_flags([spelling]) == [spelling], spelling
        problem = server_args_problem([spelling])
        assert f"{spelling.split('=')[0]} (vLLM reads it as --enable-prefix-caching) would make" in problem, problem
    for spelling in ("--speculative_config", "--speculative-config.num_speculative_tokens=2", "--max_model_len",
                     "--tensor_parallel_size=2", "--kv_transfer_config.kv_role=kv_both"):
        assert refused_flags([spelling]) == [spelling], spelling
        assert "is set by the engine" in server_args_problem([spelling]), spelling
    # a plain server (eval) sets no speculative config of its own: the draft's goes through
    assert refused_flags(["--speculative_config", "{}"], plain=True) == []
    # the step budget is the user's to give, as a whole number (the memory plan reads it)
    assert server_args_problem(["--max_num_batched_tokens=8192"]) is None
    for bad in (["--max-num-batched-tokens", "8k"], ["--max-num-batched-tokens=0"]):
        assert "--max-num-batched-tokens" in server_args_problem(bad) and "whole number" in server_args_problem(bad)
    # so is the request count (the plan's sampler and MLA moments read it): a value vLLM would refuse, refused first
    assert server_args_problem(["--max_num_seqs=64"]) is None
    for bad in (["--max-num-seqs", "many"], ["--max-num-seqs=0"], ["--max_num_seqs", "-4"]):
        problem = server_args_problem(bad)
        assert f"--max-num-seqs {bad[-1].split('=')[-1]!r} is not a positive whole number of requests" in problem, problem
        assert "e.g. --max-num-seqs 256" in problem
    assert "--block-size 'big' is not a positive whole number of tokens" in server_args_problem(["--block-size", "big"])
    # flags that only look alike stay allowed
    assert refused_flags(["--no-enable-prefix-caching", "--max-num-seqs", "4", "--model-impl", "vllm",
                          "--max_num_batched_tokens=512", "-O3"]) == []


def test_the_installed_connectors_of_the_modern_stack_write_when_a_request_is_done(modern_hostenv_python):
    """vLLM 0.32's stock connector and hs-connectors' fp8 one, read where the modern env has them."""
    import json
    import subprocess

    code = ("import json; from remote.extract.engines.vllm_server import chunking, command; "
            "print(json.dumps({'stock': chunking.installed_verdict((command.STOCK_CONNECTOR, None)), "
            "'fp8': chunking.installed_verdict((command.FP8_CONNECTOR_CLASS, command.fp8_connector_module()))}))")
    out = subprocess.run([str(modern_hostenv_python), "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    said = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("stock", "fp8"):
        assert said[name]["safe"] and said[name]["writes_in"] == ["get_finished"], said


def test_preflight_says_on_refuses_a_one_step_budget_below_seq_len_and_passes_off(modern_hostenv_python):
    """``drift.server-chunking`` on the installed vLLM 0.32 (the stock connector, cuda host params): auto is on;
    off with a step budget below seq_len fails naming both and the fix; off with room is ok."""
    import json
    import subprocess

    code = ("import json, sys; from remote.drift import server; from remote.drift.pyindex import PackageIndex; "
            "from remote.drift.source import site_packages; index = PackageIndex(site_packages({})[1]); "
            "print(json.dumps([server.chunking_record(index, p) for p in json.loads(sys.argv[1])]))")
    cases = [{"device": "cuda", "seq_len": 4096},
             {"device": "cuda", "seq_len": 4096, "chunked_prefill": "off", "max_num_batched_tokens": 2048},
             {"device": "cuda", "seq_len": 1024, "chunked_prefill": "off", "max_num_batched_tokens": 2048}]
    out = subprocess.run([str(modern_hostenv_python), "-c", code, json.dumps(cases)], cwd=REPO, capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    auto, short, roomy = json.loads(out.stdout.strip().splitlines()[-1])
    assert auto["status"] == "ok" and auto["detail"]["on"] and auto["detail"]["writes_in"] == ["get_finished"], auto
    assert auto["summary"].startswith("chunked prefill on: ExampleHiddenStatesConnector writes in get_finished")
    assert short["status"] == "fail", short
    assert "max_num_batched_tokens 2048 is below a 4096-token sample and chunked prefill is off" in short["summary"]
    assert "raise max_num_batched_tokens to 4097" in short["fix"]
    assert roomy["status"] == "ok" and not roomy["detail"]["on"] and "off, as asked" in roomy["summary"], roomy


def test_preflight_refuses_prefix_caching_in_server_args_with_the_fix(modern_hostenv_python):
    import json
    import subprocess

    code = ("import json; from remote.drift import server; from remote.drift.pyindex import PackageIndex; "
            "from remote.drift.source import site_packages; "
            "print(json.dumps(server.server_args_record(PackageIndex(site_packages({})[1]), "
            "{'server_args': ['--enable-prefix-caching', '--enable_prefix_caching']})))")
    out = subprocess.run([str(modern_hostenv_python), "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["status"] == "fail" and "--enable-prefix-caching would make the extracted files wrong" in \
        record["summary"], record
    assert "--enable_prefix_caching (vLLM reads it as --enable-prefix-caching) would make" in record["summary"]
    assert record["fix"] == "drop --enable-prefix-caching --enable_prefix_caching from the run's server_args"
