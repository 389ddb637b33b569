"""A broken inventory gives one clear error each, naming the file, the host and the field."""
from __future__ import annotations

import textwrap

import pytest

from specops.errors import InventoryError, UsageError
from specops.exit_codes import ExitCode
from specops.inventory import load_inventory

GOOD_HOST = ("address: gpu-a.example.org\npython: /opt/env/bin/python\n"
             "model_path: /models/m\noutput_dir: /data/out\n")


def write(tmp_path, text):
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    return path


def host_block(extra=""):
    return "hosts:\n  gpu-a:\n" + textwrap.indent(GOOD_HOST + extra, "    ")


def test_good_inventory_merges_defaults_and_env(tmp_path):
    path = write(tmp_path, "defaults:\n  tp: 8\n  env: {A: '1', B: '2'}\n" + host_block("env: {B: '3'}\n")
                 + "\ngroups:\n  train: [gpu-a]\n")
    inv = load_inventory(path)
    host = inv.hosts["gpu-a"]
    assert host.tp == 8 and host.env == {"A": "1", "B": "3"}
    assert [h.name for h in inv.select("train")] == ["gpu-a"]
    assert [h.name for h in inv.select(None)] == ["gpu-a"]


@pytest.mark.parametrize("extra, words", [
    ("colour: blue\n", ["host 'gpu-a'", "unknown field 'colour'", "allowed:"]),
    ("tp: eight\n", ["host 'gpu-a'", "field 'tp'", "integer", "'eight'"]),
    ("device: tpu\n", ["host 'gpu-a'", "field 'device'", "must be one of cuda, cpu", "'tpu'"]),
    ("env: {'BAD-NAME': x}\n", ["host 'gpu-a'", "field 'env'", "BAD-NAME"]),
    ("gpu_memory_utilization: 1.5\n", ["field 'gpu_memory_utilization'", "must be above 0 and at most 1"]),
])
def test_bad_field_names_file_host_and_field(tmp_path, extra, words):
    path = write(tmp_path, host_block(extra))
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    text = str(err.value)
    assert str(path) in text and "hint:" in text
    for word in words:
        assert word in text
    assert err.value.code == ExitCode.USAGE


def test_missing_field(tmp_path):
    path = write(tmp_path, "hosts:\n  gpu-a:\n    address: x\n    python: /p\n    output_dir: /o\n")
    with pytest.raises(InventoryError, match=r"host 'gpu-a': missing required field 'model_path'"):
        load_inventory(path)


def test_unknown_group_member(tmp_path):
    path = write(tmp_path, host_block() + "\ngroups:\n  train: [gpu-a, gpu-z]\n")
    with pytest.raises(InventoryError, match=r"group 'train': unknown host\(s\) \['gpu-z'\]"):
        load_inventory(path)


def test_unknown_selector_is_usage_error(tmp_path):
    inv = load_inventory(write(tmp_path, host_block()))
    with pytest.raises(UsageError, match="no host or group named 'gpu-q'") as err:
        inv.select("gpu-q")
    assert "gpu-a" in err.value.hint


def test_every_broken_host_is_listed(tmp_path):
    text = host_block("tp: 0\n") + "  gpu-b:\n    address: y\n"
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, text))
    assert "host 'gpu-a': field 'tp'" in str(err.value)
    assert "host 'gpu-b': missing required field 'python'" in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("hosts: [a, b]\n", "'hosts' must be a non-empty mapping"),
    ("hosts: {}\nextra: 1\n", "unknown top-level key(s) ['extra']"),
    ("hosts: {a: [\n", "not valid YAML"),
    ("- 1\n", "top level must be a mapping"),
])
def test_malformed_file(tmp_path, text, words):
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, text))
    assert words in str(err.value)


def test_missing_file_hint(tmp_path):
    with pytest.raises(InventoryError, match="does not exist") as err:
        load_inventory(tmp_path / "nope.yaml")
    assert "--inventory" in err.value.hint


def test_laptop_variables_expand_with_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_TEST_ROOT", "/srv/cache")
    monkeypatch.delenv("SPECOPS_TEST_UNSET", raising=False)
    path = write(tmp_path, "hosts:\n  gpu-a:\n" + textwrap.indent(
        "address: gpu-a.example.org\npython: ${SPECOPS_TEST_ROOT}/env/bin/python\n"
        "model_path: ${SPECOPS_TEST_UNSET:-~/.cache/specops}/m\noutput_dir: /data/$${literal}\n"
        "env: {GREETING: '${HOME} stays text'}\n", "    "))
    host = load_inventory(path).hosts["gpu-a"]
    assert host.python == "/srv/cache/env/bin/python"
    assert host.model_path == "~/.cache/specops/m"  # ~ stays for the host to expand
    assert host.output_dir == "/data/${literal}"
    assert host.env == {"GREETING": "${HOME} stays text"}  # the job's env travels verbatim


def test_unset_laptop_variable_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECOPS_TEST_UNSET", raising=False)
    path = write(tmp_path, host_block().replace("/models/m", "${SPECOPS_TEST_UNSET}/m"))
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert "hosts.gpu-a.model_path" in str(err.value) and "SPECOPS_TEST_UNSET" in str(err.value)
    assert err.value.code == ExitCode.USAGE


def test_canary_samples_is_a_field_and_a_flag_checked_with_the_fix(tmp_path):
    """The canary (the run's first samples checked against the engine's own logprobs) is set on the laptop:
    the inventory's ``canary_samples`` (default 2), ``--canary-samples N`` over it, 0 turns it off; a value
    out of range names the field or the flag and says what to set."""
    from specops.params import run_params

    assert load_inventory(write(tmp_path, host_block())).hosts["gpu-a"].canary_samples == 2
    spec = load_inventory(write(tmp_path, host_block("canary_samples: 0\n"))).hosts["gpu-a"]
    assert spec.canary_samples == 0 and run_params(spec)["canary_samples"] == 0
    assert run_params(spec, canary_samples="5")["canary_samples"] == 5  # the flag wins
    assert run_params(spec, canary_samples="0")["canary_samples"] == 0
    for bad, said in (("canary_samples: -1\n", "must be from 0 to 32 (got -1)"),
                      ("canary_samples: 33\n", "must be from 0 to 32 (got 33)"),
                      ("canary_samples: two\n", "valid integer"),
                      ("canary_samples: true\n", "valid integer")):
        with pytest.raises(InventoryError) as err:
            load_inventory(write(tmp_path, host_block(bad)))
        text = str(err.value)
        assert "host 'gpu-a': field 'canary_samples'" in text and said in text, text
        assert err.value.code == ExitCode.USAGE
    # the flag: the same entry of RUN_ARGS (remote/wire/argspec.py) in the same words, the flag's help as the fix
    for bad, said in (("-1", "must be from 0 to 32"), ("33", "must be from 0 to 32"), ("two", "must be an integer"),
                      ("1.5", "must be an integer"), ("２", "must be an integer")):
        with pytest.raises(UsageError) as err:
            run_params(spec, canary_samples=bad)
        assert f"--canary-samples {bad!r} {said}" in str(err.value)
        assert "--canary-samples" in err.value.hint and "else 2; 0: none" in err.value.hint


def test_long_samples_chunked_prefill_and_writer_threads_are_fields_checked_with_the_fix(tmp_path):
    """What a run does with a sample past seq_len (``long_samples``, also ``--long-samples``), chunked prefill
    (``chunked_prefill``: auto|on|off) and the connector's writer threads reach the run's params; a bad value
    names its field."""
    from specops.params import run_params

    spec = load_inventory(write(tmp_path, host_block())).hosts["gpu-a"]
    params = run_params(spec)
    assert (params["long_samples"], params["chunked_prefill"]) == ("truncate", "auto") and "writer_threads" not in params
    spec = load_inventory(write(tmp_path, host_block("long_samples: refuse\nchunked_prefill: off\nwriter_threads: 4\n"
                                                     ))).hosts["gpu-a"]
    params = run_params(spec)
    assert (params["long_samples"], params["chunked_prefill"], params["writer_threads"]) == ("refuse", "off", 4)
    assert run_params(spec, long_samples="truncate")["long_samples"] == "truncate"  # the flag wins
    with pytest.raises(UsageError) as err:
        run_params(spec, long_samples="cut")
    assert "--long-samples 'cut' must be one of truncate, refuse, drop" in str(err.value)
    assert "refuse (stop before the load" in err.value.hint
    assert load_inventory(write(tmp_path, host_block("chunked_prefill: on\n"))).hosts["gpu-a"].chunked_prefill == "on"
    for bad, field in (("long_samples: cut\n", "long_samples"), ("chunked_prefill: maybe\n", "chunked_prefill"),
                       ("writer_threads: 0\n", "writer_threads")):
        with pytest.raises(InventoryError) as err:
            load_inventory(write(tmp_path, host_block(bad)))
        assert f"host 'gpu-a': field '{field}'" in str(err.value), str(err.value)


def test_chat_turns_and_minimum_valid_tokens_are_fields_and_flags_checked_with_the_fix(tmp_path):
    """Issue 40: ``turns`` (auto|per-turn|whole) and ``minimum_valid_tokens`` reach the run's params from the
    inventory or the flag; a bad value names its field or flag."""
    from specops.params import run_params

    spec = load_inventory(write(tmp_path, host_block())).hosts["gpu-a"]
    params = run_params(spec)
    assert (params["turns"], params["minimum_valid_tokens"]) == ("auto", 1)
    spec = load_inventory(write(tmp_path, host_block("turns: whole\nminimum_valid_tokens: 4\n"
                                                     "long_samples: drop\n"))).hosts["gpu-a"]
    params = run_params(spec)
    assert (params["turns"], params["minimum_valid_tokens"], params["long_samples"]) == ("whole", 4, "drop")
    flagged = run_params(spec, turns="per-turn", minimum_valid_tokens="0")
    assert (flagged["turns"], flagged["minimum_valid_tokens"]) == ("per-turn", 0)  # the flags win
    with pytest.raises(UsageError) as err:
        run_params(spec, turns="each")
    assert "--turns 'each' must be one of auto, per-turn, whole" in str(err.value) and "per-turn (a sample" in err.value.hint
    with pytest.raises(UsageError) as err:
        run_params(spec, minimum_valid_tokens="-1")
    assert "--minimum-valid-tokens '-1'" in str(err.value)
    for bad, field in (("turns: each\n", "turns"), ("minimum_valid_tokens: -1\n", "minimum_valid_tokens")):
        with pytest.raises(InventoryError) as err:
            load_inventory(write(tmp_path, host_block(bad)))
        assert f"host 'gpu-a': field '{field}'" in str(err.value), str(err.value)


# --------------------------------------------------------------------------- replicas over several hosts

def replica_inventory(tmp_path, replicas: str, extra_hosts: str = "", tp: int = 4):
    hosts = "".join(f"  {h}:\n    address: 127.0.0.{i + 1}\n    python: /p\n    model_path: /m\n"
                    f"    output_dir: /o\n    tp: {tp}\n" for i, h in enumerate(("a", "b", "c", "d")))
    return write(tmp_path, "hosts:\n" + hosts + extra_hosts + "groups:\n  pair: [a, b]\nreplicas:\n" + replicas)


def test_replica_names_its_hosts_head_first(tmp_path):
    inv = load_inventory(replica_inventory(tmp_path, "  big: [b, a]\n  wide: {hosts: [c, d], tp: 8, master_port: 30000}\n"))
    big, wide = inv.replicas["big"], inv.replicas["wide"]
    assert big.hosts == ["b", "a"] and big.head == "b" and big.tp == 4 and big.ranks_per_host == 2
    assert big.ranks_of("a") == [2, 3] and big.master_port == 29500 and big.watch_port == 29501
    assert wide.tp == 8 and wide.ranks_of("d") == [4, 5, 6, 7] and wide.master_port == 30000
    assert [h.name for h in inv.select("big")] == ["b", "a"]
    assert inv.replica_of("a") is big and inv.replica_of("x") is None
    # a group run over replicas and plain hosts: one unit each, a replica's head first
    assert inv.units(["b", "a", "c", "d"]) == {"b": ["b", "a"], "c": ["c", "d"]}


def test_plain_hosts_and_replicas_mix(tmp_path):
    inv = load_inventory(replica_inventory(tmp_path, "  big: [a, b]\n"))
    assert inv.units(["c", "a", "b", "d"]) == {"c": ["c"], "a": ["a", "b"], "d": ["d"]}


def test_part_of_a_replica_is_refused(tmp_path):
    inv = load_inventory(replica_inventory(tmp_path, "  big: [a, b]\n"))
    with pytest.raises(UsageError) as err:
        inv.units(["b", "c"])
    assert "replica 'big'" in str(err.value) and "a of it is not selected" in str(err.value)
    assert "--on big" in err.value.hint


@pytest.mark.parametrize("replicas, words", [
    ("  big: [a, x]\n", ["replica 'big'", "unknown host(s) ['x']"]),
    ("  big: [a]\n", ["replica 'big'", "names 1 host(s)", "at least 2"]),
    ("  big: [a, a]\n", ["replica 'big'", "names a more than once"]),
    ("  big: [a, b]\n  other: [b, c]\n", ["replica 'other'", "b (in replica 'big')", "one replica only"]),
    ("  big: {hosts: [a, b, c], tp: 4}\n", ["replica 'big'", "field 'tp' = 4", "3 hosts", "multiple of 3"]),
    ("  big: [a, b, c]\n", ["replica 'big'", "the head 'a'", "does not divide"]),
    ("  big: {hosts: [a, b], size: 2}\n", ["replica 'big'", "unknown field(s) ['size']"]),
    ("  big: {hosts: [a, b], master_port: 70000}\n", ["replica 'big'", "field 'master_port'"]),
    ("  big: {hosts: [a, b], tp: two}\n", ["replica 'big'", "field 'tp'"]),
    ("  pair: [a, b]\n", ["replica 'pair'", "same name as a group"]),
    ("  big: a\n", ["replica 'big'", "list of host names"]),
])
def test_bad_replica_names_it_and_the_field(tmp_path, replicas, words):
    path = replica_inventory(tmp_path, replicas)
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    text = str(err.value)
    assert str(path) in text
    for word in words:
        assert word in text, text


def test_replica_host_needs_an_ip_to_be_reached_on(tmp_path):
    extra = "  e:\n    address: gpu-e.example.org\n    python: /p\n    model_path: /m\n    output_dir: /o\n"
    with pytest.raises(InventoryError, match=r"replica 'big': host\(s\) e: field 'node_address' is needed"):
        load_inventory(replica_inventory(tmp_path, "  big: {hosts: [a, e], tp: 2}\n", extra))
    named = extra + "    node_address: 10.0.0.5\n"
    (tmp_path / "two").mkdir()
    inv = load_inventory(replica_inventory(tmp_path / "two", "  big: {hosts: [a, e], tp: 2}\n", named))
    assert inv.hosts["e"].replica_address == "10.0.0.5" and inv.hosts["a"].replica_address == "127.0.0.1"
    (tmp_path / "three").mkdir()
    with pytest.raises(InventoryError, match=r"host 'e': field 'node_address': must be an IP address"):
        load_inventory(replica_inventory(tmp_path / "three", "  big: [a, b]\n", extra + "    node_address: gpu-e\n"))


def test_server_args_is_a_field_the_memory_plan_follows_and_a_flag_that_would_make_the_files_wrong_is_refused(tmp_path):
    """``server_args`` (more vLLM flags): the README's way to set the step budget; it reaches the run's params, the
    engine's budget is the one given; prefix caching or a non-number budget is refused by field at load."""
    from remote.extract.engines.vllm_server import command
    from specops.params import run_params

    assert "server_args" not in run_params(load_inventory(write(tmp_path, host_block())).hosts["gpu-a"])
    spec = load_inventory(write(tmp_path, host_block('server_args: ["--max-num-batched-tokens", "8192"]\n'
                                                     'device: cuda\n'))).hosts["gpu-a"]
    params = run_params(spec)
    assert params["server_args"] == ["--max-num-batched-tokens", "8192"]
    assert command.batched_tokens({**params, "chunked_prefill_on": True}, 4097) == 8192
    for bad, words in (('server_args: ["--enable-prefix-caching"]\n', "would make the extracted files wrong"),
                       ('server_args: ["--max-num-batched-tokens", "lots"]\n', "not a positive whole number"),
                       ('server_args: ["--max-num-seqs", "lots"]\n', "not a positive whole number of requests"),
                       ('server_args: ["--max-model-len", "9"]\n', "is set by the engine")):
        with pytest.raises(InventoryError) as err:
            load_inventory(write(tmp_path, host_block(bad)))
        assert "host 'gpu-a': field 'server_args'" in str(err.value) and words in str(err.value), str(err.value)
