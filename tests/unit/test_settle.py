"""The prefill's settle hold (``endpoint/settler.py``), in one process over the
in-memory transport: what a decode whose proof blocks (a fence to a stopped process waits
for the transport's timeout) may delay, and what a failure right after a proof holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdxfer import BootstrapServer, Endpoint, EndpointConfig, KVPoll, TransportError
from pdxfer.agents import patterns as pat
from pdxfer.endpoint.settler import Settler
from pdxfer.transport import MemoryFabric, MemoryTransport
from tests.harness.memory_pair import FAST, GEOMS, Pair, stranded_room, until, wait

LONG = 60.0
"""A bound on each wait (never a timing assertion: a loaded machine only makes it slower);
also how long a stopped decode's proof step hangs, unless the test wakes it first."""


@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


def frozen_decode(p: Pair) -> None:
    """``p.dc`` stops: a step of proving the path to it hangs until the test ends."""
    p.dtx.faults.hang_s = 2 * LONG
    p.dtx.faults.frozen = True


def test_a_decode_whose_proof_hangs_holds_back_no_other_decodes_messages(
    srv: BootstrapServer,
) -> None:
    """Two decodes with failed writes still on their way: the path to the first cannot be
    proven (its fence hangs: a stopped process), the second's late bytes land at once.
    The second gets its TransferDone, and its pages back, while the first's proof still
    hangs (proven one after the other, it waited for that step, past its deadline)."""
    p = Pair(srv, transfer_timeout_s=LONG)
    ds, _ = pat.build(GEOMS)
    other = Endpoint(
        EndpointConfig.from_flat(
            role="decode", bootstrap=srv.address, **{**FAST, "transfer_timeout_s": LONG}
        ),
        ds,
        transport=MemoryTransport(p.fabric),
    )
    released: dict[int, float] = {}
    try:
        frozen_decode(p)
        first, rx1, tx1 = stranded_room(p, LONG, released)
        assert until(lambda: p.pf.metrics().get("settle_waits", 0) == 1, LONG)
        second, rx2, _ = stranded_room(p, 0.3, released, dc=other)
        assert wait(rx2, LONG) == KVPoll.Failed and rx2.failure.kind == "transport", rx2.failure
        assert until(lambda: second in released, LONG)
        assert p.ptx.faults.landed, "the second room's stranded batch never landed"
        assert released[second] >= p.ptx.faults.landed[0]
        assert first not in released and tx1.reading, "the first decode's path was proven"
    finally:
        p.dtx.faults.frozen = False
        other.close()
        p.close()


def test_a_room_held_for_a_decode_whose_proof_hangs_is_given_up_at_its_deadline(
    srv: BootstrapServer,
) -> None:
    """The give-up at the transfer deadline (2 s) does not wait for a proof step that
    hangs: the room ends on the prefill (its engine gets the source pages back) while the
    decode, told nothing, keeps its pages."""
    p = Pair(srv)
    released: dict[int, float] = {}
    try:
        frozen_decode(p)
        room, rx, tx = stranded_room(p, LONG, released)
        assert until(lambda: p.pf.metrics().get("settle_waits", 0) == 1, LONG)
        assert until(lambda: not tx.reading, LONG), "held past its deadline"
        assert p.pf.metrics()["settle_given_up"] == 1
        assert wait(rx, LONG) == KVPoll.Failed and room not in released
    finally:
        p.dtx.faults.frozen = False
        p.close()


def test_a_failure_right_after_a_proof_holds_what_waits_until_its_own_proof() -> None:
    """A write to the decode fails just after its path was proven quiet, and that room's
    message is held (the path was tainted again when it asked): nothing held for the decode
    goes out until the new failure is proven too (released at the first proof, it went out
    while the new failure's bytes were still on their way)."""
    fabric = MemoryFabric()
    src, dst = MemoryTransport(fabric), MemoryTransport(fabric)
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, b.nbytes)
    peer = dst.session_id
    ran: list[tuple[str, bool]] = []
    settler = Settler(src, lambda name, n: None, LONG)

    def fail_a_write(strand_s: float) -> None:
        src.faults.strand_s = strand_s
        with pytest.raises(TransportError):
            src.write(peer, [a.ctypes.data], [b.ctypes.data], [64])

    def job(name: str) -> Any:
        return lambda: ran.append((name, src.tainted(peer)))

    proofs = [0]
    settle = src.settle

    def settle_then_fail(s: str) -> bool:
        ok = settle(s)
        if ok and not proofs[0]:
            proofs[0] += 1
            fail_a_write(0.5)
            settler.hold(peer, job("second"), lambda: ran.append(("gave up", True)))
        return ok

    src.settle = settle_then_fail  # type: ignore[method-assign]
    try:
        fail_a_write(0.2)
        settler.hold(peer, job("first"), lambda: ran.append(("gave up", True)))
        assert until(lambda: len(ran) == 2, LONG)
        assert sorted(ran) == [("first", False), ("second", False)], ran
    finally:
        settler.close()
        src.close()
        dst.close()


def test_the_prover_of_a_decode_nothing_waits_for_any_more_stops(srv: BootstrapServer) -> None:
    """A decode whose held room was given up and that no longer asks (it is gone): its
    prover stops, so a decode that went away does not keep a thread fencing it forever (the
    taint stays: a message held for it later starts a new one)."""
    p = Pair(srv)
    released: dict[int, float] = {}
    try:
        frozen_decode(p)
        p.dtx.faults.hang_s = 0.2  # each step hangs briefly and fails: never proven
        room, rx, tx = stranded_room(p, LONG, released)
        assert until(lambda: p.pf.metrics().get("settle_given_up", 0) == 1, LONG)
        p.dc.close()  # gone: no more Aborts
        settler = p.pf.prefill.settler  # type: ignore[union-attr]
        assert until(lambda: not settler.provers, 3 * LONG)
        assert p.dtx.session_id not in settler.held
        assert p.ptx.tainted(p.dtx.session_id)
    finally:
        p.dtx.faults.frozen = False
        p.close()
