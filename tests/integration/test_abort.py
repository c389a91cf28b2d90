"""Abort from either side in every state, and the late write made deterministic.

The prefill runs with ``PDXFER_FAULTS`` delaying every transport batch of the rooms below by
1.5 s *after* the write was committed to: an abort arriving meanwhile cannot stop it, exactly
like an RDMA write already posted. Fail-closed page lifetime must keep those pages away from
any other request until the prefill confirms the write drained.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import start_pair
from .helpers import (
    Factory,
    decode_items,
    prefill_items,
    run,
    start,
    verify,
    wait_drained,
    wait_held,
    wait_released,
)

SLOW = (777, 778, 779, 780)
DELAY = 1.5
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=128, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=16, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(
    bootstrap: BootstrapServer, request: pytest.FixtureRequest
) -> Iterator[tuple[Agent, Agent]]:
    faults = f"delay_write={DELAY},rooms={';'.join(map(str, SLOW))}"
    pf, dc = start_pair(
        bootstrap, GEOMS, prefill_env={"PDXFER_FAULTS": faults}, transport=request.param
    )
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:  # one per pair: its pages are that pair's
    return Factory(GEOMS, GEOMS, seed=11)


def test_late_write_never_lands_in_a_page_another_request_owns(pair, bootstrap, factory) -> None:
    pf, dc = pair
    a = factory.make(64, room=777)
    start(pf, dc, bootstrap.address, [a])
    wait_held(pf, 777)  # A's write is committed and sleeping in the transport
    dc.call("abort", rooms=[777])
    assert dc.call("wait", rooms=[777], timeout=5)[777]["state"] == "Failed"
    # the engine reuses A's pages only when pdxfer hands them back
    assert wait_released(dc, 777), "aborted pages were never handed back"
    b = {**factory.make(64), "dst": a["dst"], "dst_slots": a["dst_slots"]}
    out = run(pf, dc, bootstrap.address, [b])
    assert out[b["room"]]["state"] == "Success"
    drained = wait_drained(pf, 777)  # no byte of A is on its way any more
    assert verify(dc, [b])[b["room"]][0] == 0, "a late write of A overwrote B's KV"
    assert pf.call("wait", rooms=[777], timeout=5)[777]["state"] == "Failed"
    assert dc.call("release_counts")[777] == 1
    assert dc.call("release_times")[777][0] >= drained, "released before A's write drained"


def test_decode_abort_before_the_request_is_sent_releases_once(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(32)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    dc.call("abort", rooms=[r["room"]])
    out = dc.call("wait", rooms=[r["room"]], timeout=5)[r["room"]]
    assert out["state"] == "Failed" and out["kind"] == "aborted"
    assert wait_released(dc, r["room"])
    # the prefill side, if the request reached it, must not write: it sees the abort first
    calls = pf.call("metrics")["transport_calls"]
    pf.call("prepare", items=prefill_items([r])[0])
    pf.call("send", items=prefill_items([r])[1])
    out = pf.call("wait", rooms=[r["room"]], timeout=60)[r["room"]]
    assert out["state"] == "Failed", out  # ended without a write: nothing is on its way
    assert pf.call("metrics")["transport_calls"] == calls, "the prefill wrote an aborted request"
    assert verify(dc, [r])[r["room"]][0] > 0, "an aborted request's pages were written"
    pf.call("abort", rooms=[r["room"]])
    assert dc.call("release_counts")[r["room"]] == 1


def test_decode_abort_mid_transfer_waits_for_the_drain_then_releases_once(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(48, room=778)
    start(pf, dc, bootstrap.address, [r])
    wait_held(pf, 778)
    dc.call("abort", rooms=[778])
    assert 778 not in dc.call("released"), "released while a write was still in flight"
    assert wait_released(dc, 778)
    assert pf.call("wait", rooms=[778], timeout=5)[778]["kind"] == "aborted"
    assert dc.call("release_counts")[778] == 1
    assert dc.call("release_times")[778][0] >= wait_drained(pf, 778), "released before drained"


def test_prefill_abort_mid_transfer_fails_the_decode_and_releases_once(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(48, room=779)
    start(pf, dc, bootstrap.address, [r])
    wait_held(pf, 779)
    pf.call("abort", rooms=[779])
    out = dc.call("wait", rooms=[779], timeout=10)[779]
    assert out["state"] == "Failed" and "abort" in out["failure"]
    assert wait_released(dc, 779)
    assert dc.call("release_counts")[779] == 1


def test_prefill_abort_before_the_request_refuses_it_later(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(16)
    pf.call("send", items=prefill_items([r])[1])
    pf.call("abort", rooms=[r["room"]])
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[r["room"]], timeout=10)[r["room"]]
    assert out["state"] == "Failed" and "already failed" in out["failure"]
    assert wait_released(dc, r["room"])
    assert dc.call("release_counts")[r["room"]] == 1


def test_abort_after_success_changes_nothing(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(40)
    assert run(pf, dc, bootstrap.address, [r])[r["room"]]["state"] == "Success"
    dc.call("abort", rooms=[r["room"]])
    pf.call("abort", rooms=[r["room"]])
    assert dc.call("wait", rooms=[r["room"]], timeout=2)[r["room"]]["state"] == "Success"
    assert pf.call("wait", rooms=[r["room"]], timeout=2)[r["room"]]["state"] == "Success"
    assert r["room"] not in dc.call("released")
    assert verify(dc, [r])[r["room"]][0] == 0


def test_tables_are_empty_after_every_abort(pair) -> None:
    pf, dc = pair
    end = time.monotonic() + 10
    while time.monotonic() < end and (pf.call("tables")["rooms"] or dc.call("tables")["rooms"]):
        time.sleep(0.1)
    assert pf.call("tables") == {"rooms": 0, "pending": 0}
    assert dc.call("tables") == {"rooms": 0}
    assert all(n == 1 for n in dc.call("release_counts").values())


def test_prefill_abort_right_after_a_started_write_drains_it_then_fails_the_decode(
    pair, bootstrap, factory
) -> None:
    # A small chunk's write starts inside send() (EndpointConfig.start_in_send) and is only
    # awaited on the room's worker: an abort right behind it must still be answered after the
    # write returned, the decode must fail once and release once, and the next request works.
    pf, dc = pair
    started = pf.call("metrics").get("started_writes", 0)
    r = factory.make(48, room=790)
    prep, send = prefill_items([r])
    send[0]["abort_after_send"] = True
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    end = time.monotonic() + 10
    while pf.call("tables")["pending"] == 0 and time.monotonic() < end:
        time.sleep(0.005)
    pf.call("send", items=send)
    out = dc.call("wait", rooms=[790], timeout=10)[790]
    assert out["state"] == "Failed" and "abort" in out["failure"]
    assert pf.call("metrics")["started_writes"] == started + 1, "the write did not start in send()"
    # the write could not be stopped: it fully landed before the failure was reported
    assert verify(dc, [r])[790][0] == 0
    assert wait_released(dc, 790)
    assert dc.call("release_counts")[790] == 1
    ok = factory.make(48, room=791)
    res = run(pf, dc, bootstrap.address, [ok])
    assert res[791]["state"] == "Success"
    assert verify(dc, [ok])[791][0] == 0
