"""``specops eval``, host side: a draft's acceptance, served by vLLM with its target (stdlib only at import).

A task module (``main(params) -> payload``), run in the foreground like ``verify``. Steps:

1. **The draft's config against the states, before anything loads.** The draft is a train
   run's id (its last epoch checkpoint; the states run is the one it trained from) or a
   checkpoint dir (``from_run`` names the states). Its ``eagle_aux_hidden_state_layer_ids``
   must be the ids the states' trainer takes (:attr:`remote.train.plan.TrainPlan.trainer_layer_ids`:
   the extraction's minus the final state), its verifier the states' model, its vocab the
   model's: each mismatch is a fail showing both values and the fix (a draft whose ids
   miss by one serves at chance with no warning: vLLM issue 50170).
2. **Held-out prompts.** The rows of the states' dataset after the ones the extraction
   read (``dataset_samples``: never a training row), through the same reader
   (:mod:`remote.extract.dataset`); a chat row's prompt is its tokens up to the first assistant
   token. The slice is recorded. Or ``prompts`` names a prompt file on the host (MT-Bench, SPEED-Bench,
   speculator_benchmarks, chat rows: :mod:`remote.train.prompts`), its prompts grouped by category.
3. **Serving.** vLLM's OpenAI server as the extraction engine starts it
   (:class:`remote.extract.engines.vllm_server.VllmServer`: loopback, its own process group, logs
   under ``<work_dir>/evals/<name>/logs``), without extraction and with
   ``--speculative-config {"method": METHOD, "model": DRAFT, "num_speculative_tokens": k}``, METHOD the one
   this vLLM serves the draft's algorithm with (its config's ``speculators_model_type``, read from vLLM's
   own converters before the load: :func:`draft_algorithm`; one it cannot serve is refused there, naming
   the first release that can); completions of ``max_tokens`` each, for each cell of the sweep (every
   ``temperature`` x every ``concurrency``: 0 and 1 unless asked), one category after another; with
   per-request metrics where this vLLM has them (:mod:`remote.train.specmetrics`).
4. **Acceptance from the server's own /metrics**: ``vllm:spec_decode_num_drafts``,
   ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._per_pos``: mean acceptance
   length (1 + accepted / drafts), the rate per position, output tokens/s; with ``baseline``
   the same prompts on the plain server too (a second start), the speed-up per cell.
5. **The gate** (``min_acceptance_length``, :mod:`remote.train.gate`): each category at its worst cell
   against its bar, ``eval.gate`` naming those below. The payload carries what the laptop's history
   keeps (:mod:`specops.evals`): the draft's sha256, the target, vLLM's version and runner, the prompts' hash.

Parameters: :data:`SPEC`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from remote.extract import samples
from remote.run import slurm
from remote.system import modelconfig
from remote.train import gate
from remote.train.sweep import acceptance, cell_results, gate_lengths, pooled_categories, read_metrics, sweep_record
from remote.train import plan as trainplan
from remote.wire import contract, fsutil, layers, protocol
from remote.wire.argspec import EVAL_ARGS, RUN_ARGS, Arg, Spec
from remote.wire.contract import RunState

DEFAULT_K = 3
SPEC = Spec("draft_eval", {
    "work_dir": RUN_ARGS["work_dir"].but(required=True),
    "draft": Arg("path", required=True, doc="a train run id on this host, or a draft checkpoint dir (~ expanded)"),
    "from_run": Arg("str", doc="the states run the draft is checked against (default: the one it trained on)"),
    "k": Arg("int", min=1, max=16, doc="num_speculative_tokens (default: the draft config's, else 3)"),
    **EVAL_ARGS,
    "baseline": Arg("bool", False, doc="also serve the prompts without the draft (a second server start)"),
    "force": Arg("bool", False, doc="serve a draft whose config does not fit the states anyway (each misfit a warn): "
                                    "to measure what the mismatch costs"),
    "name": Arg("str", doc="the eval's dir under <work_dir>/evals (default: draft and time)"),
    "algorithm": RUN_ARGS["algorithm"].but(doc="the draft's algorithm: its config's speculators_model_type, which a "
                                                "given one must be (unset: the config's)"),
    "python": RUN_ARGS["python"], "device": RUN_ARGS["device"], "env": RUN_ARGS["env"], "tp": RUN_ARGS["tp"],
    "trust_remote_code": RUN_ARGS["trust_remote_code"],
    "ready_timeout_s": RUN_ARGS["ready_timeout_s"].but(default=900.0),
})


class EvalError(protocol.TaskError):
    """A refusal of eval (see protocol.TaskError)."""


@SPEC.task
def main(params: dict) -> dict:
    try:
        payload = protocol.run_in_job_env(evaluate, params)
    except Stopped as exc:  # nobody may read this (the laptop left): the server is stopped all the same
        return protocol.payload([protocol.record("eval.server", protocol.FAIL, f"stopped by request ({exc}: Ctrl-C "
                                                 f"at the laptop) while serving; the server it started is stopped",
                                                 fix="run the same eval again")])
    node = slurm.node_record("eval.node", "eval")  # a host behind Slurm serves and measures on a compute node (srun)
    if node is not None:
        payload["records"].insert(0, node)
    return payload


# --------------------------------------------------------------------------- the draft

def locate_draft(params: dict) -> tuple[Path, str, str]:
    """``(checkpoint dir, states run id, what it is)`` for ``params["draft"]``.

    :raises EvalError: an unfinished train run, a dir without config.json, no states run.
    """
    work_dir = Path(params["work_dir"])
    draft = str(params["draft"])
    run_dir = work_dir / "runs" / draft
    if contract.run_id_problem(draft) is None and (run_dir / contract.STATUS_FILE).is_file():
        status = samples.read_json_quietly(run_dir / contract.STATUS_FILE) or {}
        run_params = samples.read_json_quietly(run_dir / contract.PARAMS_FILE) or {}
        if status.get("kind") != "train":
            raise EvalError("eval.draft", f"run {draft} is not a train run", "pass a train run id or a draft dir")
        if status.get("state") != RunState.DONE:
            raise EvalError("eval.draft", f"train run {draft} is {status.get('state')!r}, not done",
                            f"wait for it or resume it (specops train --run-id {draft} ...)")
        last = trainplan.last_checkpoint(trainplan.checkpoints_dir(run_dir))
        if last is None:
            raise EvalError("eval.draft", f"train run {draft} has no checkpoint in {trainplan.checkpoints_dir(run_dir)}",
                            "train it again")
        epoch = "untrained (--dry-run)" if last["epoch"] is None else f"epoch {last['epoch']}"
        return Path(last["path"]), params.get("from_run") or run_params.get("from_run"), f"train run {draft}, {epoch}"
    path = Path(draft)
    if not (path / "config.json").is_file():
        raise EvalError("eval.draft", f"{draft} is neither a train run on this host nor a dir with config.json",
                        "pass a train run id (specops train --run-id) or a draft checkpoint dir")
    if not params.get("from_run"):
        raise EvalError("eval.params", f"draft {draft} is a dir: which states it belongs to is not known",
                        "pass --from-run with the extraction run the draft was trained on")
    return path, params["from_run"], f"dir {path}"


def read_draft(path: Path) -> dict:
    """The draft dir's config (a JSON object), once it is known to hold weights: both before anything loads.

    :raises EvalError: naming the file that cannot be read, is no object, or the weights that are not there.
    """
    config = path / "config.json"
    try:
        draft = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise EvalError("eval.draft", f"{config} cannot be read ({exc})", "pass a draft checkpoint dir") from None
    if not isinstance(draft, dict):
        raise EvalError("eval.draft", f"{config} holds a JSON {type(draft).__name__}, not the object of a draft's "
                        f"config", "pass a draft checkpoint dir as specops train (speculators) wrote it",
                        detail={"file": str(config)})
    if not any(path.glob("*.safetensors")):
        found = sorted(p.name for p in path.iterdir())[:10]
        raise EvalError("eval.draft", f"{path} holds no draft weights (*.safetensors), only "
                        f"{', '.join(found) or 'nothing'}: vLLM would load the target and then fail",
                        "pass the checkpoint dir with the weights (a train run id picks its last whole epoch), "
                        "or fetch them again (specops fetch --tensors)", detail={"dir": str(path), "files": found})
    return draft


def ids_field(plan: trainplan.TrainPlan) -> str | None:
    """The draft config's field naming the aux ids for the plan's algorithm (None: mtp's names none)."""
    return (layers.ALGORITHMS.get(plan.algorithm) or layers.ALGORITHMS[layers.DEFAULT_ALGORITHM]).config_ids


def check_config(draft: dict, plan: trainplan.TrainPlan, target: dict, where: str) -> list[dict]:
    """The draft config's records against the states' plan and the target's config (fails carry both values)."""
    records = []
    field_name = ids_field(plan)
    ids = draft.get(field_name) if field_name else plan.trainer_layer_ids  # mtp's draft names no aux ids
    want = plan.trainer_layer_ids
    if ids != want:
        shift = {b - a for a, b in zip(want, ids or [])} if isinstance(ids, list) and len(ids) == len(want) else set()
        why = (f" (every id {next(iter(shift)):+d}: ids in another convention, e.g. SpecForge/SGLang's output:k)"
               if len(shift) == 1 and 0 not in shift else "")
        records.append(protocol.record(
            "eval.draft_layer_ids", protocol.FAIL,
            f"the draft's {field_name} {ids} are not {want}, the aux ids of run "
            f"{plan.from_run}'s states (input convention; extraction ids {plan.layer_ids} minus the final state "
            f"{plan.num_layers}){why}",
            fix=f"train the draft on these states (specops train --from-run {plan.from_run}), or, if it was trained "
                f"on them under other ids, set {field_name} to {want} in {where}/config.json",
            detail={"draft": ids, "states": want, "extraction_ids": plan.layer_ids}))
    else:
        records.append(protocol.record("eval.draft_layer_ids", protocol.OK,
                                       f"the draft's aux layer ids {ids} are run {plan.from_run}'s"))
    verifier = ((draft.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    same = verifier and os.path.realpath(str(verifier)) == os.path.realpath(plan.model_path)
    records.append(protocol.record(
        "eval.draft_target", protocol.OK if same else protocol.FAIL,
        f"the draft's verifier is {verifier}" + ("" if same else f", not the states' model {plan.model_path}"),
        fix=None if same else f"evaluate a draft trained for {plan.model_path}, or the states of {verifier}",
        detail={"draft": verifier, "states": plan.model_path}))
    vocab = (draft.get("transformer_layer_config") or {}).get("vocab_size")
    model_vocab = modelconfig.text_value(target, "vocab_size")
    records.append(protocol.record(
        "eval.draft_vocab", protocol.OK if vocab == model_vocab else protocol.FAIL,
        f"the draft's vocab_size {vocab}" + (" is the target's" if vocab == model_vocab
                                            else f" is not the target's {model_vocab}"),
        fix=None if vocab == model_vocab else "train the draft against this target (its vocab comes from it)",
        detail={"draft": vocab, "target": model_vocab, "draft_vocab_size": draft.get("draft_vocab_size")}))
    return records


def _tensor_shapes(path: Path) -> dict:
    """``{name: shape}`` of every tensor in the dir's ``*.safetensors``, from their headers: nothing is loaded."""
    from remote.system.weights import ShardError, read_header

    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            shapes.update({k: v.get("shape") for k, v in read_header(str(file))["tensors"].items()})
        except (OSError, ShardError):
            continue  # an unreadable file: vLLM's load names it
    return shapes


def vocab_maps_record(draft: dict, path: Path, target: dict) -> dict | None:
    """``eval.draft_vocab_maps``, for a draft with a reduced vocabulary (``draft_vocab_size`` below the
    target's): vLLM maps its tokens back through ``d2t`` (one offset per draft token); missing or of another
    length it fails the load after the target is up. The trainer's ``t2d`` (one flag per target token) is
    skipped by vLLM's loader, judged only when present. None for a full-vocabulary draft."""
    size, model_vocab = draft.get("draft_vocab_size"), modelconfig.text_value(target, "vocab_size")
    if type(size) is not int or type(model_vocab) is not int or size >= model_vocab:
        return None
    shapes = _tensor_shapes(path)
    d2t = next((v for k, v in shapes.items() if k.split(".")[-1] == "d2t"), None)
    t2d = next((v for k, v in shapes.items() if k.split(".")[-1] == "t2d"), None)
    # vLLM maps draft tokens through d2t and skips t2d (the trainer's own mask): t2d is judged only when there
    problems = [f"{name} {'is missing' if got is None else f'has shape {got}, expected [{want}]'}"
                for name, got, want in (("d2t", d2t, size), ("t2d", t2d, model_vocab))
                if got != [want] and (got is not None or name == "d2t")]
    detail = {"draft_vocab_size": size, "target_vocab": model_vocab, "d2t": d2t, "t2d": t2d}
    if problems:
        return protocol.record("eval.draft_vocab_maps", protocol.FAIL,
                               f"the draft's reduced vocabulary ({size} of {model_vocab}): {', '.join(problems)} in "
                               f"{path}/*.safetensors", detail=detail,
                               fix="evaluate the checkpoint as speculators' trainer saved it (it writes d2t/t2d "
                                   "with --draft-vocab-size), or retrain with --draft-vocab-size")
    return protocol.record("eval.draft_vocab_maps", protocol.OK,
                           f"the draft's reduced vocabulary: d2t [{size}] and t2d [{model_vocab}]", detail=detail)


# --------------------------------------------------------------------------- prompts and metrics

def held_out_prompts(params: dict, plan: trainplan.TrainPlan, doc: dict, target: dict) -> tuple[list, list]:
    """``(prompts, [first row, stop row))``: the dataset rows after those the extraction read.

    :raises EvalError: when the dataset has none left.
    """
    from remote.extract.dataset import load_token_samples

    run_params = doc.get("params") or {}
    used = int(doc.get("dataset_samples") or 0)
    want = int(params["prompts"])
    rows = load_token_samples({**run_params, "max_samples": used + want, "seq_len": plan.sample_tokens},
                              plan.model_path, vocab_size=modelconfig.text_value(target, "vocab_size"))
    held = rows[used:]
    if not held:
        raise EvalError("eval.prompts", f"dataset {run_params.get('dataset')} has {len(rows)} rows and run "
                        f"{plan.from_run} read all of them: no held-out row to send",
                        "extract with --max-samples below the dataset's rows, so eval has rows the draft never saw")
    prompts = []
    for ids, mask in held:
        cut = mask.index(1) if 1 in mask and mask.index(1) > 0 and 0 in mask else max(1, len(ids) // 2)
        prompts.append(list(ids[:cut]))
    return prompts, [used, used + len(held)]


def send_one(server, prompt: dict, *, max_tokens: int, temperature: float) -> dict:
    """One prompt through the server: token ids to /v1/completions, chat messages or user turns to
    /v1/chat/completions (turns one after another, each after the target's own reply to the one before, as
    MT-Bench does). ``{"tokens", "text", "spec"}``: ``spec`` the per-request metrics of each reply
    (:func:`remote.train.specmetrics.of_response`; None where the server gives none)."""
    from remote.extract.engines.vllm_server import SERVED_MODEL_NAME
    from remote.train import specmetrics

    sampling = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
    if "ids" in prompt:
        replies = [server.post_json("/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": prompt["ids"],
                                                        **sampling})]
        texts = [(replies[0].get("choices") or [{}])[0].get("text")]
    else:
        messages, replies, texts = list(prompt.get("messages") or []), [], []
        for turn in prompt.get("turns") or [None]:
            if turn is not None:
                messages.append({"role": "user", "content": turn})
            reply = server.post_json("/v1/chat/completions", {"model": SERVED_MODEL_NAME, "messages": messages,
                                                              **sampling})
            text = ((reply.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            messages.append({"role": "assistant", "content": text})
            replies.append(reply)
            texts.append(text)
    return {"tokens": sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in replies),
            "text": texts[0] if len(texts) == 1 else texts, "spec": [specmetrics.of_response(r) for r in replies]}


#: the chat template's tokens around one message, at most (a bound: a text's length is known only in bytes here)
TEMPLATE_TOKENS = 64


def prompt_tokens_bound(prompt: dict) -> int:
    """At most how many tokens ``prompt`` takes: its ids, or a text's UTF-8 bytes (no tokenizer makes more
    tokens than bytes) plus :data:`TEMPLATE_TOKENS` a message."""
    if "ids" in prompt:
        return len(prompt["ids"])
    texts = list(prompt.get("turns") or []) + [m["content"] for m in prompt.get("messages") or []]
    return sum(len(t.encode("utf-8")) + TEMPLATE_TOKENS for t in texts)


def by_category(prompts: list) -> dict:
    """``{category: [prompt, ...]}`` in the order the categories first appear."""
    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt["category"], []).append(prompt)
    return groups


def serve(params: dict, plan: trainplan.TrainPlan, prompts: list, eval_dir: Path, spec: dict | None,
          per_request: bool = False) -> dict:
    """Start the server (with ``spec`` as its speculative config, or plain), send ``prompts``, read
    /metrics around them, stop it. :raises ServerFailed: naming the server's own exception.

    The prompts are sent once per cell of the sweep (each ``temperature`` x each ``concurrency``), one
    category after another, /metrics read around each category (``cells[i]["categories"][c]``: ``before``,
    ``after``, seconds, tokens), ``concurrency`` requests in flight at once within a category."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from remote.extract.engines.vllm_server import VllmServer

    device = params.get("device") or ""
    turns = max(len(p.get("turns") or [None]) for p in prompts)
    max_len = max(map(prompt_tokens_bound, prompts)) + turns * params["max_tokens"] + 2 * (
        (spec or {}).get("num_speculative_tokens") or 0) + 16
    model_max = modelconfig.text_value(modelconfig.read(plan.model_path), "max_position_embeddings")
    if isinstance(model_max, int) and not any("ids" in p for p in prompts):
        max_len = min(max_len, model_max)  # a text's bound is loose; the model's own length is the real cap
    server_args = ["--speculative-config", json.dumps(spec)] if spec else []
    step = server_step(params, spec, max_len, plan.algorithm)
    if spec and per_request:
        from remote.train import specmetrics

        server_args += [specmetrics.FLAG, "summary"]
    server = VllmServer(plan.model_path, tp=int(params.get("tp") or 1), layer_ids=[],
                        work_dir=eval_dir / ("spec" if spec else "plain"), max_model_len=max_len,
                        params={"plain": True, "device": device, "enforce_eager": device == "cpu",
                                "trust_remote_code": params.get("trust_remote_code"), "server_args": server_args,
                                "max_num_seqs": step["max_num_seqs"],
                                "max_num_batched_tokens": step["max_num_batched_tokens"]},
                        python=params.get("python") or sys.executable)

    def metrics() -> dict:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
            return read_metrics(resp.read().decode("utf-8", "replace"))

    groups = by_category(prompts)
    cells = []
    server.start()
    try:
        ready = server.wait_ready(params["ready_timeout_s"])
        for temperature in params.get("temperature") or [0.0]:
            for concurrency in params.get("concurrency") or [1]:
                cell = {"temperature": temperature, "concurrency": concurrency, "categories": {}}
                for category, items in groups.items():
                    before, t0 = metrics(), time.monotonic()
                    pool = ThreadPoolExecutor(max_workers=int(concurrency))
                    try:
                        sent = list(pool.map(lambda p, t=temperature: send_one(
                            server, p, max_tokens=params["max_tokens"], temperature=float(t)), items))
                    finally:  # a Stopped (Ctrl-C) must not wait for requests in flight: the server's stop ends them
                        pool.shutdown(wait=False, cancel_futures=True)
                    seconds = time.monotonic() - t0
                    cell["categories"][category] = {
                        "before": before, "after": metrics(), "seconds": round(seconds, 3),
                        "output_tokens": sum(x["tokens"] for x in sent), "outputs": [x["text"] for x in sent],
                        "spec": [m for x in sent for m in x["spec"]]}
                cell["seconds"] = round(sum(c["seconds"] for c in cell["categories"].values()), 3)
                cell["output_tokens"] = sum(c["output_tokens"] for c in cell["categories"].values())
                cell["tokens_per_s"] = round(cell["output_tokens"] / cell["seconds"], 1) if cell["seconds"] else None
                cells.append(cell)
    finally:
        server.stop()
    first, last = cells[0], cells[-1]
    return {"ready_s": round(ready, 1), "seconds": first["seconds"], "output_tokens": first["output_tokens"],
            "tokens_per_s": first["tokens_per_s"], "before": next(iter(first["categories"].values()))["before"],
            "after": list(last["categories"].values())[-1]["after"], "log": str(server.log_path),
            "outputs": [o for c in first["categories"].values() for o in c["outputs"]], "cells": cells,
            "step": step}


#: the drafts vLLM drafts in parallel: its speculative methods dflash and dspark, and P-EAGLE (served as eagle3). A
#: request in a step takes extra slots for the masked draft positions, and vLLM refuses a step budget they leave no
#: room in (``VllmConfig._set_max_num_scheduled_tokens``). How many, by release (``max_num_new_slots_for_drafting``):
#: k - 1 for dflash and dspark in 0.25-0.27; k for dflash, k - 1 for dspark and P-EAGLE in 0.28-0.33; none in 0.34
#: (a separate query pass). The eval sizes its step for k, which holds on each.
PARALLEL_METHODS = ("dflash", "dspark")
PARALLEL_ALGORITHMS = ("peagle",)


def draft_slots(spec: dict | None, algorithm: str | None = None) -> int:
    """The most extra slots one request takes in a step when vLLM drafts with ``spec`` (0 for serial drafts)."""
    if not spec or (spec.get("method") not in PARALLEL_METHODS and algorithm not in PARALLEL_ALGORITHMS):
        return 0
    return int(spec.get("num_speculative_tokens") or 1)


def server_step(params: dict, spec: dict | None, max_len: int, algorithm: str | None = None) -> dict:
    """The eval server's ``--max-num-seqs`` and ``--max-num-batched-tokens``. Sequences: the sweep's largest
    concurrency (the requests eval keeps in flight; vLLM's default, 1024 on an 80 GB GPU, made a dspark draft
    with k=8 leave 2048 - 1024 x 7 = -5120 tokens a step and vLLM 0.26 refused to start: GPU round 20). Budget:
    the engine's own (:func:`~remote.extract.engines.vllm_server.command.batched_tokens`), raised where the draft
    slots of every sequence (:func:`draft_slots`) would leave less than one whole prompt a step. ``room``: what
    is left for the prompts."""
    from remote.extract.engines.vllm_server import command

    seqs = max(int(c) for c in (params.get("concurrency") or [1]))
    budget = command.batched_tokens({"device": params.get("device") or ""}, max_len)
    slots = draft_slots(spec, algorithm) * seqs
    budget = max(budget, slots + max_len)
    return {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "draft_slots": slots, "room": budget - slots}


class Stopped(BaseException):
    """SIGTERM from the laptop's Ctrl-C (specops.draft_eval.stop_eval): unwinds through ``serve``'s ``finally``,
    which stops the server."""


@contextlib.contextmanager
def stoppable(eval_dir: Path):
    """While serving: this task's pid in ``eval_dir`` (:data:`remote.wire.contract.EVAL_PID_FILE`) and SIGTERM raising
    :class:`Stopped`, so a Ctrl-C at the laptop stops the server this task started, not just the task."""
    import signal

    def on_term(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    eval_dir.mkdir(parents=True, exist_ok=True)
    pid_file = eval_dir / contract.EVAL_PID_FILE
    pid_file.write_text(str(os.getpid()))
    before = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        pid_file.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the task

def evaluate(params: dict) -> dict:
    from remote.wire import manifest as run_manifest

    path, from_run, what = locate_draft(params)
    draft = read_draft(path)
    algorithm, served_by = draft_algorithm(draft, params, str(path))
    try:
        plan = trainplan.resolve({"work_dir": params["work_dir"], "run_id": "eval", "from_run": from_run,
                                  "algorithm": algorithm})
    except trainplan.TrainError as exc:
        raise EvalError(exc.name.replace("train.", "eval."), exc.summary, exc.fix, exc.detail) from None
    target = modelconfig.read(plan.model_path)
    records = [served_by, *check_config(draft, plan, target, str(path)), draft_loadable_record(draft, str(path))]
    maps = vocab_maps_record(draft, path, target)
    if maps is not None:
        records.append(maps)
    if any(r["status"] == protocol.FAIL for r in records):
        if not params.get("force"):
            return protocol.payload(records, draft=str(path), from_run=from_run)
        # --force: served as it is, each misfit kept as a warn beside the acceptance it costs
        records = [dict(r, status=protocol.WARN, summary=f"forced: {r['summary']}") if r["status"] == protocol.FAIL
                   else r for r in records]
    doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
    k = int(params.get("k") or _draft_k(draft) or DEFAULT_K)
    try:
        gate.check_thresholds(params.get("min_acceptance_length"))
    except ValueError as exc:
        raise EvalError("eval.params", str(exc), "pass --min-acceptance-length X or CATEGORY=X with X >= 1") from None
    engine = engine_facts(params)
    prompts, prompt_set = eval_prompts(params, plan, doc, target, from_run)
    records.append(prompt_set.pop("record"))
    name = params.get("name") or f"{Path(str(params['draft'])).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    eval_dir = Path(params["work_dir"]) / "evals" / name
    method = served_by["detail"]["method"]
    spec = {"method": method, "model": str(path), "num_speculative_tokens": k}
    try:
        with stoppable(eval_dir):
            served = serve(params, plan, prompts, eval_dir, spec, per_request=engine["per_request"]["available"])
    except Exception as exc:  # the server's own exception, as its log names it (ServerFailed)
        raise EvalError("eval.server", f"vLLM with the draft as {method} failed: {exc}",
                        f"read the server log under {eval_dir}/spec/logs; a draft that does not load names "
                        f"its config or weights there") from None
    records.append(aux_ids_used_record(served["log"], plan, params))
    if not served["after"]["found"]:
        records.append(protocol.record("eval.acceptance", protocol.FAIL,
                                       "the server's /metrics has no vllm:spec_decode_* counters",
                                       fix=f"check that this vLLM serves {method} drafts (its log: {served['log']})"))
        return protocol.payload(records, draft=str(path), served=served)
    acc = acceptance(served["before"], served["after"], k)
    if not acc["draft_tokens"]:  # no number to report: exit 0 would claim a measurement that never happened
        records.append(protocol.record("eval.acceptance", protocol.FAIL,
                                       f"the server drafted no token for {len(prompts)} prompt(s): no acceptance "
                                       f"was measured", detail={"draft": str(path), **acc},
                                       fix=f"read the server log ({served['log']}): the draft was not used"))
        return protocol.payload(records, draft=str(path), served=served)
    rows = prompt_set.get("rows")
    cells = cell_results(served["cells"], k)
    result = {"draft": str(path), "what": what, "from_run": from_run, "k": k, "rows": rows, **acc,
              "tokens_per_s": served["tokens_per_s"], "output_tokens": served["output_tokens"],
              "ready_s": served["ready_s"], "eval_dir": str(eval_dir), "server_step": served["step"],
              "draft_sha256": draft_digest(path), "target": plan.model_path, "engine": engine,
              "temperature": params["temperature"], "concurrency": params["concurrency"],
              "max_tokens": params["max_tokens"], "prompt_set": prompt_set, "cells": cells,
              "categories": pooled_categories(served["cells"], k)}
    rate = acc["acceptance_rate"] or 0.0
    chance = rate <= 1.0 / max(2, int(modelconfig.text_value(target, "vocab_size") or 2))
    summary = (f"{what}, k={k}: mean acceptance length {acc['mean_acceptance_length']}, {acc['accepted']} of "
               f"{acc['draft_tokens']} draft tokens accepted ({rate:.1%}); per position "
               f"{', '.join(f'{x:.1%}' for x in acc['per_position'] if x is not None)}; "
               f"{served['tokens_per_s']} output tok/s")
    records.append(protocol.record(
        "eval.acceptance", protocol.WARN if chance else protocol.OK,
        summary + ("; at chance: check the draft's aux layer ids and convention, that it trained on this target's "
                   "states (and on replies the target writes), its epochs and loss" if chance else ""),
        detail=result))
    if len(cells) > 1 or len(result["categories"]) > 1:
        records.append(sweep_record(cells))
    if params["baseline"]:
        with stoppable(eval_dir):
            plain = serve(params, plan, prompts, eval_dir, None)
        result["baseline_tokens_per_s"] = plain["tokens_per_s"]
        speedup = served["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
        for cell, plain_cell in zip(cells, plain["cells"]):
            cell["baseline_tokens_per_s"] = plain_cell["tokens_per_s"]
            cell["speedup"] = (round(cell["tokens_per_s"] / plain_cell["tokens_per_s"], 3)
                               if cell["tokens_per_s"] and plain_cell["tokens_per_s"] else None)
        records.append(protocol.record("eval.baseline", protocol.OK,
                                       f"plain server {plain['tokens_per_s']} output tok/s on the same prompts; with "
                                       f"the draft {served['tokens_per_s']} ({speedup:.2f}x)" +
                                       ("; per cell " + ", ".join(f"t={c['temperature']} c={c['concurrency']}: "
                                                                  f"{c['speedup']}x" for c in cells)
                                        if len(cells) > 1 else "") if speedup else
                                       "plain server gave no tokens", detail={"plain": plain["tokens_per_s"],
                                                                              "speedup": speedup}))
    verdict = gate.judge(gate_lengths(cells), params.get("min_acceptance_length") or {})
    if verdict is not None:
        records.append(verdict)
    return protocol.payload(records, **result)


def draft_algorithm(draft: dict, params: dict, where: str, vllm_root=None) -> tuple[str, dict]:
    """``(algorithm, eval.algorithm record)``: the draft config's ``speculators_model_type`` (a given ``--algorithm``
    must be it), served by this host's vLLM (read from its source, :mod:`remote.drift.algorithms`) with the config
    keys its converter requires; the record's ``detail["method"]`` is the ``--speculative-config`` method.

    :raises EvalError: before anything loads, naming what differs and the fix.
    """
    from remote.drift import algorithms
    from remote.drift.source import site_packages

    own = draft.get("speculators_model_type")
    given = params.get("algorithm")
    if given and own and given != own:
        raise EvalError("eval.algorithm", f"--algorithm {given}, but the draft in {where} is a {own} draft "
                        f"(its config's speculators_model_type)", f"pass --algorithm {own} (or leave it out), or "
                        f"evaluate a {given} draft (specops train --algorithm {given})",
                        detail={"given": given, "draft": own})
    algorithm = own or given or layers.DEFAULT_ALGORITHM
    rec = algorithms.servable_record(algorithm, vllm_root or site_packages({})[1], name="eval.algorithm",
                                     architectures=draft.get("architectures"))
    if rec["status"] == protocol.FAIL:
        raise EvalError("eval.algorithm", rec["summary"], rec["fix"], detail=rec["detail"])
    missing = [key for key in rec["detail"].get("requires") or () if draft.get(key) is None]
    if missing:
        raise EvalError("eval.algorithm", f"the {algorithm} draft in {where} has no {', '.join(missing)}: this vLLM's "
                        f"{algorithm} converter reads it (vllm/{rec['detail']['source']}) and the load would fail",
                        f"train the draft again with this speculators (its trainer writes them), or add "
                        f"{', '.join(missing)} to {where}/config.json", detail={**rec["detail"], "missing": missing})
    return algorithm, rec


# --------------------------------------------------------------------------- prompt sets, cells, the history's facts

def eval_prompts(params: dict, plan: trainplan.TrainPlan, doc: dict, target: dict, from_run: str) -> tuple:
    """``(prompts, prompt_set)``: the held-out rows (``--prompts N``) or a prompt file's (``--prompts FILE``), as
    :mod:`remote.train.prompts` prompts; ``prompt_set["record"]`` is the ``eval.prompts`` record.

    :raises EvalError: a prompt file that cannot be read (file, line, the fields expected), text prompts for a
        tokenizer without a chat template."""
    from remote.extract.dataset import DatasetError
    from remote.train import prompts as prompt_files

    if isinstance(params["prompts"], int):
        held, rows = held_out_prompts(params, plan, doc, target)
        record = protocol.record("eval.prompts", protocol.OK,
                                 f"{len(held)} held-out prompt(s): dataset rows {rows[0]}..{rows[1] - 1} (run "
                                 f"{from_run} read rows 0..{rows[0] - 1}), {sum(map(len, held))} tokens",
                                 detail={"rows": rows, "dataset": (doc.get("params") or {}).get("dataset")})
        prompts = [{"id": str(rows[0] + i), "category": "held-out", "ids": ids} for i, ids in enumerate(held)]
        canon = json.dumps([p["ids"] for p in prompts]).encode()
        return prompts, {"format": "held-out", "rows": rows, "sha256": fsutil.sha256_bytes(canon),
                         "categories": {"held-out": len(prompts)}, "record": record}
    try:
        found = prompt_files.read(params["prompts"])
    except DatasetError as exc:
        raise EvalError("eval.prompts", f"prompt file {exc.path}, line {exc.lineno}: {exc.problem}", exc.fix,
                        detail={"file": exc.path, "line": exc.lineno, "expected": prompt_files.EXPECTED}) from None
    texts = [p for p in found["prompts"] if "ids" not in p]
    if texts and not has_chat_template(plan.model_path):
        raise EvalError("eval.prompts", f"{found['format']} prompts are sent as chat, and the tokenizer in "
                        f"{plan.model_path} has no chat template",
                        "add a chat_template to its tokenizer_config.json, or pass token rows "
                        "({\"input_ids\": [...]}) as --prompts")
    record = protocol.record("eval.prompts", protocol.OK,
                             f"{len(found['prompts'])} prompt(s) of {found['path']} ({found['format']}), "
                             f"{len(found['categories'])} categor{'y' if len(found['categories']) == 1 else 'ies'}: "
                             + ", ".join(f"{c} {n}" for c, n in found["categories"].items()),
                             detail={k: found[k] for k in ("path", "format", "sha256", "categories")})
    return found["prompts"], {**{k: found[k] for k in ("path", "format", "sha256", "categories")}, "record": record}


def has_chat_template(model_path: str) -> bool:
    """Whether the model dir's tokenizer has a chat template (its tokenizer_config.json, or a chat_template file)."""
    root = Path(model_path)
    if any((root / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = samples.read_json_quietly(root / "tokenizer_config.json") or {}
    return bool(config.get("chat_template"))


def engine_facts(params: dict) -> dict:
    """What served the draft, for the history: vLLM's version and distribution, the model runner the
    environment asks for (``VLLM_USE_V2_MODEL_RUNNER``: v2 / v1 / vLLM's default), per-request metrics support."""
    from remote.drift.source import site_packages
    from remote.system import versions
    from remote.train import specmetrics

    root = site_packages({})[1]
    try:
        version, dist = versions.vllm_version([str(root)] if root else None)
    except versions.VersionConflict as exc:
        version, dist = None, str(exc)
    flag = (os.environ.get("VLLM_USE_V2_MODEL_RUNNER") or "").strip().lower()
    runner = "v2" if flag in ("1", "true", "yes") else "v1" if flag in ("0", "false", "no") else "default"
    return {"vllm": version, "distribution": dist, "runner": runner, "per_request": specmetrics.support(root)}


def draft_digest(path: Path) -> str:
    """sha256 over the draft dir's config.json and weights (name and bytes, in name order): the draft's identity
    in the history, whatever dir or run id names it."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted([path / "config.json", *path.glob("*.safetensors")]):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def draft_loadable_record(draft: dict, where: str, vllm_root=None) -> dict:
    """``eval.draft_loadable``: whether this host's vLLM can load the draft's config, read from the draft
    class's source before anything loads (a known-bad pair: :mod:`remote.drift.rules.known_bad`)."""
    from remote.drift.pyindex import PackageIndex
    from remote.drift.rules import known_bad
    from remote.drift.source import site_packages

    root = vllm_root or site_packages({})[1]
    problem = known_bad.draft_config_problem(PackageIndex(root), draft, where) if root else None
    if problem is None:
        return protocol.record("eval.draft_loadable", protocol.OK,
                               "no known-bad draft config form for this vLLM" + ("" if root else " (no vLLM found)"))
    return protocol.record("eval.draft_loadable", protocol.FAIL, problem["summary"], fix=problem["fix"],
                           detail=problem)


def aux_ids_used_record(log_path, plan: trainplan.TrainPlan, params: dict) -> dict:
    """``eval.aux_ids_used``: the aux ids vLLM logged taking for the draft against the states' ids (a
    draft config vLLM does not read falls back to the target's defaults with no error)."""
    from remote.extract.engines.vllm_server import logs as server_log

    field_name = ids_field(plan) or "its aux layer ids"
    return server_log.used_ids_record(
        "eval.aux_ids_used", log_path, plan.trainer_layer_ids, f"run {plan.from_run}'s states' aux ids",
        fix=f"make the draft's config say {field_name} {plan.trainer_layer_ids} in the form this "
            f"vLLM reads (its log line: 'Using ... auxiliary layers from ...'), or evaluate it on states of those ids",
        force=bool(params.get("force")))


def _draft_k(draft: dict):
    methods = (draft.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")
