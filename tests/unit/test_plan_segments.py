"""Pages of different sizes whose interior is packed (``PageSegment``): vLLM's CPU tiles put
a head's keys dimension-major and pack 16 or 2 tokens per unit. Planned with numbers and
applied to real bytes: every token's bytes land where the destination's own packing puts
them. No processes, no transport."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdxfer import plan as P
from pdxfer.pools import BufferSpec, PageSegment, PoolSpec, Sharding, check_pair

HEADS, DIM, ELT = 2, 8, 4
VEC = (PageSegment(DIM, 1, ELT), PageSegment(1, 1, DIM * ELT))
"""vLLM's ``vec`` tile of one head: keys ``[dim, tokens]``, values ``[tokens, dim]``."""
AMX = (PageSegment(1, 16, 16 * DIM * 2), PageSegment(DIM // 4, 2, 2 * 4 * 2))
"""``amx``-like (bf16): keys in 16-token units, values in 4-dim columns of token pairs."""
HEAD_BYTES = 2 * DIM * ELT


def pool(
    ps: int,
    segs: tuple[PageSegment, ...] | None,
    pages: int,
    base: int,
    head_bytes: int = HEAD_BYTES,
) -> PoolSpec:
    item = HEADS * ps * head_bytes
    return PoolSpec(
        name="kv",
        kind="paged",
        buffers=(
            BufferSpec(base, pages * item, 0, "kv"),
            BufferSpec(base + (1 << 24), pages * item, 1, "kv"),
        ),
        item_bytes=item,
        num_items=pages,
        page_size=ps,
        dtype="float32",
        sharding=Sharding.heads(HEADS, HEADS, 0, head_bytes, "HND"),
        page_remap=True,
        segments=segs,
    )


def where(p: PoolSpec, page: int, t: int, h: int) -> list[tuple[int, int]]:
    """Byte ranges (offset, length) holding token ``t`` (within its page) of head ``h``:
    one per row, the unit holding it (a whole unit per token group)."""
    out = []
    off = page * p.item_bytes + h * p.page_size * p.sharding.head_bytes
    for g in p.page_segments or ():
        step = p.page_size // g.tokens * g.nbytes
        for r in range(g.rows):
            out.append((off + r * step + (t // g.tokens) * g.nbytes, g.nbytes))
        off += g.rows * step
    return out


class Mem:
    """Two pools' buffers as real memory, written by applying a plan's blocks."""

    def __init__(self, src: PoolSpec, dst: PoolSpec) -> None:
        self.bufs = {}
        for p in (src, dst):
            for b in p.buffers:
                arr = np.zeros(b.nbytes, dtype=np.uint8)
                self.bufs[b.addr] = arr
        self.src, self.dst = src, dst
        rng = np.random.default_rng(7)
        for b in src.buffers:
            self.bufs[b.addr][:] = rng.integers(1, 255, b.nbytes, dtype=np.uint8)

    def at(self, addr: int) -> tuple[np.ndarray, int]:
        for base, arr in self.bufs.items():
            if base <= addr < base + arr.size:
                return arr, addr - base
        raise AssertionError(f"address {addr:#x} outside every buffer")

    def apply(self, blocks: P.Blocks) -> None:
        for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.nbytes.tolist()):
            sa, so = self.at(s)
            da, do = self.at(d)
            assert so + n <= sa.size and do + n <= da.size
            da[do : do + n] = sa[so : so + n]

    def token(self, p: PoolSpec, buf: int, pages: np.ndarray, first: int, t: int, h: int) -> bytes:
        arr = self.bufs[p.buffers[buf].addr]
        rel = t - first
        page, within = int(pages[rel // p.page_size]), rel % p.page_size
        return b"".join(arr[o : o + n].tobytes() for o, n in where(p, page, within, h))


@pytest.mark.parametrize("segs", [VEC, AMX, None], ids=["vec", "amx", "hnd"])
@pytest.mark.parametrize("ps_s,ps_d", [(32, 64), (64, 32), (32, 32), (16, 64)])
def test_every_tokens_packed_units_land_where_the_decodes_packing_puts_them(
    segs: tuple[PageSegment, ...] | None, ps_s: int, ps_d: int
) -> None:
    hb = HEAD_BYTES if segs is not AMX else 2 * DIM * 2
    src = pool(ps_s, segs, 4096 // ps_s, 1 << 30, hb)
    dst = pool(ps_d, segs, 4096 // ps_d, 1 << 34, hb)
    assert check_pair(src, dst) is None
    rng = np.random.default_rng(ps_s + ps_d)
    n = 333
    sp = rng.permutation(src.num_items)[: -(-n // ps_s)]
    dp = rng.permutation(dst.num_items)[: -(-(n - 64) // ps_d)]
    mem = Mem(src, dst)
    b = P.plan_paged(P.pair_buffers(src, dst), sp, 0, dp, 64, 64, n)  # a prefix of 64 held
    assert not isinstance(b, str), b
    mem.apply(b)
    unit = 16 if segs is AMX else 1
    for buf in range(2):
        for t in range(64, n - n % unit):
            for h in range(HEADS):
                assert mem.token(dst, buf, dp, 64, t, h) == mem.token(src, buf, sp, 0, t, h), (
                    buf,
                    t,
                    h,
                )


def test_a_run_is_one_block_per_lane_and_buffer() -> None:
    src, dst = pool(32, VEC, 64, 1 << 30), pool(64, VEC, 32, 1 << 34)
    b = P.plan_paged(P.pair_buffers(src, dst), np.array([5, 9]), 0, np.array([3]), 0, 0, 64)
    assert not isinstance(b, str)
    lanes = HEADS * (DIM + 1)
    assert len(b) == 2 * lanes * 2  # two source pages, one run each, two buffers


def test_pages_of_another_packing_or_an_opaque_one_are_refused_at_pairing() -> None:
    assert "page interiors differ" in (
        check_pair(pool(32, VEC, 8, 1 << 30), pool(64, None, 8, 1 << 34)) or ""
    )
    why = check_pair(pool(32, (), 8, 1 << 30), pool(64, (), 8, 1 << 34)) or ""
    assert "page_size: prefill 32, decode 64" in why and "opaque" in why
    assert check_pair(pool(32, (), 8, 1 << 30), pool(32, (), 8, 1 << 34)) is None


def test_a_chunk_starting_inside_a_packed_unit_is_refused_not_mangled() -> None:
    src, dst = pool(32, AMX, 64, 1 << 30, 2 * DIM * 2), pool(64, AMX, 32, 1 << 34, 2 * DIM * 2)
    b = P.plan_paged(P.pair_buffers(src, dst), np.arange(4), 0, np.arange(2), 0, 8, 64)
    assert isinstance(b, str) and "unit" in b


def test_unused_freed_pages_outside_the_range_are_not_read() -> None:
    """A sliding window's list names freed blocks as -1 below the tokens any decode reads."""
    src, dst = pool(32, VEC, 64, 1 << 30), pool(64, VEC, 32, 1 << 34)
    b = P.plan_paged(
        P.pair_buffers(src, dst), np.array([-1, -1, 4, 5]), 0, np.array([7]), 64, 64, 128
    )
    assert not isinstance(b, str), b
    bad = P.plan_paged(
        P.pair_buffers(src, dst), np.array([-1, -1, 4, 5]), 0, np.array([6, 7]), 0, 32, 128
    )
    assert isinstance(bad, str) and "out of range" in bad


def _real(
    ps: int, segs: tuple[PageSegment, ...], pages: int, hb: int
) -> tuple[PoolSpec, list[np.ndarray]]:
    """A pool over real memory (numpy buffers, kept alive by the caller)."""
    item = HEADS * ps * hb
    arrs = [np.zeros(pages * item, dtype=np.uint8) for _ in range(2)]
    spec = PoolSpec(
        name="kv",
        kind="paged",
        buffers=tuple(BufferSpec(a.ctypes.data, a.nbytes, i, "kv") for i, a in enumerate(arrs)),
        item_bytes=item,
        num_items=pages,
        page_size=ps,
        dtype="float32",
        sharding=Sharding.heads(HEADS, HEADS, 0, hb, "HND"),
        page_remap=True,
        segments=segs,
    )
    return spec, arrs


@pytest.mark.parametrize("mode", ["full", "sampled"])
@pytest.mark.parametrize("segs", [VEC, AMX], ids=["vec", "amx"])
@pytest.mark.parametrize("ps_s,ps_d", [(32, 64), (64, 32)])
def test_digests_of_a_remapped_range_agree_and_a_wrong_unit_changes_them(
    mode: str, segs: tuple[PageSegment, ...], ps_s: int, ps_d: int
) -> None:
    from pdxfer.integrity import Span, digests, sample_stride

    hb = HEAD_BYTES if segs is VEC else 2 * DIM * 2
    src, sa = _real(ps_s, segs, 512 // ps_s, hb)
    dst, da = _real(ps_d, segs, 512 // ps_d, hb)
    rng = np.random.default_rng(3)
    for a in sa:
        a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    n = 200
    sp = rng.permutation(src.num_items)[: -(-n // ps_s)]
    dp = rng.permutation(dst.num_items)[: -(-n // ps_d)]
    b = P.plan_paged(P.pair_buffers(src, dst), sp, 0, dp, 0, 0, n)
    assert not isinstance(b, str), b
    for s, d, k in zip(b.src.tolist(), b.dst.tolist(), b.nbytes.tolist()):
        ctypes.memmove(d, s, k)
    stride = sample_stride(src, dst)
    want = digests(src, Span(sp, 0, 0, n, 0, HEADS), mode, stride)
    assert digests(dst, Span(dp, 0, 0, n, 0, HEADS), mode, stride) == want
    # a wrong unit: the first lane's unit of the last sampled token (read by both modes)
    t = n - 1
    page, within = int(dp[t // ps_d]), t % ps_d
    off, _ = where(dst, page, within, 0)[0]
    da[1][off] ^= 0xFF
    got = digests(dst, Span(dp, 0, 0, n, 0, HEADS), mode, stride)
    assert got[0] == want[0] and got[1] != want[1]


def test_different_page_sizes_with_different_head_shards_are_refused_at_pairing() -> None:
    """A head slice of a packed tile goes whole: it needs equal page sizes (TP 2 -> 1)."""
    src = pool(32, VEC, 8, 1 << 30).with_(
        sharding=Sharding.heads(2 * HEADS, HEADS, 0, HEAD_BYTES, "HND")
    )
    dst = pool(64, VEC, 8, 1 << 34).with_(
        sharding=Sharding.heads(2 * HEADS, HEADS, HEADS, HEAD_BYTES, "HND")
    )
    why = check_pair(src, dst) or ""
    assert "page_size: prefill 32, decode 64" in why and "heads [0, 2) on the prefill" in why


def test_segments_that_do_not_tile_a_page_are_refused_with_their_values() -> None:
    """A segment whose units do not divide the page is a ValueError naming the segment and
    the page size, not an error from formatting the message."""
    with pytest.raises(ValueError, match=r"segment \(1, 3, 32\) does not tile a page of 32"):
        pool(32, (PageSegment(1, 3, 32),), 8, 1 << 30)
