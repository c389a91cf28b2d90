"""A Mooncake TCP write that was reported failed while its bytes were still on their way,
made deterministic: the prefill runs with ``PDXFER_FAULTS`` ``strand``, which fails the
first batch of each write of the rooms below at once and lands that batch ``STRAND_S``
later through the real engine, as Mooncake does on a flapping link (its Python binding
reports a batch failed when one task failed while the others are still queued on the
peer's lanes; a connection it dropped for lack of progress still buffers bytes that the
healed link delivers). Found as late bytes in ``test_net_faults``' flapping link.

The decode must get the pages back only after those bytes landed (the prefill holds the
failure until its transport proved the path quiet), never before: there an engine would
already have given them to another request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import start_pair
from .helpers import Factory, decode_items, prefill_items, run, verify

STRANDED = (881, 882)
STRAND_S = 2.0
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=128, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=16, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module")
def pair(bootstrap: BootstrapServer) -> Iterator[tuple[Agent, Agent]]:
    faults = f"strand={STRAND_S},rooms={';'.join(map(str, STRANDED))}"
    pf, dc = start_pair(bootstrap, GEOMS, prefill_env={"PDXFER_FAULTS": faults}, transport="tcp")
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:
    return Factory(GEOMS, GEOMS, seed=5)


def released_at(dc: Agent, room: int, timeout: float = 60.0) -> float:
    """When the decode handed ``room``'s pages back (the bound only ends a hang)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = dc.call("release_times").get(room)
        if got:
            return got[0]
        time.sleep(0.02)
    raise AssertionError(f"room {room}'s pages were never handed back")


def test_a_failed_write_still_on_its_way_lands_before_its_pages_come_back(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = {**factory.make(64, room=881), "scrub": True}  # refilled with the sentinel on release
    prep, send = prefill_items([r])
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap.address)
    pf.call("send", items=send)
    out = dc.call("wait", rooms=[881], timeout=60)[881]
    assert out["state"] == "Failed" and out["kind"] == "transport", out
    back = released_at(dc, 881)
    end = time.monotonic() + 60
    while not (landed := pf.call("strand_landings", room=881)):
        assert time.monotonic() < end, "the stranded batch never landed"
        time.sleep(0.05)
    assert back >= landed[-1], (
        f"pages handed back {landed[-1] - back:.2f} s before a failed write landed in them"
    )
    assert dc.call("dirty", dst=r["dst"], slots=r["dst_slots"]) == 0, (
        "bytes landed in the pages after they were handed back"
    )
    assert dc.call("release_counts")[881] == 1
    assert pf.call("metrics")["settle_waits"] >= 1
    factory.free(r)


def test_the_pair_serves_the_next_request_and_no_table_leaks(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(64)
    assert run(pf, dc, bootstrap.address, [r])[r["room"]]["state"] == "Success"
    assert verify(dc, [r])[r["room"]][0] == 0
    end = time.monotonic() + 20
    while time.monotonic() < end and (pf.call("tables")["rooms"] or dc.call("tables")["rooms"]):
        time.sleep(0.1)
    assert pf.call("tables") == {"rooms": 0, "pending": 0}
    assert dc.call("tables") == {"rooms": 0}
    factory.free(r)
