"""Landing the connector's files: wait for a file to be complete, check and digest it, rename it.

The connector writes each request's states into the server's storage dir with a
``.lock`` held until the file is whole (:func:`wait_for_file`). :func:`land_sample`
then reads it once (memory-mapped) for the checks, the digest (BLAKE3 where the host has
it, else sha256) and the per-layer statistics, and renames it into the output as
``hs_<index>.safetensors``; the digest travels in the sample's record to the manifest, so
the run never reads the file again.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import time
from pathlib import Path

from remote.extract import sampleread, samples
from remote.wire import fsutil
from remote.wire.contract import HS, SAMPLE_FILES, sample_name

#: the output file of sample ``i``, the name speculators' offline data loader reads.
SAMPLE_FILE = SAMPLE_FILES[HS][0]


class SampleRejected(RuntimeError):
    """A sample's states came back, but wrong (ids, shape, NaN/Inf): never written to the output."""

    def __init__(self, index: int, problems: list[str]):
        self.index, self.problems = index, list(problems)
        super().__init__(f"sample {index}: " + "; ".join(problems))


def wait_for_file(path: str, timeout: float) -> None:
    """Wait until the connector's writer released ``path + ".lock"``; then remove the lock."""
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None  # written already, or the connector runs without locks
    if fd is not None:
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path} still being written after {timeout:.0f} s")
                    time.sleep(0.01)
        finally:
            os.close(fd)
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass
    if not os.path.exists(path):
        raise FileNotFoundError(f"the server named {path} but never wrote it")


def move_into_place(src, dest) -> None:
    """Put the finished file ``src`` at ``dest`` atomically (a rename; a copy across filesystems).

    No fsync per file: at tens of MB per sample one fsync each costs more than the
    extraction (on the H200 it capped a run at a quarter of prefill speed). The run
    syncs the output filesystem once per chunk instead (:func:`remote.wire.fsutil.sync_filesystem`),
    and a file a power loss cut short is not counted as done on resume
    (:func:`remote.extract.samples.present_indices` checks each file's size against its header).
    """
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with open(src, "rb") as source, fsutil.atomic_open(dest, mode=0o644) as target:
            shutil.copyfileobj(source, target, 1 << 20)
        os.unlink(src)


def default_digest_workers() -> int:
    """Files digested at once by default: half the host's cores, at least 4 (the server needs the rest)."""
    return max(4, (os.cpu_count() or 1) // 2)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: hosts with at most this many usable cores digest on threads by default: 4 threads lose little to
#: the interpreter lock (3.97 vs 4.58 GB/s on the H200 host), and a process per core would import
#: torch once more each at every start
THREADS_UP_TO = 4


class DigestPool:
    """The landed files' digests (:func:`remote.extract.samples.digest_hs_file`) in worker processes.

    Digests on threads of the engine's process stopped scaling: on the H200 host (16 cores, one
    thread each) 48 files digested at once went 1.32 / 3.97 / 4.36 / 4.08 GB/s on 1 / 4 / 8 / 16
    threads, and 1.16 / 4.58 / 8.41 / 13.29 GB/s on as many processes (``scripts/bench_digest.py
    --threads 1,4,8,16``): each file's digest is many short torch calls, and the threads queue on
    the one interpreter lock between them. A landing thread hands its file to a process and waits
    (holding no lock); :class:`DigestSlots` still decides how many are digested at once.

    The processes are spawned (the engine's process has threads; fork would copy their locks)
    and import torch while the server loads (:meth:`start`).
    """

    def __init__(self, processes: int):
        import concurrent.futures
        import multiprocessing

        self.processes = max(1, int(processes))
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self.processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=sampleread.digest_process_init)
        self._started: list = []

    def start(self) -> None:
        """Spawn every process now (each imports torch), without waiting for them."""
        self._started = [self._pool.submit(sampleread.digest_process_ready) for _ in range(self.processes)]

    def wait_started(self, timeout: float = 120.0) -> dict:
        """Once the start's probe tasks are answered, the pool as the manifest's ``engine.digest_in`` says it;
        raises what a process failed with.

        ``processes`` is the pool's size: :meth:`start` spawns every process (a spawn-context pool
        spawns one per task submitted while none is idle). ``answered_probe`` counts the distinct
        processes that ran a probe task: the first processes done importing torch take several, so on
        the H200's 16 cores 3 answered; it is not how many run.
        """
        pids = {f.result(timeout=timeout) for f in self._started}
        return {"processes": self.processes, "answered_probe": len(pids)}

    def digest(self, path, layer_ids, file_layer_ids, **kwargs) -> dict:
        # sampleread's own function (picklable by name), whatever wraps the samples module's name for it
        return self._pool.submit(sampleread.digest_hs_file, str(path), list(layer_ids), list(file_layer_ids),
                                 **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DigestSlots:
    """How many landed files are digested at once: ``while_serving`` while requests are still to
    be sent or in flight (the server needs the other cores), every usable core once none are.

    A run's last requests finish together (one batch of ``concurrency``), and their files were
    then digested ``while_serving`` at a time on an idle host: on the H200's 8B-like shape that
    drain was most of what the run lost to plain prefill (96 samples of 134 MB: 0.5 s of 5.4 s).

    :param requests: requests the run will send (each one :meth:`request_done` once, sent or failed).
    """

    def __init__(self, while_serving: int, requests: int, drained: int | None = None):
        self.while_serving = max(1, int(while_serving))
        self.drained = max(self.while_serving, int(drained or usable_cores()))
        self._requests_left = int(requests)
        self._active = 0
        self._changed = threading.Condition()

    @property
    def limit(self) -> int:
        return self.drained if self._requests_left <= 0 else self.while_serving

    def request_done(self) -> None:
        with self._changed:
            self._requests_left -= 1
            if self._requests_left <= 0:
                self._changed.notify_all()

    def __enter__(self):
        with self._changed:
            self._changed.wait_for(lambda: self._active < self.limit)
            self._active += 1
        return self

    def __exit__(self, *exc):
        with self._changed:
            self._active -= 1
            self._changed.notify()


def land_sample(index: int, token_ids, path: str, out_dir, *, layer_ids, file_layer_ids,
                hidden_size: int | None, state_format: str | None = None, pool: DigestPool | None = None) -> dict:
    """Check the file the server wrote, digest it and rename it into ``out_dir``; its record.

    One read of the file (memory-mapped) gives the checks (structure, ids echo,
    ``[T, L, H]``, no NaN/Inf), the digest and the per-layer statistics the
    manifest and summary need, so the run never reads it again.

    :param layer_ids: the run's ids, in the order the records list them;
        ``file_layer_ids``: the same ids in the order of the file's layer axis.
    :param state_format: the run's ``format`` (bf16/fp8): a file in the other one is wrong.
    :param pool: digest in these processes (None: in this thread).
    :raises SampleRejected: the file is wrong; it is deleted, never landed.
    """
    digest_file = pool.digest if pool is not None else samples.digest_hs_file
    try:
        digest = digest_file(path, layer_ids, file_layer_ids, token_ids=list(token_ids),
                             hidden_size=hidden_size, state_format=state_format)
        if digest["problems"]:
            raise SampleRejected(index, digest["problems"])
    except BaseException:
        os.unlink(path)  # a rejected file never reaches the output
        raise
    dest = Path(out_dir) / sample_name(index, HS)
    move_into_place(path, dest)
    shape = digest["tensors"]["hidden_states"]
    return {"index": index, "file": dest.name, "tokens": len(token_ids), "shape": shape["shape"],
            "dtype": shape["dtype"], "bytes": digest["bytes"], "digest": digest}
