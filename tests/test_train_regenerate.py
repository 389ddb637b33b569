"""``specops train --regenerate``, the parts that need no server (light).

What speculators 0.9.0's ``regenerate-responses`` wrote on the modern test host for the tiny
Llama's first 4 chat rows (``tests/fixtures/train/regenerate_responses.jsonl``: greedy, max_tokens
48) is turned into the rows the re-extraction reads, in dataset order whatever order the CLI's
concurrent requests finished in; the rows the target answers are the states run's own, chat rows
only; the extraction of the regenerated text takes the states run's parameters. The whole step
(the target served, the CLI against it, the extraction, training, eval) runs in the heavy test
(``tests/test_train_eval.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.train import plan as trainplan  # noqa: E402
from remote.train import regenerate

FIX = REPO / "tests" / "fixtures" / "train" / "regenerate_responses.jsonl"


def test_the_clis_rows_become_the_extractions_rows_in_dataset_order(tmp_path):
    lines = FIX.read_text().splitlines()
    (tmp_path / regenerate.RAW_OUT).write_text("\n".join(reversed(lines)) + "\n{\"torn")  # finished out of order
    (tmp_path / "responses.errors.jsonl").write_text('{"id": "row-9", "metadata": {"error": "x"}}\n')
    wanted = {"model": "/m", "dataset": "/d.jsonl", "rows": [0, 4], "max_tokens": 48,
              "sampling_params": {"temperature": 0.0}}
    record = regenerate.collect(tmp_path, wanted, [(i, []) for i in range(4)])
    source = [json.loads(line) for line in lines]
    rows = [json.loads(line) for line in (tmp_path / regenerate.ROWS).read_text().splitlines()]
    assert rows == [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
                    for r in sorted(source, key=lambda r: r["metadata"]["idx"])]
    assert record["samples"] == 4 and record["source_rows_answered"] == [0, 1, 2, 3] and record["errors"] == 1
    assert record["reply_tokens"] == 4 * 48 and record["truncated"] == 4  # every reply ran to max_tokens
    assert record["prompt_tokens"] == sum(len(r["input_ids"]) - 48 for r in source)
    assert {k: record[k] for k in wanted} == wanted
    # the prompt is the server's chat rendering of the user turn, the reply the target's greedy tokens
    assert all(r["loss_mask"] == [0] * (len(r["input_ids"]) - 48) + [1] * 48 for r in rows)

    (tmp_path / regenerate.RAW_OUT).write_text("")
    with pytest.raises(trainplan.TrainError) as caught:
        regenerate.collect(tmp_path, wanted, [(0, [])])
    assert "wrote no reply to any of the 1 row(s)" in caught.value.summary and "row-9" in caught.value.summary


def test_rows_the_target_did_not_answer_are_counted_by_cause_and_the_train_run_warns(tmp_path):
    """Round 11 on the H200: 1952 of 4096 rows came back as errors and the record said only how many. Now
    the record counts them by cause (speculators' own error lines, numbers as N) and the done train run is a
    warn naming what is not in the states."""
    from specops.result import RunStatus
    from specops.train import run_record

    lines = FIX.read_text().splitlines()
    (tmp_path / regenerate.RAW_OUT).write_text("\n".join(lines[:2]) + "\n")  # rows 0 and 1 answered
    empty = "ValueError('empty assistant generation (sample {})')"
    errors = [{"id": f"chat-{i}", "metadata": {"idx": i, "error": empty.format(i), "generations_completed": 0}}
              for i in (2, 3)] + [{"id": "chat-4", "metadata": {"idx": 4, "error": "TimeoutError()"}}]
    (tmp_path / "responses.errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors) + "{torn\n")
    wanted = {"model": "/m", "dataset": "/d.jsonl", "rows": [0, 5], "max_tokens": 48,
              "sampling_params": {"temperature": 0.0}}
    record = regenerate.collect(tmp_path, wanted, [(i, []) for i in range(5)])
    answered = {json.loads(line)["metadata"]["idx"] for line in lines[:2]}
    assert record["rows_unanswered"] == 5 - len(answered) and record["errors"] == 4
    assert record["error_kinds"] == [{"error": "ValueError('empty assistant generation (sample N)')", "count": 2},
                                     {"error": "TimeoutError()", "count": 1},
                                     {"error": "an unreadable line", "count": 1}]
    line = regenerate.unanswered_line(record)
    assert line.startswith(f"the target answered {len(answered)} of 5 row(s): {5 - len(answered)} not in the states")
    assert "2x ValueError('empty assistant generation (sample N)')" in line

    state = RunStatus(run_id="t", state="done", step=3, epoch=0, regenerated={**record, "unanswered": line})
    rec = run_record("t", state)
    assert rec.status == "warn" and f"regenerate: {line}" in rec.summary and "responses.errors.jsonl" in rec.fix
    whole = RunStatus(run_id="t", state="done", step=3, epoch=0, regenerated={"unanswered": None})
    assert run_record("t", whole).status == "ok"


def _doc(dataset, used=2) -> dict:
    return {"params": {"dataset": str(dataset)}, "dataset_samples": used}


def test_the_rows_answered_are_the_states_runs_own_chat_rows(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "someone else's reply"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}]},
        {"messages": [{"role": "user", "content": "never read"}]}]) + "\n")
    dataset, rows = regenerate.source_rows(_doc(chat))
    assert dataset == str(chat) and [i for i, _ in rows] == [0, 1]  # the third row was not the run's
    assert rows[0][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "someone else's reply"}]
    tokens = tmp_path / "ids.jsonl"
    tokens.write_text('{"input_ids": [1, 2, 3]}\n')
    with pytest.raises(trainplan.TrainError) as caught:
        regenerate.source_rows(_doc(tokens, 1))
    assert "is pre-tokenized" in caught.value.summary and "chat rows" in caught.value.fix
    no_user = tmp_path / "sys.jsonl"
    no_user.write_text('{"messages": [{"role": "system", "content": "x"}]}\n')
    with pytest.raises(trainplan.TrainError) as caught:
        regenerate.source_rows(_doc(no_user, 1))
    assert "no user turn" in caught.value.summary


def test_the_regenerated_text_is_extracted_with_the_states_runs_own_parameters():
    source = {"run_id": "llama-tp1", "model_path": "/m", "dataset": "/chat.jsonl", "seq_len": 128, "tp": 2,
              "format": "fp8", "max_samples": 4, "output_dir": "/out/llama", "env": {"A": "1"}, "layer_ids": None,
              "work_dir": "/w"}
    got = regenerate.states_params(source, {"layer_ids": [2, 4, 5, 8], "layer_convention": "input"}, work_dir="/w",
                                   run_id="d1", rows_file="/w/runs/d1/regenerate/regenerated.jsonl", samples=5)
    assert got == {"action": "start", "run_id": "d1-states", "work_dir": "/w", "model_path": "/m",
                   "dataset": "/w/runs/d1/regenerate/regenerated.jsonl", "max_samples": 5, "seq_len": 128, "tp": 2,
                   "format": "fp8", "env": {"A": "1"}, "output_dir": "/w/runs/d1-states/samples",
                   "layer_ids": [2, 4, 5, 8], "layer_convention": "input", "force": True}
    assert regenerate.settings_of({}, 128) == {"max_tokens": 128, "sampling_params": {"temperature": 0.0}}
    assert regenerate.settings_of({"regen_max_tokens": 32, "regen_temperature": 0.6}, 128) == {
        "max_tokens": 32, "sampling_params": {"temperature": 0.6}}


@pytest.mark.parametrize("args, says", [
    (["--regen-max-tokens", "8"], "add --regenerate"),
    # the words of TRAIN_ARGS (remote/wire/argspec.py), which the train task's spec says on the host too
    (["--regenerate", "--regen-max-tokens", "0"], "--regen-max-tokens '0' must be at least 1"),
    (["--regenerate", "--regen-temperature", "hot"], "--regen-temperature 'hot' must be a number"),
])
def test_bad_regenerate_flags_are_usage_errors(args, says, tmp_path):
    (tmp_path / "inv.yaml").write_text("hosts:\n  h: {address: 127.0.0.1, python: python3, model_path: /m, "
                                       "output_dir: /o}\n")
    proc = subprocess.run([str(Path(sys.executable).parent / "specops"), "train", "--inventory",
                           str(tmp_path / "inv.yaml"), "--run-id", "t1", "--from-run", "r1", *args],
                          capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert says in proc.stderr, proc.stderr
