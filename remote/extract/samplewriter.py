"""The supervisor's sample writer: batches of samples written on a thread of their own (stdlib only).

The engine extracts the next batch while the last one is written; a bounded queue keeps
memory in check, and whatever the writer reports counts only samples already on disk.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from remote.wire.contract import sample_name

#: batches that may wait for the writer (besides the one being written); the engine
#: blocks beyond that, so at most this + 2 batches of hidden states are in memory.
WRITE_QUEUE_BATCHES = 1


class WriteFailed(RuntimeError):
    """A sample could not be written; the message names the sample and the cause."""


class SampleWriter:
    """Writes batches of samples on a thread of its own while the engine runs the next batch.

    Each sample is written exactly as without the thread (``samples.save_sample``: temp
    file, fsync, rename), in order. ``on_written(first_index, batch)`` runs on the writer
    thread after a whole batch is on disk, so whatever it reports (status progress) never
    counts a sample that is not there yet.

    The queue holds at most ``depth`` batches; :meth:`put` blocks beyond that, so a disk
    slower than the engine slows the engine down instead of filling memory. ``depth`` 0
    writes each batch inside :meth:`put`, before the engine gets the next one (no thread:
    the way it was done before, kept so a benchmark can measure the difference).

    The first failure stops all writing. The next :meth:`put` or :meth:`close` raises it
    as :class:`WriteFailed` (``__cause__``: the original error), naming the sample::

        WriteFailed: writing sample 3 (data_3.pt) in /data/out failed: OSError: [Errno 28] No space left on device

    :param save: ``save(index, input_ids, loss_mask, layer_states)`` writes one sample.
    :param timed: ``timed(phase, seconds)`` adds up the time spent writing.
    """

    def __init__(self, output_dir: Path, save, on_written, timed, depth: int = WRITE_QUEUE_BATCHES):
        self.output_dir = output_dir
        self._save, self._on_written, self._timed = save, on_written, timed
        self.error: WriteFailed | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._thread = None
        if int(depth) > 0:
            self._thread = threading.Thread(target=self._run, daemon=True, name="specops-writer")
            self._thread.start()

    def put(self, first_index: int, batch, states) -> None:
        """Hand one extracted batch over; raises the writer's failure if it had one."""
        self._raise_if_failed()
        if self._thread is None:
            self._write(first_index, batch, states)
            self._raise_if_failed()
        else:
            self._queue.put((first_index, batch, states))

    def close(self, raise_error: bool = True) -> None:
        """Wait until every batch handed over is written (or the writer failed).

        :param raise_error: False while another error is already on its way up: the
            writer's failure is then only printed, not raised over the first one.
        """
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if raise_error:
            self._raise_if_failed()
        elif self.error is not None:
            print(f"[specops] the sample writer failed too: {self.error}", flush=True)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is None:  # after a failure, batches are taken (put never blocks) but not written
                self._write(*item)

    def _write(self, first: int, batch, states) -> None:
        index = first
        t = time.monotonic()
        try:
            for j, ((ids, mask), layer_states) in enumerate(zip(batch, states)):
                index = first + j
                self._save(index, ids, mask, layer_states)
            self._timed("write", time.monotonic() - t)
            self._on_written(first, batch)
        except BaseException as exc:  # kept for the main thread, which fails the run with it
            error = WriteFailed(f"writing sample {index} ({sample_name(index)}) in {self.output_dir} "
                                f"failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self.error = error
