"""One prefill process, one decode process, a real bootstrap server and a real transport:
every test runs over Mooncake TCP and over NIXL (UCX).

Every destination byte is checked against a pattern of (room, pool, layer, role, token,
byte): a byte one token, head, layer or request off is caught. Pages outside the requests
must keep the decode's sentinel.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.process import Agent

from .conftest import start_pair
from .helpers import SIX_POOLS as GEOMS
from .helpers import Factory, assert_all_right, decode_items, destinations, run, verify


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(
    bootstrap: BootstrapServer, request: pytest.FixtureRequest
) -> Iterator[tuple[Agent, Agent]]:
    pf, dc = start_pair(bootstrap, GEOMS, transport=request.param)
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:  # one per pair: its pages are that pair's
    return Factory(GEOMS, GEOMS, seed=7)


def test_scattered_chunked_requests_land_byte_exact(pair, bootstrap, factory) -> None:
    pf, dc = pair
    reqs = [
        factory.make(n, chunks=c)
        for n, c in [(16, 1), (17, 1), (100, 3), (257, 4), (500, 7), (64, 2), (1, 1), (333, 5)]
    ]
    out = run(pf, dc, bootstrap.address, reqs)
    assert_all_right(out, verify(dc, reqs))
    assert dc.call("untouched", exclude=destinations(reqs)) == 0
    for r in reqs:
        factory.free(r)


def test_chunks_sent_before_the_request_wait_for_it(pair, bootstrap, factory) -> None:
    pf, dc = pair
    reqs = [factory.make(200, chunks=4) for _ in range(4)]
    out = run(pf, dc, bootstrap.address, reqs, decode_first=False)
    assert_all_right(out, verify(dc, reqs))
    for r in reqs:
        factory.free(r)


def test_prefix_held_by_decode_is_not_sent(pair, bootstrap, factory) -> None:
    pf, dc = pair
    # prefix 96 is page-aligned for both kv (16) and mla (32)
    reqs = [factory.make(300, prefix_len=96, chunks=3), factory.make(96, prefix_len=96)]
    before = dc.call("metrics")["bytes"]
    out = run(pf, dc, bootstrap.address, reqs)
    assert_all_right(out, verify(dc, reqs))
    moved = dc.call("metrics")["bytes"] - before
    per_token = 4 * 2 * 2 * 16 * 2 + 2 * 2 * 8 * 2 + 2 * 2 * 4 * 4 + 3 * 36 * 2 + 2 * 12 * 4
    aux = 2 * 24 * 4
    # suffix 204 tokens -> kv pages ceil(204/16)=13, mla pages ceil(204/32)=7 (whole pages)
    assert moved < (300 * per_token) and moved >= 204 * per_token + 2 * aux
    for r in reqs:
        factory.free(r)


def test_200_requests_32_in_flight_all_right_and_tables_empty(pair, bootstrap, factory) -> None:
    pf, dc = pair
    sizes = [16, 50, 128, 200, 300, 77]
    done = 0
    for wave in range(200 // 32 + 1):
        n = min(32, 200 - done)
        if n <= 0:
            break
        reqs = [factory.make(sizes[(wave + i) % len(sizes)], chunks=1 + i % 3) for i in range(n)]
        out = run(pf, dc, bootstrap.address, reqs)
        assert_all_right(out, verify(dc, reqs))
        for r in reqs:
            factory.free(r)
        done += n
    assert done == 200
    assert pf.call("tables") == {"rooms": 0, "pending": 0}
    assert dc.call("tables") == {"rooms": 0}
    m = dc.call("metrics")
    assert m.get("quarantined_pages", 0) == 0 and not any(k.startswith("failures_") for k in m)


def test_duplicate_room_is_refused_on_both_sides(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(32)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    with pytest.raises(Exception, match="DuplicateRoom"):
        dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    pf.call("send", items=[{"room": r["room"], "chunks": []}])
    with pytest.raises(Exception, match="DuplicateRoom"):
        pf.call("send", items=[{"room": r["room"], "chunks": []}])
    pf.call(
        "prepare",
        items=[
            {
                "room": r["room"],
                "pages": r["src"],
                "slots": r["src_slots"],
                "num_tokens": r["num_tokens"],
            }
        ],
    )
    # the prefill sender from above is still live: give it the chunks directly
    pf.call("abort", rooms=[r["room"]])
    out = dc.call("wait", rooms=[r["room"]], timeout=10)
    assert out[r["room"]]["state"] == "Failed" and "abort" in out[r["room"]]["failure"]
    factory.free(r)


def test_sender_whose_decode_never_asks_fails_at_its_deadline(pair) -> None:
    pf, _ = pair
    pf.call(
        "send",
        items=[
            {
                "room": 999_999,
                "chunks": [{"pages": {"kv": [1], "mla": [1]}, "last": True, "slots": {"aux": 1}}],
            }
        ],
    )
    out = pf.call("wait", rooms=[999_999], timeout=15)[999_999]
    assert out["state"] == "Failed" and out["kind"] == "deadline"
    assert "no request from the decode" in out["failure"]
    assert out["seconds"] >= 4.0  # not before its 5 s deadline (wait() itself bounds the rest)


def test_decode_whose_prefill_never_sends_fails_at_its_deadline_and_releases(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(48)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[r["room"]], timeout=20)[r["room"]]
    assert out["state"] == "Failed"
    # the prefill refuses the orphan request once its grace for unknown rooms ran out
    # (``room_grace_s``), or the decode's own transfer deadline fires: the reason says which
    assert out["kind"] in ("unknown_room", "deadline"), out
    assert "deadline" in out["failure"] or "within" in out["failure"]
    assert r["room"] in dc.call("released")
    factory.free(r)
