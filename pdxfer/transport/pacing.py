"""Per-peer admission and completion pacing for a transport whose completion wait spins.

Mooncake's ``get_batch_transfer_status`` spins until a batch completes; on a host with few
cores that spinner takes CPU from the transport's own I/O threads. So the transport first
*sleeps* for most of a batch's expected duration and only then calls the spinning wait.
``RateEstimate`` learns a peer's seconds per byte from batches whose wait spun, counting
every byte in flight to the peer, and is cut (never grown) by batches already complete when
the wait began, so the sleep converges to just under the true duration. ``Credits`` caps the
entries in flight to one peer across every thread (``limit`` 1024): Mooncake's TCP transport
rejects more and can leave that peer's lane broken for good.
Measured: docs/performance.md#what-pdxfer-does-to-be-fast-here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..errors import TransportError


@dataclass(slots=True)
class RateEstimate:
    """Seconds per byte of one peer, learned from completions (thread-safe enough: a torn
    update only perturbs a sleep)."""

    sec_per_byte: float = 1 / 2.0e9
    """Prior: 2 GB/s, about what Mooncake TCP moves on loopback (a guess the first spun
    batches replace)."""
    sleep_fraction: float = 0.85
    """Sleep this share of the expected duration, then spin for the rest."""
    spin_slack_s: float = 100e-6
    """A wait that took longer than this after the sleep spun: its end is the completion."""
    max_sleep_s: float = 0.05
    """Never sleep longer than this before checking (a bad estimate costs at most this)."""
    min_learn_bytes: int = 1 << 20
    floor_s: float = 150e-6
    """Shorter expected sleeps are skipped: waking a thread costs about this much."""
    one_waiter: bool = True
    """Let one thread at a time spin in the peer's completion wait (``waiter``); the others
    block on the lock meanwhile, without CPU, instead of each spinning through the end of its
    batch (measured: docs/performance-history.md#the-small-closed-loop-64-in-flight)."""
    waiter: threading.Lock = field(default_factory=threading.Lock)

    def sleep_for(self, ahead: int, elapsed: float) -> float:
        """How long to sleep now, ``elapsed`` seconds after submitting a batch that had
        ``ahead`` bytes in flight to the peer (itself included)."""
        left = min(ahead * self.sec_per_byte * self.sleep_fraction, self.max_sleep_s) - elapsed
        return left if left >= self.floor_s else 0.0

    def observe(self, ahead: int, submitted: float, slept_until: float, done: float) -> None:
        if ahead < self.min_learn_bytes:
            return  # a tiny batch's time is latency, not bandwidth
        if done - slept_until > self.spin_slack_s:
            seen = (done - submitted) / ahead
            self.sec_per_byte = 0.7 * self.sec_per_byte + 0.3 * seen
        else:
            self.sec_per_byte *= 0.85


@dataclass(slots=True)
class Credits:
    """Entries in flight to one peer, shared by every writer thread."""

    limit: int
    used: int = 0
    bytes: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def acquire(self, n: int, deadline: float | None, nbytes: int = 0) -> int:
        """Wait until ``n`` entries fit under ``limit``, or raise at ``deadline``; returns the
        bytes then in flight to the peer, these ``nbytes`` included."""
        if n > self.limit:
            raise TransportError(f"a batch of {n} entries exceeds the per-peer limit {self.limit}")
        with self.cond:
            while self.used + n > self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(
                        "deadline passed waiting for the peer's in-flight entries to drain"
                    )
                self.cond.wait(0.5 if left is None else min(left, 0.5))
            self.used += n
            self.bytes += nbytes
            return self.bytes

    def try_acquire(self, n: int, nbytes: int = 0, alone: bool = False) -> int | None:
        """``acquire`` without waiting: None when the entries do not fit now (or, ``alone``,
        when anything is in flight to the peer). A writer that already holds credits must use
        this (and complete its own batches first), never wait while holding: two writers each
        holding half the limit would wait for each other."""
        with self.cond:
            if self.used + n > self.limit or alone and self.used:
                return None
            self.used += n
            self.bytes += nbytes
            return self.bytes

    def release(self, n: int, nbytes: int = 0) -> None:
        with self.cond:
            self.used -= n
            self.bytes -= nbytes
            self.cond.notify_all()
