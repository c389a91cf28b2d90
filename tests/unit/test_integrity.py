"""Digests are defined on logical order: the same KV gives the same digest whatever the page
size, layout or TP shard holding it, and a wrong, stale, missing or shifted page changes it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.integrity import (
    IntegrityUnsupported,
    Span,
    digests,
    portable,
    prepare,
    sample_stride,
    sampled_tokens,
    slot_digests,
    supported,
)

ROOM = 41
TOKENS = (5, 93)  # not page aligned on purpose


def _pool(
    name: str,
    page_size: int,
    layout: str = "NHD",
    heads: int = 8,
    first: int = 0,
    total: int = 8,
    pages: int = 128,
):
    g = PoolGeom(
        name,
        "mha",
        layers=2,
        pages=pages,
        page_size=page_size,
        heads=heads,
        head_dim=16,
        layout=layout,
        total_heads=total,
        first_head=first,
    )
    specs, tensors = pat.build([g])
    return specs[0], tensors[name]


def _pages(n_tokens: int, ps: int, seed: int, pages: int = 128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(pages)[: -(-n_tokens // ps)].astype(np.int64)


def _filled(ps: int, layout: str = "NHD", heads: int = 8, first: int = 0, seed: int = 0):
    spec, ts = _pool("kv", ps, layout, heads, first)
    pages = _pages(TOKENS[1], ps, seed)
    pat.fill_tokens(spec, ts, ROOM, pages, 0, *TOKENS)
    return spec, ts, pages


@pytest.mark.parametrize("portable", [False, True], ids=["xxh3", "portable"])
@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize(
    "a,b",
    [
        ((16, "NHD"), (1, "NHD")),
        ((16, "HND"), (4, "NHD")),
        ((8, "HND"), (8, "HND")),
        ((64, "NHD"), (16, "HND")),
    ],
)
def test_digest_ignores_page_size_and_layout(mode: str, a, b, portable: bool) -> None:
    sa, ta, pa = _filled(*a, seed=1)  # keep the tensors: the specs only point at them
    sb, tb, pb = _filled(*b, seed=2)
    stride = sample_stride(sa, sb)
    da = digests(sa, Span(pa, 0, *TOKENS, 0, 8), mode, stride, portable=portable)
    db = digests(sb, Span(pb, 0, *TOKENS, 0, 8), mode, stride, portable=portable)
    assert da == db and len(set(da)) == len(da)  # equal per buffer, distinct across buffers


@pytest.mark.parametrize("portable", [False, True], ids=["xxh3", "portable"])
@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_digest_of_a_head_slice_equals_across_tp_shards(mode: str, portable: bool) -> None:
    whole, tw, pw = _filled(16, "HND", heads=8, first=0, seed=3)
    half, th, ph = _filled(4, "NHD", heads=4, first=4, seed=4)  # a decode rank holding 4..8
    s = sample_stride(whole, half)
    assert digests(whole, Span(pw, 0, *TOKENS, 4, 8), mode, s, portable=portable) == digests(
        half, Span(ph, 0, *TOKENS, 4, 8), mode, s, portable=portable
    )
    assert digests(whole, Span(pw, 0, *TOKENS, 4, 6), mode, s, portable=portable) != digests(
        whole, Span(pw, 0, *TOKENS, 4, 8), mode, s, portable=portable
    )


@pytest.mark.parametrize("known", [False, True], ids=["stride_only", "page_sizes"])
def test_sample_touches_every_page_of_either_side(known: bool) -> None:
    cases = [
        (5, 93, 4, (4, 16)),
        (0, 64, 1, (1, 64)),
        (3, 40, 8, (8, 24)),
        (20, 26, 16, (16, 24)),
        (0, 128, 64, (64, 64)),
        (16, 100, 16, (16, 64)),
        (7, 9, 4, (4, 12)),
        (0, 17, 16, (16, 16)),
    ]
    for start, end, s, pages_of in cases:
        t = set(sampled_tokens(start, end, s, pages_of if known else ()).tolist())
        for ps in pages_of:
            for p in range(start // ps, -(-end // ps)):
                lo, hi = max(start, p * ps), min(end, (p + 1) * ps)
                assert t & set(range(lo, hi)), (start, end, s, ps, p)


def test_digests_count_the_bytes_they_read() -> None:
    spec, ts, pages = _filled(16, seed=11)  # 4 buffers, 8 heads of 32 bytes, all heads
    span = Span(pages, 0, *TOKENS, 0, 8)
    n = len(sampled_tokens(*TOKENS, 16, (16, 16)))
    assert digests(spec, span, "sampled", sample_stride(spec, spec)).nbytes == n * 8 * 4
    assert digests(spec, span, "full").nbytes == (TOKENS[1] - TOKENS[0]) * spec.token_bytes * 4
    assert digests(spec, span, "off").nbytes == 0


def test_knowing_both_page_sizes_reads_each_page_once_where_it_can() -> None:
    """A range's ends are read only when their page has no other sampled token: 128 tokens
    in pages of 64 on both sides read 2 tokens (63, 127), not 3."""
    assert sampled_tokens(0, 128, 64, (64, 64)).tolist() == [63, 127]
    assert sampled_tokens(0, 128, 64).tolist() == [0, 63, 127]
    assert sampled_tokens(20, 26, 16, (16, 24)).tolist() == [20, 25]  # the page cut both ends


@pytest.mark.parametrize("portable", [False, True], ids=["xxh3", "portable"])
@pytest.mark.parametrize("fault", ["stale", "shift", "overwrite"])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_sampled_digest_catches_every_page_level_fault(fault: str, ps: int, portable: bool) -> None:
    """Every page of the destination, in turn: a page never written (stale), written one page
    off (shift), or overwritten with other bytes: the digest of its buffer changes."""
    src, ts, psrc = _filled(16, "HND", seed=5)
    dst, dts, pdst = _filled(ps, seed=6)
    s = sample_stride(src, dst)
    want = digests(src, Span(psrc, 0, *TOKENS, 0, 8), "sampled", s, portable=portable)
    assert digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "sampled", s, portable=portable) == want
    used = range(TOKENS[0] // ps, -(-TOKENS[1] // ps))
    spare = int(np.setdiff1d(np.arange(128), pdst)[0])
    for i in used:
        for b in range(len(dts)):
            u8 = dts[b].view(-1).view(torch.uint8).view(128, -1)
            keep = u8[pdst[i]].clone()
            if fault == "stale":
                u8[pdst[i]] = pat.SENTINEL
            elif fault == "shift":  # this page's bytes landed in the next page slot
                u8[pdst[i]] = u8[pdst[i + 1] if i + 1 < len(pdst) else spare]
            else:
                u8[pdst[i]] ^= 0xFF
            got = digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "sampled", s, portable=portable)
            u8[pdst[i]] = keep
            assert got[b] != want[b], (fault, ps, i, b)
            assert [g for j, g in enumerate(got) if j != b] == [
                w for j, w in enumerate(want) if j != b
            ]


@pytest.mark.parametrize(
    "a,b,heads",
    [
        ((16, "HND", 8, 0), (4, "NHD", 8, 0), (0, 8)),
        ((64, "NHD", 8, 0), (64, "NHD", 8, 0), (0, 8)),
        ((16, "HND", 8, 0), (4, "NHD", 4, 4), (4, 8)),
        ((8, "NHD", 8, 0), (1, "HND", 4, 0), (0, 4)),
    ],
)
def test_a_check_planned_ahead_reads_the_same_bytes_as_the_digest(a, b, heads) -> None:
    """The decode plans its sampled check when the request goes out (``prepare``) and gathers
    only when the digests arrive: same values as ``digests`` for the same buffers, and a page
    damaged after planning is still caught (the bytes are read at check time)."""
    src, ts, psrc = _filled(*a, seed=12)
    dst, dts, pdst = _filled(*b, seed=13)
    s = sample_stride(src, dst)
    want = digests(src, Span(psrc, 0, *TOKENS, *heads), "sampled", s)
    order = list(range(len(dts)))[::-1]
    prep = prepare(dst, Span(pdst, 0, *TOKENS, *heads), s, order)
    assert prep is not None
    got = prep.digests()
    assert got == digests(dst, Span(pdst, 0, *TOKENS, *heads), "sampled", s, order)
    assert got == [want[i] for i in order] and got.nbytes > 0
    u8 = dts[1].view(-1).view(torch.uint8).view(128, -1)
    u8[pdst[TOKENS[0] // b[0]]] ^= 0xFF  # the first page the range uses
    bad = prep.digests()
    assert bad[order.index(1)] != want[1]
    assert [g for j, g in enumerate(bad) if j != order.index(1)] == [
        want[i] for i in order if i != 1
    ]


@pytest.mark.parametrize("portable", [False, True], ids=["xxh3", "portable"])
def test_full_digest_catches_one_flipped_byte_anywhere(portable: bool) -> None:
    dst, dts, pdst = _filled(16, "NHD", seed=7)
    want = digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "full", portable=portable)
    rng = np.random.default_rng(0)
    u8 = dts[1].view(-1).view(torch.uint8).view(128, -1)
    for _ in range(50):
        i = int(rng.integers(0, len(pdst)))
        lo = max(0, TOKENS[0] - i * 16) if i == 0 else 0
        hi = min(16, TOKENS[1] - i * 16)
        tok = int(rng.integers(lo, hi))
        off = tok * dst.token_bytes + int(rng.integers(0, dst.token_bytes))
        u8[pdst[i], off] ^= 1 << int(rng.integers(0, 8))
        assert digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "full", portable=portable)[1] != want[1]
        want = digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "full", portable=portable)


@pytest.mark.parametrize("portable", [False, True], ids=["xxh3", "portable"])
def test_off_digests_nothing(portable: bool) -> None:
    dst, ts, pdst = _filled(16, seed=8)
    assert digests(dst, Span(pdst, 0, *TOKENS, 0, 8), "off", portable=portable) == []


def test_portable_digest_is_the_same_whether_memory_is_word_aligned_or_not() -> None:
    """One side may hold a pool at an address that is not 8-byte aligned: it gathers bytes
    and joins them into the same words, so both sides still agree."""
    spec, ts, pages = _filled(16, seed=9)
    span = Span(pages, 0, *TOKENS, 0, 8)
    want = {m: digests(spec, span, m, 16, portable=True) for m in ("sampled", "full")}
    # the same bytes, one byte further into a larger host allocation
    raw = [torch.zeros(t.numel() * t.element_size() + 1, dtype=torch.uint8) for t in ts]
    for r, t in zip(raw, ts):
        r[1:] = t.reshape(-1).view(torch.uint8)
    bufs = tuple(
        msgspec.structs.replace(b, addr=r.data_ptr() + 1) for b, r in zip(spec.buffers, raw)
    )
    odd = msgspec.structs.replace(spec, buffers=bufs)
    for m in ("sampled", "full"):
        assert digests(odd, span, m, 16, portable=True) == want[m], m


def test_portable_and_xxh3_digests_are_different_functions_of_the_same_bytes() -> None:
    """The two sides must pick the same function (``integrity.portable``): a host-only pair
    uses XXH3, a pair with a device pool the portable digest."""
    spec, ts, pages = _filled(16, seed=10)
    span = Span(pages, 0, *TOKENS, 0, 8)
    assert digests(spec, span, "sampled", 16) != digests(spec, span, "sampled", 16, portable=True)
    dev = msgspec.structs.replace(spec, location="cuda:0")
    assert portable(spec, dev) and portable(dev, spec) and not portable(spec, spec)
    assert supported("cuda:3") and supported("cpu") and not supported("npu:0")
    with pytest.raises(IntegrityUnsupported):
        digests(msgspec.structs.replace(spec, location="npu:0"), span, "sampled", 16, portable=True)


@pytest.mark.parametrize("portable_", [False, True], ids=["xxh3", "portable"])
def test_slot_digest_changes_with_any_byte_of_the_row(portable_: bool) -> None:
    g = PoolGeom("aux", "slots", layers=2, pages=16, dim=6, dtype="int32")  # 24-byte rows
    specs, tensors = pat.build([g])
    spec, ts = specs[0], tensors["aux"]
    for i, t in enumerate(ts):
        t.copy_(torch.arange(t.numel(), dtype=torch.int32).view_as(t) * (i + 3))
    want = slot_digests(spec, 5, "full", portable=portable_)
    assert len(set(want)) == len(want)
    assert slot_digests(spec, 6, "full", portable=portable_) != want
    u8 = ts[1].view(torch.uint8).view(16, -1)
    for off in range(u8.shape[1]):
        u8[5, off] ^= 0x10
        got = slot_digests(spec, 5, "full", portable=portable_)
        u8[5, off] ^= 0x10
        assert got[0] == want[0] and got[1] != want[1], off


GOLDEN_FULL = {
    (16, "NHD", 8, 0): [
        220383978460132820,
        5550844213741517227,
        97472494252136772,
        7468083472054760906,
    ],
    (4, "HND", 8, 0): [
        220383978460132820,
        5550844213741517227,
        97472494252136772,
        7468083472054760906,
    ],
    (16, "HND", 4, 2): [
        364552564673622122,
        5337609156932799269,
        1771317425649639457,
        5152158755802720397,
    ],
}
GOLDEN_BYTES = [7007303558894192594, 6858577253974152768, 642633986856136722, 65310315313490175]


def test_the_full_portable_digest_keeps_its_values_since_its_index_moved_to_the_device() -> None:
    """The full portable digest expands its word (or byte) index on the pool's device from
    one offset per unit; it once built that index on the host and copied it over. Both
    sides must agree across releases: these are the values the host-built index gave."""
    for (ps, lay, heads, first), want in GOLDEN_FULL.items():
        spec, _, pages = _filled(ps, lay, heads, first, seed=3)
        span = Span(pages, 0, *TOKENS, first, first + heads)
        assert digests(spec, span, "full", ps, portable=True) == want
    g = PoolGeom(
        "kv",
        "mha",
        layers=2,
        pages=64,
        page_size=4,
        heads=3,
        head_dim=3,
        dtype="uint8",
        total_heads=3,
    )  # 3-byte heads: digested byte by byte
    specs, ts = pat.build([g])
    pages = np.arange(0, 64, 2, dtype=np.int64)[:25]
    pat.fill_tokens(specs[0], ts["kv"], 9, pages, 0, *TOKENS)
    assert (
        digests(specs[0], Span(pages, 0, *TOKENS, 0, 3), "full", 4, portable=True) == GOLDEN_BYTES
    )
