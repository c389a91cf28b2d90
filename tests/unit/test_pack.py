"""Packed requests (``plan/pack.py``, ``endpoint/pack.py``): the rule that picks them, the
sender's gather and the decode's scatter agree byte for byte on patterned pages (a row one
token, buffer or request off is caught), and over the in-memory transport a packed request
lands exactly, a failed one leaves its pages untouched and releases them once, and head
slices keep their own path."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from pdxfer import BootstrapServer, KVPoll, wire
from pdxfer import plan as P
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.endpoint.pack import MAX_ENTRY, Packer, merged, unpack
from pdxfer.endpoint.staging import Lease, Staging
from pdxfer.plan.chunk import Ask, check_ask, plan_chunk
from pdxfer.plan.pack import PACK_POOL, Pack, pack_bytes, pack_error, plan_pack, wanted
from tests.harness.memory_pair import Pair, transfer, until, wait


def apply(blocks: P.Blocks) -> None:
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.nbytes.tolist()):
        ctypes.memmove(d, s, n)


def mha(
    ps: int = 4,
    pages: int = 32,
    layout: str = "NHD",
    heads: int = 2,
    first: int = 0,
    total: int | None = None,
) -> PoolGeom:
    return PoolGeom(
        "kv",
        "mha",
        layers=3,
        pages=pages,
        page_size=ps,
        heads=heads,
        head_dim=8,
        layout=layout,
        first_head=first,
        total_heads=total or heads,
    )


def spec(g: PoolGeom, location: str = "cpu") -> Any:
    (s,), _ = pat.build([g])
    return s.with_(location=location)


# -- the rule ------------------------------------------------------------------------------------
def test_the_rule_packs_small_many_device_pages_and_leaves_host_pools_alone() -> None:
    host, dev = spec(mha()), spec(mha(), "cuda:0")
    big = 256 * 1024
    assert wanted("auto", dev, dev, None, 64, 64, big)
    assert not wanted("auto", host, host, None, 1000, 64, big)  # the default keeps host pools
    assert not wanted("auto", dev, host, None, 1000, 64, big)  # a host landing
    assert not wanted("auto", dev, dev, None, 63, 64, big)  # few pages: cheap already
    assert not wanted("auto", dev, dev, None, 1000, 64, dev.item_bytes - 1)  # large pages
    assert wanted("on", host, host, None, 1, 64, big) and not wanted(
        "off", dev, dev, None, 1000, 64, big
    )


def test_only_whole_token_rows_one_to_one_are_packed() -> None:
    hnd = spec(mha(layout="HND"))
    assert not wanted("on", hnd, hnd, None, 100, 1, 1 << 30)  # a partial HND page is not rows
    lo, hi = spec(mha(heads=2, first=0, total=4)), spec(mha(heads=2, first=2, total=4))
    whole = spec(mha(heads=4, total=4))
    assert not wanted("on", whole, lo, None, 100, 1, 1 << 30)  # a head slice (hetero TP)
    assert not wanted("on", lo, lo, (0, 1), 100, 1, 1 << 30)  # asked for part of the heads
    assert wanted("on", lo, lo, (0, 2), 100, 1, 1 << 30) and not wanted(
        "on", lo, hi, None, 100, 1, 1 << 30
    )
    mla = spec(PoolGeom("mla", "paged", layers=2, pages=8, page_size=16, dim=36))
    assert wanted("on", mla, mla, None, 8, 1, 1 << 30)


# -- layout: plan, gather, scatter -------------------------------------------------------------
@pytest.mark.parametrize("ps_src,ps_dst", [(4, 4), (4, 8), (16, 1)])
def test_gather_and_unpack_land_every_row_and_nothing_else(ps_src: int, ps_dst: int) -> None:
    (src,), st = pat.build([mha(ps_src, pages=64)])
    (dst,), dt = pat.build([mha(ps_dst, pages=256 // ps_dst)])
    pat.fill_sentinel(dt)
    room, n, prefix = 41, 53, 2 * max(ps_src, ps_dst)
    rng = np.random.default_rng(1)
    sp = rng.permutation(64)[: -(-n // ps_src)]
    dp = rng.permutation(256 // ps_dst)[: -(-(n - prefix) // ps_dst)]
    pat.fill_tokens(src, st["kv"], room, sp, 0, 0, n)
    pr = P.pair_buffers(src, dst)
    assert not isinstance(pr, str) and n - prefix > 5
    staging = Staging(1 << 20)
    lease_n = pack_bytes(dst, n - prefix)
    lease = staging.alloc(lease_n)
    assert lease is not None
    packer = Packer(Staging(1 << 20))
    cut = prefix + 5
    for lo, hi in ((prefix, cut), (cut, n)):  # two chunks: tokens from their pages
        first = lo - lo % ps_src
        pages = sp[first // ps_src : -(-hi // ps_src)]
        pk = plan_pack(pr, lease, n - prefix, pages, first, prefix, lo, hi)
        assert isinstance(pk, Pack), pk
        assert P.check_bounds(pk.blocks(), [(lease, lease_n)], "dst") is None
        (part,) = list(packer.pieces([pk]))
        g = packer.gather(part)
        assert g is not None and len(g.blocks) == len(pk.src)  # one entry per buffer
        apply(g.blocks)
        packer.release(g)
    unpack(
        dst,
        Lease("kv", lease, lease_n, 0, 0, packed=True),
        dp,
        prefix,
        n,
        {(b.layer_id, b.role) for b in dst.buffers},
    )
    bad, first_wrong = pat.check_tokens(dst, dt["kv"], room, dp, prefix, prefix, n)
    assert bad == 0, first_wrong
    assert pat.untouched(dst, dt["kv"], dp.tolist()) == 0
    # the rows past num_tokens in the last page keep the sentinel: only tokens move
    tail = (n - prefix) % ps_dst
    if tail:
        rows = dt["kv"][0].view(torch.uint8).reshape(256, -1)
        assert (
            rows[int(dp[-1]) * ps_dst + tail : (int(dp[-1]) + 1) * ps_dst] == pat.SENTINEL
        ).all()


def test_the_direct_blocks_and_the_gathered_ones_write_the_same_bytes() -> None:
    (src,), st = pat.build([mha(4, pages=64)])
    pat.fill_tokens(src, st["kv"], 9, np.arange(64), 0, 0, 256)
    pr = P.pair_buffers(src, src)
    assert not isinstance(pr, str)
    pages = np.random.default_rng(2).permutation(64)[:10]
    a, b = np.zeros(pack_bytes(src, 40), np.uint8), np.zeros(pack_bytes(src, 40), np.uint8)
    for out, gather in ((a, False), (b, True)):
        pk = plan_pack(pr, out.ctypes.data, 40, pages, 0, 0, 0, 40)
        assert isinstance(pk, Pack)
        if gather:
            packer = Packer(Staging(1 << 20))
            g = packer.gather(next(packer.pieces([pk])))
            assert g is not None and len(g.blocks) == 1  # the whole request: one entry
            apply(g.blocks)
        else:
            apply(pk.blocks())
    assert a.any() and (a == b).all()


def test_pieces_fit_half_the_staging_and_a_full_staging_gathers_nothing() -> None:
    (src,), _ = pat.build([mha(4, pages=64)])
    pr = P.pair_buffers(src, src)
    assert not isinstance(pr, str)
    pk = plan_pack(pr, 1 << 40, 64, np.arange(16), 0, 0, 0, 64)
    assert isinstance(pk, Pack) and len(pk.src) == 6
    packer = Packer(Staging(4 * pk.part_bytes))
    assert [len(p) for p in packer.pieces([pk])] == [2, 2, 2]
    held = packer.staging.alloc(3 * pk.part_bytes)
    assert held is not None and packer.gather(next(packer.pieces([pk]))) is None


def test_merged_joins_contiguous_runs_and_splits_at_the_entry_cap() -> None:
    b = merged([0, 10, 100], [1000, 1010, 5000], [10, 5, MAX_ENTRY + 1])
    assert b.lists() == (
        [0, 100, 100 + MAX_ENTRY],
        [1000, 5000, 5000 + MAX_ENTRY],
        [15, MAX_ENTRY, 1],
    )


def test_a_lease_outside_the_pack_staging_or_of_a_slice_is_refused() -> None:
    dst = spec(mha())
    stage = Staging(1 << 16).spec(PACK_POOL)
    base, n = stage.buffers[0].addr, pack_bytes(dst, 10)
    assert pack_error(dst, dst, None, stage, base, 10) is None
    assert "outside" in (pack_error(dst, dst, None, stage, base + (1 << 16) - n + 1, 10) or "")
    assert "advertised no" in (pack_error(dst, dst, None, None, base, 10) or "")
    hnd = spec(mha(layout="HND"))
    assert "whole token rows" in (pack_error(hnd, hnd, None, stage, base, 10) or "")
    pr = P.pair_buffers(dst, dst)
    assert not isinstance(pr, str)
    ask = Ask(5, 0, 10, {"kv": np.arange(3)}, {}, pack={"kv": base - 64})
    assert "outside" in check_ask(ask, {"kv": dst, PACK_POOL: stage}, {"kv": pr}, frozenset({"kv"}))


def test_a_plan_without_a_gatherer_writes_packed_pools_straight_into_the_lease() -> None:
    (src,), _ = pat.build([mha(4, pages=64)])
    pr = P.pair_buffers(src, src)
    assert not isinstance(pr, str)
    stage = Staging(1 << 16)
    ask = Ask(5, 0, 12, {"kv": np.arange(3)}, {}, pack={"kv": stage.addr})
    args = (
        ask,
        {"kv": pr},
        {"kv": np.array([7, 3, 9])},
        {"kv": 0},
        {},
        True,
        {"kv": 12},
        {"kv": 4},
        [(b.addr, b.nbytes) for b in src.buffers],
        [(stage.addr, stage.nbytes)],
    )
    direct = plan_chunk(*args)
    packs: list[Pack] = []
    rest = plan_chunk(*args, packs=packs)
    assert isinstance(direct, P.Blocks) and isinstance(rest, P.Blocks)
    assert len(rest) == 0 and len(packs) == 1  # handed to the gatherer, not planned twice
    assert direct.total_bytes == packs[0].nbytes == pack_bytes(src, 12)


# -- wire ---------------------------------------------------------------------------------------
def test_a_request_that_packs_nothing_encodes_as_before_and_pack_round_trips() -> None:
    r = wire.TransferRequest(
        room=1, nonce=2, endpoint_id="a", dst={}, slots={}, prefix_len=0, num_tokens=4
    )
    assert b"pack" not in wire.encode(r)  # an older prefill decodes it
    p = msgspec.structs.replace(r, pack={"kv": 4096})
    assert wire.decode(wire.encode(p)).pack == {"kv": 4096}
    with pytest.raises(ValueError):
        wire.TransferRequest(
            room=1,
            nonce=2,
            endpoint_id="a",
            dst={},
            slots={},
            prefix_len=0,
            num_tokens=4,
            heads={"kv": (0, 1)},
            stage={"kv": 64},
            pack={"kv": 64},
        )


# -- endpoints over the in-memory transport -----------------------------------------------------
@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


def test_packed_requests_land_byte_exact_and_leave_other_pages_alone(srv: BootstrapServer) -> None:
    p = Pair(srv, pack="on")
    try:
        used: list[int] = []
        for tokens, chunks in ((1, 1), (24, 2), (97, 3), (130, 1)):
            tx, rx, room, dst = transfer(p, tokens, chunks)
            assert wait(rx) == KVPoll.Success and wait(tx) == KVPoll.Success, rx.failure
            assert p.wrong_bytes(room, dst, tokens) == 0
            assert pat.untouched(p.dspecs[0], p.dt["kv"], dst) == 0
            pat.fill_sentinel(p.dt)
            used.append(room)
        assert p.dc.metrics()["packed_leases"] == len(used)
        assert p.pf.metrics()["packed_writes"] >= len(used)
        assert until(lambda: p.dc.decode.packing._free == [(0, p.dc.decode.packing.nbytes)])
    finally:
        p.close()


def test_pack_auto_leaves_host_pools_on_the_direct_path(srv: BootstrapServer) -> None:
    p = Pair(srv)  # the default: auto
    try:
        assert p.dc.decode.packing is None and p.pf.prefill.writer.packer is None
        tx, rx, room, dst = transfer(p, 97, 3)
        assert wait(rx) == KVPoll.Success and p.wrong_bytes(room, dst, 97) == 0
        assert "packed_leases" not in p.dc.metrics()
    finally:
        p.close()


def test_a_packed_write_failing_halfway_leaves_the_pages_untouched_and_releases_once(
    srv: BootstrapServer,
) -> None:
    p = Pair(srv, batch_entries=4, pack="on")
    try:
        p.ptx.faults.fail_after_batches = 0  # the packed write's first batch fails
        tx, rx, room, dst = transfer(p, 64, 2)
        assert wait(rx) == KVPoll.Failed and wait(tx) == KVPoll.Failed
        assert until(lambda: p.released[room] == 1)
        # nothing was scattered: the pages hold the sentinel, not half a request
        assert pat.untouched(p.dspecs[0], p.dt["kv"], []) == 0
        assert until(lambda: p.dc.decode.packing._free == [(0, p.dc.decode.packing.nbytes)])
        p.ptx.faults.fail_after_batches = None
        tx, rx, room, dst = transfer(p, 64, 2)  # the lease came back: the next one packs
        assert wait(rx) == KVPoll.Success and p.wrong_bytes(room, dst, 64) == 0
        assert p.released[room] == 0
    finally:
        p.close()
