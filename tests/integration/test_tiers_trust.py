"""L3 objects are bound to their key and pool, and the file store cannot be steered outside
its root. Real files and a real ``mooncake_master``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.tiers import FileStorage, TieredCache
from pdxfer.tiers.mooncake_store import MooncakeMaster, MooncakeStoreStorage

SECRET = b"l3-secret-for-these-tests-0123456789"
SIZE = 8192


def _page(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def test_an_object_copied_over_another_keys_file_is_refused(tmp_path) -> None:
    fs = FileStorage(str(tmp_path))
    a, b = _page(1), _page(2)
    assert fs.put_from(["ka.kv", "kb.kv"], [a.ctypes.data, b.ctypes.data], [SIZE] * 2) == [True] * 2
    shutil.copyfile(fs.path("ka.kv"), fs.path("kb.kv"))  # the right size and a valid tag...
    dst = np.zeros(SIZE, np.uint8)
    assert fs.get_into(["kb.kv"], [dst.ctypes.data], [SIZE]) == [False]  # ...for another key
    assert fs.get_into(["ka.kv"], [dst.ctypes.data], [SIZE]) == [True] and (dst == a).all()


def test_a_forged_payload_is_refused_with_a_secret(tmp_path) -> None:
    fs = FileStorage(str(tmp_path), secret=SECRET)
    a = _page(3)
    assert fs.put_from(["k.kv"], [a.ctypes.data], [SIZE]) == [True]
    forger = FileStorage(str(tmp_path))  # no secret: writes a self-consistent object
    evil = _page(4)
    assert forger.put_from(["k.kv"], [evil.ctypes.data], [SIZE]) == [True]
    dst = np.zeros(SIZE, np.uint8)
    assert fs.get_into(["k.kv"], [dst.ctypes.data], [SIZE]) == [False]


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster()
    yield m
    m.stop()


def test_mooncake_store_objects_carry_a_tag_a_secretless_writer_cannot_forge(master) -> None:
    ours = MooncakeStoreStorage(
        master.master_addr, master.metadata_url, secret=SECRET, segment_bytes=64 << 20
    )
    theirs = MooncakeStoreStorage(master.master_addr, master.metadata_url, segment_bytes=64 << 20)
    try:
        a, evil, dst = _page(5), _page(6), np.zeros(SIZE, np.uint8)
        for st, buf in ((ours, a), (ours, dst), (theirs, evil)):
            st.register(buf.ctypes.data, buf.nbytes)
        assert ours.put_from(["mk.kv"], [a.ctypes.data], [SIZE]) == [True]
        assert ours.get_into(["mk.kv"], [dst.ctypes.data], [SIZE]) == [True]
        assert (dst == a).all()
        assert theirs.put_from(["mk.kv"], [evil.ctypes.data], [SIZE]) == [True]  # upsert
        dst[:] = 0
        assert ours.get_into(["mk.kv"], [dst.ctypes.data], [SIZE]) == [False]
    finally:
        ours.close()
        theirs.close()


def test_two_models_with_the_same_kv_shape_never_share_keys() -> None:
    specs, tensors = pat.build(
        [PoolGeom("kv", "mha", layers=1, pages=8, page_size=4, heads=1, head_dim=8)]
    )
    one = TieredCache(specs, host_pages=4, model_id="model=a")
    two = TieredCache(specs, host_pages=4, model_id="model=b")
    try:
        toks = list(range(16))
        assert set(one.keys(toks)).isdisjoint(two.keys(toks))
        assert one.keys(toks) == TieredCache(specs, host_pages=4, model_id="model=a").keys(toks)
    finally:
        one.close()
        two.close()
        del tensors


def test_a_symlink_planted_as_a_fanout_folder_cannot_redirect_writes(tmp_path) -> None:
    root, outside = tmp_path / "l3", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "zz")  # where key "zz..." would go
    fs = FileStorage(str(root))
    a = _page(7)
    assert fs.put_from(["zzkey.kv"], [a.ctypes.data], [SIZE]) == [False]
    assert list(outside.iterdir()) == [] and fs.refused >= 1
    os.symlink(outside / "x", root / "zzfile")  # a symlink as the object itself
    dst = np.zeros(SIZE, np.uint8)
    assert fs.get_into(["zzfile"], [dst.ctypes.data], [SIZE]) == [False]


def test_size_accounting_does_not_walk_the_folder_per_put(tmp_path, monkeypatch) -> None:
    fs = FileStorage(str(tmp_path), max_bytes=5 * (SIZE + 64))
    walks = []
    real = os.walk
    monkeypatch.setattr(os, "walk", lambda *a, **k: walks.append(a) or real(*a, **k))
    a = _page(8)
    oks = fs.put_from([f"k{i:03d}.kv" for i in range(8)], [a.ctypes.data] * 8, [SIZE] * 8)
    assert oks == [True] * 5 + [False] * 3  # full after five, as before
    assert walks == []  # and no walk of the folder on any put
    assert fs.used_bytes() == sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
