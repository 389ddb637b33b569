"""How many landed files the vllm-server engine digests at once: a share of the cores while the
server still has requests, every usable core once the last one is answered (the run's drain)."""
from __future__ import annotations

import threading
import time

from remote.extract.engines.vllm_server.landing import DigestSlots, usable_cores


def digest_concurrency(slots: DigestSlots, files: int, answer_all_after: int) -> tuple[int, int]:
    """``files`` threads each take a slot and hold it until released; the requests are answered
    once ``answer_all_after`` of them hold one. The most held at once before and after that."""
    held, most = [0], {"serving": 0, "drained": 0}
    lock, release = threading.Lock(), threading.Event()
    answered = threading.Event()

    def digest():
        with slots:
            with lock:
                held[0] += 1
                phase = "drained" if answered.is_set() else "serving"
                most[phase] = max(most[phase], held[0])
            release.wait(10)
            with lock:
                held[0] -= 1

    threads = [threading.Thread(target=digest) for _ in range(files)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while held[0] < answer_all_after and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a thread that could take a slot beyond the limit would have taken it by now
    serving_now = held[0]
    answered.set()
    for _ in range(files):
        slots.request_done()
    while held[0] < min(files, slots.drained) and time.monotonic() < deadline:
        time.sleep(0.01)
    drained_now = held[0]
    release.set()
    for t in threads:
        t.join(10)
    return serving_now, drained_now


def test_files_are_digested_a_few_at_a_time_while_serving_and_on_every_core_at_the_drain():
    slots = DigestSlots(2, requests=12, drained=6)
    serving, drained = digest_concurrency(slots, files=12, answer_all_after=2)
    assert serving == 2  # the server's cores are left to it while requests remain
    assert drained == 6  # the last batch's files go on every core once nothing is in flight
    assert slots.limit == 6


def test_the_drain_never_uses_fewer_slots_than_serving_and_defaults_to_the_usable_cores():
    assert DigestSlots(8, requests=1, drained=2).drained == 8
    assert DigestSlots(1, requests=1).drained == max(1, usable_cores())
    slots = DigestSlots(3, requests=2)
    slots.request_done()
    assert slots.limit == 3  # one request still out
    slots.request_done()
    assert slots.limit == slots.drained
