"""Replay: the one guard for nonces (signed HTTP requests, control-plane Hellos) and the
per-session counter window (every later control frame).

A signed message carries a timestamp and a fresh nonce; one older or newer than
``MAX_SKEW_S`` is refused outright, and ``ReplayGuard`` remembers each nonce for as long as
its timestamp could still pass, so a message is accepted once. A session frame carries a
counter instead, accepted once by its session's ``ReplayWindow``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Literal

MAX_SKEW_S = 300.0
"""A signed request or Hello older (or newer) than this is refused: bounds replay."""


class ReplayGuard:
    """Nonces seen within the freshness window (``2 * MAX_SKEW_S``): each is accepted once.

    Bounded by ``limit``. When it is full and no nonce has expired, ``when_full`` decides:
    ``refuse`` new nonces (control-plane Hellos: only holders of the secret can make them, so
    a legitimate cluster never gets near the limit), or ``evict`` the oldest tenth (signed
    HTTP requests: a busy bootstrap server keeps serving)."""

    def __init__(self, limit: int, when_full: Literal["refuse", "evict"]) -> None:
        self.limit = limit
        self.when_full = when_full
        self._seen: OrderedDict[str | bytes, tuple[float, str | bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, nonce: str | bytes, tag: str | bytes = b"", now: float | None = None) -> str:
        """``""`` for a new nonce (now remembered), ``"again"`` for one seen with the same
        non-empty ``tag`` (a retransmission of the same message), else why it is refused:
        ``"replay"`` or ``"table_full"``."""
        now = time.time() if now is None else now
        with self._lock:
            while self._seen:  # expiries are in insertion order: drop from the front
                k, (exp, _) = next(iter(self._seen.items()))
                if exp > now:
                    break
                del self._seen[k]
            seen = self._seen.get(nonce)
            if seen is not None:
                return "again" if tag and seen[1] == tag else "replay"
            if len(self._seen) >= self.limit:
                if self.when_full == "refuse":
                    return "table_full"
                for k in list(self._seen)[: max(1, self.limit // 10)]:
                    del self._seen[k]
            self._seen[nonce] = (now + 2 * MAX_SKEW_S, tag)
            return ""

    def __len__(self) -> int:
        return len(self._seen)


class ReplayWindow:
    """Counters seen from one peer: a counter is accepted once, and only while it is newer
    than the newest minus ``SIZE`` (frames from several sender threads may interleave)."""

    SIZE = 4096

    def __init__(self) -> None:
        self.top = 0
        self.mask = 0

    def accept(self, c: int) -> bool:
        if c <= 0:
            return False
        if c > self.top:
            shift = c - self.top
            self.mask = (
                ((self.mask << shift) | 1) & ((1 << self.SIZE) - 1) if shift < self.SIZE else 1
            )
            self.top = c
            return True
        d = self.top - c
        if d >= self.SIZE or (self.mask >> d) & 1:
            return False
        self.mask |= 1 << d
        return True
