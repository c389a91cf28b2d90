"""Heartbeats: probe the peers that rooms wait on.

A decode rank probes the prefill endpoints its rooms wait on. Two failed probes in a row
fail its rooms. Whether their pages can be released depends on why the probes failed:

- the peer's host *refused* a connection to the peer's control port (it answered, and no
  process listens there): the process is gone, its writes cannot land, the pages are
  released (``dead``);
- anything else (a probe that hangs, a timeout, "network unreachable"): a frozen process,
  or a network that lost the peer. Either may still deliver a write (a frozen writer wakes
  up; TCP retransmits what it holds once a link heals), so the pages stay quarantined until
  the peer acknowledges the abort, or later refuses as above. A failure that comes back at
  once is no proof of death across a network: a host whose own link is down sees every
  connection fail at once while its peers are alive.

A prefill rank probes the decodes it holds rooms for (repair holds): a decode that is gone
will never send its Release, so its holds end at once. Verdicts go back through ``on_lost``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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

    def _probe(self, p: P, hang_s: float) -> tuple[bool, bool]:
        """(alive, gone): a failed probe is followed by a look at the peer's control port."""
        if self._probe_fn(p.session):
            return True, False
        return False, refuses(p.ctrl_addr, hang_s)

    def _run(self) -> None:
        probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdxfer-probe")
        pending: dict[str, tuple[Future[tuple[bool, bool]], float, P]] = {}
        hang_s = max(1.0, 2 * self.interval_s)
        try:
            while not self._stop.wait(self.interval_s):
                now = time.monotonic()
                for eid, p in self._watched().items():
                    if eid not in pending:
                        pending[eid] = (probes.submit(self._probe, p, hang_s), now, p)
                for eid, (fut, t0, p) in list(pending.items()):
                    if fut.done():
                        del pending[eid]
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
                    elif now - t0 > hang_s and not p.hung:
                        p.hung = True
                        self._on_lost(p, False)
        finally:
            probes.shutdown(wait=False, cancel_futures=True)
