"""Rooms a prefill engine has received but not opened yet (``Endpoint.expect``).

A decode dispatched at the same time as its prefill (the early form) asks before the prefill
engine opens the room, and the prefill holds the request for ``room_grace_s``: long enough
for a request still on its way to the engine, and short, so that a room nobody will ever
hold fails fast. An engine that opens a room only when it schedules the request (vLLM: a
request may wait in its queue far longer) declares the room when the request arrives; a
request for an expected room is held until the bootstrap deadline instead.

The table is bounded (``max_tombstones`` rooms, the oldest forgotten first: a forgotten
room falls back to the grace) and each entry expires at ``bootstrap_timeout_s``, so an engine
that declares rooms it never opens or withdraws cannot grow it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import PlanError

ROOM_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Expectation:
    deadline: float
    """Monotonic time after which the expectation is forgotten (``bootstrap_timeout_s``)."""
    decode: str | None
    """The decode the room will be bound to (for the logs; the binding is ``sender``'s)."""


class Expected:
    """The bounded, expiring table of expected rooms (the side's lock guards it)."""

    def __init__(self, cap: int, ttl_s: float) -> None:
        self.cap = cap
        self.ttl_s = ttl_s
        self.rooms: OrderedDict[int, Expectation] = OrderedDict()
        self.evicted = 0

    def add(self, room: int, decode: str | None, now: float | None = None) -> Expectation:
        """Declare ``room`` (again: its deadline is renewed). Returns its entry."""
        check_room(room)
        if decode is not None and (not isinstance(decode, str) or not 0 < len(decode) <= 256):
            raise PlanError(f"room {room}: decode must be a non-empty name, not {decode!r}")
        e = Expectation((time.monotonic() if now is None else now) + self.ttl_s, decode)
        self.rooms[room] = e
        self.rooms.move_to_end(room)
        while len(self.rooms) > self.cap:
            self.rooms.popitem(last=False)
            self.evicted += 1
        return e

    def get(self, room: int) -> Expectation | None:
        return self.rooms.get(room)

    def pop(self, room: int) -> Expectation | None:
        return self.rooms.pop(room, None)

    def expire(self, now: float) -> None:
        """Forget the expectations past their deadline (oldest first: stop at a live one)."""
        while self.rooms:
            room, e = next(iter(self.rooms.items()))
            if e.deadline >= now:
                return
            del self.rooms[room]


def check_room(room: object) -> int:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= ROOM_MAX:
        raise PlanError(f"room must be an integer in [0, 2^64), not {room!r}")
    return room
