"""Soak: many small requests on one endpoint pair with flat memory.

The reduced form (about 2,000 requests, at most ~60 s) runs in the test command. The full form
(20,000 requests) runs with ``PDXFER_SOAK_FULL=1 scripts/test.sh -k soak``.
"""

from __future__ import annotations

import os
import time

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom

from .conftest import start_pair
from .helpers import Factory, run, verify

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=512, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=64, dim=8, dtype="int32"),
]
FULL = os.environ.get("PDXFER_SOAK_FULL") == "1"
TOTAL = 20_000 if FULL else 2_000
BUDGET_S = 3600.0 if FULL else 30.0
WARMUP, WAVE = 300, 32


def test_soak_many_small_requests_keep_memory_flat(bootstrap: BootstrapServer) -> None:
    pf, dc = start_pair(bootstrap, GEOMS)
    f = Factory(GEOMS, GEOMS, seed=17)
    try:
        done, base, t0 = 0, None, time.monotonic()
        while done < TOTAL and (time.monotonic() - t0 < BUDGET_S or done < 2 * WARMUP):
            reqs = [f.make(16 + (done + i) % 48) for i in range(WAVE)]
            out = run(pf, dc, bootstrap.address, reqs, timeout=30)
            assert all(o["state"] == "Success" for o in out.values()), out
            if done % (WAVE * 10) == 0:  # spot-check bytes without slowing the soak
                assert all(v[0] == 0 for v in verify(dc, reqs).values())
            for r in reqs:
                f.free(r)
            rooms = [r["room"] for r in reqs]
            dc.call("forget", rooms=rooms)
            pf.call("forget", rooms=rooms)
            done += WAVE
            if base is None and done >= WARMUP:
                base = (pf.call("proc_stats"), dc.call("proc_stats"))
        end = (pf.call("proc_stats"), dc.call("proc_stats"))
        assert base is not None and done >= 2 * WARMUP
        for b, e, who in zip(base, end, ("prefill", "decode")):
            growth = (e["rss"] - b["rss"]) / b["rss"]
            assert growth < 0.05, f"{who} RSS grew {growth:.1%} over {done} requests"
            assert e["fds"] <= b["fds"] + 4, f"{who} leaked file descriptors"
        assert pf.call("tables") == {"rooms": 0, "pending": 0}
        assert dc.call("tables") == {"rooms": 0}
    finally:
        pf.close()
        dc.close()
