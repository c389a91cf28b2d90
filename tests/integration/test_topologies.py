"""DP groups, PP stages, host-DRAM landing pools and many pools in one request, between
processes over real Mooncake TCP; every destination byte is checked against its pattern."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items
from .hetero import Group, add_group, assert_success_and_exact, run_groups

KV = PoolGeom("kv", "mha", layers=4, pages=256, page_size=16, heads=2, head_dim=16)
AUX = PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32")
# several pools in one request: draft KV sharing the target's pages, a sidecar with a quarter
# of the bytes per page (kv: 16 tok x 2 heads x 16 dims x fp16 = 1 KiB/page per buffer), a
# sliding-window pool with its own indices, a Mamba-like state slot and aux rows
MULTI = [
    KV,
    PoolGeom(
        "draft",
        "mha",
        layers=1,
        pages=256,
        page_size=16,
        heads=1,
        head_dim=32,
        indices_from="kv",
        first_layer=50,
    ),
    PoolGeom(
        "sidecar",
        "paged",
        layers=4,
        pages=256,
        page_size=16,
        dim=8,
        indices_from="kv",
        first_layer=60,
    ),
    PoolGeom("window", "paged", layers=2, pages=128, page_size=32, dim=24, first_layer=70),
    PoolGeom("state", "slots", layers=2, pages=16, dim=100, dtype="float32", first_layer=80),
    AUX,
]


def stage(g: PoolGeom, pp: int, of: int) -> PoolGeom:
    """Stage ``pp`` of ``of`` holds its share of the layers (aux on every stage, own rows)."""
    n = g.layers // of
    return dataclasses.replace(g, layers=n, first_layer=g.first_layer + pp * n)


@pytest.fixture(scope="module")
def cluster(bootstrap: BootstrapServer) -> Iterator[dict[str, Group]]:
    b = bootstrap.address
    pf = Agent("prefill", {**FAST, "bootstrap": b, "instance": "multi"}, MULTI)
    dc = None
    try:
        dc = Agent("decode", dict(FAST), MULTI)
        dc.call("sentinel")
        g = {"pmulti": Group(pf, ["main"], "multi"), "dmulti": Group(dc, ["main"])}
        g["pdp"] = add_group(
            pf,
            "prefill",
            "dp",
            2,
            lambda i: [KV, AUX],
            lambda i: {"dp_rank": i, "dp_size": 2},
            b,
            "dp",
        )
        g["ddp"] = add_group(dc, "decode", "ddp", 1, lambda i: [KV, AUX], lambda i: {})
        aux2 = dataclasses.replace(AUX, layers=2)
        g["ppp"] = add_group(
            pf,
            "prefill",
            "pp",
            2,
            lambda i: [stage(KV, i, 2), stage(aux2, i, 2)],
            lambda i: {"pp_rank": i, "pp_size": 2},
            b,
            "pp",
        )
        g["dpp"] = add_group(dc, "decode", "dpp", 1, lambda i: [KV, aux2], lambda i: {})
        for ps in (1, 4):
            host = dataclasses.replace(KV, page_size=ps, pages=4096 // ps, page_remap=True)
            g[f"dhost{ps}"] = add_group(
                dc, "decode", f"host{ps}", 1, lambda i, h=host: [h, AUX], lambda i: {}
            )
        yield g
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def test_rooms_route_to_both_dp_groups_and_land_exactly(cluster, bootstrap) -> None:
    pf, dc = cluster["pdp"], cluster["ddp"]
    f = Factory([KV, AUX], [KV, AUX], seed=5)
    reqs = [f.make(n, chunks=2) for n in (40, 70, 100, 33)]
    reqs[3]["dp"] = 0  # the caller may name the group; the others go to room % 2
    groups = [r["dp"] if "dp" in r else r["room"] % 2 for r in reqs]
    assert set(groups) == {0, 1}
    prep, send = prefill_items(reqs)
    dc.each(
        "recv",
        items=[{**d, "dp": r.get("dp")} for d, r in zip(decode_items(reqs), reqs)],
        bootstrap=bootstrap.address,
        instance="dp",
    )
    for i, name in enumerate(pf.names):
        mine = [k for k, gi in enumerate(groups) if gi == i]
        pf.agent.call("prepare", ep=name, items=[prep[k] for k in mine])
        pf.agent.call("send", ep=name, items=[send[k] for k in mine])
    outs = dc.each("wait", rooms=[r["room"] for r in reqs], timeout=30)
    assert_success_and_exact(outs, dc.each("verify", items=decode_items(reqs)))
    assert all(t["rooms"] == 0 and t["pending"] == 0 for t in pf.each("tables"))


def test_two_pp_stages_fill_every_layer_of_one_decode_rank(cluster, bootstrap) -> None:
    pf, dc = cluster["ppp"], cluster["dpp"]
    f = Factory([KV, AUX], [KV, AUX], seed=6)
    reqs = [f.make(n, chunks=c) for n, c in ((50, 1), (300, 3), (16, 1))]
    outs = run_groups(pf, dc, bootstrap.address, reqs)
    assert_success_and_exact(outs, dc.each("verify", items=decode_items(reqs)))
    assert all(o["stats"]["senders"] == 2 for o in outs[0].values())


@pytest.mark.parametrize("ps", [1, 4])
def test_host_pool_with_small_pages_receives_every_token(cluster, bootstrap, ps) -> None:
    dc = cluster[f"dhost{ps}"]
    host = dataclasses.replace(KV, page_size=ps, pages=4096 // ps)
    f = Factory([KV, AUX], [host, AUX], seed=ps)
    run = list(range(100, 100 + 160 // ps))  # host slots kept aside for a contiguous request
    f.dst["kv"].free = [p for p in f.dst["kv"].free if p not in set(run)]
    reqs = [f.make(n, chunks=c) for n, c in ((1, 1), (37, 2), (200, 3))]
    # a request whose host slots are contiguous moves one run per buffer, not one per token
    contiguous = f.make(160)
    f.dst["kv"].give(contiguous["dst"]["kv"])
    contiguous["dst"]["kv"] = run
    reqs.append(contiguous)
    dc.each("sentinel")
    outs = run_groups(
        Group(cluster["pmulti"].agent, ["dp:0"], "dp"),
        dc,
        bootstrap.address,
        [dict(r, dp=0) for r in reqs],
    )
    assert_success_and_exact(outs, dc.each("verify", items=decode_items(reqs)))
    blocks = outs[0][contiguous["room"]]["stats"]["blocks"]
    src_pages = len(contiguous["src"]["kv"])
    assert blocks <= 8 * src_pages + 1  # 8 buffers x source page runs, + the aux row


def test_one_request_carries_target_draft_sidecar_window_state_and_aux(cluster, bootstrap) -> None:
    pf, dc = cluster["pmulti"], cluster["dmulti"]
    f = Factory(MULTI, MULTI, seed=9)
    reqs = [f.make(n, chunks=c) for n, c in ((64, 1), (129, 3), (250, 4))]
    dc.each("sentinel")
    outs = run_groups(pf, dc, bootstrap.address, reqs)
    checks = dc.each("verify", items=decode_items(reqs))
    assert_success_and_exact(outs, checks)
    excl: dict[str, list[int]] = {}
    for r in reqs:
        for n, p in r["dst"].items():
            excl.setdefault(n, []).extend(p)
        for n, s in r["dst_slots"].items():
            excl.setdefault(n, []).append(s)
    assert dc.each("untouched", exclude=excl) == [0]


def test_pool_missing_on_one_side_is_refused_by_name_unless_optional(cluster, bootstrap) -> None:
    pf, dc = cluster["pmulti"], cluster["dmulti"]
    dc.agent.call(
        "add_endpoint",
        name="nosidecar",
        role="decode",
        config=dict(FAST),
        geoms=[g for g in MULTI if g.name != "sidecar"],
    )
    f = Factory(MULTI, MULTI, seed=11)
    r = f.make(32)
    d = decode_items([r])[0]
    d["dst"] = {k: v for k, v in d["dst"].items() if k != "sidecar"}
    dc.agent.call("recv", ep="nosidecar", items=[d], bootstrap=bootstrap.address, instance="multi")
    out = dc.agent.call("wait", ep="nosidecar", rooms=[r["room"]], timeout=20)[r["room"]]
    assert out["state"] == "Failed" and "'sidecar'" in out["failure"], out
    # the same decode pools against a prefill that declares its sidecar optional: served
    opt = [dataclasses.replace(g, optional=True) if g.name == "sidecar" else g for g in MULTI]
    p2 = add_group(
        pf.agent,
        "prefill",
        "optsidecar",
        1,
        lambda i: opt,
        lambda i: {},
        bootstrap.address,
        "optsidecar",
    )
    r2 = f.make(100, chunks=2)
    for c in r2["chunks"]:
        c["pages"].pop("sidecar", None)
    r2["dst"].pop("sidecar", None)
    outs = run_groups(p2, Group(dc.agent, ["nosidecar"]), bootstrap.address, [r2])
    checks = dc.agent.call("verify", ep="nosidecar", items=decode_items([r2]))
    assert_success_and_exact(outs, [checks])
