"""A Mamba / Gated DeltaNet state slot moved between different TP sizes, piece by piece.

Every element of a model's state is numbered by what it is globally (sub-block, channel or
head, row), and each rank's page is built from those numbers as the engine lays it out for
its own share (x | B | C per rank, a single B/C group replicated on every rank, SD or DS conv
layout, padding after the state). The planned blocks are then carried out byte for byte in a
simulated address space: each decode rank's page must equal the page it would have computed
itself, every byte written once, its padding untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer.plan import pair_buffers
from pdxfer.plan.pieces import plan_pieces, ranges_error
from pdxfer.plan.topology import assign, contacts
from pdxfer.pools import BufferSpec, PoolSpec, Sharding, check_pair

from .state_pages import GDN, MAMBA2, SENTINEL, page, state_pieces

SLOTS = 4
LAYERS = (3, 7)
SPACE = 1 << 20
"""Bytes of one rank's simulated address space (buffers at ``rank * SPACE`` on)."""


def rank_pool(model: dict, tp: int, r: int, mem: bytearray) -> PoolSpec:
    """Rank ``r``'s state pool over its page bytes in ``mem`` (``SLOTS`` slots per layer)."""
    item = len(page(model, tp, r, 0, 0)[0])
    bufs = []
    for j, layer in enumerate(LAYERS):
        base = r * SPACE + j * item * SLOTS
        for s in range(SLOTS):
            mem[base + s * item : base + (s + 1) * item] = page(model, tp, r, layer, s)[0]
        bufs.append(BufferSpec(base, item * SLOTS, layer, "state"))
    return PoolSpec(
        "kv1",
        "slot",
        tuple(bufs),
        item,
        SLOTS,
        sharding=Sharding.sliced(state_pieces(model, tp, r)),
    )


def move(model: dict, tp_p: int, tp_d: int, sslot: int = 1, dslot: int = 2) -> None:
    src_mem = bytearray(SPACE * tp_p)
    dst_mem = bytearray(SPACE * tp_d)
    srcs = [rank_pool(model, tp_p, r, src_mem) for r in range(tp_p)]
    dsts = [rank_pool(model, tp_d, d, dst_mem) for d in range(tp_d)]
    dst_mem[:] = bytes([SENTINEL]) * len(dst_mem)
    for d, dst in enumerate(dsts):
        asked = contacts(tp_p, tp_d, d)
        assert not isinstance(asked, str)
        plan = assign({"kv1": dst}, [(0, {"kv1": srcs[p]}) for p in asked])
        assert not isinstance(plan, str), plan
        written = np.zeros(len(dst_mem), dtype=np.int32)
        for p, a in zip(asked, plan):
            if "kv1" in a.skip:
                continue
            assert check_pair(srcs[p], dst) is None
            pr = pair_buffers(srcs[p], dst)
            assert not isinstance(pr, str)
            blocks = plan_pieces(pr, sslot, dslot, a.pieces.get("kv1"))
            assert not isinstance(blocks, str), blocks
            for s, t, n in zip(*blocks.lists()):
                dst_mem[t : t + n] = src_mem[s : s + n]
                written[t : t + n] += 1
        item = dst.item_bytes
        for j, layer in enumerate(LAYERS):
            want = page(model, tp_d, d, layer, sslot)[0]
            at = dst.buffers[j].addr + dslot * item
            got = bytes(dst_mem[at : at + item])
            assert got == want, (d, layer, first_diff(got, want))
        assert written.max() == 1  # every byte once: a replicated group is written by one rank
        state_bytes = sum(p.width * p.rows for p in dst.sharding.pieces) * len(LAYERS)
        assert int(written.sum()) == state_bytes  # the state, never the padding


def first_diff(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
@pytest.mark.parametrize("ds", [True, False], ids=["DS", "SD"])
@pytest.mark.parametrize("groups", [1, 4], ids=["one-group", "four-groups"])
def test_mamba2_state_lands_as_the_decode_rank_would_hold_it(tp_p, tp_d, ds, groups) -> None:
    move({**MAMBA2, "ds": ds, "g": groups}, tp_p, tp_d)


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("ds", [True, False], ids=["DS", "SD"])
def test_gated_deltanet_state_lands_q_k_v_each_split_on_its_own(tp_p, tp_d, ds) -> None:
    move({**GDN, "ds": ds}, tp_p, tp_d)


def test_equal_tp_sizes_copy_the_whole_slot_in_one_block_per_layer() -> None:
    mem = bytearray(SPACE * 2)
    model = {**MAMBA2, "ds": False, "g": 1}
    a, b = rank_pool(model, 2, 1, mem), rank_pool(model, 2, 1, mem)
    blocks = plan_pieces(pair_buffers(a, b), 0, 3)  # type: ignore[arg-type]
    assert not isinstance(blocks, str)
    assert blocks.lists()[2] == [a.item_bytes] * len(LAYERS)


def test_ranges_outside_what_both_sides_hold_are_refused() -> None:
    mem = bytearray(SPACE * 2)
    model = {**MAMBA2, "ds": True, "g": 2}
    p1 = rank_pool(model, 2, 1, mem)
    d0 = rank_pool(model, 2, 0, bytearray(SPACE * 2))
    full = rank_pool(model, 1, 0, bytearray(SPACE))
    # prefill rank 1 holds x heads [2, 4): decode rank 0 of TP 2 holds [0, 2)
    assert "not within" in (ranges_error(p1, d0, ((2, 4), (1, 2), (1, 2), (2, 4))) or "")
    assert "pieces" in (ranges_error(p1, full, ((0, 1),)) or "")
    assert ranges_error(p1, full, ((2, 4), (1, 2), (1, 2), (2, 4))) is None
    assert "out of range" in plan_pieces(pair_buffers(p1, full), SLOTS, 0)  # type: ignore[arg-type,operator]


def test_pieces_that_differ_in_units_refuse_the_pair_naming_both() -> None:
    a = rank_pool({**MAMBA2, "ds": True, "g": 2}, 1, 0, bytearray(SPACE))
    b = rank_pool({**MAMBA2, "ds": True, "g": 1}, 1, 0, bytearray(SPACE))
    why = check_pair(a, b) or ""
    assert "pieces" in why and "prefill" in why and "decode" in why


def test_a_whole_slot_does_not_pair_with_a_sliced_one() -> None:
    a = rank_pool({**MAMBA2, "ds": True, "g": 2}, 1, 0, bytearray(SPACE))
    whole = a.with_(sharding=Sharding())
    assert "pieces" in (check_pair(a, whole) or "")
    assert "pieces" in (check_pair(whole, a) or "")
