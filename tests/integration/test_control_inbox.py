"""The control socket's receive side (``endpoint.inbox``) against real ZMQ PUSH peers and raw
TCP peers speaking ZMTP by hand: what a frame costs before it is admitted, and that the memory
comes back. In this process: the inbox's pool is inspected directly."""

from __future__ import annotations

import collections
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from pdxfer import wire
from pdxfer.endpoint import inbox as I
from pdxfer.endpoint.control import Control
from tests.harness.zmqctx import context

GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def ready(kind: bytes) -> bytes:
    body = b"\x05READY" + bytes([11]) + b"Socket-Type" + len(kind).to_bytes(4, "big") + kind
    return bytes([0x04, len(body)]) + body


def prefix(size: int) -> bytes:
    return b"\x02" + size.to_bytes(8, "big")  # a long, final message frame


class Box:
    """A Control whose frame handler admits a frame when its header parses (no secret)."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.rejected: collections.Counter[str] = collections.Counter()
        self.c = Control(
            "127.0.0.1",
            self._frame,
            lambda: None,
            screen=self._screen,
            reject=lambda reason, text: self.rejected.update([reason]),
            max_frame=wire.MAX_FRAME + wire.HEADER_LEN,
        )
        self.pool = self.c._inbox.pool
        self.ctx = context()

    def _screen(self, head: memoryview, size: int) -> bool:
        try:
            wire.header(head, size)
        except wire.Rejected as e:
            self.rejected[e.reason] += 1
            return False
        return True

    def _frame(self, f: memoryview) -> bool:
        try:
            wire.header(f)
        except wire.Rejected as e:
            self.rejected[e.reason] += 1
            return False
        self.got.append(bytes(f))
        return True

    def push(self, kind: int = zmq.PUSH) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.connect(self.c.address)
        return s

    def raw(self, kind: bytes = b"PUSH") -> socket.socket:
        """A TCP peer that has done the ZMTP handshake by hand."""
        s = socket.create_connection(("127.0.0.1", int(self.c.address.rsplit(":", 1)[1])))
        s.sendall(GREETING + ready(kind))
        want = len(GREETING) + len(ready(b"PULL"))
        got = b""
        while len(got) < want:
            got += s.recv(want - len(got))
        assert got == GREETING + ready(b"PULL")
        return s

    def close(self) -> None:
        self.c.close()
        self.ctx.destroy()  # closes what a failed test left open (its sockets linger 0)


@pytest.fixture
def box() -> Iterator[Box]:
    b = Box()
    yield b
    b.close()


def until(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def frame(kind: type[wire.Msg], n: int, fill: int = 7) -> bytes:
    return wire.frame(bytes([fill]) * n, kind)


def test_a_refused_frame_costs_its_header_not_its_body(box: Box) -> None:
    p = box.push()
    big = frame(wire.Hello, wire.MAX_HELLO + (1 << 20))  # over the Hello cap
    taken = box.pool.taken
    for _ in range(50):
        p.send(big, copy=False)
    good = frame(wire.TransferRequest, 200 << 10, fill=3)
    p.send(good)
    until(lambda: box.got)
    assert box.rejected["oversized"] == 50
    assert box.got == [good]
    assert box.pool.taken - taken == I.RecvPool.cost(len(good))  # only the good one's body


def test_frames_before_authentication_hold_at_most_their_share_and_then_give_it_back(
    box: Box, monkeypatch
) -> None:
    """Raw peers that never delivered an admitted frame each start an 8 MiB frame and stall:
    together they hold at most the untrusted share; a peer whose frames were admitted still
    gets its large frame through; the stalled ones are cut at their deadline."""
    size = 8 << 20
    head = frame(wire.TransferRequest, size - wire.HEADER_LEN)[: wire.HEADER_LEN + 1024]
    stalled = [box.raw() for _ in range(4)]
    for s in stalled:
        s.sendall(prefix(size) + head)
    until(lambda: len(box.c._inbox._waiting) >= 2)
    assert box.pool.used_untrusted <= box.pool.untrusted
    trusted = box.push()
    trusted.send(frame(wire.Release, 10))
    until(lambda: len(box.got) == 1)
    large = frame(wire.TransferRequest, size, fill=5)
    trusted.send(large, copy=False)
    until(lambda: len(box.got) == 2)
    assert box.got[1] == large
    monkeypatch.setattr(I, "FRAME_S", 0.3)  # the stalled frames' deadline passes now
    until(lambda: box.c.connections() == 1, 10)
    assert box.pool.used == 0 and box.pool.used_untrusted == 0
    for s in stalled:
        s.close()


def test_receive_buffers_are_unmapped_once_idle(box: Box) -> None:
    p = box.push()
    frames = [frame(wire.TransferRequest, 3 << 20, fill=i) for i in range(10)]
    for f in frames:
        p.send(f, copy=False)
    until(lambda: len(box.got) == 10)
    assert box.got == frames  # byte-exact, in order, through reused buffers
    assert box.pool.mapped() > 0
    until(lambda: box.pool.mapped() == 0, I.IDLE_S + 5)


def test_only_zmq_push_peers_are_served_and_multipart_messages_are_dropped(box: Box) -> None:
    dealer = box.push(zmq.DEALER)
    with contextlib.suppress(zmq.Again):  # ZMQ drops a refused DEALER's pipe: send may find none
        dealer.send(frame(wire.Release, 10), zmq.NOBLOCK)
    p = box.push()
    p.send_multipart([frame(wire.Release, 10), frame(wire.Release, 10)])
    good = frame(wire.Abort, 20)
    p.send(good)
    # the parts came before ``good`` on its connection, and the dealer's connection was
    # closed at its handshake: once both are seen, nothing refused can still arrive
    until(
        lambda: box.got and box.rejected["malformed"] == 1 and box.c._inbox.closed_connections == 1
    )
    assert box.got == [good]  # not the dealer's frame, not the parts
    assert box.rejected["malformed"] == 1
    assert box.c.connections() == 1  # the dealer's connection was closed


def test_connections_past_the_cap_evict_the_oldest_unauthenticated_one(
    box: Box, monkeypatch
) -> None:
    monkeypatch.setattr(I, "MAX_CONNECTIONS", 4)
    p = box.push()
    p.send(frame(wire.Release, 10))
    until(lambda: len(box.got) == 1)  # an authenticated connection
    strangers = [
        socket.create_connection(("127.0.0.1", int(box.c.address.rsplit(":", 1)[1])))
        for _ in range(10)
    ]
    until(lambda: box.c._inbox.closed_connections >= 7)
    assert box.c.connections() <= 4
    p.send(frame(wire.Release, 11))
    until(lambda: len(box.got) == 2)  # the authenticated peer kept its connection
    for s in strangers:
        s.close()


# -- the send side (``endpoint.outbox``): what Control.send writes from the calling thread ------


def test_frames_sent_by_a_control_arrive_whole_and_in_order_past_a_full_socket(box: Box) -> None:
    """Small frames go out in the caller's ``sendmsg``; 3 MiB ones overflow the socket's
    buffer, so the rest goes out from the flusher thread, and later frames queue behind it."""
    peer = Box()
    try:
        frames = [
            frame(wire.TransferRequest, (3 << 20) if i % 7 == 3 else 10 + i, fill=i)
            for i in range(40)
        ]
        for f in frames:
            assert peer.c.send(box.c.address, f)
        until(lambda: len(box.got) == len(frames))
        assert box.got == frames
        assert peer.c.sockets() == 1
    finally:
        peer.close()


def test_a_connection_the_receiver_closed_is_dialled_again(box: Box) -> None:
    """The receiver drops the connection (as an inbox does at a deadline): the sender sees
    the end of the stream, and the next frames go out on a new connection."""
    peer = Box()
    try:
        peer.c.send(box.c.address, frame(wire.Release, 10))
        until(lambda: len(box.got) == 1)
        out = peer.c._outbox
        assert out is not None
        for c in list(box.c._inbox._conns.values()):
            box.c._inbox._close(c, "test")
        until(lambda: out.reconnects == 1)
        later = [frame(wire.Release, 10, fill=i) for i in range(5)]
        for f in later:
            peer.c.send(box.c.address, f)
        until(lambda: len(box.got) == 6)
        assert box.got[1:] == later
    finally:
        peer.close()


def test_frames_for_a_receiver_not_yet_listening_go_out_once_it_listens() -> None:
    """A refused connection is dialled again (backing off) with the frames kept, in order,
    after the PUSH greeting on the new connection and once the receiver's greeting came."""
    from pdxfer.endpoint.outbox import HELLO, Outbox

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    out = Outbox(4)
    try:
        frames = [bytes([i]) * (5 + i) for i in range(3)]
        for f in frames:
            assert out.send(f"tcp://127.0.0.1:{port}", f)
        time.sleep(0.1)  # a few refused dials
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        srv.settimeout(20)
        conn, _ = srv.accept()
        conn.sendall(I._HELLO)  # the receiver's greeting and READY: frames wait for them
        want = HELLO + b"".join(bytes([0, len(f)]) + f for f in frames)
        got = b""
        conn.settimeout(20)
        while len(got) < len(want):
            got += conn.recv(4096)
        assert got == want
        conn.close()
        srv.close()
    finally:
        out.close()


def test_frames_sent_by_a_control_reach_a_zmq_pull_socket() -> None:
    """libzmq drops a connection whose first frame arrives in the same read as the end of
    the greeting: frames wait for the receiver's READY, so a ZMQ PULL socket gets them."""
    peer = Box()
    try:
        pull = peer.ctx.socket(zmq.PULL)
        addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        frames = [frame(wire.Release, 10, fill=i) for i in range(3)]
        for f in frames:
            assert peer.c.send(addr, f)
        got = []
        for _ in frames:
            assert pull.poll(20_000)
            got.append(pull.recv())
        assert got == frames
    finally:
        peer.close()
