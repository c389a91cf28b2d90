"""Heartbeats: probe the peers that rooms wait on.

A decode rank probes the prefill endpoints its rooms wait on; two failed probes in a row
fail its rooms. Their pages are released only when the peer's host *refused* a connection
to the peer's control port (nothing listens there: the process is gone, ``dead``). Anything
else (a hang, a timeout, "network unreachable") may be a frozen process or a network that
lost the peer, and either may still deliver a write (a frozen writer wakes up; TCP
retransmits once a link heals), so the pages stay quarantined until the peer acknowledges
the abort or later refuses. A failure that comes back at once proves nothing across a
network: a host whose own link is down sees every connection fail at once.

A prefill rank probes the decodes it holds rooms for (repair holds): a decode that is gone
will never send its Release, so its holds end at once. Verdicts go back through ``on_lost``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Probed(Protocol):
    """A peer as the heartbeat sees it (``PrefillPeer``, ``DecodePeer``)."""

    session: str
    ctrl_addr: str
    probe_failures: int
    hung: bool


def refuses(ctrl_addr: str, timeout: float) -> bool:
    """Whether the peer's host refuses a connection to its control port: the host is up and
    nothing listens, so the process is gone (a timeout or an unreachable network proves
    nothing about the process)."""
    host, _, port = ctrl_addr.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


P = TypeVar("P", bound=Probed)


@dataclass(slots=True, eq=False)
class _Pending(Generic[P]):
    """One probe on its way: when it really left (None while it waits for a probe thread)
    and how long the heartbeat has seen it unanswered."""

    peer: P
    fut: Future[tuple[bool, bool]] | None = None
    started: float | None = None
    unanswered_s: float = 0.0


class Liveness(Generic[P]):
    """One heartbeat thread; ``watched()`` names the peers to probe on each beat.

    A probe that stays unanswered is a hang verdict only on evidence: the time counted is
    time this process was there to see it, from when the probe really left, and each beat
    counts at most one interval. A heartbeat that itself was starved (the engine's compute
    held the CPU or the GIL for seconds) wakes to find its probe unanswered only because
    nothing here ran -- the probe thread may hold the answer, not yet handed back -- and
    that is no evidence against the peer: it is then looked at again on the next beats,
    which a live peer's answer reaches first."""

    def __init__(
        self,
        interval_s: float,
        watched: Callable[[], dict[str, P]],
        probe: Callable[[str], bool],
        on_lost: Callable[[P, bool], None],
        name: str = "pdxfer-heartbeat",
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        """``clock`` and ``start=False`` (then ``beat()`` by hand) are for tests."""
        self.interval_s = interval_s
        self.hang_s = max(1.0, 2 * interval_s)
        self._watched, self._probe_fn, self._on_lost = watched, probe, on_lost
        self._clock = clock
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdxfer-probe")
        self._pending: dict[str, _Pending[P]] = {}
        self._last_beat: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self._thread.start()

    def close(self) -> None:
        """Stop and join the heartbeat. A probe still waiting on a frozen peer is left to
        the transport's own timeout (its thread holds nothing of ours)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._probes.shutdown(wait=False, cancel_futures=True)

    def _probe(self, rec: _Pending[P]) -> tuple[bool, bool]:
        """(alive, gone): a failed probe is followed by a look at the peer's control port."""
        rec.started = self._clock()
        if self._probe_fn(rec.peer.session):
            return True, False
        return False, refuses(rec.peer.ctrl_addr, self.hang_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def beat(self) -> None:
        """One heartbeat: probe the watched peers, judge the answers that came back, and
        count the unanswered probes' time (see the class notes)."""
        now = self._clock()
        seen = (
            self.interval_s
            if self._last_beat is None
            else min(now - self._last_beat, self.interval_s)
        )
        self._last_beat = now
        for eid, p in self._watched().items():
            if eid not in self._pending:
                rec = _Pending(p)
                self._pending[eid] = rec
                rec.fut = self._probes.submit(self._probe, rec)
        for eid, rec in list(self._pending.items()):
            p, fut = rec.peer, rec.fut
            assert fut is not None
            if fut.done():
                del self._pending[eid]
                alive, gone = fut.result()
                if alive:
                    p.probe_failures, p.hung = 0, False
                else:
                    p.probe_failures += 1
                    # one "not responding" verdict per episode (a partition fails a
                    # probe every beat); a later refusal still declares it dead
                    if p.probe_failures >= 2 and (gone or not p.hung):
                        p.hung = not gone
                        self._on_lost(p, gone)
            elif rec.started is not None:
                rec.unanswered_s += min(seen, now - rec.started)
                if rec.unanswered_s > self.hang_s and not p.hung:
                    p.hung = True
                    self._on_lost(p, False)
