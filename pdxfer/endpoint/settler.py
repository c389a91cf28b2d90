"""Prefill side: terminal messages held until a failed write can no longer land.

A decode hands a failed room's pages back to its engine when the prefill says the room's
writes are over (``AbortAck`` or ``TransferDone``). On Mooncake TCP a write reported failed
may still land once the link heals (``transport/mooncake.py``). So while the transport says a
decode is *tainted*, every message that ends a room whose writes ran to it waits here, and so
does an ``AbortAck`` for a room this prefill no longer knows, until ``Transport.settle``
proves the path quiet. Until then the decode keeps the pages quarantined: fail-closed.

``Settler`` is its own object, with its own threads, because a proof step may block (a fence
to a hung decode waits for the transport's timeout) and must not hold back other decodes or
the room's worker. docs/failure-semantics.md tells the whole story.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..transport.base import Transport

log = logging.getLogger(__name__)

PERIOD_S = 0.05
"""Between proof steps (the kernel samples of ``settle`` are this far apart)."""

MAX_PERIOD_S = 1.0
"""The period a path that stays unproven (its fence keeps failing) backs off to."""


@dataclass(frozen=True, slots=True)
class Held:
    run: Callable[[], None]
    """Sends what was held (called on a prover thread: it should only queue work)."""
    give_up: Callable[[], None]
    """Ends the room without sending (past ``at``)."""
    at: float


class Settler:
    """Held jobs per tainted decode session, run once the transport proves that session's
    path quiet.

    Each session being proven has a prover thread of its own (one blocked proof must not
    hold back the others). One timer thread, which never calls the transport, gives up what
    is held past ``give_up_s`` (the transfer deadline: the decode has failed the room by
    then and keeps asking with ``Abort``), however long a proof step takes: the target
    finishes without a message, so the engine gets its source pages back (a stale slice
    lands only in pages its decode still holds), and the decode's next ``AbortAck`` is held
    like any other. A prover with nothing held and no recent ask stops (a decode that is
    gone keeps no thread); the taint stays, and the next message held starts a new one."""

    def __init__(
        self, transport: Transport, count: Callable[[str, int], None], give_up_s: float
    ) -> None:
        self.transport = transport
        self.count = count
        self.give_up_s = give_up_s
        self.held: dict[str, list[Held]] = {}
        self.asked: dict[str, float] = {}
        """Sessions whose proof an ``AbortAck`` waits for with nothing held: until when."""
        self.provers: set[str] = set()
        self.cv = threading.Condition()
        self.closed = False
        self._stop = threading.Event()
        self.timer: threading.Thread | None = None

    def hold(self, session: str, run: Callable[[], None], give_up: Callable[[], None]) -> None:
        """Call ``run`` once ``session`` is proven quiet, or ``give_up`` if that takes more
        than ``give_up_s`` (both on this object's threads: they should only queue work)."""
        with self.cv:
            if self.closed:
                return
            self.held.setdefault(session, []).append(
                Held(run, give_up, time.monotonic() + self.give_up_s)
            )
            self._prove(session)
            if self.timer is None:
                self.timer = threading.Thread(
                    target=self._time, name="pdxfer-settle-timer", daemon=True
                )
                self.timer.start()
            self.cv.notify_all()

    def kick(self, session: str) -> None:
        """A decode asked for the ack of a room that ended here while ``session`` is tainted
        (nothing is held for it: it asks again): keep proving it for ``give_up_s``."""
        with self.cv:
            if self.closed:
                return
            self.asked[session] = time.monotonic() + self.give_up_s
            self._prove(session)

    def _prove(self, session: str) -> None:
        """Start ``session``'s prover unless it runs (under ``cv``)."""
        if session in self.provers:
            return
        self.provers.add(session)
        threading.Thread(
            target=self._prover, args=(session,), name="pdxfer-settle", daemon=True
        ).start()

    def _prover(self, s: str) -> None:
        period = PERIOD_S
        while True:
            try:
                ok = self.transport.settle(s)
            except Exception:  # noqa: BLE001 - this thread must outlive a transport error
                log.exception("proving the path to %s quiet failed", s)
                ok = False
            with self.cv:
                if self.closed:
                    self.provers.discard(s)
                    return
                # proven, and no write failed since: a failure after the proof taints the
                # session again, and the message held for it (maybe already here) waits for
                # a proof of its own, so everything held waits with it
                if ok and not self.transport.tainted(s):
                    jobs = self.held.pop(s, [])
                    self.asked.pop(s, None)
                    self.provers.discard(s)
                    break
                if s not in self.held and self.asked.get(s, 0.0) < time.monotonic():
                    self.asked.pop(s, None)  # nothing waits for this proof any more
                    self.provers.discard(s)
                    return
            period = PERIOD_S if ok else min(MAX_PERIOD_S, period * 1.25)
            if self._stop.wait(period):
                with self.cv:
                    self.provers.discard(s)
                return
        if jobs:
            log.info("path to %s proven quiet: %d held messages go out", s, len(jobs))
            self.count("settled", 1)
        for h in jobs:
            h.run()

    def _time(self) -> None:
        """Give up what is held past its time, whatever the provers are blocked on."""
        while True:
            with self.cv:
                if self.closed:
                    return
                now = time.monotonic()
                late = [h for hs in self.held.values() for h in hs if h.at <= now]
                if late:
                    for s in list(self.held):
                        self.held[s] = [h for h in self.held[s] if h.at > now]
                        if not self.held[s]:
                            del self.held[s]
                else:
                    nxt = min((h.at for hs in self.held.values() for h in hs), default=None)
                    self.cv.wait(None if nxt is None else nxt - now)
                    continue
            log.warning(
                "%d rooms gave up waiting for a quiet path to their decode: they end "
                "without a message (their decodes keep the pages until it is proven)",
                len(late),
            )
            self.count("settle_given_up", len(late))
            for h in late:
                h.give_up()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self._stop.set()
            self.cv.notify_all()
        t = self.timer
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
