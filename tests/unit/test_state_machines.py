"""Sender and receiver state machines, in one process over the in-memory transport.

Both endpoints are real (ZMQ control on loopback, an in-process bootstrap server); only the
transport is ``MemoryTransport``, which really copies bytes and lets a test delay or fail
writes. So every path can be driven quickly: aborts in every state, every deadline, duplicate
rooms, late and repeated messages, a write that fails halfway, and the one release per failed
request that the engine's page lifetime depends on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdxfer import (
    BootstrapServer,
    DuplicateRoom,
    KVPoll,
    PlanError,
    wire,
)
from tests.harness.memory_pair import (
    Pair,
    rooms,
    stranded_room,
    transfer,
    until,
    wait,
)

HOLD_S = 60.0
"""The hold deadline of the dead-decode test: the heartbeat must end the hold long before."""


@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


@pytest.fixture
def pair(srv: BootstrapServer) -> Iterator[Pair]:
    p = Pair(srv)
    yield p
    p.close()


def test_bytes_land_exactly_with_scattered_pages_and_chunks(pair: Pair) -> None:
    for tokens, chunks in ((1, 1), (24, 2), (97, 3)):
        tx, rx, room, dst = transfer(pair, tokens, chunks)
        assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success, rx.failure
        assert pair.wrong_bytes(room, dst, tokens) == 0
        assert pair.released[room] == 0  # a successful request's pages stay the engine's


def test_decode_abort_in_every_state_releases_exactly_once(pair: Pair) -> None:
    # Bootstrapping: aborted before its request was sent
    room = next(rooms)
    rx = pair.receiver(room)
    rx.abort("early")
    assert rx.poll() == KVPoll.Failed and until(lambda: pair.released[room] == 1)
    # WaitingForInput: the prefill never sends
    room = next(rooms)
    rx = pair.receiver(room)
    rx.request({"kv": [1, 2]}, {"aux": 2}, 0, 8)
    assert until(lambda: rx.poll() == KVPoll.WaitingForInput)
    rx.abort("waiting")
    assert until(lambda: pair.released[room] == 1)
    # Transferring: writes in flight (slow network); pages come back only after they drained
    pair.ptx.faults.delay_s = 1.0  # a write stays in flight this long
    tx, rx, room, dst = transfer(pair, 24, 2)
    assert until(lambda: pair.ptx.credits(pair.dtx.session_id).used > 0)  # one is in flight
    rx.abort("transferring")
    assert pair.released[room] == 0  # a write may still land
    assert until(lambda: pair.released[room] == 1)
    assert wait(tx) == KVPoll.Failed
    pair.ptx.faults.delay_s = 0.0
    # after Success: abort changes nothing, nothing is released
    tx, rx, room, dst = transfer(pair)
    assert wait(rx) == KVPoll.Success
    rx.abort("too late")
    assert rx.poll() == KVPoll.Success and pair.released[room] == 0
    # every room is forgotten (its release claimed, if it failed): nothing is left that could
    # release again, so the counts below are final
    assert until(lambda: pair.dc.tables()["rooms"] == 0, timeout=120), pair.dc.tables()
    assert pair.released[room] == 0 and all(v == 1 for r, v in pair.released.items() if r != room)


def test_prefill_abort_fails_the_decode_and_releases_once(pair: Pair) -> None:
    room = next(rooms)
    rx = pair.receiver(room)
    rx.request({"kv": [3, 4]}, {"aux": 2}, 0, 8)
    tx = pair.pf.sender(room)
    assert until(lambda: tx.prefix_len is not None)
    tx.abort("engine gave up")
    assert wait(rx) == KVPoll.Failed and rx.failure.kind == "aborted", rx.failure
    assert until(lambda: pair.released[room] == 1)


def test_every_deadline_fails_with_its_reason(pair: Pair) -> None:
    # bootstrap: the decode asks for an instance nobody registered
    room = next(rooms)
    rx = pair.dc.receiver(room, instance="nobody", release=lambda d, s: None)
    rx.request({"kv": [1]}, {"aux": 2}, 0, 4)
    assert wait(rx, 10) == KVPoll.Failed
    # prefill: the decode never asks
    tx = pair.pf.sender(next(rooms))
    tx.send({"kv": [5]}, {"aux": 1}, last=True)
    assert wait(tx, 10) == KVPoll.Failed and tx.failure.kind == "deadline", tx.failure
    assert "no request from the decode" in str(tx.failure)
    # transfer: the prefill never opens the room; the decode fails at its deadline, or as
    # unknown_room if the prefill's grace for unknown rooms ran out first
    room = next(rooms)
    rx = pair.receiver(room)
    rx.request({"kv": [6]}, {"aux": 2}, 0, 4)
    assert wait(rx, 10) == KVPoll.Failed, rx.failure
    assert rx.failure.kind in ("deadline", "unknown_room"), rx.failure
    assert until(lambda: pair.released[room] == 1)


def test_pages_are_quarantined_until_a_delayed_write_drains(pair: Pair) -> None:
    # 3 s, 10x abort_timeout_s: the AbortAck is late, and the quarantine is seen before the
    # write drains even on a loaded machine
    pair.ptx.faults.delay_s = 3.0
    tx, rx, room, dst = transfer(pair, 8, 1)
    assert until(lambda: pair.ptx.credits(pair.dtx.session_id).used > 0)
    rx.abort("stop")
    assert until(lambda: rx.quarantined)
    assert pair.dc.metrics()["quarantined_pages"] >= len(dst)
    assert pair.released[room] == 0
    pair.ptx.faults.delay_s = 0.0
    assert until(lambda: pair.released[room] == 1)
    assert pair.dc.metrics()["quarantined_pages"] == 0


def test_a_failed_write_still_on_its_way_keeps_the_pages_until_it_landed(
    srv: BootstrapServer,
) -> None:
    """Mooncake TCP reports a write failed while some of it is still queued or buffered on
    the way (a flapping link): the prefill tells the decode the room is over only once the
    transport proves nothing more lands, so the pages come back after the late bytes."""
    p = Pair(srv)
    released: dict[int, float] = {}
    try:
        # each batch fails at once and lands 1 s later
        room, rx, tx = stranded_room(p, 1.0, released)
        assert wait(rx) == KVPoll.Failed and rx.failure.kind == "transport", rx.failure
        assert until(lambda: room in released)
        assert p.ptx.faults.landed, "the stranded batch never landed"
        assert released[room] >= p.ptx.faults.landed[0], (
            "pages handed back while a failed write was still on its way"
        )
        assert p.pf.metrics()["settle_waits"] >= 1
        p.ptx.faults.strand_s = 0.0
        tx, rx, room, dst = transfer(p)  # the proof is over: the next request is unaffected
        assert wait(rx) == KVPoll.Success and p.wrong_bytes(room, dst, 24) == 0
    finally:
        p.close()


def test_a_room_held_past_its_deadline_ends_and_its_abort_ack_still_waits(
    srv: BootstrapServer,
) -> None:
    """The failed write takes longer to land than the transfer deadline (2 s): the prefill
    gives the room up (its engine gets the source pages back) without telling the decode,
    whose own deadline fails it; its Abort then finds the room gone, and that ack too
    waits until the bytes landed."""
    p = Pair(srv)
    released: dict[int, float] = {}
    try:
        room, rx, tx = stranded_room(p, 4.0, released)
        assert wait(rx) == KVPoll.Failed and rx.failure.kind == "deadline", rx.failure
        assert until(lambda: not tx.reading)  # given up: the source pages are the engine's
        assert p.pf.metrics()["settle_given_up"] == 1
        assert until(lambda: room in released)
        assert p.ptx.faults.landed and released[room] >= p.ptx.faults.landed[0], (
            "pages handed back while a failed write was still on its way"
        )
        assert p.pf.metrics()["abort_acks_held"] >= 1
    finally:
        p.close()


def test_duplicate_rooms_are_refused(pair: Pair) -> None:
    room = next(rooms)
    rx = pair.receiver(room)
    with pytest.raises(DuplicateRoom):
        pair.dc.receiver(room)
    tx = pair.pf.sender(room)
    with pytest.raises(DuplicateRoom):
        pair.pf.sender(room)
    rx.abort()
    tx.abort()


def test_late_or_repeated_transfer_done_changes_nothing(pair: Pair) -> None:
    tx, rx, room, dst = transfer(pair)
    assert wait(rx) == KVPoll.Success
    stale = pair.dc.metrics().get("stale_messages", 0)
    side = pair.dc.decode
    assert side is not None
    done = wire.TransferDone(
        room=room,
        nonce=1,
        endpoint_id=pair.pf.endpoint_id,
        rank=0,
        ok=False,
        reason="late",
        kind="transport",
    )
    side.on_done(done, None, None)  # a stale nonce, for a room that already succeeded
    side.on_done(done, None, None)
    assert rx.poll() == KVPoll.Success and rx.failure is None
    assert pair.dc.metrics()["stale_messages"] == stale + 2
    assert pair.released[room] == 0


def test_a_write_that_fails_halfway_fails_both_sides_releases_once_and_leaks_no_credit(
    srv: BootstrapServer,
) -> None:
    p = Pair(srv, batch_entries=4)  # many batches per write
    try:
        p.ptx.faults.fail_after_batches = 1  # the first batch lands, the second fails
        tx, rx, room, dst = transfer(p, 64, 1)
        assert wait(rx) == KVPoll.Failed and wait(tx) == KVPoll.Failed
        assert rx.failure.kind == "transport", rx.failure  # the kind the prefill named
        assert until(lambda: p.released[room] == 1)
        assert p.ptx.credits(p.dtx.session_id).used == 0  # every batch's credits came back
        assert p.ptx.stats.failures == 1 and p.ptx.faults.batches == 1
        p.ptx.faults.fail_after_batches = None
        tx, rx, room, dst = transfer(p, 64, 1)  # the next request is unaffected
        assert wait(rx) == KVPoll.Success and p.wrong_bytes(room, dst, 64) == 0
    finally:
        p.close()


def test_remote_failure_kind_survives_the_wire(pair: Pair) -> None:
    """The prefill fails a room with a plan error (it was handed fewer pages than the decode
    asked for): the decode fails with the same class, not a generic remote failure."""
    room = next(rooms)
    rx = pair.receiver(room)
    rx.request({"kv": [7, 8, 9]}, {"aux": 2}, 0, 12)
    tx = pair.pf.sender(room)
    tx.send({"kv": [10]}, {"aux": 1}, last=True)  # 4 tokens of 12
    assert wait(rx) == KVPoll.Failed
    assert isinstance(rx.failure, PlanError) and rx.failure.kind == "plan", rx.failure
    assert until(lambda: pair.released[room] == 1)


def test_release_is_called_once_under_concurrent_aborts(pair: Pair) -> None:
    pair.ptx.faults.delay_s = 0.05
    held = []
    for _ in range(10):
        tx, rx, room, dst = transfer(pair, 16, 2)
        held.append((tx, rx, room))
    threads = [threading.Thread(target=h.abort) for tx, rx, _ in held for h in (tx, rx)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pair.ptx.faults.delay_s = 0.0
    assert until(lambda: all(pair.released[r] == 1 for _, _, r in held))
    # the decode forgot every room: no state is left that could release one again
    assert until(lambda: pair.dc.tables()["rooms"] == 0, timeout=120), pair.dc.tables()
    assert all(pair.released[r] == 1 for _, _, r in held)


def test_a_digest_the_prefill_cannot_take_fails_that_request_not_its_worker(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool the digest cannot read (say a device the portable digest does not support)
    must not kill the worker mid-room: the write completes, the decode fails the request
    for the range no digest covers, and the next request is served as usual."""
    from pdxfer import integrity

    real = integrity.digests

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("this device cannot be read")

    monkeypatch.setattr(integrity, "digests", broken)
    tx, rx, room, dst = transfer(pair, 24, 2)
    assert wait(rx) == KVPoll.Failed and rx.failure.kind == "integrity", rx.failure
    assert "no digest covers pool 'kv'" in str(rx.failure)
    assert wait(tx) == KVPoll.Success
    assert pair.pf.metrics()["integrity_digest_errors"] >= 1
    monkeypatch.setattr(integrity, "digests", real)
    tx, rx, room, dst = transfer(pair, 24, 2)
    assert wait(rx) == KVPoll.Success and pair.wrong_bytes(room, dst, 24) == 0


def test_a_dead_decodes_repair_holds_end_without_waiting_for_their_deadline(
    srv: BootstrapServer,
) -> None:
    """A prefill keeps a held room's pages for its decode's repair until that decode's
    Release; a decode that died will never send it, so the heartbeat ends its holds (the
    engine gets the pages back) long before the hold deadline (``transfer_timeout_s``)."""
    p = Pair(srv, transfer_timeout_s=HOLD_S)
    try:
        room = next(rooms)
        src, dst = p.pages(4)
        p.fill(room, src, 16)
        rx = p.receiver(room)
        rx.request({"kv": dst}, {"aux": 2}, 0, 16, hold_for_repair=True)
        tx = p.pf.sender(room)
        tx.send({"kv": src}, {"aux": 1}, last=True)
        assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success
        assert until(lambda: tx.holding)  # held for the decode's repair
        p.dc.close()  # the decode is gone: no Release will come
        # the heartbeat ends it: a third of the hold deadline is a hang detector with room
        # for a loaded machine, far short of the deadline that would end it anyway
        assert until(lambda: not tx.holding, HOLD_S / 3), "still held for a dead decode"
        assert until(lambda: p.pf.tables()["rooms"] == 0)
        assert p.pf.metrics()["holds_dropped"] == 1
    finally:
        p.close()


def test_an_expected_room_waits_past_the_grace_and_an_unknown_one_does_not(
    srv: BootstrapServer,
) -> None:
    """Early dispatch: the decode asks before the prefill's engine opens the room. A room the
    engine declared (``expect``: it holds the request, queued) waits for it past
    ``room_grace_s``, whether declared before or after the decode asked; a room it never
    declared still fails fast as ``unknown_room``. The late-opened rooms' bytes land exactly."""
    p = Pair(srv, room_grace_s=0.2, bootstrap_timeout_s=30.0, transfer_timeout_s=30.0)
    try:
        before, after, unknown = next(rooms), next(rooms), next(rooms)
        p.pf.expect(before, decode=None)
        p.pf.expect(before)  # idempotent
        asked = {}
        for i, room in enumerate((before, after, unknown)):
            src, dst = [3 * i, 3 * i + 1, 3 * i + 2], [40 + 3 * i, 41 + 3 * i, 42 + 3 * i]
            asked[room] = (src, dst, p.receiver(room))
            asked[room][2].request({"kv": dst}, {"aux": 2}, 0, 10)
        assert until(lambda: p.pf.tables()["pending"] >= 2)
        p.pf.expect(after)  # declared once its decode already waits
        # the grace has passed once the undeclared room failed
        rx = asked[unknown][2]
        assert wait(rx, 10) == KVPoll.Failed and rx.failure.kind == "unknown_room", rx.failure
        assert p.pf.tables()["expected"] == 2
        for room in (before, after):
            src, dst, rx = asked[room]
            assert not rx.poll().terminal, rx.failure
            p.fill(room, src, 10)  # the rooms share the slot pool's slot: one at a time
            tx = p.pf.sender(room)
            tx.send({"kv": src}, {"aux": 1}, last=True)
            assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success, rx.failure
            assert p.wrong_bytes(room, dst, 10) == 0
        assert p.pf.tables()["expected"] == 0  # forgotten once opened
        p.pf.expect(before)  # the engine reuses the room for a new request: allowed
        assert p.pf.tables()["expected"] == 1
    finally:
        p.close()


def test_a_withdrawn_expected_room_fails_its_decode_at_once_as_aborted(
    srv: BootstrapServer,
) -> None:
    """An engine that aborts a queued request it declared withdraws the room: the decode
    waiting for it fails now (``aborted``), not at the bootstrap deadline, and so does a
    decode that asks later."""
    p = Pair(srv, room_grace_s=0.2, bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)
    try:
        room = next(rooms)
        p.pf.expect(room)
        rx = p.receiver(room)
        rx.request({"kv": [3]}, {"aux": 2}, 0, 4)
        assert until(lambda: p.pf.tables()["pending"] == 1)
        p.pf.withdraw(room, "cancelled by the test")
        assert wait(rx, 10) == KVPoll.Failed and rx.failure.kind == "aborted", rx.failure
        assert "cancelled by the test" in str(rx.failure)
        assert until(lambda: p.released[room] == 1)
        assert p.pf.tables()["expected"] == 0 and p.pf.tables()["pending"] == 0
        late = p.receiver(room)  # a decode that asks after the withdrawal
        late.request({"kv": [4]}, {"aux": 2}, 0, 4)
        assert wait(late, 10) == KVPoll.Failed and late.failure.kind == "aborted", late.failure
    finally:
        p.close()


def test_expected_rooms_are_validated_and_bounded(srv: BootstrapServer) -> None:
    """A buggy or hostile engine cannot grow the table of expected rooms past its cap (the
    oldest are forgotten) nor put a malformed room in it."""
    p = Pair(srv, max_tombstones=4)
    try:
        for bad in (-1, 1 << 64, "7", True, 1.0):
            with pytest.raises(PlanError):
                p.pf.expect(bad)  # type: ignore[arg-type]
        with pytest.raises(PlanError):
            p.pf.expect(1, decode="")
        for room in range(10):
            p.pf.expect(room)
        assert p.pf.tables()["expected"] == 4
        assert p.pf.metrics()["expected_evicted"] == 6
        p.pf.withdraw(123456)  # never expected: nothing happens
        with pytest.raises(Exception, match="prefill"):
            p.dc.expect(1)
    finally:
        p.close()
