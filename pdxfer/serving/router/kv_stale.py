"""A KV event feed that went quiet without a gap, caught by what its worker did.

Silence proves nothing (an idle worker sends no events, vLLM no heartbeats), so each served
request is the evidence: a worker that held fewer prompt tokens than its feed claimed
(beyond ``tolerance_blocks``), or whose feed never showed the blocks it must have stored for
a prompt it served (within ``deadline_s``), scores a miss. ``misses`` of them within
``window_s`` and its feed is suspected (``KvFeeds.suspect``): the router falls back to its
history for it until the feed resynchronises.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .kv_feed import KvFeeds
from .settings import DEFAULT

MAX_PENDING_TOKENS = 4_000_000
"""Prompt tokens kept for the blocks awaited (8 bytes each); past this the oldest
expectations are dropped."""


@dataclass(frozen=True, slots=True)
class StaleLimits:
    """When a feed counts as stale (``--kv-stale-*``)."""

    misses: int = DEFAULT["kv_stale_misses"]
    window_s: float = DEFAULT["kv_stale_window_s"]
    tolerance_blocks: int = DEFAULT["kv_stale_tolerance_blocks"]
    deadline_s: float = DEFAULT["kv_stale_deadline_s"]

    def __post_init__(self) -> None:
        if self.misses < 1 or self.window_s <= 0 or self.tolerance_blocks < 0 or not (
                0 < self.deadline_s <= self.window_s):
            raise ValueError(f"--kv-stale-*: misses >= 1, window > 0, tolerance >= 0 and "
                             f"0 < deadline <= window, got {self}")


LIMITS = StaleLimits()
"""The defaults."""


@dataclass(frozen=True, slots=True)
class Served:
    """One leg of a served request: its worker, what the index claimed it held (``claimed``,
    with ``from_events``: the claim came from its feed) and what it reported (None: not
    reported)."""

    worker: str
    claimed: int
    from_events: bool
    actual: int | None


@dataclass(frozen=True, slots=True)
class _Expect:
    due: float
    worker: str
    head: np.ndarray  # the prompt up to the first block it should have stored (int64)
    salt: str | None
    held: int


class StaleCheck:
    """Per worker its recent misses, and the blocks it is expected to publish."""

    def __init__(self, kv: KvFeeds, limits: StaleLimits = LIMITS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.limits, self.clock = kv, limits, clock
        self._misses: dict[str, collections.deque[float]] = {}
        self._pending: collections.deque[_Expect] = collections.deque()
        self._pending_tokens = 0

    def served(self, ids: Sequence[int], salt: str | None, legs: Sequence[Served]) -> None:
        """A request was served: judge each leg's claim, and expect the blocks it lacked."""
        bs = self.kv.block_size()
        if bs is None:
            return
        now = self.clock()
        for leg in legs:
            f = self.kv.feeds.get(leg.worker)
            if f is None or not leg.from_events or not f.synced:
                continue  # no feed, or its claim did not come from it: nothing to judge
            if (leg.actual is not None
                    and leg.actual + self.limits.tolerance_blocks * bs < leg.claimed):
                self._miss(leg.worker, "misses", now)
            full = len(ids) // bs * bs
            if full > leg.claimed:  # the worker computed full blocks: its events should say
                head = np.asarray(ids[:leg.claimed + bs], np.int64)
                self._pending.append(_Expect(now + self.limits.deadline_s, leg.worker, head,
                                             salt, leg.claimed))
                self._pending_tokens += len(head)
        while self._pending_tokens > MAX_PENDING_TOKENS:
            self._pending_tokens -= len(self._pending.popleft().head)
        self.sweep()

    def sweep(self) -> None:
        """Expectations past their deadline: a worker whose feed (still in sync) shows none
        of the blocks scores a miss."""
        now = self.clock()
        while self._pending and self._pending[0].due <= now:
            e = self._pending.popleft()
            self._pending_tokens -= len(e.head)
            if not self.kv.synced(e.worker):
                continue
            if self.kv.cached(e.head, e.salt).get(e.worker, 0) <= e.held:
                self._miss(e.worker, "unpublished", now)

    def _miss(self, worker: str, kind: str, now: float) -> None:
        self.kv.feeds[worker].counters[kind] += 1
        q = self._misses.setdefault(worker, collections.deque())
        q.append(now)
        while q and q[0] < now - self.limits.window_s:
            q.popleft()
        if len(q) >= self.limits.misses:
            q.clear()
            self._pending = collections.deque(e for e in self._pending if e.worker != worker)
            self._pending_tokens = sum(len(e.head) for e in self._pending)
            self.kv.suspect(worker, f"{self.limits.misses} requests within "
                                    f"{self.limits.window_s:g} s contradicted its events")
