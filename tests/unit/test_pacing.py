"""Pacing of the non-spinning completion wait and the per-peer in-flight cap (pure logic)."""

from __future__ import annotations

import threading
import time

import pytest

from pdxfer import TransportError
from pdxfer.transport.pacing import Credits, RateEstimate


def test_sleep_estimate_only_shrinks_when_batches_finish_before_the_wait() -> None:
    """A batch already complete when the wait began gives only an upper bound: the estimate
    must come down (else a slow phase would make every later wait oversleep)."""
    r = RateEstimate(sec_per_byte=1e-8)
    before = r.sleep_for(1 << 20, 0.0)
    for _ in range(10):  # the wait returned at once: no spin
        r.observe(1 << 20, submitted=0.0, slept_until=1.0, done=1.0 + 10e-6)
    assert r.sleep_for(1 << 20, 0.0) < before / 4


def test_a_wait_that_spun_teaches_the_true_duration() -> None:
    r = RateEstimate(sec_per_byte=1e-12)
    for _ in range(30):  # each batch of 2 MB took 4 ms, most of it spent spinning
        r.observe(2_000_000, submitted=0.0, slept_until=0.0001, done=0.004)
    assert r.sec_per_byte == pytest.approx(2e-9, rel=0.05)
    assert r.sleep_for(2_000_000, 0.0) == pytest.approx(0.004 * r.sleep_fraction, rel=0.05)
    assert r.sleep_for(1 << 40, 0.0) == r.max_sleep_s  # a bad estimate costs a bounded sleep
    assert r.sleep_for(1_000, 0.0) == 0.0  # too short to be worth a sleep


def test_credits_never_exceed_the_per_peer_limit_across_threads() -> None:
    c = Credits(limit=100)
    peak = [0]
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            c.acquire(30, time.monotonic() + 10, nbytes=30)
            with lock:
                peak[0] = max(peak[0], c.used)
            time.sleep(0.0002)
            c.release(30, nbytes=30)

    ts = [threading.Thread(target=worker) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert 0 < peak[0] <= 100
    assert c.used == 0 and c.bytes == 0


def test_credits_wait_has_a_deadline_and_oversized_batches_are_refused() -> None:
    c = Credits(limit=10)
    c.acquire(10, None)
    with pytest.raises(TransportError, match="deadline"):
        c.acquire(1, time.monotonic() + 0.05)
    with pytest.raises(TransportError, match="exceeds"):
        c.acquire(11, None)


def test_try_acquire_never_waits() -> None:
    c = Credits(limit=10)
    assert c.try_acquire(6, 60) == 60
    assert c.try_acquire(6, 60) is None
    c.release(6, 60)
    assert c.try_acquire(10) == 0 and c.used == 10
