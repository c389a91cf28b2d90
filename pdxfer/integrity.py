"""KV digests defined on logical order, so both sides of a transfer can compare them.

A digest covers one buffer of one pool, tokens ``[start, end)`` and global heads ``[lo, hi)``,
read token by token, head by head, byte by byte: page placement, page size, layout (NHD/HND)
and TP sharding change where the bytes sit, never the digest. Modes: ``off``; ``sampled``
(the default: with ``S`` the smaller page size of the two sides, the token at ``S-1`` modulo
``S`` plus the range's ends where their page has none, so every page either side holds is
sampled; of each, the first 8 bytes of the range's first head and, for a head slice, the
last 8 of its last head: a wrong, stale, shifted or missing page is caught for one or two
words per page); ``full``, every byte. Host pool pairs hash with XXH3-64; if either pool is
on a device, both use a *portable* digest torch computes on the pool's own device (words
mixed with their position by SplitMix64's finalizer and summed modulo 2^64: bit-identical on
any device and on host), so only one word per buffer leaves the device. Other device types
raise ``IntegrityUnsupported``. Semantics and cost: docs/failure-semantics.md.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .errors import ConfigError
from .pools import PoolSpec, segment_lanes

MASK = (1 << 63) - 1
"""Digests keep 63 bits: they travel as non-negative int64 (msgpack, msgspec bounds)."""
SAMPLE_BYTES = 8


def supported(location: str) -> bool:
    """Whether pools on ``location`` can be digested (host memory, or CUDA through torch)."""
    return location == "cpu" or location == "cuda" or location.startswith("cuda:")


def portable(a: PoolSpec, b: PoolSpec) -> bool:
    """Whether a pool pair uses the portable digest: either side is device memory."""
    return a.location != "cpu" or b.location != "cpu"


class Digests(list[int]):
    """Digests, one per buffer, and how many bytes were read for them (``nbytes``, the
    ``integrity_bytes`` counter)."""

    __slots__ = ("nbytes",)

    def __init__(self, values: Sequence[int] = (), nbytes: int = 0) -> None:
        super().__init__(values)
        self.nbytes = nbytes


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


@dataclass(frozen=True, slots=True)
class Sampling:
    """What two sides agree to sample: the stride (the smaller page size) and both page sizes
    (pages start at token multiples of their size on either side)."""

    stride: int
    pages: tuple[int, ...] = ()


def sample_stride(a: PoolSpec, b: PoolSpec) -> Sampling:
    """The sampling two sides agree on: stride the smaller page size, and both page sizes."""
    return Sampling(max(1, min(a.page_size, b.page_size)), (a.page_size, b.page_size))


def sampled_tokens(start: int, end: int, stride: int, pages: tuple[int, ...] = ()) -> np.ndarray:
    """Token positions a sampled digest reads: every position ``stride-1`` modulo ``stride``
    in ``[start, end)``, and the range's own first and last token (sorted, unique) unless,
    on every side (page sizes ``pages``), the page holding it holds a sampled token already:
    each page either side holds then has one sampled token, read once."""
    if end <= start:
        return np.empty(0, dtype=np.int64)
    if stride <= 1:
        return np.arange(start, end, dtype=np.int64)
    first = start + (stride - 1 - start) % stride
    t = np.arange(first, end, stride, dtype=np.int64)

    def covered(tok: int, near: int) -> bool:
        return bool(pages) and all(tok // p == near // p for p in pages)

    if not t.size or (t[0] != start and not covered(start, int(t[0]))):
        t = np.concatenate(([start], t))
    if t[-1] != end - 1 and not covered(end - 1, int(t[-1])):
        t = np.concatenate((t, [end - 1]))
    return t


def _units(
    pool: PoolSpec, span: Span, tokens: np.ndarray, heads: np.ndarray | None
) -> tuple[np.ndarray, int]:
    """Byte offsets (inside one buffer) of each logical unit, in logical order, and the unit's
    size: one head of one token for head-sharded pools, else one token's row."""
    ps = pool.page_size
    rel = tokens - span.first
    if rel.size and (int(rel.min()) < 0 or int(rel.max()) >= span.pages.size * ps):
        raise ConfigError(
            f"pool {pool.name!r}: pages do not cover tokens [{span.start}, {span.end})"
        )
    if pool.segments:
        return _segment_units(pool, span, tokens, heads)
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


def _segment_units(
    pool: PoolSpec, span: Span, tokens: np.ndarray, heads: np.ndarray | None
) -> tuple[np.ndarray, int]:
    """``_units`` of a pool whose page interior is packed (``PoolSpec.segments``): the
    tokens go by groups of every unit's tokens (a range is digested whole groups, as it is
    copied), each group head by head, lane by lane (``pools.segment_lanes``), in pieces of
    one size (the gcd of what each lane holds of a group)."""
    ps, sh = pool.page_size, pool.sharding
    lanes = segment_lanes(pool.segments or (), ps)
    group = int(np.lcm.reduce([u for _, u, _ in lanes]))
    sizes = [group // u * nb for _, u, nb in lanes]
    piece = int(np.gcd.reduce(sizes))
    starts = np.unique(tokens // group) * group - span.first
    page = span.pages[starts // ps].astype(np.int64)
    within = starts % ps
    per_head = ps * sh.head_bytes if sh.kind == "heads" else 0
    local = (
        (heads - sh.first_head)
        if heads is not None and sh.kind == "heads"
        else np.zeros(1, np.int64)
    )
    # each lane's part of a group is contiguous: its pieces, and each piece's lane's unit
    off = np.concatenate([at + np.arange(0, n, piece) for (at, _, _), n in zip(lanes, sizes)])
    rep = [n // piece for n in sizes]
    u = np.repeat(np.array([x[1] for x in lanes], dtype=np.int64), rep)
    nb = np.repeat(np.array([x[2] for x in lanes], dtype=np.int64), rep)
    offs = (
        (page * pool.item_bytes)[:, None, None]
        + (local * per_head)[None, :, None]
        + off[None, None, :]
        + ((within[:, None] // u[None, :]) * nb[None, :])[:, None, :]
    )
    return offs.reshape(-1), piece


def _heads(pool: PoolSpec, span: Span) -> np.ndarray | None:
    if pool.sharding.kind != "heads":
        return None
    if span.hi <= span.lo:
        raise ConfigError(f"pool {pool.name!r}: empty head range [{span.lo}, {span.hi})")
    return np.arange(span.lo, span.hi, dtype=np.int64)


def _host_view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class _CudaMemory:
    """Device memory at an address, as torch takes it (``__cuda_array_interface__``)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


def torch_bytes(addr: int, nbytes: int, location: str) -> Any:
    """``nbytes`` at ``addr`` on ``location`` as a uint8 torch tensor (a view, no copy)."""
    import torch

    if location == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
    if not supported(location):
        raise IntegrityUnsupported(f"cannot digest memory on {location!r} (cpu or cuda only)")
    return torch.as_tensor(_CudaMemory(addr, nbytes), device=torch.device(location))


class _Bases:
    """One uint8 view spanning every buffer of a pool, and each buffer's offset in it: a
    sample of all buffers is then one gather (no per-buffer view or Python loop). ``dev``:
    torch tensors on the pool's own device (the portable digest), else numpy on host."""

    __slots__ = ("offsets", "view", "words")

    def __init__(self, pool: PoolSpec, dev: bool = False) -> None:
        addrs = np.array([b.addr for b in pool.buffers], dtype=np.int64)
        lo = int(addrs.min())
        span = int(addrs.max()) - lo + pool.num_items * pool.item_bytes
        self.offsets = addrs - lo
        aligned = lo % 8 == 0 and not (self.offsets % 8).any()
        if dev:
            import torch

            self.view = torch_bytes(lo, span, pool.location)
            self.words = self.view[: span - span % 8].view(torch.int64) if aligned else None
        else:
            self.view = _host_view(lo, span)
            self.words = self.view[: span - span % 8].view(np.uint64) if aligned else None


_BASES: dict[tuple[int, bool], tuple[PoolSpec, _Bases]] = {}


def _bases(pool: PoolSpec, dev: bool = False) -> _Bases:
    hit = _BASES.get((id(pool), dev))
    if hit is None or hit[0] is not pool:
        if len(_BASES) > 256:
            _BASES.clear()
        hit = _BASES[(id(pool), dev)] = (pool, _Bases(pool, dev))
    return hit[1]


# -- the portable digest (module notes) ---------------------------------------------------------
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # SplitMix64's finalizer constants, as signed int64
_C2 = 0x94D049BB133111EB - (1 << 64)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)


def _fmix(z: Any) -> Any:
    """SplitMix64's finalizer on an int64 tensor (logical shifts: masked arithmetic ones)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _C1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _C2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _mix_sums(x: Any) -> Any:
    """Per row of ``x`` ([rows, n] int64 values in logical order): the sum of each value mixed
    with its position (wrapping, so the order of summation does not matter)."""
    import torch

    pos = torch.arange(1, x.shape[-1] + 1, dtype=torch.int64, device=x.device) * _GOLD
    return _fmix(x ^ pos).sum(dim=-1, dtype=torch.int64)


def _mix_finish(sums: Any, n: int) -> list[int]:
    """The digests of rows of ``n`` values from their ``_mix_sums`` (one device sync)."""
    return [v & MASK for v in _fmix(sums ^ n).tolist()]


def _gather_values(b: _Bases, starts: np.ndarray, k: int) -> Any:
    """The values of the ``k``-byte units at byte offsets ``starts`` ([rows, m], host) of the
    device view: one int64 word per unit when ``k`` is 8 (a word gather where memory is
    aligned, else 8 byte gathers joined), else one value per byte (``[rows, m * k]``)."""
    import torch

    dev = b.view.device
    if k == 8 and b.words is not None and not (starts % 8).any():
        return b.words[torch.from_numpy(starts >> 3).to(dev)]
    return _gather_at(b, torch.from_numpy(starts).to(dev), k)


def _gather_at(b: _Bases, byte_idx: Any, k: int) -> Any:
    """``_gather_values`` by single bytes, the offsets already a tensor on the device."""
    import torch

    dev = b.view.device
    cols = byte_idx[..., None] + torch.arange(k, device=dev)
    raw = b.view[cols]
    if k == 8:
        return raw.contiguous().view(torch.int64)[..., 0]
    return raw.reshape(raw.shape[0], -1).to(torch.int64)


@functools.lru_cache(maxsize=4096)
def _sample_points(
    start: int,
    end: int,
    stride: int,
    pages: tuple[int, ...],
    first: int,
    ps: int,
    token_bytes: int,
    hb: int,
    lo: int,
    hi: int,
    token_major: bool,
    tail: bool,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The sample's reads, in order: the page of each (relative to the span's first page) and
    the byte offset inside that page where it starts. Per sampled token: ``k`` bytes at the
    start of head ``lo`` and, with ``tail``, the last ``k`` bytes of head ``hi`` (``hb`` 0: a
    pool without heads, whose token rows are sampled from their start). It depends only on
    the request's shape, never on page placement, so requests of one shape share it."""
    rel = sampled_tokens(start, end, stride, pages) - first
    pidx, within = np.divmod(rel, ps)
    if hb == 0:
        head = within * token_bytes
        last = head + token_bytes
    elif token_major:
        head = within * token_bytes + lo * hb
        last = within * token_bytes + (hi + 1) * hb
    else:  # HND: a head's rows of a page are contiguous
        head = lo * ps * hb + within * hb
        last = hi * ps * hb + within * hb + hb
    if tail:
        pidx = np.repeat(pidx, 2)
        offs = np.stack((head, last - k), axis=1).reshape(-1)
    else:
        offs = head
    for x in (pidx, offs):
        x.setflags(write=False)
    return pidx, offs


def _sample_plan(pool: PoolSpec, span: Span, sampling: int | Sampling) -> tuple[np.ndarray, int]:
    """Byte offsets (inside one buffer) where each read of the sample starts, and its size
    ``k`` (8 bytes, or the whole unit when smaller). The tail of the last head is read only
    for a head slice (part of the model's heads), whose edges a misplaced slice would move."""
    s = sampling if isinstance(sampling, Sampling) else Sampling(sampling)
    hb = lo = hi = 0
    tail = False
    if pool.sharding.kind == "heads":
        sh = pool.sharding
        if span.hi <= span.lo:
            raise ConfigError(f"pool {pool.name!r}: empty head range [{span.lo}, {span.hi})")
        lo, hi, hb = span.lo - sh.first_head, span.hi - 1 - sh.first_head, sh.head_bytes
        if lo < 0 or hi >= sh.rank_heads:
            raise ConfigError(f"pool {pool.name!r}: heads [{span.lo}, {span.hi}) not held here")
        tail = (span.lo, span.hi) != (0, sh.total_heads)
    if pool.segments:
        return _segment_samples(pool, span, s, hb, lo, hi, tail)
    k = min(SAMPLE_BYTES, hb or pool.token_bytes)
    pidx, offs = _sample_points(
        span.start,
        span.end,
        s.stride,
        s.pages,
        span.first,
        pool.page_size,
        pool.token_bytes,
        hb,
        lo,
        hi,
        pool.token_major,
        tail,
        k,
    )
    pages = np.asarray(span.pages)
    if pidx.size and (int(pidx[0]) < 0 or int(pidx[-1]) >= pages.size):
        raise ConfigError(
            f"pool {pool.name!r}: pages do not cover tokens [{span.start}, {span.end})"
        )
    return pages[pidx].astype(np.int64) * pool.item_bytes + offs, k


def _segment_samples(
    pool: PoolSpec, span: Span, s: Sampling, hb: int, lo: int, hi: int, tail: bool
) -> tuple[np.ndarray, int]:
    """``_sample_plan`` of a pool whose page interior is packed (``PoolSpec.segments``): per
    sampled token the first bytes of the unit of head ``lo``'s first lane holding it and,
    with ``tail``, the last bytes of head ``hi``'s last lane's."""
    ps = pool.page_size
    lanes = segment_lanes(pool.segments or (), ps)
    (a0, u0, n0), (a1, u1, n1) = lanes[0], lanes[-1]
    k = min(SAMPLE_BYTES, n0, n1 if tail else n0)
    rel = sampled_tokens(span.start, span.end, s.stride, s.pages) - span.first
    pidx, within = np.divmod(rel, ps)
    head = lo * ps * hb + a0 + within // u0 * n0
    if tail:
        last = hi * ps * hb + a1 + within // u1 * n1 + n1
        pidx = np.repeat(pidx, 2)
        offs = np.stack((head, last - k), axis=1).reshape(-1)
    else:
        offs = head
    pages = np.asarray(span.pages)
    if pidx.size and (int(pidx[0]) < 0 or int(pidx[-1]) >= pages.size):
        raise ConfigError(
            f"pool {pool.name!r}: pages do not cover tokens [{span.start}, {span.end})"
        )
    return pages[pidx].astype(np.int64) * pool.item_bytes + offs, k


def _hash_rows(rows: np.ndarray) -> Digests:
    """XXH3 of each row of ``rows`` (the sampled bytes of one buffer per row). Rows go to
    XXH3 as ``bytes`` from one ``tolist`` (half the time of slicing a memoryview per row)."""
    rows = np.ascontiguousarray(rows)
    step = rows.nbytes // max(1, rows.shape[0])
    if step == 0:
        return Digests([xxhash.xxh3_64_intdigest(b"") & MASK for _ in range(rows.shape[0])])
    h = xxhash.xxh3_64_intdigest
    return Digests(
        [h(r) & MASK for r in rows.reshape(rows.shape[0], -1).view(f"V{step}").ravel().tolist()],
        rows.nbytes,
    )


def _sampled(
    pool: PoolSpec, span: Span, sampling: int | Sampling, b: _Bases, base: np.ndarray
) -> Digests:
    """Sampled digests (the bytes read: module notes), one per buffer offset in ``base``."""
    starts, k = _sample_plan(pool, span, sampling)
    if b.words is not None and k == SAMPLE_BYTES and not (starts % 8).any():
        return _hash_rows(b.words[(base >> 3)[:, None] + (starts >> 3)[None, :]])
    cols = (starts[:, None] + np.arange(k, dtype=np.int64)).reshape(1, -1)
    return _hash_rows(np.ascontiguousarray(b.view[base[:, None] + cols]))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A host pool's sampled digests over one span, with every read planned ahead: the
    decode prepares them when it sends its request (the prefill computes meanwhile) and only
    gathers and hashes when the sender's digests arrive: planned right after a large write,
    the reads cost several times what they cost warm, on the request's path (measured:
    docs/performance-history.md#what-each-transfer-lead-bought-measured-alone)."""

    words: np.ndarray
    idx: np.ndarray
    """``[buffers, reads]`` indices into ``words`` (the same reads ``digests`` makes)."""

    def digests(self) -> Digests:
        return _hash_rows(self.words[self.idx])


def prepare(
    pool: PoolSpec, span: Span, stride: int | Sampling = 1, buffers: Sequence[int] | None = None
) -> Prepared | None:
    """``digests(pool, span, "sampled", stride, buffers)`` planned ahead (``Prepared``), or
    None where only ``digests`` computes it (device pools, unaligned memory or samples)."""
    if pool.location != "cpu":
        return None
    b = _bases(pool)
    starts, k = _sample_plan(pool, span, stride)
    if b.words is None or k != SAMPLE_BYTES or (starts % 8).any():
        return None
    base = b.offsets if buffers is None else b.offsets[np.asarray(buffers, dtype=np.int64)]
    return Prepared(b.words, (base >> 3)[:, None] + (starts >> 3)[None, :])


def _sampled_portable(
    pool: PoolSpec, span: Span, sampling: int | Sampling, b: _Bases, base: np.ndarray
) -> Digests:
    """The portable digest of the same sample, gathered and mixed on the pool's device."""
    offs, k = _sample_plan(pool, span, sampling)
    x = _gather_values(b, offs[None, :] + base[:, None], k)
    return Digests(_mix_finish(_mix_sums(x), int(x.shape[-1])), offs.size * k * base.size)


def _check_location(pool: PoolSpec, portable: bool) -> None:
    if not supported(pool.location):
        raise IntegrityUnsupported(
            f"pool {pool.name!r} is on {pool.location}: only host "
            f"and CUDA pools can be digested (integrity='off')"
        )
    if pool.location != "cpu" and not portable:
        raise IntegrityUnsupported(
            f"pool {pool.name!r} is on {pool.location}: device pools take the portable digest"
        )


def digests(
    pool: PoolSpec,
    span: Span,
    mode: str,
    stride: int | Sampling = 1,
    buffers: Sequence[int] | None = None,
    portable: bool = False,
) -> Digests:
    """One digest per buffer of ``pool`` (or per index in ``buffers``) over ``span``; with
    ``portable`` (a device pool on either side: ``portable()``) the torch digest."""
    if mode == "off":
        return Digests()
    _check_location(pool, portable)
    b = _bases(pool, portable)
    base = b.offsets if buffers is None else b.offsets[np.asarray(buffers, dtype=np.int64)]
    if mode == "sampled":
        return (_sampled_portable if portable else _sampled)(pool, span, stride, b, base)
    tokens = np.arange(span.start, span.end, dtype=np.int64)
    offs, unit = _units(pool, span, tokens, _heads(pool, span))
    if portable:
        return Digests(_full_portable(b, base, offs, unit), offs.size * unit * base.size)
    # full: hash contiguous runs of units in logical order (the stream equals one buffer of
    # every byte in that order; a run is as long as memory and logical order agree)
    if offs.size == 0:
        return Digests([xxhash.xxh3_64_intdigest(b"") & MASK for _ in range(base.size)])
    brk = np.flatnonzero(offs[1:] != offs[:-1] + unit) + 1
    starts = offs[np.concatenate(([0], brk))]
    lens = np.diff(np.concatenate(([0], brk, [offs.size]))) * unit
    runs = list(zip(starts.tolist(), (starts + lens).tolist()))
    out: list[int] = []
    for o in base.tolist():
        h = xxhash.xxh3_64()
        for a, e in runs:
            h.update(b.view[o + a : o + e])
        out.append(h.intdigest() & MASK)
    return Digests(out, offs.size * unit * base.size)


def _full_portable(b: _Bases, base: np.ndarray, offs: np.ndarray, unit: int) -> list[int]:
    """Every byte of the units at ``offs`` of each buffer, as the portable digest: 8-byte
    words when units are whole words, else single bytes; one buffer at a time on the device
    (a gather as large as that buffer's part of the request), one sync at the end.

    Only the units' offsets (one per token and head) go to the device; the index of every
    word or byte is expanded there. Built on the host, that index was as large as the KV it
    reads (8 bytes per word digested) and crossed to the device with every digest."""
    import torch

    k = 8 if unit % 8 == 0 else 1
    n = offs.size * (unit // k)
    if n == 0:
        return _mix_finish(torch.zeros(base.size, dtype=torch.int64), 0)
    dev = b.view.device
    within = torch.arange(0, unit, k, dtype=torch.int64, device=dev)
    if k == 8 and b.words is not None and not (offs % 8).any() and not (base % 8).any():
        units = torch.from_numpy(offs >> 3).to(dev)
        idx = (units[:, None] + (within >> 3)[None, :]).reshape(1, -1)
        sums = torch.cat([_mix_sums(b.words[idx + (o >> 3)]) for o in base.tolist()])
    else:
        starts = (torch.from_numpy(offs).to(dev)[:, None] + within[None, :]).reshape(1, -1)
        sums = torch.cat([_mix_sums(_gather_at(b, starts + o, k)) for o in base.tolist()])
    return _mix_finish(sums, n)


def slot_digests(
    pool: PoolSpec,
    slot: int,
    mode: str,
    buffers: Sequence[int] | None = None,
    portable: bool = False,
    spans: tuple[np.ndarray, np.ndarray] | None = None,
) -> Digests:
    """One digest per buffer of a slot pool's row ``slot`` (rows are small: always whole);
    ``spans``: only these ``(offsets, sizes)`` of the slot, in their order (a state slot's
    pieces written across TP sizes, ``plan/pieces.py``)."""
    if mode == "off":
        return Digests()
    _check_location(pool, portable)
    idx = list(range(len(pool.buffers))) if buffers is None else list(buffers)
    off, size = spans if spans is not None else (np.zeros(1, np.int64), np.full(1, pool.item_bytes))
    nbytes = int(size.sum())
    if portable:
        b = _bases(pool, True)
        k = 8 if not (off % 8).any() and not (size % 8).any() else 1
        row = np.concatenate(
            [np.arange(o, o + n, k, dtype=np.int64) for o, n in zip(off.tolist(), size.tolist())]
            or [np.zeros(0, np.int64)]
        )
        row = row + slot * pool.item_bytes
        starts = b.offsets[np.asarray(idx, dtype=np.int64)][:, None] + row[None, :]
        x = _gather_values(b, starts, k)
        return Digests(_mix_finish(_mix_sums(x), int(x.shape[-1])), nbytes * len(idx))
    out = []
    for i in idx:
        view = _host_view(pool.buffers[i].addr, pool.num_items * pool.item_bytes)
        base = slot * pool.item_bytes
        data = b"".join(
            view[base + o : base + o + n].tobytes() for o, n in zip(off.tolist(), size.tolist())
        )
        out.append(xxhash.xxh3_64_intdigest(data) & MASK)
    return Digests(out, nbytes * len(idx))


PAGE_SAMPLE_WORDS = 512
"""A page digest reads one 8-byte word per 4 KiB of each buffer's page (all of it when a page
is not a multiple of 8 bytes): enough to tell a wrong, stale or shifted page, and a copy torn
at any 4 KiB (OS page) boundary, while a restore's check reads 1/512 of what it copied."""


def page_digest(rows: np.ndarray) -> int:
    """Digest of one page given as ``[buffers, item_bytes]`` uint8 (an L2 host page, or the
    same page gathered from L1's buffers): equal bytes in equal order give equal digests."""
    if rows.shape[1] % 8 == 0:
        rows = np.ascontiguousarray(rows).view(np.uint64)[:, ::PAGE_SAMPLE_WORDS]
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(rows).data) & MASK


def host_rows(addr: int, num_items: int, item_bytes: int) -> np.ndarray:
    """A host buffer as ``[num_items, item_bytes]`` uint8 (a view, no copy)."""
    return _host_view(addr, num_items * item_bytes).reshape(num_items, item_bytes)


def l1_page_digests(pool: PoolSpec, pages: np.ndarray) -> list[int]:
    """``page_digest`` of each L1 page in ``pages``, gathering only the words the digest reads
    (one gather for every page and buffer; never a copy of whole pages). A CUDA pool gathers
    on its device and hands only those words (1/512 of the pages) to the host's XXH3: the
    digest it is compared with was recorded over the L2 (host) copy."""
    item = pool.item_bytes
    pages = np.asarray(pages, dtype=np.int64)
    dev = pool.location != "cpu"
    b = _bases(pool, dev)
    if b.words is None or item % 8:
        if dev:
            raise IntegrityUnsupported(
                f"pool {pool.name!r}: pages of a device pool must be 8-byte aligned to be checked"
            )
        return [page_digest(l1_page_rows(pool, int(p))) for p in pages.tolist()]
    cols = np.arange(0, item // 8, PAGE_SAMPLE_WORDS, dtype=np.int64)
    idx = ((b.offsets[None, :, None] + (pages * item)[:, None, None]) >> 3) + cols
    if dev:
        import torch

        words = b.words[torch.from_numpy(idx).to(b.view.device)].cpu().numpy()
    else:
        words = b.words[idx]  # [pages, buffers, sampled words]
    h = xxhash.xxh3_64_intdigest
    return [h(np.ascontiguousarray(w).data) & MASK for w in words]


def l1_page_rows(pool: PoolSpec, page: int) -> np.ndarray:
    """``[buffers, item_bytes]`` of one L1 page of a host pool (a gather, for ``page_digest``)."""
    return np.stack(
        [_host_view(b.addr + page * pool.item_bytes, pool.item_bytes) for b in pool.buffers]
    )


def covers(ranges: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the union of ``ranges`` covers ``[start, end)``."""
    at = start
    for a, b in sorted(ranges):
        if a > at:
            return False
        at = max(at, b)
    return at >= end


class IntegrityUnsupported(ConfigError):
    """A digest was asked of memory this build cannot read (a device other than CUDA)."""
