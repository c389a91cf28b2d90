"""The KV index's burst path (``KvIndex.ingest``): many workers' events, applied in
vectorized runs, leave the index exactly as applying them one at a time does; events of one
worker keep their order (a store then a remove, a clear mid-burst); hostile arrays in raw
frames are dropped whole."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from pdxfer.serving.kv_events import BlockStored, RawBatch, encode_batch
from pdxfer.serving.router.kv_index import KvIndex, block_keys, chain_states
from pdxfer.serving.router.kv_kernels import chain_blocks, msgpack_ints, token_blocks
from pdxfer.serving.router.u64map import U64Map, fix_keys

BS = 4
TOK = KvIndex.__init__.__globals__["_TOK"]


def _state(ix: KvIndex) -> tuple[list[tuple[int, int]], dict[int, list[str]], int]:
    live = ix.blocks.live_slots()
    pairs = sorted(zip(ix.blocks.cols["state"][live].tolist(), ix.blocks.cols["w"][live].tolist()))
    hl = ix.holders.live_slots()
    hold = {}
    for k, s in zip(ix.holders.keys[hl].tolist(), hl.tolist()):
        m = ix.holder_mask(k, s)
        hold[k] = sorted(ix.names[i] for i in range(m.bit_length()) if m >> i & 1)
        assert hold[k], "a holder slot without holders"
    return pairs, hold, ix.orphans


def _one(ix: KvIndex, name: str, op: tuple) -> None:
    if op[0] == "s":
        ix.stored(name, op[1], op[2], op[3], op[4])
    elif op[0] == "r":
        ix.removed(name, op[1])
    else:
        ix.cleared(name)


def _burst(ix: KvIndex, ops: list[tuple[str, tuple]], raw: bool) -> np.ndarray:
    out = []
    for name, op in ops:
        w = ix.worker(name)
        if op[0] == "s":
            h, t = op[1], op[3]
            if raw:
                h, t = (
                    msgspec.Raw(msgspec.msgpack.encode(h)),
                    msgspec.Raw(msgspec.msgpack.encode(t)),
                )
            out.append(("s", w, h, op[2], t, op[4]))
        elif op[0] == "r":
            out.append(("r", w, op[1]))
        else:
            out.append(("c", w))
    return ix.ingest(out)


def _random_ops(rng: random.Random, n: int) -> list[tuple[str, tuple]]:
    prompts = [[rng.randrange(50) for _ in range(BS * 6)] for _ in range(8)]
    made: dict[str, list[int]] = {w: [] for w in "abcd"}
    alive: dict[str, set[int]] = {w: set() for w in "abcd"}  # parents only from these
    ops = []
    for _ in range(n):
        w = rng.choice("abcd")
        x = rng.random()
        if x < 0.6:
            p = rng.choice(prompts)
            a = rng.randrange(0, 3)
            k = rng.randrange(1, 4)
            h = [hash((w, tuple(p[: (a + i + 1) * BS]))) & ((1 << 64) - 1) for i in range(k)]
            parent = (hash((w, tuple(p[: a * BS]))) & ((1 << 64) - 1)) if a else None
            if parent is not None and parent not in alive[w] and rng.random() < 0.8:
                continue
            extras = [["salt"]] + [None] * (k - 1) if rng.random() < 0.1 else None
            ops.append((w, ("s", h, parent, p[a * BS : (a + k) * BS], extras)))
            if parent is None or parent in alive[w]:
                made[w] += h
                alive[w] |= set(h)
        elif x < 0.9:
            gone = rng.sample(made[w], min(len(made[w]), 2)) + [rng.randrange(1 << 60)]
            ops.append((w, ("r", gone)))
            alive[w] -= set(gone)
        else:
            ops.append((w, ("c",)))
            alive[w].clear()
    return ops


@pytest.mark.parametrize("raw", [False, True])
def test_a_burst_leaves_the_index_as_one_event_at_a_time_does(raw: bool) -> None:
    rng = random.Random(11)
    for trial in range(6):
        ops = _random_ops(rng, 120)
        one, many = KvIndex(BS, capacity=32), KvIndex(BS, capacity=32)
        for w in "abcd":
            one.worker(w), many.worker(w)
        for name, op in ops:
            _one(one, name, op)
        for a in range(0, len(ops), 17 + trial * 9):
            _burst(many, ops[a : a + 17 + trial * 9], raw)
        assert _state(one) == _state(many)


def test_a_store_then_a_remove_in_one_burst_ends_removed_and_back() -> None:
    ix = KvIndex(BS)
    ids = list(range(8))
    got = _burst(
        ix,
        [
            ("a", ("s", [1, 2], None, ids, None)),
            ("a", ("r", [2])),
            ("b", ("s", [1, 2], None, ids, None)),
        ],
        raw=True,
    )
    assert got.tolist() == [3, 2] and ix.cached_tokens(ids) == {"a": 4, "b": 8}
    _burst(ix, [("a", ("r", [1])), ("a", ("s", [1], None, ids[:4], None))], raw=True)
    assert ix.cached_tokens(ids) == {"a": 4, "b": 8}


def test_a_remove_of_an_unknown_block_changes_nothing() -> None:
    ix = KvIndex(BS)
    ids = list(range(8))
    got = _burst(
        ix,
        [("a", ("s", [1, 2], None, ids, None)), ("a", ("r", [99, b"\x07"])), ("c", ("r", [1]))],
        raw=True,
    )
    assert got.tolist() == [2, 0] and ix.cached_tokens(ids) == {"a": 8}


def test_a_clear_mid_burst_forgets_only_what_came_before_it() -> None:
    ix = KvIndex(BS)
    ids = list(range(12))
    _burst(
        ix,
        [
            ("a", ("s", [1, 2], None, ids[:8], None)),
            ("b", ("s", [5], None, ids[:4], None)),
            ("a", ("c",)),
            ("a", ("s", [1], None, ids[:4], None)),
            ("b", ("s", [6], 5, ids[4:8], None)),
        ],
        raw=True,
    )
    assert ix.cached_tokens(ids) == {"a": 4, "b": 8}
    _burst(ix, [("a", ("s", [2], 1, ids[4:8], None)), ("a", ("c",))], raw=True)
    assert ix.cached_tokens(ids) == {"b": 8} and len(ix) == 2


def test_a_parent_stored_later_in_the_same_burst_chains() -> None:
    ix = KvIndex(BS)
    ids = list(range(12))
    _burst(
        ix,
        [("a", ("s", [3], 2, ids[8:], None)), ("a", ("s", [1, 2], None, ids[:8], None))],
        raw=True,
    )
    assert ix.cached_tokens(ids) == {"a": 12} and ix.orphans == 0
    _burst(ix, [("a", ("s", [9], 8, ids[:4], None))], raw=True)
    assert ix.orphans == 1


@pytest.mark.parametrize(
    "bad",
    [
        b"\xc0",  # nil, not an array
        b"\x93\x01\x02",  # says 3 items, has 2
        b"\x92\x01\xa1x",  # a string item
        b"\x91\xd0\xff",  # a negative token
        b"\x91\xce\x80\x00\x00\x00",  # a token >= 2**31
        b"\xdd\xff\xff\xff\xff\x01",  # a huge count
        b"\x92\x01\x02\x03",  # trailing bytes
        b"\x96\x01\x02\x03\x04\x05\x06",  # a block and a half
        b"\x98\x01\x02\x03\x04\x05\x06\x07\x08",  # two blocks for one hash
    ],
)
def test_a_hostile_token_array_drops_its_event_only(bad: bytes) -> None:
    ix = KvIndex(BS)
    ids = list(range(8))
    ix.worker("a")
    ix.ingest(
        [
            ("s", 0, msgspec.Raw(msgspec.msgpack.encode([1])), None, msgspec.Raw(bad), None),
            (
                "s",
                0,
                msgspec.Raw(msgspec.msgpack.encode([2, 3])),
                None,
                msgspec.Raw(msgspec.msgpack.encode(ids)),
                None,
            ),
        ]
    )
    assert ix.cached_tokens(ids) == {"a": 8} and len(ix) == 2


def test_a_block_size_past_4096_tokens_indexes_in_a_burst_as_alone() -> None:
    """Every block size the schema allows has its token weights (none read past them)."""
    bs = 5000
    ids = [i % 997 for i in range(2 * bs)]
    one, many = KvIndex(bs), KvIndex(bs)
    one.stored("a", [1, 2], None, ids)
    many.worker("a")
    many.ingest(
        [
            (
                "s",
                0,
                msgspec.Raw(msgspec.msgpack.encode([1, 2])),
                None,
                msgspec.Raw(msgspec.msgpack.encode(ids)),
                None,
            )
        ]
    )
    assert _state(one) == _state(many)
    assert many.cached_tokens(ids + [5]) == {"a": 2 * bs}


def test_msgpack_ints_reads_what_msgspec_writes() -> None:
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 1 << 31, int(rng.integers(0, 40))).tolist() for _ in range(50)]
    toks += [[0, 127, 128, 255, 256, 65535, 65536, (1 << 31) - 1]]
    flat, counts = msgpack_ints([msgspec.msgpack.encode(t) for t in toks], True, 1 << 22)
    assert counts.tolist() == [len(t) for t in toks]
    assert flat.tolist() == [x for t in toks for x in t]
    hashes = [-1, -200, -(1 << 63), (1 << 64) - 1, 5, b"\x01\x02", bytes(range(32)), b""]
    flat, counts = msgpack_ints([msgspec.msgpack.encode(hashes)], False, 1 << 16)
    want = [
        (x if isinstance(x, int) else int.from_bytes(x[:8], "big")) & ((1 << 64) - 1)
        for x in hashes
    ]
    assert counts.tolist() == [len(hashes)] and flat.tolist() == want


def test_the_compiled_chain_equals_the_vectorized_one() -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 1 << 31, 16 * 40)
    want = chain_states(12345, ids, 16, [["x"]] + [None] * 39)
    xor = np.zeros(40, np.uint64)
    xor[0] = np.uint64(KvIndex.__init__.__globals__["extra_hash"](["x"]))
    th, counts = token_blocks([msgspec.msgpack.encode(ids.tolist())], 16, TOK, 1 << 22)
    assert counts.tolist() == [16 * 40] and len(th) == 40
    got, keys = chain_blocks(th, np.array([40]), np.array([12345], np.uint64), xor)
    assert (got == want).all() and (keys == block_keys(want)).all()


def test_a_raw_frame_decodes_to_raw_stores() -> None:
    p = encode_batch([BlockStored([1, 2], None, list(range(8)), BS)])
    b = msgspec.msgpack.decode(p, type=RawBatch)
    assert isinstance(b.events[0].token_ids, msgspec.Raw)


def test_a_put_that_grows_the_map_sets_old_and_new_keys() -> None:
    m = U64Map({"v": np.int64}, capacity=32)
    keys = fix_keys(np.arange(1, 31, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    m.put(keys[:20], v=np.arange(20))
    m.put(keys, v=np.arange(100, 130))  # 20 present, 10 new: grows
    assert m.cols["v"][m.find(keys)].tolist() == list(range(100, 130))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_put_of_two_columns_agrees_with_a_dict_and_the_last_value_of_a_key_wins(
    seed: int,
) -> None:
    """Both columns in one pass: keys new, present, repeated in a batch, and placed in
    deleted slots, as the map grows."""
    rng = np.random.default_rng(seed)
    m = U64Map({"a": np.uint64, "b": np.uint16}, capacity=32)
    model: dict[int, tuple[int, int]] = {}
    pool = fix_keys(rng.integers(2, 1 << 63, 300, dtype=np.uint64))
    for _ in range(40):
        keys = pool[rng.integers(0, len(pool), int(rng.integers(1, 60)))]
        a = rng.integers(0, 1 << 63, len(keys), dtype=np.uint64)
        b = rng.integers(0, 1 << 16, len(keys)).astype(np.uint16)
        slots = m.put(keys, a=a, b=b)
        assert (m.keys[slots] == keys).all()
        model.update(zip(keys.tolist(), zip(a.tolist(), b.tolist())))
        gone = pool[rng.integers(0, len(pool), 10)]
        m.delete_slots(m.find(gone))
        for k in gone.tolist():
            model.pop(k, None)
        assert m.live == len(model)
    got = m.find(np.array(list(model), np.uint64))
    assert (got >= 0).all()
    assert list(zip(m.cols["a"][got].tolist(), m.cols["b"][got].tolist())) == list(model.values())


def test_an_index_sized_for_its_blocks_does_not_grow_and_indexes_the_same() -> None:
    from pdxfer.serving.kv_events import KVEventBatch
    from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds

    rng = random.Random(3)
    names = [f"http://w{i}" for i in range(4)]
    frames = [
        (
            n,
            KVEventBatch(
                0.0,
                [
                    BlockStored(
                        list(range(1000 * i + 1, 1000 * i + 251)),
                        None,
                        [rng.randrange(500) for _ in range(250 * BS)],
                        BS,
                    )
                ],
            ),
        )
        for i, n in enumerate(names)
    ]
    sized, grown = (
        KvFeeds([FeedSpec(n, "tcp://127.0.0.1:1") for n in names], index_blocks=b)
        for b in (1000, 0)
    )
    for feeds in (sized, grown):
        feeds.apply_many(frames)
    ix, ix0 = sized.indexes[BS], grown.indexes[BS]
    assert ix.blocks.capacity == ix.holders.capacity == sized.index_slots and len(ix) == 1000
    assert ix0.blocks.capacity > grown.index_slots  # unsized, the same blocks grow the map
    assert _state(ix) == _state(ix0)
    ids = frames[2][1].events[0].token_ids
    assert ix.cached_tokens(ids) == ix0.cached_tokens(ids) == {names[2]: len(ids)}
    with pytest.raises(ValueError):
        KvFeeds([], index_blocks=-1)


def test_a_burst_of_frames_defers_a_workers_frames_from_its_gap_on() -> None:
    from pdxfer.serving.kv_events import KVEventBatch
    from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds

    w1, w2 = "http://w1", "http://w2"
    feeds = KvFeeds([FeedSpec(w1, "tcp://127.0.0.1:1"), FeedSpec(w2, "tcp://127.0.0.1:2")])
    f1, f2 = feeds.feeds[w1], feeds.feeds[w2]
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))

    def st(ids: list[int], h: int) -> KVEventBatch:
        return KVEventBatch(0.0, [BlockStored([h, h + 1], None, ids, BS)])

    rest = feeds.on_frames(
        [
            (f1, 0, st(a, 10)),
            (f2, 0, st(b, 20)),
            (f1, 2, st(c, 30)),
            (f1, 3, st(c, 40)),
            (f2, 1, st(c, 50)),
        ]
    )
    assert [(f.spec.worker, s, gap) for f, s, _, gap in rest] == [(w1, 2, True), (w1, 3, False)]
    assert feeds.cached(a) == {w1: 8} and feeds.cached(c) == {w2: 8}
    assert f1.next_seq == 1 and f2.next_seq == 2 and f2.counters["blocks"] == 4
    # w1 starts over (seq 0 again): cleared first, then what the new stream says
    assert not feeds.on_frames([(f2, 2, st(a, 60)), (f1, 0, st(b, 70))])
    assert feeds.cached(a) == {w2: 8} and feeds.cached(b) == {w1: 8, w2: 8}
    assert f1.counters["resets"] == 1


def test_a_store_that_grows_the_holders_map_keeps_shared_blocks_shared() -> None:
    ix = KvIndex(BS, capacity=32)
    ids = list(range(BS * 20))
    ix.stored("a", list(range(1, 21)), None, ids)
    more = ids + list(range(1000, 1000 + BS * 40))  # 20 shared, 40 new: the map grows
    ix.stored("b", list(range(101, 161)), None, more)
    assert ix.cached_tokens(ids) == {"a": len(ids), "b": len(ids)}
    assert ix.cached_tokens(more) == {"a": len(ids), "b": len(more)}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_holders_agree_with_a_set_model_as_blocks_gain_and_lose_workers(seed: int) -> None:
    """One, two (the second holder column) and three or more holders (the bitmask on the
    side), in bursts where several workers store and release the same blocks, and with the
    holders map growing and reusing deleted slots."""
    rng = random.Random(seed)
    blocks = [[rng.randrange(1000) for _ in range(BS)] for _ in range(40)]
    names = [f"w{i}" for i in range(7)]
    model: dict[int, set[str]] = {b: set() for b in range(len(blocks))}
    ix = KvIndex(BS, capacity=32)
    for _ in range(60):
        ops: list[tuple[str, tuple]] = []
        for _ in range(rng.randrange(1, 40)):
            w, b = rng.choice(names), rng.randrange(len(blocks))
            x = rng.random()
            if x < 0.55:
                ops.append((w, ("s", [b + 1], None, blocks[b], None)))
                model[b].add(w)
            elif x < 0.97:
                ops.append((w, ("r", [b + 1])))
                model[b].discard(w)
            else:
                ops.append((w, ("c",)))
                for held in model.values():
                    held.discard(w)
        _burst(ix, ops, raw=rng.random() < 0.5)
        for b, ids in enumerate(blocks):
            assert ix.cached_tokens(ids) == dict.fromkeys(sorted(model[b]), BS), b
        _state(ix)  # no holder slot is left without holders
        assert ix.shared() == sum(len(h) > 1 for h in model.values())
        assert len(ix.multi) == sum(len(h) > 2 for h in model.values())


def test_warm_compiles_every_kernel_a_growing_burst_uses() -> None:
    """The first frames must not wait for numba: ``warm`` reaches every signature."""
    import numba

    from pdxfer.serving.router import kv_kernels, u64map
    from pdxfer.serving.router.kv_index import warm

    kernels = [
        getattr(m, n)
        for m in (u64map, kv_kernels)
        for n in dir(m)
        if isinstance(getattr(m, n), numba.core.registry.CPUDispatcher)
    ]
    warm()
    before = [set(k.signatures) for k in kernels]
    ix = KvIndex(BS, capacity=32)
    rng = random.Random(5)
    ops = [
        (
            w,
            (
                "s",
                list(range(1 + 100 * i, 31 + 100 * i)),
                None,
                [rng.randrange(1000) for _ in range(30 * BS)],
                None,
            ),
        )
        for i, w in enumerate("abc")
    ]
    _burst(ix, ops + [("b", ("r", [101, 102])), ("c", ("c",))], raw=True)
    ix.cached_tokens(list(range(3 * BS)))
    assert [set(k.signatures) - b for k, b in zip(kernels, before)] == [set()] * len(kernels)
