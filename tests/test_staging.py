"""Staging for NHD head slices: the sender's packed layout and the decode's scatter agree,
gathering keeps every byte, and the staging allocator never hands out a byte twice."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pdxfer import patterns as pat
from pdxfer import plan as P
from pdxfer.headplan import plan_staged
from pdxfer.patterns import PoolGeom
from pdxfer.staging import Lease, Staging, bounce, lease_bytes, scatter


def apply(blocks: P.Blocks) -> None:
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.nbytes.tolist()):
        ctypes.memmove(d, s, n)


def test_staged_slices_scatter_to_the_right_heads_of_every_token() -> None:
    g = PoolGeom("kv", "mha", layers=2, pages=16, page_size=4, heads=2, total_heads=4,
                 head_dim=8, first_head=2)
    (src,), st = pat.build([g])
    (dst,), dt = pat.build([PoolGeom("kv", "mha", layers=2, pages=16, page_size=4, heads=4,
                                     total_heads=4, head_dim=8)])
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
        apply(b if g2 is None else g2[0])
    scatter(dst, Lease("kv", addr, size, 2, 4), dp, prefix, n,
            {(x.layer_id, x.role) for x in src.buffers})
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
    assert out is not None and len(out[0]) == 1
    apply(out[0])
    staging.release(out[1], out[2])
    assert (dst[:128 * 256].reshape(128, 256) == src.reshape(256, 256)[pages]).all()
    assert staging.alloc(1 << 16) == staging.addr  # released and merged back


def test_staging_allocations_never_overlap() -> None:
    st = Staging(1 << 12)
    got = [st.alloc(1000) for _ in range(5)]
    assert got[4] is None
    spans = sorted((a, a + 1024) for a in got[:4] if a is not None)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    st.release(got[1], 1000)  # type: ignore[arg-type]
    assert st.alloc(1000) == got[1]
