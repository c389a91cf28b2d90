"""Requests held at the router while every prefill's queue is full.

A prefill's load is the prompt tokens its requests still have to compute (``pending``, from
the choice until the first token). Piling more onto a busy prefill only lengthens its queue,
and with ``--dispatch concurrent`` each queued request also holds blocks on its decode. So a
request goes to a prefill only while that prefill's pending tokens, with the request's own,
stay within ``limit``; an idle prefill takes any request, however long. The rest wait here,
first come first served, until a prefill's first token frees room, at most their deadline;
past ``max_held`` waiting requests a new one is refused at once (503, retry later).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from .backends import AttemptFailed, Prefill


class Door:
    def __init__(self, limit: int, max_held: int) -> None:
        self.limit = limit
        """Pending prompt tokens a prefill may hold with a new request (0: no limit)."""
        self.max_held = max_held
        self.waiting = 0
        self.held = 0
        """Requests that waited here (since start)."""
        self.refused = 0
        """Requests refused here: too many waiting, or no room before their deadline."""
        self._changed = asyncio.Event()

    def full(self, p: Prefill, n_tokens: int) -> bool:
        return self.limit > 0 and p.pending > 0 and p.pending + n_tokens > self.limit

    def released(self) -> None:
        """A prefill's pending tokens went down: waiters look again (in arrival order)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def enter(self, prefills: Sequence[Prefill], n_tokens: int, timeout_s: float) -> set[str]:
        """Wait until some prefill has room for ``n_tokens``; returns the keys of those that
        do not (for the choice to avoid). Raises a 503 ``AttemptFailed`` when too many wait
        already or none has room within ``timeout_s``."""
        full = {p.key for p in prefills if self.full(p, n_tokens)}
        if len(full) < len(prefills):
            return full
        if self.waiting >= self.max_held:
            self.refused += 1
            raise AttemptFailed(
                503, f"{self.waiting} requests already wait for a prefill; retry later"
            )
        self.waiting += 1
        self.held += 1
        end = time.monotonic() + timeout_s
        try:
            while True:
                left = end - time.monotonic()
                changed = self._changed
                if left <= 0:
                    self.refused += 1
                    raise AttemptFailed(
                        503, f"no prefill had room for {n_tokens} prompt tokens in {timeout_s:g} s"
                    )
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except asyncio.TimeoutError:
                    continue
                full = {p.key for p in prefills if self.full(p, n_tokens)}
                if len(full) < len(prefills):
                    return full
        finally:
            self.waiting -= 1
