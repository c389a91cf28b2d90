"""Bad input: mismatched layouts, hostile requests, duplicates, unknown rooms.

The hostile decode runs in the test process with a real Mooncake engine and real registered
buffers, so "refused before any write" is checked on actual memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from pdxfer import BootstrapClient, BootstrapServer, wire
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.pools import layout_signature
from pdxfer.transport import MooncakeTransport
from tests.harness.zmqctx import context

from .conftest import start_pair

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=16, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module")
def pair(bootstrap: BootstrapServer) -> Iterator[tuple[Agent, Agent]]:
    pf, dc = start_pair(bootstrap, GEOMS)
    yield pf, dc
    pf.close()
    dc.close()


class Hostile:
    """A hand-rolled decode endpoint: real transport and buffers, raw control messages."""

    def __init__(self, prefill_ctrl: str) -> None:
        self.specs, self.tensors = pat.build(GEOMS)
        pat.fill_sentinel(self.tensors)
        self.t = MooncakeTransport()
        for s in self.specs:
            for b in s.buffers:
                self.t.register(b.addr, b.nbytes)
        self.ctx = context()  # lingers 0: a test that fails early cannot hang in the GC
        self.pull = self.ctx.socket(zmq.PULL)
        self.addr = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(prefill_ctrl)

    def send(self, msg: wire.Msg | bytes) -> None:
        self.push.send(msg if isinstance(msg, bytes) else wire.encode(msg))

    def recv(self, timeout: float = 5.0) -> wire.Message:
        assert self.pull.poll(int(timeout * 1000)), "no answer from the prefill"
        return wire.decode(self.pull.recv())

    def hello(self) -> wire.Message:
        self.send(
            wire.Hello(
                endpoint_id="hostile",
                ctrl_addr=self.addr,
                session=self.t.session_id,
                tp_rank=0,
                tp_size=1,
                signature=layout_signature(self.specs),
                pools=tuple(self.specs),
            )
        )
        return self.recv()

    def request(
        self,
        room: int,
        pages: list[int],
        num_tokens: int,
        slot: int = 0,
        nonce: int = 1,
        endpoint_id: str = "hostile",
    ) -> None:
        self.send(
            wire.TransferRequest(
                room=room,
                nonce=nonce,
                endpoint_id=endpoint_id,
                dst={"kv": wire.pack_indices(pages)},
                slots={"aux": slot},
                prefix_len=0,
                num_tokens=num_tokens,
            )
        )

    def close(self) -> None:
        self.ctx.destroy()
        self.t.close()


@pytest.fixture()
def hostile(pair: tuple[Agent, Agent]) -> Iterator[Hostile]:
    h = Hostile(pair[0].info["ctrl_addr"])
    try:
        ack = h.hello()
        assert isinstance(ack, wire.HelloAck) and ack.ok, ack
        yield h
    finally:
        h.close()


def give_chunks(pf: Agent, room: int, pages: list[int], n: int) -> None:
    pf.call(
        "prepare",
        items=[{"room": room, "pages": {"kv": pages}, "slots": {"aux": 2}, "num_tokens": n}],
    )
    pf.call(
        "send",
        items=[
            {"room": room, "chunks": [{"pages": {"kv": pages}, "slots": {"aux": 2}, "last": True}]}
        ],
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"head_dim": 32}, "head size"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"page_size": 32, "pages": 32}, "page_size"),
    ],
)
def test_mismatched_layout_is_refused_at_hello_naming_the_mismatch(
    pair, bootstrap, change: dict, needle: str
) -> None:
    pf, dc = pair
    name = "mm_" + next(iter(change))
    geoms = [dataclasses.replace(GEOMS[0], **change), GEOMS[1]]
    config = {"bootstrap_timeout_s": 5.0, "instance": name}
    dc.call("add_endpoint", name=name, role="decode", config=config, geoms=geoms)
    dc.call("sentinel", ep=name)
    dc.call(
        "recv",
        items=[{"room": 77, "dst": {"kv": [0, 1]}, "slots": {"aux": 0}}],
        bootstrap=bootstrap.address,
        ep=name,
    )
    out = dc.call("wait", rooms=[77], ep=name, timeout=10)[77]
    assert out["state"] == "Failed" and out["kind"] == "layout_mismatch"
    assert needle in out["failure"], out["failure"]
    assert dc.call("untouched", exclude={}, ep=name) == 0
    dc.call("close_endpoint", name=name)
    # the prefill's registration says why, so a router can tell the client (a 409)
    why = _refusal(bootstrap, name, lambda r: r is not None)
    assert why is not None and needle in why, why


def _refusal(bootstrap: BootstrapServer, decode: str, until: Any) -> str | None:
    """The prefill instance's recorded refusal of ``decode``, once ``until`` holds for it."""
    client = BootstrapClient(bootstrap.address)
    deadline = time.monotonic() + 15
    while True:
        why = client.refusals("default").get(decode)
        if until(why) or time.monotonic() > deadline:
            return why
        time.sleep(0.05)


def test_a_decode_that_pairs_after_a_refusal_clears_the_prefills_record(pair, bootstrap) -> None:
    pf, dc = pair
    name = "mm_then_fixed"
    config = {"bootstrap_timeout_s": 3.0, "instance": name}
    bad = [dataclasses.replace(GEOMS[0], head_dim=32), GEOMS[1]]
    for room, geoms in ((81, bad), (82, GEOMS)):
        dc.call("add_endpoint", name=name, role="decode", config=config, geoms=geoms)
        dc.call(
            "recv",
            items=[{"room": room, "dst": {"kv": [0, 1]}, "slots": {"aux": 0}}],
            bootstrap=bootstrap.address,
            ep=name,
        )
        if room == 81:
            assert dc.call("wait", rooms=[81], ep=name, timeout=10)[81]["kind"] == (
                "layout_mismatch"
            )
            assert _refusal(bootstrap, name, lambda r: r is not None) is not None
        else:  # the same decode, its layout fixed: its handshake is accepted
            assert _refusal(bootstrap, name, lambda r: r is None) is None
        dc.call("close_endpoint", name=name)


def test_destination_index_out_of_range_is_refused_before_any_write(pair, hostile) -> None:
    pf, _ = pair
    give_chunks(pf, 501, [3, 4, 5], 48)
    hostile.request(501, [1, 2, 64], 48)
    done = hostile.recv()
    assert isinstance(done, wire.TransferDone) and not done.ok
    assert "out of range" in done.reason
    assert all(int(pat.untouched(s, hostile.tensors[s.name], [])) == 0 for s in hostile.specs)
    pf.call("abort", rooms=[501])
    out = pf.call("wait", rooms=[501], timeout=10)[501]
    assert out["state"] == "Failed"


def test_garbage_frames_are_dropped_and_the_next_request_still_works(pair, hostile) -> None:
    pf, _ = pair
    before = pf.call("metrics").get("wire_rejected", 0)
    for junk in [
        b"",
        b"PDX",
        b"PDX\x01\xff\xff",
        b"\x00" * 1000,
        wire.MAGIC + b"\x02abc",
        wire.MAGIC + b"\x01" + b"\x92\xa5Abort\x01",
    ]:
        hostile.send(junk)
    give_chunks(pf, 502, [7, 8], 20)
    hostile.request(502, [10, 11], 20, slot=3)
    done = hostile.recv()
    assert isinstance(done, wire.TransferDone) and done.ok, done
    kv = hostile.specs[0]
    bad, first = pat.check_tokens(kv, hostile.tensors["kv"], 502, [10, 11], 0, 0, 20)
    assert bad == 0, first
    assert pat.check_slot(hostile.specs[1], hostile.tensors["aux"], 502, 3)[0] == 0
    assert pf.call("metrics")["wire_rejected"] >= before + 6


def test_duplicate_room_from_a_peer_is_refused(pair, hostile) -> None:
    pf, _ = pair
    hostile.request(503, [20], 10, nonce=1)
    hostile.request(503, [21], 10, nonce=2)
    done = hostile.recv()
    assert isinstance(done, wire.TransferDone) and not done.ok and done.nonce == 2
    assert "duplicate" in done.reason
    hostile.send(wire.Abort(room=503, nonce=1, endpoint_id="hostile"))
    ack = hostile.recv()
    assert isinstance(ack, wire.AbortAck) and ack.known


def test_abort_for_an_unknown_room_is_answered(hostile) -> None:
    hostile.send(wire.Abort(room=123456789, nonce=5, endpoint_id="hostile"))
    ack = hostile.recv()
    assert isinstance(ack, wire.AbortAck) and not ack.known and ack.room == 123456789


def test_request_without_hello_is_dropped_unanswered_and_counted(pair) -> None:
    """Nobody registered an address for an endpoint that never said Hello: there is nowhere
    to answer (a message never names its own reply address), so the request is counted."""
    pf, _ = pair
    h = Hostile(pair[0].info["ctrl_addr"])
    try:
        before = pf.call("metrics").get("rejected_unknown_peer", 0)
        h.request(504, [1], 5, endpoint_id="stranger")
        t0 = time.monotonic()
        while (
            pf.call("metrics").get("rejected_unknown_peer", 0) == before
            and time.monotonic() - t0 < 30
        ):
            time.sleep(0.05)
        assert pf.call("metrics")["rejected_unknown_peer"] == before + 1
        # the request named no reply address and its sender none earlier: none can come
        assert not h.pull.poll(0)
    finally:
        h.close()


def test_hello_whose_pools_lie_about_their_size_gets_no_pairing(pair) -> None:
    pf, _ = pair
    h = Hostile(pair[0].info["ctrl_addr"])
    try:
        hello = msgspec.to_builtins(
            wire.Hello(
                endpoint_id="liar",
                ctrl_addr=h.addr,
                session="x:1",
                tp_rank=0,
                tp_size=1,
                signature="0",
                pools=(h.specs[0],),
            ),
            builtin_types=(bytes,),
        )
        hello["type"] = "Hello"
        hello["pools"][0]["num_items"] *= 4  # buffers claim 4x more pages than they hold
        frame = wire.frame(msgspec.msgpack.encode(hello), wire.Hello)
        before = pf.call("metrics").get("wire_rejected", 0)
        h.send(frame)
        t0 = time.monotonic()
        while pf.call("metrics").get("wire_rejected", 0) == before and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert pf.call("metrics")["wire_rejected"] == before + 1
        # unanswered: the prefill answers in order, so had the lie been answered, that answer
        # would come before the ones to an honest Hello and an Abort sent after it
        ack = h.hello()
        assert isinstance(ack, wire.HelloAck) and ack.ok, ack
        h.send(wire.Abort(room=123456790, nonce=5, endpoint_id="hostile"))
        assert isinstance(h.recv(), wire.AbortAck), "the lying Hello was answered"
    finally:
        h.close()


def test_index_arrays_are_validated_in_the_engine_call(pair, bootstrap) -> None:
    _, dc = pair
    with pytest.raises(Exception, match="out of range"):
        dc.call("recv", items=[{"room": 505, "dst": {"kv": [64]}}], bootstrap=bootstrap.address)
    with pytest.raises(Exception, match="unknown pool"):
        dc.call("recv", items=[{"room": 506, "dst": {"nope": [1]}}], bootstrap=bootstrap.address)
    with pytest.raises(Exception, match="integers"):
        dc.call(
            "recv",
            items=[{"room": 507, "dst": {"kv": np.array([1.5])}}],
            bootstrap=bootstrap.address,
        )
