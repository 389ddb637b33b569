"""Host probe: python, OS, CPUs, RAM, GPUs (nvidia-smi), CPU-engine needs, free disk, writable dirs.

What nvidia-smi and /proc/meminfo print is read by :mod:`remote.system.devices`; this module
judges it.
"""
from __future__ import annotations

import errno
import os
import platform
import shutil
import socket
import sys
import tempfile

from remote.probes import Context, nearest_existing
from remote.run import slurm
from remote.system import cpu
from remote.system.devices import query_nvidia_smi, read_meminfo, visible_gpus
from remote.wire.contract import VLLM_SERVER
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import GiB, MiB, human_bytes

#: memory.used above this on a GPU with no listed process means someone we cannot see
#: (another container, a PID namespace) holds it.
HIDDEN_USE_MIB = 1024

#: vLLM's CPU builds need AVX2 at least; AVX2 alone is enough (they run on AVX2-only AMD EPYC).
CPU_ISA_FLAGS = ("avx512f", "avx2")
#: what the vllm-server engine sets VLLM_CPU_KVCACHE_SPACE to when the host's env does not.
SERVER_KVCACHE_GIB = 1
#: the vllm-server engine's server listens here only, on a port it picks free itself.
LOOPBACK = "127.0.0.1"


def probe(ctx: Context) -> list:
    """Run every host check; leaves the facts in ``ctx.host``."""
    records = [_python(ctx), _os(ctx), _cpus(ctx), _ram(ctx)]
    node = slurm.node_record("host.node", "checks")  # preflight of a host behind Slurm runs under srun: say where
    if node is not None:
        records.append(node)
    records += _gpus(ctx)
    if ctx.params["device"] == "cpu":
        records += _cpu_engine(ctx)
    records += _disks(ctx)
    records += _writable(ctx)
    if ctx.params["engine"] == VLLM_SERVER:
        records.append(_loopback(ctx))
    return records


def summarize_gpu_use(gpus: list, apps: list) -> list:
    """Per GPU, who already holds memory: listed processes, or memory used by someone unseen."""
    busy = []
    for gpu in gpus:
        procs = [a for a in apps if a["gpu_uuid"] == gpu["uuid"]]
        used = gpu["memory_used_mib"] or 0
        if procs or used > HIDDEN_USE_MIB:
            busy.append({"index": gpu["index"], "memory_used_mib": used,
                         "processes": [{k: p[k] for k in ("pid", "process_name", "used_memory_mib")}
                                       for p in procs]})
    return busy


# -- checks ---------------------------------------------------------------------------------

def _python(ctx):
    ver = sys.version_info
    facts = {"version": platform.python_version(), "executable": sys.executable,
             "implementation": platform.python_implementation()}
    ctx.host["python"] = facts
    if (ver.major, ver.minor) < (3, 10):
        return record("host.python", FAIL, f"python {facts['version']} is too old for vLLM 0.16",
                      detail=facts, fix="point the inventory's python at an env with python 3.10-3.13")
    return record("host.python", OK, f"python {facts['version']} at {sys.executable}", detail=facts)


def _os(ctx):
    uname = platform.uname()
    facts = {"system": uname.system, "release": uname.release, "machine": uname.machine,
             "hostname": uname.node, "platform": platform.platform()}
    try:
        with open("/etc/os-release") as fh:
            rel = dict(line.rstrip("\n").split("=", 1) for line in fh if "=" in line)
        facts["distro"] = rel.get("PRETTY_NAME", "").strip('"')
    except OSError:
        pass
    ctx.host["os"] = facts
    if uname.system != "Linux":
        return record("host.os", FAIL, f"{uname.system} host: vLLM runs on Linux only", detail=facts,
                      fix="run extraction on a Linux host")
    return record("host.os", OK, f"{facts.get('distro') or uname.system} {uname.release} {uname.machine}",
                  detail=facts)


def _cpus(ctx):
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    flags = set(cpu.read_cpuinfo()["flags"])
    facts = {"count": os.cpu_count(), "usable": usable,
             "isa": [f for f in CPU_ISA_FLAGS if f in flags]}
    ctx.host["cpus"] = facts
    return record("host.cpus", OK, f"{usable} usable of {facts['count']} CPUs"
                  + (f" ({', '.join(facts['isa'])})" if facts["isa"] else ""), detail=facts)


def _ram(ctx):
    try:
        info = read_meminfo()
    except OSError as exc:
        ctx.host["ram"] = {}
        return record("host.ram", WARN, f"cannot read /proc/meminfo: {exc}", detail={})
    facts = {"total_bytes": info.get("MemTotal"),
             "available_bytes": info.get("MemAvailable", info.get("MemFree"))}
    ctx.host["ram"] = facts
    return record("host.ram", OK, f"RAM {human_bytes(facts['available_bytes'])} available of "
                  f"{human_bytes(facts['total_bytes'])}", detail=facts)


def _gpus(ctx) -> list:
    device = ctx.params["device"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        ctx.host["gpus"] = []
        ctx.host["visible_gpus"] = []
        if device == "cuda":
            return [record("host.gpus", FAIL, "device=cuda but nvidia-smi is not on PATH",
                           detail={"PATH": os.environ.get("PATH")},
                           fix="install the NVIDIA driver (nvidia-smi) or set device: cpu for this host")]
        return [record("host.gpus", OK, "device=cpu: no GPUs used (no nvidia-smi on this host)",
                       detail={"device": "cpu"})]
    smi_out = query_nvidia_smi(smi)
    gpus = smi_out["gpus"]
    cvd = ctx.env("CUDA_VISIBLE_DEVICES")
    visible = visible_gpus(gpus, cvd)
    ctx.host["gpus"] = gpus
    ctx.host["visible_gpus"] = visible
    detail = {"nvidia_smi": smi, "gpus": gpus, "CUDA_VISIBLE_DEVICES": cvd,
              "visible": [g["index"] for g in visible]}
    if smi_out["error"]:
        detail["error"] = smi_out["error"]
        if device == "cuda":
            return [record("host.gpus", FAIL, f"nvidia-smi failed: {smi_out['error']}", detail=detail,
                           fix="check the driver with `nvidia-smi` on the host (a reboot or driver "
                               "reinstall is often needed), or set device: cpu")]
        return [record("host.gpus", OK, "device=cpu: nvidia-smi present but not answering; GPUs unused",
                       detail=detail)]
    if device == "cpu":
        return [record("host.gpus", OK, f"device=cpu: {len(gpus)} GPU(s) present but not used",
                       detail=detail)]
    if not visible:
        why = f"CUDA_VISIBLE_DEVICES={cvd!r} hides them all" if gpus and cvd is not None else "none found"
        return [record("host.gpus", FAIL, f"device=cuda but no usable GPU: {why}", detail=detail,
                       fix="fix CUDA_VISIBLE_DEVICES in the inventory env" if gpus else
                           "check the driver with `nvidia-smi`, or set device: cpu")]
    names = sorted({g["name"] for g in visible})
    total = min(g["memory_total_mib"] or 0 for g in visible)
    free = min(g["memory_free_mib"] or 0 for g in visible)
    records = [record("host.gpus", OK, f"{len(visible)} x {'/'.join(map(str, names))}, "
                      f"{human_bytes(total * MiB)} each, min free {human_bytes(free * MiB)}, "
                      f"driver {visible[0]['driver']}", detail=detail)]
    busy = summarize_gpu_use(visible, smi_out["apps"])
    if smi_out["apps_error"]:
        records.append(record("host.gpu_processes", WARN,
                              f"cannot list GPU processes: {smi_out['apps_error']}",
                              detail={"error": smi_out["apps_error"]}))
    elif busy:
        pids = sorted({p["pid"] for b in busy for p in b["processes"]})
        records.append(record(
            "host.gpu_processes", WARN,
            f"GPU(s) {', '.join(str(b['index']) for b in busy)} already hold memory"
            + (f" (pids {', '.join(map(str, pids))})" if pids else " (processes not visible here)"),
            detail={"busy": busy},
            fix="stop those processes, or pick free GPUs with CUDA_VISIBLE_DEVICES"))
    else:
        records.append(record("host.gpu_processes", OK, "no process holds GPU memory",
                              detail={"busy": []}))
    return records


def _cpu_engine(ctx) -> list:
    """What vLLM's CPU build needs: AVX2, a KV-cache size, thread binding at TP>1."""
    records = []
    isa = ctx.host["cpus"]["isa"]
    if not isa:
        records.append(record("host.cpu_isa", FAIL, "CPU has no AVX2: vLLM's CPU build cannot run",
                              detail={"flags_checked": list(CPU_ISA_FLAGS)},
                              fix="use a host whose CPU has AVX2 or AVX-512"))
    else:
        records.append(record("host.cpu_isa", OK, f"CPU engine ISA: {', '.join(isa)}", detail={"isa": isa}))

    raw = ctx.env("VLLM_CPU_KVCACHE_SPACE")
    ram = ctx.host.get("ram", {})
    avail = ram.get("available_bytes")
    tp = ctx.params["tp"]
    # a host of a replica over several hosts runs its share of the ranks (remote/extract/replica.py): the KV cache
    # and the thread binding are this host's ranks', not the whole TP's
    local = int((ctx.params.get("replica") or {}).get("ranks_per_node") or tp)
    ranks_here = f"TP={tp}" if local == tp else f"{local} rank(s) of TP={tp} on this host"
    server = ctx.params["engine"] == VLLM_SERVER
    if raw is None and server:
        # the engine's server_env gives its server 1 GiB: one prefill per request needs little
        kv_bytes = SERVER_KVCACHE_GIB * GiB
        ctx.host["cpu_kvcache_bytes"] = kv_bytes
        records.append(record(
            "host.cpu_kvcache", OK, f"VLLM_CPU_KVCACHE_SPACE not set: the vllm-server engine gives its server "
            f"{SERVER_KVCACHE_GIB} GiB per rank", detail={"VLLM_CPU_KVCACHE_SPACE": None,
                                                         "engine_default_bytes_per_rank": kv_bytes}))
    elif raw is None:
        # vLLM then takes half of RAM (per NUMA node) for KV cache, per rank.
        kv_bytes = (ram.get("total_bytes") or 0) // 2
        ctx.host["cpu_kvcache_bytes"] = kv_bytes
        records.append(record(
            "host.cpu_kvcache", WARN,
            f"VLLM_CPU_KVCACHE_SPACE is not set: vLLM takes half of RAM ({human_bytes(kv_bytes)}) per rank",
            detail={"VLLM_CPU_KVCACHE_SPACE": None, "assumed_bytes_per_rank": kv_bytes},
            fix="set VLLM_CPU_KVCACHE_SPACE (GiB, e.g. 1) in the host's env in the inventory"))
    else:
        try:
            kv_bytes = int(raw) * GiB
        except ValueError:
            ctx.host["cpu_kvcache_bytes"] = 0
            records.append(record("host.cpu_kvcache", FAIL, f"VLLM_CPU_KVCACHE_SPACE={raw!r} is not an integer",
                                  detail={"VLLM_CPU_KVCACHE_SPACE": raw},
                                  fix="set VLLM_CPU_KVCACHE_SPACE to a whole number of GiB, e.g. 1"))
            kv_bytes = None
        if kv_bytes is not None:
            ctx.host["cpu_kvcache_bytes"] = kv_bytes
            detail = {"VLLM_CPU_KVCACHE_SPACE": raw, "bytes_per_rank": kv_bytes, "tp": tp, "ranks_here": local,
                      "ram_available_bytes": avail}
            if avail is not None and kv_bytes * local > avail:
                records.append(record(
                    "host.cpu_kvcache", FAIL,
                    f"KV cache {raw} GiB x {ranks_here} exceeds available RAM {human_bytes(avail)}",
                    detail=detail, fix="lower VLLM_CPU_KVCACHE_SPACE or TP, or free RAM on the host"))
            else:
                records.append(record("host.cpu_kvcache", OK, f"VLLM_CPU_KVCACHE_SPACE={raw} GiB per rank",
                                      detail=detail))

    if tp > 1:
        # one core range per rank that runs on this host (VLLM_CPU_OMP_THREADS_BIND is read per host)
        bind = ctx.env("VLLM_CPU_OMP_THREADS_BIND")
        detail = {"VLLM_CPU_OMP_THREADS_BIND": bind, "tp": tp, "ranks_here": local}
        if bind is None and server:
            records.append(record(
                "host.cpu_threads", OK, f"{ranks_here} on CPU: the vllm-server engine binds one slice of the "
                f"allowed cores per rank itself (VLLM_CPU_OMP_THREADS_BIND not set)", detail=detail))
        elif bind in (None, "", "auto") and local > 1:
            records.append(record(
                "host.cpu_threads", WARN,
                f"{ranks_here} on CPU without VLLM_CPU_OMP_THREADS_BIND: vLLM may refuse ('Not enough allowed "
                f"NUMA nodes')", detail=detail,
                fix=f'bind one core range per rank, e.g. VLLM_CPU_OMP_THREADS_BIND="0|1" for {local} ranks'
                    if local == 2 else f"bind one core range per rank ({local} '|'-separated ranges)"))
        elif bind in (None, "", "auto"):
            records.append(record(
                "host.cpu_threads", OK, f"{ranks_here} on CPU: one rank here, vLLM's own binding serves it "
                f"(VLLM_CPU_OMP_THREADS_BIND={bind!r})", detail=detail))
        else:
            ranges = bind.split("|")
            status = OK if len(ranges) == local else WARN
            records.append(record(
                "host.cpu_threads", status,
                f"VLLM_CPU_OMP_THREADS_BIND={bind!r} ({len(ranges)} range(s) for {ranks_here})",
                detail=detail,
                fix=None if status == OK else f"give exactly {local} '|'-separated core ranges, one per rank "
                                              f"of this host"))
    return records


def _disks(ctx) -> list:
    records = []
    ctx.host["disk"] = {}
    for key in ("model_path", "output_dir"):
        path = ctx.params.get(key)
        name = "host.disk_model" if key == "model_path" else "host.disk_output"
        if not path:
            records.append(record(name, SKIPPED, f"no {key} given", detail={}))
            continue
        where = nearest_existing(path)
        try:
            usage = shutil.disk_usage(where)
        except OSError as exc:
            records.append(record(name, WARN, f"cannot stat {where}: {exc}", detail={"path": path}))
            continue
        facts = {"path": path, "measured_at": where, "free_bytes": usage.free, "total_bytes": usage.total}
        ctx.host["disk"][key] = facts
        records.append(record(name, OK, f"{human_bytes(usage.free)} free at {where}", detail=facts))
    return records


#: Directories the run writes into -> record name. Free space says nothing about a
#: read-only mount (EROFS) or a dir owned by someone else: only a real write does.
WRITTEN_DIRS = {"output_dir": "host.output_writable", "work_dir": "host.work_dir_writable"}
WRITE_TEST_PREFIX = ".specops-write-test-"
_WHY = {errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied", errno.EPERM: "not permitted",
        errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}


def write_test(path: str) -> dict:
    """Prove ``path`` (or, when it does not exist yet, its nearest existing parent, where
    the run would create it) writable for this user, leaving nothing behind.

    A temp file is created there, written, fsync'ed and removed. ``os.access`` is kept
    only as a hint: it knows nothing of quotas, full disks or NFS root squashing, and
    for root it ignores permission bits.

    :returns: ``{"path", "tested_at", "access_hint", "writable", "error", "errno"}``.
    """
    where = nearest_existing(path)
    facts = {"path": path, "tested_at": where, "access_hint": os.access(where, os.W_OK | os.X_OK),
             "writable": False, "error": None, "errno": None}
    if not os.path.isdir(where):
        facts["error"] = f"{where} exists and is not a directory"
        return facts
    try:
        fd, tmp = tempfile.mkstemp(prefix=WRITE_TEST_PREFIX, dir=where)
    except OSError as exc:
        facts.update(error=f"cannot create a file in {where}: {_WHY.get(exc.errno, exc.strerror)}",
                     errno=errno.errorcode.get(exc.errno))
        return facts
    try:
        os.write(fd, b"specops write test\n")
        os.fsync(fd)
        facts["writable"] = True
    except OSError as exc:  # ENOSPC / EDQUOT show up on write or fsync, not on create
        facts.update(error=f"cannot write a file in {where}: {_WHY.get(exc.errno, exc.strerror)}",
                     errno=errno.errorcode.get(exc.errno))
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError as exc:
            facts["left_behind"] = f"{tmp}: {exc.strerror}"
    return facts


def _writable(ctx) -> list:
    records = []
    for key, name in WRITTEN_DIRS.items():
        path = ctx.params.get(key)
        if not path:
            records.append(record(name, SKIPPED, f"no {key} given", detail={}))
            continue
        facts = write_test(path)
        made = "" if facts["tested_at"] == os.path.abspath(os.path.expanduser(path)) else \
            f" (does not exist yet; tested where it would be created, {facts['tested_at']})"
        if not facts["writable"]:
            records.append(record(
                name, FAIL, f"{key} {path} is not writable: {facts['error']}", detail=facts,
                fix=f"point {key} at a writable filesystem" + (" (this one is mounted read-only)"
                    if facts["errno"] == "EROFS" else f", or let this user write to {facts['tested_at']}")))
        else:
            records.append(record(name, OK, f"{key} {path} is writable{made}", detail=facts))
    return records


def _loopback(ctx) -> dict:
    """The vllm-server engine's server listens on 127.0.0.1 only: prove a socket there binds and answers.

    The engine picks a free port itself when it starts (and retries once if another
    process takes it first), so no particular port is checked, only that loopback
    works at all: a host without a ``lo`` interface, or a sandbox that forbids
    binding, would otherwise fail minutes later, after the model load.
    """
    detail = {"address": LOOPBACK}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((LOOPBACK, 0))
            server.listen(1)
            port = server.getsockname()[1]
            detail["port_tried"] = port
            with socket.create_connection((LOOPBACK, port), timeout=5):
                pass
    except OSError as exc:
        detail["error"] = f"{type(exc).__name__}: {exc}"
        return record("host.loopback", FAIL, f"cannot listen on and connect to {LOOPBACK}: {exc}", detail=detail,
                      fix="the vLLM server listens on 127.0.0.1 only: bring the loopback interface up "
                          "(ip link set lo up) or allow binding TCP ports on it")
    return record("host.loopback", OK, f"{LOOPBACK} accepts connections (tried free port {port}; the engine "
                  f"picks its own free port when the server starts)", detail=detail)
