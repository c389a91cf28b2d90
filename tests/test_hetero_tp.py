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
from pdxfer.harness import Agent
from pdxfer.patterns import PoolGeom

from .conftest import FAST
from .helpers import Factory, decode_items
from .hetero import Group, assert_success_and_exact, rank_geoms, run_groups, tp_group

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=4, total_heads=4, head_dim=8),
    PoolGeom("kvh", "mha", layers=2, pages=256, page_size=16, heads=4, total_heads=4, head_dim=8,
             layout="HND", first_layer=10),
    PoolGeom("gqa", "mha", layers=1, pages=256, page_size=16, heads=2, total_heads=2, head_dim=8,
             layout="HND", indices_from="kv", first_layer=20),
    PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32"),
]
MLA = [PoolGeom("mla", "paged", layers=2, pages=128, page_size=16, dim=32),
       PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32")]


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


def exclude(reqs: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in reqs:
        for n, p in r["dst"].items():
            out.setdefault(n, []).extend(p)
        for n, s in r["dst_slots"].items():
            out.setdefault(n, []).append(s)
    return out


def run_case(cluster: dict[str, Group], bootstrap: str, pf: str, dc: str,
             geoms: list[PoolGeom]) -> list[dict]:
    f = Factory(geoms, geoms, seed=len(pf) * 10 + len(dc))
    reqs = [f.make(n, chunks=c) for n, c in [(16, 1), (45, 2), (200, 3), (129, 4)]]
    p, d = cluster[pf], cluster[dc]
    d.each("sentinel")
    outs = run_groups(p, d, bootstrap, reqs)
    assert_success_and_exact(outs, d.each("verify", items=decode_items(reqs)))
    assert d.each("untouched", exclude=exclude(reqs)) == [0] * len(d.names)
    return outs


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_every_head_lands_once_in_nhd_hnd_and_gqa_pools(cluster, bootstrap, tp_p, tp_d) -> None:
    run_case(cluster, bootstrap.address, f"p{tp_p}", f"d{tp_d}", GEOMS)
    # every prefill rank finished its rooms (silent or not): nothing is left waiting
    p = cluster[f"p{tp_p}"]
    assert all(t["rooms"] == 0 and t["pending"] == 0 for t in p.each("tables"))


def test_mla_two_to_one_second_rank_writes_nothing(cluster, bootstrap) -> None:
    before = [m["transport_bytes"] for m in cluster["mp2"].each("metrics")]
    outs = run_case(cluster, bootstrap.address, "mp2", "md1", MLA)
    after = [m["transport_bytes"] for m in cluster["mp2"].each("metrics")]
    assert after[0] > before[0] and after[1] == before[1]
    assert all(o["stats"]["senders"] == 1 for o in outs[0].values())
    assert all(t["rooms"] == 0 for t in cluster["mp2"].each("tables"))


def test_mla_one_to_two_every_decode_rank_gets_the_latent(cluster, bootstrap) -> None:
    outs = run_case(cluster, bootstrap.address, "mp1", "md2", MLA)
    assert all(o["stats"]["senders"] == 1 for out in outs for o in out.values())
