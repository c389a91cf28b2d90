"""The core's lock, timed: how long threads waited for it and how long one held it.

A rank's control thread needs the core lock for nearly every message (a Hello, a request, a
counter). When a Hello is answered seconds late, the question is whether the control thread
waited for this lock (another thread held it across something slow), ran out of CPU or GIL,
or did slow work itself; ``Core.timed`` answers it from these figures and the handler's own
CPU time. Re-entrant like ``threading.RLock``; used only as a context manager.

Costs on the uncontended path: one non-blocking acquire, two clock reads per outermost hold.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger(__name__)


class TimedLock:
    """``threading.RLock`` with the longest wait (``wait_max_s``) and the longest outermost
    hold (``hold_max_s``, by ``hold_site``: the function that took it); a hold longer than
    ``slow_s`` is logged (at most once a second) naming that function."""

    def __init__(self, slow_s: float = 1.0) -> None:
        self._lock = threading.RLock()
        self._slow_s = slow_s
        self._depth = 0
        self._since = 0.0
        self._site = ""
        self._local = threading.local()
        self._logged = 0.0
        self.wait_max_s = 0.0
        self.hold_max_s = 0.0
        self.hold_site = ""

    def owned(self) -> bool:
        """Whether the calling thread holds this lock."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]  # RLock's, not in stubs

    def waited(self) -> float:
        """Seconds the calling thread has waited for this lock so far (all its waits)."""
        return getattr(self._local, "waited", 0.0)

    def __enter__(self) -> TimedLock:
        if not self._lock.acquire(blocking=False):
            t0 = time.perf_counter()
            self._lock.acquire()
            w = time.perf_counter() - t0
            self._local.waited = getattr(self._local, "waited", 0.0) + w
            if w > self.wait_max_s:
                self.wait_max_s = w
        # only the holder touches what follows
        self._depth += 1
        if self._depth == 1:
            self._since = time.perf_counter()
            self._site = sys._getframe(1).f_code.co_name
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            self._lock.release()
            return
        held = time.perf_counter() - self._since
        site = self._site
        if held > self.hold_max_s:
            self.hold_max_s, self.hold_site = held, site
        slow = held >= self._slow_s and time.monotonic() - self._logged >= 1.0
        if slow:
            self._logged = time.monotonic()
        self._lock.release()
        if slow:
            log.warning(
                "the endpoint lock was held %.1f s by %s on thread %s (every other "
                "thread that needed it waited)",
                held,
                site,
                threading.current_thread().name,
            )


class Clocks:
    """Where one run of a thread's work spent its time: its wall time, its own CPU, its
    waits for a ``TimedLock`` and the CPU its whole process used meanwhile. What is left of
    the wall time after the first two, the thread was runnable without a CPU or the GIL:
    with the process using a CPU's worth meanwhile, its other threads held the GIL; with it
    using little, the machine gave the process little CPU."""

    __slots__ = ("cpu", "proc", "waited", "wall")

    def __init__(self, wall: float, cpu: float, waited: float, proc: float) -> None:
        self.wall, self.cpu, self.waited, self.proc = wall, cpu, waited, proc

    @staticmethod
    def now(lock: TimedLock) -> Clocks:
        """The clocks' readings now (``since`` turns them into a run's figures)."""
        return Clocks(time.perf_counter(), time.thread_time(), lock.waited(), time.process_time())

    def since(self, lock: TimedLock) -> Clocks:
        return Clocks(
            time.perf_counter() - self.wall,
            time.thread_time() - self.cpu,
            lock.waited() - self.waited,
            time.process_time() - self.proc,
        )

    def explain(self) -> str:
        rest = max(0.0, self.wall - self.cpu - self.waited)
        return (
            f"{self.cpu:.3f} s its own CPU, {self.waited:.3f} s waiting for the endpoint "
            f"lock, {rest:.3f} s waiting for a CPU or the GIL (the process used "
            f"{self.proc:.3f} s of CPU meanwhile)"
        )
