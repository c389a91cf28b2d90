"""Pure address math: from pool geometry and indices to ``(src_addr, dst_addr, nbytes)`` blocks.

Nothing here does I/O, so every rule is unit-tested with numbers. Functions return a plan or
an error string (the caller decides how to fail); they never raise on bad peer input.

Positional model: a request's tokens are numbered ``0..num_tokens``. A list of page indices
covers consecutive tokens starting at a page-aligned ``first`` token: page ``i`` of the list
holds tokens ``[first + i*page_size, first + (i+1)*page_size)``. The sender's chunk and the
receiver's destination list each have their own ``first`` (the receiver's is its
``prefix_len``), so a plan is made for the intersection ``[start, end)``.

Coalescing: a run of tokens (or pages) contiguous on both sides becomes one block per buffer,
because the transport's cost is per entry (docs/performance.md#what-this-means-on-an-rdma-cluster).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..pools import PageSegment, PoolSpec, segment_lanes

MAX_BATCH_ENTRIES = 1024
"""Mooncake's TCP transport rejects batches over ~2048 entries per peer and can wedge that
peer's lane for good; 1024 keeps a safe margin."""

_U64 = np.uint64


class Blocks:
    """A plan: parallel uint64 arrays of source address, destination address and length.

    A small plan may instead be built from Python lists (``from_lists``): the transport takes
    lists, so the arrays are then only made if some consumer asks for them. Treat as
    immutable."""

    __slots__ = ("_src", "_dst", "_nb", "_lists")

    def __init__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        self._src: np.ndarray | None = src
        self._dst: np.ndarray | None = dst
        self._nb: np.ndarray | None = nbytes
        self._lists: tuple[list[int], list[int], list[int]] | None = None

    @classmethod
    def from_lists(cls, src: list[int], dst: list[int], nbytes: list[int]) -> Blocks:
        b = cls.__new__(cls)
        b._src = b._dst = b._nb = None
        b._lists = (src, dst, nbytes)
        return b

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Make the arrays from the lists (all three at once) and return them."""
        assert self._lists is not None
        s, d, n = self._lists
        out = (np.array(s, dtype=_U64), np.array(d, dtype=_U64), np.array(n, dtype=_U64))
        self._src, self._dst, self._nb = out
        return out

    @property
    def src(self) -> np.ndarray:
        return self._src if self._src is not None else self._arrays()[0]

    @property
    def dst(self) -> np.ndarray:
        return self._dst if self._dst is not None else self._arrays()[1]

    @property
    def nbytes(self) -> np.ndarray:
        return self._nb if self._nb is not None else self._arrays()[2]

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python int lists (what the transport takes)."""
        if self._lists is None:
            self._lists = (self.src.tolist(), self.dst.tolist(), self.nbytes.tolist())
        return self._lists

    @staticmethod
    def empty() -> Blocks:
        z = np.zeros(0, dtype=_U64)
        return Blocks(z, z, z)

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Blocks.empty()
        if len(parts) == 1:
            return parts[0]
        return Blocks(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )

    def __len__(self) -> int:
        if self._lists is not None:
            return len(self._lists[0])
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        if self._lists is not None:
            return sum(self._lists[2])
        return int(self.nbytes.sum()) if len(self) else 0

    def batches(self, max_entries: int = MAX_BATCH_ENTRIES) -> Iterator[Blocks]:
        for i in range(0, len(self), max_entries):
            yield Blocks(
                self.src[i : i + max_entries],
                self.dst[i : i + max_entries],
                self.nbytes[i : i + max_entries],
            )


@dataclass(frozen=True, slots=True)
class BufferPairing:
    """Source and destination base addresses of the buffers that pair by (layer id, role).

    Computed once per (prefill endpoint, decode endpoint, pool) and cached by the endpoint;
    planning a chunk is then a few vectorised numpy operations.
    """

    src: PoolSpec
    dst: PoolSpec
    src_base: np.ndarray
    dst_base: np.ndarray
    src_list: tuple[int, ...] = ()
    """``src_base`` as Python ints, for the small-request path (``_expand_few``)."""
    dst_list: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.src_base.shape[0])


def pair_buffers(src: PoolSpec, dst: PoolSpec) -> BufferPairing | str:
    """Pair ``src`` buffers with ``dst`` buffers by (layer id, role).

    Every source buffer needs a destination; destination buffers without a source here are
    fine (another pipeline stage writes them).
    """
    by_key = {(b.layer_id, b.role): b for b in dst.buffers}
    sb: list[int] = []
    db: list[int] = []
    for b in src.buffers:
        d = by_key.get((b.layer_id, b.role))
        if d is None:
            return f"pool {src.name!r}: no destination buffer for layer {b.layer_id} {b.role}"
        sb.append(b.addr)
        db.append(d.addr)
    return BufferPairing(
        src, dst, np.array(sb, dtype=_U64), np.array(db, dtype=_U64), tuple(sb), tuple(db)
    )


def layer_subset(pairing: BufferPairing, lo: int, hi: int) -> BufferPairing | None:
    """The pairs of ``pairing`` whose source buffer holds a layer in ``[lo, hi)``: what a
    partial-layer chunk writes (its source pool narrowed to those buffers, so digests and
    staging walk the same subset); None when the pool holds none of those layers."""
    keep = [i for i, b in enumerate(pairing.src.buffers) if lo <= b.layer_id < hi]
    if not keep:
        return None
    if len(keep) == len(pairing.src.buffers):
        return pairing
    src = pairing.src.with_(buffers=tuple(pairing.src.buffers[i] for i in keep))
    sb, db = pairing.src_base[keep], pairing.dst_base[keep]
    return BufferPairing(src, pairing.dst, sb, db, tuple(sb.tolist()), tuple(db.tolist()))


def as_indices(x: object, what: str) -> np.ndarray | str:
    """Normalise indices to a 1-d int64 array, or say why they are not indices."""
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - any conversion failure is a caller error
        return f"{what}: not an index array ({e})"
    if a.ndim != 1:
        a = a.reshape(-1) if a.ndim == 0 else a
        if a.ndim != 1:
            return f"{what}: indices must be 1-d, got shape {a.shape}"
    if a.size and a.dtype.kind not in "iu":
        return f"{what}: indices must be integers, got {a.dtype}"
    return a.astype(np.int64, copy=False)


def runs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired index arrays wherever either side breaks +1 continuity.

    Returns the first index of each run on both sides and the run lengths.
    """
    if a.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    brk = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    ends = np.concatenate((brk, np.array([a.size], dtype=np.int64)))
    return a[starts], b[starts], ends - starts


def _range_error(lo: int, hi: int, limit: int, what: str) -> str | None:
    if lo < 0 or hi >= limit:
        return f"{what}: index out of range [0, {limit}) (min {lo}, max {hi})"
    return None


def check_pages(
    pairing: BufferPairing, src_pages: np.ndarray, dst_pages: np.ndarray | None
) -> str | None:
    """Why a source or destination page index is out of its pool's range, or None
    (``dst_pages`` None: the destination is staging, checked as a lease)."""
    src, dst = pairing.src, pairing.dst
    return _check_range(src_pages, src.num_items, f"pool {src.name!r} source page") or (
        None
        if dst_pages is None
        else _check_range(dst_pages, dst.num_items, f"pool {src.name!r} destination page")
    )


def token_rows(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Global token rows ``(page * page_size + offset)`` of tokens ``[start, end)`` on each
    side: the page-size remap, one row per token."""
    ps_s, ps_d = pairing.src.page_size, pairing.dst.page_size
    pos = np.arange(start, end, dtype=np.int64)
    ps_, pd_ = pos - src_first, pos - dst_first
    return (src_pages[ps_ // ps_s] * ps_s + ps_ % ps_s, dst_pages[pd_ // ps_d] * ps_d + pd_ % ps_d)


def _check_range(idx: np.ndarray, limit: int, what: str) -> str | None:
    return _range_error(int(idx.min()), int(idx.max()), limit, what) if idx.size else None


def _expand(
    pairing: BufferPairing, s0: np.ndarray, d0: np.ndarray, n: np.ndarray, unit: int
) -> Blocks:
    """Every run times every paired buffer, as flat arrays (buffer-major)."""
    u = _U64(unit)
    src = (pairing.src_base[:, None] + s0.astype(_U64)[None, :] * u).reshape(-1)
    dst = (pairing.dst_base[:, None] + d0.astype(_U64)[None, :] * u).reshape(-1)
    nb = np.broadcast_to(n.astype(_U64)[None, :] * u, (len(pairing), n.size)).reshape(-1)
    return Blocks(src, dst, nb)


FEW_PAGES = 32
"""Up to this many pages a plan is built from Python lists: a request's control path runs
with cold CPU caches (its own data just streamed through them), where each numpy call costs
tens of microseconds; a few list comprehensions cost less than the ~25 numpy calls of the
vectorised path. Larger plans use numpy, where per-element work dominates."""


def _runs_few(s: list[int], d: list[int]) -> list[tuple[int, int, int]]:
    """``runs`` on short Python lists: (source start, destination start, length)."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(s, d):
        if out:
            a0, b0, n = out[-1]
            if a == a0 + n and b == b0 + n:
                out[-1] = (a0, b0, n + 1)
                continue
        out.append((a, b, 1))
    return out


def _expand_few(pairing: BufferPairing, rr: list[tuple[int, int, int]], unit: int) -> Blocks:
    """``_expand`` for few runs, through Python lists (same buffer-major order)."""
    sl = pairing.src_list or tuple(pairing.src_base.tolist())
    dl = pairing.dst_list or tuple(pairing.dst_base.tolist())
    src = [b + a * unit for b in sl for a, _, _ in rr]
    dst = [b + d * unit for b in dl for _, d, _ in rr]
    nb = [r[2] * unit for r in rr] * len(sl)
    return Blocks.from_lists(src, dst, nb)


def _partial_page(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
) -> Blocks | str:
    """Tokens ``[start, end)`` inside one page: by lanes where the engine packs the page's
    interior (``PoolSpec.segments``), else ``_partial_plain``."""
    if pairing.src.segments:
        return plan_segments(pairing, src_pages, src_first, dst_pages, dst_first, start, end, True)
    return _partial_plain(pairing, src_pages, src_first, dst_pages, dst_first, start, end)


def _partial_plain(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
) -> Blocks | str:
    """Tokens ``[start, end)`` inside one page (equal page sizes, aligned page grids): what a
    chunk computed of a page that another chunk fills too. Token-major: one block per buffer;
    HND: one block per head and buffer (a head's tokens are contiguous inside the page)."""
    src, dst = pairing.src, pairing.dst
    ps = src.page_size
    sp, dp = int(src_pages[(start - src_first) // ps]), int(dst_pages[(start - dst_first) // ps])
    why = _range_error(sp, sp, src.num_items, f"pool {src.name!r} source page") or _range_error(
        dp, dp, dst.num_items, f"pool {src.name!r} destination page"
    )
    if why:
        return why
    off = (start - src_first) % ps
    if src.token_major and dst.token_major:
        tb = src.token_bytes
        rows, unit, width = np.zeros(1, dtype=np.int64), 0, (end - start) * tb
        s_at, d_at = sp * src.item_bytes + off * tb, dp * dst.item_bytes + off * tb
    else:
        hb = src.sharding.head_bytes
        rows, unit, width = (
            np.arange(src.sharding.rank_heads, dtype=np.int64),
            ps * hb,
            (end - start) * hb,
        )
        s_at, d_at = sp * src.item_bytes + off * hb, dp * dst.item_bytes + off * hb
    s = pairing.src_base[:, None] + _U64(s_at) + rows.astype(_U64)[None, :] * _U64(unit)
    d = pairing.dst_base[:, None] + _U64(d_at) + rows.astype(_U64)[None, :] * _U64(unit)
    nb = np.full(s.size, width, dtype=_U64)
    return Blocks(s.reshape(-1), d.reshape(-1), nb)


def plan_paged(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
    exact: bool = False,
) -> Blocks | str:
    """Blocks moving tokens ``[start, end)`` of a paged pool.

    With equal page sizes, whole pages are copied (the tail of a request's last page is its
    own page, so this writes nothing another request owns) and any layout works; a page the
    range covers only in part at its start, or at its end when ``exact`` (a later chunk
    fills the rest: ``end`` is not the request's end), is written for the range's tokens
    alone. Otherwise tokens are mapped one by one, which needs a token-major layout.
    """
    src, dst = pairing.src, pairing.dst
    if end <= start or src.item_bytes == 0:
        return Blocks.empty()
    ps_s, ps_d = src.page_size, dst.page_size
    if start < src_first or start < dst_first:
        return f"pool {src.name!r}: token {start} precedes the indices' first token"
    if end - src_first > src_pages.size * ps_s:
        return (
            f"pool {src.name!r}: source indices cover {src_pages.size * ps_s} tokens from "
            f"{src_first}, need up to token {end}"
        )
    if end - dst_first > dst_pages.size * ps_d:
        return (
            f"pool {src.name!r}: destination indices cover {dst_pages.size * ps_d} tokens "
            f"from {dst_first}, need up to token {end}"
        )
    if (
        ps_s == ps_d
        and (src_first - dst_first) % ps_s == 0
        and ((start - src_first) % ps_s or exact and (end - src_first) % ps_s)
    ):
        a = min(end, start + (src_first - start) % ps_s)  # the first page boundary
        b = max(a, end - (end - src_first) % ps_s if exact else end)
        parts = [
            _partial_page(pairing, src_pages, src_first, dst_pages, dst_first, start, a)
            if a > start
            else Blocks.empty(),
            plan_paged(pairing, src_pages, src_first, dst_pages, dst_first, a, b),
            _partial_page(pairing, src_pages, src_first, dst_pages, dst_first, b, end)
            if end > b
            else Blocks.empty(),
        ]
        bad = next((x for x in parts if isinstance(x, str)), None)
        if bad is not None:
            return bad
        return Blocks.concat([x for x in parts if isinstance(x, Blocks)])
    if ps_s == ps_d and (start - src_first) % ps_s == 0 and (start - dst_first) % ps_d == 0:
        i0, j0 = (start - src_first) // ps_s, (start - dst_first) // ps_d
        count = -(-(end - start) // ps_s)
        s = src_pages[i0 : i0 + count]
        d = dst_pages[j0 : j0 + count]
        if count <= FEW_PAGES:
            sl, dl = s.tolist(), d.tolist()
            why = sl and (
                _range_error(min(sl), max(sl), src.num_items, f"pool {src.name!r} source page")
                or _range_error(
                    min(dl), max(dl), dst.num_items, f"pool {src.name!r} destination page"
                )
            )
            return why or _expand_few(pairing, _runs_few(sl, dl), src.item_bytes)
        why = check_pages(pairing, s, d)
        if why:
            return why
        s0, d0, n = runs(s, d)
        return _expand(pairing, s0, d0, n, src.item_bytes)
    if src.page_segments is None or dst.page_segments is None:
        return (
            f"pool {src.name!r}: an opaque page interior moves only whole, between equal page sizes"
        )
    if not (src.token_major and dst.token_major):
        return plan_segments(pairing, src_pages, src_first, dst_pages, dst_first, start, end, exact)
    why = _check_used(pairing, src_pages, src_first, dst_pages, dst_first, start, end)
    if why:
        return why
    s, d = token_rows(pairing, src_pages, src_first, dst_pages, dst_first, start, end)
    s0, d0, n = runs(s, d)
    return _expand(pairing, s0, d0, n, src.token_bytes)


def _check_used(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
) -> str | None:
    """``check_pages`` on the pages holding tokens ``[start, end)`` only (a list may name
    pages no one reads, -1, outside them: a window's freed blocks)."""
    ps_s, ps_d = pairing.src.page_size, pairing.dst.page_size
    s = src_pages[(start - src_first) // ps_s : -(-(end - src_first) // ps_s)]
    d = dst_pages[(start - dst_first) // ps_d : -(-(end - dst_first) // ps_d)]
    return check_pages(pairing, s, d)


def _lanes(
    pool: PoolSpec, segs: tuple[PageSegment, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every lane (``pools.segment_lanes``) of every head of one page of ``pool``: where its
    units start inside the page, how many tokens a unit holds, its bytes; in page order."""
    ps, sh = pool.page_size, pool.sharding
    heads, per_head = (sh.rank_heads, ps * sh.head_bytes) if sh.kind == "heads" else (1, 0)
    one = segment_lanes(segs, ps)
    rows = [(h * per_head + at, tok, nb) for h in range(heads) for at, tok, nb in one]
    at, tok, nb = (np.array(x, dtype=np.int64) for x in zip(*rows))
    return at, tok, nb


def plan_segments(
    pairing: BufferPairing,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    start: int,
    end: int,
    exact: bool = False,
) -> Blocks | str:
    """Tokens ``[start, end)`` between pages of different sizes laid out by the same
    segments (``PoolSpec.page_segments``): the tokens split into runs that lie in one page
    on each side, and each run is one block per lane (a row of a segment of a head) and
    buffer. A unit packs several tokens: runs start on a unit; the last is rounded up to
    one (its page's own tail, on both sides), unless ``exact`` (a later chunk writes it)."""
    src, dst = pairing.src, pairing.dst
    segs = src.page_segments
    if segs is None or segs != dst.page_segments:
        return (
            f"pool {src.name!r}: page-size remapping needs token-major layouts or the same "
            "known page interior on both sides"
        )
    unit = int(np.lcm.reduce([g.tokens for g in segs]))
    if (
        (start - src_first) % unit
        or (start - dst_first) % unit
        or exact
        and (end - src_first) % unit
    ):
        return (
            f"pool {src.name!r}: tokens [{start}, {end}) do not start and end on a "
            f"{unit}-token unit of the page interior"
        )
    why = _check_used(pairing, src_pages, src_first, dst_pages, dst_first, start, end)
    if why:
        return why
    ps_s, ps_d = src.page_size, dst.page_size
    cuts = np.union1d(
        np.arange(start - (start - src_first) % ps_s + ps_s, end, ps_s, dtype=np.int64),
        np.arange(start - (start - dst_first) % ps_d + ps_d, end, ps_d, dtype=np.int64),
    )
    a = np.concatenate(([start], cuts)).astype(np.int64)
    b = np.concatenate((cuts, [end])).astype(np.int64)
    b[-1] = min(b[-1] + (-(b[-1] - src_first)) % unit, b[-1] - (b[-1] - src_first) % ps_s + ps_s)
    rs, rd = a - src_first, a - dst_first
    sp, so = src_pages[rs // ps_s].astype(np.int64), rs % ps_s
    dp, do = dst_pages[rd // ps_d].astype(np.int64), rd % ps_d
    at_s, tok, nb = _lanes(src, segs)
    at_d, _, _ = _lanes(dst, segs)
    # [lane, run] byte offsets inside a buffer, and lengths
    s_off = (
        (sp * src.item_bytes)[None, :] + at_s[:, None] + (so[None, :] // tok[:, None]) * nb[:, None]
    )
    d_off = (
        (dp * dst.item_bytes)[None, :] + at_d[:, None] + (do[None, :] // tok[:, None]) * nb[:, None]
    )
    length = -(-(b - a)[None, :] // tok[:, None]) * nb[:, None]
    so_, do_, ln = (x.reshape(-1).astype(_U64) for x in (s_off, d_off, length))
    src_a = (pairing.src_base[:, None] + so_[None, :]).reshape(-1)
    dst_a = (pairing.dst_base[:, None] + do_[None, :]).reshape(-1)
    nbytes = np.broadcast_to(ln[None, :], (len(pairing), ln.size)).reshape(-1)
    return Blocks(src_a, dst_a, np.ascontiguousarray(nbytes))


def plan_slots(pairing: BufferPairing, src_slot: int, dst_slot: int) -> Blocks | str:
    """Blocks copying one slot (aux row, state) of every paired buffer."""
    src, dst = pairing.src, pairing.dst
    if not 0 <= src_slot < src.num_items:
        return f"pool {src.name!r}: source slot {src_slot} out of range [0, {src.num_items})"
    if not 0 <= dst_slot < dst.num_items:
        return f"pool {src.name!r}: destination slot {dst_slot} out of range [0, {dst.num_items})"
    one = np.ones(1, dtype=np.int64)
    return _expand(pairing, one * src_slot, one * dst_slot, one, src.item_bytes)


@functools.lru_cache(maxsize=256)
def _region_table(regions: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted region starts and ends; cached because a peer's regions never change and the
    check runs for every chunk."""
    reg = sorted(regions)
    starts = np.array([r[0] for r in reg], dtype=_U64)
    ends = np.array([r[0] + r[1] for r in reg], dtype=_U64)
    starts.flags.writeable = False
    ends.flags.writeable = False
    return starts, ends


def check_bounds(blocks: Blocks, regions: list[tuple[int, int]], side: str) -> str | None:
    """Whether every block lies inside one of ``regions`` (``(addr, nbytes)``).

    The last line of defence: a plan that would write outside a registered buffer is an
    error, never a write.
    """
    if not len(blocks):
        return None
    addrs = blocks.src if side == "src" else blocks.dst
    starts, ends = _region_table(tuple(regions))
    k = np.searchsorted(starts, addrs, side="right") - 1
    bad = k < 0
    kk = np.where(bad, 0, k)
    bad |= addrs + blocks.nbytes > ends[kk]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return (
            f"{side} block {i} at {int(addrs[i]):#x}+{int(blocks.nbytes[i])} lies outside "
            f"every registered buffer"
        )
    return None
