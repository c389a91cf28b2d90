"""Planning with numbers: page-size pairs, coalescing, bounds. No processes, no transport."""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer import plan as P
from pdxfer.pools import BufferSpec, PoolSpec, Sharding

TB = 32  # bytes per token


def pool(
    name: str = "kv",
    page_size: int = 16,
    pages: int = 64,
    layers: int = 2,
    base: int = 1 << 20,
    gap: int = 1 << 20,
    layout: str = "NHD",
) -> PoolSpec:
    item = page_size * TB
    bufs = tuple(
        BufferSpec(
            base + i * gap,
            pages * item,
            i // 2 if i % 2 == 0 else i // 2,
            "k" if i % 2 == 0 else "v",
        )
        for i in range(2 * layers)
    )
    return PoolSpec(
        name=name,
        kind="paged",
        buffers=bufs,
        item_bytes=item,
        num_items=pages,
        page_size=page_size,
        dtype="float16",
        sharding=Sharding.heads(2, 2, 0, TB // 2, layout),
        page_remap=True,
    )


def pair(src: PoolSpec, dst: PoolSpec) -> P.BufferPairing:
    pr = P.pair_buffers(src, dst)
    assert not isinstance(pr, str), pr
    return pr


def moved(blocks: P.Blocks, src: PoolSpec, dst: PoolSpec) -> dict[int, int]:
    """Simulate the plan on the first buffer: which source token slot lands in which dst slot."""
    sb, db = src.buffers[0].addr, dst.buffers[0].addr
    out: dict[int, int] = {}
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.nbytes.tolist()):
        if not (sb <= s < sb + src.buffers[0].nbytes):
            continue
        assert n % TB == 0
        for k in range(n // TB):
            out[(d - db) // TB + k] = (s - sb) // TB + k
    return out


def expected(src_pages, ps_s, dst_pages, ps_d, start, end, src_first=0, dst_first=0):
    out = {}
    for t in range(start, end):
        s = src_pages[(t - src_first) // ps_s] * ps_s + (t - src_first) % ps_s
        d = dst_pages[(t - dst_first) // ps_d] * ps_d + (t - dst_first) % ps_d
        out[d] = s
    return out


@pytest.mark.parametrize("ps_s,ps_d", [(16, 16), (64, 1), (1, 64), (16, 64), (64, 16), (16, 4)])
def test_every_token_lands_in_its_slot_for_any_page_size_pair(ps_s: int, ps_d: int) -> None:
    n_tokens = 200
    rng = np.random.default_rng(ps_s * 100 + ps_d)
    src, dst = (
        pool(page_size=ps_s, pages=4096 // ps_s),
        pool(page_size=ps_d, pages=4096 // ps_d, base=1 << 30),
    )
    sp = rng.permutation(src.num_items)[: -(-n_tokens // ps_s)]
    dp = rng.permutation(dst.num_items)[: -(-n_tokens // ps_d)]
    b = P.plan_paged(pair(src, dst), sp, 0, dp, 0, 0, n_tokens)
    assert not isinstance(b, str), b
    got = moved(b, src, dst)
    want = expected(sp, ps_s, dp, ps_d, 0, n_tokens)
    if ps_s == ps_d:  # whole pages: every wanted token is there, plus the tail of the last page
        assert all(got[d] == s for d, s in want.items())
    else:
        assert got == want


def test_contiguous_pages_coalesce_into_one_block_per_buffer() -> None:
    src, dst = pool(), pool(base=1 << 30)
    b = P.plan_paged(pair(src, dst), np.arange(10, 20), 0, np.arange(30, 40), 0, 0, 160)
    assert not isinstance(b, str)
    assert len(b) == 4  # 2 layers x K,V
    assert set(b.nbytes.tolist()) == {10 * 16 * TB}


def test_coalescing_leaves_one_block_per_contiguous_run() -> None:
    src, dst = pool(), pool(base=1 << 30)
    sp = np.array([1, 2, 3, 7, 8, 20, 21, 22])
    dp = np.array([5, 6, 7, 8, 9, 40, 41, 50])
    # runs where both continue: (1,5)(2,6)(3,7) | (7,8)(8,9) | (20,40)(21,41) | (22,50)
    b = P.plan_paged(pair(src, dst), sp, 0, dp, 0, 0, 8 * 16)
    assert not isinstance(b, str)
    assert len(b) == 4 * 4


def test_token_remap_merges_runs_across_pages_when_host_slots_are_contiguous() -> None:
    src, dst = pool(page_size=64, pages=16), pool(page_size=1, pages=4096, base=1 << 30)
    sp = np.array([3, 4])  # contiguous source pages
    dp = np.arange(1000, 1128)  # contiguous host token slots
    b = P.plan_paged(pair(src, dst), sp, 0, dp, 0, 0, 128)
    assert not isinstance(b, str)
    assert len(b) == 4 and set(b.nbytes.tolist()) == {128 * TB}


def test_prefix_is_skipped_and_destination_starts_at_prefix() -> None:
    src, dst = pool(), pool(base=1 << 30)
    sp = np.arange(0, 8)  # chunk covering tokens 0..128
    dp = np.array([50, 51, 52, 53])  # decode holds 0..64, asks for 64..128
    b = P.plan_paged(pair(src, dst), sp, 0, dp, 64, 64, 128)
    assert not isinstance(b, str)
    got = moved(b, src, dst)
    assert got == expected(sp, 16, dp, 16, 64, 128, 0, 64)


def test_chunk_offsets_map_positions_not_list_positions() -> None:
    src, dst = pool(), pool(base=1 << 30)
    dp = np.arange(40, 48)  # request tokens 0..128
    b = P.plan_paged(pair(src, dst), np.array([9, 4]), 64, dp, 0, 64, 96)  # 2nd chunk
    assert not isinstance(b, str)
    assert moved(b, src, dst) == expected([9, 4], 16, dp, 16, 64, 96, 64, 0)


def test_out_of_range_destination_page_is_an_error_not_a_write() -> None:
    src, dst = pool(), pool(base=1 << 30)
    why = P.plan_paged(pair(src, dst), np.arange(4), 0, np.array([1, 2, 3, 64]), 0, 0, 64)
    assert isinstance(why, str) and "out of range" in why
    why = P.plan_paged(pair(src, dst), np.arange(4), 0, np.array([1, -2, 3, 4]), 0, 0, 64)
    assert isinstance(why, str) and "out of range" in why


def test_too_few_indices_is_an_error() -> None:
    src, dst = pool(), pool(base=1 << 30)
    why = P.plan_paged(pair(src, dst), np.arange(4), 0, np.arange(2), 0, 0, 64)
    assert isinstance(why, str) and "cover" in why


def test_check_bounds_catches_a_block_past_a_buffer_end() -> None:
    regions = [(1000, 100), (5000, 100)]
    ok = P.Blocks(
        np.array([1000, 5050], dtype=np.uint64),
        np.zeros(2, dtype=np.uint64),
        np.array([100, 50], dtype=np.uint64),
    )
    assert P.check_bounds(ok, regions, "src") is None
    bad = P.Blocks(
        np.array([1050], dtype=np.uint64),
        np.zeros(1, dtype=np.uint64),
        np.array([51], dtype=np.uint64),
    )
    assert "outside" in (P.check_bounds(bad, regions, "src") or "")
    below = P.Blocks(
        np.array([999], dtype=np.uint64),
        np.zeros(1, dtype=np.uint64),
        np.array([1], dtype=np.uint64),
    )
    assert "outside" in (P.check_bounds(below, regions, "src") or "")


def test_batches_never_exceed_the_transport_limit() -> None:
    n = 5000
    b = P.Blocks(
        np.arange(n, dtype=np.uint64), np.arange(n, dtype=np.uint64), np.ones(n, dtype=np.uint64)
    )
    sizes = [len(x) for x in b.batches()]
    assert max(sizes) <= 1024 and sum(sizes) == n


def test_slot_plan_copies_one_row_per_buffer_and_checks_range() -> None:
    rows = tuple(BufferSpec(1 << 20 | (i << 16), 8 * 64, i, f"row{i}") for i in range(3))
    s = PoolSpec(name="aux", kind="slot", buffers=rows, item_bytes=64, num_items=8)
    d = s.with_(
        buffers=tuple(BufferSpec(b.addr + (1 << 30), b.nbytes, b.layer_id, b.role) for b in rows)
    )
    b = P.plan_slots(pair(s, d), 2, 5)
    assert not isinstance(b, str)
    assert len(b) == 3
    assert (b.src - np.array([r.addr for r in rows], dtype=np.uint64) == 128).all()
    assert isinstance(P.plan_slots(pair(s, d), 2, 8), str)


def test_pipeline_stage_pairs_only_its_layers() -> None:
    full = pool(layers=4, base=1 << 30)
    stage = PoolSpec(
        name="kv",
        kind="paged",
        buffers=tuple(b for b in pool(layers=4).buffers if b.layer_id >= 2),
        item_bytes=16 * TB,
        num_items=64,
        page_size=16,
        dtype="float16",
        sharding=Sharding.heads(2, 2, 0, TB // 2),
    )
    pr = pair(stage, full)
    assert len(pr) == 4
    assert isinstance(P.pair_buffers(full, stage), str)


def test_hnd_layout_with_different_page_sizes_is_refused() -> None:
    src = pool(layout="HND")
    dst = pool(page_size=1, pages=1024, base=1 << 30)
    why = P.plan_paged(pair(src, dst), np.arange(4), 0, np.arange(64), 0, 0, 64)
    assert isinstance(why, str) and "token-major" in why


def test_few_page_plan_equals_the_vectorised_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small plans are built from Python lists; they must be block for block the numpy plan,
    including merged runs, a partial last page and refused out-of-range indices."""
    src, dst = pool(pages=64), pool(pages=80, base=1 << 30)
    pr = pair(src, dst)
    rng = np.random.default_rng(3)
    cases = [(np.array([1, 2, 3, 9]), np.array([5, 6, 7, 8]), 60)]
    for _ in range(300):
        n = int(rng.integers(1, P.FEW_PAGES + 1))
        sp = rng.choice(64, n, replace=False)
        dp = rng.choice(80, n, replace=False)
        if rng.random() < 0.5:  # contiguous stretches on both sides
            sp = np.sort(sp)
            dp = np.arange(n) + int(rng.integers(0, 80 - n + 1))
        cases.append((sp, dp, n * 16 - int(rng.integers(0, 16))))
    cases.append((np.array([1, 64]), np.array([1, 2]), 32))
    cases.append((np.array([1, 2]), np.array([-1, 2]), 32))
    for sp, dp, end in cases:
        few = P.plan_paged(pr, sp, 0, dp, 0, 0, end)
        monkeypatch.setattr(P, "FEW_PAGES", -1)
        vec = P.plan_paged(pr, sp, 0, dp, 0, 0, end)
        monkeypatch.setattr(P, "FEW_PAGES", 32)
        if isinstance(vec, str):
            assert few == vec
            continue
        assert isinstance(few, P.Blocks) and len(few) == len(vec)
        for a, b in ((few.src, vec.src), (few.dst, vec.dst), (few.nbytes, vec.nbytes)):
            assert a.dtype == np.uint64 and (a == b).all()
        assert few.total_bytes == vec.total_bytes
    merged = P.plan_paged(pr, cases[0][0], 0, cases[0][1], 0, 0, 60)
    assert len(merged) == 2 * len(src.buffers)  # pages 1-3 -> 5-7 merge; 9 -> 8 stands alone
