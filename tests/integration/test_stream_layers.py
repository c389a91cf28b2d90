"""Partial-layer sends between real processes over Mooncake TCP: a room sent one layer at a
time, or as a grid of token steps by layer groups (pages filled in part by one step and
completed by the next), lands byte-exact in the decode's pages (per-token, per-buffer
patterns reveal any misplaced layer, token or page); the decode's room does not succeed
before its last layer landed; and the sampled integrity check over streamed layers catches
a corrupted page.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent, wait_until

from .conftest import start_pair
from .helpers import Factory, decode_items, prefill_items, verify
from .hetero import Group, assert_success_and_exact, tp_group

LAYERS, PS = 4, 16
KV = PoolGeom("kv", "mha", layers=LAYERS, pages=256, page_size=PS, heads=2, head_dim=16)
AUX = PoolGeom("aux", "slots", layers=1, pages=16, dim=8, dtype="int32")
GEOMS = [KV, AUX]
WAIT = 60.0


@pytest.fixture(scope="module")
def pair(bootstrap: BootstrapServer) -> Iterator[tuple[Agent, Agent]]:
    pf, dc = start_pair(bootstrap, GEOMS)
    dc.call("sentinel")
    yield pf, dc
    pf.close()
    dc.close()


@pytest.fixture(scope="module")
def factory(pair: tuple[Agent, Agent]) -> Factory:
    return Factory(GEOMS, GEOMS, seed=21)


def grid(
    r: dict[str, Any],
    steps: list[int],
    groups: list[tuple[int, int]],
    last: bool = True,
    layers_of: dict[str, range] | None = None,
) -> list[dict[str, Any]]:
    """Chunks of ``r``: for each token step (cut at ``steps``), one chunk per layer group,
    each naming the pages (of the anchor pools holding those layers, ``layers_of``) that
    hold its tokens; the final one carries the slots."""
    layers_of = layers_of or {"kv": range(LAYERS)}
    bounds = [0, *steps, r["num_tokens"]]
    out = []
    for t0, t1 in zip(bounds, bounds[1:]):
        for a, b in groups:
            pages = {
                n: r["src"][n][t0 // PS : -(-t1 // PS)]
                for n, ids in layers_of.items()
                if any(a <= x < b for x in ids)
            }
            out.append({"pages": pages, "layers": [a, b], "tokens": [t0, t1], "last": False})
    if last:
        out[-1]["last"] = True
        out[-1]["slots"] = r["src_slots"]
    return out


def start(
    pf: Agent, dc: Agent, bootstrap: str, r: dict[str, Any], chunks: list[dict[str, Any]]
) -> None:
    prep, _ = prefill_items([r])
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap)
    pf.call("send", items=[{"room": r["room"], "chunks": chunks}])


def _landed(dc: Agent, r: dict[str, Any], layers: int) -> bool:
    """Whether layers ``[0, layers)`` of every token of ``r`` are in the decode's pages."""
    return dc.call(
        "ext",
        fn="tests.harness.transport_cmds:layers_landed",
        room=r["room"],
        dst=r["dst"],
        num_tokens=r["num_tokens"],
        layers=layers,
    )


ONE_BY_ONE = [(x, x + 1) for x in range(LAYERS)]


@pytest.mark.parametrize("shape", ["layer_by_layer", "steps_by_layer", "steps_by_groups"])
def test_streamed_layers_land_byte_exact(pair, bootstrap, factory, shape: str) -> None:
    pf, dc = pair
    r = factory.make(101)  # the last page is partly used
    steps, groups = {
        "layer_by_layer": ([], ONE_BY_ONE),
        "steps_by_layer": ([7, 40, 41, 90], ONE_BY_ONE),
        "steps_by_groups": ([23, 64], [(0, 3), (3, 4)]),
    }[shape]
    start(pf, dc, bootstrap.address, r, grid(r, steps, groups))
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Success", out
    assert verify(dc, [r])[r["room"]][0] == 0
    assert pf.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]["state"] == "Success"
    factory.free(r)


def test_the_room_succeeds_only_once_its_last_layer_landed(pair, bootstrap, factory) -> None:
    pf, dc = pair
    r = factory.make(70)
    chunks = grid(r, [33], ONE_BY_ONE)
    held_back = chunks.pop()  # layer 3 of tokens [33, 70)
    start(pf, dc, bootstrap.address, r, chunks)
    # every other chunk is written (layers 0-2 land whole); the room waits for the one
    # layer still missing
    assert wait_until(lambda: _landed(dc, r, LAYERS - 1), timeout=WAIT)
    assert pf.call("states", rooms=[r["room"]])[r["room"]] == "WaitingForInput"
    assert dc.call("states", rooms=[r["room"]])[r["room"]] == "WaitingForInput"
    assert verify(dc, [r])[r["room"]][0] > 0  # layer 3's last tokens are not there yet
    pf.call(
        "send",
        items=[
            {
                "room": r["room"],
                "open": False,
                "chunks": [{**held_back, "last": True, "slots": r["src_slots"]}],
            }
        ],
    )
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Success", out
    assert verify(dc, [r])[r["room"]][0] == 0
    factory.free(r)


def test_a_last_send_with_a_layer_missing_fails_the_room_and_writes_nothing_past_it(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    r = factory.make(48)
    chunks = grid(r, [], [(0, 3)])  # layer 3 never given, yet the send says last
    start(pf, dc, bootstrap.address, r, chunks)
    out = dc.call("wait", rooms=[r["room"]], timeout=WAIT)[r["room"]]
    assert out["state"] == "Failed" and out["kind"] == "plan", out
    factory.free(r)


def test_sampled_integrity_over_streamed_layers_catches_a_corrupted_page(
    pair, bootstrap, factory
) -> None:
    pf, dc = pair
    rooms = []
    reqs = [factory.make(90) for _ in range(4)]
    dc.call("set_faults", spec=f"corrupt=1,rooms={';'.join(str(r['room']) for r in reqs)}")
    try:
        for r in reqs:
            start(pf, dc, bootstrap.address, r, grid(r, [50], ONE_BY_ONE))
            rooms.append(r["room"])
        outs = dc.call("wait", rooms=rooms, timeout=WAIT)
    finally:
        dc.call("set_faults", spec="")
    for room, out in outs.items():
        assert out["state"] == "Failed" and out["kind"] == "integrity", (room, out)
        assert "layer" in out["failure"], out
    for r in reqs:
        factory.free(r)


HETERO = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=PS, heads=4, total_heads=4, head_dim=8),
    PoolGeom(
        "kvh",
        "mha",
        layers=2,
        pages=256,
        page_size=PS,
        heads=4,
        total_heads=4,
        head_dim=8,
        layout="HND",
        first_layer=10,
    ),
    AUX,
]
HETERO_LAYERS = {"kv": range(0, 2), "kvh": range(10, 12)}


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
def test_streamed_layers_land_byte_exact_across_tp_sizes(pair, bootstrap, tp_p, tp_d) -> None:
    """Head slices per sender, layer by layer: every decode rank counts each sender's layers
    (HND slices need page-aligned steps; the NHD pool alone takes a mid-page one)."""
    pf, dc = pair
    p = tp_group(
        pf, "prefill", f"sp{tp_p}{tp_d}", HETERO, tp_p, bootstrap.address, f"stream{tp_p}{tp_d}"
    )
    d = tp_group(dc, "decode", f"sd{tp_p}{tp_d}", HETERO, tp_d)
    f = Factory(HETERO, HETERO, seed=tp_p * 10 + tp_d)
    reqs = [f.make(101), f.make(77)]
    groups = [(0, 1), (1, 2), (10, 11), (11, 12)]
    chunks = {
        reqs[0]["room"]: grid(reqs[0], [32, 64], groups, layers_of=HETERO_LAYERS),
        reqs[1]["room"]: grid(reqs[1], [16], groups, layers_of=HETERO_LAYERS),
    }
    prep, _ = prefill_items(reqs)
    p.each("prepare", items=prep)
    d.each("recv", items=decode_items(reqs), bootstrap=bootstrap.address, instance=p.instance)
    p.each("send", items=[{"room": r["room"], "chunks": chunks[r["room"]]} for r in reqs])
    outs = d.each("wait", rooms=[r["room"] for r in reqs], timeout=WAIT)
    assert_success_and_exact(outs, d.each("verify", items=decode_items(reqs)))
    assert wait_until(
        lambda: all(t["rooms"] == 0 and t["pending"] == 0 for t in _tables(p)), timeout=WAIT
    )


def _tables(g: Group) -> list[dict[str, int]]:
    return g.each("tables")
