"""Packed requests: a chunk's token rows gathered into one contiguous run, pure numpy.

Scattered small pages cost one transport entry each per buffer. For a packed pool the decode
lends a lease of its pack staging (``PACK_POOL``): decode buffer ``j``, request token ``k``
(counted from ``prefix_len``) sits at ``lease + (j*ntok + k)*token_bytes`` (the staged
layout of ``heads.py`` with the whole token as the slice). The sender gathers each source
buffer's rows of a chunk into its own staging (one ``index_select`` per buffer), writes them
as a few large entries, and the decode scatters the lease into its pages before Success.

``wanted`` is the rule that picks packed pools per request: whole token rows 1:1 on both
sides (token-major, same heads and bytes), then ``off``/``on``, or ``auto``: both pools on a
device, pages at most ``max_page_bytes`` and at least ``min_pages`` of them in the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..pools import PoolSpec
from .paged import Blocks, BufferPairing, check_pages, runs

PACK_POOL = "pdxfer.pack"
"""The name under which a decode advertises its pack staging (an optional slot pool)."""
_U64 = np.uint64


def whole_rows(mine: PoolSpec, theirs: PoolSpec, heads: tuple[int, int] | None = None) -> bool:
    """Whether ``theirs`` writes whole token rows of ``mine`` one to one (so a lease of token
    rows can hold them): paged, token-major, equal token bytes, the same heads (all of
    them, when ``heads`` names a range)."""
    if mine.kind != "paged" or theirs.kind != "paged" or not mine.item_bytes:
        return False
    if not (mine.token_major and theirs.token_major) or mine.token_bytes != theirs.token_bytes:
        return False
    a, b = mine.sharding, theirs.sharding
    if a.kind != b.kind:
        return False
    if a.kind != "heads":
        return True
    span = (a.first_head, a.first_head + a.rank_heads)
    return span == (b.first_head, b.first_head + b.rank_heads) and heads in (None, span)


def wanted(
    mode: str,
    mine: PoolSpec,
    theirs: PoolSpec,
    heads: tuple[int, int] | None,
    pages: int,
    min_pages: int,
    max_page_bytes: int,
) -> bool:
    """Whether a request packs pool ``mine`` (the decode's) written from ``theirs``: the rule
    in the module docstring (``pages``: the request's destination pages of the pool)."""
    if mode == "off" or not whole_rows(mine, theirs, heads):
        return False
    if mode == "on":
        return True
    return (
        mine.location != "cpu"
        and theirs.location != "cpu"
        and mine.item_bytes <= max_page_bytes
        and pages >= min_pages
    )


def pack_bytes(pool: PoolSpec, ntok: int) -> int:
    """Bytes of a lease holding ``ntok`` token rows of every buffer of ``pool``."""
    return len(pool.buffers) * ntok * pool.token_bytes


def pack_error(
    pool: PoolSpec,
    theirs: PoolSpec,
    heads: tuple[int, int] | None,
    staging: PoolSpec | None,
    addr: int,
    ntok: int,
) -> str | None:
    """Why a pack lease at ``addr`` for decode pool ``pool`` cannot be served, or None: the
    pool must pair whole rows, and the lease lie wholly inside the decode's pack staging."""
    if not whole_rows(pool, theirs, heads):
        return f"pool {pool.name!r}: packing needs whole token rows one to one"
    if staging is None or not staging.buffers:
        return f"pool {pool.name!r}: packed but the decode advertised no pack staging"
    n, b = pack_bytes(pool, ntok), staging.buffers[0]
    if not (b.addr <= addr and addr + n <= b.addr + b.nbytes):
        return (
            f"pool {pool.name!r}: pack lease {addr:#x}+{n} outside the decode's pack "
            f"staging {b.addr:#x}+{b.nbytes}"
        )
    return None


@dataclass(frozen=True, slots=True)
class Pack:
    """One chunk of one pool, packed: source buffer ``src[i]`` gives rows ``rows`` (of
    ``row_bytes``, counted from the buffer's start, ``src_rows`` in it), which land back to
    back at ``dst[i]`` in the lease."""

    location: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    rows: np.ndarray
    row_bytes: int
    src_rows: int

    @property
    def part_bytes(self) -> int:
        return int(self.rows.size) * self.row_bytes

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.part_bytes

    def blocks(self) -> Blocks:
        """The same bytes written straight from the pages: one block per run of source rows
        per buffer (what a sender without staging writes)."""
        s0, k0, n = runs(self.rows, np.arange(self.rows.size, dtype=np.int64))
        rb = _U64(self.row_bytes)
        src = (np.array(self.src, _U64)[:, None] + s0.astype(_U64)[None, :] * rb).reshape(-1)
        dst = (np.array(self.dst, _U64)[:, None] + k0.astype(_U64)[None, :] * rb).reshape(-1)
        nb = np.broadcast_to(n.astype(_U64)[None, :] * rb, (len(self.src), n.size)).reshape(-1)
        return Blocks(src, dst, nb)


def plan_pack(
    pairing: BufferPairing,
    lease: int,
    ntok: int,
    src_pages: np.ndarray,
    src_first: int,
    prefix_len: int,
    start: int,
    end: int,
) -> Pack | str:
    """Tokens ``[start, end)`` of the source pages (covering tokens from ``src_first``) packed
    into the lease at ``lease`` of a request of ``ntok`` tokens from ``prefix_len``."""
    src, dst = pairing.src, pairing.dst
    if not whole_rows(dst, src):
        return f"pool {src.name!r}: packing needs whole token rows one to one"
    if end <= start:
        return Pack(src.location, (), (), np.zeros(0, np.int64), src.token_bytes, 0)
    if start < src_first or start < prefix_len or end - prefix_len > ntok:
        return f"pool {src.name!r}: tokens [{start}, {end}) outside the packed request"
    if end - src_first > src_pages.size * src.page_size:
        return f"pool {src.name!r}: source indices do not cover tokens up to {end}"
    why = check_pages(pairing, src_pages, None)
    if why:
        return why
    tb, ps = src.token_bytes, src.page_size
    rel = np.arange(start - src_first, end - src_first, dtype=np.int64)
    rows = src_pages[rel // ps] * ps + rel % ps
    index = {(b.layer_id, b.role): j for j, b in enumerate(dst.buffers)}
    k0 = start - prefix_len
    dsts = tuple(lease + (index[(b.layer_id, b.role)] * ntok + k0) * tb for b in src.buffers)
    return Pack(
        src.location, tuple(int(a) for a in pairing.src_base), dsts, rows, tb, src.num_items * ps
    )
