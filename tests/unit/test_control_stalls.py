"""What holds a rank's control thread is counted and named: a Hello answered late costs the
decode retransmits and the whole bootstrap deadline's worth of waiting, and the TP 1 -> TP 2
vLLM failure (219 retransmitted Hellos, 110 s) left no trace of where the time went.

A prefill whose transport pairs slowly (``add_peer``, as NIXL's ``add_remote_agent`` runs on
the control thread) must show it in its metrics: the slow handler (``slow_handlers``, the
longest ``handler_max_ms``), the pairing (``add_peer_max_ms``); the decode shows how long it
waited for its HelloAck (``hello_wait_max_ms``)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer, KVPoll, wire
from pdxfer.endpoint.core import SLOW_S, Core
from pdxfer.endpoint.timed_lock import TimedLock
from tests.harness.memory_pair import Pair, transfer, until, wait

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
    srv: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    try:
        p.ptx.add_peer = slow_pairing  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="pdxfer"):
            _, rx, _, _ = transfer(p)
            assert wait(rx) == KVPoll.Success
        pm, dm = p.pf.metrics(), p.dc.metrics()
        assert pm["slow_handlers"] >= 1 and pm["handler_max_ms"] >= PAIRING_S * 1e3
        assert pm["add_peer_max_ms"] >= PAIRING_S * 1e3
        assert pm["hello_age_max_ms"] >= 0
        assert dm["hello_wait_max_ms"] >= PAIRING_S * 1e3 and dm["hello_retransmits"] >= 1
        assert any("in Hello" in r.getMessage() for r in caplog.records), caplog.text
        # the control thread's tick waited behind the handler: its lateness is kept and
        # logged with the process's CPU meanwhile
        assert pm["control_late_max_ms"] >= (PAIRING_S - 0.05) * 1e3
        assert any("ran" in r.getMessage() and "late" in r.getMessage() for r in caplog.records), (
            caplog.text
        )
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


def test_an_unanswered_hello_goes_again_less_and_less_often(srv: BootstrapServer) -> None:
    """A prefill slow to answer finds every copy of a Hello queued and answers each: at a
    fixed 0.5 s pace a 67 s wait sent 134 copies per decode rank on a loaded machine. The
    copies back off (0.5, 1, 2 s ...): within a 4 s deadline three go, where a fixed pace
    sends seven (a slower machine only sends fewer)."""
    p = Pair(srv, bootstrap_timeout_s=4.0, transfer_timeout_s=30.0)
    try:
        p.pf.core.handlers[wire.Hello] = lambda *a: None  # this prefill never answers
        _, rx, _, _ = transfer(p)
        assert wait(rx) == KVPoll.Failed
        assert "HelloAck" in str(rx.failure)
        assert 1 <= p.dc.metrics()["hello_retransmits"] <= 3
    finally:
        p.close()


def waiting_for_the_lock(name: str) -> bool:
    """Whether the thread called ``name`` is inside ``TimedLock.__enter__`` (waiting)."""
    ids = {t.ident for t in threading.enumerate() if t.name == name}
    frames = sys._current_frames()
    for i in ids:
        f = frames.get(i)
        while f is not None:
            if f.f_code is TimedLock.__enter__.__code__:
                return True
            f = f.f_back
    return False


def hold_the_lock(core: Core, started: threading.Event) -> None:
    """Hold ``core``'s lock until its control thread waits for it, then ``PAIRING_S`` more."""
    with core.lock:
        started.set()
        end = time.monotonic() + 30.0  # a bound on the wait for the event, not a stopwatch
        while not waiting_for_the_lock("pdxfer-prefill-control") and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(PAIRING_S)


def test_a_handler_held_up_by_the_endpoint_lock_says_so_and_names_the_holder(
    srv: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The TP 1 -> TP 2 stall left one 13.3 s Hello handler and no word of where the time
    went. Now the slow handler's line splits it (its own CPU, its wait for the endpoint
    lock, the rest without a CPU or the GIL), the lock's line names the function that held
    it, and the metrics keep the longest wait and hold."""
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    try:
        started = threading.Event()
        holder = threading.Thread(target=hold_the_lock, args=(p.pf.core, started))
        with caplog.at_level(logging.WARNING, logger="pdxfer.endpoint"):
            holder.start()
            started.wait()
            _, rx, _, _ = transfer(p)  # its Hello waits for the lock
            assert wait(rx) == KVPoll.Success
            holder.join()
        pm = p.pf.metrics()
        assert pm["lock_hold_max_ms"] >= PAIRING_S * 1e3
        assert pm["lock_wait_max_ms"] > 0
        held = [r.getMessage() for r in caplog.records if "lock was held" in r.getMessage()]
        assert held and "by hold_the_lock" in held[0], caplog.text
        slow = [r.getMessage() for r in caplog.records if "control thread spent" in r.getMessage()]
        assert slow, caplog.text
        waited = float(slow[0].split(" s waiting for the endpoint lock")[0].rsplit(", ", 1)[1])
        assert waited >= PAIRING_S, slow[0]
    finally:
        p.close()


def test_no_write_is_started_under_the_endpoint_lock_or_on_the_control_thread(
    srv: BootstrapServer,
) -> None:
    """A transport's ``start`` may wait on its peer (the first write to it can open the
    connection, and the caller's turn at the CPU under load is part of it): under the core
    lock every other thread, the control thread's Hello handler included, waited with it.
    ``send()`` now starts its small writes after releasing the lock, and a request for
    chunks already given is written by the room's worker, not started on the control
    thread. Bytes still land exactly."""
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    calls: list[tuple[bool, str]] = []
    start = p.ptx.start

    def watched(*a: object, **k: object) -> object:
        calls.append((p.pf.core.lock.owned(), threading.current_thread().name))
        return start(*a, **k)  # type: ignore[arg-type]

    try:
        p.ptx.start = watched  # type: ignore[method-assign]
        # the decode's request first: send() starts the write
        room = 1 << 40
        src, dst = p.pages(3)
        p.fill(room, src, 12)
        rx = p.receiver(room)
        rx.request({"kv": dst}, {"aux": 2}, 0, 12)
        assert until(lambda: p.pf.tables()["pending"] == 1)
        tx = p.pf.sender(room)
        tx.send({"kv": src}, {"aux": 1}, last=True)
        assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success
        assert p.wrong_bytes(room, dst, 12) == 0
        assert calls and not any(owned for owned, _ in calls), calls
        # the chunks first: the request, on the control thread, leaves the write to a worker
        calls.clear()
        room += 1
        src, dst = p.pages(3)
        p.fill(room, src, 12)
        tx = p.pf.sender(room)
        tx.send({"kv": src}, {"aux": 1}, last=True)
        rx = p.receiver(room)
        rx.request({"kv": dst}, {"aux": 2}, 0, 12)
        assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success
        assert p.wrong_bytes(room, dst, 12) == 0
        assert not any(owned or "control" in name for owned, name in calls), calls
    finally:
        p.close()


def test_neither_side_pairs_its_transport_under_the_endpoint_lock(srv: BootstrapServer) -> None:
    """Pairing can take long (NIXL loads the peer's metadata: ``add_peer``); at the HelloAck
    the decode did it under its endpoint lock, so every thread of the rank waited for it."""
    p = Pair(srv, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    owned: list[tuple[str, bool]] = []
    try:
        for side, tx in (("prefill", p.ptx), ("decode", p.dtx)):
            ep = p.pf if side == "prefill" else p.dc
            tx.add_peer = lambda peer, info, side=side, ep=ep: (  # type: ignore[method-assign]
                owned.append((side, ep.core.lock.owned()))
            )
        _, rx, _, _ = transfer(p)
        assert wait(rx) == KVPoll.Success
        assert sorted(owned) == [("decode", False), ("prefill", False)], owned
    finally:
        p.close()
