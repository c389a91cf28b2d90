"""Heartbeats: probe the peers that rooms wait on.

A decode rank probes the prefill endpoints its rooms wait on. A probe refused at once means
the process is gone: its writes cannot land, so its rooms fail and their pages are released.
A probe that hangs (a frozen or overloaded process) fails the rooms too, but their pages stay
quarantined until the peer acknowledges the abort: a frozen writer may still wake up and
write. A prefill rank probes the decodes it holds rooms for (repair holds): a decode that is
gone will never send its Release, so its holds end at once. Verdicts go back through
``on_lost``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar


class Probed(Protocol):
    """A peer as the heartbeat sees it (``PrefillPeer``, ``DecodePeer``)."""

    session: str
    probe_failures: int
    hung: bool


P = TypeVar("P", bound=Probed)


class Liveness(Generic[P]):
    """One heartbeat thread; ``watched()`` names the peers to probe on each beat."""

    def __init__(self, interval_s: float, watched: Callable[[], dict[str, P]],
                 probe: Callable[[str], bool], on_lost: Callable[[P, bool], None],
                 name: str = "pdxfer-heartbeat") -> None:
        self.interval_s = interval_s
        self._watched, self._probe_fn, self._on_lost = watched, probe, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop and join the heartbeat. A probe still waiting on a frozen peer is left to
        the transport's own timeout (its thread holds nothing of ours)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _probe(self, session: str) -> tuple[bool, float]:
        t0 = time.monotonic()
        return self._probe_fn(session), time.monotonic() - t0

    def _run(self) -> None:
        probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdxfer-probe")
        pending: dict[str, tuple[Future[tuple[bool, float]], float, P]] = {}
        hang_s = max(1.0, 2 * self.interval_s)
        try:
            while not self._stop.wait(self.interval_s):
                now = time.monotonic()
                for eid, p in self._watched().items():
                    if eid not in pending:
                        pending[eid] = (probes.submit(self._probe, p.session), now, p)
                for eid, (fut, t0, p) in list(pending.items()):
                    if fut.done():
                        del pending[eid]
                        alive, took = fut.result()
                        if alive:
                            p.probe_failures, p.hung = 0, False
                        else:
                            p.probe_failures += 1
                            if p.probe_failures >= 2:
                                self._on_lost(p, took < hang_s)
                    elif now - t0 > hang_s and not p.hung:
                        p.hung = True
                        self._on_lost(p, False)
        finally:
            probes.shutdown(wait=False, cancel_futures=True)
