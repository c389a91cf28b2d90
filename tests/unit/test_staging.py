"""Staging for NHD and HND head slices: the sender's packed layout and the decode's scatter agree,
gathering keeps every byte, and the staging allocator never hands out a byte twice."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdxfer import plan as P
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.endpoint.staging import Lease, Staging, bounce, scatter
from pdxfer.plan.heads import lease_bytes, lease_error, plan_staged


def apply(blocks: P.Blocks) -> None:
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.nbytes.tolist()):
        ctypes.memmove(d, s, n)


def test_staged_slices_scatter_to_the_right_heads_of_every_token() -> None:
    g = PoolGeom(
        "kv",
        "mha",
        layers=2,
        pages=16,
        page_size=4,
        heads=2,
        total_heads=4,
        head_dim=8,
        first_head=2,
    )
    (src,), st = pat.build([g])
    (dst,), dt = pat.build(
        [PoolGeom("kv", "mha", layers=2, pages=16, page_size=4, heads=4, total_heads=4, head_dim=8)]
    )
    pat.fill_sentinel(dt)
    room, n, prefix = 77, 13, 3
    sp, dp = np.array([5, 1, 9, 2]), np.array([7, 3, 12])
    pat.fill_tokens(src, st["kv"], room, sp, 0, 0, n)
    pr = P.pair_buffers(src, dst)
    assert not isinstance(pr, str)
    staging = Staging(1 << 16)
    size = lease_bytes(dst, n - prefix, 2, 4)
    addr = staging.alloc(size)
    assert addr is not None
    for lo, hi in ((prefix, 9), (9, n)):  # two chunks
        b = plan_staged(pr, addr, n - prefix, sp, 0, prefix, lo, hi, 2, 4)
        assert not isinstance(b, str), b
        assert P.check_bounds(b, [(addr, size)], "dst") is None
        g2 = bounce(b, staging)
        apply(b if g2 is None else g2.blocks)
    scatter(
        dst,
        Lease("kv", addr, size, 2, 4),
        dp,
        prefix,
        n,
        {(x.layer_id, x.role) for x in src.buffers},
    )
    k = np.arange(prefix, n)
    stok = sp[k // 4] * 4 + k % 4
    dtok = dp[(k - prefix) // 4] * 4 + (k - prefix) % 4
    for ts, td in zip(st["kv"], dt["kv"]):
        a = ts.view(torch.int16).reshape(64, 2, 8)  # compare bits (patterns include NaNs)
        b = td.view(torch.int16).reshape(64, 4, 8)
        assert (b[dtok, 2:] == a[stok]).all()  # heads [2, 4) landed
        assert (b[dtok, :2].contiguous().view(torch.uint8) == pat.SENTINEL).all()
        assert (a[stok] != b[dtok, :2]).any()


def test_gathering_keeps_every_byte_and_saves_entries() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    pages = rng.permutation(256)[:128]
    s = src.ctypes.data + pages.astype(np.uint64) * 256
    d = dst.ctypes.data + np.arange(128, dtype=np.uint64) * 256
    b = P.Blocks(s.astype(np.uint64), d.astype(np.uint64), np.full(128, 256, np.uint64))
    staging = Staging(1 << 16)
    out = bounce(b, staging)
    assert out is not None and len(out.blocks) == 1
    apply(out.blocks)
    staging.release(out.addr, out.nbytes)
    assert (dst[: 128 * 256].reshape(128, 256) == src.reshape(256, 256)[pages]).all()
    assert staging.alloc(1 << 16) == staging.addr  # released and merged back


def test_staging_allocations_never_overlap() -> None:
    st = Staging(1 << 12)
    got = [st.alloc(1000) for _ in range(5)]
    assert got[4] is None
    spans = sorted((a, a + 1024) for a in got[:4] if a is not None)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    st.release(got[1], 1000)  # type: ignore[arg-type]
    assert st.alloc(1000) == got[1]


# -- HND (head-major pages) ------------------------------------------------------------------
PS, HD = 4, 8  # page size, head_dim (fp16: a head of a token is 16 bytes)


def hnd(heads: int, first: int, pages: int = 16) -> PoolGeom:
    return PoolGeom(
        "kv",
        "mha",
        layers=2,
        pages=pages,
        page_size=PS,
        heads=heads,
        total_heads=4,
        head_dim=HD,
        first_head=first,
        layout="HND",
    )


def stage_hnd(
    src_g: PoolGeom,
    dst_spec,
    room: int,
    sp: np.ndarray,
    n: int,
    prefix: int,
    lo: int,
    hi: int,
    staging: Staging,
    cuts: tuple[int, ...],
) -> tuple[Lease, int]:
    """Fill a sender's pages with the pattern, plan its staged writes chunk by chunk (``cuts``
    are page-aligned token boundaries), gather and apply them; return the lease and entries."""
    (src,), st = pat.build([src_g])
    pat.fill_tokens(src, st["kv"], room, sp, 0, 0, n)
    pr = P.pair_buffers(src, dst_spec)
    assert not isinstance(pr, str)
    size = lease_bytes(dst_spec, n - prefix, lo, hi)
    addr = staging.alloc(size)
    assert addr is not None
    entries = 0
    bounds = [prefix, *cuts, n]
    for a, b in zip(bounds, bounds[1:]):
        first = a - a % PS if a > prefix else 0  # the chunk's pages cover from ``first``
        blocks = plan_staged(pr, addr, n - prefix, sp[first // PS :], first, prefix, a, b, lo, hi)
        assert not isinstance(blocks, str), blocks
        assert P.check_bounds(blocks, [(addr, size)], "dst") is None
        g = bounce(blocks, staging)
        apply(blocks if g is None else g.blocks)
        entries += len(blocks if g is None else g.blocks)
        if g is not None:
            staging.release(g.addr, g.nbytes)
    # keep the source tensors alive until the copies above ran
    del st
    return Lease("kv", addr, size, lo, hi), entries


def test_hnd_staged_plan_numbers() -> None:
    """The exact blocks: a page's slice is one block at its head offset inside the page, lands
    as request page k of buffer j, and source pages in a run merge when the slice is the
    whole source page."""
    (src,), _keep = pat.build([hnd(4, 0)])
    (dst,), _keep2 = pat.build([hnd(2, 2)])
    pr = P.pair_buffers(src, dst)
    assert not isinstance(pr, str)
    stage, prefix, n = 1 << 20, 4, 4 + 3 * PS - 1  # 3 request pages, the last one partial
    unit = 2 * 16 * PS  # heads [2, 4): 2 heads x 16 bytes x 4 tokens
    sp = np.array([7, 5, 6, 9])  # src page 0 is the prefix page the decode already holds
    b = plan_staged(pr, stage, n - prefix, sp, 0, prefix, prefix, n, 2, 4)
    assert not isinstance(b, str), b
    assert len(b) == 4 * 3  # 4 buffers x 3 pages (the sender holds more heads: no merging)
    base = np.array([x.addr for x in src.buffers], dtype=np.uint64)
    assert (b.nbytes == unit).all()
    assert (
        b.src.reshape(4, 3).tolist()
        == (base[:, None] + np.array([5, 6, 9], dtype=np.uint64) * 256 + 128).tolist()
    )
    assert b.dst.reshape(4, 3).tolist() == [
        [stage + (j * 3 + k) * unit for k in range(3)] for j in range(4)
    ]
    lo_half = plan_staged(pr, stage, n - prefix, sp, 0, prefix, prefix + PS, n, 2, 3)
    assert not isinstance(lo_half, str)
    assert lo_half.nbytes.tolist()[0] == 16 * PS  # one head
    assert int(lo_half.src[0]) == int(base[0]) + 6 * 256 + 2 * 16 * PS

    # the whole source page is the slice (2 -> 1): pages 5 and 6 merge into one block
    (s2,), _k3 = pat.build([hnd(2, 2)])
    (d2,), _k4 = pat.build([hnd(4, 0)])
    pr2 = P.pair_buffers(s2, d2)
    assert not isinstance(pr2, str)
    b2 = plan_staged(pr2, stage, n - prefix, sp, 0, prefix, prefix, n, 2, 4)
    assert not isinstance(b2, str)
    assert b2.nbytes.tolist() == [2 * unit, unit] * 4
    base2 = [x.addr for x in s2.buffers]
    assert b2.src.tolist()[:2] == [base2[0] + 5 * unit, base2[0] + 9 * unit]
    assert b2.dst.tolist()[:2] == [stage, stage + 2 * unit]
    # misaligned or uncovered ranges are refused, never planned
    assert isinstance(plan_staged(pr2, stage, n - prefix, sp, 0, prefix, prefix + 1, n, 2, 4), str)
    assert isinstance(plan_staged(pr2, stage, n - prefix, sp[:2], 0, prefix, prefix, n, 2, 4), str)
    assert isinstance(plan_staged(pr2, stage, 4, sp, 0, prefix, prefix, n, 2, 4), str)


@pytest.mark.parametrize(
    ("senders", "dst_heads"),
    [
        ([(2, 0), (2, 2)], (4, 0)),  # 2 -> 1: each sender's whole page is a slice
        ([(1, 0), (1, 1), (1, 2), (1, 3)], (4, 0)),  # 4 -> 1
        ([(4, 0)], (2, 2)),  # 1 -> 2, second decode rank: part of the sender's page
        ([(2, 2)], (1, 3)),  # 2 -> 4, last decode rank
    ],
)
def test_hnd_staged_slices_land_on_their_global_heads(senders, dst_heads) -> None:
    """Every sender stages its slice, the decode scatters each lease; every head of every
    token then matches the pattern of its GLOBAL head, and no other page changed."""
    (dst,), dt = pat.build([hnd(*dst_heads, pages=32)])
    pat.fill_sentinel(dt)
    room, prefix, n = 91, 8, 8 + 5 * PS + 3
    rng = np.random.default_rng(3)
    sp = rng.permutation(14)[: -(-n // PS)]
    sp[3:5] = [14, 15]  # a run of contiguous source pages (14 and 15 are nowhere else)
    dp = rng.permutation(32)[: -(-(n - prefix) // PS)]
    staging = Staging(1 << 20)
    d_lo, d_hi = dst_heads[1], dst_heads[1] + dst_heads[0]
    for heads, first in senders:
        lo, hi = max(first, d_lo), min(first + heads, d_hi)
        if lo >= hi:
            continue
        lease, _ = stage_hnd(hnd(heads, first), dst, room, sp, n, prefix, lo, hi, staging, (16,))
        scatter(dst, lease, dp, prefix, n, {(b.layer_id, b.role) for b in dst.buffers})
        staging.release(lease.addr, lease.nbytes)
    assert pat.check_tokens(dst, dt["kv"], room, dp, prefix, prefix, n) == (0, "")
    assert pat.untouched(dst, dt["kv"], dp.tolist()) == 0


def test_hnd_scatter_only_the_buffers_the_sender_wrote() -> None:
    """A pipeline stage holding some layers leaves the other layers' pages as they were."""
    (dst,), dt = pat.build([hnd(4, 0)])
    pat.fill_sentinel(dt)
    staging = Staging(1 << 16)
    n = 2 * PS
    size = lease_bytes(dst, n, 0, 2)
    addr = staging.alloc(size)
    assert addr is not None
    stage = np.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=np.uint8)
    stage[:] = np.arange(size) % 251
    layer0 = {(b.layer_id, b.role) for b in dst.buffers if b.layer_id == 0}
    scatter(dst, Lease("kv", addr, size, 0, 2), np.array([3, 1]), 0, n, layer0)
    unit = 2 * 16 * PS
    for j, (b, t) in enumerate(zip(dst.buffers, dt["kv"])):
        rows = t.view(torch.uint8).reshape(16, 4 * 16 * PS)
        if b.layer_id == 0:
            assert (
                rows[[3, 1], :unit].numpy()
                == stage[j * 2 * unit : (j + 1) * 2 * unit].reshape(2, unit)
            ).all()
            assert (rows[[3, 1], unit:] == pat.SENTINEL).all()
        else:
            assert (rows == pat.SENTINEL).all()


def test_a_lease_must_lie_inside_the_advertised_staging() -> None:
    (dst,), _keep = pat.build([hnd(4, 0)])
    staging = Staging(1 << 12)
    spec = staging.spec()
    n = lease_bytes(dst, 2 * PS, 0, 2)
    assert lease_error(dst, spec, staging.addr, 2 * PS, 0, 2) is None
    assert lease_error(dst, spec, staging.addr + (1 << 12) - n, 2 * PS, 0, 2) is None
    assert lease_error(dst, spec, staging.addr + (1 << 12) - n + 1, 2 * PS, 0, 2)
    assert lease_error(dst, spec, dst.buffers[0].addr, 2 * PS, 0, 2)  # not into the pool
    assert lease_error(dst, None, staging.addr, 2 * PS, 0, 2)
    assert n == 4 * 2 * (2 * 16 * PS)  # 4 buffers x 2 pages x the slice of a page
