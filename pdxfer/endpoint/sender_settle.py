"""Prefill side: terminal messages held until a failed write can no longer land.

A decode hands a failed room's pages back to its engine when the prefill says the room's
writes are over (``AbortAck``, or ``TransferDone``). On Mooncake TCP a write reported failed
is not necessarily over (``transport/mooncake.py``, module notes): some of it may still be
queued or buffered on the way and land once the link heals. So while the transport says a
decode is *tainted* (a write to it failed and has not been proven drained), every message
to that decode that ends a room whose writes ran is held here, and so is an ``AbortAck``
for a room this prefill no longer knows; this thread proves the path quiet
(``Transport.settle``: a fence, then the kernel's word) and then lets them go. Until then
the decode keeps the pages quarantined and re-sends its ``Abort``: fail-closed.

A held room is given up after ``give_up_s`` (the transfer deadline: its decode has failed
the room by then and keeps asking with ``Abort``): its target finishes without a message,
so the engine gets its source pages back (a stale slice may still read them, but lands only
in pages its decode holds). The decode's next ``Abort`` finds the room gone, and its
``AbortAck`` is held like any other until the path is proven quiet.
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

log = logging.getLogger("pdxfer.sender")

PERIOD_S = 0.05
"""Between proof steps (the kernel samples of ``settle`` are this far apart)."""

MAX_PERIOD_S = 1.0
"""The period a path that keeps failing its fence backs off to."""


@dataclass(frozen=True, slots=True)
class Held:
    run: Callable[[], None]
    """Sends what was held (called on the settle thread: it should only queue work)."""
    give_up: Callable[[], None]
    """Ends the room without sending (past ``at``)."""
    at: float


class Settler:
    """Held jobs per tainted decode session, run once the transport proves that session's
    path quiet; a thread that keeps proving while any session is tainted."""

    def __init__(self, transport: Transport, count: Callable[[str, int], None],
                 give_up_s: float) -> None:
        self.transport = transport
        self.count = count
        self.give_up_s = give_up_s
        self.held: dict[str, list[Held]] = {}
        self.cv = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def hold(self, session: str, run: Callable[[], None], give_up: Callable[[], None]
             ) -> None:
        """Call ``run`` once ``session`` is proven quiet, or ``give_up`` if that takes more
        than ``give_up_s`` (both on this thread: they should only queue work)."""
        with self.cv:
            self.held.setdefault(session, []).append(
                Held(run, give_up, time.monotonic() + self.give_up_s))
            self._start()
            self.cv.notify()
        self.count("settle_held", 1)

    def kick(self) -> None:
        """A session may have become tainted with nothing held yet: keep proving it."""
        with self.cv:
            self._start()
            self.cv.notify()

    def _start(self) -> None:
        if self.thread is None and not self.closed:
            self.thread = threading.Thread(target=self._run, name="pdxfer-settle", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        period = PERIOD_S
        while True:
            with self.cv:
                if self.closed:
                    return
                sessions = set(self.held) | set(self.transport.tainted_peers())
                if not sessions:
                    self.cv.wait(1.0)
                    period = PERIOD_S
                    continue
            progress = False
            for s in sorted(sessions):
                try:
                    ok = self.transport.settle(s)
                except Exception:  # noqa: BLE001 - this thread must outlive a transport error
                    log.exception("proving the path to %s quiet failed", s)
                    ok = False
                if not ok:
                    continue
                progress = True
                with self.cv:
                    jobs = self.held.pop(s, [])
                if jobs:
                    log.info("path to %s proven quiet: %d held messages go out", s, len(jobs))
                    self.count("settled", 1)
                for h in jobs:
                    h.run()
            now = time.monotonic()
            with self.cv:
                late = [h for hs in self.held.values() for h in hs if h.at < now]
                for s in list(self.held):
                    self.held[s] = [h for h in self.held[s] if h.at >= now]
                    if not self.held[s]:
                        del self.held[s]
            if late:
                log.warning("%d rooms gave up waiting for a quiet path to their decode: they "
                            "end without a message (their decodes keep the pages until it is "
                            "proven)", len(late))
                self.count("settle_given_up", len(late))
            for h in late:
                h.give_up()
            period = PERIOD_S if progress else min(MAX_PERIOD_S, period * 1.25)
            with self.cv:
                if not self.closed:
                    self.cv.wait(period)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
