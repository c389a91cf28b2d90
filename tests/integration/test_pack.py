"""Packed requests between processes, over Mooncake TCP and over NIXL (UCX): the prefill
gathers each chunk's token rows into its pack staging, writes them into the decode's lease,
and the decode scatters them into its pages before Success (``pack="on"``: host pools here,
which ``auto`` would leave direct).

Every destination byte is checked against its pattern (a row one token, layer or request
off is caught) and pages outside the requests keep the decode's sentinel. The prefill
delays every transport batch of the rooms in ``SLOW`` (``PDXFER_FAULTS``), so an abort
lands while a packed write is committed: the lease and the pages stay held until it
drained, and a request that fails never scatters into its pages. The checks that nothing
landed late wait for the prefill's transport to report every write of the room returned
(``wait_drained``), not for a fixed time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.process import Agent

from .conftest import start_pair
from .helpers import SIX_POOLS as GEOMS
from .helpers import (
    Factory,
    assert_all_right,
    destinations,
    run,
    start,
    verify,
    wait_drained,
    wait_held,
    wait_released,
)

SLOW = (881, 882)
DELAY = 1.5


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(
    bootstrap: BootstrapServer, request: pytest.FixtureRequest
) -> Iterator[tuple[Agent, Agent]]:
    faults = f"delay_write={DELAY},rooms={';'.join(map(str, SLOW))}"
    pf, dc = start_pair(
        bootstrap, GEOMS, prefill_env={"PDXFER_FAULTS": faults}, transport=request.param, pack="on"
    )
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:
    return Factory(GEOMS, GEOMS, seed=17)


def test_packed_scattered_chunked_requests_land_byte_exact(pair, bootstrap, factory) -> None:
    pf, dc = pair
    reqs = [
        factory.make(n, chunks=c)
        for n, c in [(16, 1), (17, 1), (100, 3), (257, 4), (500, 7), (1, 1), (333, 5)]
    ]
    reqs.append(factory.make(200, prefix_len=64, chunks=3))  # a prefix the decode holds
    out = run(pf, dc, bootstrap.address, reqs)
    assert_all_right(out, verify(dc, reqs))
    assert dc.call("untouched", exclude=destinations(reqs)) == 0
    # every paged pool of every request went through a lease, gathered on the prefill
    assert dc.call("metrics")["packed_leases"] >= 5 * len(reqs)
    assert pf.call("metrics").get("packed_writes", 0) >= len(reqs)
    assert pf.call("metrics").get("pack_direct_writes", 0) == 0
    for r in reqs:
        factory.free(r)


def test_a_packed_write_still_landing_keeps_pages_and_lease_until_it_drained(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    a = factory.make(64, room=881)
    start(pf, dc, bootstrap.address, [a])
    wait_held(pf, 881)  # A's packed write is committed and sleeping in the transport
    dc.call("abort", rooms=[881])
    assert 881 not in dc.call("released"), "released while a write was still in flight"
    assert wait_released(dc, 881)
    b = {**factory.make(64), "dst": a["dst"], "dst_slots": a["dst_slots"]}
    out = run(pf, dc, bootstrap.address, [b])
    assert out[b["room"]]["state"] == "Success"
    drained = wait_drained(pf, 881)  # no byte of A is on its way any more
    assert verify(dc, [b])[b["room"]][0] == 0, "a late write of A overwrote B's KV"
    assert dc.call("release_counts")[881] == 1
    assert dc.call("release_times")[881][0] >= drained, "released before A's write drained"


def test_a_packed_request_that_fails_never_scatters_into_its_pages(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    dc.call("sentinel")
    r = factory.make(96, room=882)
    start(pf, dc, bootstrap.address, [r])
    wait_held(pf, 882)
    pf.call("abort", rooms=[882])
    out = dc.call("wait", rooms=[882], timeout=10)[882]
    assert out["state"] == "Failed"
    assert wait_released(dc, 882)
    drained = wait_drained(pf, 882)  # no byte of the request is on its way any more
    # the packed rows went to the lease only: the pages never saw half a request
    assert dc.call("dirty", dst=r["dst"], slots={}) == 0
    assert dc.call("release_counts")[882] == 1
    assert dc.call("release_times")[882][0] >= drained, "released before the write drained"
