"""The devices of this machine as its tools print them: GPUs (``nvidia-smi``) and RAM (``/proc/meminfo``).

Two pure parsers over the text nvidia-smi prints for our exact query flags (:data:`GPU_QUERY`,
:data:`APPS_QUERY`), so the tests parse fixtures recorded on a real GPU host and the host
parses the live output the same way; the preflight's host probe (:mod:`remote.probes.host`),
a run's device check (:mod:`remote.extract.shard`) and a trainer's memory sampler read them::

    >>> parse_gpus("0, GPU-5c1e, 550.54.15, 143771, 0, 143176, 0, NVIDIA H200\\n")[0]["memory_free_mib"]
    143176
"""
from __future__ import annotations

import subprocess

#: Fields asked of ``--query-gpu``; ``name`` last because it is free text.
GPU_FIELDS = ("index", "uuid", "driver_version", "memory.total", "memory.used", "memory.free",
              "utilization.gpu", "name")
#: Fields asked of ``--query-compute-apps``; ``process_name`` last because it is a path.
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")
GPU_QUERY = ["nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits"]
APPS_QUERY = ["nvidia-smi", "--query-compute-apps=" + ",".join(APP_FIELDS),
              "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 20


def _value(text: str):
    """One nvidia-smi CSV cell: ``[N/A]``/``[Not Supported]`` -> None, numbers -> int/float."""
    text = text.strip()
    if not text or text.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "Insufficient Permissions"):
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _rows(text: str, fields) -> list:
    """Split CSV lines into dicts; the last field takes the rest of the line (it may hold ', ')."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split(",", len(fields) - 1)
        if len(cells) != len(fields):
            raise ValueError(f"nvidia-smi line has {len(cells)} fields, expected {len(fields)}: {line!r}")
        rows.append({f: _value(c) for f, c in zip(fields, cells)})
    return rows


def parse_gpus(text: str) -> list:
    """GPUs from ``nvidia-smi`` run with :data:`GPU_QUERY` (MiB, percent).

    :returns: one dict per GPU: index, uuid, name, driver, memory_total_mib,
        memory_used_mib, memory_free_mib, utilization_pct.
    :raises ValueError: on a line that does not have the fields asked for.
    """
    gpus = []
    for row in _rows(text, GPU_FIELDS):
        gpus.append({
            "index": row["index"], "uuid": row["uuid"], "name": row["name"],
            "driver": None if row["driver_version"] is None else str(row["driver_version"]),
            "memory_total_mib": row["memory.total"], "memory_used_mib": row["memory.used"],
            "memory_free_mib": row["memory.free"], "utilization_pct": row["utilization.gpu"],
        })
    return gpus


def parse_apps(text: str) -> list:
    """Processes holding GPU memory, from ``nvidia-smi`` run with :data:`APPS_QUERY`.

    An idle host prints nothing (or "No running processes found" on old drivers).
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lower().startswith("no running")]
    return [{"gpu_uuid": r["gpu_uuid"], "pid": r["pid"], "used_memory_mib": r["used_memory"],
             "process_name": r["process_name"]} for r in _rows("\n".join(lines), APP_FIELDS)]


def parse_meminfo(text: str) -> dict:
    """``/proc/meminfo`` -> ``{"MemTotal": bytes, ...}`` (the file counts in kB)."""
    info = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            info[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return info


def read_meminfo(path: str = "/proc/meminfo") -> dict:
    """:func:`parse_meminfo` of this machine's; raises ``OSError`` when it cannot be read."""
    with open(path) as fh:
        return parse_meminfo(fh.read())


def visible_gpus(gpus: list, cuda_visible_devices) -> list:
    """The GPUs a job sees under ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes), in its order."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen = []
    for token in (t.strip() for t in str(cuda_visible_devices).split(",")):
        if not token:
            continue
        match = [g for g in gpus if str(g["index"]) == token
                 or (g["uuid"] and str(g["uuid"]).startswith(token))]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        chosen.append(match[0])
    return chosen


def _run_smi(argv):
    """(stdout, error text or None) of one nvidia-smi call; never raises."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "", f"{argv[0]} did not answer in {NVIDIA_SMI_TIMEOUT_S} s (driver hung?)"
    except OSError as exc:
        return "", f"{argv[0]}: {exc}"
    if proc.returncode != 0:
        return proc.stdout, (proc.stdout + proc.stderr).strip() or f"exit code {proc.returncode}"
    return proc.stdout, None


def compute_apps(smi: str) -> tuple[list, str | None]:
    """(:func:`parse_apps` rows, error text or None) of one ``--query-compute-apps`` call; never raises."""
    text, err = _run_smi([smi] + APPS_QUERY[1:])
    if err:
        return [], err
    try:
        return parse_apps(text), None
    except ValueError as exc:
        return [], f"cannot parse nvidia-smi output: {exc}"


def query_nvidia_smi(smi: str) -> dict:
    """Run both queries with the nvidia-smi at ``smi``; raw text is kept for the record."""
    gpu_text, gpu_err = _run_smi([smi] + GPU_QUERY[1:])
    apps_text, apps_err = ("", None) if gpu_err else _run_smi([smi] + APPS_QUERY[1:])
    result = {"gpu_text": gpu_text, "apps_text": apps_text, "error": gpu_err, "apps_error": apps_err,
              "gpus": [], "apps": []}
    if not gpu_err:
        try:
            result["gpus"] = parse_gpus(gpu_text)
            result["apps"] = parse_apps(apps_text) if not apps_err else []
        except ValueError as exc:
            result["error"] = f"cannot parse nvidia-smi output: {exc}"
    return result
