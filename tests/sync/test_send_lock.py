"""The stage emitters' send lock (megarl.sync.lock): real processes on a real TCPStore take it in
turns, never two at once; a waiter gives up after its timeout naming the holder."""
import multiprocessing as mp
import time

import pytest

from megarl.sync.lock import SendLock, SendLockTimeout

ROUNDS = 15


def _emitter(port: int, stage: int, out) -> None:
    lock = SendLock.join("127.0.0.1", port, f"pipeline stage {stage}", timeout_s=60)
    spans = []
    for _ in range(ROUNDS):
        with lock:
            entered = time.monotonic()
            time.sleep(0.002)  # "sending"
            spans.append((entered, time.monotonic()))
    out.put((stage, spans))


def test_emitters_in_separate_processes_hold_the_lock_one_at_a_time():
    host, port = SendLock.host("127.0.0.1", "pipeline stage 0", timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_emitter, args=(port, stage, out)) for stage in (1, 2, 3)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # by its own PID
                p.join(timeout=10)
    spans = sorted(span for stage_spans in results.values() for span in stage_spans)
    assert len(spans) == 3 * ROUNDS
    overlaps = [(a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    assert overlaps == []  # monotonic clocks are system-wide on Linux: one process's exit precedes the next's entry
    assert host.holder() == ""


def test_a_waiter_times_out_naming_the_holder_and_only_the_holder_releases():
    host, port = SendLock.host("127.0.0.1", "pipeline stage 0", timeout_s=30)
    other = SendLock.join("127.0.0.1", port, "pipeline stage 1", timeout_s=0.2)
    with host:
        assert other.holder() == "pipeline stage 0"
        with pytest.raises(SendLockTimeout, match="pipeline stage 1 waited 0.2 s for pipeline stage 0"):
            other.acquire()
        with pytest.raises(RuntimeError, match="held by 'pipeline stage 0'"):
            other.release()
    with other:  # free again
        assert host.holder() == "pipeline stage 1"
