"""Address math for a slot split over TP piece by piece (``Sharding.kind == "pieces"``), pure.

A Mamba / linear-attention state is one slot per request, but its tensors are sharded over TP:
a conv state's channels in sub-blocks split on their own (x, B, C; or Q, K, V), an SSM state's
heads. When the two sides' TP differ, each decode rank takes, per piece, the global units it
holds from the prefill ranks that hold them (``topology.assign`` says which rank writes which
units). A piece row's units are contiguous on both sides, so one piece row is one block.

``ranges`` is one global unit range ``[lo, hi)`` per piece (``lo == hi``: none of it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..pools import PoolSpec, piece_key
from .paged import Blocks, BufferPairing, plan_slots

_U64 = np.uint64

Ranges = tuple[tuple[int, int], ...]


def held(pool: PoolSpec) -> Ranges:
    """The global units each piece of ``pool`` holds."""
    return tuple((p.first, p.first + p.rank_units) for p in pool.sharding.pieces)


def same_pieces(src: PoolSpec, dst: PoolSpec) -> bool:
    """Whether a whole slot maps to a whole slot (equal slots, the same units held)."""
    return src.item_bytes == dst.item_bytes and src.sharding == dst.sharding


def shared(src: PoolSpec, dst: PoolSpec) -> Ranges:
    """Per piece, the units both sides hold (what a sender writes unless told otherwise)."""
    return tuple(
        (max(a, c), max(max(a, c), min(b, d))) for (a, b), (c, d) in zip(held(src), held(dst))
    )


def ranges_error(src: PoolSpec, dst: PoolSpec, ranges: Sequence[tuple[int, int]]) -> str | None:
    """Why ``ranges`` is not one unit range per piece held by both sides, or None."""
    if src.sharding.kind != "pieces" or piece_key(src) != piece_key(dst):
        return f"pool {src.name!r}: unit ranges need pieces that pair on both sides"
    if len(ranges) != len(src.sharding.pieces):
        return f"pool {src.name!r}: {len(ranges)} unit ranges for {len(src.sharding.pieces)} pieces"
    for k, ((lo, hi), (a, b), (c, d)) in enumerate(zip(ranges, held(src), held(dst))):
        if lo == hi:
            continue
        if not (max(a, c) <= lo < hi <= min(b, d)):
            return (
                f"pool {src.name!r}: piece {k} units [{lo}, {hi}) not within prefill "
                f"[{a}, {b}) and decode [{c}, {d})"
            )
    return None


def spans(pool: PoolSpec, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(offset in the slot, nbytes)`` of the bytes holding ``ranges`` in ``pool``, piece by
    piece and row by row: the same order on both sides, so the i-th span of the source goes
    to the i-th of the destination (and integrity digests read them in that order)."""
    off: list[int] = []
    size: list[int] = []
    for p, (lo, hi) in zip(pool.sharding.pieces, ranges):
        if hi <= lo:
            continue
        base = p.offset + (lo - p.first) * p.unit_bytes
        n = (hi - lo) * p.unit_bytes
        off += [base + r * p.row_stride for r in range(p.rows)]
        size += [n] * p.rows
    return np.array(off, dtype=np.int64), np.array(size, dtype=np.int64)


def _merge(
    s: np.ndarray, d: np.ndarray, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans contiguous on both sides become one (a piece whose rows are whole, or pieces
    that follow each other on both sides)."""
    if s.size < 2:
        return s, d, n
    cont = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    start = np.flatnonzero(np.concatenate(([True], ~cont)))
    sums = np.add.reduceat(n, start)
    return s[start], d[start], sums


def plan_pieces(
    pairing: BufferPairing,
    src_slot: int,
    dst_slot: int,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> Blocks | str:
    """Blocks moving units ``ranges`` (default: every unit both sides hold) of slot
    ``src_slot`` into slot ``dst_slot`` of every paired buffer; a whole slot when both
    sides hold the same pieces and every unit of them is asked."""
    src, dst = pairing.src, pairing.dst
    if ranges is None:
        if same_pieces(src, dst):
            return plan_slots(pairing, src_slot, dst_slot)
        ranges = shared(src, dst)
    why = ranges_error(src, dst, ranges)
    if why:
        return why
    if same_pieces(src, dst) and tuple(ranges) == held(src):
        return plan_slots(pairing, src_slot, dst_slot)
    if not 0 <= src_slot < src.num_items:
        return f"pool {src.name!r}: source slot {src_slot} out of range [0, {src.num_items})"
    if not 0 <= dst_slot < dst.num_items:
        return f"pool {src.name!r}: destination slot {dst_slot} out of range [0, {dst.num_items})"
    so, n = spans(src, ranges)
    do, _ = spans(dst, ranges)
    so, do, n = _merge(so, do, n)
    s0 = _U64(src_slot) * _U64(src.item_bytes)
    d0 = _U64(dst_slot) * _U64(dst.item_bytes)
    sa = (pairing.src_base[:, None] + s0 + so.astype(_U64)[None, :]).reshape(-1)
    da = (pairing.dst_base[:, None] + d0 + do.astype(_U64)[None, :]).reshape(-1)
    nb = np.broadcast_to(n.astype(_U64)[None, :], (len(pairing), n.size)).reshape(-1)
    return Blocks(sa, da, nb)


def written_ranges(
    src: PoolSpec, dst: PoolSpec, asked: Sequence[tuple[int, int]] | None
) -> Ranges | None:
    """The units a sender of ``src`` writes into ``dst`` (``asked``, else every unit both
    hold), or None when it copies the whole slot: what ``plan_pieces`` moves, and so what
    the integrity digests of the slot cover."""
    if src.sharding.kind != "pieces":
        return None
    if asked is None:
        return None if same_pieces(src, dst) else shared(src, dst)
    r = tuple((int(a), int(b)) for a, b in asked)
    return None if same_pieces(src, dst) and r == held(src) else r
