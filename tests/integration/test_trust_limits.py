"""Pre-authentication tables stay bounded, and a bad transfer request is refused at once,
naming why, on both sides.

No secret here: bounded tables matter most where anyone may say Hello. The attacker is this
test process with raw ZMQ sockets; the endpoints are real processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from pdxfer import BootstrapServer, wire
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent, AgentError
from pdxfer.pools import layout_signature

from . import attack as A
from .conftest import FAST, start_pair
from .helpers import Factory, decode_items, prefill_items

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32"),
]
CAPS = {"max_pending": 50, "max_pending_bytes": 8 << 20, "max_peers": 64, "max_tombstones": 1000}


@pytest.fixture(scope="module")
def pair(bootstrap: BootstrapServer) -> Iterator[tuple[Agent, Agent]]:
    pf, dc = start_pair(bootstrap, GEOMS)
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture()
def raw() -> Iterator[A.Raw]:
    r = A.Raw()
    yield r
    r.close()


def hello(raw: A.Raw, eid: str) -> bytes:
    """A plain Hello from a decode whose control address is ``raw``'s."""
    specs, _ = pat.build(GEOMS)
    msg = msgspec.to_builtins(
        wire.Hello(
            endpoint_id=eid,
            ctrl_addr=raw.addr,
            session="127.0.0.1:1",
            tp_rank=0,
            tp_size=1,
            signature=layout_signature(specs),
            pools=tuple(specs),
        ),
        builtin_types=(bytes,),
    )
    msg["type"] = "Hello"
    return A.plain(msg)


def metrics(agent: Agent, ep: str = "main") -> dict:
    return agent.call("metrics", ep=ep)


def now(agent: Agent, room: int, ep: str = "main") -> str:
    return str(agent.call("ext", fn="tests.harness.attack:states", rooms=[room], ep=ep)[room])


@pytest.fixture()
def capped(pair: tuple[Agent, Agent]) -> Iterator[str]:
    pf, _ = pair
    conf = {**FAST, "bootstrap_timeout_s": 60.0}
    try:
        addr = pf.call(
            "add_endpoint", name="capped", role="prefill", config={**conf, **CAPS}, geoms=GEOMS
        )["ctrl_addr"]
    except AgentError as e:  # a build without caps (the old code): show its tables grow
        assert "max_pending" in str(e)
        addr = pf.call("add_endpoint", name="capped", role="prefill", config=conf, geoms=GEOMS)[
            "ctrl_addr"
        ]
    yield addr
    pf.call("close_endpoint", name="capped")


def test_requests_for_rooms_that_never_come_are_capped_in_count_and_bytes(
    pair, capped: str, raw: A.Raw
) -> None:
    """4 MB requests and many small ones for rooms no sender will ever have."""
    pf, _ = pair
    raw.send(capped, hello(raw, "hoarder"))
    raw.recv()  # HelloAck
    rss0 = pf.call("proc_stats")["rss"]
    huge = wire.pack_indices(np.arange(1 << 20) % 64)  # 4 MB of valid page ids
    for room in range(20):
        raw.send(
            capped,
            A.plain(
                {
                    "type": "TransferRequest",
                    "room": 10_000 + room,
                    "nonce": 1,
                    "endpoint_id": "hoarder",
                    "reply_to": raw.addr,
                    "dst": {"kv": huge},
                    "slots": {},
                    "prefix_len": 0,
                    "num_tokens": 16,
                }
            ),
        )
    for room in range(200):
        raw.send(
            capped,
            A.plain(
                {
                    "type": "TransferRequest",
                    "room": 20_000 + room,
                    "nonce": 1,
                    "endpoint_id": "hoarder",
                    "reply_to": raw.addr,
                    "dst": {"kv": wire.pack_indices([1])},
                    "slots": {},
                    "prefix_len": 0,
                    "num_tokens": 16,
                }
            ),
        )
    assert A.wait_for(lambda: metrics(pf, "capped").get("rejected_pending_full", 0) >= 170, 30)
    m = metrics(pf, "capped")
    assert m["pending_requests"] <= CAPS["max_pending"]
    assert m["table_pending_bytes"] <= CAPS["max_pending_bytes"]
    grew = pf.call("proc_stats")["rss"] - rss0
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MB"


def test_aborts_and_fresh_hellos_cannot_grow_tombstones_or_peers_past_their_caps(
    pair, capped: str, raw: A.Raw
) -> None:
    """5,000 Aborts for distinct rooms, 300 Hellos with fresh endpoint ids."""
    pf, _ = pair
    raw.send(capped, hello(raw, "aborter"))
    raw.recv()
    for room in range(5000):
        raw.send(
            capped,
            A.plain(
                {
                    "type": "Abort",
                    "room": 30_000 + room,
                    "nonce": 1,
                    "endpoint_id": "aborter",
                    "reply_to": raw.addr,
                }
            ),
        )
    for i in range(300):
        raw.send(capped, hello(raw, f"fresh-{i}"))
    assert A.wait_for(lambda: metrics(pf, "capped").get("peers_evicted", 0) >= 300 - 64, 30)
    m = metrics(pf, "capped")
    assert m["table_tombstones"] <= CAPS["max_tombstones"]
    assert m["table_peers"] <= CAPS["max_peers"]
    assert m["table_push_sockets"] <= 2


def test_abort_reply_addresses_are_never_dialled(pair, raw: A.Raw) -> None:
    """Aborts whose reply_to names 300 dead ports open no socket (the answer
    goes to the registered peer only)."""
    pf, _ = pair
    raw.send(pf.info["ctrl_addr"], hello(raw, "dialler"))
    raw.recv()
    fds0 = pf.call("proc_stats")["fds"]
    socks0 = metrics(pf).get("table_push_sockets", 0)
    for port in range(300):
        raw.send(
            pf.info["ctrl_addr"],
            A.plain(
                {
                    "type": "Abort",
                    "room": 40_000 + port,
                    "nonce": 1,
                    "endpoint_id": "dialler",
                    "reply_to": f"tcp://127.0.0.1:{port + 1}",
                }
            ),
        )
    for _ in range(300):  # each answered to the registered peer: all were handled
        raw.recv(timeout=60)
    assert pf.call("proc_stats")["fds"] - fds0 < 30
    assert metrics(pf).get("table_push_sockets", 0) <= socks0 + 1


def _recv(dc: Agent, bootstrap: str, room: int, **kw: object) -> None:
    dc.call("recv", items=[{"room": room, "slots": {"aux": 3}, **kw}], bootstrap=bootstrap)


@pytest.mark.parametrize(
    "room,kw,needle",
    [
        (50_001, {"dst": {"kv": [1, 2, 3]}, "prefix_len": 8, "num_tokens": 40}, "not a multiple"),
        (50_002, {"dst": {"kv": [5, 5, 6]}, "num_tokens": 40}, "more than once"),
        (50_003, {"dst": {"kv": [64]}, "num_tokens": 16}, "out of range"),
    ],
    ids=["unaligned_prefix", "duplicate_pages", "out_of_range"],
)
def test_bad_request_is_refused_with_a_clear_error_and_leaves_the_receiver_failed_at_once(
    pair, bootstrap: BootstrapServer, room: int, kw: dict, needle: str
) -> None:
    """A malformed request is refused naming why, and the receiver is Failed at once with
    that reason instead of lingering into a DeadlineExceeded."""
    _, dc = pair
    with pytest.raises(AgentError, match=needle):
        _recv(dc, bootstrap.address, room, **kw)
    assert now(dc, room) == "Failed"
    out = dc.call("wait", rooms=[room])[room]
    assert needle in out["failure"] and out["kind"] == "plan", out
    assert dc.call("untouched", exclude={}) == 0


@pytest.mark.parametrize("decode_first", [False, True])
def test_refused_handshake_fails_the_prefill_room_too_with_the_reason(
    pair, bootstrap: BootstrapServer, decode_first: bool
) -> None:
    """The prefill hears why, instead of timing out on 'no request'."""
    pf, dc = pair
    name = f"mismatch{int(decode_first)}"
    bad = [PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=32), GEOMS[1]]
    dc.call("add_endpoint", name=name, role="decode", config=dict(FAST), geoms=bad)
    try:
        r = Factory(GEOMS, GEOMS, seed=24 + decode_first).make(32)
        prep, send = prefill_items([r])
        pf.call("prepare", items=prep)
        if not decode_first:
            pf.call("send", items=send)
        dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address, ep=name)
        out = dc.call("wait", rooms=[r["room"]], ep=name, timeout=20)[r["room"]]
        assert out["kind"] == "layout_mismatch", out
        if decode_first:
            pf.call("send", items=send)
        # the kind below, not a stopwatch, says it was the refusal and not the 5 s deadline
        assert A.wait_for(lambda: now(pf, r["room"]) == "Failed", 30.0)
        got = pf.call("wait", rooms=[r["room"]])[r["room"]]
        assert "refused" in got["failure"] and "head" in got["failure"], got
        assert got["kind"] == "layout_mismatch"
    finally:
        dc.call("close_endpoint", name=name)
