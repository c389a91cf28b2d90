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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..transport.base import Transport

log = logging.getLogger("pdxfer.sender")

PERIOD_S = 0.05
"""Between proof steps (the kernel samples of ``settle`` are this far apart)."""

MAX_PERIOD_S = 1.0
"""The period a path that keeps failing its fence backs off to."""


class Settler:
    """Held jobs per tainted decode session, run once the transport proves that session's
    path quiet; a thread that keeps proving while any session is tainted."""

    def __init__(self, transport: Transport, count: Callable[[str, int], None]) -> None:
        self.transport = transport
        self.count = count
        self.held: dict[str, list[Callable[[], None]]] = {}
        self.cv = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def hold(self, session: str, job: Callable[[], None]) -> None:
        """Run ``job`` (on this thread: it should only queue work) once ``session`` is proven
        quiet, or at once when it is not tainted."""
        with self.cv:
            self.held.setdefault(session, []).append(job)
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
                for job in jobs:
                    job()
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
