"""A decode that asks a live prefill for a room it does not hold fails fast,
while a decode that asks before the prefill's engine opened the room (early dispatch) still
gets its KV.

Both sides run with a bootstrap deadline far in the future (``FAR``) and the prefill with a
short ``room_grace_s``: every verdict below comes long before that deadline, so a test waits
at most ``WAIT`` (a bound, never a timing assertion) and then asserts the failure kind.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent, wait_until

from .conftest import start_pair
from .helpers import Factory, decode_items, prefill_items, run, verify

FAR = 600.0
"""Bootstrap deadline of both sides: a room that only the deadline ends stays unfinished."""
GRACE = 1.0
WAIT = 60.0
GEOMS = [PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=16)]


@pytest.fixture(scope="module")
def pair(bootstrap: BootstrapServer) -> Iterator[tuple[Agent, Agent]]:
    pf, dc = start_pair(bootstrap, GEOMS, bootstrap_timeout_s=FAR, room_grace_s=GRACE)
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:
    return Factory(GEOMS, GEOMS, seed=5)


def test_a_room_the_prefill_never_opens_fails_as_unknown_long_before_the_deadline(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(40)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Failed", out
    assert out["kind"] == "unknown_room", out


def test_a_room_that_already_succeeded_is_refused_at_once_when_asked_again(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(40)
    assert run(pf, dc, bootstrap.address, [r])[r["room"]]["state"] == "Success"
    assert pf.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]["state"] == "Success"
    dc.call("forget", rooms=[r["room"]])
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Failed" and out["kind"] == "unknown_room", out
    # refused from the table of ended rooms, not after the grace for unknown ones
    assert "already ended on this prefill" in out["failure"], out


def test_a_decode_that_asks_before_the_prefill_opened_the_room_still_gets_its_kv(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(40)
    prep, send = prefill_items([r])
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    # the decode's request is waiting on the prefill (it asked first, on any machine: a
    # fixed sleep could end before it arrived); the engine opens the room now, within the grace
    assert wait_until(lambda: pf.call("tables")["pending"] >= 1, WAIT)
    pf.call("send", items=send)
    assert dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]["state"] == "Success"
    assert verify(dc, [r])[r["room"]][0] == 0


def test_an_expected_room_waits_past_the_grace_then_its_bytes_land_exactly(
    pair, bootstrap, factory
) -> None:
    """A prefill engine that holds the request but opens the room only later (vLLM: once it
    schedules the queued request) declares it: the decode that asked first waits past the
    grace, while a room nobody declared fails after it (the state that says the grace has
    passed), and the expected room's KV then arrives exactly."""
    pf, dc = pair
    r, unknown = factory.make(40), factory.make(24)
    prep, send = prefill_items([r])
    pf.call("prepare", items=prep)
    pf.call("expect", rooms=[r["room"]])
    dc.call("recv", items=decode_items([r, unknown]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[unknown["room"]], timeout=WAIT)[unknown["room"]]
    assert out["state"] == "Failed" and out["kind"] == "unknown_room", out
    assert dc.call("states", rooms=[r["room"]])[r["room"]] not in ("Failed", "Success")
    pf.call("send", items=send)
    assert dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]["state"] == "Success"
    assert verify(dc, [r])[r["room"]][0] == 0


def test_an_expected_room_the_engine_withdraws_fails_its_decode_at_once(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(24)
    pf.call("expect", rooms=[r["room"]])
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    assert wait_until(lambda: pf.call("tables")["pending"] >= 1, WAIT)  # the request waits
    pf.call("withdraw", rooms=[r["room"]], reason="client went away")
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Failed" and out["kind"] == "aborted", out
    assert "client went away" in out["failure"], out


def test_a_room_asked_for_at_dispatch_waits_past_the_grace_then_its_bytes_land_exactly(
    pair, bootstrap, factory
) -> None:
    """The early form: a decode asks at dispatch, before the prefill's engine has even
    received the request (a loaded vLLM prefill may take longer than the grace to get there):
    the prefill holds the ask past its grace, while an ordinary ask for an unknown room fails
    after it (the state that says the grace has passed), and the early room's KV then
    arrives exactly."""
    pf, dc = pair
    r, unknown = factory.make(40), factory.make(24)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address, early=True)
    dc.call("recv", items=decode_items([unknown]), bootstrap=bootstrap.address)
    out = dc.call("wait", rooms=[unknown["room"]], timeout=WAIT)[unknown["room"]]
    assert out["state"] == "Failed" and out["kind"] == "unknown_room", out
    assert dc.call("states", rooms=[r["room"]])[r["room"]] not in ("Failed", "Success")
    prep, send = prefill_items([r])
    pf.call("prepare", items=prep)
    pf.call("send", items=send)
    assert dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]["state"] == "Success"
    assert verify(dc, [r])[r["room"]][0] == 0
