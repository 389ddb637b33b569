"""Long jobs on a host, from any laptop with the inventory: status, follow, logs, abort, fetch.

A run is named by its id; its state lives on the host (``<work_dir>/runs/<id>/``,
written by the job itself), so nothing here depends on the laptop that started it.
Exit codes follow the job (SkyPilot style): 0 done, 100 failed, 101 still running,
102 not found, 103 aborted.

Following a run costs one python on the host for the whole follow, not one per look:
:func:`follow_run` starts ``remote/run/job.py``'s ``follow`` verb over one SSH channel and
reads the events it prints (status changes, new log lines, heartbeats) as they come.
Closing the channel (Ctrl-C, a dropped connection) ends that python at once; the run,
detached from SSH, goes on.

    >>> final = follow_run(host, "r1", on_event=print)
    {'event': 'hello', 'pid': 4242, ...}
    {'event': 'status', 'status': {'state': 'loading', ...}}
    ...
    >>> final.state, final.exit_code
    ('done', <ExitCode.SUCCESS: 0>)
"""
from __future__ import annotations

import base64
import json
import os
import queue
import re
import shlex
import socket
import threading
from pathlib import Path
from typing import Callable

from rich.table import Table
from rich.text import Text

from specops import wire
from specops.errors import UnreachableError
from specops.exit_codes import ExitCode
from specops.report import console
from specops.result import HostReport, Record, RunStatus
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload

#: small files fetched for every run, relative to the run dir, and the subdirs fetched whole (logs,
#: errors, the canary's prompt logprobs and records).
RUN_FILES, RUN_DIRS = wire.contract.RUN_FILES, wire.contract.RUN_DIRS
#: a data-parallel replica's dir under a run's logs/ (remote/extract/layout.py)
REPLICA_DIR = re.compile(r"dp[0-9]+")
#: the follower says something at least this often (seconds) ...
FOLLOW_HEARTBEAT_S = 2.0
#: ... so this long without a word from it means the connection is gone.
FOLLOW_SILENCE_S = 30.0
#: a read from the host that hears nothing for this long is given up (the host hangs).
DOWNLOAD_IDLE_S = 120.0


def local_runs_root() -> Path:
    return Path(os.environ.get("SPECOPS_RUNS", "runs"))


def job_call(host: Host, action: str, run_id: str, *, timeout: float | None = None, **params) -> dict:
    """One ``remote/run/job.py`` verb on the host; returns the payload (``timeout``: seconds for the remote python).

    A start on a host behind Slurm carries its slurm mapping: the job task submits the run (sbatch)."""
    if action == "start":
        from specops import slurm

        params = {**slurm.job_params(host.spec), **params}
    return host.run_task("job", {"action": action, "run_id": run_id, "work_dir": host.spec.work_dir,
                                 **params}, timeout=timeout)


def run_state(host: Host, run_id: str) -> RunStatus:
    """The run's state now (``missing`` when the host has no such run); one look."""
    return RunStatus.from_payload(job_call(host, "status", run_id))


def status_report(host: Host, run_id: str) -> HostReport:
    payload = job_call(host, "status", run_id)
    report = report_from_payload(host.name, "status", payload)
    report.data["state"] = RunStatus.from_payload(payload).state
    return report


def canary_record(name: str, state: RunStatus) -> Record | None:
    """The record that shows what a finished run's canary found (its status file's ``canary``, written by
    the host's ``remote.verify.canary.summarize``); None for an engine without a canary."""
    found = (state.model_extra or {}).get("canary")
    if not isinstance(found, dict):
        return None
    status = found.get("shown") or "warn"  # the host's remote.verify.canary.SHOWN_AS
    return Record(name=name, status=status, summary=f"canary {found.get('summary')}", detail=found,
                  fix=f"specops verify --run-id {state.run_id} --reference logits" if status == "warn" else None)


def job_exit_code(state: str) -> ExitCode:
    return ExitCode.from_job_state(state)


# -- following -----------------------------------------------------------------------

def follow_run(host: Host, run_id: str, on_event: Callable[[dict], None] | None = None, *,
               logs: bool = False, offsets: dict | None = None, until: str = "final",
               timeout: float | None = None, poll_s: float = 0.5) -> RunStatus:
    """Follow one run until it is final, over one channel with one python on the host.

    :param on_event: gets each event dict as it arrives: ``hello`` (the follower's pid),
        ``status`` (``event["status"]`` is the new status), ``log`` (``file``, ``text``,
        ``next_offset``; whole lines), ``heartbeat``.
    :param logs: also stream new log lines (the last 16 KiB of each log first, unless
        ``offsets`` says where to go on from).
    :param until: ``final``, or ``exited``: final and the supervisor gone (a done
        supervisor still closing its engine would make a next run on the host wait).
    :param timeout: stop following after this many seconds; the state then is not final.
    :returns: the last state; ``missing`` when the host has no such run.
    :raises UnreachableError: the connection dropped (the run goes on).
    """
    def on_line(text: str) -> None:
        if on_event is not None:
            on_event(json.loads(text))

    params = {"action": "follow", "run_id": run_id, "work_dir": host.spec.work_dir, "logs": logs,
              "offsets": offsets, "until": until, "timeout_s": timeout, "poll_s": poll_s,
              "heartbeat_s": FOLLOW_HEARTBEAT_S}
    # the event marker comes from the file the follower prints it with
    payload = host.stream_task("job", params, on_line, prefix=wire.protocol.JOB_EVENT_PREFIX,
                               idle_timeout=FOLLOW_SILENCE_S)
    return RunStatus.from_payload(payload)


def follow_runs(hosts: list[Host], run_id: str, on_event: Callable[[str, dict], None], **options
                ) -> dict[str, RunStatus | Exception]:
    """Follow the run on every host at once; one channel and one remote python per host.

    ``on_event(host_name, event)`` runs in the caller's thread, so it may draw on the
    terminal; a host whose follow fails (unreachable, no result) maps to its exception
    instead of a state, and the others go on. Options are :func:`follow_run`'s.

    :raises KeyboardInterrupt: passed through at once; the caller detaches by closing
        the hosts, which ends every follower on them.
    """
    return follow_many([(host.name, host, run_id) for host in hosts], on_event, **options)


def follow_many(targets: list[tuple[str, Host, str]], on_event: Callable[[str, dict], None],
                on_result: Callable[[str, RunStatus | Exception], None] | None = None, **options
                ) -> dict[str, RunStatus | Exception]:
    """Follow several runs at once, each named by a key: ``(key, host, run_id)`` triples.

    What :func:`follow_runs` does for one run id on many hosts, for any runs (the
    shards of a group run, which may differ in run id and share a host).
    ``on_result(key, state_or_error)`` is called, in the caller's thread, the moment one
    follow ends, so a lost host can be shown while the others are still followed.
    """
    events: queue.Queue = queue.Queue()

    def follow_one(key: str, host: Host, run_id: str) -> None:
        try:
            events.put((key, follow_run(host, run_id, lambda e: events.put((key, e)), **options)))
        except Exception as exc:  # noqa: BLE001 -- handed to the caller as this run's result
            events.put((key, exc))

    for key, host, run_id in targets:
        threading.Thread(target=follow_one, args=(key, host, run_id), daemon=True, name=f"follow-{key}").start()
    results: dict[str, RunStatus | Exception] = {}
    while len(results) < len(targets):
        try:
            key, item = events.get(timeout=0.5)  # a timeout keeps Ctrl-C deliverable here
        except queue.Empty:
            continue
        if isinstance(item, dict):
            on_event(key, item)
        else:
            results[key] = item
            if on_result is not None:
                on_result(key, item)
    return results


# -- fetching ----------------------------------------------------------------------

def _silent(host: Host, what: str) -> UnreachableError:
    return UnreachableError(f"no data from the host for {DOWNLOAD_IDLE_S:.0f}s while {what}",
                            "check the host and the network; fetch again to resume where it stopped", host=host.name)


def read_remote(host: Host, path: str) -> bytes | None:
    """A small remote file's bytes (None when it does not exist); SFTP or a shell fallback."""
    host.open()
    if host.spec.delivery == "sftp":
        try:
            with host.cxn.sftp().open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except socket.timeout:
            raise _silent(host, f"reading {path}") from None
    result = host.run(f"test -f {shlex.quote(path)} && base64 < {shlex.quote(path)}")
    return base64.b64decode(result.stdout) if result.ok else None


def list_remote(host: Host, directory: str) -> list[str]:
    host.open()
    if host.spec.delivery == "sftp":
        try:
            return sorted(host.cxn.sftp().listdir(directory))
        except FileNotFoundError:
            return []
    result = host.run(f"ls -1A -- {shlex.quote(directory)} 2>/dev/null")
    return sorted(result.stdout.splitlines()) if result.ok else []


def fetch_run(host: Host, run_id: str, tensors: bool = False, dest_root: Path | None = None,
              timeout: float | None = None) -> HostReport:
    """Bring logs, status, params, manifest, summary and the canary's ``prompt_logprobs/`` into ``runs/<host>/<run-id>/``.

    With ``tensors``: every sample file too, resumed from a partial ``.part`` file and
    checked against the manifest's digest (BLAKE3, or an older run's sha256). ``timeout``
    bounds the look at the run's state; reads stop after :data:`DOWNLOAD_IDLE_S` of
    silence from the host.
    """
    payload = job_call(host, "status", run_id, timeout=timeout)
    if host.spec.delivery == "sftp":
        host.cxn.sftp().get_channel().settimeout(DOWNLOAD_IDLE_S)
    state = RunStatus.from_payload(payload)
    if not state.found:
        return report_from_payload(host.name, "fetch", payload)
    run_dir = host.remote_path(state.run_dir)
    dest = (dest_root or local_runs_root()) / host.name / run_id
    (dest / "logs").mkdir(parents=True, exist_ok=True)
    fetched = []
    for name in RUN_FILES:
        data = read_remote(host, f"{run_dir}/{name}")
        if data is not None:
            wire.fsutil.atomic_write(dest / name, data, mode=0o644)
            fetched.append(name)
    for sub in RUN_DIRS:
        names = list_remote(host, f"{run_dir}/{sub}")
        # a data-parallel replica's logs sit in a dir of their own (logs/dp1/server.log)
        names += [f"{name}/{inner}" for name in names if REPLICA_DIR.fullmatch(name)
                  for inner in list_remote(host, f"{run_dir}/{sub}/{name}")]
        for name in names:
            if REPLICA_DIR.fullmatch(name):
                continue
            data = read_remote(host, f"{run_dir}/{sub}/{name}")
            if data is not None:
                (dest / sub / name).parent.mkdir(parents=True, exist_ok=True)
                wire.fsutil.atomic_write(dest / sub / name, data, mode=0o644)
                fetched.append(f"{sub}/{name}")
    status = wire.fsutil.read_json_quietly(dest / wire.contract.STATUS_FILE) or {}
    report = HostReport(host=host.name, task="fetch", data={"dest": str(dest), "files": fetched,
                                                            "state": state.state, "run_dir": run_dir,
                                                            "kind": status.get("kind") or "extract"})
    report.records.append(_rec("fetch.run", "ok", f"{len(fetched)} file(s) of run {run_id} in {dest}",
                               {"files": fetched}))
    if tensors and report.data["kind"] != "train":  # a train run has no sample files (specops.train.fetch_run)
        report.records.append(fetch_tensors(host, dest))
    return report


def fetch_tensors(host: Host, dest: Path):
    manifests = wire.manifest
    try:
        manifest = manifests.read(dest / wire.contract.MANIFEST, manifests.FOR_FETCH)
    except FileNotFoundError:
        return _rec("fetch.tensors", "fail", "the run has no manifest yet: nothing to check tensors against",
                    {}, fix="wait for the run to finish (specops status), then fetch --tensors")
    except manifests.ManifestError as exc:
        return _rec("fetch.tensors", "fail", f"the run's manifest cannot be used: {exc}", {"field": exc.field},
                    fix="the manifest was not written by this specops: re-run the extraction")
    out_dir = host.remote_path(manifest["params"].get("output_dir") or "")
    entries = list(manifest["files"])
    if manifest.get("dataset_files"):
        # an hs run's token dataset (what speculators trains on beside the samples); the manifest names
        # its files, the host hashes them, so they are checked like the samples
        listing = host.run_task("shard", {"action": "files", "output_dir": out_dir, "start": 0, "stop": 0})
        entries += (listing.get("data") or {}).get("dataset_files") or []
    return download_files(host, out_dir, entries, dest / "samples")


def download_files(host: Host, remote_dir: str, entries: list[dict], local_dir: Path, name: str = "fetch.tensors"):
    """Bring ``entries`` (``path``, ``bytes``, a digest) from ``remote_dir`` into ``local_dir``; one record.

    A file already there with the right digest is kept; a partial ``.part`` file is
    resumed where it stopped; every file is checked against its entry's digest, in that
    entry's algorithm (:func:`remote.wire.manifest.file_matches`), before it takes its name. A
    BLAKE3 digest on a laptop without ``blake3`` fails before anything is fetched, naming the
    fix. A host silent for :data:`DOWNLOAD_IDLE_S` ends the download with an error.
    """
    schema, fsutil = wire.manifest, wire.fsutil
    hashes = schema.digest_names(entries)
    bare = [e["path"] for e in entries if schema.entry_digest(e) is None]
    if bare:
        return _rec(name, "fail", f"{len(bare)} file(s) have no digest to check them by ({', '.join(bare[:3])})",
                    {"bare": bare}, fix="fetch again once the run has finished (its manifest lists them)")
    try:
        for algorithm in {schema.entry_digest(e)[0] for e in entries}:
            fsutil.new_hasher(algorithm)
    except fsutil.HashUnavailable as exc:
        return _rec(name, "fail", f"this python cannot check the manifest's {exc.name} digests", {"hash": exc.name},
                    fix=exc.fix)
    local_dir.mkdir(parents=True, exist_ok=True)
    got, resumed, bad = 0, 0, []
    host.open()
    sftp = host.cxn.sftp()
    sftp.get_channel().settimeout(DOWNLOAD_IDLE_S)
    for entry in entries:
        local = local_dir / entry["path"]  # a path may name a subdir (hidden_states/hs_3.safetensors)
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.exists() and schema.file_matches(local, entry):
            got += 1
            continue
        part = local.with_name(local.name + ".part")
        offset = part.stat().st_size if part.exists() else 0
        if offset > entry["bytes"]:
            part.unlink()
            offset = 0
        resumed += offset > 0
        # a resumed .part that then fails the check may be junk of its own (not a prefix of
        # the file): it is dropped and the file fetched once more, whole
        for offset in ([offset, 0] if offset else [0]):
            if offset == 0:
                part.unlink(missing_ok=True)
            try:
                with sftp.open(f"{remote_dir}/{entry['path']}", "rb") as remote, open(part, "ab") as fh:
                    remote.seek(offset)
                    remote.prefetch()
                    while chunk := remote.read(1 << 20):
                        fh.write(chunk)
            except socket.timeout:
                raise _silent(host, f"downloading {entry['path']} ({got} of {len(entries)} done)") from None
            if schema.file_matches(part, entry):
                break
        else:
            bad.append(entry["path"])
            part.unlink()
            continue
        os.replace(part, local)
        got += 1
    if bad:
        return _rec(name, "fail", f"{len(bad)} sample file(s) do not match the manifest {hashes}",
                    {"bad": bad}, fix="fetch again; if it persists the files changed on the host after "
                                      "the manifest was written")
    return _rec(name, "ok", f"{got} sample file(s) verified by {hashes} ({resumed} resumed)",
                {"files": got, "resumed": resumed, "dir": str(local_dir)})


def summary_table(summary: dict) -> Table:
    table = Table(title=Text(f"summary of run {summary.get('run_id')} ({summary.get('samples')} samples, "
                             f"{summary.get('tokens')} tokens, {summary.get('tokens_per_s')} tok/s, "
                             f"{summary.get('state_format') or wire.contract.BF16} states)"),
                  title_justify="left")
    for col in ("layer", "shape", "dtype", "mean", "std", "abs max", "NaN", "Inf"):
        table.add_column(col, justify="right")
    for layer in summary.get("layers", []):
        bad = layer["nan"] or layer["inf"]
        style = "bold red" if bad else None
        table.add_row(str(layer["layer_id"]), "x".join(map(str, layer["shape"])), layer["dtype"],
                      f"{layer['mean']:.4g}", f"{layer['std']:.4g}", f"{layer['abs_max']:.4g}",
                      str(layer["nan"]), str(layer["inf"]), style=style)
    return table


def show_summary(dest: Path) -> None:
    path = dest / wire.contract.SUMMARY
    if path.exists():
        console.print(summary_table(json.loads(path.read_text())))


# -- helpers -----------------------------------------------------------------------

def _rec(name, status, summary, detail, fix=None):
    from specops.result import Record

    return Record(name=name, status=status, summary=summary, detail=detail, fix=fix)




def wait_final(host: Host, run_id: str, timeout: float) -> RunStatus:
    """Wait until the run is final (for scripts); returns its state, not final after ``timeout``."""
    return follow_run(host, run_id, timeout=timeout)
