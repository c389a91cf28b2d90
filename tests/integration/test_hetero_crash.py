"""One prefill TP rank dies mid-request: exactly the decode ranks that expected it fail."""

from __future__ import annotations

import time

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items, wait_written
from .hetero import rank_geoms, tp_group

# 8 layers x K,V x 16 tokens x 8 heads x 64 dims x fp16: 256 KiB per page across buffers
GEOMS = [
    PoolGeom(
        "kv",
        "mha",
        layers=8,
        pages=256,
        page_size=16,
        heads=8,
        total_heads=8,
        head_dim=64,
        layout="HND",
    ),
    PoolGeom("aux", "slots", layers=1, pages=8, dim=16, dtype="int32"),
]


def test_dead_prefill_rank_fails_every_decode_rank_it_fed_and_no_other(
    bootstrap: BootstrapServer,
) -> None:
    b = bootstrap.address
    cfg = {**FAST, "bootstrap": b, "instance": "crash", "tp_size": 2}
    ranks: list[Agent] = []
    dc = None
    try:
        for r in range(2):
            ranks.append(Agent("prefill", {**cfg, "tp_rank": r}, rank_geoms(GEOMS, 2, r)))
        dc = Agent("decode", dict(FAST), rank_geoms(GEOMS, 4, 0))
        d = tp_group(dc, "decode", "d", GEOMS, 4)  # decode ranks 2, 3 are fed by prefill rank 1
        f = Factory(GEOMS, GEOMS, seed=4)
        big = f.make(16 * 200, chunks=20)
        big["delay_s"] = 0.1
        prep, send = prefill_items([big])
        for a in ranks:
            a.call("prepare", items=prep)
        d.each("recv", items=decode_items([big]), bootstrap=b, instance="crash")
        for a in ranks:
            a.call("send", items=send)
        wait_written(ranks[1])  # mid-transfer: the rest of its 20 chunks take 0.1 s each
        t_kill = time.monotonic()
        ranks[1].kill()
        outs = d.each("wait", rooms=[big["room"]], timeout=FAST["transfer_timeout_s"] + 5)
        waited = time.monotonic() - t_kill
        states = [o[big["room"]]["state"] for o in outs]
        assert states == ["Success", "Success", "Failed", "Failed"], outs
        for o in outs[2:]:
            out = o[big["room"]]
            assert out["kind"] in ("peer_lost", "deadline"), out
        assert waited < FAST["transfer_timeout_s"] + 2, f"waited {waited:.1f} s"
        checks = d.each("verify", items=decode_items([big]))
        assert [c[big["room"]][0] for c in checks[:2]] == [0, 0]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and not all(
            big["room"] in x for x in d.each("released")[2:]
        ):
            time.sleep(0.05)
        assert [big["room"] in x for x in d.each("released")] == [False, False, True, True]
    finally:
        for a in ranks:
            a.close()
        if dc is not None:
            dc.close()
