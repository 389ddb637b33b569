"""Preflight, the group plan and the run read the same inputs the same way (issue 20: 5, 6, 8, 10, 14).

Every case runs the real pieces: the host code in the test host's own python env (the
shard probe a group plan is built from, ``remote.probes.preflight.main``, the supervisor's
dataset reader), and ``specops`` over the real sshd where the run itself is the point.
A run that must refuse its input does so before any model loads (it fails while
tokenizing), so no case here waits for vLLM. The host-side cases are answered by the env's
long-lived host python (``tests/hostcall.py``): one interpreter and one transformers import
for all of them, each case still its own call with its own input and assertions.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hostcall
from test_preflight_remote import base_params, host_preflight

REPO = Path(__file__).resolve().parents[1]
SPECOPS = Path(sys.executable).parent / "specops"
#: the shard probe a group plan is built from, preflight's data records and the supervisor's reader, on one
#: input; run by the host env's long-lived python (tests/hostcall.py), so the cases share its imports
AGREE = """
def main(params):
    from remote.extract import dataset, shard
    from remote.system import modelconfig
    from remote.probes import preflight
    out = {"plan": shard.count_rows(params["dataset"], params.get("max_samples"))[0]}
    pf = preflight.main(params)
    out["preflight"] = {r["name"]: r for r in pf["records"] if r["area"] == "data"}
    try:
        out["run"] = len(dataset.load_token_samples(params, params["model_path"], vocab_size=modelconfig.text_value(
            modelconfig.read(params["model_path"]), "vocab_size")))
    except ValueError as exc:
        out["run_error"] = str(exc)
    return out
"""


def agree(python: Path, params: dict) -> dict:
    return hostcall.run_code(python, AGREE, params, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def tok(*ids, **extra) -> bytes:
    return json.dumps({"input_ids": list(ids), **extra}, ensure_ascii=False).encode()


# -- 5. one row rule: the plan counts what the run reads --------------------------------------

#: (id, file bytes, rows every reader must count) -- all rows usable
GOOD = [
    ("crlf", tok(1, 2) + b"\r\n" + tok(3) + b"\r\n\r\n" + tok(4, 5) + b"\r\n", 3),
    ("cr-inside-a-row", b'{"input_ids": [1,\r 2]}\n' + tok(3) + b"\n", 2),
    # str.splitlines() splits on all of these; a JSON string may hold them raw
    ("separators-in-strings", tok(1, note="a\u2028b\u2029c\x85d\u000be") + b"\n" + tok(2) + b"\n", 2),
    ("bom-and-blank-lines", b"\xef\xbb\xbf" + tok(1) + b"\n \t\n\n" + tok(2) + b"\n", 2),
]
#: (id, file bytes, the line the run and preflight both name) -- a row no reader may drop
BAD = [
    ("stray-cr-between-rows", tok(1, 2) + b"\n" + tok(3) + b"\r" + tok(4) + b"\n" + tok(5) + b"\n", 2),
    ("line-of-only-x1c", tok(1) + b"\n" + tok(2) + b"\n\x1c\n" + tok(3) + b"\n", 3),
    ("line-of-only-x1e-u2028", tok(1) + b"\n\x1e\xe2\x80\xa8\n" + tok(2) + b"\n", 2),
]


@pytest.mark.parametrize("data,rows", [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_the_plan_preflight_and_the_run_count_the_same_rows(hostenv_python, tiny_models, tmp_path, data, rows):
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    got = agree(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path)))
    assert got.get("run_error") is None, got
    assert (got["plan"], got["run"], got["preflight"]["data.file"]["detail"]["records"]) == (rows, rows, rows)
    assert got["preflight"]["data.records"]["status"] == "ok", got["preflight"]["data.records"]


@pytest.mark.parametrize("data,line", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_row_the_readers_once_split_differently_fails_everywhere_naming_its_line(hostenv_python, tiny_models,
                                                                                   tmp_path, data, line):
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    got = agree(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path)))
    rec = got["preflight"]["data.records"]
    assert rec["status"] == "fail" and [b["line"] for b in rec["detail"]["bad"]] == [line], rec
    assert f"{path}:{line}: not JSON" in got["run_error"], got
    # the plan counts that line as a row too: no global index means another sample on another host
    assert got["plan"] == got["preflight"]["data.file"]["detail"]["records"]


# -- 8. preflight accepts every row shape the run reads ----------------------------------------

def _mixed_dataset(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 5]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
    )) + "\n")
    return path


def _specops(*args, timeout=600) -> tuple[int, dict, str]:
    proc = subprocess.run([str(SPECOPS), *args, "--json"], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, timeout=timeout, env={**os.environ, "COLUMNS": "250"})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    return proc.returncode, doc, proc.stdout + proc.stderr


def _records(doc: dict) -> dict:
    return {r["name"]: r for r in doc["hosts"][0]["records"]}


@pytest.mark.parametrize("stack", ["modern", "seed"])
def test_preflight_over_ssh_accepts_pre_tokenized_and_messages_rows(stack, make_inventory, modern_make_inventory,
                                                                     tiny_models, tmp_path):
    make = modern_make_inventory if stack == "modern" else make_inventory
    inv = make(model_path=str(tiny_models["llama"]), dataset=str(_mixed_dataset(tmp_path)),
               env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    code, doc, _ = _specops("preflight", "--inventory", str(inv), "--skip-autoconfig")
    recs = _records(doc)
    assert recs["data.records"]["status"] == "ok", recs["data.records"]
    assert recs["data.records"]["detail"]["kinds"] == {"tokens": 2, "chat": 2}
    # rows are counted as rows ("2 tokens" once read as a token count)
    assert recs["data.records"]["summary"].endswith(": 2 chat row(s), 2 pre-tokenized row(s)"), recs["data.records"]
    assert "all 4 rows" in recs["data.records"]["summary"]


# -- 6. a layer id is range-checked as typed, before it is translated ---------------------------

def test_output_minus_one_is_refused_by_the_run_as_by_preflight(modern_make_inventory, tiny_models, tmp_path):
    """``output:-1`` once became ``input:0`` in the supervisor: the embeddings, recorded as a layer."""
    inv = modern_make_inventory(model_path=str(tiny_models["llama"]), dataset=str(_mixed_dataset(tmp_path)),
                                max_samples=2, seq_len=32, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    code, doc, _ = _specops("preflight", "--inventory", str(inv), "--skip-autoconfig", "--layer-ids", "output:-1")
    rec = _records(doc)["layers.ids"]
    assert code != 0 and rec["status"] == "fail" and "output:-1 is out of range 0..7" in rec["summary"]
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([str(SPECOPS), "extract", "--inventory", str(inv), "--run-id", "minus1", "--layer-ids",
                           "output:-1", "--skip-preflight", "--skip-smoke"], capture_output=True, text=True,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=600, env={**os.environ, "COLUMNS": "250", **runs})
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, said[-3000:]
    assert "output:-1 is out of range 0..7" in said, said[-3000:]
    status = json.loads((tmp_path / "work" / "runs" / "minus1" / "status.json").read_text())
    assert status["state"] == "failed" and "output:-1 is out of range" in status["error"]["message"]
    assert not list((tmp_path / "out").rglob("*.safetensors")), "no sample may be written"


#: the supervisor's layer-id resolution and the shard probe's stack record, on one set of params
LAYER_REFUSAL = """
def main(params, engine):
    from remote.extract import shard
    from remote.extract import runplan
    try:
        runplan.resolve(params, {"num_hidden_layers": 8}, engine=(engine, "given")).require()
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"refused": refused, "stack": shard._stack(params, {})}
"""


@pytest.mark.parametrize("engine,given,asked,says", [
    ("vllm-server", [-1], "output", "output:-1 is out of range 0..7"),
    ("vllm-server", [8], "output", "output:8 is out of range 0..7"),
    ("speculators-0.3", [0, 4], "input", "input:0 (the embeddings) has no output id"),
    ("speculators-0.3", [2, 4], "sideways", "layer_convention 'sideways' is not a layer convention"),
])
def test_the_supervisor_and_the_shard_probe_refuse_what_preflight_refuses(hostenv_python, tiny_models, tmp_path,
                                                                          engine, given, asked, says):
    got = hostcall.run_code(hostenv_python, LAYER_REFUSAL, {
        "layer_ids": given, "layer_convention": asked, "engine": engine,
        "model_path": str(tiny_models["llama"]), "dataset": "/none", "device": "cpu"}, engine)
    assert got["refused"] is not None and says in got["refused"], got
    stack = got["stack"]
    if engine == "speculators-0.3":  # the seed env resolves this engine: its stack record is the one to judge
        assert stack["status"] == "fail" and says in stack["summary"], stack
    params = base_params(Path(tiny_models["llama"]), tmp_path, engine=engine, layer_ids=given, layer_convention=asked)
    if engine == "speculators-0.3" and asked == "sideways":  # no convention at all: the table's check refuses it
        rec = host_preflight(hostenv_python, params)["params.values"]  # first (RUN_ARGS["layer_convention"])
        assert rec["status"] == "fail" and "'layer_convention' of task preflight must be one of output, input" \
            in rec["summary"], rec
    elif engine == "speculators-0.3":
        rec = host_preflight(hostenv_python, params)["layers.ids"]
        assert rec["status"] == "fail" and says in rec["summary"], rec


# -- 10. a dataset error says where: preflight first, the run too ------------------------------

#: (id, the bad third row, what both preflight and the run say about line 3)
ROW_CASES = [
    ("invalid-utf8", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8 (byte 0xe9"),
    ("out-of-vocabulary", tok(1, 99999999), "token id 99999999 (input_ids[1]) is out of vocabulary"),
    ("float-token-id", b'{"input_ids": [1, 2.7, 3]}', "input_ids[1] is the number 2.7, expected a whole number"),
    ("negative-token-id", tok(1, -4), "token id -4 (input_ids[1]) is negative"),
    ("mask-not-0-1", b'{"input_ids": [1, 2], "loss_mask": [1, 0.5]}', "loss_mask[1] is the number 0.5"),
]


@pytest.mark.parametrize("row,says", [c[1:] for c in ROW_CASES], ids=[c[0] for c in ROW_CASES])
def test_a_bad_row_fails_preflight_and_the_run_naming_file_and_line(hostenv_python, tiny_models, tmp_path, row, says):
    path = tmp_path / "d.jsonl"
    path.write_bytes(tok(1, 2) + b"\n" + tok(3, 4) + b"\n" + row + b"\n" + tok(5) + b"\n")
    got = agree(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path)))
    rec = got["preflight"]["data.records"]
    assert rec["status"] == "fail" and f"line 3: {says}" in rec["summary"], rec
    assert got["run_error"].startswith(f"sample 2, {path}:3: {says}"), got["run_error"]


def test_the_run_names_the_sample_and_line_of_an_out_of_vocabulary_id_over_ssh(make_inventory, tiny_models,
                                                                               tmp_path):
    """With preflight skipped, the supervisor refuses the row before the engine sees it (no HTTP 400)."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(tok(1, 2) + b"\n\n" + tok(3, 4) + b"\n" + tok(5, 99999999) + b"\n")
    inv = make_inventory(model_path=str(tiny_models["llama"]), dataset=str(path), engine="hf-reference",
                         max_samples=8, seq_len=32)
    runs = {"SPECOPS_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([str(SPECOPS), "extract", "--inventory", str(inv), "--run-id", "oov", "--skip-preflight",
                           "--skip-smoke"], capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                          timeout=600, env={**os.environ, "COLUMNS": "250", **runs})
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, said[-3000:]
    status = json.loads((tmp_path / "work" / "runs" / "oov" / "status.json").read_text())
    assert status["state"] == "failed", status
    assert status["error"]["message"].startswith(f"sample 2, {path}:4: token id 99999999"), status["error"]
    assert "vocab_size is 512" in status["error"]["message"]
    assert f"{path}:4" in said, said[-3000:]


def test_preflight_says_how_many_rows_it_checked_when_it_samples(hostenv_python, tiny_models, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(tok(i, i + 1) + b"\n" for i in range(1, 41)) + tok(1, 99999999) + b"\n")
    params = base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path), max_samples=100)
    whole = host_preflight(hostenv_python, params)["data.records"]
    assert whole["status"] == "fail" and "line 41" in whole["summary"] and "all 41 rows" in whole["summary"]
    part = host_preflight(hostenv_python, dict(params, data_check_bytes=200))["data.records"]
    assert part["status"] == "ok" and part["detail"]["checked"] < 41 == part["detail"]["rows"]
    assert f"the first {part['detail']['checked']} of 41 rows" in part["summary"]
    assert "the run checks the rest" in part["summary"]
    # max_samples is the rows the run sends: the bad 41st is not one of the first 40
    capped = host_preflight(hostenv_python, dict(params, max_samples=40))
    assert capped["data.records"]["status"] == "ok" and capped["data.file"]["detail"]["records"] == 40


def test_a_dataset_file_name_is_no_reason_to_refuse_and_a_hub_name_is_no_file(hostenv_python, tiny_models, tmp_path):
    """The run reads any local file of JSON lines, and never a hub dataset by name: preflight likewise."""
    path = tmp_path / "rows.txt"
    path.write_bytes(tok(1, 2) + b"\n" + tok(3) + b"\n")
    got = agree(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path)))
    assert got["run"] == 2 and got["preflight"]["data.file"]["status"] == "ok", got["preflight"]
    assert got["preflight"]["data.records"]["status"] == "ok"
    rec = host_preflight(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset="sharegpt"))
    assert rec["data.file"]["status"] == "fail" and "hub name 'sharegpt'" in rec["data.file"]["summary"]
    assert "local .jsonl" in rec["data.file"]["fix"]


def test_no_chat_template_fails_only_a_dataset_with_chat_rows(hostenv_python, tiny_models, tmp_path):
    """The run renders chat rows only: pre-tokenized rows need no template (seed engine included)."""
    model = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    path = tmp_path / "tok.jsonl"
    path.write_bytes(tok(1, 2) + b"\n" + tok(3) + b"\n")
    res = host_preflight(hostenv_python, base_params(model, tmp_path, dataset=str(path)))
    assert res["tokenizer.chat_template"]["status"] == "warn" and res["data.records"]["status"] == "ok"
    assert res.failed(ignore_areas=("drift", "patch")) == {}
    path.write_bytes(tok(1, 2) + b"\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n")
    rec = host_preflight(hostenv_python, base_params(model, tmp_path, dataset=str(path)))["data.records"]
    assert rec["status"] == "fail" and "1 chat row(s) (line 2 first)" in rec["summary"] and "no chat template" in \
        rec["summary"]


def test_a_row_longer_than_seq_len_is_truncated_or_refused_alike_by_preflight_and_the_run(hostenv_python, tiny_models,
                                                                                          tmp_path):
    """``data.lengths``: preflight measures every pre-tokenized row against ``seq_len`` and says what the run
    does with a longer one: ``long_samples: truncate`` (the default) keeps its first seq_len tokens (a warn
    naming the line), ``refuse`` fails here as the run fails before any load, naming the line and the fix."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(tok(*range(3, 13)) + b"\n" + tok(*range(3, 43)) + b"\n" + tok(5, 6) + b"\n")
    params = base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(path), seq_len=16)
    kept = agree(hostenv_python, params)
    lengths = kept["preflight"]["data.lengths"]
    assert lengths["status"] == "warn" and kept["run"] == 3, kept
    assert lengths["summary"].startswith("1 row(s) longer than seq_len 16 are truncated to 16 tokens (lines 2; "
                                         "longest row 40 tokens (line 2))"), lengths
    assert lengths["detail"]["over_lines"] == [{"line": 2, "tokens": 40}]
    refused = agree(hostenv_python, dict(params, long_samples="refuse"))
    lengths = refused["preflight"]["data.lengths"]
    assert lengths["status"] == "fail" and "long_samples: refuse" in lengths["summary"], lengths
    assert "raise seq_len to 40" in lengths["fix"] and "long_samples: truncate" in lengths["fix"]
    assert "the sample has 40 tokens, more than seq_len 16 (long_samples: refuse)" in refused["run_error"], refused
    assert ":2" in refused["run_error"] and "sample 1" in refused["run_error"], refused["run_error"]
    dropped = agree(hostenv_python, dict(params, long_samples="drop"))  # issue 40: left out, said by both
    lengths = dropped["preflight"]["data.lengths"]
    assert lengths["status"] == "warn" and "are left out (long_samples: drop; lines 2;" in lengths["summary"], lengths
    assert dropped["run"] == 2, dropped
    whole = agree(hostenv_python, dict(params, seq_len=64))["preflight"]["data.lengths"]
    assert whole["status"] == "ok" and whole["summary"].startswith("longest row 40 tokens (line 2) <= seq_len 64")
