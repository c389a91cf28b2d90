"""NIXL descriptors name the memory they point into: a list per memory type, each row with
its device. NIXL matches a descriptor only against memory registered with the same type and
device; describing a GPU pool's pages as host memory failed every write from or to it
(``NIXL_ERR_NOT_FOUND``, first seen on an H100)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pdxfer.transport.nixl import DRAM, _device, _Info, _Mems, split_by_memory


def test_location_strings_name_their_device() -> None:
    assert [_device(x) for x in ("cpu", "cuda:0", "cuda:3", "cuda")] == [DRAM, 0, 3, 0]


def test_an_address_is_in_the_memory_of_the_region_that_holds_it() -> None:
    mems = _Mems([(1000, 100, 2), (5000, 10, DRAM), (100, 50, 0)])
    addr = np.array([100, 149, 150, 1000, 1099, 1100, 5005, 7, 1 << 40])
    assert mems.of(addr).tolist() == [0, 0, DRAM, 2, 2, DRAM, DRAM, DRAM, DRAM]
    assert _Mems([]).of(np.array([1, 2])).tolist() == [DRAM, DRAM]


def test_blocks_are_grouped_by_both_sides_memory_with_their_devices() -> None:
    src = np.array([10, 20, 30, 40, 50])
    dst = np.array([110, 120, 130, 140, 150])
    n = np.array([1, 2, 3, 4, 5])
    sdev = np.array([DRAM, 1, 1, DRAM, 0])
    ddev = np.array([DRAM, DRAM, 3, 2, 3])
    got = {(sm, dm): (s.tolist(), d.tolist())
           for sm, s, dm, d in split_by_memory(src, dst, n, sdev, ddev)}
    assert got == {
        ("DRAM", "DRAM"): ([[10, 1, 0]], [[110, 1, 0]]),
        ("DRAM", "VRAM"): ([[40, 4, 0]], [[140, 4, 2]]),
        ("VRAM", "DRAM"): ([[20, 2, 1]], [[120, 2, 0]]),
        ("VRAM", "VRAM"): ([[30, 3, 1], [50, 5, 0]], [[130, 3, 3], [150, 5, 3]]),
    }
    for _, s, _, d in split_by_memory(src, dst, n, sdev, ddev):
        assert s.dtype == d.dtype == np.uint64


def test_a_peer_that_names_no_devices_is_host_memory_and_bad_devices_are_refused() -> None:
    old = msgspec.msgpack.encode({"md": b"x", "regions": [(4096, 4096, 0)]})
    assert msgspec.msgpack.decode(old, type=_Info).devices == []
    for bad in (-2, 1 << 20):
        raw = msgspec.msgpack.encode({"md": b"x", "regions": [(4096, 4096, 0)],
                                      "devices": [bad]})
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(raw, type=_Info)
