"""A flood of oversized, forged and replayed frames against a secured prefill and decode while
legitimate requests flow: every legitimate request is byte-exact, every flood frame is refused
(counted by reason), and neither process's memory grows by more than 64 MB. Eight floods of
oversized Hellos in a row leave the prefill's memory where it was.

Runs 10 s by default; ``PDXFER_FLOOD_S=30`` floods for 30 s. Latency under flood is
measured by ``benchmarks/flood.py``, not asserted here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.harness import flood as F


@pytest.fixture(scope="module")
def cluster() -> Iterator[F.Cluster]:
    c = F.start()
    yield c
    c.close()


def test_flood_of_forged_oversized_and_replayed_frames_corrupts_nothing_and_stays_bounded(
    cluster: F.Cluster,
) -> None:
    for i in range(3):  # warm: handshake done, allocator settled
        assert F.legit(cluster, seed=100 + i)[1] == 0
    out = F.flood_run(cluster, float(os.environ.get("PDXFER_FLOOD_S", "10")))
    assert len(out["latencies"]) >= 3, out
    assert out["bad_bytes"] == 0
    assert set(out["sent"]) >= {
        "unsigned",
        "forged_mac",
        "forged_hello",
        "oversized",
        "replayed",
    }, out["sent"]
    pf, dc = out["rejected_pf"], out["rejected_dc"]
    for reason in ("unsigned", "bad_mac", "unknown_pair", "oversized", "replay"):
        assert pf.get(f"rejected_{reason}", 0) > 0, (reason, pf)
    for reason in ("unsigned", "unknown_pair", "oversized"):
        assert dc.get(f"rejected_{reason}", 0) > 0, (reason, dc)
    assert out["rss_growth_pf"] < 64 << 20, out["rss_growth_pf"]
    assert out["rss_growth_dc"] < 64 << 20, out["rss_growth_dc"]


def test_eight_floods_of_oversized_hellos_leave_no_memory_behind(cluster: F.Cluster) -> None:
    """Over 1 GiB of unauthenticated Hellos, each over the Hello cap, with a
    secret set. Each is refused on its header, legitimate requests behind every flood land
    byte-exact, and the prefill's RSS after the last flood is within 64 MB of its RSS before
    the first (a ZMQ socket received each whole, and the allocator kept what it freed)."""
    out = F.hello_floods(cluster)
    assert out["bytes"] > 1 << 30
    assert len(out["latencies"]) == 8 and out["bad_bytes"] == 0, out
    grew = out["rss_after"] - out["rss_before"]
    assert abs(grew) < 64 << 20, (
        f"RSS {out['rss_before'] >> 20} MB before the first flood, "
        f"{out['rss_after'] >> 20} MB after the last "
        f"(peak {out['rss_peak'] >> 20} MB)"
    )
