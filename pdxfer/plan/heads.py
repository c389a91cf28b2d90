"""Address math for a head slice of a head-sharded pool (heterogeneous TP), pure numpy.

A sender writes global heads ``[lo, hi)`` that it holds into a decode rank that holds them too,
possibly at another offset inside a token (NHD) or inside a page (HND):

- HND (head-major pages): the slice of one page is one block of ``(hi-lo)*page_size*head_bytes``
  bytes, so a slice costs one entry per page and buffer in place: as many entries as a 1:1
  copy of scattered pages, each carrying a fraction of the bytes.
- NHD or page size 1 (token-major): the slice of one token is one block, one entry per token
  and buffer in place.

Either way the decode may lend staging instead (``plan_staged``, ``staging``): the blocks then
land back to back and the sender's gather merges them into a few large entries.
"""

from __future__ import annotations

import numpy as np

from ..pools import PoolSpec
from .paged import Blocks, BufferPairing, check_pages, plan_paged, runs, token_rows

_U64 = np.uint64


def _span(pool_first: int, pool_heads: int) -> tuple[int, int]:
    return pool_first, pool_first + pool_heads


def head_range_error(pairing: BufferPairing, lo: int, hi: int) -> str | None:
    """Why ``[lo, hi)`` is not a slice both sides hold, or None."""
    src, dst = pairing.src, pairing.dst
    if src.sharding.kind != "heads" or dst.sharding.kind != "heads":
        return f"pool {src.name!r}: a head range needs head-sharded pools on both sides"
    for side, p in (("prefill", src), ("decode", dst)):
        a, b = _span(p.sharding.first_head, p.sharding.rank_heads)
        if not a <= lo < hi <= b:
            return f"pool {src.name!r}: heads [{lo}, {hi}) not within {side} heads [{a}, {b})"
    return None


def _offsets(
    pairing: BufferPairing,
    s: np.ndarray,
    d: np.ndarray,
    s_unit: int,
    d_unit: int,
    s_off: int,
    d_off: int,
    nbytes: int,
) -> Blocks:
    """One block of ``nbytes`` per (buffer, index pair), buffer-major."""
    src = (
        pairing.src_base[:, None] + s.astype(_U64)[None, :] * _U64(s_unit) + _U64(s_off)
    ).reshape(-1)
    dst = (
        pairing.dst_base[:, None] + d.astype(_U64)[None, :] * _U64(d_unit) + _U64(d_off)
    ).reshape(-1)
    nb = np.full(src.shape[0], nbytes, dtype=_U64)
    return Blocks(src, dst, nb)


def plan_head_slice(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
    lo: int,
    hi: int,
    exact: bool = False,
) -> Blocks | str:
    """Blocks moving heads ``[lo, hi)`` of tokens ``[start, end)`` (see ``plan.plan_paged``;
    HND slices move whole pages, so their chunks must start and, when ``exact``, end on a
    page boundary)."""
    src, dst = pairing.src, pairing.dst
    why = head_range_error(pairing, lo, hi)
    if why:
        return why
    ss, ds = src.sharding, dst.sharding
    if (lo, hi) == _span(ss.first_head, ss.rank_heads) == _span(ds.first_head, ds.rank_heads):
        return plan_paged(pairing, src_pages, src_first, dst_pages, dst_first, start, end, exact)
    if end <= start:
        return Blocks.empty()
    ps_s, ps_d, hb = src.page_size, dst.page_size, ss.head_bytes
    if start < src_first or start < dst_first:
        return f"pool {src.name!r}: token {start} precedes the indices' first token"
    if end - src_first > src_pages.size * ps_s or end - dst_first > dst_pages.size * ps_d:
        return f"pool {src.name!r}: indices do not cover tokens up to {end}"
    s_off, d_off = (lo - ss.first_head) * hb, (lo - ds.first_head) * hb
    width = (hi - lo) * hb
    if not (src.token_major and dst.token_major):
        if (
            ps_s != ps_d
            or (start - src_first) % ps_s
            or (start - dst_first) % ps_d
            or exact
            and (end - src_first) % ps_s
        ):
            return (
                f"pool {src.name!r}: HND head slices need equal page sizes and page-aligned chunks"
            )
        i0, j0 = (start - src_first) // ps_s, (start - dst_first) // ps_d
        count = -(-(end - start) // ps_s)
        s, d = src_pages[i0 : i0 + count], dst_pages[j0 : j0 + count]
        why = check_pages(pairing, s, d)
        if why:
            return why
        return _offsets(
            pairing, s, d, src.item_bytes, dst.item_bytes, s_off * ps_s, d_off * ps_d, width * ps_s
        )
    why = check_pages(pairing, src_pages, dst_pages)
    if why:
        return why
    s, d = token_rows(pairing, src_pages, src_first, dst_pages, dst_first, start, end)
    if width == src.token_bytes == dst.token_bytes:
        s0, d0, n = runs(s, d)
        blocks = _offsets(pairing, s0, d0, width, width, 0, 0, 0)
        nb = np.broadcast_to(n.astype(_U64)[None, :] * _U64(width), (len(pairing), n.size)).reshape(
            -1
        )
        return Blocks(blocks.src, blocks.dst, nb)
    return _offsets(pairing, s, d, src.token_bytes, dst.token_bytes, s_off, d_off, width)


def plan_staged(
    pairing: BufferPairing,
    stage: int,
    ntok: int,
    src_pages: np.ndarray,
    src_first: int,
    prefix_len: int,
    start: int,
    end: int,
    lo: int,
    hi: int,
    exact: bool = False,
) -> Blocks | str:
    """Blocks writing heads ``[lo, hi)`` of tokens ``[start, end)`` packed into a decode
    staging lease at ``stage`` (layout in ``staging``) for a request of ``ntok`` tokens from
    ``prefix_len``: one block per token, or per page for HND; one block per run of source
    tokens (pages) when the sender's whole token (page) is the slice."""
    src, dst = pairing.src, pairing.dst
    why = head_range_error(pairing, lo, hi)
    if why:
        return why
    if src.token_major != dst.token_major:
        return f"pool {src.name!r}: staged head slices need the same layout on both sides"
    if end <= start:
        return Blocks.empty()
    if start < src_first or start < prefix_len or end - prefix_len > ntok:
        return f"pool {src.name!r}: tokens [{start}, {end}) outside the staged request"
    if not src.token_major:
        if exact and (end - src_first) % src.page_size:
            return (
                f"pool {src.name!r}: HND head slices need equal page sizes and page-aligned chunks"
            )
        return _plan_staged_pages(
            pairing, stage, ntok, src_pages, src_first, prefix_len, start, end, lo, hi
        )
    if end - src_first > src_pages.size * src.page_size:
        return f"pool {src.name!r}: source indices do not cover tokens up to {end}"
    why = check_pages(pairing, src_pages, None)
    if why:
        return why
    hb, tb = src.sharding.head_bytes, src.token_bytes
    width, s_off = (hi - lo) * hb, (lo - src.sharding.first_head) * hb
    base = _staging_bases(pairing, stage, ntok * width)
    pos = np.arange(start, end, dtype=np.int64)
    rel = pos - src_first
    s = src_pages[rel // src.page_size] * src.page_size + rel % src.page_size
    k = pos - prefix_len
    if width == tb:
        s0, k0, n = runs(s, k)
        nb = np.broadcast_to(n.astype(_U64)[None, :] * _U64(width), (len(pairing), n.size))
    else:
        s0, k0 = s, k
        nb = np.full((len(pairing), s.size), width, dtype=_U64)
    srca = pairing.src_base[:, None] + s0.astype(_U64)[None, :] * _U64(tb) + _U64(s_off)
    dsta = base[:, None] + k0.astype(_U64)[None, :] * _U64(width)
    return Blocks(srca.reshape(-1), dsta.reshape(-1), nb.reshape(-1))


def _staging_bases(pairing: BufferPairing, stage: int, per_buffer: int) -> np.ndarray:
    """Staging address of each source buffer's part of a lease: the decode's buffer order
    (the one ``staging.scatter`` walks), which need not be the sender's."""
    index = {(b.layer_id, b.role): j for j, b in enumerate(pairing.dst.buffers)}
    j = np.array([index[(b.layer_id, b.role)] for b in pairing.src.buffers], dtype=_U64)
    return _U64(stage) + j * _U64(per_buffer)


def _plan_staged_pages(
    pairing: BufferPairing,
    stage: int,
    ntok: int,
    src_pages: np.ndarray,
    src_first: int,
    prefix_len: int,
    start: int,
    end: int,
    lo: int,
    hi: int,
) -> Blocks | str:
    """HND half of ``plan_staged``: inside a source page heads ``[lo, hi)`` are one block at
    ``(lo - first_head)*page_size*head_bytes``; request page ``k`` of the lease takes it."""
    src, dst = pairing.src, pairing.dst
    ps = src.page_size
    if ps != dst.page_size or (start - src_first) % ps or (start - prefix_len) % ps:
        return f"pool {src.name!r}: HND head slices need equal page sizes and page-aligned starts"
    i0, k0 = (start - src_first) // ps, (start - prefix_len) // ps
    count = -(-(end - start) // ps)
    if i0 + count > src_pages.size:
        return f"pool {src.name!r}: source indices do not cover tokens up to {end}"
    s = src_pages[i0 : i0 + count]
    why = check_pages(pairing, s, None)
    if why:
        return why
    sh = src.sharding
    unit = (hi - lo) * sh.head_bytes * ps
    s_off = (lo - sh.first_head) * sh.head_bytes * ps
    base = _staging_bases(pairing, stage, -(-ntok // ps) * unit)
    k = np.arange(k0, k0 + count, dtype=np.int64)
    if unit == src.item_bytes:  # the whole source page is the slice: merge page runs
        s0, k1, n = runs(s, k)
        nb = np.broadcast_to(n.astype(_U64)[None, :] * _U64(unit), (len(pairing), n.size))
    else:
        s0, k1 = s, k
        nb = np.full((len(pairing), s.size), unit, dtype=_U64)
    srca = pairing.src_base[:, None] + s0.astype(_U64)[None, :] * _U64(src.item_bytes) + _U64(s_off)
    dsta = base[:, None] + k1.astype(_U64)[None, :] * _U64(unit)
    return Blocks(srca.reshape(-1), dsta.reshape(-1), nb.reshape(-1))


STAGING_POOL = "pdxfer.staging"
"""The name under which a decode advertises its staging buffer (an optional slot pool)."""


def staged_unit(pool: PoolSpec, ntok: int, lo: int, hi: int) -> tuple[int, int]:
    """``(count, nbytes)`` of the packed units of one buffer: tokens (token-major) or whole
    pages (HND, where a page's slice is one contiguous block)."""
    width = (hi - lo) * pool.sharding.head_bytes
    if pool.token_major:
        return ntok, width
    return -(-ntok // pool.page_size), width * pool.page_size


def lease_bytes(pool: PoolSpec, ntok: int, lo: int, hi: int) -> int:
    """Staging for heads ``[lo, hi)`` of ``ntok`` tokens of every buffer of ``pool``."""
    count, unit = staged_unit(pool, ntok, lo, hi)
    return len(pool.buffers) * count * unit


def lease_error(
    pool: PoolSpec, staging: PoolSpec | None, addr: int, ntok: int, lo: int, hi: int
) -> str | None:
    """Why a lease at ``addr`` for ``pool`` is not wholly inside the peer's staging pool, or
    None. Checked by the sender before it plans: a decode may only lend its staging, never
    point the packed layout (which ignores its page indices) at its own pools."""
    if pool.sharding.kind != "heads":
        return f"pool {pool.name!r}: staging needs a head-sharded pool"
    if staging is None or not staging.buffers:
        return f"pool {pool.name!r}: staged but the decode advertised no staging"
    n = lease_bytes(pool, ntok, lo, hi)
    b = staging.buffers[0]
    if not (b.addr <= addr and addr + n <= b.addr + b.nbytes):
        return (
            f"pool {pool.name!r}: staging lease {addr:#x}+{n} outside the decode's "
            f"staging {b.addr:#x}+{b.nbytes}"
        )
    return None
