"""One chunk's plan for one decode peer, and the checks on what a decode asked for.

Pure: the sender decodes a ``TransferRequest`` into an ``Ask`` (indices unpacked) and calls
these functions; nothing here touches a socket, a lock or the transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..pools import PoolSpec
from .heads import STAGING_POOL, head_range_error, lease_error, plan_head_slice, plan_staged
from .pack import PACK_POOL, Pack, pack_error, plan_pack
from .paged import Blocks, BufferPairing, check_bounds, plan_paged, plan_slots
from .pieces import plan_pieces, ranges_error


@dataclass(frozen=True, slots=True)
class Ask:
    """What one decode endpoint asked for a room, with its page indices decoded."""

    room: int
    prefix_len: int
    num_tokens: int
    dst: Mapping[str, np.ndarray]
    slots: Mapping[str, int]
    skip: tuple[str, ...] = ()
    heads: Mapping[str, tuple[int, int]] | None = None
    stage: Mapping[str, int] | None = None
    pack: Mapping[str, int] | None = None
    pieces: Mapping[str, tuple[tuple[int, int], ...]] | None = None


def ask_of(req: Any, dst: Mapping[str, np.ndarray]) -> Ask:
    """An ``Ask`` from a decoded ``wire.TransferRequest`` and its unpacked indices."""
    return Ask(
        req.room,
        req.prefix_len,
        req.num_tokens,
        dst,
        req.slots,
        tuple(req.skip),
        req.heads,
        req.stage,
        req.pack,
        req.pieces,
    )


def check_ask(
    ask: Ask,
    peer_pools: Mapping[str, PoolSpec],
    pairings: Mapping[str, BufferPairing],
    mine: frozenset[str],
) -> str:
    """Why an ask cannot be served ("" when it can): unknown pools, indices out of range,
    too few pages, bad head ranges, staging leases outside the peer's staging, bad slots."""
    span = ask.num_tokens - ask.prefix_len
    for name, idx in ask.dst.items():
        q = peer_pools.get(name)
        if q is None or name not in mine:
            return f"room {ask.room}: pool {name!r} unknown"
        if q.kind != "paged" or q.indices_from is not None:
            return f"room {ask.room}: pool {name!r} takes no destination indices"
        if idx.size and int(idx.max()) >= q.num_items:
            return (
                f"room {ask.room}: destination index {int(idx.max())} out of range "
                f"[0, {q.num_items}) for pool {name!r}"
            )
        if idx.size * q.page_size < span:
            return (
                f"room {ask.room}: pool {name!r} has {idx.size} destination pages for {span} tokens"
            )
    for name in ask.skip:
        if name not in peer_pools or name not in mine:
            return f"room {ask.room}: skip names unknown pool {name!r}"
    stage = ask.stage or {}
    for name, (lo, hi) in (ask.heads or {}).items():
        pr = pairings.get(name)
        why = f"pool {name!r} unknown" if pr is None else head_range_error(pr, lo, hi)
        if not why and pr is not None and name in stage:
            why = lease_error(pr.dst, peer_pools.get(STAGING_POOL), stage[name], span, lo, hi)
        if why:
            return f"room {ask.room}: {why}"
    for name, addr in (ask.pack or {}).items():
        pr = pairings.get(name)
        why = (
            f"pool {name!r} unknown"
            if pr is None or name in ask.skip
            else pack_error(
                pr.dst, pr.src, (ask.heads or {}).get(name), peer_pools.get(PACK_POOL), addr, span
            )
        )
        if why:
            return f"room {ask.room}: {why}"
    for name, slot in ask.slots.items():
        q = peer_pools.get(name)
        if q is None or q.kind != "slot" or name not in mine:
            return f"room {ask.room}: slot pool {name!r} unknown"
        if slot >= q.num_items:
            return (
                f"room {ask.room}: destination slot {slot} out of range "
                f"[0, {q.num_items}) for pool {name!r}"
            )
    for name, ranges in (ask.pieces or {}).items():
        pr = pairings.get(name)
        why = (
            f"pool {name!r} unknown"
            if pr is None or name not in ask.slots
            else ranges_error(pr.src, pr.dst, ranges)
        )
        if why:
            return f"room {ask.room}: {why}"
    return ""


def pool_layers(pools: Mapping[str, PoolSpec]) -> dict[str, tuple[int, ...]]:
    """The layer ids each anchor pool's pages carry (its own buffers' and its followers'); a
    logical anchor (no bytes) carries none."""
    out: dict[str, set[int]] = {}
    for name, p in pools.items():
        if p.kind != "paged":
            continue
        ids = out.setdefault(p.indices_from or name, set())
        ids |= {b.layer_id for b in p.buffers}
    return {n: tuple(sorted(ids)) for n, ids in out.items()}


Cursor = int | dict[int, int]
"""Tokens an anchor pool was given: one count for all of its layers (whole-layer chunks, the
common case, cost no per-layer work), or one per layer id once chunks split its layers."""


def low(c: Cursor) -> int:
    """Tokens every layer of the pool holds."""
    return c if isinstance(c, int) else min(c.values(), default=0)


@dataclass(frozen=True, slots=True)
class Claim:
    """What one ``send()`` carries, checked against what the room was given so far: per
    anchor pool the token the first page starts at (``first``) and the tokens computed
    (``span``), the layer range (None: all), and each pool's new cursor."""

    first: dict[str, int]
    span: dict[str, tuple[int, int]]
    layers: tuple[int, int] | None
    cursors: dict[str, Cursor]


def claim(
    room: int,
    pages: Mapping[str, np.ndarray],
    page_sizes: Mapping[str, int],
    layers_of: Mapping[str, tuple[int, ...]],
    cursors: Mapping[str, Cursor],
    layers: tuple[int, int] | None,
    tokens: tuple[int, int] | None,
) -> Claim | str:
    """Check one chunk against the room's per-layer token cursors, or say why it is refused.

    Each layer of each anchor pool is given in token order, with no gap and no overlap: a
    chunk for layers ``[a, b)`` and tokens ``[t0, t1)`` must start where every one of those
    layers stopped (so a layer sent twice, or out of order, is refused before it is
    written), and its pages are the ones holding tokens ``t0 .. t1 - 1``. Without ``tokens``
    a chunk carries every token of its pages, from where its layers stopped (the pages start
    at that token's page). Layers outside the room's pools, an empty range, or pools that
    hold none of the chunk's layers are refused."""
    if layers is not None:
        a, b = layers
        top = max((x + 1 for ids in layers_of.values() for x in ids), default=0)
        if not 0 <= a < b <= top:
            return f"room {room}: layers [{a}, {b}) not within this endpoint's [0, {top})"
    if tokens is not None and not 0 <= tokens[0] <= tokens[1] < 1 << 62:
        return f"room {room}: tokens [{tokens[0]}, {tokens[1]}) empty or out of range"
    first: dict[str, int] = {}
    span: dict[str, tuple[int, int]] = {}
    out: dict[str, Cursor] = {}
    for name, idx in pages.items():
        ids = layers_of.get(name)
        if ids is None:
            return f"room {room}: pool {name!r} is not an anchor pool"
        cur = cursors.get(name, 0)
        whole = layers is None or not ids or layers[0] <= ids[0] and ids[-1] < layers[1]
        mine = ids if whole else [x for x in ids if layers[0] <= x < layers[1]]  # type: ignore[index]
        if not mine and ids:
            return f"room {room}: pool {name!r} holds none of layers [{layers[0]}, {layers[1]})"  # type: ignore[index]
        at = {cur} if isinstance(cur, int) else {cur.get(x, 0) for x in mine}
        ps = page_sizes[name]
        if tokens is None:
            if len(at) > 1:
                return (
                    f"room {room}: pool {name!r}: the chunk's layers stopped at different "
                    f"tokens {sorted(at)}: name the tokens it carries"
                )
            t0 = at.pop()
            f0 = t0 - t0 % ps
            t1 = max(t0, f0 + idx.size * ps)
        else:
            t0, t1 = tokens
            f0 = t0 - t0 % ps
            wrong = sorted(x for x in at if x != t0)
            if wrong and ids:
                how = "overlaps tokens already given" if wrong[-1] > t0 else "leaves a gap"
                return (
                    f"room {room}: pool {name!r}: tokens [{t0}, {t1}) {how} (its layers "
                    f"stopped at {wrong})"
                )
            need = -(-t1 // ps) - t0 // ps
            if idx.size != need:
                return (
                    f"room {room}: pool {name!r}: {idx.size} pages for tokens [{t0}, "
                    f"{t1}), which span {need}"
                )
        first[name], span[name] = f0, (t0, t1)
        if whole:
            out[name] = t1 if ids else max(t1, low(cur))
            continue
        per = dict(cur) if isinstance(cur, dict) else dict.fromkeys(ids, cur)
        per.update(dict.fromkeys(mine, t1))
        out[name] = t1 if len(set(per.values())) == 1 else per
    return Claim(first, span, layers, out)


def heads_to_write(pairing: BufferPairing, asked: tuple[int, int] | None) -> tuple[int, int] | None:
    """The head range to write, or None when whole tokens (pages) pair one to one: the decode's
    choice, else the heads both sides hold."""
    a, b = pairing.src.sharding, pairing.dst.sharding
    if a.kind != "heads":
        return None
    same = (a.first_head, a.rank_heads) == (b.first_head, b.rank_heads)
    if asked is not None:
        lo, hi = int(asked[0]), int(asked[1])
        if same and (lo, hi) == (a.first_head, a.first_head + a.rank_heads):
            return None  # every head of one same shard: whole pages, a proven plan
        return (lo, hi)
    if same:
        return None
    return (
        max(a.first_head, b.first_head),
        min(a.first_head + a.rank_heads, b.first_head + b.rank_heads),
    )


def sliced(
    pairings: Mapping[str, BufferPairing],
    heads: Mapping[str, tuple[int, int]],
    stage: Mapping[str, int],
) -> bool:
    """Whether a peer gets head slices (heterogeneous TP): only then are sources gathered
    through staging; 1:1 pages keep the direct path."""
    if stage:
        return True
    for name, pr in pairings.items():
        h = heads_to_write(pr, heads.get(name))
        sh = pr.src.sharding
        if h is not None and h != (sh.first_head, sh.first_head + sh.rank_heads):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Written:
    """What one chunk writes into one pool of a decode peer: tokens ``[start, end)`` of the
    source pages (covering tokens from ``first``) and global heads ``[lo, hi)`` (``lo == hi``
    for a pool without heads). The integrity digests are taken over exactly this."""

    pool: str
    pages: np.ndarray
    first: int
    start: int
    end: int
    lo: int
    hi: int


def _tokens(
    ask: Ask,
    anchor: str,
    src: np.ndarray,
    f0: int,
    page_sizes: Mapping[str, int],
    span: Mapping[str, tuple[int, int]] | None,
) -> tuple[int, int]:
    """The request's tokens one chunk carries for one anchor pool: its ``span`` (tokens the
    engine computed, possibly part of a page at either end), else every token of its pages,
    within ``[prefix_len, num_tokens)``."""
    a, b = span[anchor] if span and anchor in span else (f0, f0 + src.size * page_sizes[anchor])
    return max(a, ask.prefix_len), min(b, ask.num_tokens)


def written(
    ask: Ask,
    pairings: Mapping[str, BufferPairing],
    pages: Mapping[str, np.ndarray],
    first: Mapping[str, int],
    page_sizes: Mapping[str, int],
    span: Mapping[str, tuple[int, int]] | None = None,
) -> list[Written]:
    """The ranges ``plan_chunk`` moves for this chunk, pool by pool (paged pools only)."""
    out: list[Written] = []
    heads_asked = ask.heads or {}
    for name, pairing in pairings.items():
        pool = pairing.src
        if pool.kind != "paged" or name in ask.skip or pool.item_bytes == 0:
            continue
        anchor = pool.indices_from or name
        src = pages.get(anchor)
        if src is None or anchor not in ask.dst:
            continue
        f0 = first[anchor]
        lo, hi = _tokens(ask, anchor, src, f0, page_sizes, span)
        if hi <= lo:
            continue
        sh = pool.sharding
        if sh.kind != "heads":
            out.append(Written(name, src, f0, lo, hi, 0, 0))
            continue
        h = heads_to_write(pairing, heads_asked.get(name)) or (
            sh.first_head,
            sh.first_head + sh.rank_heads,
        )
        if h[0] < h[1]:
            out.append(Written(name, src, f0, lo, hi, h[0], h[1]))
    return out


def plan_chunk(
    ask: Ask,
    pairings: Mapping[str, BufferPairing],
    pages: Mapping[str, np.ndarray],
    first: Mapping[str, int],
    slots: Mapping[str, int],
    last: bool,
    cursor: Mapping[str, int],
    page_sizes: Mapping[str, int],
    src_regions: list[tuple[int, int]],
    dst_regions: list[tuple[int, int]],
    span: Mapping[str, tuple[int, int]] | None = None,
    packs: list[Pack] | None = None,
) -> Blocks | str:
    """The blocks that move one chunk (``pages`` per anchor pool covering tokens from
    ``first``; ``span``: the tokens it carries, when not all of its pages' tokens) to one
    decode peer, or why it cannot be planned. ``cursor``: tokens given so far per anchor, in
    every layer (the last chunk must cover ``num_tokens``). A partial-layer chunk is planned
    on ``pairings`` narrowed to its layers (``paged.layer_subset``). Pools the decode packs
    (``ask.pack``) go to ``packs`` for the caller to gather, else into the blocks as written
    straight from the pages (``Pack.blocks``)."""
    parts: list[Blocks] = []
    proven = True  # only whole pages and slots so far: in bounds by construction
    heads_asked = ask.heads or {}
    stage = ask.stage or {}
    packed = ask.pack or {}
    for name, pairing in pairings.items():
        pool = pairing.src
        if pool.kind != "paged" or name in ask.skip:
            continue
        anchor = pool.indices_from or name
        dst = ask.dst.get(anchor)
        if dst is None:
            continue
        if last and cursor.get(anchor, 0) < ask.num_tokens:
            return (
                f"room {ask.room}: prefill gave pool {anchor!r} pages for "
                f"{cursor.get(anchor, 0)} tokens, decode expects {ask.num_tokens}"
            )
        src = pages.get(anchor)
        if src is None:
            continue
        f0 = first[anchor]
        lo, hi = _tokens(ask, anchor, src, f0, page_sizes, span)
        if hi <= lo:
            continue
        exact = hi < ask.num_tokens  # a later chunk writes the rest of a partial last page
        if name in packed:
            pk = plan_pack(
                pairing,
                packed[name],
                ask.num_tokens - ask.prefix_len,
                src,
                f0,
                ask.prefix_len,
                lo,
                hi,
            )
            if isinstance(pk, str):
                return f"room {ask.room}: {pk}"
            if packs is not None:  # checked by construction: rows in range, lease checked
                packs.append(pk)
            else:
                proven = False
                parts.append(pk.blocks())
            continue
        heads = heads_to_write(pairing, heads_asked.get(name))
        if heads is None:
            b = plan_paged(pairing, src, f0, dst, ask.prefix_len, lo, hi, exact)
        elif heads[0] >= heads[1]:
            continue
        elif name in stage:
            proven = False
            b = plan_staged(
                pairing,
                stage[name],
                ask.num_tokens - ask.prefix_len,
                src,
                f0,
                ask.prefix_len,
                lo,
                hi,
                *heads,
                exact=exact,
            )
        else:
            proven = False
            b = plan_head_slice(pairing, src, f0, dst, ask.prefix_len, lo, hi, *heads, exact=exact)
        if isinstance(b, str):
            return f"room {ask.room}: {b}"
        parts.append(b)
    if last:
        for name, dslot in ask.slots.items():
            spr = pairings.get(name)
            if spr is None or name in ask.skip:
                continue
            sslot = slots.get(name)
            if sslot is None:
                return f"room {ask.room}: last send() gave no slot for pool {name!r}"
            if spr.src.sharding.kind == "pieces":
                b = plan_pieces(spr, int(sslot), dslot, (ask.pieces or {}).get(name))
            else:
                b = plan_slots(spr, int(sslot), dslot)
            if isinstance(b, str):
                return f"room {ask.room}: {b}"
            parts.append(b)
    blocks = Blocks.concat(parts)
    if proven:
        # Whole pages and slots of paired buffers: ``plan_paged``/``plan_slots`` checked every
        # index against ``num_items``, and a PoolSpec (ours, or the peer's decoded from its
        # Hello) never declares a buffer smaller than ``num_items * item_bytes``, so every
        # block lies inside a buffer that is a registered region on its side. Checking again
        # per block would cost as much as the plan on the hot path.
        return blocks
    return (
        check_bounds(blocks, src_regions, "src")
        or check_bounds(blocks, dst_regions, "dst")
        or blocks
    )
