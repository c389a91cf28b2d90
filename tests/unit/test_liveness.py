"""The heartbeat's hang verdict needs evidence: time it was there to see a probe unanswered.

Driven beat by beat with a test clock (``Liveness(start=False)``); the probes run on the
heartbeat's real probe threads and are answered when the test says so."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdxfer.endpoint.liveness import Liveness

INTERVAL = 2.0


@dataclass(eq=False)
class Peer:
    session: str = "127.0.0.1:1"
    ctrl_addr: str = "tcp://127.0.0.1:1"
    probe_failures: int = 0
    hung: bool = False


class Probes:
    """A peer that answers each probe only when the test lets it (a starved or frozen one)."""

    def __init__(self) -> None:
        self.sent = threading.Semaphore(0)
        self.answer = threading.Event()

    def __call__(self, session: str) -> bool:
        self.sent.release()
        self.answer.wait(30)
        return True


def heartbeat(probes: Probes) -> tuple[Liveness[Peer], Peer, list[bool], list[float]]:
    peer, lost, clock = Peer(), [], [0.0]
    lv = Liveness(
        INTERVAL,
        lambda: {"p": peer},
        probes,
        lambda p, gone: lost.append(gone),
        clock=lambda: clock[0],
        start=False,
    )
    return lv, peer, lost, clock


def test_a_heartbeat_that_was_starved_itself_does_not_call_a_live_peer_hung() -> None:
    """The heartbeat sleeps far past the hang limit (its process starved) while its probe
    is out: waking, it has no evidence against the peer; the answer, handed back on the
    next beat, keeps the peer alive."""
    probes = Probes()
    lv, peer, lost, clock = heartbeat(probes)
    try:
        lv.beat()  # the probe leaves
        assert probes.sent.acquire(timeout=10)
        clock[0] += 10 * lv.hang_s  # nothing of this process ran meanwhile
        lv.beat()
        assert lost == [] and not peer.hung
        probes.answer.set()
        for _ in range(50):  # the probe thread hands its answer back
            clock[0] += INTERVAL
            lv.beat()
            if probes.sent.acquire(timeout=0.1):
                break
        assert lost == [] and not peer.hung and peer.probe_failures == 0
    finally:
        probes.answer.set()
        lv.close()


def test_a_peer_that_never_answers_is_called_hung_after_the_hang_limit() -> None:
    """Beats on time and the probe still unanswered past the hang limit: hung, once."""
    probes = Probes()
    lv, peer, lost, clock = heartbeat(probes)
    try:
        lv.beat()
        assert probes.sent.acquire(timeout=10)
        beats = 0
        while not lost:
            clock[0] += INTERVAL
            lv.beat()
            beats += 1
            assert beats <= 4, "a peer that never answers was never called hung"
        assert lost == [False] and peer.hung
        assert beats * INTERVAL > lv.hang_s
        clock[0] += INTERVAL
        lv.beat()
        assert lost == [False]  # one verdict per episode
    finally:
        probes.answer.set()
        lv.close()
