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

from pdxfer.integrations.vllm.state import pieces, splits
from pdxfer.plan import pair_buffers
from pdxfer.plan.pieces import plan_pieces, ranges_error
from pdxfer.plan.topology import assign, contacts
from pdxfer.pools import BufferSpec, PoolSpec, Sharding, check_pair

SENTINEL = 0xA5
SLOTS = 4
LAYERS = (3, 7)
SPACE = 1 << 20
"""Bytes of one rank's simulated address space (buffers at ``rank * SPACE`` on)."""


def _m2_channels(h: int, hd: int, g: int, n: int, tp: int, r: int) -> list[int]:
    """The global conv channels of Mamba2 rank ``r``: its x heads, then its B and C groups
    (one group replicated on every rank when TP does not divide the group count)."""
    x = list(range(r * h * hd // tp, (r + 1) * h * hd // tp))
    gs = range(r * g // tp, (r + 1) * g // tp) if g % tp == 0 else range(g)
    b = [10_000 + k * n + j for k in gs for j in range(n)]
    return x + b + [20_000 + c - 10_000 for c in b]


def _gdn_channels(kh: int, kd: int, vh: int, vd: int, tp: int, r: int) -> list[int]:
    q = list(range(r * kh * kd // tp, (r + 1) * kh * kd // tp))
    return (
        q
        + [10_000 + c for c in q]
        + list(range(20_000 + r * vh * vd // tp, 20_000 + (r + 1) * vh * vd // tp))
    )


def page(model: dict, tp: int, r: int, layer: int, slot: int) -> tuple[bytes, int, list[int]]:
    """One rank's page for one (layer, slot): the conv state then the temporal state, as the
    engine computes them, plus the shapes it reports and the page's padded size."""
    kind, ds, length = model["kind"], model["ds"], model["rows"]
    if kind == "MAMBA2":
        h, hd, g, n = model["h"], model["hd"], model["g"], model["n"]
        ch = _m2_channels(h, hd, g, n, tp, r)
        heads, inner = range(r * h // tp, (r + 1) * h // tp), hd * n
        shapes = [(len(ch), length) if ds else (length, len(ch)), (h // tp, hd, n)]
    else:
        kh, kd, vh, vd = model["kh"], model["kd"], model["vh"], model["vd"]
        ch = _gdn_channels(kh, kd, vh, vd, tp, r)
        heads, inner = range(r * vh // tp, (r + 1) * vh // tp), vd * kd
        shapes = [(len(ch), length) if ds else (length, len(ch)), (vh // tp, vd, kd)]
    tag = (layer * 7 + slot) << 24
    conv = np.array([[tag + c * 16 + k for k in range(length)] for c in ch], dtype=np.int32)
    conv = conv if ds else conv.T.copy()
    temporal = np.array(
        [[tag + (1 << 23) + hh * 4096 + i for i in range(inner)] for hh in heads], dtype=np.int32
    )
    body = conv.tobytes() + temporal.tobytes()
    padded = -(-len(body) // 256) * 256 + 64 * tp  # pages differ in size and padding per TP
    return body + bytes([SENTINEL]) * (padded - len(body)), len(conv.tobytes()), shapes


def rank_pool(model: dict, tp: int, r: int, mem: bytearray) -> PoolSpec:
    """Rank ``r``'s state pool over its page bytes in ``mem`` (``SLOTS`` slots per layer)."""
    body, conv_bytes, shapes = page(model, tp, r, 0, 0)
    item = len(body)
    split = splits(
        model["kind"], shapes, [4, 4], conv_ds=model["ds"], tp_size=tp, n_groups=model.get("g")
    )
    assert not isinstance(split, str), split
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
        sharding=Sharding.sliced(pieces(split, [0, conv_bytes], r, tp)),
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


MAMBA2 = {"kind": "MAMBA2", "h": 4, "hd": 2, "n": 3, "rows": 3}
GDN = {"kind": "GDN_ATTN", "kh": 2, "kd": 3, "vh": 4, "vd": 2, "rows": 3}


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
