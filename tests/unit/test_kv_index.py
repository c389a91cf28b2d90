"""The router's KV index: prefixes learned from stored/removed/cleared events, per worker."""

from __future__ import annotations

import random

import numpy as np

from pdxfer.serving.router.kv_index import KvIndex
from pdxfer.serving.router.u64map import U64Map, fix_keys

BS = 4


def _store(
    ix: KvIndex,
    name: str,
    ids: list[int],
    start_hash: int = 1000,
    parent: int | None = None,
    salt: str | None = None,
) -> list[int]:
    """Store ``ids``' full blocks as one event with hashes start_hash, start_hash+1, ..."""
    n = len(ids) // BS
    hashes = [start_hash + i for i in range(n)]
    extras = [[salt]] + [None] * (n - 1) if salt else None
    ix.stored(name, hashes, parent, ids[: n * BS], extras)
    return hashes


def test_map_agrees_with_a_dict_through_inserts_deletes_and_growth() -> None:
    m = U64Map({"v": np.int64}, 16)
    ref: dict[int, int] = {}
    rng = random.Random(1)
    for _ in range(60):
        ks = [rng.randrange(1 << 64) for _ in range(rng.randrange(1, 200))]
        ks += rng.sample(list(ref), min(len(ref), 20))
        keys = fix_keys(np.array(ks, np.uint64))
        vals = np.arange(len(keys), dtype=np.int64) + rng.randrange(1000)
        m.put(keys, v=vals)
        seen = set()
        for k, v in zip(keys.tolist(), vals.tolist()):
            if k not in seen:
                ref[k] = v
                seen.add(k)
        gone = rng.sample(list(ref), len(ref) // 4)
        m.delete_slots(m.find(fix_keys(np.array(gone, np.uint64))))
        for k in gone:
            ref.pop(k)
    keys = np.array(list(ref), np.uint64)
    slots = m.find(keys)
    assert (slots >= 0).all() and m.live == len(ref)
    assert m.cols["v"][slots].tolist() == list(ref.values())
    absent = fix_keys(np.array([rng.randrange(1 << 64) for _ in range(500)], np.uint64))
    assert (m.find(absent[~np.isin(absent, keys)]) < 0).all()


def test_longest_prefix_per_worker_from_chained_events() -> None:
    ix = KvIndex(BS)
    ids = list(range(100, 132))  # 8 blocks
    h = _store(ix, "a", ids[:16])  # blocks 0..3 in one event
    _store(ix, "a", ids[16:24], start_hash=2000, parent=h[-1])  # 4, 5 chained to 3
    _store(ix, "b", ids[:8], start_hash=3000)  # 0, 1
    assert ix.cached_tokens(ids) == {"a": 24, "b": 8}
    assert ix.cached_tokens(ids[:10]) == {"a": 8, "b": 8}  # only full blocks count
    assert ix.cached_tokens([1] + ids[1:]) == {}
    other = ids[:8] + [7] * 8
    assert ix.cached_tokens(other) == {"a": 8, "b": 8}


def test_removed_block_cuts_the_prefix_there_and_clear_forgets_the_worker() -> None:
    ix = KvIndex(BS)
    ids = list(range(50, 74))
    h = _store(ix, "a", ids)
    _store(ix, "b", ids, start_hash=5000)
    ix.removed("a", [h[3]])
    assert ix.cached_tokens(ids) == {"a": 12, "b": 24}
    ix.cleared("b")
    assert ix.cached_tokens(ids) == {"a": 12}
    assert ix.blocks_of("b") == 0 and ix.blocks_of("a") == 5 and ix.shared() == 0


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    ix = KvIndex(BS)
    ids = list(range(8))
    assert ix.stored("a", [1, 2], parent=999, tokens=ids) == 0
    assert ix.orphans == 2 and ix.cached_tokens(ids) == {}


def test_cache_salt_separates_tenants() -> None:
    ix = KvIndex(BS)
    ids = list(range(16))
    _store(ix, "a", ids, salt="s1")
    assert ix.cached_tokens(ids, "s1") == {"a": 16}
    assert ix.cached_tokens(ids) == {} and ix.cached_tokens(ids, "s2") == {}


def test_index_agrees_with_a_brute_force_model_under_random_events() -> None:
    rng = random.Random(7)
    ix = KvIndex(BS)
    prompts = [[rng.randrange(50) for _ in range(BS * 6)] for _ in range(12)]
    held: dict[str, dict[int, tuple[int, ...]]] = {w: {} for w in "abcd"}  # hash -> prefix
    for step in range(300):
        w = rng.choice("abcd")
        p = rng.choice(prompts)
        k = rng.randrange(1, 7)
        if rng.random() < 0.6:
            hashes = [hash((w, tuple(p[: (i + 1) * BS]))) & ((1 << 63) - 1) for i in range(k)]
            ix.stored(w, hashes, None, p[: k * BS])
            for i, hh in enumerate(hashes):
                held[w][hh] = tuple(p[: (i + 1) * BS])
        elif held[w]:
            gone = rng.sample(list(held[w]), min(len(held[w]), 3))
            ix.removed(w, gone)
            for hh in gone:
                held[w].pop(hh)
        if step % 97 == 0:
            ix.cleared(w)
            held[w].clear()
        q = rng.choice(prompts)
        want = {}
        for name, blocks in held.items():
            have = set(blocks.values())
            d = 0
            while d < 6 and tuple(q[: (d + 1) * BS]) in have:
                d += 1
            if d:
                want[name] = d * BS
        assert ix.cached_tokens(q) == want


def test_stored_many_agrees_with_one_event_at_a_time() -> None:
    rng = random.Random(3)
    one, many = KvIndex(BS), KvIndex(BS)
    events = []
    for k in range(40):
        n = rng.randrange(1, 5)
        toks = [rng.randrange(1000) for _ in range(n * BS)]
        hashes = [10_000 * (k + 1) + i for i in range(n)]
        parent = None
        if events and rng.random() < 0.6:  # chained to a block stored before, maybe in-run
            parent = rng.choice(events)[0][-1]
        extras = [["salt"]] + [None] * (n - 1) if rng.random() < 0.2 else None
        events.append((hashes, parent, toks, extras))
    for e in events:
        one.stored("a", *e)
    for a in range(0, len(events), 7):
        many.stored_many("a", events[a : a + 7])
    assert len(one) == len(many) and one.orphans == many.orphans
    s1 = np.sort(one.blocks.cols["state"][one.blocks.live_slots()])
    s2 = np.sort(many.blocks.cols["state"][many.blocks.live_slots()])
    assert (s1 == s2).all()
