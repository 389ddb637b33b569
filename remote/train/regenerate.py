"""The target writes its own replies before a draft trains on them (``train --regenerate``; stdlib only at import).

A draft learns to predict what the target writes; a dataset's replies are someone else's text
(FACTS: on the CPU test host a draft trained on the target's own replies accepted ~23 %, one
trained on the dataset's 16 %). speculators' flow: ``regenerate-responses`` has the target
answer each conversation's user turns (its assistant turns dropped) through a vLLM chat
endpoint and writes pre-tokenized rows -- the prompt as the server's chat template renders it
(``loss_mask`` 0) and the reply's token ids (1) --, then the states of *that* text are extracted
(``prepare-data`` / ``generate-offline-data`` over its output) and trained on. specops does the same
in a train run, before the trainer starts (:mod:`remote.train.supervisor`):

1. **regenerate** (:func:`regenerate`): the chat rows the states run ``from_run`` read are written
   to ``<run>/regenerate/prompts.jsonl``; the target is served plainly (the extraction engine's
   server, loopback, :class:`remote.extract.engines.vllm_server.VllmServer`, also named by its path, which
   speculators' CLI loads the tokenizer from); ``python -m speculators regenerate-responses``
   runs against it (``--resume``: a resumed run keeps the replies already written); its rows,
   ordered by dataset row, become ``regenerated.jsonl``; ``regenerated.json`` records which
   rows, which model, the sampling settings, the counts and speculators' version.
2. **re-extract** (:func:`states_params`): an extraction run ``<run>-states`` with the states
   run's own parameters (model, layer ids and convention, seq_len, format, engine, tp, env) over
   ``regenerated.jsonl``, started through :mod:`remote.run.job` like any extraction and waited for.
3. the trainer reads that run's states; eval still checks the draft against ``from_run`` and
   sends the dataset's rows after the ones ``from_run`` read (the regenerated rows are those
   same rows), so a draft trained on the dataset's replies and one trained on the target's are
   measured on the same prompts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from remote.wire import contract, fsutil, protocol

#: speculators' CLI command and the module it lives in (checked before a run starts)
CLI_COMMAND, CLI_MODULE = "regenerate-responses", "speculators.cli.regenerate_responses"
#: the regeneration's dir in a train run dir, and what it keeps there
REGEN_DIR, PROMPTS, RAW_OUT, ROWS, RECORD = ("regenerate", "prompts.jsonl", "responses.jsonl", "regenerated.jsonl",
                                             "regenerated.json")
LOG = "regenerate.log"
#: greedy by default: what eval measures (and speculative decoding mostly serves)
DEFAULT_SAMPLING = {"temperature": 0.0}


from remote.train.plan import TrainError as RegenerateError  # noqa: E402  (a refusal of the train run)


def states_run_id(run_id: str) -> str:
    """The extraction run of a train run's regenerated text."""
    return f"{run_id}-states"


def regen_dir(run_dir) -> Path:
    return Path(run_dir) / REGEN_DIR


def source_rows(doc: dict) -> tuple[str, list[tuple[int, list]]]:
    """``(dataset, [(row index, chat turns)])``: the chat rows the states run read (its ``dataset_samples``).

    :raises RegenerateError: a pre-tokenized row (no turns to reply to), or no rows.
    """
    from remote.extract.dataset import DatasetError, chat_turns, input_rows, parse_row

    run_params = doc.get("params") or {}
    given = run_params.get("dataset") or ""
    dataset = ", ".join(map(str, given)) if isinstance(given, list) else str(given)
    used = int(doc.get("dataset_samples") or 0)
    if not dataset or used < 1:
        raise RegenerateError("train.regenerate", f"the states run records no dataset rows (dataset {dataset!r}, "
                              f"{used} rows read)", "extract from a chat dataset first")
    out = []
    for index, (path, lineno, raw) in enumerate(input_rows(given, used)):
        row = parse_row(path, lineno, raw)
        if "input_ids" in row:
            raise RegenerateError("train.regenerate", f"{path}:{lineno} is pre-tokenized (input_ids): the target "
                                  f"needs a conversation's user turns to reply to",
                                  "extract from a dataset of chat rows (messages/conversations), or train without "
                                  "--regenerate", detail={"dataset": str(path), "line": lineno})
        try:
            turns = chat_turns(row, path, lineno)
        except DatasetError as exc:
            raise RegenerateError("train.regenerate", str(exc), "fix the row, or train without --regenerate") from None
        if not any(t["role"] == "user" for t in turns):
            raise RegenerateError("train.regenerate", f"{path}:{lineno} has no user turn to reply to",
                                  "drop the row, or train without --regenerate", detail={"line": lineno})
        out.append((index, turns))
    return dataset, out


def check_cli() -> dict | None:
    """Why the installed speculators cannot regenerate (None: it can): its CLI module and aiohttp."""
    import importlib.util

    for name in (CLI_MODULE, "aiohttp", "datasets"):
        try:
            if importlib.util.find_spec(name) is None:
                return {"missing": name}
        except ImportError:
            return {"missing": name}
    return None


def settings_of(params: dict, seq_len: int) -> dict:
    """The regeneration's settings, as recorded: ``max_tokens`` (default: the states' seq_len, which the
    re-extraction truncates each row to anyway) and the sampling parameters merged into each request."""
    sampling = dict(DEFAULT_SAMPLING)
    if params.get("regen_temperature") is not None:
        sampling["temperature"] = float(params["regen_temperature"])
    return {"max_tokens": int(params.get("regen_max_tokens") or seq_len), "sampling_params": sampling}


def check(doc: dict, params: dict, seq_len: int) -> dict:
    """The ``train.regenerate`` record of the training preflight. :raises RegenerateError: it cannot run."""
    missing = check_cli()
    if missing:
        raise RegenerateError("train.regenerate", f"this python has no {missing['missing']}: speculators' "
                              f"{CLI_COMMAND} cannot run", "pip install 'speculators>=0.9' (with aiohttp, datasets)",
                              detail=missing)
    dataset, rows = source_rows(doc)
    settings = settings_of(params, seq_len)
    return protocol.record(
        "train.regenerate", protocol.OK,
        f"the target writes its own replies to the {len(rows)} row(s) run {params['from_run']} read "
        f"({dataset} rows 0..{len(rows) - 1}; max_tokens {settings['max_tokens']}, sampling "
        f"{json.dumps(settings['sampling_params'])}) with speculators' {CLI_COMMAND}; their states are extracted "
        f"as run {states_run_id(params['run_id'])} before training",
        detail={"dataset": dataset, "rows": [0, len(rows)], **settings,
                "states_run": states_run_id(params["run_id"])})


def regenerate(run_dir, *, doc: dict, model_path: str, params: dict, seq_len: int, log) -> dict:
    """The target's replies to the states run's rows (:data:`ROWS`) and their record (:data:`RECORD`).

    Done once: a record whose settings and rows match is returned as it is (a resumed train run).
    ``log`` takes the lines to show (the supervisor's own log).

    :raises RegenerateError: the server or the CLI failed, or no row came back.
    """
    out_dir = regen_dir(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset, rows = source_rows(doc)
    settings = settings_of(params, seq_len)
    wanted = {"model": model_path, "dataset": dataset, "rows": [0, len(rows)], **settings}
    done = fsutil.read_json_quietly(out_dir / RECORD)
    if done and all(done.get(k) == v for k, v in wanted.items()) and (out_dir / ROWS).is_file():
        log(f"[specops] regenerated replies already written ({done['samples']} rows): kept")
        return {**done, "kept": True}
    prompts = out_dir / PROMPTS
    fsutil.atomic_write(prompts, "".join(json.dumps({"id": f"row-{i}", "messages": turns}) + "\n"
                                         for i, turns in rows).encode())
    t0 = time.monotonic()
    from remote.extract.engines.vllm_server import SERVED_MODEL_NAME, VllmServer

    device = params.get("device") or ""
    # speculators' CLI names the model by the path it loads the tokenizer from: the server answers to both names
    server = VllmServer(model_path, tp=int(params.get("tp") or 1), layer_ids=[], work_dir=out_dir / "server",
                        max_model_len=seq_len + settings["max_tokens"],
                        params={"plain": True, "device": device, "enforce_eager": device == "cpu",
                                "trust_remote_code": params.get("trust_remote_code"),
                                "server_args": ["--served-model-name", SERVED_MODEL_NAME, model_path]},
                        python=params.get("python") or sys.executable)
    argv = [params.get("python") or sys.executable, "-m", "speculators", CLI_COMMAND,
            "--model", model_path, "--dataset", str(prompts), "--limit", str(len(rows)),
            "--max-tokens", str(settings["max_tokens"]), "--sampling-params", json.dumps(settings["sampling_params"]),
            "--concurrency", str(max(1, min(len(rows), 8))), "--outfile", str(out_dir / RAW_OUT), "--resume"]
    server.start()
    try:
        ready = server.wait_ready(float(params.get("ready_timeout_s") or 900.0))
        log(f"[specops] target served for regeneration in {ready:.0f}s; {' '.join(argv)}")
        argv[argv.index("--model"):argv.index("--model")] = ["--endpoint", f"{server.url}/v1/chat/completions"]
        with open(out_dir / LOG, "ab") as cli_log:
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=cli_log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=str(out_dir)).returncode
    finally:
        server.stop()
    tail = (out_dir / LOG).read_text(errors="replace")[-3000:]
    if code != 0:
        raise RegenerateError("train.regenerate", f"speculators {CLI_COMMAND} exited with code {code}",
                              f"read {out_dir / LOG} and the server log under {out_dir / 'server' / 'logs'}",
                              detail={"log_tail": tail})
    record = collect(out_dir, wanted, rows)
    record.update(wall_s=round(time.monotonic() - t0, 1), ready_s=round(ready, 1), command=argv,
                  speculators=_version("speculators"), unanswered=unanswered_line(record))
    fsutil.atomic_write(out_dir / RECORD, json.dumps(record, indent=1).encode())
    log(f"[specops] regenerated {record['samples']} row(s), {record['reply_tokens']} reply tokens "
        f"({record['errors']} error(s), {record['truncated']} cut at max_tokens)")
    if record["unanswered"]:
        log(f"[specops] {record['unanswered']}; read {record['errors_file']}")
    return record


def collect(out_dir: Path, wanted: dict, rows: list) -> dict:
    """The CLI's rows in dataset order (each row's generations in order) as :data:`ROWS`: ``input_ids`` and
    ``loss_mask`` only, what the extraction reads; and the record. :raises RegenerateError: no row came back."""
    found = []
    for line in (out_dir / RAW_OUT).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        meta = row.get("metadata") or {}
        gen = str(row.get("id") or "").rpartition("_gen")[2]
        found.append((int(meta.get("idx", 0)), int(gen) if gen.isdigit() else 0, row))
    found.sort(key=lambda t: t[:2])
    errors_file = out_dir / RAW_OUT.replace(".jsonl", ".errors.jsonl")  # the CLI's failed rows
    if not found:
        why = errors_file.read_text(errors="replace")[:600] if errors_file.is_file() else "no error file"
        raise RegenerateError("train.regenerate", f"the target wrote no reply to any of the {len(rows)} row(s): {why}",
                              f"read {out_dir / LOG}")
    fsutil.atomic_write(out_dir / ROWS, "".join(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]})
                                                + "\n" for _, _, r in found).encode())
    kinds = error_kinds(errors_file)
    answered = sorted({i for i, _, _ in found})
    return {**wanted, "samples": len(found), "source_rows_answered": answered,
            "rows_unanswered": len(rows) - len(answered), "error_kinds": kinds, "errors_file": str(errors_file),
            "reply_tokens": sum(sum(r["loss_mask"]) for _, _, r in found),
            "prompt_tokens": sum(len(r["loss_mask"]) - sum(r["loss_mask"]) for _, _, r in found),
            "truncated": sum((r.get("metadata") or {}).get("finish_reason") == "length" for _, _, r in found),
            "errors": sum(kind["count"] for kind in kinds), "file": str(out_dir / ROWS)}


def error_kinds(errors_file: Path, top: int = 3) -> list[dict]:
    """The CLI's failed rows by what failed (its ``repr`` of the exception, numbers as N), commonest first:
    round 11 on the H200 lost 1952 of 4096 rows and said only how many."""
    import collections
    import re

    counts: collections.Counter = collections.Counter()
    if errors_file.is_file():
        for line in errors_file.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                error = str((row.get("metadata") or {}).get("error") or row.get("error") or "no error given")
            except (ValueError, AttributeError):
                error = "an unreadable line"
            counts[re.sub(r"\d+", "N", error)[:160]] += 1
    kinds = [{"error": error, "count": n} for error, n in counts.most_common(top)]
    rest = sum(counts.values()) - sum(kind["count"] for kind in kinds)
    return kinds + ([{"error": "other", "count": rest}] if rest else [])


def unanswered_line(record: dict) -> str | None:
    """What a regeneration lost, in one line (None: every row answered)."""
    missing = int(record.get("rows_unanswered") or 0)
    if not missing:
        return None
    kinds = record.get("error_kinds") or []
    said = "; ".join(f"{kind['count']}x {kind['error']}" for kind in kinds) or "no error recorded"
    total = missing + len(record.get("source_rows_answered") or [])
    return f"the target answered {total - missing} of {total} row(s): {missing} not in the states ({said})"


def states_params(states_doc_params: dict, manifest: dict, *, work_dir: str, run_id: str, rows_file: str,
                  samples: int) -> dict:
    """The extraction run of the regenerated text: the states run's own parameters (as its ``params.json``
    recorded them) over ``rows_file``, its ids and convention as its manifest says, its own output dir."""
    keep = {k: v for k, v in states_doc_params.items() if k not in ("run_id", "sample_range", "output_dir",
                                                                    "dataset", "max_samples")}
    return {**keep, "action": "start", "run_id": states_run_id(run_id), "work_dir": work_dir,
            "dataset": rows_file, "max_samples": samples,
            "output_dir": str(Path(work_dir) / "runs" / states_run_id(run_id) / "samples"),
            "layer_ids": list(manifest["layer_ids"]), "layer_convention": manifest["layer_convention"],
            "force": True}  # beside the train run that waits for it


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def wait_run(params: dict, poll_s: float = 2.0, on_status=None) -> dict:
    """The final status of run ``params["run_id"]`` (:func:`remote.run.job.current_status`), polled."""
    from remote.run import job

    run_dir = job.run_dir_of(params)
    while True:
        st = job.current_status(run_dir) or {}
        if on_status:
            on_status(st)
        if st.get("state") in contract.FINAL_STATES:
            return st
        time.sleep(poll_s)
