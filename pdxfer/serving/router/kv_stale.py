"""A KV event feed that went quiet without a gap, caught by what its worker did.

Silence proves nothing (an idle worker sends no events, vLLM no heartbeats), so each served
request is the evidence. A worker that held fewer prompt tokens than its feed claimed
(beyond ``tolerance_blocks``) scores a ``misses``: its entries are wrong. One that computed
or loaded full blocks it did not hold, while its feed applied no batch at all from the
choice to ``deadline_s`` after the answer, scores an ``unpublished``: its stream is silent.
(Not "its blocks are not in the index": an engine evicts a chain's blocks as it pleases.)
``misses`` of them within ``window_s`` and its feed is suspected (``KvFeeds.suspect``): the
router falls back to its history for it until the feed resynchronises; only wrong entries
are cleared.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .kv_feed import KvFeeds
from .settings import DEFAULT

MAX_PENDING = 1_000_000
"""Served legs awaiting a batch of their worker's events; past this the oldest are dropped."""


@dataclass(frozen=True, slots=True)
class StaleLimits:
    """When a feed counts as stale (``--kv-stale-*``)."""

    misses: int = DEFAULT["kv_stale_misses"]
    window_s: float = DEFAULT["kv_stale_window_s"]
    tolerance_blocks: int = DEFAULT["kv_stale_tolerance_blocks"]
    deadline_s: float = DEFAULT["kv_stale_deadline_s"]

    def __post_init__(self) -> None:
        if (
            self.misses < 1
            or self.window_s <= 0
            or self.tolerance_blocks < 0
            or not (0 < self.deadline_s <= self.window_s)
        ):
            raise ValueError(
                f"--kv-stale-*: misses >= 1, window > 0, tolerance >= 0 and "
                f"0 < deadline <= window, got {self}"
            )


LIMITS = StaleLimits()
"""The defaults."""


@dataclass(frozen=True, slots=True)
class Served:
    """One leg of a served request: its worker, what the index claimed it held, the batches
    its feed had applied when the router chose (``seen``, ``KvFeeds.mark``; None: the claim
    did not come from its feed) and what it reported (None: not reported)."""

    worker: str
    claimed: int
    seen: int | None
    actual: int | None


@dataclass(frozen=True, slots=True)
class _Expect:
    due: float
    worker: str
    seen: int


class StaleCheck:
    """Per worker its recent misses, and the blocks it is expected to publish."""

    def __init__(
        self, kv: KvFeeds, limits: StaleLimits = LIMITS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kv, self.limits, self.clock = kv, limits, clock
        self._misses: dict[str, collections.deque[float]] = {}
        self._pending: collections.deque[_Expect] = collections.deque()

    def served(self, n_tokens: int, legs: Sequence[Served]) -> None:
        """A request of ``n_tokens`` prompt tokens was served: judge each leg's claim, and
        expect a batch of events from a worker that stored blocks it lacked."""
        bs = self.kv.block_size()
        if bs is None:
            return
        now = self.clock()
        for leg in legs:
            f = self.kv.feeds.get(leg.worker)
            if f is None or leg.seen is None or not f.synced:
                continue  # no feed, or its claim did not come from it: nothing to judge
            if (
                leg.actual is not None
                and leg.actual + self.limits.tolerance_blocks * bs < leg.claimed
            ):
                self._miss(leg.worker, "misses", now)
            if n_tokens // bs * bs > leg.claimed:  # it stored full blocks: its events say so
                self._pending.append(_Expect(now + self.limits.deadline_s, leg.worker, leg.seen))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
        self.sweep()

    def sweep(self) -> None:
        """Expectations past their deadline: a worker whose feed (still in sync) applied no
        batch since the choice scores a miss."""
        now = self.clock()
        while self._pending and self._pending[0].due <= now:
            e = self._pending.popleft()
            mark = self.kv.mark(e.worker)
            if mark is not None and mark <= e.seen:
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
            self.kv.suspect(
                worker,
                f"{self.limits.misses} requests within "
                f"{self.limits.window_s:g} s contradicted its events",
                clear=kind == "misses",
            )
