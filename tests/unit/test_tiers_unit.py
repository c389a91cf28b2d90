"""Tier building blocks in one process: keys, the L2 index, file L3 integrity, write-back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdxfer.agents.patterns import PoolGeom, build
from pdxfer.errors import ConfigError
from pdxfer.tiers import CapacityError, FileStorage, HostCache, TieredCache, page_keys
from pdxfer.tiers.keys import pool_key
from pdxfer.tiers.storage import NO_DIGEST

V4 = [
    PoolGeom("c4", "logical", pages=16, page_size=4),
    PoolGeom(
        "c4_kv",
        "paged",
        layers=2,
        pages=16,
        page_size=4,
        dim=10,
        dtype="bfloat16",
        indices_from="c4",
    ),
    PoolGeom(
        "c4_idx",
        "paged",
        layers=1,
        pages=16,
        page_size=4,
        dim=3,
        dtype="float32",
        indices_from="c4",
    ),
]


def test_prefix_keys_are_a_chain() -> None:
    toks = list(range(100, 164))
    keys = page_keys(toks, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    changed = page_keys(toks[:20] + [7] + toks[21:], 16)
    assert changed[0] == keys[0] and all(a != b for a, b in zip(changed[1:], keys[1:]))
    assert page_keys(toks[:63], 16) == keys[:3]  # a partial page has no key
    assert pool_key(keys[0], "draft") != pool_key(keys[0], "kv")


def test_group_allocation_rolls_back_when_one_sidecar_is_full() -> None:
    specs, _ = build(V4)
    host = HostCache(specs, {"c4_kv": 8, "c4_idx": 3})
    assert set(host.pools) == {"c4_kv", "c4_idx"}  # the logical anchor has no host memory
    held = host.alloc(["a", "b", "c"])  # pinned, so nothing can be evicted
    with pytest.raises(CapacityError):
        host.alloc(["d"])
    with pytest.raises(CapacityError):
        host.alloc(["e", "f"])
    assert len(host.pools["c4_kv"].free) == 5 and len(host.pools["c4_idx"].free) == 0
    assert set(host.entries) == {"a", "b", "c"} and host.check() is None
    host.commit(held)  # ready and unpinned: now evictable, least recently used first
    host.match_and_pin(["a"])
    new = host.alloc(["d"])
    assert "b" not in host.entries and "a" in host.entries and host.check() is None
    host.discard(new)
    host.unpin(host.match_and_pin(["a"]))
    host.unpin([host.entries["a"]])
    assert host.pinned() == 0 and host.check() is None


def test_torn_short_or_corrupt_l3_file_is_a_miss_never_garbage(tmp_path) -> None:
    fs = FileStorage(str(tmp_path))
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:8192].copy()
    dst = np.zeros(8192, dtype=np.uint8)
    a, d = src.ctypes.data, dst.ctypes.data
    assert fs.put_from(["k1", "k2", "k3"], [a, a, a], [8192] * 3) == [True] * 3
    assert fs.get_into(["k1"], [d], [8192]) == [True] and (dst == src).all()
    os.truncate(fs.path("k1"), 5000)
    with open(fs.path("k2"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    assert fs.exists(["k1", "k2", "k3", "nope"]) == [False, True, True, False]
    assert fs.get_into(["k1", "k2", "nope"], [d] * 3, [8192] * 3) == [False, False, False]
    assert fs.get_into(["k3"], [d], [4096]) == [False]  # another size than expected
    assert not any(n.startswith(".tmp") for _, _, fs_ in os.walk(tmp_path) for n in fs_)


def test_the_page_digest_is_sealed_into_its_l3_object(tmp_path) -> None:
    """The digest a page was stored with comes back with it, and is covered by the tag: an
    object whose recorded digest was changed is a miss like one whose bytes were."""
    fs = FileStorage(str(tmp_path))
    src = np.arange(2048, dtype=np.uint32).view(np.uint8).copy()
    dst = np.zeros_like(src)
    a, d, n = src.ctypes.data, dst.ctypes.data, src.size
    assert (
        fs.put_from(["k1", "k2", "k3"], [a] * 3, [n] * 3, [123, 1 << 62, NO_DIGEST]) == [True] * 3
    )
    got = [0, 0, 0]
    assert fs.get_into(["k1", "k2", "k3"], [d] * 3, [n] * 3, got) == [True] * 3
    assert got == [123, 1 << 62, NO_DIGEST] and (dst == src).all()
    with open(fs.path("k1"), "r+b") as f:  # the digest field of the header
        f.seek(16)
        f.write((124).to_bytes(8, "little"))
    got = [0]
    assert fs.get_into(["k1"], [d], [n], got) == [False] and got == [NO_DIGEST]


def test_an_l3_object_of_an_older_format_is_a_miss(tmp_path) -> None:
    """Objects written before the tag became BLAKE3 (format v3: BLAKE2b/HMAC tags) are misses
    that the next write-back replaces, never bytes checked against the wrong tag."""
    from pdxfer.tiers import storage as S

    fs = FileStorage(str(tmp_path))
    src = np.arange(2048, dtype=np.uint32).view(np.uint8).copy()
    dst = np.zeros_like(src)
    assert fs.put_from(["k1"], [src.ctypes.data], [src.size]) == [True]
    with open(fs.path("k1"), "r+b") as f:
        f.write(b"PDXL3v3\0")
    assert fs.exists(["k1"]) == [False]
    assert fs.get_into(["k1"], [dst.ctypes.data], [src.size]) == [False] and not dst.any()
    assert fs.put_from(["k1"], [src.ctypes.data], [src.size]) == [True]
    assert fs.get_into(["k1"], [dst.ctypes.data], [src.size]) == [True] and (dst == src).all()
    assert S._MAGIC == b"PDXL3v4\0"


def test_an_l3_payload_larger_than_one_read_is_checked_whole(tmp_path) -> None:
    """A payload read in several chunks is hashed over every chunk: a flipped byte in the
    last chunk is a miss."""
    from pdxfer.tiers import storage as S

    n = 2 * S.READ_CHUNK + 4096
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros_like(src)
    fs = FileStorage(str(tmp_path), secret=b"a-secret-of-enough-length-0123456")
    assert fs.put_from(["big"], [src.ctypes.data], [n]) == [True]
    assert fs.get_into(["big"], [dst.ctypes.data], [n]) == [True] and (dst == src).all()
    with open(fs.path("big"), "r+b") as f:
        f.seek(24 + n - 10)  # header, then the payload's tail
        b = f.read(1)
        f.seek(24 + n - 10)
        f.write(bytes([b[0] ^ 1]))
    assert fs.get_into(["big"], [dst.ctypes.data], [n]) == [False]


def test_full_l3_is_a_logged_miss_not_an_error(tmp_path) -> None:
    specs, tensors = build(V4)
    for t in tensors["c4_kv"] + tensors["c4_idx"]:
        t.fill_(1)
    cache = TieredCache(
        specs,
        host_pages=8,
        storage=FileStorage(str(tmp_path), max_bytes=600),
        model_id="v4-pattern",
    )
    toks = list(range(32))
    fut = cache.write_back(toks, {"c4": list(range(8))}, 32)
    assert fut.result(timeout=30) < 8
    assert cache.stats()["l3_put_failures"] > 0
    assert cache.flush() and cache.host.pinned() == 0 and cache.check() is None
    m = cache.match(toks, 32)
    assert len(m.l2) == 7  # the last token is always left to the network
    cache.finish(m)
    assert cache.host.pinned() == 0
    cache.close()


def test_streaming_page_copy_is_byte_exact_at_any_alignment_and_size() -> None:
    # The native copier streams 64-byte blocks to 16-byte aligned addresses and copies the
    # head and tail around them; every (alignment, size) corner must land byte for byte, and
    # nothing next to a destination may change. It must also be the copier in use: the setup
    # installs a C compiler, so a silent fallback to memmove would hide a build failure.
    from pdxfer.tiers import copy as C

    threads = C._Threads()
    assert threads.native is not None, "pdxfer.tiers._ntcopy was not built"
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for size in (1, 15, 16, 63, 64, 65, 129, 1000, 4096 + 7):
        for s_off in (0, 1, 8, 15):
            for d_off in (0, 3, 16, 31):
                dst = np.zeros(3 * size + 64, dtype=np.uint8)
                d_at = [dst.ctypes.data + d_off, dst.ctypes.data + d_off + size + 17]
                s_at = [src.ctypes.data + s_off, src.ctypes.data + s_off + 2 * size]
                threads.copy(np.array(d_at, dtype=np.int64), np.array(s_at, dtype=np.int64), size)
                want = np.zeros_like(dst)
                want[d_off : d_off + size] = src[s_off : s_off + size]
                want[d_off + size + 17 : d_off + 2 * size + 17] = src[
                    s_off + 2 * size : s_off + 3 * size
                ]
                assert np.array_equal(dst, want), (size, s_off, d_off)


def test_l3_without_model_id_is_a_config_error_that_says_why(tmp_path) -> None:
    """L3 outlives the process and is shared: keys salted by the layout alone would let a
    second model with the same KV shape restore this one's pages."""
    specs, tensors = build(V4)
    fs = FileStorage(str(tmp_path))
    with pytest.raises(ConfigError, match="needs model_id.*same KV shape"):
        TieredCache(specs, host_pages=8, storage=fs)
    l2_only = TieredCache(specs, host_pages=8)  # L2 dies with its process: allowed
    try:
        with pytest.raises(ConfigError, match="needs model_id"):
            l2_only.set_storage(fs)
        assert l2_only.storage is None
    finally:
        l2_only.close()
    TieredCache(specs, host_pages=8, storage=fs, model_id="v4-pattern").close()
    del tensors


def test_the_torch_copier_moves_the_same_bytes_as_the_host_copier() -> None:
    # TorchCopier is what a decode with device pools restores through (default_copier picks
    # it off the host); on host pools it must land exactly what CpuCopier lands, and leave
    # every other page alone, so the GPU check exercises a copier proven here.
    import torch

    from pdxfer.tiers.copy import CpuCopier, TorchCopier, default_copier

    specs, ts = build(V4)
    host = HostCache(specs, {"c4_kv": 8, "c4_idx": 8})
    rng = np.random.default_rng(3)
    for t in (x for v in ts.values() for x in v):
        u8 = t.view(torch.uint8)
        u8.copy_(torch.from_numpy(rng.integers(0, 256, u8.shape, dtype=np.uint8)))
    l1, hp = np.array([9, 2, 14]), np.array([5, 0, 7])
    assert isinstance(default_copier(specs), CpuCopier)
    cpu, tch = CpuCopier(specs), TorchCopier(specs)
    for pool in ("c4_kv", "c4_idx"):
        p = host.pools[pool]
        cpu.to_host(pool, l1, p, hp)
        want = p.data.copy()
        p.data[:] = 0
        tch.to_host(pool, l1, p, hp)
        assert np.array_equal(p.data, want)
    before = {n: [t.clone() for t in v] for n, v in ts.items()}
    back = np.array([1, 3, 4])
    for pool in ("c4_kv", "c4_idx"):
        tch.to_l1(pool, host.pools[pool], hp, back)
    for n, v in ts.items():
        for t, old in zip(v, before[n]):
            rows, olds = t.view(torch.uint8).view(16, -1), old.view(torch.uint8).view(16, -1)
            assert torch.equal(rows[back], olds[l1]) and torch.equal(
                rows[[i for i in range(16) if i not in back]],
                olds[[i for i in range(16) if i not in back]],
            )


class _Seen:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, keys, parent, tokens, page_size, scope) -> None:  # noqa: ANN001
        self.events.append(("s", list(keys), parent, list(tokens), page_size, scope))

    def removed(self, keys) -> None:  # noqa: ANN001
        self.events.append(("r", list(keys)))


def test_an_observer_sees_l2_stores_as_chained_runs_and_evictions() -> None:
    specs, _ = build(V4)
    cache = TieredCache(specs, host_pages=4, model_id="v4-pattern")
    seen = _Seen()
    cache.observer = seen
    toks = list(range(16))
    keys = cache.keys(toks)
    cache.write_back(toks[:8], {"c4": [0, 1]}, 8).result(timeout=30)
    cache.write_back(toks, {"c4": [0, 1, 2, 3]}, 16, scope="").result(timeout=30)
    assert seen.events == [
        ("s", keys[:2], None, toks[:8], 4, ""),
        ("s", keys[2:], keys[1], toks[8:], 4, ""),
    ]
    other = list(range(100, 104))
    cache.write_back(other, {"c4": [5]}, 4).result(timeout=30)  # L2 full: the LRU page goes
    assert seen.events[-2:] == [("r", [keys[0]]), ("s", cache.keys(other), None, other, 4, "")]
    assert cache.flush()
    cache.host.clear()
    assert seen.events[-1][0] == "r" and len(seen.events[-1][1]) == 4
    cache.close()
