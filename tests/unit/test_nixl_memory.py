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
    got = {
        (sm, dm): (s.tolist(), d.tolist())
        for sm, s, dm, d in split_by_memory(src, dst, n, sdev, ddev)
    }
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
        raw = msgspec.msgpack.encode({"md": b"x", "regions": [(4096, 4096, 0)], "devices": [bad]})
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(raw, type=_Info)


# -- prepared page lists for device memory (a stand-in agent records what NIXL is asked) --------
from pdxfer.transport import nixl as pnixl  # noqa: E402
from pdxfer.transport.nixl import NixlTransport, _Layout, page_regions  # noqa: E402


class _FakeAgent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.backends = {"UCX": object()}
        self.calls: list[tuple] = []
        self._h = 0

    def _handle(self) -> int:
        self._h += 1
        return self._h

    def register_memory(self, regs, mem):
        return (mem, regs)

    def deregister_memory(self, descs) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, md: bytes) -> bytes:
        return bytes(md)

    def remove_remote_agent(self, name) -> None:
        pass

    def prep_xfer_dlist(self, agent, rows, mem):
        h = self._handle()
        self.calls.append(("prep", agent, mem, np.asarray(rows).tolist(), h))
        return h

    def make_prepped_xfer(self, op, lh, li, rh, ri):
        self.calls.append(("prepped", lh, np.asarray(li).tolist(), rh, np.asarray(ri).tolist()))
        return self._handle()

    def get_xfer_descs(self, rows, mem):
        return (mem, np.asarray(rows).tolist())

    def initialize_xfer(self, op, local, remote, peer):
        self.calls.append(("per_call", local, remote))
        return self._handle()

    def transfer(self, h) -> str:
        return "DONE"

    def check_xfer_state(self, h) -> str:
        return "DONE"

    def release_xfer_handle(self, h) -> None:
        pass

    def release_dlist_handle(self, h) -> None:
        pass

    def get_new_notifs(self) -> dict:
        return {}


@pytest.fixture
def fake_agents(monkeypatch):
    monkeypatch.setattr(pnixl, "_agent", lambda nixl, name, backends, threads: _FakeAgent(name))
    made: list[NixlTransport] = []
    yield made
    for t in made:
        t.close()


P = 4096


def _pair(made, old_peer: bool = False):
    a, b = NixlTransport(), NixlTransport()
    made += [a, b]
    a.register(0x100000, 8 * P, "cuda:0", P)  # device pages, device 0
    a.register(0x200000, 8 * P, "cpu", P)  # host pages
    b.register(0x900000, 8 * P, "cuda:1", P)  # the peer's device pages, device 1
    info = b.peer_info()
    if old_peer:  # a release that sent no device page sizes
        parsed = msgspec.msgpack.decode(info, type=_Info)
        info = msgspec.msgpack.encode(msgspec.structs.replace(parsed, items=[]))
    a.add_peer(b.session_id, info)
    return a, b


def test_device_pages_are_written_through_prepared_lists_with_their_devices(fake_agents) -> None:
    a, b = _pair(fake_agents)
    a.write(
        b.session_id,
        [0x100000 + 2 * P, 0x200000 + 3 * P, 0x100000 + 4 * P],
        [0x900000 + 5 * P, 0x900000 + 6 * P, 0x900000 + 7 * P],
        [P, P, P // 2],
    )
    calls = a._agent.calls
    preps = {(c[1] == "NIXL_INIT_AGENT", c[2]): c for c in calls if c[0] == "prep"}
    assert set(preps) == {(True, "VRAM"), (True, "DRAM"), (False, "VRAM")}
    assert preps[(True, "VRAM")][3][2] == [0x100000 + 2 * P, P, 0]  # its device, 0
    assert preps[(False, "VRAM")][3][0] == [0x900000, P, 1]  # the peer's device, 1
    prepped = [c for c in calls if c[0] == "prepped"]
    by_list = {c[1]: (c[2], c[4]) for c in prepped}
    assert by_list == {preps[(True, "VRAM")][4]: ([2], [5]), preps[(True, "DRAM")][4]: ([3], [6])}
    assert all(c[3] == preps[(False, "VRAM")][4] for c in prepped)
    (per_call,) = [c for c in calls if c[0] == "per_call"]  # the half page
    assert per_call[1] == ("VRAM", [[0x100000 + 4 * P, P // 2, 0]])
    assert per_call[2] == ("VRAM", [[0x900000 + 7 * P, P // 2, 1]])
    assert a.stats_prepped == 2


def test_a_peer_that_sends_no_device_page_sizes_gets_its_device_pages_per_call(fake_agents) -> None:
    a, b = _pair(fake_agents, old_peer=True)
    a.write(b.session_id, [0x100000], [0x900000], [P])
    assert a.stats_prepped == 0
    assert [c[0] for c in a._agent.calls if c[0] != "prep"] == ["per_call"]


def test_host_regions_keep_their_page_sizes_where_older_peers_read_them() -> None:
    regs = [(0x1000, 4 * P, P), (0x9000, 4 * P, 0)]
    got = page_regions(regs, [DRAM, 2], [P, P])
    assert got == {"DRAM": [(0x1000, 4 * P, P, 0)], "VRAM": [(0x9000, 4 * P, P, 2)]}
    assert page_regions(regs, [DRAM, 2], [])["VRAM"] == [(0x9000, 4 * P, 0, 2)]
    lay = _Layout(got["VRAM"], "VRAM")
    assert lay.total == 4 and lay.descs()[:, 2].tolist() == [2, 2, 2, 2]


def test_device_page_sizes_travel_apart_from_what_older_peers_prepare(fake_agents) -> None:
    _, b = _pair(fake_agents)
    info = msgspec.msgpack.decode(b.peer_info(), type=_Info)
    assert info.regions == [(0x900000, 8 * P, 0)] and info.items == [P] and info.devices == [1]
