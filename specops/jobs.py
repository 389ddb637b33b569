"""Long jobs on a host, from any laptop with the inventory: status, logs, abort, fetch.

A run is named by its id; its state lives on the host (``<work_dir>/runs/<id>/``,
written by the job itself), so nothing here depends on the laptop that started it.
Exit codes follow the job (SkyPilot style): 0 done, 100 failed, 101 still running,
102 not found, 103 aborted.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import time
from pathlib import Path

from rich.table import Table

from specops.exit_codes import ExitCode
from specops.fleet import report_from_payload
from specops.host import Host
from specops.report import console
from specops.result import HostReport

#: small files fetched for every run, relative to the run dir.
RUN_FILES = ("params.json", "status.json", "manifest.json", "summary.json")
FINAL = ("done", "failed", "aborted")


def local_runs_root() -> Path:
    return Path(os.environ.get("SPECOPS_RUNS", "runs"))


def job_call(host: Host, action: str, run_id: str, **params) -> dict:
    """One ``remote/job.py`` verb on the host; returns the payload."""
    return host.run_task("job", {"action": action, "run_id": run_id, "work_dir": host.spec.work_dir,
                                 **params})


def job_state(payload: dict) -> str:
    """``done`` / ``failed`` / ... or ``missing`` when the host has no such run."""
    status = (payload.get("data") or {}).get("status")
    if not status:
        return "missing"
    return status.get("state") or "pending"


def status_report(host: Host, run_id: str) -> HostReport:
    payload = job_call(host, "status", run_id)
    report = report_from_payload(host.name, "status", payload)
    report.data["state"] = job_state(payload)
    return report


def job_exit_code(state: str) -> ExitCode:
    return ExitCode.from_job_state(state)


# -- fetching ----------------------------------------------------------------------

def read_remote(host: Host, path: str) -> bytes | None:
    """A small remote file's bytes (None when it does not exist); SFTP or a shell fallback."""
    host.open()
    if host.spec.delivery == "sftp":
        try:
            with host.cxn.sftp().open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
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


def fetch_run(host: Host, run_id: str, tensors: bool = False, dest_root: Path | None = None) -> HostReport:
    """Bring logs, status, params, manifest and summary into ``runs/<host>/<run-id>/``.

    With ``tensors``: every sample file too, resumed from a partial ``.part`` file and
    checked against the manifest's sha256.
    """
    payload = job_call(host, "status", run_id)
    if job_state(payload) == "missing":
        return report_from_payload(host.name, "fetch", payload)
    run_dir = host.remote_path(payload["data"]["run_dir"])
    dest = (dest_root or local_runs_root()) / host.name / run_id
    (dest / "logs").mkdir(parents=True, exist_ok=True)
    fetched = []
    for name in RUN_FILES:
        data = read_remote(host, f"{run_dir}/{name}")
        if data is not None:
            _write_atomic(dest / name, data)
            fetched.append(name)
    for sub in ("logs", "errors"):
        for name in list_remote(host, f"{run_dir}/{sub}"):
            data = read_remote(host, f"{run_dir}/{sub}/{name}")
            if data is not None:
                (dest / sub).mkdir(exist_ok=True)
                _write_atomic(dest / sub / name, data)
                fetched.append(f"{sub}/{name}")
    report = HostReport(host=host.name, task="fetch", data={"dest": str(dest), "files": fetched,
                                                            "state": job_state(payload)})
    report.records.append(_rec("fetch.run", "ok", f"{len(fetched)} file(s) of run {run_id} in {dest}",
                               {"files": fetched}))
    if tensors:
        report.records.append(fetch_tensors(host, dest))
    return report


def fetch_tensors(host: Host, dest: Path):
    manifest_path = dest / "manifest.json"
    if not manifest_path.exists():
        return _rec("fetch.tensors", "fail", "the run has no manifest yet: nothing to check tensors against",
                    {}, fix="wait for the run to finish (specops status), then fetch --tensors")
    manifest = json.loads(manifest_path.read_text())
    out_dir = host.remote_path(manifest["params"].get("output_dir") or "")
    (dest / "samples").mkdir(exist_ok=True)
    got, resumed, bad = 0, 0, []
    sftp = host.cxn.sftp()
    for entry in manifest["files"]:
        local = dest / "samples" / entry["path"]
        if local.exists() and _sha256(local) == entry["sha256"]:
            got += 1
            continue
        part = local.with_name(local.name + ".part")
        offset = part.stat().st_size if part.exists() else 0
        if offset > entry["bytes"]:
            part.unlink()
            offset = 0
        resumed += offset > 0
        with sftp.open(f"{out_dir}/{entry['path']}", "rb") as remote, open(part, "ab") as fh:
            remote.seek(offset)
            remote.prefetch()
            while chunk := remote.read(1 << 20):
                fh.write(chunk)
        if _sha256(part) != entry["sha256"]:
            bad.append(entry["path"])
            part.unlink()
            continue
        os.replace(part, local)
        got += 1
    if bad:
        return _rec("fetch.tensors", "fail", f"{len(bad)} sample file(s) do not match the manifest sha256",
                    {"bad": bad}, fix="fetch again; if it persists the files changed on the host after "
                                      "the manifest was written")
    return _rec("fetch.tensors", "ok", f"{got} sample file(s) verified by sha256 ({resumed} resumed)",
                {"files": got, "resumed": resumed, "dir": str(dest / "samples")})


def summary_table(summary: dict) -> Table:
    table = Table(title=f"summary of run {summary.get('run_id')} ({summary.get('samples')} samples, "
                        f"{summary.get('tokens')} tokens, {summary.get('tokens_per_s')} tok/s)",
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
    path = dest / "summary.json"
    if path.exists():
        console.print(summary_table(json.loads(path.read_text())))


# -- helpers -----------------------------------------------------------------------

def _rec(name, status, summary, detail, fix=None):
    from specops.result import Record

    return Record(name=name, status=status, summary=summary, detail=detail, fix=fix)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_final(host: Host, run_id: str, timeout: float, poll: float = 1.0) -> dict:
    """Poll until the run reaches a final state (for scripts and tests); returns the status."""
    deadline = time.monotonic() + timeout
    while True:
        payload = job_call(host, "status", run_id)
        state = job_state(payload)
        if state in FINAL or state == "missing" or time.monotonic() > deadline:
            return (payload.get("data") or {}).get("status") or {"state": state}
        time.sleep(poll)

