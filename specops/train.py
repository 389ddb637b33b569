"""``specops train``: an EAGLE-3 draft trained on a finished extraction run's states, detached.

Per host: the training preflight and the start (``remote/train/task.py``: the plan from the
states run's manifest -- model, ids minus the final state, read backend, seq len, data
path --, the samples whole, the installed trainer's flags, disk for the checkpoints),
then the run followed like an extraction (one python on the host streaming status
changes: step, epoch, loss, per-position accuracy, tokens/s, ETA), then the run's
status, logs and ``metrics.jsonl`` fetched into ``runs/<host>/<run-id>/``. The run is an
ordinary run dir on the host, so ``specops status / logs / abort --run-id`` act on it;
Ctrl-C detaches; the same command again re-attaches, or resumes an aborted or failed run
from its last epoch checkpoint (speculators resumes from its save path). On a host behind Slurm
(``scheduler: slurm``) the checks run on the login node and the start submits the supervisor as one
batch job (:mod:`specops.slurm`); status, abort (scancel) and the resume read Slurm's state the same way.

    >>> train(inventory, "modern", run_id="d1", from_run="llama-tp1", epochs=40)
    th  step 88/90  epoch 20/20  loss 0.009  acc 0.46/0.39/0.37  58 tok/s  ETA 2s
    ...
    train.run ok: run d1 done: step 90, epoch 20, loss 0.009, accuracy [0.46, 0.39, 0.37]; checkpoint .../19
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

from rich.text import Text

from specops import slurm, trainnodes, wire
from specops.errors import SpecopsError, UsageError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.report import console, err_console, print_reports
from specops.result import HostReport, Record, RunStatus
from specops.runs import hostjob
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts
from specops.transport.pool import HostPool
from specops.wire import argspec
from specops.wire.argspec import TRAIN_ARGS

#: at most one progress line a host this often (seconds), besides one per state or epoch change
PROGRESS_EVERY_S = 5.0


def train_params(host: Host, run_id: str, from_run: str, *, epochs: int, dry_run: bool, force: bool,
                 trainer_args: list[str] | None = None, regenerate: dict | None = None,
                 action: str = "start", gpus: int | None = None, total_seq_len: int | None = None,
                 online: bool | dict = False, algorithm: str | None = None, tp: int | None = None) -> dict:
    """The host task's parameters; ``regenerate``: ``{"regen_max_tokens", "regen_temperature"}`` (None values
    left out) for ``train --regenerate``."""
    params = {"action": action, "run_id": run_id, "work_dir": host.spec.work_dir, "from_run": from_run,
              "epochs": int(epochs), "dry_run": bool(dry_run), "python": host.spec.python,
              "device": host.spec.device, "env": dict(host.spec.env), "force": bool(force)}
    if trainer_args:  # only when given: a run started without any records none, and resumes without any
        params["train_args"] = list(trainer_args)
    if gpus:
        params["gpus"] = int(gpus)
    if total_seq_len:
        params["total_seq_len"] = int(total_seq_len)
    if tp:  # only when given (or a replica's): the online server's TP, else the states run's
        params["tp"] = int(tp)
    if online:  # only when given: an offline run records none (a dict: its stream checks given)
        params["online"] = True
        params.update({k: v for k, v in (online if isinstance(online, dict) else {}).items() if v is not None})
    if algorithm:  # only when given, like the trainer args: a run started without it resumes without it
        params["algorithm"] = str(algorithm)
    if regenerate is not None:
        params.update({"regenerate": True, **{k: v for k, v in regenerate.items() if v is not None}})
    return params


def online_params(stream_checks: dict, keep_states: str) -> dict | bool:
    """``--online``'s own parameters as :func:`train_params` takes them: the stream checks given and a
    ``keep_states`` other than its default (True: none given)."""
    given = {**stream_checks, **({"keep_states": keep_states} if keep_states != TRAIN_ARGS["keep_states"].default
                                 else {})}
    return given or True


def trainer_argv(values) -> list[str]:
    """The argv tokens of the ``--trainer-arg`` values: each one flag, ``--lr=1e-4`` or ``--lr 1e-4`` (or a list
    flag's values, ``--full-attention-indices 0 2``), split the same way whichever form was typed, so a resume
    that types it the other way is the same run.

    :raises UsageError: a value that is not a ``--flag``.
    """
    import shlex

    out = []
    for value in values or []:
        try:
            words = shlex.split(str(value))
        except ValueError as exc:
            raise UsageError(f"--trainer-arg {value!r}: {exc}", "quote each trainer flag as one shell word, e.g. "
                                                               "--trainer-arg='--lr 1e-4'") from None
        if not words or not words[0].startswith("--") or len(words[0]) < 3:
            raise UsageError(f"--trainer-arg {value!r} is not a trainer flag",
                             "pass one flag of speculators' trainer with its value per --trainer-arg, e.g. "
                             "--trainer-arg=--lr=1e-4 or --trainer-arg '--num-layers 2'")
        bare = [w for w in words if w.startswith("--") and len(w) < 3]
        if bare:  # "--" would end the trainer's own options: no flag, and the host could not name it
            raise UsageError(f"--trainer-arg {value!r} holds a bare {bare[0]!r}, which is not a trainer flag",
                             "pass one flag of speculators' trainer with its value per --trainer-arg, e.g. "
                             "--trainer-arg=--lr=1e-4 or --trainer-arg '--num-layers 2'")
        name, eq, first = words[0].partition("=")
        out += [name] + ([first] if eq else []) + words[1:]
    return out


def start_step(host: Host, run_id: str, from_run: str, *, epochs: int, dry_run: bool, force: bool,
               trainer_args: list[str] | None = None, regenerate: dict | None = None,
               gpus: int | None = None, total_seq_len: int | None = None, nodes: dict | None = None,
               action: str = "start", online: bool | dict = False, algorithm: str | None = None,
               online_server: dict | None = None, tp: int | None = None) -> HostReport:
    """The training preflight and the start (or re-attach, or resume) on one host (``action`` check: the
    preflight alone); ``nodes``: its place in a run over several hosts (:mod:`specops.trainnodes`);
    ``online_server``: its half of a disaggregated online run (:func:`disagg_blocks`)."""
    slurm.refuse_train(host.spec)
    params = train_params(host, run_id, from_run, epochs=epochs, dry_run=dry_run, force=force,
                          trainer_args=trainer_args, regenerate=regenerate, gpus=gpus, total_seq_len=total_seq_len,
                          action=action, online=online, algorithm=algorithm, tp=tp)
    if nodes:
        params["nodes"] = nodes
    if online_server:
        params["online_server"] = online_server
    params.update(slurm.job_params(host.spec))  # behind Slurm: the start submits the run as a batch job
    payload = host.run_task("train", params)
    report = report_from_payload(host.name, "train", payload)
    report.data.update(payload.get("data") or {})
    return report


def _train_flag(name: str, value):
    """Flag ``--<name>``'s value checked by its :data:`TRAIN_ARGS` entry (the train task's spec on the host checks
    the same), its default when unset. :raises UsageError: naming the flag, in the table's words."""
    arg, flag = TRAIN_ARGS[name], "--" + name.replace("_", "-")
    if value is None or value == "":
        return arg.default
    try:
        return argspec.judge(arg, value)
    except argspec.BadValue as exc:
        raise UsageError(exc.about(flag, value), exc.fix_for(flag)) from None


def progress_line(host: str, st: dict) -> Text:
    """One line of a training run's progress from its status (its text is the remote's: never markup)."""
    acc = st.get("accuracy") or []
    parts = [st.get("state") or ""]
    if st.get("step") is None and st.get("phase"):  # before the trainer: regenerating, extracting, starting
        parts.append(st["phase"])
    if st.get("step") is not None:
        parts.append(f"step {st['step']}/{st.get('steps_total') or '?'}")
        parts.append(f"epoch {int(st.get('epoch') or 0) + 1}/{st.get('epochs') or '?'}")
    if st.get("loss") is not None:
        parts.append(f"loss {st['loss']:.4g}")
    if acc:
        parts.append("acc " + "/".join(f"{a:.2f}" for a in acc))
    if st.get("tokens_per_s"):
        parts.append(f"{st['tokens_per_s']:.0f} tok/s")
    if st.get("eta_s") is not None:
        parts.append(f"ETA {st['eta_s']:.0f}s")
    memory = st.get("memory") or {}
    if memory.get("peak_bytes"):  # the trainer's measured peak so far, against the preflight's estimate
        parts.append(f"peak {wire.words.human_bytes(memory['peak_bytes'])}" +
                     (f" ({memory['peak_over_estimate']:.2f}x est.)" if memory.get("peak_over_estimate") else ""))
    return Text(host, style="bold") + Text("  " + "  ".join(p for p in parts if p))


#: the errors of a trainer that exited but whose draft learned nothing (remote.train.supervisor): diverged, or no signal
NOTHING_LEARNED = ("LossNotFinite", "NothingLearned")


def run_record(run_id: str, state: RunStatus) -> Record:
    """``train.run``: how the run ended, with its last numbers (fail: its root cause)."""
    st = state.model_dump()
    # what the trainer really held, beside the preflight's estimate (the host's remote.train.memuse)
    memory = st.get("memory")
    used = f"; {wire.words.usage_line(memory)}" if memory else ""
    nodes = st.get("nodes") or {}
    if state.state == "done" and int(nodes.get("node_rank") or 0) > 0:
        return Record(name="train.run", status="ok",
                      summary=f"run {run_id} done on node {nodes['node_rank']} of {nodes['nnodes']} (headless: the "
                              f"curve and the checkpoints are on {nodes['hosts'][0]}){used}",
                      detail={"nodes": nodes, "wall_s": st.get("wall_s"), "memory": memory})
    served = st.get("online_server") or {}
    if state.state == "done" and served.get("trainer_host"):  # the server host's half of a disaggregated run
        how = (f"ranks {served['ranks']} of replica {served.get('replica')} (headless) served the trainer on "
               f"{served['trainer_host']} through the head {served.get('server_host')}" if served.get("ranks") else
               f"served the trainer on {served['trainer_host']} at {served.get('endpoint')} (ready in "
               f"{served.get('ready_s')} s)")
        return Record(name="train.run", status="ok",
                      summary=f"run {run_id} done: {how}; the curve and the checkpoints are on "
                              f"{served['trainer_host']}",
                      detail={"online_server": served, "wall_s": st.get("wall_s")})
    if state.state == "done":
        ckpt = st.get("checkpoint") or {}
        where = ckpt.get("path") or st.get("checkpoints")
        # rows the target did not answer when regenerating are not in what the draft learned: said, not lost
        regenerated = st.get("regenerated") or {}
        lost = regenerated.get("unanswered")
        # --online: streamed samples that failed the trainer's checks (ids echo, shape, finite) on every try
        stream = st.get("online_stream") or {}
        dropped = (f"{stream['dropped']} streamed sample(s) failed every check and were not trained on (rows "
                   f"{stream['dropped_rows']}; {stream['failed_round_trips']} failed round trip(s), last: "
                   f"{stream['last']['error']})") if stream.get("dropped") else ""
        kept = st.get("kept_states") or {}
        # rows a trainer process streamed and kept whose file is not in the kept run: a kept run short of its stream
        unkept = kept.get("lost") or []
        kept_line = (f"; the streamed states kept as extraction run {kept['run_id']} ({kept['samples']} samples"
                     + (f", streamed by ranks {kept['ranks']}" if len(kept.get("ranks") or {}) > 1 else "")
                     + (f", {kept['tokens_per_s']} tok/s streamed" if kept.get("tokens_per_s") else "")
                     + (f", rows {kept['missing']} missing" if kept.get("missing") else "")
                     + (f"; rows {unkept} streamed but not kept" if unkept else "") + ")") if kept else ""
        return Record(name="train.run", status="warn" if lost or dropped or unkept else "ok",
                      summary=f"run {run_id} done: step {st.get('step')}, epoch {int(st.get('epoch') or 0) + 1}, "
                              f"loss {st.get('loss')}, accuracy {st.get('accuracy')}; checkpoint {where}{used}"
                              + (f"; regenerate: {lost}" if lost else "") + (f"; {dropped}" if dropped else "")
                              + kept_line,
                      fix=f"read {regenerated.get('errors_file')} for why" if lost else
                      (f"read the server's log ({(st.get('online_server') or {}).get('log')}) and the trainer's "
                       f"(specops logs --run-id {run_id}) for why" if dropped else None),
                      detail={"checkpoint": where, "resumed_from": st.get("resumed_from"),
                              "regenerated": st.get("regenerated"), "states_run": st.get("states_run"),
                              "tokens_per_s": st.get("tokens_per_s"), "val_loss": st.get("val_loss"),
                              "val_accuracy": st.get("val_accuracy"), "wall_s": st.get("wall_s"), "memory": memory,
                              "online_stream": st.get("online_stream"), "kept_states": st.get("kept_states")})
    err = state.error
    status = "warn" if state.state == "aborted" else "fail"
    fix = None if status == "warn" else ((f"{err.fix}; then " if err and err.fix else "read the traceback (specops "
                                          f"logs --run-id {run_id}); fix the cause, then ") +
                                         "run the same train command again to resume")
    if err and err.type in NOTHING_LEARNED:  # a resume would go on from a useless draft
        fix = f"fix what the summary names, then train under a new --run-id (specops logs --run-id {run_id})"
    return Record(name="train.run", status=status,
                  summary=f"run {run_id} {state.state}: "
                          + (f"{err.type}: {err.message}" if err else "no error recorded") + used,
                  detail={"error": err.model_dump() if err else None, "memory": memory}, fix=fix)


def train(inventory: Inventory, selector: str | None, *, run_id: str | None, from_run: str | None, epochs: int = 1,
          dry_run: bool = False, detach: bool = False, force: bool = False, trainer_args: list[str] | None = None,
          regenerate: bool = False, regen_max_tokens=None, regen_temperature=None, gpus=None, total_seq_len=None,
          master_port=None, online: bool = False, stream_checks: dict | None = None, keep_states=None,
          server_on: str | None = None, server_port=None, tp=None,
          as_json: bool = False, accept_new_host_key: bool = False, algorithm: str | None = None) -> ExitCode:
    """Start (or resume) the train run, follow it, fetch what it wrote: on one host, or one run over every
    selected host (torchrun's nodes, the first host the head: :mod:`specops.trainnodes`)."""
    from specops.runid import check_run_id

    if not run_id:
        raise UsageError("--run-id is required", "name the train run (the same id re-attaches or resumes)")
    if not from_run:
        raise UsageError("--from-run is required", "name the finished extraction run whose states to train on")
    check_run_id(run_id)
    check_run_id(from_run)
    epochs = _train_flag("epochs", epochs)
    extra = trainer_argv(trainer_args)
    gpus = _train_flag("gpus", gpus)
    total_seq_len = _train_flag("total_seq_len", total_seq_len)
    regen = None
    if regenerate:
        regen = {"regen_max_tokens": _train_flag("regen_max_tokens", regen_max_tokens),
                 "regen_temperature": _train_flag("regen_temperature", regen_temperature)}
    elif regen_max_tokens is not None or regen_temperature is not None:
        raise UsageError("--regen-max-tokens and --regen-temperature set how the target writes its replies",
                         "add --regenerate, or drop them")
    master_port = _train_flag("master_port", master_port)
    # --online's own: speculators' checks of each streamed sample, and what stays on disk
    stream_checks = {k: _train_flag(k, v) for k, v in (stream_checks or {}).items() if v not in (None, "")}
    keep_states = _train_flag("keep_states", keep_states)
    if not online and (stream_checks or keep_states != TRAIN_ARGS["keep_states"].default):
        given = [*stream_checks, *(["keep_states"] if keep_states != TRAIN_ARGS["keep_states"].default else [])]
        raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in given)} set(s) how an online run streams "
                         f"its states", "add --online, or drop them")
    pool = HostPool(inventory, accept_new_host_key)
    hosts = {host.name: host for host in pool.selected(selector)}
    for host in hosts.values():  # before any host is reached: a Slurm host trains alone (slurm.nodes: its job spans them)
        slurm.refuse_train(host.spec, len(hosts))
    nodes = {}
    tp = int(tp) if tp not in (None, "") else None  # checked against RUN_ARGS' tp by the task (specops.params)
    if tp is not None and not online:
        raise UsageError(f"--tp {tp} sets the TP of an online run's extraction server", "add --online, or drop --tp")
    # host -> its half of a disaggregated run (the trainer's host first, then the server's: a replica's every host)
    halves = disagg_blocks(inventory, list(hosts), server_on, server_port, online=online,
                           regenerate=regen is not None, master_port=master_port, tp=tp)
    if halves:  # the server's host(s) join the run: they serve, the --on host trains
        hosts.update({name: pool.host(name) for name in halves if name not in hosts})
        behind = [name for name, host in hosts.items() if slurm.is_slurm(host.spec)]
        if behind:  # a half started there would run on the login node
            raise UsageError(f"--server-on: host(s) {', '.join(behind)} are behind Slurm (scheduler: slurm), and a "
                             f"disaggregated online run's halves are not submitted through Slurm",
                             "name hosts reached over SSH for both halves, or train online on the Slurm host alone "
                             "(--online without --server-on)")
    elif len(hosts) > 1:  # one run over every selected host: torchrun's nodes, the first host the head
        if online:
            raise UsageError("--online over several --on hosts: the trainer runs on one host, the server beside it "
                             "or on the host --server-on names", "train online on one host (--on HOST), with "
                             "--server-on SERVER_HOST to run the extraction server on another; or train over "
                             "several hosts offline")
        if regen is not None:
            raise UsageError("--regenerate runs on one host (the target's server writes the replies there)",
                             "regenerate on one host (--on HOST), or train over several hosts without it")
        nodes = trainnodes.node_blocks(inventory, list(hosts), master_port)
    elif master_port is not None:
        raise UsageError("--master-port is the rendezvous port of a training run over several hosts",
                         "drop it, or select several hosts (--on GROUP)")
    step = functools.partial(start_step, run_id=run_id, from_run=from_run, epochs=epochs, dry_run=dry_run, force=force,
                             trainer_args=extra, regenerate=regen, gpus=gpus, total_seq_len=total_seq_len,
                             online=online_params(stream_checks, keep_states) if online else False,
                             algorithm=algorithm, tp=tp)
    checked: dict[str, list[Record]] = {}
    if nodes:
        refused, checked = _nodes_preflight(inventory, hosts, nodes, step, run_id, as_json)
        if refused is not None:
            return refused
    if halves:
        refused, checked = disagg_preflight(inventory, hosts, halves, step, as_json)
        if refused is not None:
            return refused
    reports = run_on_hosts(inventory, ",".join(hosts), "train",
                           lambda h: step(hosts[h.name], nodes=nodes.get(h.name), online_server=halves.get(h.name)))
    for report in reports:  # the nodes' own checks (rendezvous, a checkpoint copied) before the start's
        report.records[:0] = checked.get(report.host, [])
    started = [r.host for r in reports if not r.failed]
    if (nodes or halves) and len(started) < len(hosts):  # a node or half that did not start: the other waits for it
        trainnodes.abort_nodes([hosts[n] for n in started], run_id)
        started = []
    if detach or not started:
        print_reports(reports, as_json=as_json)
        return max((r.exit_code for r in reports), default=ExitCode.SUCCESS)
    if not as_json:
        print_reports(reports)
        console.print(Text("Following train run ") + Text(run_id, style="bold")
                      + Text(f" on {', '.join(started)} (Ctrl-C detaches)"))
    shown: dict[str, tuple] = {}

    def on_event(name: str, event: dict) -> None:
        # a line when the state or epoch changes, else at most every PROGRESS_EVERY_S: a run of 10k steps
        # would otherwise print 10k lines
        if event["event"] != "status" or as_json:
            return
        st = event["status"]
        line, phase, now = progress_line(name, st), (st.get("state"), st.get("epoch")), time.monotonic()
        last = shown.get(name)
        if last is None or (phase != last[1] and line != last[0]) or (now - last[2] >= PROGRESS_EVERY_S
                                                                     and line != last[0]):
            shown[name] = (line, phase, now)
            err_console.print(line)

    ended: list[str] = []

    def on_result(name: str, result) -> None:
        # a node of a run over several hosts that ended without being done: the others go down with it
        ended.append(name)
        if (nodes or halves) and getattr(result, "state", None) != "done" and len(ended) == 1:
            trainnodes.abort_nodes([hosts[n] for n in started if n != name], run_id)

    try:
        final = hostjob.follow_many([(n, hosts[n], run_id) for n in started], on_event, on_result=on_result)
    except KeyboardInterrupt:
        for host in hosts.values():
            host.close()
        err_console.print(Text("\ndetached", style="yellow") + Text(
            f": train run {run_id} goes on. Re-attach: the same command; status: specops status --run-id {run_id}"))
        return ExitCode.JOB_RUNNING
    fetched = run_on_hosts(inventory, ",".join(started), "fetch",
                           lambda h: fetch_run(hosts[h.name], run_id))
    codes = []
    starts = {r.host: r for r in reports}
    for report in fetched:
        report.records[:0] = starts[report.host].records  # one report per host: the checks, the start, the end
        result = final[report.host]
        if isinstance(result, Exception):
            report.records.append(Record(name="train.run", status="fail", summary=f"lost the follow: {result}",
                                         fix="the run goes on; follow it again with the same command"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
            continue
        report.records.append(run_record(run_id, result))
        report.data["final_status"] = result.model_dump()
        codes.append(result.exit_code)
    lost = trainnodes.lost_node(ended, final) if nodes else None
    if lost is not None:  # the head's report says which node ended the run, and how to go on
        result = final[lost]
        why = (f"{result.error.type}: {result.error.message}" if getattr(result, "error", None)
               else str(result) if isinstance(result, Exception) else getattr(result, "state", "?"))
        head_report = next(r for r in fetched if r.host == started[0])
        head_report.records.append(Record(
            name="train.nodes", status="fail",
            summary=f"run {run_id} over {', '.join(started)} lost node {nodes[lost]['node_rank']} (host {lost}): "
                    f"{why.splitlines()[0][:300]}; the other nodes were stopped",
            detail={"lost": lost, "node_rank": nodes[lost]["node_rank"], "ended_in_order": ended},
            fix=f"bring {lost} back, then run the same train command: it resumes every node from the head's "
                f"last epoch checkpoint"))
    print_reports(fetched, as_json=as_json)
    if lost is not None:  # the run failed: the other nodes' "aborted" is the laptop's doing, not the run's end
        return ExitCode.JOB_FAILED
    return max(codes + [r.exit_code for r in fetched], default=ExitCode.SUCCESS)


def disagg_blocks(inventory: Inventory, selected: list[str], server_on, server_port, *, online: bool,
                  regenerate: bool, master_port, tp=None) -> dict[str, dict]:
    """``--server-on``: each host's ``online_server`` block of a disaggregated online run, by host (the trainer's
    host, then the server's; see :data:`remote.train.online.DISAGG_KEYS`); {} without it. The server host is reached
    at its replica address (``node_address``, else its address when that is an IP), as a replica's head is.

    ``--server-on`` names a host, or a replica of the inventory (``replicas:``): the server is then that replica,
    its head the API the trainer streams from, every host its ranks (each block adds its place,
    :func:`specops.replica.node_block`), at the replica's TP.

    :raises UsageError: naming the flag (or the inventory field) and the fix; nothing is started.
    """
    from specops import replica as replicas

    server_on = _train_flag("server_on", server_on)
    port = _train_flag("server_port", server_port)
    if server_on is None:
        if server_port not in (None, ""):
            raise UsageError("--server-port is the port of a disaggregated online run's server",
                             "add --online --server-on SERVER_HOST, or drop it")
        return {}
    if not online:
        raise UsageError(f"--server-on {server_on} places an online run's extraction server",
                         "add --online, or drop --server-on")
    if regenerate:
        raise UsageError("--regenerate runs on one host (the target's server writes the replies there)",
                         "drop --server-on, or drop --regenerate")
    if master_port is not None:
        raise UsageError("--master-port is the rendezvous of a training run over several hosts; a disaggregated "
                         "online run's trainer runs on one", "drop --master-port (--server-port sets the server's)")
    replica = inventory.replicas.get(server_on)
    if server_on not in inventory.hosts and replica is None:
        raise UsageError(f"--server-on {server_on!r} is not a host or a replica of {inventory.path}",
                         f"name one of its hosts ({', '.join(inventory.hosts)})"
                         + (f" or replicas ({', '.join(inventory.replicas)})" if inventory.replicas else ""))
    if len(selected) != 1:
        raise UsageError(f"--server-on with --on {', '.join(selected)}: a disaggregated online run's trainer runs "
                         f"on one host", "select the trainer's host alone (--on HOST)")
    trainer = selected[0]
    servers = list(replica.hosts) if replica is not None else [server_on]
    if trainer in servers:
        raise UsageError(f"--server-on {server_on} is the trainer's host too" if replica is None else
                         f"--server-on {server_on}: the trainer's host {trainer} is a host of replica {server_on} "
                         f"({', '.join(servers)})",
                         f"drop --server-on to run both halves on {trainer} (colocated), or name another host"
                         if replica is None else f"train on a host outside replica {server_on} (--on HOST), or "
                                                 f"name another replica or host")
    if replica is not None:  # its TP is the replica's (its ranks over its hosts): another --tp is refused
        tp = replicas.replica_overrides(inventory, replica.head, {"tp": tp})["tp"]
    address = inventory.hosts[servers[0]].replica_address  # a replica's hosts have theirs (the inventory's check)
    if address is None:
        raise UsageError(f"--server-on {server_on}: the trainer's host reaches the server at an IP address, and "
                         f"host {server_on}'s address {inventory.hosts[server_on].address!r} is a name",
                         f"set node_address of host {server_on} in {inventory.path} to the IP the trainer's host "
                         f"reaches it on")
    block = {"server_host": servers[0], "trainer_host": trainer, "address": address, "port": int(port),
             "watch_port": int(port) + 1}
    # the trainer's block names the replica (its error then names the host of it that failed); each server host's
    # block holds its place in it
    halves = {trainer: {"role": "trainer", **block,
                        **({"replica": {"name": replica.name, "hosts": servers}} if replica is not None else {})}}
    for host in servers:
        halves[host] = {"role": "server", **block}
        if replica is not None:
            halves[host]["replica"] = replicas.node_block(inventory, replica, host)
    return halves


def disagg_preflight(inventory: Inventory, hosts: dict[str, Host], halves: dict, step,
                     as_json: bool) -> tuple[ExitCode | None, dict[str, list[Record]]]:
    """A disaggregated online run, before either half starts: the train checks of every host at once, so the
    server host holds its address's ports while the trainer's host reaches them (``train.server_address``, as
    a replica's preflight checks its head's ports); a server that is a replica then gets the replica's own preflight
    (:func:`specops.replica.judge`: every host answered, versions, model, devices, its ports, clocks) on its head's
    report. The exit code of a refusal (its reports printed), else None; and the records each half's start report
    begins with, by host."""
    from specops import replica as replicas

    checks = run_on_hosts(inventory, ",".join(hosts), "train",
                          lambda h: step(hosts[h.name], online_server=halves[h.name], action="check"))
    added = {r.host: [x for x in r.records if x.name == "train.server_address"] for r in checks}
    head = next(iter(halves.values()))["server_host"]
    replica = inventory.replica_of(head) if any(b.get("replica") for b in halves.values()) else None
    if replica is not None and not any(r.failed for r in checks):
        found = replicas.judge(replica, replicas.probe_hosts(inventory, replica, lambda n: hosts[n], {}))
        report = next(r for r in checks if r.host == head)
        report.records += found
        added[head] += found
    if not any(r.failed for r in checks):
        return None, added
    failed = [r.host for r in checks if r.failed]
    _not_started(checks, "train.online", f"the disaggregated online run was not started: the checks of "
                                         f"{', '.join(failed)} failed (no half starts until every host can run)",
                 lambda report: "fix what the records above name (every host reads the states run --from-run "
                                "names, and the model), then run the same command again")
    print_reports(checks, as_json=as_json)
    return max(r.exit_code for r in checks), {}


def _not_started(checks: list[HostReport], name: str, summary: str, fix_of) -> None:
    """Record ``name`` on every host of a refused start: fail (``fix_of(report)``) where its checks failed,
    skipped on the others."""
    for report in checks:
        report.records.append(Record(name=name, status="fail" if report.failed else "skipped", summary=summary,
                                     fix=fix_of(report) if report.failed else None))


def _nodes_preflight(inventory: Inventory, hosts: dict[str, Host], nodes: dict, step, run_id: str,
                     as_json: bool) -> tuple[ExitCode | None, dict[str, list[Record]]]:
    """A run over several hosts, before any node starts: the train checks on every host, the rendezvous
    checks of the nodes (:func:`specops.trainnodes.preflight`), and the head's last checkpoint copied to the
    others for a resume. The exit code of a refusal (its reports printed), else None; and the records the nodes'
    start reports begin with, by host."""
    names = list(hosts)
    checks = run_on_hosts(inventory, ",".join(names), "train",
                          lambda h: step(hosts[h.name], nodes=nodes[h.name], action="check"))
    by_host = {r.host: r for r in checks}
    added: dict[str, list[Record]] = {name: [] for name in names}
    if not any(r.failed for r in checks):
        added[names[0]] = trainnodes.preflight(inventory, names, lambda n: hosts[n], nodes[names[0]]["master_port"])
        by_host[names[0]].records += added[names[0]]
    if any(r.failed for r in checks):
        failed = [r.host for r in checks if r.failed]
        _not_started(checks, "train.nodes", f"train run {run_id} over {', '.join(names)} not started: the checks of "
                                            f"{', '.join(failed)} failed (no node starts until every node can train)",
                     lambda report: f"each host trains on the states it reads: give {report.host} the states of the "
                                    f"run (an output_dir every host shares, or the states run copied into its "
                                    f"work_dir), or fix what the records above name")
        print_reports(checks, as_json=as_json)
        return max(r.exit_code for r in checks), {}
    for worker in names[1:]:
        copied = trainnodes.sync_checkpoint(hosts[names[0]], hosts[worker], run_id)
        if copied is not None:
            added[worker].append(copied)
    return None, added


#: what a train run's fetch writes beside ``metrics.jsonl``
METRICS_JSONL, METRICS_CSV, CURVE_PNG, BEST_DIR = "metrics.jsonl", "metrics.csv", "curve.png", "best"
#: the best checkpoint's small files fetched (the weights stay on the host, where ``eval`` serves them)
CHECKPOINT_FILES = ("config.json", "training_state.json", "val_metrics.json")
#: the dir speculators keeps its lowest-validation-loss checkpoint in, beside the numbered ones
SPECULATORS_BEST = "checkpoint_best"


def read_metrics(text: str) -> list[dict]:
    """The records of ``metrics.jsonl`` (one per trainer metrics line: ``kind`` train or val, ``epoch``,
    ``loss``, ``accuracy`` per position, train: ``step``, ``tokens_per_s``); a torn last line is skipped.

    A resumed run repeats the steps after its last checkpoint (and that epoch's validation): one record per
    train step and per validation epoch is kept, the last written (the attempt whose checkpoint went on)."""
    import json

    rows: dict = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") in ("train", "val"):
            key = (row["kind"], row.get("step") if row["kind"] == "train" else row.get("epoch"))
            rows.pop(key, None)  # the later record wins, in the place it was written
            rows[key] = row
    return list(rows.values())


def metrics_csv(rows: list[dict]) -> str:
    """One CSV row per metrics record: kind, epoch, step, loss, tokens/s, then acc_0..acc_{k-1}."""
    import csv
    import io

    width = max((len(r.get("accuracy") or []) for r in rows), default=0)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["kind", "epoch", "step", "loss", "tokens_per_s"] + [f"acc_{i}" for i in range(width)])
    for r in rows:
        acc = list(r.get("accuracy") or [])
        writer.writerow([r["kind"], r.get("epoch"), r.get("step", ""), r.get("loss"), r.get("tokens_per_s") or ""]
                        + acc + [""] * (width - len(acc)))
    return out.getvalue()


def best_epoch(rows: list[dict], last_epoch) -> tuple[int | None, str]:
    """The epoch whose checkpoint to keep: the lowest validation loss, else the last one; and why."""
    val = [r for r in rows if r["kind"] == "val" and r.get("loss") is not None]
    if val:
        best = min(val, key=lambda r: (r["loss"], -r["epoch"]))
        return best["epoch"], f"lowest validation loss {best['loss']:.4g} (epoch {best['epoch']})"
    return last_epoch, "the last epoch (no validation loss in the trainer's log)"


def draw_curve(rows: list[dict], path, title: str) -> str | None:
    """Loss and per-position accuracy against the step, as a PNG at ``path``; None, or why it was not drawn."""
    train = [r for r in rows if r["kind"] == "train" and r.get("step") is not None]
    if not train:
        return "no training step in the metrics yet"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a laptop's ssh session or in CI
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install 'specops[plot]'"
    steps = [r["step"] for r in train]
    fig, (loss_ax, acc_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    loss_ax.plot(steps, [r["loss"] for r in train], label="train loss")
    loss_ax.set_ylabel("loss")
    loss_ax.set_yscale("log")
    loss_ax.set_title(title)
    for pos in range(max(len(r.get("accuracy") or []) for r in train)):
        series = [r.get("accuracy") or [] for r in train]
        acc_ax.plot(steps, [acc[pos] if len(acc) > pos else None for acc in series], label=f"position {pos}")
    acc_ax.set_ylabel("accuracy")
    acc_ax.set_xlabel("step")
    acc_ax.legend(loc="lower right")
    loss_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def fetch_run(host: Host, run_id: str, tensors: bool = False) -> HostReport:
    """:func:`specops.runs.hostjob.fetch_run`, and for a train run its metrics, curve and best checkpoint's
    config (with ``tensors``: the best checkpoint's draft, servable as it lands in ``best/``)."""
    report = hostjob.fetch_run(host, run_id, tensors=tensors)
    if report.data.get("kind") == "train":
        dest = Path(report.data["dest"])
        from specops import wire

        status = wire.fsutil.read_json_quietly(dest / wire.contract.STATUS_FILE) or {}
        report.records += fetch_artifacts(host, report.data["run_dir"], dest, status)
        if tensors:
            report.records.append(fetch_draft(host, run_id, dest, report.records))
    return report


def fetch_artifacts(host: Host, run_dir: str, dest, status: dict) -> list[Record]:
    """A train run's ``metrics.jsonl`` with its CSV and curve, and the best checkpoint's config (``best/``)."""

    from specops import wire

    write, dest = wire.fsutil.atomic_write, Path(dest)
    data = hostjob.read_remote(host, f"{run_dir}/{METRICS_JSONL}")
    if data is None:
        return [Record(name="fetch.metrics", status="skipped", summary="the trainer has logged no metrics yet")]
    rows = read_metrics(data.decode("utf-8", "replace"))
    write(dest / METRICS_JSONL, data, mode=0o644)
    write(dest / METRICS_CSV, metrics_csv(rows).encode(), mode=0o644)
    why_not = draw_curve(rows, dest / CURVE_PNG, f"{status.get('run_id')}: loss and accuracy per step")
    steps = sum(r["kind"] == "train" for r in rows)
    records = [Record(name="fetch.metrics", status="ok" if why_not is None else "warn",
                      summary=f"{steps} step(s) in {METRICS_JSONL} and {METRICS_CSV}" + (
                          f", the curve in {CURVE_PNG}" if why_not is None else f"; no curve: {why_not}"),
                      detail={"files": [METRICS_JSONL, METRICS_CSV] + ([CURVE_PNG] if why_not is None else [])},
                      fix="pip install 'specops[plot]' and fetch again" if why_not else None)]
    final, save_path = status.get("checkpoint") or {}, status.get("checkpoints")
    if not final and not save_path:
        return records
    if final:
        epoch, why = best_epoch(rows, final.get("epoch"))
        candidates = [(f"{save_path}/{SPECULATORS_BEST}", "speculators' own checkpoint_best", None)] if save_path \
            else []
        if save_path and epoch is not None and final.get("epoch") is not None:
            candidates.append((f"{save_path}/{epoch}", why, epoch))
        candidates.append((str(final["path"]), "the last checkpoint", final.get("epoch")))
    else:  # still training (or stopped): the best so far, else the newest epoch checkpoint it saved
        going = f"run {status.get('state') or 'not done'}"
        candidates = [(f"{save_path}/{SPECULATORS_BEST}", f"speculators' checkpoint_best so far ({going})", None)]
        candidates += [(f"{save_path}/{e}", f"epoch {e}'s checkpoint, the newest so far ({going})", e)
                       for e in range(int(status.get("epoch") or 0), -1, -1)]
    for remote_ckpt, why, epoch in candidates:
        config = hostjob.read_remote(host, f"{host.remote_path(remote_ckpt)}/config.json")
        if config is not None:
            break
    else:
        if not final:  # no epoch saved yet: fetch --tensors says so
            return records
        records.append(Record(name="fetch.checkpoint", status="warn", summary=f"no checkpoint config.json found in "
                              f"{', '.join(c[0] for c in candidates)}", detail={"tried": [c[0] for c in candidates]}))
        return records
    (dest / BEST_DIR).mkdir(parents=True, exist_ok=True)
    _keep_or_write(dest / BEST_DIR / "config.json", config)
    got = ["config.json"]
    for name in CHECKPOINT_FILES[1:]:
        blob = hostjob.read_remote(host, f"{host.remote_path(remote_ckpt)}/{name}")
        if blob is not None:
            _keep_or_write(dest / BEST_DIR / name, blob)
            got.append(name)
    records.append(Record(name="fetch.checkpoint", status="ok",
                          summary=f"best checkpoint {remote_ckpt} ({why}): {', '.join(got)} in {BEST_DIR}/; the "
                                  f"weights stay on the host, where eval serves them (fetch --tensors brings them)",
                          detail={"path": remote_ckpt, "epoch": epoch, "why": why, "files": got}))
    return records


def _keep_or_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically unless it holds exactly that already (a kept file keeps its inode)."""
    from specops import wire

    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    wire.fsutil.atomic_write(path, data, mode=0o644)


#: a draft's files are hashed on the host (every byte digested): bounded, not unbounded
DRAFT_HASH_TIMEOUT_S = 1800.0


def fetch_draft(host: Host, run_id: str, dest, records: list[Record]) -> Record:
    """``fetch --tensors`` of a train run: the best checkpoint's draft (config.json + model.safetensors) into
    ``best/``, a dir ``vllm serve --speculative-config`` takes as it is.

    The checkpoint is the one :func:`fetch_artifacts` picked (its ``fetch.checkpoint`` record). One host call
    lists its files with sizes and digests (``remote/train/task.py`` ``files``); :func:`specops.runs.hostjob.download_files`
    brings them over SFTP: a file already here with that digest stays as it is, a partial ``.part`` resumes,
    each is checked before it takes its name.
    """
    import json

    dest = Path(dest)
    best = next((r for r in records if r.name == "fetch.checkpoint" and r.status == "ok"), None)
    if best is None:
        return Record(name="fetch.tensors", status="fail", summary=f"train run {run_id} has no checkpoint yet: no "
                      f"draft weights to fetch", fix=f"wait for its first epoch checkpoint (specops status --run-id "
                                                      f"{run_id}), then fetch --tensors again")
    payload = host.run_task("train", {"action": "files", "run_id": run_id, "work_dir": host.spec.work_dir,
                                      "checkpoint": best.detail["path"]}, timeout=DRAFT_HASH_TIMEOUT_S)
    listed = report_from_payload(host.name, "fetch", payload).records
    data = payload.get("data") or {}
    if not data.get("files"):
        why = listed[0] if listed else None
        return Record(name="fetch.tensors", status="fail",
                      summary=f"the host listed no draft files in {best.detail['path']}"
                              + (f": {why.summary}" if why else ""),
                      detail={"path": best.detail["path"]}, fix=why.fix if why and why.fix else
                      "fetch again; if it persists, look at the checkpoint dir on the host")
    local = dest / BEST_DIR
    local.mkdir(parents=True, exist_ok=True)
    before = {e["path"]: _inode(local / e["path"]) for e in data["files"]}
    done = hostjob.download_files(host, data["dir"], data["files"], local, name="fetch.tensors")
    names = [e["path"] for e in data["files"]]
    total = sum(int(e["bytes"]) for e in data["files"])
    kept = [n for n in names if before[n] is not None and before[n] == _inode(local / n)]
    detail = {**done.detail, "dir": str(local.resolve()), "host_dir": data["dir"], "files": data["files"],
              "kept": kept, "downloaded": [n for n in names if n not in kept] if done.status == "ok" else []}
    if done.status != "ok":
        return Record(name="fetch.tensors", status=done.status, summary=f"the draft of {data['dir']}: "
                      f"{done.summary}", detail=detail, fix=done.fix)
    # a former best's weights left beside these would be served with this config: only the listed ones stay
    stale = [p.name for p in local.glob("*.safetensors*") if p.name not in names and not p.name.endswith(".part")]
    for name in stale:
        (local / name).unlink()
    k = _speculative_tokens(local / "config.json")
    serve = json.dumps({"method": _serve_method(local / "config.json"), "model": str(local.resolve()),
                        "num_speculative_tokens": k})
    detail.update(stale_removed=stale, serve=f"vllm serve TARGET --speculative-config '{serve}'")
    return Record(name="fetch.tensors", status="ok",
                  summary=f"draft {data['dir']} ({best.detail.get('why')}) in {local}: {', '.join(names)} "
                          f"({total / 2**20:.1f} MiB), {wire.manifest.digest_names(data['files'])} "
                          f"checked; {len(kept)} kept, "
                          f"{len(names) - len(kept)} downloaded ({done.detail.get('resumed', 0)} resumed); serve "
                          f"it with --speculative-config '{serve}'", detail=detail)


def _inode(path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _serve_method(config_path) -> str:
    """vLLM's method for the draft's algorithm (its config's ``speculators_model_type``; eagle3 when it names none)."""
    import json

    from specops.wire import layers

    try:
        own = json.loads(config_path.read_text()).get("speculators_model_type")
    except (OSError, ValueError, AttributeError):
        own = None
    facts = layers.ALGORITHMS.get(own or layers.DEFAULT_ALGORITHM)
    return facts.method if facts else str(own)


def _speculative_tokens(config_path) -> int:
    """The draft's own number of speculative tokens (speculators' proposal method), else 3."""
    import json

    try:
        config = json.loads(config_path.read_text())
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
        return int(methods[0].get("speculative_tokens") or 3)
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return 3
