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
    ("device: tpu\n", ["host 'gpu-a'", "field 'device'", "'cuda'", "'cpu'"]),
    ("env: {'BAD-NAME': x}\n", ["host 'gpu-a'", "field 'env'", "BAD-NAME"]),
    ("gpu_memory_utilization: 1.5\n", ["field 'gpu_memory_utilization'", "less than or equal to 1"]),
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
