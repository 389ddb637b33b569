"""How preflight output reads in a log (a pipe, CI: not a terminal, 80 columns) and on a
wide terminal: real records through real rich consoles, no sshd needed."""
from __future__ import annotations

import io
import json
import math
import re

from rich.console import Console
from rich.measure import Measurement

from specops.report import MIN_TABLE_TEXT, HostBlocks, host_table, host_view, print_reports, table_fits
from specops.result import HostReport, Record

ENV = "/root/.cache/specops/hostenv/b12b97d247c0c429"
SITE = f"{ENV}/lib/python3.12/site-packages"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
BOX = "┃│┏┓┗┛┡┩└┘━─"


def preflight_report(host: str = "testhost") -> HostReport:
    """The kinds of records preflight produces: short oks, long summaries with long paths,
    fixes, a drift id longer than most check names, several areas in order."""
    recs = [
        Record(name="host.python", status="ok", summary=f"python 3.12.3 at {ENV}/bin/python"),
        Record(name="host.os", status="ok", summary="Linux 6.8.0-1019-aws x86_64, glibc 2.39"),
        Record(name="host.gpus", status="fail", summary="nvidia-smi is not on PATH and device is cuda, so no GPU "
               "can be listed or checked for free memory",
               fix="install the NVIDIA driver (nvidia-smi) or set device: cpu for this host"),
        Record(name="host.kvcache", status="warn", summary="VLLM_CPU_KVCACHE_SPACE is not set; vLLM takes 4 GiB "
               "per rank by default, 8 GiB for TP=2 against 7.6 GiB of free RAM",
               fix="set VLLM_CPU_KVCACHE_SPACE (GiB, e.g. 1) in the host's env in the inventory"),
        Record(name="packages.vllm", status="ok", summary="vllm-cpu 0.16.0 (CPU build) at "
               f"{SITE}/vllm/__init__.py"),
        Record(name="packages.transformers", status="warn", summary="transformers 5.19.0: the reference stack is "
               "transformers<5", fix="pip install 'transformers<5' in the host's python"),
        Record(name="model.config", status="ok", summary="deepseek_v3 from /data/models/tiny-deepseek-v3/config.json"
               " (text_config unwrapped: no), 8 layers, hidden 256, family deepseek, llama_4_scaling absent"),
        Record(name="checkpoint.shards", status="fail",
               summary="2 of 64 shards named by /data/models/Kimi-K2.5/model.safetensors.index.json are missing: "
               "model-00017-of-00064.safetensors, model-00042-of-00064.safetensors",
               fix="download the missing shards into the model dir (huggingface-cli download resumes)"),
        Record(name="drift.scheduler-config-is-encoder-decoder", status="fail",
               summary=f"{SITE}/speculators/data_generation/vllm_hidden_states_generator.py:141 (+1 more) "
               "SchedulerConfig(...) misses required argument 'is_encoder_decoder'",
               fix="run `specops patch` (patch set speculators-0.3.0-vllm-0.16 fixes this)"),
        Record(name="drift.cuda-only-mem-get-info", status="skipped", summary=""),
        Record(name="patches.status", status="changed", summary="patch set speculators-0.3.0-vllm-0.16 applied "
               "to 4 files", detail={"diff": "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-old\n+new\n"}),
    ]
    return HostReport(host=host, task="preflight", records=recs)


def log_console(width: int = 80) -> tuple[Console, io.StringIO]:
    """A console like a pipe or a CI log: not a terminal, a fixed width."""
    buf = io.StringIO()
    return Console(file=buf, width=width, highlight=False, soft_wrap=False), buf


def tty_console(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=True, highlight=False, soft_wrap=False), buf


def lines_of(buf: io.StringIO) -> list[str]:
    return ANSI.sub("", buf.getvalue()).splitlines()


HEAD = re.compile(r"^  (ok|changed|skipped|warn|fail) +(\S+)(?: +(.*))?$")


def parse_blocks(lines: list[str]) -> tuple[list[str], list[dict]]:
    """Read blocks back: area headings, and per record its status, name, and the pieces
    of its summary and fix as printed (the inverse of what a person's eye does)."""
    areas, records = [], []
    for line in lines[1:]:
        head = HEAD.match(line)
        if head:
            status, name, first = head.groups()
            records.append({"status": status, "name": name, "summary": [first] if first else [], "fix": []})
        elif line.startswith("    ") and records:
            body = line.strip()
            rec = records[-1]
            if body.startswith("fix: ") or rec["fix"]:
                rec["fix"].append(body.removeprefix("fix: "))
            else:
                rec["summary"].append(body)
        elif line and not line.startswith(" "):
            areas.append(line)
    return areas, records


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_log_output_keeps_every_line_within_80_columns_and_each_record_short():
    report = preflight_report()
    out, buf = log_console(80)
    out.print(host_view(report, out))
    lines = lines_of(buf)
    assert max(len(line) for line in lines) <= 80
    assert not any(ch in line for line in lines[1:] for ch in BOX), "a log gets blocks, not a table"
    assert not any(line != line.rstrip() for line in lines), "no trailing blanks in a log"
    areas, records = parse_blocks(lines)
    assert [r["name"] for r in records] == [r.name.split(".", 1)[1] for r in report.records]
    # a record takes its head line, at most 4 more for summary and fix (6 for the one with
    # a 130-character path), and 3.5 lines on average: not the 30 of a squeezed table
    for rec in records:
        most = 6 if rec["name"] == "scheduler-config-is-encoder-decoder" else 4
        assert len(rec["summary"][1:]) + len(rec["fix"]) <= most, rec
    assert len(lines) - 1 - len(areas) <= 3.5 * len(report.records), "\n".join(lines)


def test_log_output_prints_each_area_once_as_a_heading():
    out, buf = log_console(80)
    out.print(HostBlocks(preflight_report()))
    areas, records = parse_blocks(lines_of(buf))
    assert areas == ["host", "packages", "model", "checkpoint", "drift", "patches"]
    assert not any("." in r["name"] for r in records), "the area is not repeated in the check names"


def test_log_output_wraps_summaries_and_fixes_whole_words_at_full_width():
    report = preflight_report()
    out, buf = log_console(80)
    out.print(HostBlocks(report))
    _, printed = parse_blocks(lines_of(buf))
    hang = len("  changed  ")
    for rec, got in zip(report.records, printed):
        # nothing lost or reordered
        assert squash(" ".join(got["summary"])) == squash(rec.summary)
        assert squash(" ".join(got["fix"])) == squash(rec.fix or "")
        # no word that fits a line is broken, and no line is cut short: at most one line
        # more than the text needs at the full width after the hanging indent
        for word in rec.summary.split():
            if len(word) <= 80 - hang:
                assert any(word in piece for piece in got["summary"]), (word, got["summary"])
        assert len(got["summary"]) <= math.ceil(len(rec.summary) / (80 - hang)) + 1, got["summary"]
        assert len(got["fix"]) <= math.ceil(len(rec.fix or "") / (80 - hang - 5)) + 1, got["fix"]


def test_a_long_path_wraps_once():
    out, buf = log_console(80)
    out.print(HostBlocks(preflight_report()))
    _, printed = parse_blocks(lines_of(buf))
    drift = next(r for r in printed if r["name"] == "scheduler-config-is-encoder-decoder")
    path = f"{SITE}/speculators/data_generation/vllm_hidden_states_generator.py:141"
    assert len(path) > 80 and drift["summary"][0] + drift["summary"][1] == path
    vllm = next(r for r in printed if r["name"] == "vllm")
    assert [p for p in vllm["summary"] if p.startswith("/")] and len(vllm["summary"]) == 3


def test_log_output_puts_the_fix_under_the_summary():
    out, buf = log_console(80)
    out.print(HostBlocks(preflight_report()))
    lines = lines_of(buf)
    gpus = next(i for i, line in enumerate(lines) if re.match(r"  fail +gpus ", line))
    assert lines[gpus + 1].startswith(" " * 11 + "can be listed")
    assert lines[gpus + 2].startswith(" " * 11 + "fix: install the NVIDIA driver")
    assert lines[gpus + 3] == " " * 16 + "this host"


def test_a_name_longer_than_its_column_starts_the_summary_on_the_next_line():
    out, buf = log_console(80)
    out.print(HostBlocks(preflight_report()))
    lines = lines_of(buf)
    i = next(i for i, line in enumerate(lines) if "scheduler-config-is-encoder-decoder" in line)
    assert lines[i].split() == ["fail", "scheduler-config-is-encoder-decoder"]
    assert lines[i + 1].startswith(" " * 11 + "/root/") and (lines[i + 1] + lines[i + 2].lstrip()).endswith(".py:141")
    python = next(line for line in lines if re.match(r"  ok +python ", line))
    assert python.index("python 3.12.3") == len("  changed  transformers  ")


def test_blocks_adapt_to_a_very_narrow_console():
    report = preflight_report()
    out, buf = log_console(40)
    out.print(HostBlocks(report))
    lines = lines_of(buf)
    assert max(len(line) for line in lines) <= 40
    _, printed = parse_blocks(lines)
    for rec, got in zip(report.records, printed):  # a folded name's tail comes first
        assert squash(" ".join(got["summary"])).endswith(squash(rec.summary))
        assert squash(" ".join(got["fix"])) == squash(rec.fix or "")


def test_a_wide_terminal_still_gets_the_table_as_before():
    report = preflight_report()
    assert table_fits(report, 200)
    out, buf = tty_console(200)
    out.print(host_view(report, out))
    before, before_buf = tty_console(200)
    before.print(host_table(report))
    assert buf.getvalue() == before_buf.getvalue(), "byte for byte the table a wide terminal printed before"
    lines = lines_of(buf)
    assert lines[0].rstrip() == "preflight on testhost"
    assert lines[1].startswith("┏") and "┃ summary" in lines[2] and "┃ fix" in lines[2]
    assert any("scheduler-config-is-encoder-decoder" in line for line in lines)


def test_a_narrow_terminal_or_columns_80_gets_blocks():
    report = preflight_report()
    assert not table_fits(report, 80)
    out, buf = tty_console(80)
    out.print(host_view(report, out))
    assert isinstance(host_view(report, out), HostBlocks)
    assert max(len(line) for line in lines_of(buf)) <= 80


def test_table_fits_matches_what_rich_measures():
    """The width model behind :func:`table_fits` (borders, padding, natural column widths)
    agrees with rich's own measurement of the table, so the switch point is the real one."""
    report = preflight_report()
    out, _ = tty_console(1000)
    natural = Measurement.get(out, out.options, host_table(report)).maximum
    assert table_fits(report, natural)
    # with summary and fix capped at MIN_TABLE_TEXT each, the table fits exactly at the threshold
    capped = report.model_copy(update={"records": [
        r.model_copy(update={"summary": r.summary[:MIN_TABLE_TEXT], "fix": (r.fix or "")[:MIN_TABLE_TEXT] or None})
        for r in report.records]})
    capped_natural = Measurement.get(out, out.options, host_table(capped)).maximum
    assert table_fits(report, capped_natural)
    assert not table_fits(report, capped_natural - 1)


def test_print_reports_in_a_pipe_keeps_diffs_and_the_recap():
    reports = [preflight_report("gpu-a"), HostReport(host="gpu-b", task="preflight", error="connection refused",
                                                     error_code=2)]
    out, buf = log_console(80)
    print_reports(reports, out=out)
    text = buf.getvalue()
    assert "preflight on gpu-a" in text and "preflight on gpu-b: connection refused" in text
    assert "--- diff of patches.status" in text and "+new" in text
    assert "RECAP" in text
    assert "gpu-a : ok=4 changed=1 warn=2 fail=3 skipped=1" in text
    assert "gpu-b : unreachable=1 (connection refused)" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_json_output_is_untouched_by_the_layout(capsys):
    reports = [preflight_report()]
    out, buf = log_console(80)
    print_reports(reports, as_json=True, out=out)
    assert buf.getvalue() == ""
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and doc["task"] == "preflight"
    assert doc["hosts"][0]["records"][2]["summary"].startswith("nvidia-smi is not on PATH")


def test_bracketed_text_in_records_is_printed_as_written_never_as_markup():
    """A summary, fix, check name or table cell holding ``[/x]`` or ``[bold]`` (a user's path, a remote
    message) is shown as written on a wide terminal (the table), in a log (blocks) and in the shard table;
    rich markup in it used to raise MarkupError or vanish."""
    from specops.runs.shardmap import GroupMap
    from specops.runs.view import shard_table

    said = "dataset /data/[/x]/rows.jsonl has [bold]5[/bold] rows, [red] kept"
    report = HostReport(host="h[/x]", task="preflight", records=[
        Record(name="data.rows[/x]", status="fail", summary=said, fix="set dataset: /data/[b]/ok.jsonl")])
    for terminal, width in ((True, 250), (False, 80)):
        out = Console(file=io.StringIO(), force_terminal=terminal, width=width, highlight=False)
        print_reports([report], out=out)
        text = " ".join(ANSI.sub("", out.file.getvalue()).split())
        for part in ("[/x]/rows.jsonl", "[bold]5[/bold] rows, [red] kept", "/data/[b]/ok.jsonl", "rows[/x]"):
            assert part in text, (terminal, part, text)
    manifest = GroupMap.model_validate({
        "run_id": "r1", "total": 4, "shards": [{"id": "s0", "hosts": ["h[/x]"], "start": 0, "stop": 4,
                                                 "run_id": "r1", "moved_from": "[bold]old[/]"}]})
    out = Console(file=io.StringIO(), force_terminal=True, width=250)
    out.print(shard_table(manifest, {}))
    text = ANSI.sub("", out.file.getvalue())
    assert "h[/x]" in text and "moved from [bold]old[/]" in text, text
