"""Pool geometry: what the other side needs to address a pool, and nothing engine-specific.

A pool is a named set of equally shaped buffers (one per layer and role) registered with the
transport. ``PoolSpec`` travels in the ``Hello`` handshake, so it is a msgspec Struct whose
``__post_init__`` validates it both when an engine builds it and when a peer's copy is decoded:
a peer cannot make us plan against an inconsistent geometry.

Pools are addresses plus a location string, so the same code runs with ``cuda:N`` tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from .errors import ConfigError

U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
"""Addresses and nonces: user-space and device (UVA) addresses fit in 63 bits."""
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
Positive = Annotated[int, msgspec.Meta(gt=0, le=1 << 62)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]
Role = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]

MAX_BUFFERS = 8192
"""More buffers than any real model has (layers x roles); bounds what a peer may send."""


MAX_PIECES = 64
"""More TP-sharded parts than any state slot has (a few per state tensor)."""
MAX_PIECE_ROWS = 4096
"""Rows of one piece (a conv state's kernel width when channels are innermost)."""


class Piece(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP-sharded part of a slot: a sub-tensor of a Mamba / linear-attention state whose
    leading axis is split by heads or channel groups (a conv state's x, B and C, or Q, K and
    V, each split on its own; an SSM state's heads).

    ``rows`` rows, ``row_stride`` bytes apart from byte ``offset`` of the slot; each row holds
    ``rank_units`` units of ``unit_bytes`` (global units ``[first, first + rank_units)`` of
    ``total``; fewer units than TP ranks: each replicated on consecutive ranks, as heads are).
    """

    offset: NonNeg
    total: Positive
    rank_units: Positive
    first: NonNeg
    unit_bytes: Positive
    rows: Annotated[int, msgspec.Meta(ge=1, le=MAX_PIECE_ROWS)] = 1
    row_stride: NonNeg = 0

    def __post_init__(self) -> None:
        if not (
            self.first >= 0
            and self.rank_units > 0
            and self.first + self.rank_units <= self.total <= 1 << 40
            and 0 < self.unit_bytes <= 1 << 40
            and 1 <= self.rows <= MAX_PIECE_ROWS
            and 0 <= self.offset <= 1 << 62
        ):
            raise ValueError(
                f"piece: units [{self.first}, {self.first + self.rank_units}) of "
                f"{self.total}, {self.rows} rows: out of bounds"
            )
        if self.rows > 1 and self.row_stride < self.rank_units * self.unit_bytes:
            raise ValueError(
                f"piece: rows {self.row_stride} bytes apart overlap their "
                f"{self.rank_units * self.unit_bytes} bytes"
            )

    @property
    def width(self) -> int:
        """Bytes of one row on this rank."""
        return self.rank_units * self.unit_bytes

    @property
    def end(self) -> int:
        """One past the last byte of the slot it covers."""
        return self.offset + (self.rows - 1) * self.row_stride + self.width


class Sharding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a pool is split over tensor-parallel ranks.

    ``replicated``: every rank holds the same bytes (MLA latent, aux rows).
    ``heads``: each rank holds ``rank_heads`` heads starting at global head ``first_head`` of
    ``total_heads``; ``head_bytes`` is one head of one token. ``layout`` is ``NHD`` (token-major
    inside a page) or ``HND`` (head-major inside a page).
    ``pieces`` (slot pools): each slot is ``pieces``, each split over TP on its own
    (``Piece``); bytes of the slot outside every piece (padding) are not this rank's state.
    """

    kind: Literal["replicated", "heads", "pieces"] = "replicated"
    total_heads: Positive = 1
    rank_heads: Positive = 1
    first_head: NonNeg = 0
    head_bytes: NonNeg = 0
    layout: Literal["NHD", "HND"] = "NHD"
    pieces: Annotated[tuple[Piece, ...], msgspec.Meta(max_length=MAX_PIECES)] = ()

    def __post_init__(self) -> None:
        if (self.kind == "pieces") != bool(self.pieces):
            raise ValueError("pieces sharding needs its pieces, and only it has any")
        if len(self.pieces) > MAX_PIECES:
            raise ValueError(f"{len(self.pieces)} pieces > {MAX_PIECES}")
        if self.kind == "heads":
            if self.head_bytes <= 0:
                raise ValueError("heads sharding needs head_bytes > 0")
            if self.first_head + self.rank_heads > self.total_heads:
                raise ValueError(
                    f"heads [{self.first_head}, {self.first_head + self.rank_heads}) exceed "
                    f"total_heads {self.total_heads}"
                )

    @staticmethod
    def sliced(pieces: Sequence[Piece]) -> Sharding:
        """A slot whose state is split over TP piece by piece (``Piece``)."""
        return _build(Sharding, kind="pieces", pieces=tuple(pieces))

    @staticmethod
    def heads(
        total_heads: int, rank_heads: int, first_head: int, head_bytes: int, layout: str = "NHD"
    ) -> Sharding:
        return _build(
            Sharding,
            kind="heads",
            total_heads=total_heads,
            rank_heads=rank_heads,
            first_head=first_head,
            head_bytes=head_bytes,
            layout=layout,
        )


class BufferSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered buffer: a layer's K, V or latent, or one row array of a slot pool."""

    addr: U64
    nbytes: Positive
    layer_id: NonNeg
    role: Role

    def __post_init__(self) -> None:
        # msgspec checks the Meta bounds when a spec is decoded, not when code builds one:
        # an engine's own spec is held to the same bounds before anything is planned on it
        if not (
            0 <= self.addr < 1 << 63
            and 0 < self.nbytes <= 1 << 62
            and 0 <= self.layer_id <= 1 << 62
            and 0 < len(self.role) <= 32
        ):
            raise ValueError(
                f"buffer layer {self.layer_id} {self.role!r}: address "
                f"{self.addr:#x} / {self.nbytes} bytes out of bounds"
            )


class PageSegment(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One part of a page's interior, in a form that holds for any page size ``N``: ``rows``
    rows one after the other, each ``N / tokens`` units of ``nbytes`` bytes, a unit holding
    ``tokens`` consecutive tokens of that row (packed as the engine packs them; pdxfer never
    reads inside a unit). A page is its segments one after the other.

    Plain token-major pages are one segment ``(1, 1, token_bytes)``; head-major (HND) pages
    ``(1, 1, head_bytes)`` per head. vLLM's CPU tiles put a head's keys dimension-major
    (``(head_dim, 1, elt)``) and its values token-major, or pack 16 or 2 tokens per unit:
    still segments, so pages of different sizes map unit by unit."""

    rows: Positive
    tokens: Positive
    nbytes: Positive

    def width(self) -> int:
        """Bytes this segment holds per token (over all its rows)."""
        return self.rows * self.nbytes // self.tokens


class PoolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a peer needs to address one pool.

    ``item_bytes`` is one page (paged) or one slot (slot) of ONE buffer; ``num_items`` how many
    pages or slots each buffer holds. ``page_remap`` marks a pool that accepts a peer with a
    different page size (a token-granular host landing pool): the planner then maps tokens,
    which needs a token-major layout on both sides, or the same known page interior
    (``segments``).

    ``segments``: how one page is laid out by token (``PageSegment``), for a head of a
    head-sharded pool (each head's part of a page is contiguous) or else the whole page.
    None: as the sharding says (token-major, or ``HND``: one segment of ``head_bytes`` per
    token). ``()``: opaque, pages move whole and only between equal page sizes.
    """

    name: Name
    kind: Literal["paged", "slot"]
    buffers: tuple[BufferSpec, ...]
    item_bytes: NonNeg
    num_items: NonNeg
    page_size: Positive = 1
    location: Annotated[str, msgspec.Meta(max_length=64)] = "cpu"
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = "uint8"
    sharding: Sharding = Sharding()
    indices_from: Name | None = None
    optional: bool = False
    page_remap: bool = False
    segments: tuple[PageSegment, ...] | None = None

    def __post_init__(self) -> None:
        if not (
            0 <= self.item_bytes <= 1 << 62
            and 0 <= self.num_items <= 1 << 62
            and 0 < self.page_size <= 1 << 62
        ):
            raise ValueError(
                f"pool {self.name!r}: item_bytes {self.item_bytes}, num_items "
                f"{self.num_items} or page_size {self.page_size} out of bounds"
            )
        if len(self.buffers) > MAX_BUFFERS:
            raise ValueError(f"pool {self.name!r}: {len(self.buffers)} buffers > {MAX_BUFFERS}")
        if self.kind == "slot" and self.page_size != 1:
            raise ValueError(f"slot pool {self.name!r} must have page_size 1")
        if self.item_bytes == 0:
            if self.buffers:
                raise ValueError(f"pool {self.name!r}: item_bytes 0 (logical) but has buffers")
            return
        if self.item_bytes % self.page_size:
            raise ValueError(
                f"pool {self.name!r}: item_bytes {self.item_bytes} is not a multiple of "
                f"page_size {self.page_size}"
            )
        need = self.num_items * self.item_bytes
        seen: set[tuple[int, str]] = set()
        for b in self.buffers:
            if b.nbytes < need:
                raise ValueError(
                    f"pool {self.name!r}: buffer layer {b.layer_id} {b.role} has {b.nbytes} "
                    f"bytes < num_items*item_bytes = {need}"
                )
            key = (b.layer_id, b.role)
            if key in seen:
                raise ValueError(f"pool {self.name!r}: duplicate buffer {key}")
            seen.add(key)
        sh = self.sharding
        if sh.kind == "pieces":
            why = _pieces_error(self.kind, sh.pieces, self.item_bytes)
            if why:
                raise ValueError(f"pool {self.name!r}: {why}")
        if sh.kind == "heads":
            token_bytes = self.item_bytes // self.page_size
            if sh.rank_heads * sh.head_bytes != token_bytes:
                raise ValueError(
                    f"pool {self.name!r}: rank_heads*head_bytes = {sh.rank_heads * sh.head_bytes}"
                    f" but one token is {token_bytes} bytes"
                )
        if self.segments:
            if self.kind != "paged" or sh.kind == "heads" and sh.layout != "HND":
                raise ValueError(
                    f"pool {self.name!r}: segments describe paged HND or unsharded pools"
                )
            per = sh.head_bytes if sh.kind == "heads" else self.token_bytes
            for g in self.segments:
                if self.page_size % g.tokens or (g.rows * g.nbytes) % g.tokens:
                    raise ValueError(
                        f"pool {self.name!r}: segment {(g.rows, g.tokens, g.nbytes)} does not "
                        f"tile a page of {self.page_size} tokens"
                    )
            if sum(g.width() for g in self.segments) != per:
                raise ValueError(
                    f"pool {self.name!r}: segments hold {sum(g.width() for g in self.segments)} "
                    f"bytes a token, the {'head' if sh.kind == 'heads' else 'page'} {per}"
                )

    # -- derived ---------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        return self.item_bytes // self.page_size

    @property
    def token_major(self) -> bool:
        """Whether one token's bytes are contiguous inside a page (needed to remap pages)."""
        if self.kind == "slot" or self.page_size == 1:
            return True
        if self.segments:
            return self.segments == (PageSegment(1, 1, self.token_bytes),)
        return self.sharding.layout == "NHD"

    @property
    def page_segments(self) -> tuple[PageSegment, ...] | None:
        """How a page is laid out by token (``segments``, for one head of an HND pool), or
        None where its interior is opaque."""
        if self.segments is not None:
            return self.segments or None
        sh = self.sharding
        if sh.kind == "heads" and sh.layout == "HND":
            return (PageSegment(1, 1, sh.head_bytes),)
        return (PageSegment(1, 1, self.token_bytes),)

    def with_(self, **changes: Any) -> PoolSpec:
        return msgspec.structs.replace(self, **changes)

    # -- constructors from tensors -----------------------------------------------------------
    @staticmethod
    def mha(
        name: str,
        k: Sequence[Any],
        v: Sequence[Any],
        *,
        page_size: int,
        layout: str = "NHD",
        total_heads: int | None = None,
        first_head: int = 0,
        layer_ids: Sequence[int] | None = None,
        indices_from: str | None = None,
        optional: bool = False,
        page_remap: bool = False,
    ) -> PoolSpec:
        """K and V per layer, each ``[num_pages, page_size, heads, head_dim]`` (NHD) or
        ``[num_pages, heads, page_size, head_dim]`` (HND)."""
        if len(k) != len(v) or not k:
            raise ConfigError(f"pool {name!r}: need the same non-zero number of K and V layers")
        t0 = k[0]
        if t0.dim() != 4:
            raise ConfigError(f"pool {name!r}: MHA buffers must be 4-d, got {tuple(t0.shape)}")
        heads = t0.shape[2] if layout == "NHD" else t0.shape[1]
        ps_dim = t0.shape[1] if layout == "NHD" else t0.shape[2]
        if ps_dim != page_size:
            raise ConfigError(f"pool {name!r}: page dimension {ps_dim} != page_size {page_size}")
        head_bytes = t0.shape[3] * t0.element_size()
        ids = list(layer_ids) if layer_ids is not None else list(range(len(k)))
        bufs = _buffers(name, list(k), ids, "k") + _buffers(name, list(v), ids, "v")
        return _pool(
            name,
            "paged",
            bufs,
            list(k) + list(v),
            page_size,
            Sharding.heads(total_heads or heads, heads, first_head, head_bytes, layout),
            indices_from,
            optional,
            page_remap,
        )

    @staticmethod
    def paged(
        name: str,
        buffers: Sequence[Any],
        *,
        page_size: int,
        layer_ids: Sequence[int] | None = None,
        role: str = "latent",
        indices_from: str | None = None,
        optional: bool = False,
        page_remap: bool = False,
    ) -> PoolSpec:
        """A replicated paged pool: one ``[num_pages, page_size, ...]`` tensor per layer (MLA
        latent, a compressed sidecar, a sliding-window pool)."""
        ts = list(buffers)
        if not ts:
            raise ConfigError(f"pool {name!r}: no buffers")
        if ts[0].dim() < 2 or ts[0].shape[1] != page_size:
            raise ConfigError(
                f"pool {name!r}: buffers must be [num_pages, page_size={page_size}, ...], "
                f"got {tuple(ts[0].shape)}"
            )
        ids = list(layer_ids) if layer_ids is not None else list(range(len(ts)))
        return _pool(
            name,
            "paged",
            _buffers(name, ts, ids, role),
            ts,
            page_size,
            Sharding(),
            indices_from,
            optional,
            page_remap,
        )

    mla = paged

    @staticmethod
    def slots(
        name: str,
        rows: Sequence[Any],
        *,
        layer_ids: Sequence[int] | None = None,
        optional: bool = False,
    ) -> PoolSpec:
        """A per-request pool (aux rows, Mamba-like state): tensors ``[num_slots, ...]``."""
        ts = list(rows)
        if not ts:
            raise ConfigError(f"pool {name!r}: no buffers")
        ids = list(layer_ids) if layer_ids is not None else list(range(len(ts)))
        # with explicit layer ids the layer names the row, so PP stages pair by layer alone
        bufs = [
            BufferSpec(
                int(t.data_ptr()),
                int(t.numel() * t.element_size()),
                i,
                "row" if layer_ids is not None else f"row{j}",
            )
            for j, (t, i) in enumerate(zip(ts, ids))
        ]
        _check_tensors(name, ts)
        return _build(
            PoolSpec,
            name=name,
            kind="slot",
            buffers=tuple(bufs),
            item_bytes=int(ts[0][0].numel() * ts[0].element_size()),
            num_items=int(ts[0].shape[0]),
            location=str(ts[0].device),
            dtype=str(ts[0].dtype).removeprefix("torch."),
            optional=optional,
        )

    @staticmethod
    def logical(name: str, *, num_pages: int, page_size: int) -> PoolSpec:
        """An anchor pool that only owns page indices (no bytes); data pools follow it."""
        return _build(
            PoolSpec,
            name=name,
            kind="paged",
            buffers=(),
            item_bytes=0,
            num_items=num_pages,
            page_size=page_size,
        )


def _pieces_error(kind: str, pieces: Sequence[Piece], item_bytes: int) -> str | None:
    """Why ``pieces`` do not lie apart inside one ``item_bytes`` slot, or None."""
    if kind != "slot":
        return "pieces sharding is for slot pools"
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if p.end > item_bytes:
            return f"a piece ends at byte {p.end} of a {item_bytes}-byte slot"
        spans += [(p.offset + r * p.row_stride, p.width) for r in range(p.rows)]
    spans.sort()
    for (a, n), (b, _) in zip(spans, spans[1:]):
        if a + n > b:
            return f"pieces overlap at byte {b} of the slot"
    return None


def _build(cls: type, **fields: Any) -> Any:
    """Construct a Struct, turning validation errors into ConfigError for callers."""
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as e:
        raise ConfigError(str(e)) from None


def _check_tensors(name: str, ts: list[Any]) -> None:
    shape, dtype, dev = ts[0].shape, ts[0].dtype, ts[0].device
    for t in ts:
        if not t.is_contiguous():
            raise ConfigError(f"pool {name!r}: buffers must be contiguous")
        if t.shape != shape or t.dtype != dtype or t.device != dev:
            raise ConfigError(f"pool {name!r}: buffers differ in shape, dtype or device")


def _buffers(name: str, ts: list[Any], ids: list[int], role: str) -> list[BufferSpec]:
    if len(ids) != len(ts):
        raise ConfigError(f"pool {name!r}: {len(ids)} layer ids for {len(ts)} buffers")
    return [
        BufferSpec(int(t.data_ptr()), int(t.numel() * t.element_size()), int(i), role)
        for t, i in zip(ts, ids)
    ]


def _pool(
    name: str,
    kind: str,
    bufs: list[BufferSpec],
    ts: list[Any],
    page_size: int,
    sharding: Sharding,
    indices_from: str | None,
    optional: bool,
    page_remap: bool,
) -> PoolSpec:
    _check_tensors(name, ts)
    t0 = ts[0]
    return _build(
        PoolSpec,
        name=name,
        kind=kind,
        buffers=tuple(bufs),
        item_bytes=int(t0[0].numel() * t0.element_size()),
        num_items=int(t0.shape[0]),
        page_size=page_size,
        location=str(t0.device),
        dtype=str(t0.dtype).removeprefix("torch."),
        sharding=sharding,
        indices_from=indices_from,
        optional=optional,
        page_remap=page_remap,
    )


def segment_lanes(segs: Sequence[PageSegment], page_size: int) -> list[tuple[int, int, int]]:
    """Each row of each segment (a lane), in page order: where its units start inside one
    head's part of a page of ``page_size`` tokens (the page, unsharded), how many tokens a
    unit holds and its bytes."""
    out = []
    off = 0
    for g in segs:
        step = page_size // g.tokens * g.nbytes
        out += [(off + r * step, g.tokens, g.nbytes) for r in range(g.rows)]
        off += g.rows * step
    return out


# -- compatibility ----------------------------------------------------------------------------


def compat_key(p: PoolSpec) -> tuple[Any, ...]:
    """The part of a pool's geometry both sides must agree on, whatever their TP, PP and
    page size: kind, dtype and the bytes of one token (of one head, when sharded by heads)."""
    sh = p.sharding
    if p.kind == "slot" and sh.kind == "pieces":
        unit: tuple[Any, ...] = ("pieces", piece_key(p))
    elif p.kind == "slot":
        unit = ("slot", p.item_bytes)
    elif sh.kind == "heads":
        unit = ("heads", sh.total_heads, sh.head_bytes, sh.layout)
    else:
        unit = ("token", p.token_bytes)
    inside = p.page_segments if p.kind == "paged" else None
    return (p.name, p.kind, p.dtype, unit, p.indices_from, inside)


def piece_key(p: PoolSpec) -> tuple[tuple[int, int, int], ...] | str:
    """What both sides' pieces must agree on whatever their TP: each piece's global units,
    unit bytes and rows (``"whole"``: a slot not split into pieces)."""
    if p.sharding.kind != "pieces":
        return "whole"
    return tuple((q.total, q.unit_bytes, q.rows) for q in p.sharding.pieces)


def layout_signature(pools: Sequence[PoolSpec]) -> str:
    """A short hash over every pool's compat key: equal signatures mean the pools pair."""
    h = hashlib.sha256()
    for p in sorted(pools, key=lambda p: p.name):
        if not p.optional:
            h.update(repr(compat_key(p)).encode())
    return h.hexdigest()[:16]


def check_pair(src: PoolSpec, dst: PoolSpec) -> str | None:
    """Why ``src`` (prefill) cannot feed ``dst`` (decode), or None when it can."""
    n = src.name
    if src.kind != dst.kind:
        return f"pool {n!r}: kind {src.kind} on prefill, {dst.kind} on decode"
    if src.dtype != dst.dtype:
        return f"pool {n!r}: dtype mismatch: prefill {src.dtype}, decode {dst.dtype}"
    if (src.item_bytes == 0) != (dst.item_bytes == 0):
        return f"pool {n!r}: logical (no bytes) on one side only"
    if src.item_bytes == 0:
        return None
    if src.kind == "slot":
        a, b = src.sharding, dst.sharding
        if a.kind == "pieces" or b.kind == "pieces":
            if piece_key(src) != piece_key(dst):
                return (
                    f"pool {n!r}: state pieces (total units, unit bytes, rows) differ: "
                    f"prefill {piece_key(src)}, decode {piece_key(dst)}"
                )
        elif src.item_bytes != dst.item_bytes:
            return (
                f"pool {n!r}: slot size mismatch: prefill {src.item_bytes}, decode {dst.item_bytes}"
            )
    else:
        a, b = src.sharding, dst.sharding
        if a.kind != b.kind:
            return f"pool {n!r}: sharding {a.kind} on prefill, {b.kind} on decode"
        if a.kind == "heads":
            if a.head_bytes != b.head_bytes:
                return (
                    f"pool {n!r}: head size mismatch (head dim x dtype): prefill "
                    f"{a.head_bytes} bytes per head, decode {b.head_bytes}"
                )
            if a.total_heads != b.total_heads:
                return f"pool {n!r}: total heads mismatch: prefill {a.total_heads}, decode {b.total_heads}"
            if a.layout != b.layout:
                return f"pool {n!r}: layout mismatch: prefill {a.layout}, decode {b.layout}"
        elif src.token_bytes != dst.token_bytes:
            return (
                f"pool {n!r}: bytes per token mismatch: prefill {src.token_bytes}, "
                f"decode {dst.token_bytes}"
            )
        if src.page_size != dst.page_size:
            why = _remap_error(src, dst)
            if why:
                return (
                    f"pool {n!r}: page_size: prefill {src.page_size}, decode {dst.page_size}: {why}"
                )
    dst_keys = {(buf.layer_id, buf.role) for buf in dst.buffers}
    for buf in src.buffers:
        if (buf.layer_id, buf.role) not in dst_keys:
            return (
                f"pool {n!r}: prefill buffer layer {buf.layer_id} {buf.role} has no decode buffer"
            )
    return None


def _remap_error(src: PoolSpec, dst: PoolSpec) -> str | None:
    """Why pages of ``src`` cannot be mapped into pages of another size in ``dst``, or None:
    both token-major, or both laid out by the same segments (``PageSegment``, one head's
    when sharded, the same heads on both sides) whose units tile both page sizes."""
    a, b = src.page_segments, dst.page_segments
    if a is None or b is None:
        side = "prefill" if a is None else "decode"
        return f"the {side}'s page interior is opaque, so its pages move only whole"
    if not (src.page_remap or dst.page_remap):
        return "mark the decode pool page_remap=True to map tokens"
    if src.token_major and dst.token_major:
        return None
    if a != b:
        return f"page interiors differ (prefill {_segs(a)}, decode {_segs(b)})"
    sa, sb = src.sharding, dst.sharding
    if (sa.first_head, sa.rank_heads) != (sb.first_head, sb.rank_heads):
        return (
            f"heads [{sa.first_head}, {sa.first_head + sa.rank_heads}) on the prefill, "
            f"[{sb.first_head}, {sb.first_head + sb.rank_heads}) on the decode: head slices "
            "of pages that are not token-major need equal page sizes"
        )
    return None


def _segs(segs: tuple[PageSegment, ...]) -> str:
    return " ".join(f"{g.rows}x{g.tokens}t/{g.nbytes}B" for g in segs)


def check_pools(src_pools: Sequence[PoolSpec], dst_pools: Sequence[PoolSpec]) -> str | None:
    """Pair every pool by name; a pool missing on one side is an error unless optional."""
    s = {p.name: p for p in src_pools}
    d = {p.name: p for p in dst_pools}
    for name in sorted(set(s) | set(d)):
        if name not in d:
            if not s[name].optional:
                return f"pool {name!r} exists on prefill but not on decode"
            continue
        if name not in s:
            if not d[name].optional:
                return f"pool {name!r} exists on decode but not on prefill"
            continue
        why = check_pair(s[name], d[name])
        if why:
            return why
    return None
