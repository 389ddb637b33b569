"""``specops train``, host side: check, then start an EAGLE-3 training run detached (stdlib only).

A task module (``main(params) -> payload``). ``action``:

``check``  the training preflight, nothing started: the states run is done and its
           samples are all there (size, and digest up to :data:`DIGEST_LIMIT` bytes of
           them, in each entry's algorithm: blake3, or an older run's sha256), its
           manifest gives a plan (:func:`remote.train.plan.resolve`: ids, backend, seq
           len, model), its token dataset is the states' own row for row with a
           supervised token (:func:`check_data`), the installed trainer takes every flag the plan passes (read
           from its schema, nothing imported), and the save path's disk holds the
           checkpoints.
``start``  ``check``, then the run through :mod:`remote.run.job`'s own start (the same lock,
           re-attach, resume and "one run at a time" rules as an extraction), whose
           supervisor is :mod:`remote.train.supervisor` instead of :mod:`remote.extract.supervisor`. A
           train run is an ordinary run dir (``<work_dir>/runs/<run_id>``): ``job``'s
           status, logs, follow and abort work on it unchanged. Starting a finished run
           again says so; an aborted or failed one resumes from its last checkpoint
           (speculators resumes from its save path by itself).

``online`` (``train --online``): the same checks plus ``train.online`` (the ids the run's own server will
capture are the trainer's aux ids and the final state; the disk each way keeps), and the supervisor
starts the states run's extraction server before the trainer (:mod:`remote.train.online`).

Parameters: :data:`SPEC`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from remote.extract import samples
from remote.run import job
from remote.system import modelconfig
from remote.train import memory as trainmem, online, plan as trainplan
from remote.train.plan import TrainError
from remote.wire import fsutil, protocol
from remote.wire.argspec import RUN_ARGS, TRAIN_ARGS, Arg, Spec

#: a states run up to this many bytes has every file's digest checked before training; above
#: it, sizes only (a 540 GB run would take hours to hash), and the record says so.
DIGEST_LIMIT = 2 << 30
#: bytes a checkpoint keeps per draft parameter: bf16 weights + AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 10

SPEC = Spec("train", TRAIN_ARGS, {
    "action": Arg("str", "check", choices=("check", "start", "files"), call=True),
    "run_id": Arg("str", required=True, doc="the train run's id (remote.wire.contract.run_id_problem)"),
    "work_dir": RUN_ARGS["work_dir"].but(required=True),
    "from_run": Arg("str", doc="check, start: the finished extraction run whose states it trains on"),
    "dry_run": Arg("bool", False, doc="speculators' --dry-run: write an untrained checkpoint and stop"),
    "train_args": Arg("list", elements="str", doc="more trainer flags (argv tokens), checked against the installed "
                      "trainer's (remote.train.plan.check_extra_args), appended to its command, recorded"),
    "algorithm": RUN_ARGS["algorithm"],
    "python": RUN_ARGS["python"].but(call=True, doc="the trainer's python (default: this one)"),
    "device": RUN_ARGS["device"],
    "tp": RUN_ARGS["tp"].but(doc="online: the TP of the run's extraction server (default: the states run's; a "
                                 "replica's own with --server-on REPLICA)"),
    "env": RUN_ARGS["env"],
    "force": Arg("bool", False, call=True, doc="start beside another run of this host"),
    # a host behind Slurm: the start submits the supervisor as a batch job, as an extraction's does
    "slurm": job.SPEC.args["slurm"],
    "online": Arg("bool", False, doc="train online: the run starts from_run's extraction server (same model, ids and "
                                     "parameters) and the trainer asks it for every row's states; none stay on disk "
                                     "(remote.train.online)"),
    "regenerate": Arg("bool", False, doc="the target writes its own replies to the states run's rows, their states "
                                         "are extracted, the draft trains on those (remote.train.regenerate)"),
    "ready_timeout_s": RUN_ARGS["ready_timeout_s"].but(doc="regenerate: how long the target's server may take to start"),
    "online_server": Arg("dict", doc="a disaggregated online run: this host's half of it (remote.train.online."
                         "DISAGG_KEYS: its role, server or trainer, both hosts, the server host's address, port "
                         "and watch_port)"),
    "nodes": Arg("dict", doc="a run over several hosts: this host's place in it (remote.train.plan.NODE_KEYS: the "
                             "hosts, head first, its node_rank, nnodes, the head's master_addr and master_port)"),
    "checkpoint": Arg("path", call=True, doc="files: a checkpoint dir inside the run's save path (or the save path)"),
    "globs": Arg("list", elements="str", call=True, doc="files: which of its files (default DRAFT_FILES)"),
}, required_if=[("action", "check", ("from_run",)), ("action", "start", ("from_run",))])
#: what a draft dir needs to be served (``vllm serve --speculative-config``): speculators' config (and the
#: config class it names in ``auto_map``) and weights
DRAFT_FILES = ("config.json", "config.py", "*.safetensors", "*.safetensors.index.json")


@SPEC.task
def main(params: dict) -> dict:
    records: list[dict] = []
    try:
        if params["action"] == "files":
            return draft_files(params)
        plan = check(params, records)
    except TrainError as exc:
        payload = exc.payload()
        payload["records"][:0] = records  # the checks that passed before the refusal
        return payload
    if params["action"] == "check" or any(r["status"] == protocol.FAIL for r in records):
        return protocol.payload(records, plan=plan.as_dict())
    try:
        started = job.start({**params, "_entry": "remote.train.supervisor"})
    except protocol.TaskError as exc:  # job's own refusals (other parameters, a busy host) are the train's
        return protocol.payload(records + [start_refusal(exc, params).record()], plan=plan.as_dict())
    return protocol.payload(records + started["records"], plan=plan.as_dict(), **started["data"])


def start_refusal(exc: protocol.TaskError, params: dict) -> protocol.TaskError:
    """:func:`remote.run.job.start`'s refusal said in train's words: which parameter differs from the run's own
    and how to resume it, or which run keeps the host busy and the ``--force``/abort way out."""
    detail = exc.detail or {}
    run_id = params["run_id"]
    if detail.get("running"):
        others = detail["running"]
        return TrainError("train.start", f"this host is already running {', '.join(others)}; train run {run_id} "
                          f"was not started", f"wait for it, stop it (specops abort --run-id {others[0]}), or pass "
                          f"--force to train beside it", detail=detail)
    if detail.get("changed"):
        changed = detail["changed"]
        from remote.wire.contract import PARAMS_FILE

        old = samples.read_json_quietly(job.run_dir_of(params) / PARAMS_FILE) or {}
        flag = lambda key: "the inventory's env" if key == "env" else "--" + key.replace("_", "-")  # noqa: E731
        shown = ", ".join(f"{flag(k)} {old.get(k)!r} (this call: {params.get(k)!r})" for k in changed)
        own = " ".join(f"{flag(k)} {old[k]}" for k in changed if old.get(k) not in (None, False, [], ""))
        return TrainError("train.start", f"train run {run_id} exists with other parameters: {shown}",
                          f"repeat the run's own flags to resume it ({own or 'leave them out'}), or train "
                          f"under a new --run-id", detail={**detail, "run": {k: old.get(k) for k in changed}})
    return TrainError("train.start", exc.summary, exc.fix, detail=detail)


def check(params: dict, records: list[dict]) -> trainplan.TrainPlan:
    """The training preflight: its records appended to ``records`` as they pass; the plan.

    :raises TrainError: a refusal (the records before it stay in ``records``).
    """
    check_same_args(params)
    if params.get("nodes"):
        why = trainplan.node_problem(params["nodes"])
        if why:
            raise TrainError("train.nodes", f"this host's place in the run over several hosts: {why}",
                             "start it with specops train --on <group> (the laptop sends each host its place)")
    # the server host's half of a disaggregated online run trains nothing: the trainer's own checks are its host's
    trains = (params.get("online_server") or {}).get("role") != "server"
    api = trainplan.trainer_api() if trains else None
    if trains:
        records.append(trainplan.check_algorithm(params, api))
        records.append(trainplan.check_extra_args(params.get("train_args"), api))
    plan = trainplan.resolve(params)
    records += [protocol.record(
        "train.plan", protocol.OK,
        f"from run {plan.from_run}: {plan.samples} samples, {plan.tokens} tokens, {plan.state_format} states -> "
        f"--hidden-states-backend {plan.backend}; ids {plan.layer_ids} (input) -> --target-layer-ids "
        f"{plan.trainer_layer_ids}; --total-seq-len {plan.total_seq_len}",
        detail=plan.as_dict())]
    records.append(check_states(plan))
    records.append(check_data(plan))
    if plan.online:
        records.append(check_online(plan, params))
    if params.get("regenerate"):
        from remote.train import regenerate
        from remote.wire import manifest as run_manifest

        doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
        records.append(regenerate.check(doc, params, plan.sample_tokens))
    if trains:
        records.append(trainplan.check_api(plan, api))
        records.append(trainplan.check_served(plan))
        records.append(check_disk(plan))
        # behind Slurm this is the login node: the trainer's memory is that of the compute node the job gets
        elsewhere = {"where": "the job's compute node", "why": "this is the login node; the trainer runs on a "
                     "compute node Slurm picks (specops preflight checks one)"} if params.get("slurm") else None
        records.append(trainmem.check(plan, modelconfig.read(plan.model_path), params.get("env"), elsewhere))
        if plan.device == "cpu":
            records.append(check_cpu_launcher())
    # the server's address is its head's: a replica's worker host neither holds nor reaches it (its ranks reach the
    # head on the replica's own ports, which the laptop's replica preflight checks)
    if params.get("online_server") and params["action"] == "check" and not online.node_rank(params["online_server"]):
        records.append(check_server_address(params["online_server"]))
    return plan


#: how long the server host holds its ports open for the trainer host's preflight to reach them (seconds)
ADDRESS_HOLD_S = 20.0


def check_server_address(disagg: dict) -> dict:
    """``train.server_address``: a disaggregated online run's ports, checked as a replica's are
    (:mod:`remote.extract.replica_probe`): the server host listens on its address's port and watch port while the
    trainer host, checked at the same time (:func:`specops.train.disagg_preflight`), connects to both."""
    from remote.extract import replica_probe

    ports = [int(disagg["port"]), int(disagg["watch_port"])]
    if disagg.get("role") == "server":
        held = replica_probe.hold_ports(str(disagg["address"]), ports, ADDRESS_HOLD_S, expect=1)
        taken = {p: e for p, e in held["bound"].items() if e}
        return protocol.record("train.server_address", protocol.FAIL if taken else protocol.OK,
                               f"the server host cannot listen on {disagg['address']} port(s) " + "; ".join(
                                   f"{p} ({e})" for p, e in taken.items()) if taken else
                               f"listened on {disagg['address']}:{ports[0]}/{ports[1]} for the trainer host "
                               f"{disagg['trainer_host']}", detail={"listen": held, **disagg},
                               fix="pass --server-port P with P and P + 1 free on the server host, or set its "
                                   "node_address to an address it has" if taken else None)
    reached = replica_probe.reach(str(disagg["address"]), ports, ADDRESS_HOLD_S)
    missed = {p: e for p, e in reached.items() if e}
    return protocol.record("train.server_address", protocol.FAIL if missed else protocol.OK,
                           f"cannot reach the server host {disagg['server_host']} on " + "; ".join(
                               f"{disagg['address']}:{p} ({e})" for p, e in missed.items()) if missed else
                           f"reached the server host {disagg['server_host']} on {disagg['address']}:"
                           f"{ports[0]}/{ports[1]}", detail={"reach": reached, **disagg},
                           fix=f"open ports {ports[0]} and {ports[1]} of {disagg['server_host']} to this host "
                               f"(firewall), and check its node_address: the address the trainer connects to"
                           if missed else None)


def check_online(plan: trainplan.TrainPlan, params: dict) -> dict:
    """``train.online``: what the online run's server captures is what the trainer reads, both from the one layer
    plan (:func:`remote.wire.layers.algorithm_plan` of the run's algorithm: the file's layer axis, the trainer's
    aux ids and the final state last, the ids the serving vLLM counts).

    :raises TrainError: ``--regenerate`` with ``--online`` (not built: the regenerated rows' states would be
        extracted offline first), or ids that disagree (both lists named).
    """
    from remote.train import online

    if params.get("regenerate"):
        raise TrainError("train.online", "--online with --regenerate is not built: the regenerated text's states "
                         "are extracted offline before training", "drop one of --online and --regenerate")
    layer_plan = online.layer_plan(plan)
    captured, reads = online.capture_ids(plan), [*plan.trainer_layer_ids, layer_plan["final_state"]]
    if captured != reads or layer_plan["problems"]:
        raise TrainError("train.online", f"the server would capture ids {captured} (input) but {plan.algorithm}'s "
                         f"trainer reads aux ids {plan.trainer_layer_ids} and the final state "
                         f"{layer_plan['final_state']} ({reads})" + "".join(f"; {p}" for p in layer_plan["problems"]),
                         "extract again with the final state last (specops extract --layer-ids)",
                         detail={"captured": captured, "trainer_layer_ids": plan.trainer_layer_ids,
                                 "reads": reads, "algorithm": plan.algorithm, "problems": layer_plan["problems"]})
    disk, cost = online_disk(plan), online_time(plan)
    return protocol.record("train.online", protocol.OK,
                           f"online: run {plan.from_run}'s extraction server captures ids {captured} (input) for "
                           f"every row; the trainer asks it (--on-missing generate) with {plan.algorithm}'s aux ids "
                           f"{plan.trainer_layer_ids} (vLLM serves them as {layer_plan['engine_ids']}); on disk: "
                           f"offline {disk['offline_bytes'] / 2**20:.1f} MiB "
                           f"(states {disk['states_bytes'] / 2**20:.1f} MiB, {disk['bytes_per_sample']} B a sample), "
                           f"online {disk['online_bytes'] / 2**20:.2f} MiB ({disk['online_keeps']}); {cost['line']}",
                           detail={"captured": captured, "trainer_layer_ids": plan.trainer_layer_ids,
                                   "algorithm": plan.algorithm, "engine_ids": layer_plan["engine_ids"],
                                   "final_state": layer_plan["final_state"], "data_path": plan.online_data,
                                   "keep_states": plan.keep_states, "disk": disk, "time": cost})


def online_disk(plan: trainplan.TrainPlan) -> dict:
    """What each way keeps on disk for this dataset: offline the states (the manifest's files) and the token
    dataset, online the token dataset alone (the server's files are deleted once the trainer read them), or with
    ``keep_states`` all the states too."""
    from remote.wire import manifest as run_manifest

    doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
    entries = list(doc.get("files") or [])
    states = sum(int(e.get("bytes") or 0) for e in entries)
    states_dir = Path(plan.data_path) / "hidden_states"
    dataset = sum(f.stat().st_size for f in Path(plan.data_path).rglob("*")
                  if f.is_file() and states_dir not in f.parents)
    from remote.train.keepstates import kept_run_id

    keep = plan.keep_states == "all"
    return {"states_bytes": states, "token_dataset_bytes": dataset, "offline_bytes": states + dataset,
            "online_bytes": dataset + (states if keep else 0), "bytes_per_sample": states // max(1, len(entries)),
            "samples": len(entries),
            "online_keeps": (f"--keep-states all: the token dataset and the states, kept as run "
                             f"{kept_run_id(plan.run_id)}") if keep else "the token dataset only"}


def online_time(plan: trainplan.TrainPlan) -> dict:
    """The time of each way for this dataset, from the last runs' rates where known: the states run's
    extraction tok/s (its summary), the last offline train run of the same states' tok/s, and the last online
    one's (this run's earlier attempt too: the trainer's own rate, its waits on the server included).

    Offline extracts once and trains ``epochs`` times from disk; online (colocated, one request at a time) has
    the server make every row's states again each epoch, as the trainer deletes them once read: without an
    online rate measured, the states' time each epoch plus the training's. Either way loads the target once
    (the states run's own load, where its summary has it): counted in both, so a small dataset's figures are
    not a fraction of what the runs take, and the difference between the ways stays the states' time."""
    tokens, epochs = int(plan.tokens or 0), int(plan.epochs or 1)
    summary = samples.read_json_quietly(Path(plan.states_run_dir) / samples.SUMMARY)
    summary = summary if isinstance(summary, dict) else {}
    try:
        extract_tps = float(summary["tokens_per_s"])
    except (KeyError, TypeError, ValueError):
        extract_tps = None
    try:
        load_s = round(float((summary.get("phase_seconds") or {}).get("load") or 0), 1)
    except (TypeError, ValueError, AttributeError):
        load_s = 0.0
    rates: dict[bool, tuple[float, str]] = {}  # online? -> (tok/s, run id) of the newest such train run
    statuses = [d / "status.json" for d in Path(plan.states_run_dir).parent.iterdir() if (d / "status.json").is_file()]
    for path in sorted(statuses, key=lambda f: f.stat().st_mtime, reverse=True):
        st = samples.read_json_quietly(path)
        if not isinstance(st, dict):
            continue
        run_plan = st.get("plan") or {}
        if st.get("kind") == "train" and run_plan.get("from_run") == plan.from_run and st.get("tokens_per_s"):
            rates.setdefault(bool(run_plan.get("online")), (float(st["tokens_per_s"]), path.parent.name))
    train_tps, train_run = rates.get(False, (None, None))
    online_tps, online_run = rates.get(True, (None, None))
    out = {"tokens": tokens, "epochs": epochs, "extract_tokens_per_s": extract_tps, "train_tokens_per_s": train_tps,
           "train_rate_from": train_run, "online_tokens_per_s": online_tps, "online_rate_from": online_run,
           "load_s": load_s, "offline_s": None, "online_s": None}
    if not tokens or not extract_tps:
        out["line"] = "time: no extraction rate known for this dataset"
        return out
    extract_s = tokens / extract_tps
    out.update(offline_extract_s=round(extract_s, 1), online_extract_s=round(epochs * extract_s, 1))
    load = f"; each way loads the target once (~{load_s:.0f} s in run {plan.from_run})" if load_s else ""
    if online_tps:  # measured: the trainer's own rate while streaming
        out["online_s"] = round(load_s + epochs * tokens / online_tps, 1)
    if train_tps is None:
        out["line"] = (f"time: states {extract_s:.0f} s once offline at {extract_tps:.0f} tok/s, "
                       + (f"online ~{out['online_s']:.0f} s ({online_tps:.0f} tok/s in run {online_run}); "
                          if online_tps else f"{epochs * extract_s:.0f} s online (made again each of {epochs} "
                                             f"epoch(s)); ")
                       + f"training's offline rate not known yet (no earlier offline train run of {plan.from_run})"
                       + load)
        return out
    train_s = epochs * tokens / train_tps
    out["offline_s"] = round(load_s + extract_s + train_s, 1)
    if not online_tps:
        out["online_s"] = round(load_s + epochs * extract_s + train_s, 1)
    how = (f"{online_tps:.0f} tok/s measured in run {online_run}" if online_tps
           else "the states made again each epoch, estimated")
    out["line"] = (f"time: offline ~{out['offline_s']:.0f} s (states once at {extract_tps:.0f} tok/s, then "
                   f"{epochs} epoch(s) at {train_tps:.0f} tok/s, run {train_run}), online ~{out['online_s']:.0f} s "
                   f"({how}){load + ', in both' if load else ''}")
    return out


def check_same_args(params: dict) -> None:
    """A train run that exists (resumed, re-attached) goes on with the trainer flags it started with: other
    ``train_args`` would make its epochs two different runs under one id.

    :raises TrainError: naming both lists.
    """
    from remote.wire.contract import PARAMS_FILE

    old = samples.read_json_quietly(job.run_dir_of(params) / PARAMS_FILE)
    if old is None:
        return
    before, now = list(old.get("train_args") or []), list(params.get("train_args") or [])
    if before != now:
        shown = lambda args: " ".join(args) if args else "none"  # noqa: E731
        raise TrainError("train.trainer_args", f"train run {params['run_id']} started with trainer flags "
                         f"[{shown(before)}], this call gives [{shown(now)}]",
                         "repeat the run's own --trainer-arg flags to resume it, or train under a new --run-id",
                         detail={"run": before, "given": now})


def check_cpu_launcher() -> dict:
    """``train.device``: a CPU host runs speculators' trainer only behind the launcher shim
    (:data:`remote.train.plan.CPU_LAUNCHER_MODULE`: five accelerator assumptions patched), which
    only the test host's env carries; elsewhere the trainer dies with "No accelerator found"."""
    import importlib.util

    if importlib.util.find_spec(trainplan.CPU_LAUNCHER_MODULE) is None:
        return protocol.record("train.device", protocol.FAIL,
                               "device cpu: speculators' trainer needs an accelerator, and this env has no CPU "
                               f"launcher ({trainplan.CPU_LAUNCHER_MODULE})",
                               fix="train on a GPU host (set device: cuda), or use a specops test host, whose env "
                                   "carries the launcher (specops/testhost/cpu_train_launcher.py)")
    return protocol.record("train.device", protocol.OK,
                           f"device cpu: the trainer runs behind {trainplan.CPU_LAUNCHER_MODULE} (test host)")


def check_states(plan: trainplan.TrainPlan) -> dict:
    """``train.states``: every sample file and token dataset file the manifest names is there and whole.

    :raises TrainError: naming the files missing, cut short or changed.
    """
    from remote.wire import manifest as run_manifest

    doc = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
    out_dir = Path(plan.data_path)
    entries = list(doc.get("files") or [])
    total = sum(int(e.get("bytes") or 0) for e in entries)
    hashed = total <= DIGEST_LIMIT
    hashes = run_manifest.digest_names(entries)
    missing, short, changed = [], [], []
    for entry in entries:
        path = out_dir / entry["path"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            missing.append(entry["path"])
            continue
        if size != int(entry["bytes"]):
            short.append(entry["path"])
        elif hashed and not _matches(path, entry):
            changed.append(entry["path"])
    missing += [name for name in doc.get("dataset_files") or [] if not (out_dir / name).exists()]
    if missing or short or changed:
        parts = [f"{len(v)} {k}" for k, v in (("missing", missing), ("of another size", short),
                                              (f"with another {hashes}", changed)) if v]
        raise TrainError("train.states", f"run {plan.from_run}'s states in {out_dir}: {', '.join(parts)} "
                         f"(e.g. {(missing + short + changed)[0]})",
                         f"resume the extraction (specops extract --run-id {plan.from_run}) to make them again",
                         detail={"missing": missing, "short": short, "changed": changed})
    how = f"{hashes} match" if hashed else f"sizes match (over {DIGEST_LIMIT >> 30} GiB: {hashes} not checked)"
    return protocol.record("train.states", protocol.OK,
                           f"{len(entries)} sample file(s) of run {plan.from_run} ({total} bytes) and the token "
                           f"dataset present; {how}", detail={"output_dir": str(out_dir), "bytes": total,
                                                               "digests_checked": hashed})


def check_data(plan: trainplan.TrainPlan) -> dict:
    """``train.data``: the token dataset the trainer reads (``load_from_disk(data_path)``) is the one these states
    were made from, row for row, and it supervises at least one token.

    speculators' trainer pairs row ``i`` with ``hidden_states/hs_{i}.safetensors`` and silently skips a row whose
    ``input_ids`` differ from the file's ``token_ids`` (another run's dataset trains on nothing, exchanged rows
    drop both); a row without a file it would make through a vLLM server it assumes (specops passes
    ``--on-missing raise``, :data:`remote.train.plan.FIXED`). So every row is compared here, before a load.

    :raises TrainError: naming the dataset file that cannot be read, the rows without states (a group run's
        other shards) or whose tokens are not their states' (and whose they are), or a dataset with no
        supervised token.
    """
    out_dir = Path(plan.data_path)
    try:
        import numpy  # noqa: F401  (safetensors' numpy reader)
        from datasets import load_from_disk
        from safetensors import safe_open
    except ImportError as exc:
        raise TrainError("train.data", f"this python cannot read the token dataset the trainer reads ({exc})",
                         "install speculators' own requirements (datasets, safetensors, numpy) into the host's "
                         "env (the inventory's python)") from None
    fix_remake = f"resume the extraction to write its token dataset again (specops extract --run-id {plan.from_run})"
    try:
        rows = load_from_disk(str(out_dir)).with_format(None)
        input_ids, loss_mask = rows["input_ids"], rows["loss_mask"]
    except Exception as exc:  # a truncated or foreign arrow file fails here, in datasets' or pyarrow's words
        bad = _unreadable_dataset_file(out_dir)
        raise TrainError("train.data", f"run {plan.from_run}'s token dataset in {out_dir} cannot be read"
                         f"{f' ({bad} is damaged)' if bad else ''}: {type(exc).__name__}: {str(exc)[:300]}",
                         f"{fix_remake}; it rewrites {bad or 'the dataset files'} from the run's dataset",
                         detail={"output_dir": str(out_dir), "file": bad}) from None
    missing, foreign, by_tokens = [], [], {}
    for index, ids in enumerate(input_ids):
        path = samples.sample_path(out_dir, index, samples.HS)
        if not path.is_file():
            missing.append(index)
            continue
        try:
            with safe_open(str(path), framework="numpy") as fh:
                tokens = fh.get_tensor("token_ids").tolist()
        except Exception as exc:  # damaged past what the size check sees (runs over DIGEST_LIMIT are not hashed)
            raise TrainError("train.data", f"{path} (the states of row {index}) cannot be read: "
                             f"{type(exc).__name__}: {str(exc)[:200]}", f"{fix_remake} (it makes the file again)",
                             detail={"file": str(path), "row": index}) from None
        by_tokens[tuple(tokens)] = index
        if tokens != list(ids):
            foreign.append(index)
    listed = sorted(int(e["index"]) for e in run_states(plan) if e.get("index") is not None)
    beyond = [i for i in listed if i >= len(input_ids)]
    where = f"run {plan.from_run}'s token dataset ({out_dir}, {len(input_ids)} rows)"
    if foreign:
        shown = []
        for index in foreign[:3]:
            other = by_tokens.get(tuple(input_ids[index]))
            shown.append(f"row {index} holds the tokens of {_sample_name(other)}" if other is not None
                         else f"row {index}'s tokens are not those of {_sample_name(index)}")
        raise TrainError("train.data", f"{where} is not the one its states were made from: {len(foreign)} row(s) "
                         f"differ from their states' token_ids ({'; '.join(shown)}); the trainer would skip them",
                         f"{fix_remake}; never copy another run's dataset files into its output dir",
                         detail={"rows": foreign[:100], "rows_differing": len(foreign)})
    if beyond:
        raise TrainError("train.data", f"{where} ends before its states do: {len(beyond)} sample(s) from "
                         f"{_sample_name(beyond[0])} have no row (a truncated or older dataset)", fix_remake,
                         detail={"samples_without_row": beyond[:100]})
    if missing:
        spans = _spans(missing)
        raise TrainError("train.data", f"{where}: {len(missing)} row(s) have no states in {out_dir} (rows "
                         f"{', '.join(spans[:4])}{' ...' if len(spans) > 4 else ''}): the states of a group run's "
                         f"other shards, or of a sample range this run did not extract",
                         "train where every row's states are: extract the group with an output_dir all its hosts "
                         f"share, or copy the other shards' {samples.sample_path('', 0, samples.HS).parent}/hs_*"
                         f".safetensors into {out_dir} on this host, then train again",
                         detail={"rows_without_states": missing[:1000], "spans": spans, "rows": len(input_ids)})
    supervised = sum(int(sum(mask)) for mask in loss_mask)
    if supervised == 0:
        raise TrainError("train.data", f"{where} supervises no token: every row's loss_mask is 0, so the draft "
                         f"would learn nothing (loss 0)", "extract with a --seq-len long enough to hold the "
                         "replies (the assistant turns are the supervised tokens), or from a dataset that has them",
                         detail={"rows": len(input_ids), "supervised_tokens": 0})
    shared = len(input_ids) - len(listed)  # a group run's shared output dir: the other shards' states are here too
    return protocol.record("train.data", protocol.OK,
                           f"{len(input_ids)} token dataset row(s) are the states' own tokens; {supervised} "
                           f"supervised token(s)" + (f"; {shared} row(s) of the group's other shards (shared "
                                                     f"output dir)" if shared > 0 else ""),
                           detail={"rows": len(input_ids), "supervised_tokens": supervised,
                                   "rows_of_other_shards": max(0, shared)})


def run_states(plan: trainplan.TrainPlan) -> list[dict]:
    """The ``files`` entries of the states run's manifest."""
    from remote.wire import manifest as run_manifest

    return list(run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST).get("files") or [])


def _sample_name(index) -> str:
    return f"sample {index} ({samples.sample_path('', index, samples.HS)})"


def _spans(indices: list[int]) -> list[str]:
    """``[0, 1, 2, 5]`` -> ``["0-2", "5"]``."""
    out, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            out.append(f"{start}-{index}" if index != start else str(start))
            start = None
    return out


def _unreadable_dataset_file(out_dir: Path) -> str | None:
    """The first arrow file of the token dataset pyarrow cannot read whole (datasets writes IPC streams)."""
    try:
        import pyarrow
    except ImportError:
        return None
    for path in sorted(out_dir.glob("*.arrow")):
        try:
            with pyarrow.memory_map(str(path)) as source:
                pyarrow.ipc.open_stream(source).read_all()
        except Exception:  # any damage: this is the file to name
            return path.name
    return None


def _matches(path, entry: dict) -> bool:
    """:func:`remote.wire.manifest.file_matches`; a digest this python cannot compute refuses the check."""
    from remote.wire import fsutil, manifest as run_manifest

    try:
        return run_manifest.file_matches(path, entry)
    except fsutil.HashUnavailable as exc:
        raise TrainError("train.states", f"cannot check {entry['path']}'s {exc.name} digest here", exc.fix) from None


def draft_params(config: dict) -> int:
    """How many parameters the EAGLE-3 draft of this target has (:func:`remote.train.memory.parameters`)."""
    counts = trainmem.parameters(trainmem.draft_shape(config))
    return counts["trainable"] + counts["frozen"]


def check_disk(plan: trainplan.TrainPlan) -> dict:
    """``train.disk``: the save path's filesystem holds a checkpoint per epoch (weights + optimizer).

    :raises TrainError: when it does not, with both numbers.
    """
    try:
        config = modelconfig.read(plan.model_path)
    except modelconfig.ConfigError as exc:
        raise TrainError("train.model", f"the states' model {plan.model_path}: {exc.summary}", exc.fix) from None
    per = draft_params(config) * CHECKPOINT_BYTES_PER_PARAM
    need = per * (1 if plan.dry_run else plan.epochs)
    where = Path(plan.save_path)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    detail = {"save_path": plan.save_path, "per_checkpoint_bytes": per, "need_bytes": need, "free_bytes": free}
    if free < need:
        raise TrainError("train.disk", f"{plan.save_path}: {free / 2**30:.1f} GiB free, the run keeps about "
                         f"{need / 2**30:.1f} GiB of checkpoints ({plan.epochs} x {per / 2**30:.2f} GiB)",
                         "free disk under work_dir, or train fewer epochs (each keeps a checkpoint)", detail=detail)
    return protocol.record("train.disk", protocol.OK, f"{free / 2**30:.1f} GiB free for about "
                           f"{need / 2**20:.0f} MiB of checkpoints", detail=detail)


def draft_files(params: dict) -> dict:
    """``files``: a checkpoint's draft files (:data:`DRAFT_FILES`, or ``globs``) with their sizes and digests
    (the manifest's hash, :func:`remote.wire.fsutil.file_digest`).

    ``checkpoint`` must lie inside the run's save path once its links are followed
    (speculators' ``checkpoint_best`` is a link to an epoch dir); the payload names that
    real dir, so a download reads the files that were hashed even if the link moves.
    """
    import fnmatch

    save = trainplan.checkpoints_dir(job.run_dir_of(params))
    asked = Path(params.get("checkpoint") or save)
    ckpt = asked if asked.is_absolute() else save / asked
    try:
        real, root = ckpt.resolve(strict=True), save.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        raise TrainError("fetch.draft", f"{ckpt} does not exist on the host",
                         f"list the run's checkpoints: specops status --run-id {params['run_id']}") from None
    if real != root and root not in real.parents:
        raise TrainError("fetch.draft", f"{ckpt} is not inside run {params['run_id']}'s save path {save}",
                         "name a checkpoint of this train run")
    globs = params.get("globs") or DRAFT_FILES
    entries = []
    for path in sorted(real.iterdir()):
        if not path.is_file() or not any(fnmatch.fnmatchcase(path.name, g) for g in globs):
            continue
        size = path.stat().st_size
        digest = fsutil.file_digest(path)
        if path.stat().st_size != size:
            raise TrainError("fetch.draft", f"{path} changed while it was hashed (a checkpoint being written)",
                             "fetch again once the epoch's checkpoint is saved")
        entries.append({"path": path.name, "bytes": size, **digest})
    names = [e["path"] for e in entries]
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise TrainError("fetch.draft", f"{real} holds no draft (config.json and *.safetensors): "
                         f"{', '.join(names) or 'none of ' + ', '.join(globs)}",
                         "fetch again once the run has saved a checkpoint", detail={"files": names})
    total = sum(e["bytes"] for e in entries)
    return protocol.payload([protocol.record("fetch.draft", protocol.OK, f"{len(entries)} file(s) of {real}, "
                                             f"{total} bytes, hashed on the host", detail={"dir": str(real)})],
                            dir=str(real), files=entries)
