"""A host's parallel layout: ``dp`` data-parallel replicas of ``tp`` ranks each, every replica on its own devices.

A host offers devices (its visible GPUs, or its usable CPU cores on a CPU host). A run holds
``dp x tp`` of them: replica ``i`` takes the ``i``-th run of ``tp`` GPU ids (``CUDA_VISIBLE_DEVICES``
of its processes), or the ``i``-th equal slice of the cores (its ranks split the slice again,
:func:`device_env`). The default ``dp`` is as many replicas as the devices hold at the run's ``tp``
(GPUs // tp) on a GPU host, and 1 on a CPU host: one CPU replica already computes on every core, so
splitting them is the user's choice.

The engines of :data:`DP_ENGINES` run replicas: the vllm-server engine one server per replica (the
replicas split the host's rows dynamically, each taking the next sample when it has a free request
slot), the seed stack's in-process generator one process per replica
(:mod:`remote.extract.engines.replicas`: each batch split among them). Either way every sample is
written once, computed by exactly one replica, under the names a one-replica run gives it. Used by
preflight (``parallel.layout``), the shard probe (a host's width in a group plan) and those engines.
Stdlib only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from remote.system import cpu
from remote.wire.contract import SPECULATORS_03, VLLM_SERVER

#: the engines that run data-parallel replicas (one server, or one generator process, per device set)
DP_ENGINES = (VLLM_SERVER, SPECULATORS_03)

@dataclass
class Layout:
    """``dp`` replicas of ``tp`` ranks; ``sets[i]`` the device ids of replica ``i`` (GPU ids or CPU cores)."""

    kind: str
    dp: int
    tp: int
    devices: list[int]
    sets: list[list[int]] = field(default_factory=list)
    #: how dp was chosen: "asked" (the run's dp) or the default's reason
    why: str = ""
    #: why the layout cannot run (None: it can)
    problem: str | None = None

    @property
    def idle(self) -> list[int]:
        used = {d for s in self.sets for d in s}
        return [d for d in self.devices if d not in used]

    def text(self) -> str:
        unit = "GPU" if self.kind == "cuda" else "core"
        sets = " | ".join(",".join(map(str, s)) for s in self.sets)
        return f"dp {self.dp} x tp {self.tp} over {len(self.devices)} {unit}(s)" + (f" ({unit}s {sets})" if sets else "")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "dp": self.dp, "tp": self.tp, "devices": self.devices, "sets": self.sets,
                "idle": self.idle, "why": self.why, "problem": self.problem}


def host_devices(params: dict) -> tuple[str, list[int], str | None]:
    """``(kind, ids, error)``: the GPU ids this run may use (``CUDA_VISIBLE_DEVICES`` of the run's env or
    the process, else every GPU nvidia-smi lists), or the usable CPU cores on a CPU host."""
    if str(params.get("device") or "cuda") == "cpu":
        try:
            return "cpu", sorted(os.sched_getaffinity(0)), None
        except (AttributeError, OSError):
            return "cpu", list(range(os.cpu_count() or 1)), None
    import shutil

    from remote.system.devices import query_nvidia_smi, visible_gpus

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cuda", [], "nvidia-smi is not on PATH"
    out = query_nvidia_smi(smi)
    cvd = (params.get("env") or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    visible = visible_gpus(out["gpus"], cvd)
    return "cuda", [int(g["index"]) for g in visible], out["error"]


def resolve(params: dict, tp: int, kind: str, devices: list[int], engine: str | None = None) -> Layout:
    """The layout of a run of ``tp`` ranks per replica over ``devices`` (``params["dp"]``: asked, None: default;
    ``engine``: the run's resolved engine, when known)."""
    tp = max(1, int(tp))
    asked = params.get("dp")
    unit = "GPU" if kind == "cuda" else "CPU core"
    if asked not in (None, ""):
        dp, why = int(asked), "asked (dp)"
    elif params.get("replica"):
        dp, why = 1, "a host of a replica over several hosts: the replica is one data-parallel unit"
    elif engine is not None and engine not in DP_ENGINES:
        dp, why = 1, f"the {engine} engine runs one replica per host"
    elif kind == "cuda":
        dp, why = max(1, len(devices) // tp), f"default: {len(devices)} GPU(s) // tp {tp}"
    else:
        dp, why = 1, "default on a CPU host (one replica computes on every core; set dp to split them)"
    layout = Layout(kind=kind, dp=dp, tp=tp, devices=list(devices), why=why)
    if params.get("replica") and dp > 1:
        layout.problem = (f"dp {dp} on a host of a replica over several hosts: the replica is one data-parallel "
                          f"unit (its tp spans the hosts)")
        return layout
    if dp > 1 and engine is not None and engine not in DP_ENGINES:
        layout.problem = (f"dp {dp}: data-parallel replicas are {' or '.join(DP_ENGINES)} engines (one server "
                          f"or generator process each); the {engine} engine runs one replica per host")
        return layout
    need = dp * tp
    if need > len(devices):
        layout.problem = f"dp {dp} x tp {tp} needs {need} {unit}(s), {len(devices)} usable"
        return layout
    if kind == "cuda":
        layout.sets = [devices[i * tp:(i + 1) * tp] for i in range(dp)]
    else:  # equal slices of the cores; the remainder (fewer than dp cores) stays with the last replica
        per = len(devices) // dp
        layout.sets = [devices[i * per:(i + 1) * per] for i in range(dp)]
        layout.sets[-1] = devices[(dp - 1) * per:]
    return layout


def of_host(params: dict, tp: int, engine: str | None = None) -> Layout:
    """:func:`resolve` over this host's own devices (:func:`host_devices`)."""
    kind, devices, _error = host_devices(params)
    return resolve(params, tp, kind, devices, engine)


def device_env(base: dict, *, tp: int, on_cpu: bool, devices: list[int] | None = None) -> dict:
    """``base`` with what pins a vLLM process and its ``tp`` ranks to their devices (the one writer of it:
    the vllm-server engine's servers and the seed engine's replica processes read it).

    ``devices``: a data-parallel replica's own device set (:func:`resolve`): its GPU ids
    (``CUDA_VISIBLE_DEVICES``, in nvidia-smi's order), or the CPU cores its ranks split; None: the host's.

    On CPU, vLLM's automatic thread binding wants one NUMA node per rank ("Not enough
    allowed NUMA nodes" on a one-node host at TP=2) and keeps a varying number of cores
    for its front end, so unless the host's env says otherwise each rank gets its own
    slice of the cores (all of them at TP=1), and as many torch threads as its slice has
    cores; the KV cache gets 1 GiB, plenty for extraction (one prefill per request, no decoding).
    """
    env = dict(base)
    if devices is not None and not on_cpu:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # nvidia-smi's indices
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    if on_cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cores = sorted(devices) if devices is not None else sorted(os.sched_getaffinity(0))
        if devices is not None:
            env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the replica's own cores, not the host's setting
        per_rank = max(1, len(cores) // tp)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # Explicit at TP=1 too: vLLM's "auto" keeps cores back for its front end, but how
            # many depends on the config (2 cores: a plain server ran its model on one, the
            # same server with extraction on both), which made the two incomparable.
            slices = [cores[r * per_rank:(r + 1) * per_rank] or cores[-1:] for r in range(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, s)) for s in slices)
        # and as many torch threads (vLLM cuts them to 1 "for serving" on some start paths)
        if devices is not None:
            env["OMP_NUM_THREADS"] = str(per_rank)
        else:
            env.setdefault("OMP_NUM_THREADS", str(per_rank))
        # on an AMX CPU every rank must ask Linux for AMX tile state itself (remote/system/cpu.py)
        env = cpu.amx_env(env)
    return env
