"""Pure planning for heterogeneous TP: who asks whom, who writes which heads, and head slices."""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer import plan as P
from pdxfer.agents.patterns import PoolGeom, build
from pdxfer.plan.heads import plan_head_slice
from pdxfer.plan.topology import assign, contacts, decode_peers
from pdxfer.pools import BufferSpec, PoolSpec, Sharding


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "rank", "want", "peers"),
    [
        (1, 1, 0, [0], 1),
        (2, 1, 0, [0, 1], 1),
        (4, 2, 1, [2, 3], 1),
        (4, 1, 0, [0, 1, 2, 3], 1),
        (1, 2, 1, [0], 2),
        (2, 4, 3, [1], 2),
        (2, 4, 2, [1], 2),
        (1, 4, 2, [0], 4),
    ],
)
def test_every_prefill_rank_is_asked_by_exactly_decode_peers_ranks(
    tp_p, tp_d, rank, want, peers
) -> None:
    assert contacts(tp_p, tp_d, rank) == want
    assert decode_peers(tp_p, tp_d) == peers
    asked = [p for d in range(tp_d) for p in contacts(tp_p, tp_d, d)]
    assert sorted(asked) == sorted(list(range(tp_p)) * peers)


def test_tp_sizes_that_do_not_divide_are_refused() -> None:
    assert "not a multiple" in contacts(3, 2, 0)
    assert "not a multiple" in contacts(2, 3, 0)
    assert "bad TP" in contacts(2, 2, 2)


def heads_pool(
    name: str,
    total: int,
    rank_heads: int,
    first: int,
    layout: str = "NHD",
    ps: int = 4,
    hb: int = 8,
) -> PoolSpec:
    item = ps * rank_heads * hb
    return PoolSpec(
        name,
        "paged",
        (BufferSpec(1 << 20, item * 8, 0, "k"),),
        item,
        8,
        page_size=ps,
        sharding=Sharding.heads(total, rank_heads, first, hb, layout),
    )


def mla_pool(name: str = "mla") -> PoolSpec:
    return PoolSpec(name, "paged", (BufferSpec(1 << 30, 64 * 8, 0, "latent"),), 64, 8, page_size=4)


def shard(total: int, tp: int, r: int) -> tuple[int, int]:
    """(rank_heads, first_head) of rank r: contiguous split, or replication below tp."""
    return (total // tp, r * total // tp) if total >= tp else (1, r * total // tp)


@pytest.mark.parametrize(
    ("total", "tp_p", "tp_d"),
    [
        (4, 2, 1),
        (4, 1, 2),
        (4, 4, 2),
        (4, 2, 4),
        (4, 4, 1),
        (2, 4, 1),
        (2, 4, 2),
        (2, 1, 4),
        (2, 2, 4),
        (8, 4, 4),
    ],
)
def test_each_decode_head_is_written_by_exactly_one_prefill_rank(total, tp_p, tp_d) -> None:
    for d in range(tp_d):
        rh, fh = shard(total, tp_d, d)
        mine = {"kv": heads_pool("kv", total, rh, fh), "mla": mla_pool()}
        ranks = contacts(tp_p, tp_d, d)
        peers = [
            (0, {"kv": heads_pool("kv", total, *shard(total, tp_p, p)), "mla": mla_pool()})
            for p in ranks
        ]
        plan = assign(mine, peers)
        assert not isinstance(plan, str), plan
        written = [h for a in plan for h in range(*a.heads.get("kv", (0, 0)))]
        assert sorted(written) == list(range(fh, fh + rh))
        assert sum("mla" not in a.skip for a in plan) == 1
        for a in plan:  # a rank with neither heads nor the latent to write is silent
            assert a.silent == ("kv" not in a.heads and "mla" in a.skip)


def test_mla_two_to_one_leaves_the_second_rank_silent() -> None:
    plan = assign({"mla": mla_pool()}, [(0, {"mla": mla_pool()}), (0, {"mla": mla_pool()})])
    assert not isinstance(plan, str)
    assert [a.silent for a in plan] == [False, True]
    assert plan[1].skip == ("mla",)


def test_each_pipeline_stage_writes_its_own_layers() -> None:
    plan = assign({"mla": mla_pool()}, [(0, {"mla": mla_pool()}), (1, {"mla": mla_pool()})])
    assert not isinstance(plan, str)
    assert [a.silent for a in plan] == [False, False]


def test_heads_no_asked_rank_holds_are_an_error() -> None:
    mine = {"kv": heads_pool("kv", 4, 4, 0)}
    plan = assign(mine, [(0, {"kv": heads_pool("kv", 4, 2, 0)})])
    assert isinstance(plan, str) and "[2, 4)" in plan


def _pair(
    total: int, s: tuple[int, int], d: tuple[int, int], layout: str, ps_s: int = 4, ps_d: int = 4
) -> P.BufferPairing:
    pr = P.pair_buffers(
        heads_pool("kv", total, *s, layout, ps_s), heads_pool("kv", total, *d, layout, ps_d)
    )
    assert not isinstance(pr, str)
    return pr


def test_hnd_head_slice_is_one_block_per_page() -> None:
    # prefill holds heads [2, 4), decode all 4: each page's slice lands at head 2 of the page
    pr = _pair(4, (2, 2), (4, 0), "HND")
    b = plan_head_slice(pr, np.array([3, 4]), 0, np.array([6, 1]), 0, 0, 8, 2, 4)
    assert not isinstance(b, str)
    item_s, item_d = 4 * 2 * 8, 4 * 4 * 8
    assert b.src.tolist() == [(1 << 20) + 3 * item_s, (1 << 20) + 4 * item_s]
    assert b.dst.tolist() == [(1 << 20) + 6 * item_d + 2 * 4 * 8, (1 << 20) + item_d + 64]
    assert b.nbytes.tolist() == [64, 64]


def test_nhd_head_slice_is_one_block_per_token() -> None:
    # prefill holds all 4 heads, decode heads [1, 2): token t of page p at p*4+t, offset 1 head
    pr = _pair(4, (4, 0), (1, 1), "NHD")
    b = plan_head_slice(pr, np.array([2]), 0, np.array([5]), 0, 0, 3, 1, 2)
    assert not isinstance(b, str)
    assert b.src.tolist() == [(1 << 20) + (8 + t) * 32 + 8 for t in range(3)]
    assert b.dst.tolist() == [(1 << 20) + (20 + t) * 8 for t in range(3)]
    assert b.nbytes.tolist() == [8, 8, 8]


def test_head_range_outside_either_side_is_refused() -> None:
    pr = _pair(4, (2, 2), (2, 0), "HND")
    b = plan_head_slice(pr, np.array([0]), 0, np.array([0]), 0, 0, 4, 2, 4)
    assert isinstance(b, str) and "decode heads [0, 2)" in b


def test_patterns_build_head_pools_that_pair() -> None:
    specs, _ = build([PoolGeom("kv", "mha", heads=1, total_heads=2, first_head=1, pages=2)])
    assert specs[0].sharding.first_head == 1


def test_asking_for_every_head_of_the_same_shard_is_a_whole_page_plan() -> None:
    # The decode names the head range of every sharded pool; when it is the whole shard both
    # sides hold, the sender must take the whole-page path (no slicing, no staging, and no
    # per-block bounds check on the hot path), and only then.
    from pdxfer.plan.chunk import heads_to_write as _heads

    same = _pair(4, (2, 2), (2, 2), "HND")
    assert _heads(same, (2, 4)) is None
    assert _heads(same, None) is None
    assert _heads(same, (2, 3)) == (2, 3)
    wider = _pair(4, (2, 2), (4, 0), "HND")
    assert _heads(wider, (2, 4)) == (2, 4)
    assert _heads(wider, None) == (2, 4)
