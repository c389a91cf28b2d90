"""Prefill side: the decode's requests that came before their room was opened.

A decode may ask before this prefill's engine opens the room (its request is still on its
way here, or it was dispatched early). ``PendingRequests`` parks such requests per room, each
room with the deadline after which its requests are refused (``PrefillSide`` picks it), and
keeps the running count and memory of what it holds, so that the caps (``max_pending``,
``max_pending_bytes``) are checked in constant time before a request's indices are unpacked.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire
from .decode_peers import DecodePeer


@dataclass(frozen=True, slots=True)
class Parked:
    """One request waiting for its room."""

    req: wire.TransferRequest
    peer: DecodePeer
    size: int
    """Memory it holds (``pending_size``)."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """A room's parked requests and when they are refused."""

    deadline: float
    parked: tuple[Parked, ...]


class PendingRequests:
    """Parked requests by room, with their totals (under the core's lock)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.rooms: dict[int, Waiting] = {}
        self.count = 0
        """Requests parked, over every room."""
        self.bytes = 0
        """Memory they hold."""

    def __len__(self) -> int:
        return len(self.rooms)

    def __contains__(self, room: object) -> bool:
        return room in self.rooms

    def fits(self, size: int) -> bool:
        """Whether one more request of ``size`` bytes fits the caps."""
        return self.count < self.max_count and self.bytes + size <= self.max_bytes

    def deadline(self, room: int) -> float | None:
        w = self.rooms.get(room)
        return None if w is None else w.deadline

    def has(self, room: int, endpoint_id: str) -> bool:
        """Whether decode ``endpoint_id`` already has a request parked for ``room``."""
        w = self.rooms.get(room)
        return w is not None and any(p.peer.endpoint_id == endpoint_id for p in w.parked)

    def park(self, p: Parked, deadline: float) -> None:
        """Add ``p`` to its room, whose requests are now refused after ``deadline``."""
        w = self.rooms.get(p.req.room)
        self.rooms[p.req.room] = Waiting(deadline, (w.parked if w else ()) + (p,))
        self.bytes += p.size
        self.count += 1

    def extend(self, room: int, deadline: float) -> None:
        """Keep ``room``'s requests (if any) at least until ``deadline``."""
        w = self.rooms.get(room)
        if w is not None:
            self.rooms[room] = Waiting(max(w.deadline, deadline), w.parked)

    def take(self, room: int) -> tuple[Parked, ...]:
        """Remove and return ``room``'s requests (its room opened, or it is refused)."""
        w = self.rooms.pop(room, None)
        if w is None:
            return ()
        self._forget(w.parked)
        return w.parked

    def drop(self, room: int, nonce: int, endpoint_id: str) -> bool:
        """Remove the request of decode ``endpoint_id`` with ``nonce`` (its decode aborted
        it); whether there was one."""
        w = self.rooms.get(room)
        if w is None:
            return False

        def match(p: Parked) -> bool:
            return p.req.nonce == nonce and p.peer.endpoint_id == endpoint_id

        gone = tuple(p for p in w.parked if match(p))
        if not gone:
            return False
        self._forget(gone)
        left = tuple(p for p in w.parked if not match(p))
        if left:
            self.rooms[room] = Waiting(w.deadline, left)
        else:
            del self.rooms[room]
        return True

    def take_expired(self, now: float) -> list[tuple[int, tuple[Parked, ...]]]:
        """Remove and return the requests of every room past its deadline."""
        due = [room for room, w in self.rooms.items() if now > w.deadline]
        return [(room, self.take(room)) for room in due]

    def peers(self) -> set[int]:
        """``id()`` of every peer with a parked request (the peer table keeps those)."""
        return {id(p.peer) for w in self.rooms.values() for p in w.parked}

    def _forget(self, parked: tuple[Parked, ...]) -> None:
        self.bytes -= sum(p.size for p in parked)
        self.count -= len(parked)


def pending_size(req: wire.TransferRequest) -> int:
    """Memory a parked request holds: its packed indices and their unpacked int64 copy."""
    return 1024 + 3 * sum(len(v) for v in req.dst.values())
