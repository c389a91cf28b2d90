"""Partial-layer, partial-page chunks planned and applied to real memory, byte by byte.

A room may be sent a few layers at a time, each for the tokens computed so far (``send(...,
layers=, tokens=)``). ``plan.chunk.claim`` keeps each layer's tokens in order (no gap, no
overlap); ``plan_chunk`` on pairings narrowed to the layers (``layer_subset``) writes exactly
those layers' bytes of exactly those tokens: a page a chunk fills in part is written for its
tokens alone, and the next chunk completes it. Checked here by applying the blocks to real
buffers with ``memmove`` and comparing every byte of the destination.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdxfer import plan as P
from pdxfer.plan import chunk as C
from pdxfer.pools import BufferSpec, PoolSpec, Sharding

PS, PAGES, HEADS, HB, LAYERS = 4, 16, 2, 4, 3
ITEM = PS * HEADS * HB
SENTINEL = 0xEE


class Mem:
    """One pool's buffers in real memory (kept alive here), K and V per layer."""

    def __init__(self, name: str, layout: str, seed: int | None) -> None:
        self.arrays = []
        bufs = []
        for i in range(2 * LAYERS):
            a = (
                np.random.default_rng(seed * 100 + i).integers(0, 255, PAGES * ITEM, np.uint8)
                if seed is not None
                else np.full(PAGES * ITEM, SENTINEL, np.uint8)
            )
            self.arrays.append(a)
            bufs.append(BufferSpec(a.ctypes.data, a.nbytes, i // 2, "kv"[i % 2]))
        self.spec = PoolSpec(
            name=name,
            kind="paged",
            buffers=tuple(bufs),
            item_bytes=ITEM,
            num_items=PAGES,
            page_size=PS,
            dtype="uint8",
            sharding=Sharding.heads(HEADS, HEADS, 0, HB, layout),
        )


def token_bytes(layout: str, page: int, off: int) -> np.ndarray:
    """Byte offsets, inside one buffer, of the token at offset ``off`` of ``page``."""
    if layout == "NHD":
        return page * ITEM + off * HEADS * HB + np.arange(HEADS * HB)
    return np.concatenate(
        [page * ITEM + h * PS * HB + off * HB + np.arange(HB) for h in range(HEADS)]
    )


def apply(blocks: P.Blocks) -> None:
    for s, d, n in zip(*blocks.lists()):
        ctypes.memmove(d, s, n)


def expect(
    src: Mem,
    dst: Mem,
    layout: str,
    sp: np.ndarray,
    dp: np.ndarray,
    done: dict[int, int],
    end: int = 0,
) -> list[np.ndarray]:
    """The destination once each layer ``l`` holds tokens ``[0, done[l])``; a layer that
    reached the request's ``end`` got its last page whole (that page is the request's
    own: its tail past ``end`` is the source's, as for any whole-request send)."""
    out = [np.full(PAGES * ITEM, SENTINEL, np.uint8) for _ in dst.arrays]
    for i, b in enumerate(src.spec.buffers):
        upto = done.get(b.layer_id, 0)
        if end and upto == end:
            upto = -(-end // PS) * PS
        for t in range(upto):
            s = token_bytes(layout, int(sp[t // PS]), t % PS)
            d = token_bytes(layout, int(dp[t // PS]), t % PS)
            out[i][d] = src.arrays[i][s]
    return out


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layer_by_layer_token_chunks_land_exactly_and_nothing_else(layout: str) -> None:
    src, dst = Mem("kv", layout, seed=1), Mem("kv", layout, seed=None)
    pairing = P.pair_buffers(src.spec, dst.spec)
    assert not isinstance(pairing, str)
    n = 13  # the last page is partly used
    rng = np.random.default_rng(3)
    sp, dp = rng.permutation(PAGES)[:4], rng.permutation(PAGES)[:4]
    layers_of = C.pool_layers({"kv": src.spec})
    cursors: dict[str, C.Cursor] = {}
    done: dict[int, int] = {}
    steps = [(0, 5), (5, 11), (11, 13)]  # tokens each prefill step computed
    for t0, t1 in steps:
        for layer in range(LAYERS):
            pages = {"kv": sp[t0 // PS : -(-t1 // PS)]}
            c = C.claim(7, pages, {"kv": PS}, layers_of, cursors, (layer, layer + 1), (t0, t1))
            assert not isinstance(c, str), c
            cursors.update(c.cursors)
            ask = C.Ask(7, 0, n, {"kv": dp}, {})
            subset = {"kv": P.layer_subset(pairing, layer, layer + 1)}
            cursor = {"kv": C.low(cursors["kv"])}
            b = C.plan_chunk(
                ask,
                subset,
                pages,
                c.first,
                {},
                (t1, layer) == (n, LAYERS - 1),
                cursor,
                {"kv": PS},
                [],
                [],
                c.span,
            )
            assert not isinstance(b, str), b
            apply(b)
            done[layer] = t1
            want = expect(src, dst, layout, sp, dp, done, n)
            for i, (got, w) in enumerate(zip(dst.arrays, want)):
                assert np.array_equal(got, w), (layout, t0, t1, layer, i)


def test_a_mixed_token_by_layer_chunk_coalesces_to_one_block_per_buffer() -> None:
    src, dst = Mem("kv", "NHD", seed=2), Mem("kv", "NHD", seed=None)
    pairing = P.pair_buffers(src.spec, dst.spec)
    sub = P.layer_subset(pairing, 1, 3)  # type: ignore[arg-type]
    assert sub is not None and len(sub) == 4  # K and V of layers 1 and 2
    assert [b.layer_id for b in sub.src.buffers] == [1, 1, 2, 2]
    pages = np.arange(2, 6)
    b = P.plan_paged(sub, pages, 0, np.arange(8, 12), 0, 0, 16)
    assert not isinstance(b, str) and len(b) == 4  # contiguous on both sides: one per buffer
    assert P.layer_subset(pairing, 5, 9) is None  # layers the pool does not hold


def test_a_partial_page_is_written_for_its_tokens_alone_then_completed() -> None:
    src, dst = Mem("kv", "HND", seed=4), Mem("kv", "HND", seed=None)
    pairing = P.pair_buffers(src.spec, dst.spec)
    sp, dp = np.array([5]), np.array([9])
    first = P.plan_paged(pairing, sp, 0, dp, 0, 0, 3, exact=True)  # type: ignore[arg-type]
    assert not isinstance(first, str)
    apply(first)
    want = expect(src, dst, "HND", sp, dp, {x: 3 for x in range(LAYERS)})
    assert all(np.array_equal(g, w) for g, w in zip(dst.arrays, want))
    assert all((a[9 * ITEM : 10 * ITEM] == SENTINEL).sum() == HEADS * HB for a in dst.arrays)
    rest = P.plan_paged(pairing, sp, 0, dp, 0, 3, 4)  # type: ignore[arg-type]
    assert not isinstance(rest, str)
    apply(rest)
    want = expect(src, dst, "HND", sp, dp, {x: 4 for x in range(LAYERS)})
    assert all(np.array_equal(g, w) for g, w in zip(dst.arrays, want))


def _claim(cursors, layers, tokens, pages=1, layers_of=None):
    return C.claim(
        1,
        {"kv": np.arange(pages)},
        {"kv": PS},
        layers_of or {"kv": (0, 1, 2)},
        cursors,
        layers,
        tokens,
    )


def test_claims_that_overlap_leave_gaps_or_name_missing_layers_are_refused() -> None:
    ok = _claim({}, (0, 1), (0, 3))
    assert not isinstance(ok, str) and ok.cursors == {"kv": {0: 3, 1: 0, 2: 0}}
    cur = ok.cursors
    assert "overlaps" in _claim(cur, (0, 1), (0, 3))  # the same layer and tokens again
    assert "overlaps" in _claim(cur, (0, 2), (2, 4))
    assert "gap" in _claim(cur, (0, 1), (4, 5), pages=1)
    assert "not within" in _claim({}, (2, 9), (0, 3))
    assert "not within" in _claim({}, (1, 1), (0, 3))  # an empty layer range
    assert "not within" in _claim({}, (-1, 1), (0, 3))
    assert "span" in _claim({}, (0, 1), (0, 5), pages=1)  # 5 tokens need 2 pages
    assert "none of layers" in C.claim(
        1, {"kv": np.arange(1)}, {"kv": PS}, {"kv": (0,), "x": (5,)}, {}, (5, 6), (0, 3)
    )
    assert "not an anchor" in C.claim(
        1, {"nope": np.arange(1)}, {"kv": PS}, {"kv": (0,)}, {}, None, None
    )
    assert "different tokens" in _claim(cur, None, None)
    whole = _claim({}, None, None, pages=2)  # whole-layer chunks keep one count per pool
    assert not isinstance(whole, str) and whole.cursors == {"kv": 8}
    aligned = _claim({"kv": {0: 3, 1: 2, 2: 2}}, (1, 3), (2, 3))
    assert not isinstance(aligned, str) and aligned.cursors == {"kv": 3}
    # the next tokens of layer 0, then every layer without naming tokens once they align
    nxt = _claim(cur, (0, 1), (3, 8), pages=2)
    assert not isinstance(nxt, str) and nxt.first == {"kv": 0} and nxt.span == {"kv": (3, 8)}


def test_the_last_chunk_is_refused_until_every_layer_holds_every_token() -> None:
    src, dst = Mem("kv", "NHD", seed=5), Mem("kv", "NHD", seed=None)
    pairing = P.pair_buffers(src.spec, dst.spec)
    sub = {"kv": P.layer_subset(pairing, 2, 3)}  # type: ignore[arg-type]
    ask = C.Ask(1, 0, 8, {"kv": np.arange(2)}, {})
    # layer 2 reaches token 8, but the room's cursor (its slowest layer) is still at 4
    why = C.plan_chunk(
        ask,
        sub,
        {"kv": np.arange(1, 2)},
        {"kv": 4},
        {},
        True,
        {"kv": 4},
        {"kv": PS},
        [],
        [],
        {"kv": (4, 8)},
    )
    assert isinstance(why, str) and "expects 8" in why


def _kv_spec() -> PoolSpec:
    return Mem("kv", "NHD", seed=None).spec


def test_the_decode_counts_every_layer_of_every_token_before_a_sender_is_done() -> None:
    from pdxfer.endpoint.integrity_checks import _uncovered

    spec = _kv_spec()
    whole = [(0, 0, 0, 13)]
    assert _uncovered(whole, spec, 0, 13) == ""
    by_layer = [(x, x + 1, a, b) for x in range(LAYERS) for a, b in ((0, 5), (5, 13))]
    assert _uncovered(by_layer, spec, 0, 13) == ""
    missing = [e for e in by_layer if e != (1, 2, 5, 13)]  # one layer's last tokens
    assert _uncovered(missing, spec, 0, 13) == "layer 1 tokens [0, 13)"
    assert _uncovered(by_layer[:-1] + [(0, 0, 5, 13)], spec, 0, 13) == ""  # a whole digest


def test_a_digest_with_a_reversed_layer_range_is_refused_on_decode() -> None:
    from pdxfer import wire

    with pytest.raises(ValueError):
        wire.Digest("kv", 0, 4, 0, 0, (1,), 3, 2)
    ok = wire.Digest("kv", 0, 4, 0, 0, (1, 2), 1, 2)
    assert wire.decode(
        wire.encode(
            wire.TransferDone(room=1, nonce=1, endpoint_id="e", rank=0, ok=True, digests=(ok,))
        )
    ).digests == (ok,)
