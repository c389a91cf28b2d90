"""Heterogeneous TP between processes: every prefill/decode TP pair moves exact bytes.

One prefill process hosts TP groups of sizes 1, 2 and 4 (one instance each) and one decode
process hosts decode TP groups of sizes 1, 2 and 4; each case pairs one of each. Heads pools
are checked against the pattern of their GLOBAL heads, so a head slice landing one head off
fails, and pages outside the requests must keep the sentinel.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, decode_items
from .hetero import (
    BIG,
    SIZES,
    Group,
    assert_success_and_exact,
    exclude,
    rank_geoms,
    run_case,
    run_groups,
    tp_group,
)
from .hetero import HEAD_POOLS as GEOMS

MLA = [
    PoolGeom("mla", "paged", layers=2, pages=128, page_size=16, dim=32),
    PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module")
def cluster(bootstrap: BootstrapServer) -> Iterator[dict[str, Group]]:
    b = bootstrap.address
    pf = Agent("prefill", {**FAST, "bootstrap": b, "instance": "tp1"}, rank_geoms(GEOMS, 1, 0))
    dc = None
    try:
        dc = Agent("decode", dict(FAST), rank_geoms(GEOMS, 1, 0))
        dc.call("sentinel")
        groups = {"p1": Group(pf, ["main"], "tp1"), "d1": Group(dc, ["main"])}
        for tp in (2, 4):
            groups[f"p{tp}"] = tp_group(pf, "prefill", f"p{tp}", GEOMS, tp, b, f"tp{tp}")
            groups[f"d{tp}"] = tp_group(dc, "decode", f"d{tp}", GEOMS, tp)
        for tp in (1, 2):
            groups[f"mp{tp}"] = tp_group(pf, "prefill", f"mp{tp}", MLA, tp, b, f"mla{tp}")
            groups[f"md{tp}"] = tp_group(dc, "decode", f"md{tp}", MLA, tp)
        yield groups
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def counters(g: Group, name: str) -> list[int]:
    return [int(m.get(name, 0)) for m in g.each("metrics")]


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_every_head_lands_once_in_nhd_hnd_and_gqa_pools(cluster, bootstrap, tp_p, tp_d) -> None:
    p, d = cluster[f"p{tp_p}"], cluster[f"d{tp_d}"]
    leases = counters(d, "staged_leases_hnd")
    full = counters(d, "staging_full")
    gathered = counters(p, "gathered_writes")
    # the last request is big enough (64 pages in 2 chunks) for the senders to gather
    outs = run_case(cluster, bootstrap.address, f"p{tp_p}", f"d{tp_d}", GEOMS, [*SIZES, (BIG, 2)])
    # every prefill rank finished its rooms (silent or not): nothing is left waiting
    assert all(t["rooms"] == 0 and t["pending"] == 0 for t in p.each("tables"))
    # The HND pool went through staging: each decode rank lent every sender of its "kvh"
    # heads a lease for every room (never fell back: staging was not full), and the senders
    # gathered their writes into few entries.
    rooms = len(outs[0])
    per_rank = max(1, tp_p // tp_d)
    assert all(b - a >= rooms * per_rank for a, b in zip(leases, counters(d, "staged_leases_hnd")))
    assert counters(d, "staging_full") == full
    assert sum(counters(p, "gathered_writes")) > sum(gathered)
    # in place, "kvh" alone would take one entry per page and buffer of the big request
    kvh_in_place = 2 * 2 * BIG // 16
    big = [max(out.values(), key=lambda o: o["stats"]["bytes"])["stats"] for out in outs]
    assert all(s["blocks"] < kvh_in_place for s in big), big


def test_pools_that_find_staging_full_are_written_in_place(cluster, bootstrap) -> None:
    """A decode whose staging holds less than one room's leases (256 KiB against about
    576 KiB) stages what fits and lets the other pools take the in-place path: the room still
    lands byte-exact, whichever pools ended up where."""
    dc = Agent("decode", dict(FAST), rank_geoms(GEOMS, 1, 0), env={"PDXFER_STAGING_MB": "0.25"})
    try:
        d = Group(dc, ["main"])
        dc.call("sentinel")
        f = Factory(GEOMS, GEOMS, seed=7)
        reqs = [f.make(BIG, chunks=2), f.make(200, chunks=3)]
        outs = run_groups(cluster["p2"], d, bootstrap.address, reqs)
        assert_success_and_exact(outs, d.each("verify", items=decode_items(reqs)))
        assert d.each("untouched", exclude=exclude(reqs)) == [0]
        m = dc.call("metrics")
        assert m.get("staging_full", 0) > 0
        assert m.get("staged_leases_hnd", 0) + m.get("staged_leases_nhd", 0) > 0
    finally:
        dc.close()


def test_mla_two_to_one_second_rank_writes_nothing(cluster, bootstrap) -> None:
    before = [m["transport_bytes"] for m in cluster["mp2"].each("metrics")]
    outs = run_case(cluster, bootstrap.address, "mp2", "md1", MLA)
    after = [m["transport_bytes"] for m in cluster["mp2"].each("metrics")]
    assert after[0] > before[0] and after[1] == before[1]
    got = sum(o["stats"]["bytes"] for o in outs[0].values())
    assert after[0] - before[0] == got, "the latent once, not once per prefill rank"
    assert all(o["stats"]["senders"] == 1 for o in outs[0].values())
    assert all(t["rooms"] == 0 for t in cluster["mp2"].each("tables"))


def test_mla_one_to_two_every_decode_rank_gets_the_latent_once(cluster, bootstrap) -> None:
    """Each decode rank receives every room's latent (and slots) once: the same bytes on
    both ranks, from one sender, and the prefill sent exactly their sum."""
    before = counters(cluster["mp1"], "transport_bytes")[0]
    outs = run_case(cluster, bootstrap.address, "mp1", "md2", MLA)
    sent = counters(cluster["mp1"], "transport_bytes")[0] - before
    assert all(o["stats"]["senders"] == 1 for out in outs for o in out.values())
    got = [sum(o["stats"]["bytes"] for o in out.values()) for out in outs]
    assert got[0] == got[1] > 0 and sent == sum(got), (got, sent)
