"""Prefill side: rooms that ended here, remembered so that a late request for one is refused
at once (with the reason and failure kind it ended with) instead of waiting for a room that
will never open.

Two kinds of entry: a room that ended (failed, withdrawn, or succeeded and left the table),
for any decode; and a room a decode aborted before its request came, for that decode's
request alone (the request may still be on its way). Entries expire after the bootstrap
timeout and the table is bounded (``max_tombstones``, oldest first), so a hostile decode
cannot grow it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tombstone:
    expires: float
    """Monotonic time after which it is forgotten."""
    why: str
    """Completes "room N ..." in the refusal."""
    kind: str
    """The failure kind the refusal carries (``errors.py``)."""


_ANY = ("", 0)
"""The (endpoint, nonce) of an entry that holds for every decode."""


class Tombstones:
    """The bounded, expiring table (under the core's lock). ``count`` is the core's counter
    (each eviction counts ``tombstones_evicted``)."""

    def __init__(self, cap: int, ttl_s: float, count: Callable[[str], None]) -> None:
        self.cap = cap
        self.ttl_s = ttl_s
        self.count = count
        self.entries: OrderedDict[tuple[int, str, int], Tombstone] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def ended(self, room: int, why: str, kind: str = "remote") -> None:
        """``room`` ended here: refuse any later request for it."""
        self._add((room, *_ANY), why, kind)

    def aborted(self, room: int, endpoint_id: str, nonce: int, why: str) -> None:
        """Decode ``endpoint_id`` aborted ``room`` (its request ``nonce``) before asking."""
        self._add((room, endpoint_id, nonce), why, "remote")

    def find(self, room: int, endpoint_id: str, nonce: int) -> Tombstone | None:
        """The entry that refuses this request, if any (the room's own first)."""
        return self.entries.get((room, *_ANY)) or self.entries.get((room, endpoint_id, nonce))

    def forget(self, room: int) -> None:
        """A new request reuses ``room``: it no longer counts as ended."""
        self.entries.pop((room, *_ANY), None)

    def expire(self, now: float) -> None:
        for key in [k for k, t in self.entries.items() if now > t.expires]:
            del self.entries[key]

    def _add(self, key: tuple[int, str, int], why: str, kind: str) -> None:
        self.entries[key] = Tombstone(time.monotonic() + self.ttl_s, why, kind)
        self.entries.move_to_end(key)
        while len(self.entries) > self.cap:
            self.entries.popitem(last=False)
            self.count("tombstones_evicted")
