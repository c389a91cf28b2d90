"""What holds a rank's control thread is counted and named: a Hello answered late costs the
decode retransmits and the whole bootstrap deadline's worth of waiting, and the TP 1 -> TP 2
vLLM failure (219 retransmitted Hellos, 110 s) left no trace of where the time went.

A prefill whose transport pairs slowly (``add_peer``, as NIXL's ``add_remote_agent`` runs on
the control thread) must show it in its metrics: the slow handler (``slow_handlers``, the
longest ``handler_max_ms``), the pairing (``add_peer_max_ms``); the decode shows how long it
waited for its HelloAck (``hello_wait_max_ms``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer, KVPoll
from pdxfer.endpoint.core import SLOW_S

from .test_state_machines import Pair, transfer, wait

PAIRING_S = SLOW_S + 0.3


PAIRINGS: list[str] = []


def slow_pairing(peer: str, info: bytes) -> None:
    PAIRINGS.append(peer)
    time.sleep(PAIRING_S)


@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


def test_a_slow_pairing_on_the_control_thread_is_counted_and_named(
        srv: BootstrapServer, caplog: pytest.LogCaptureFixture) -> None:
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    try:
        p.ptx.add_peer = slow_pairing  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="pdxfer.endpoint"):
            _, rx, _, _ = transfer(p)
            assert wait(rx) == KVPoll.Success
        pm, dm = p.pf.metrics(), p.dc.metrics()
        assert pm["slow_handlers"] >= 1 and pm["handler_max_ms"] >= PAIRING_S * 1e3
        assert pm["add_peer_max_ms"] >= PAIRING_S * 1e3
        assert pm["hello_age_max_ms"] >= 0
        assert dm["hello_wait_max_ms"] >= PAIRING_S * 1e3 and dm["hello_retransmits"] >= 1
        assert any("in Hello" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        p.close()


def test_a_retransmitted_hello_is_answered_again_not_paired_again(srv: BootstrapServer) -> None:
    """Without a secret too: the Hellos a decode retransmitted while the prefill's control
    thread was held up reach it as a queue once it is free; each gets the same HelloAck,
    and the peer is paired once (not once per copy, each replacing the last)."""
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    try:
        PAIRINGS.clear()
        p.ptx.add_peer = slow_pairing  # type: ignore[method-assign]
        _, rx, _, _ = transfer(p)
        assert wait(rx) == KVPoll.Success
        tries = p.dc.metrics()["hello_retransmits"]
        assert tries >= 1
        end = time.monotonic() + 30.0  # a bound on the wait for the event, not a stopwatch
        while p.pf.metrics().get("hello_repeats", 0) < tries and time.monotonic() < end:
            time.sleep(0.05)
        assert p.pf.metrics().get("hello_repeats", 0) == tries
        assert [p.dc.transport.session_id] == PAIRINGS
        _, rx, _, _ = transfer(p)  # the pair still works
        assert wait(rx) == KVPoll.Success
    finally:
        p.close()
