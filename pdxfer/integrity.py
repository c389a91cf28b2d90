"""KV digests defined on logical order, so both sides of a transfer can compare them.

A digest covers one buffer of one pool (one layer's K, V or latent), tokens ``[start, end)``
and global heads ``[lo, hi)``, read in logical order: token by token, head by head, byte by
byte. Page placement, page size, layout (NHD/HND) and TP sharding change where those bytes
sit, never the digest: a prefill with page 64 and HND pages and a decode with page 1 and NHD
rows compute the same value over the same KV.

Modes:

- ``off``: nothing is digested.
- ``sampled`` (the default): a fixed sample that touches every page on both sides. With
  ``S = min(page sizes of the two sides)``, tokens whose position is ``S-1`` modulo ``S`` are
  read, plus the range's first and last token: any page either side holds spans ``S`` tokens
  or is cut by the range's ends, so it has at least one sampled token. Of each sampled token
  it reads the first 8 bytes of the range's first head and the last 8 bytes of its last head
  (of the token's row in a pool without heads). That catches a wrong, stale, missing, shifted
  or overwritten page, and a head slice landing off by a head, for a cost that does not grow
  with the page's bytes: two cache lines per sampled token and buffer, which matters because
  those reads are scattered (cold in cache and TLB right after a network write).
- ``full``: every byte.

The hash is XXH3-64 (``xxhash``) over the selected bytes, on host memory. Device pools are not
digested yet (``IntegrityUnsupported``): an engine with device pools runs with ``off``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from .errors import ConfigError
from .pools import PoolSpec

MODES = ("off", "sampled", "full")
MASK = (1 << 63) - 1
"""Digests keep 63 bits: they travel as non-negative int64 (msgpack, msgspec bounds)."""
SAMPLE_BYTES = 8


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"integrity must be one of {MODES}, got {mode!r}")
    return mode


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens ``[start, end)`` of a pool whose pages (``pages``) cover tokens from ``first``,
    heads ``[lo, hi)`` (global ids; ignored for pools without head sharding)."""

    pages: np.ndarray
    first: int
    start: int
    end: int
    lo: int = 0
    hi: int = 0


def sample_stride(a: PoolSpec, b: PoolSpec) -> int:
    """The sampling stride two sides agree on: the smaller page size."""
    return max(1, min(a.page_size, b.page_size))


def sampled_tokens(start: int, end: int, stride: int) -> np.ndarray:
    """Token positions a sampled digest reads: every position ``stride-1`` modulo ``stride``
    in ``[start, end)``, and the range's own first and last token (sorted, unique)."""
    if end <= start:
        return np.empty(0, dtype=np.int64)
    if stride <= 1:
        return np.arange(start, end, dtype=np.int64)
    first = start + (stride - 1 - start) % stride
    t = np.arange(first, end, stride, dtype=np.int64)
    if not t.size or t[0] != start:
        t = np.concatenate(([start], t))
    if t[-1] != end - 1:
        t = np.concatenate((t, [end - 1]))
    return t


def _units(pool: PoolSpec, span: Span, tokens: np.ndarray, heads: np.ndarray | None
           ) -> tuple[np.ndarray, int]:
    """Byte offsets (inside one buffer) of each logical unit, in logical order, and the unit's
    size: one head of one token for head-sharded pools, else one token's row."""
    ps = pool.page_size
    rel = tokens - span.first
    if rel.size and (int(rel.min()) < 0 or int(rel.max()) >= span.pages.size * ps):
        raise ConfigError(f"pool {pool.name!r}: pages do not cover tokens "
                          f"[{span.start}, {span.end})")
    page = span.pages[rel // ps].astype(np.int64)
    within = rel % ps
    base = page * pool.item_bytes
    if heads is None or pool.sharding.kind != "heads":
        return base + within * pool.token_bytes, pool.token_bytes
    sh = pool.sharding
    hb = sh.head_bytes
    local = heads - sh.first_head
    if local.size and (int(local.min()) < 0 or int(local.max()) >= sh.rank_heads):
        raise ConfigError(f"pool {pool.name!r}: heads [{span.lo}, {span.hi}) not held here")
    if pool.token_major:
        offs = (base + within * pool.token_bytes)[:, None] + (local * hb)[None, :]
    else:  # HND: a head's rows of a page are contiguous
        offs = base[:, None] + (local * ps * hb)[None, :] + (within * hb)[:, None]
    return offs.reshape(-1), hb


def _heads(pool: PoolSpec, span: Span, sampled: bool) -> np.ndarray | None:
    if pool.sharding.kind != "heads":
        return None
    if span.hi <= span.lo:
        raise ConfigError(f"pool {pool.name!r}: empty head range [{span.lo}, {span.hi})")
    if sampled:
        return np.array([span.lo] if span.hi - 1 == span.lo else [span.lo, span.hi - 1],
                        dtype=np.int64)
    return np.arange(span.lo, span.hi, dtype=np.int64)


def _host_view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class _Bases:
    """One uint8 view spanning every buffer of a pool, and each buffer's offset in it: a
    sample of all buffers is then one gather (no per-buffer view or Python loop)."""

    __slots__ = ("offsets", "view", "words")

    def __init__(self, pool: PoolSpec) -> None:
        addrs = np.array([b.addr for b in pool.buffers], dtype=np.int64)
        lo = int(addrs.min())
        span = int(addrs.max()) - lo + pool.num_items * pool.item_bytes
        self.view = _host_view(lo, span)
        self.offsets = addrs - lo
        aligned = lo % 8 == 0 and not (self.offsets % 8).any()
        self.words = self.view[:span - span % 8].view(np.uint64) if aligned else None


_BASES: dict[int, tuple[PoolSpec, _Bases]] = {}


def _bases(pool: PoolSpec) -> _Bases:
    hit = _BASES.get(id(pool))
    if hit is None or hit[0] is not pool:
        if len(_BASES) > 256:
            _BASES.clear()
        hit = _BASES[id(pool)] = (pool, _Bases(pool))
    return hit[1]


@functools.lru_cache(maxsize=4096)
def _sample_points(start: int, end: int, stride: int, first: int, ps: int, token_bytes: int,
                   hb: int, lo: int, hi: int, token_major: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each sampled token: its page (relative to the span's first page) and the byte
    offsets inside that page where the sample's head starts and its tail ends (``hb`` 0: a
    pool without heads, whose token rows are sampled whole). It depends only on the request's
    shape, never on page placement, so requests of one shape share it."""
    rel = sampled_tokens(start, end, stride) - first
    pidx, within = np.divmod(rel, ps)
    if hb == 0:
        head = within * token_bytes
        tail = head + token_bytes
    elif token_major:
        head = within * token_bytes + lo * hb
        tail = within * token_bytes + (hi + 1) * hb
    else:  # HND: a head's rows of a page are contiguous
        head = lo * ps * hb + within * hb
        tail = hi * ps * hb + within * hb + hb
    for x in (pidx, head, tail):
        x.setflags(write=False)
    return pidx, head, tail


def _sampled(pool: PoolSpec, span: Span, stride: int, b: _Bases, base: np.ndarray
             ) -> list[int]:
    """Sampled digests (the bytes read: module notes), one per buffer offset in ``base``."""
    heads = pool.sharding.kind == "heads"
    lo = hi = 0
    hb = 0
    if heads:
        sh = pool.sharding
        if span.hi <= span.lo:
            raise ConfigError(f"pool {pool.name!r}: empty head range [{span.lo}, {span.hi})")
        lo, hi, hb = span.lo - sh.first_head, span.hi - 1 - sh.first_head, sh.head_bytes
        if lo < 0 or hi >= sh.rank_heads:
            raise ConfigError(f"pool {pool.name!r}: heads [{span.lo}, {span.hi}) not held here")
    pidx, head, tail = _sample_points(span.start, span.end, stride, span.first,
                                      pool.page_size, pool.token_bytes, hb, lo, hi,
                                      pool.token_major)
    pages = np.asarray(span.pages)
    if pidx.size and (int(pidx[0]) < 0 or int(pidx[-1]) >= pages.size):
        raise ConfigError(f"pool {pool.name!r}: pages do not cover tokens "
                          f"[{span.start}, {span.end})")
    at = pages[pidx].astype(np.int64) * pool.item_bytes
    k = min(SAMPLE_BYTES, hb or pool.token_bytes)
    if b.words is not None and k == SAMPLE_BYTES and not (
            pool.item_bytes % 8 or pool.token_bytes % 8 or hb % 8):
        w = np.empty((at.size, 2), dtype=np.int64)  # 8 bytes at a time: same bytes, order
        w[:, 0], w[:, 1] = (at + head) >> 3, ((at + tail) >> 3) - 1
        rows = b.words[(base >> 3)[:, None] + w.reshape(1, -1)]
    else:
        r = np.arange(k, dtype=np.int64)
        cols = np.concatenate(((at + head)[:, None] + r, (at + tail - k)[:, None] + r), axis=1)
        rows = np.ascontiguousarray(b.view[base[:, None] + cols.reshape(1, -1)])
    m = memoryview(rows).cast("B")
    step = m.nbytes // max(1, rows.shape[0])
    h = xxhash.xxh3_64_intdigest
    return [h(m[i:i + step]) & MASK for i in range(0, m.nbytes, step)] if step else [
        h(b"") & MASK for _ in range(rows.shape[0])]


def digests(pool: PoolSpec, span: Span, mode: str, stride: int = 1,
            buffers: Sequence[int] | None = None) -> list[int]:
    """One digest per buffer of ``pool`` (or per index in ``buffers``) over ``span``."""
    if mode == "off":
        return []
    if pool.location != "cpu":
        raise IntegrityUnsupported(f"pool {pool.name!r} is on {pool.location}: digests of "
                                   f"device pools are not supported yet (integrity='off')")
    b = _bases(pool)
    base = b.offsets if buffers is None else b.offsets[np.asarray(buffers, dtype=np.int64)]
    if mode == "sampled":
        return _sampled(pool, span, stride, b, base)
    tokens = np.arange(span.start, span.end, dtype=np.int64)
    offs, unit = _units(pool, span, tokens, _heads(pool, span, False))
    # full: hash contiguous runs of units in logical order (the stream equals one buffer of
    # every byte in that order; a run is as long as memory and logical order agree)
    if offs.size == 0:
        return [xxhash.xxh3_64_intdigest(b"") & MASK for _ in range(base.size)]
    brk = np.flatnonzero(offs[1:] != offs[:-1] + unit) + 1
    starts = offs[np.concatenate(([0], brk))]
    lens = np.diff(np.concatenate(([0], brk, [offs.size]))) * unit
    runs = list(zip(starts.tolist(), (starts + lens).tolist()))
    out: list[int] = []
    for o in base.tolist():
        h = xxhash.xxh3_64()
        for a, e in runs:
            h.update(b.view[o + a:o + e])
        out.append(h.intdigest() & MASK)
    return out


def slot_digests(pool: PoolSpec, slot: int, mode: str,
                 buffers: Sequence[int] | None = None) -> list[int]:
    """One digest per buffer of a slot pool's row ``slot`` (rows are small: always whole)."""
    if mode == "off":
        return []
    if pool.location != "cpu":
        raise IntegrityUnsupported(f"pool {pool.name!r} is on {pool.location}: digests of "
                                   f"device pools are not supported yet (integrity='off')")
    out = []
    for i in range(len(pool.buffers)) if buffers is None else buffers:
        view = _host_view(pool.buffers[i].addr, pool.num_items * pool.item_bytes)
        off = slot * pool.item_bytes
        out.append(xxhash.xxh3_64_intdigest(view[off:off + pool.item_bytes].tobytes()) & MASK)
    return out


PAGE_SAMPLE_WORDS = 512
"""A page digest reads one 8-byte word per 4 KiB of each buffer's page (all of it when a page
is not a multiple of 8 bytes): enough to tell a wrong, stale or shifted page, and a copy torn
at any 4 KiB (OS page) boundary, while a restore's check reads 1/512 of what it copied."""


def page_digest(rows: np.ndarray) -> int:
    """Digest of one page given as ``[buffers, item_bytes]`` uint8 (an L2 host page, or the
    same page gathered from L1's buffers): equal bytes in equal order give equal digests."""
    if rows.shape[1] % 8 == 0:
        rows = np.ascontiguousarray(rows).view(np.uint64)[:, ::PAGE_SAMPLE_WORDS]
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(rows)) & MASK


def host_rows(addr: int, num_items: int, item_bytes: int) -> np.ndarray:
    """A host buffer as ``[num_items, item_bytes]`` uint8 (a view, no copy)."""
    return _host_view(addr, num_items * item_bytes).reshape(num_items, item_bytes)


def l1_page_digests(pool: PoolSpec, pages: np.ndarray) -> list[int]:
    """``page_digest`` of each L1 page in ``pages`` of a host pool, gathering only the words
    the digest reads (one gather for every page and buffer; never a copy of whole pages)."""
    b = _bases(pool)
    item = pool.item_bytes
    pages = np.asarray(pages, dtype=np.int64)
    if b.words is None or item % 8:
        return [page_digest(l1_page_rows(pool, int(p))) for p in pages.tolist()]
    cols = np.arange(0, item // 8, PAGE_SAMPLE_WORDS, dtype=np.int64)
    idx = ((b.offsets[None, :, None] + (pages * item)[:, None, None]) >> 3) + cols
    words = b.words[idx]  # [pages, buffers, sampled words]
    h = xxhash.xxh3_64_intdigest
    return [h(w) & MASK for w in words]


def l1_page_rows(pool: PoolSpec, page: int) -> np.ndarray:
    """``[buffers, item_bytes]`` of one L1 page of a host pool (a gather, for ``page_digest``)."""
    return np.stack([_host_view(b.addr + page * pool.item_bytes, pool.item_bytes)
                     for b in pool.buffers])


def covers(ranges: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the union of ``ranges`` covers ``[start, end)``."""
    at = start
    for a, b in sorted(ranges):
        if a > at:
            return False
        at = max(at, b)
    return at >= end


class IntegrityUnsupported(ConfigError):
    """A digest was asked of memory this build cannot read (a device pool)."""
