"""A hybrid request (attention KV split by heads, and a Mamba2 state split into pieces) between
real endpoints at different TP sizes, prefill TP 2 -> decode TP 1 and TP 1 -> TP 2, over the
in-memory transport (ZMQ control on loopback, an in-process bootstrap server).

Each decode rank's state page must equal the page it would hold itself (``state_pages``), its
padding untouched, the KV exact, with ``integrity: full`` verifying each sender's digests of
the state units it wrote."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pdxfer import BootstrapServer, BufferSpec, Endpoint, EndpointConfig, KVPoll, PoolSpec, Sharding
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.transport import MemoryFabric, MemoryTransport

from .state_pages import MAMBA2, SENTINEL, page, state_pieces

MODEL = {**MAMBA2, "ds": False, "g": 1}
LAYERS = (1, 3)
SLOTS = 4
PAGES, PS, HEADS = 32, 4, 2
CONF = {"bootstrap_timeout_s": 20.0, "transfer_timeout_s": 20.0, "integrity": "full"}


class Rank:
    """One TP rank's endpoint over a head-sharded KV pool and a Mamba2 state pool."""

    def __init__(self, role: str, tp: int, r: int, srv: BootstrapServer, fabric: Any) -> None:
        h = HEADS // tp
        kv = PoolGeom(
            "kv", "mha", layers=2, pages=PAGES, page_size=PS, heads=h, head_dim=8,
            total_heads=HEADS, first_head=r * h, first_layer=10,
        )  # fmt: skip
        specs, self.t = pat.build([kv])
        self.kv = specs[0]
        self.item = len(page(MODEL, tp, r, 0, 0)[0])
        self.state = [torch.zeros(SLOTS, self.item, dtype=torch.uint8) for _ in LAYERS]
        self.pool = PoolSpec(
            "state",
            "slot",
            tuple(
                BufferSpec(t.data_ptr(), t.nbytes, lid, "state")
                for t, lid in zip(self.state, LAYERS)
            ),
            self.item,
            SLOTS,
            sharding=Sharding.sliced(state_pieces(MODEL, tp, r)),
        )
        self.tp, self.r = tp, r
        self.ep = Endpoint(
            EndpointConfig.from_flat(
                role=role, bootstrap=srv.address, tp_rank=r, tp_size=tp, **CONF
            ),
            [self.kv, self.pool],
            transport=MemoryTransport(fabric),
        )

    def fill_state(self, slot: int) -> None:
        for t, lid in zip(self.state, LAYERS):
            t[slot] = torch.frombuffer(
                bytearray(page(MODEL, self.tp, self.r, lid, slot)[0]), dtype=torch.uint8
            )

    def state_page(self, layer: int, slot: int) -> bytes:
        return bytes(self.state[LAYERS.index(layer)][slot].numpy().tobytes())


@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


def wait(h: Any, timeout: float = 60.0) -> KVPoll:
    """Until ``h`` is terminal: the bound only ends a hang."""
    import time

    end = time.monotonic() + timeout
    while not h.poll().terminal and time.monotonic() < end:
        time.sleep(0.002)
    return h.poll()


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
def test_each_decode_rank_gets_its_state_share_and_heads_from_the_prefill_ranks(
    srv: BootstrapServer, tp_p: int, tp_d: int
) -> None:
    fabric = MemoryFabric()
    pre = [Rank("prefill", tp_p, r, srv, fabric) for r in range(tp_p)]
    dec = [Rank("decode", tp_d, d, srv, fabric) for d in range(tp_d)]
    try:
        room, tokens, sslot, dslot = 4242 + tp_p, 13, 1, 2
        src = np.array([5, 9, 2, 17])
        dst = np.array([3, 30, 8, 11])
        for p in pre:
            pat.fill_tokens(p.kv, p.t["kv"], room, src, 0, 0, tokens)
            p.fill_state(sslot)
        for d in dec:
            pat.fill_sentinel(d.t)
            for t in d.state:
                t.fill_(SENTINEL)
        rxs = []
        for d in dec:
            rx = d.ep.receiver(room)
            rx.request({"kv": dst.tolist()}, {"state": dslot}, 0, tokens)
            rxs.append(rx)
        txs = []
        for p in pre:
            tx = p.ep.sender(room)
            tx.send({"kv": src.tolist()}, {"state": sslot}, last=True)
            txs.append(tx)
        for rx in rxs:
            assert wait(rx) == KVPoll.Success, rx.failure
        for d in dec:
            bad, why = pat.check_tokens(d.kv, d.t["kv"], room, dst, 0, 0, tokens)
            assert bad == 0, why
            for lid in LAYERS:
                assert d.state_page(lid, dslot) == page(MODEL, tp_d, d.r, lid, sslot)[0], lid
                for other in set(range(SLOTS)) - {dslot}:
                    assert set(d.state_page(lid, other)) == {SENTINEL}
            m = d.ep.metrics()
            assert m.get("integrity_checks", 0) >= 1 and m.get("integrity_mismatches", 0) == 0, m
        for tx in txs:
            assert wait(tx) == KVPoll.Success, tx.failure
    finally:
        for x in dec + pre:
            x.ep.close()
