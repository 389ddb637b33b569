"""The memory a trainer really holds, sampled while it runs, beside its estimate (stdlib only at import).

:class:`MemorySampler` is started by the train supervisor (:mod:`remote.train.supervisor`) on the
trainer's pid; about once a second, on a daemon thread, it reads the trainer's process tree
(the trainer and all its descendants: torchrun's workers too,
:func:`remote.system.procscan.process_tree`) and adds up what those processes hold:

* on a CUDA run, their GPU memory as ``nvidia-smi --query-compute-apps`` lists it
  (:func:`remote.system.devices.compute_apps`), per GPU; with several GPUs the busiest one is
  what compares with the estimate (each rank holds its own copy of the draft);
* on CPU, the sum of their ``VmRSS``; and each process's own ``VmHWM`` (the kernel's resident
  peak), so a peak between two samples is not missed.

The result is the status's ``memory`` (:meth:`MemorySampler.as_dict`), beside the
``train.memory`` preflight's ``need_bytes`` (:func:`remote.train.memory.plan_estimate`): an estimate
3x off rents the wrong GPU. Sampling never fails the run: an error ends it, recorded as ``why``.

Its wording (:func:`remote.wire.words.usage_line`) is the wire's: the laptop prints it too.
"""
from __future__ import annotations

import threading

from remote.wire.words import MiB, ratio

#: seconds between two samples.
SAMPLE_EVERY_S = 1.0
#: the status is rewritten when the peak grows, else every this many samples (the count).
STATUS_EVERY_SAMPLES = 10
#: how long :meth:`MemorySampler.stop` waits for a sample under way.
STOP_WAIT_S = 2.0
GPU_SOURCE = "nvidia-smi --query-compute-apps"
RAM_SOURCE = "/proc VmRSS/VmHWM"


def gpu_use(apps: list, pids, gpus=()) -> dict:
    """``{GPU index: bytes}`` the processes ``pids`` hold, from :func:`remote.system.devices.parse_apps` rows;
    a GPU missing from ``gpus`` (:func:`remote.system.devices.parse_gpus` rows) is keyed by its UUID."""
    index_of = {g["uuid"]: g["index"] for g in gpus}
    pids, used = set(pids), {}
    for app in apps:
        if app["pid"] in pids:
            index = index_of.get(app["gpu_uuid"], app["gpu_uuid"])
            used[index] = used.get(index, 0) + (app["used_memory_mib"] or 0) * MiB
    return used


class MemorySampler:
    """Samples the memory of ``pid``'s process tree until :meth:`stop`; the peak so far is :meth:`as_dict`.

    :param smi: the nvidia-smi to ask (a CUDA run), else None: the resident memory is read.
    :param gpus: :func:`remote.system.devices.parse_gpus` rows, to name the GPUs by index and model.
    :param on_update: gets :meth:`as_dict` when the peak grows (and now and then); its errors end the sampling.
    """

    def __init__(self, pid: int, *, estimate_bytes: int | None = None, smi: str | None = None,
                 gpus: list | None = None, where: str | None = None, on_update=None,
                 every_s: float = SAMPLE_EVERY_S, pids_of=None):
        self.pid, self.estimate_bytes, self.smi = pid, estimate_bytes, smi
        self.pids_of = pids_of  # the processes to read, when they are not pid's tree (a Slurm job step's)
        self.gpus = {g["uuid"]: g for g in gpus or []}
        self.where = where or ("GPU" if smi else "RAM")
        self.on_update, self.every_s = on_update, every_s
        self.samples = 0
        self.peak_sum = 0  # the largest sum of one sample (all GPUs, or all processes' VmRSS)
        self.hwm = {}  # pid -> its own VmHWM, the largest seen
        self.per_gpu = {}  # GPU index -> the largest sum on it
        self.pids_seen = set()
        self.others_listed = False  # nvidia-smi listed processes, none of them the trainer's
        self.why = None
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "MemorySampler":
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling (the trainer has exited) and give the final :meth:`as_dict`."""
        self._stop.set()
        if self._thread is not None:
            # not for a hung nvidia-smi (20 s): an aborted run has 10 s to record that it was
            self._thread.join(timeout=STOP_WAIT_S)
        return self.as_dict()

    def _loop(self) -> None:
        try:
            while True:
                grew = self.sample()
                if self.on_update and not self._stop.is_set() and (grew or self.samples % STATUS_EVERY_SAMPLES == 0):
                    self.on_update(self.as_dict())
                if self._stop.wait(self.every_s):
                    return
        except Exception as exc:  # never fails the run: the sampling ends, and says why
            self.why = f"{type(exc).__name__}: {exc}"

    def sample(self) -> bool:
        """Take one sample; True when the peak grew.

        :raises RuntimeError: nvidia-smi did not answer.
        """
        from remote.system import procscan

        before = self.peak_bytes()
        tree = self.pids_of() if self.pids_of else procscan.process_tree(self.pid)
        self.pids_seen.update(tree)
        if self.smi:
            from remote.system import devices

            apps, err = devices.compute_apps(self.smi)
            if err:
                raise RuntimeError(f"nvidia-smi: {err}")
            by_gpu = gpu_use(apps, tree, self.gpus.values())
            self.others_listed |= bool(apps) and not by_gpu
            for index, used in by_gpu.items():
                self.per_gpu[index] = max(self.per_gpu.get(index, 0), used)
            self.peak_sum = max(self.peak_sum, sum(by_gpu.values()))
        else:
            total = 0
            for pid in tree:
                vm = procscan.memory_status(pid)
                total += vm.get("VmRSS", 0)
                if "VmHWM" in vm:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), vm["VmHWM"])
            self.peak_sum = max(self.peak_sum, total)
        self.samples += 1
        return self.peak_bytes() > before

    def peak_bytes(self) -> int:
        """On GPU, the busiest GPU's peak (the estimate sizes one device); on CPU, the largest sampled
        sum or one process's own VmHWM, whichever is more."""
        if self.smi:
            return max(self.per_gpu.values(), default=0)
        return max(self.peak_sum, max(self.hwm.values(), default=0))

    def as_dict(self) -> dict:
        peak = self.peak_bytes()
        out = {"where": self._where(), "source": GPU_SOURCE if self.smi else RAM_SOURCE, "peak_bytes": peak,
               "estimate_bytes": self.estimate_bytes, "peak_over_estimate": ratio(peak, self.estimate_bytes),
               "samples": self.samples, "processes": len(self.pids_seen)}
        if self.smi and len(self.per_gpu) > 1:
            out["per_gpu"] = {str(k): v for k, v in sorted(self.per_gpu.items(), key=lambda kv: str(kv[0]))}
            out["total_peak_bytes"] = self.peak_sum
        if self.why:
            out["why"] = self.why
        elif self.smi and not peak and self.others_listed:
            # nvidia-smi names the pids of the host's namespace; a container's trainer has others
            out["why"] = ("nvidia-smi lists GPU processes but none of the trainer's pids (the trainer in a "
                          "container, nvidia-smi seeing the host's pids?)")
        return out

    def _where(self) -> str:
        if not self.smi or not self.per_gpu:
            return self.where
        busiest = max(self.per_gpu, key=self.per_gpu.get)
        name = next((g["name"] for g in self.gpus.values() if g["index"] == busiest), None)
        where = f"GPU {busiest}" + (f" ({name})" if name else "")
        return where + (f", the busiest of {len(self.per_gpu)}" if len(self.per_gpu) > 1 else "")
