"""The pairing rule of ``transport="auto"`` (``transport/auto.py``): both sides of a pair pick
the same transport, the fastest both run (NIXL on one host, Mooncake TCP across hosts), and a
pair with none in common is refused naming both offers. Writes then go through the picked
transport only (in-process transports stand in for the real ones; the real pairs are in
tests/integration/test_auto_transport.py)."""

from __future__ import annotations

import ctypes
import itertools

import pytest

from pdxfer.errors import TransportError
from pdxfer.transport.auto import AutoTransport, mismatch, pick
from pdxfer.transport.memory import MemoryFabric, MemoryTransport


@pytest.mark.parametrize("same_host", [True, False])
@pytest.mark.parametrize(
    "a,b",
    list(itertools.product([("nixl", "tcp"), ("tcp",), ("nixl",), ("tcp", "nixl")], repeat=2)),
)
def test_both_sides_pick_the_same_transport(a, b, same_host) -> None:
    assert pick(a, b, same_host) == pick(b, a, same_host)


def test_one_host_prefers_nixl_and_hosts_apart_prefer_mooncake_tcp() -> None:
    both = ("nixl", "tcp")
    assert pick(both, both, same_host=True) == "nixl"
    assert pick(both, both, same_host=False) == "tcp"
    assert pick(both, ("tcp",), same_host=True) == "tcp"  # a side without NIXL: fall back
    assert pick(("nixl",), ("tcp",), same_host=True) is None


def test_an_explicit_transport_against_auto_names_both_and_the_fix() -> None:
    assert mismatch("auto", "auto") == "" and mismatch("nixl", "nixl") == ""
    assert mismatch("tcp", "") == ""  # an old decode that does not say
    why = mismatch("tcp", "auto")
    assert "'tcp'" in why and "'auto'" in why and "on neither" in why


class _Kinds:
    """In-process stand-ins for the kinds ``auto`` would start, on one fabric."""

    def __init__(self) -> None:
        self.fabric = MemoryFabric()
        self.made: dict[str, list[MemoryTransport]] = {}

    def side(self, *kinds: str) -> AutoTransport:
        def make(k: str) -> MemoryTransport:
            t = MemoryTransport(self.fabric)
            self.made.setdefault(k, []).append(t)
            return t

        return AutoTransport(kinds=kinds, make=make)


def pair(a: AutoTransport, b: AutoTransport) -> None:
    a.add_peer(b.session_id, b.peer_info())
    b.add_peer(a.session_id, a.peer_info())


def test_writes_go_through_the_picked_transport_and_land() -> None:
    k = _Kinds()
    pf, dc = k.side("nixl", "tcp"), k.side("nixl", "tcp")
    src = (ctypes.c_uint8 * 4096)(*range(256), *([7] * 3840))
    dst = (ctypes.c_uint8 * 4096)()
    for t, buf in ((pf, src), (dc, dst)):
        t.register(ctypes.addressof(buf), 4096)
    pair(pf, dc)
    assert pf.chosen() == {dc.session_id: "nixl"} and dc.chosen() == {pf.session_id: "nixl"}
    pf.write(dc.session_id, [ctypes.addressof(src)], [ctypes.addressof(dst)], [4096])
    assert bytes(dst) == bytes(src)
    nixl_pf = k.made["nixl"][0]
    assert nixl_pf.stats.bytes == 4096 and pf.stats.bytes == 4096  # one set of counters
    assert dc.probe(pf.session_id)


def test_hosts_apart_pick_mooncake_tcp_on_both_sides() -> None:
    k = _Kinds()
    pf, dc = k.side("nixl", "tcp"), k.side("nixl", "tcp")
    dc.host = "another-host"
    pair(pf, dc)
    assert set(pf.chosen().values()) == set(dc.chosen().values()) == {"tcp"}


def test_no_transport_in_common_refuses_the_pairing_naming_both() -> None:
    k = _Kinds()
    pf, dc = k.side("nixl"), k.side("tcp")
    with pytest.raises(TransportError, match=r"no transport in common.*\['nixl'\].*\['tcp'\]"):
        pf.add_peer(dc.session_id, dc.peer_info())
    with pytest.raises(TransportError, match="not paired"):
        pf.write(dc.session_id, [0], [0], [1])


def test_offers_from_a_peer_not_on_auto_are_refused_clearly() -> None:
    k = _Kinds()
    with pytest.raises(TransportError, match="malformed"):
        k.side("tcp").add_peer("peer", b"\x01\x02garbage")
    assert len(k.made["tcp"]) == 1


def test_a_peer_that_offers_nothing_predates_auto_and_gets_mooncake_tcp() -> None:
    """A Hello or HelloAck without a transport or pairing data comes from a peer older than
    ``auto`` (or one built by hand): those ran Mooncake TCP, found by session alone. Before,
    the endpoint skipped ``add_peer`` for it and every write failed "not paired"."""
    k = _Kinds()
    pf = k.side("nixl", "tcp")
    old = MemoryTransport(k.fabric)  # the old peer: one transport, no offers
    src = (ctypes.c_uint8 * 64)(*range(64))
    dst = (ctypes.c_uint8 * 64)()
    pf.register(ctypes.addressof(src), 64)
    old.register(ctypes.addressof(dst), 64)
    pf.add_peer(old.session_id, old.peer_info())
    assert pf.chosen() == {old.session_id: "tcp"}
    pf.write(old.session_id, [ctypes.addressof(src)], [ctypes.addressof(dst)], [64])
    assert bytes(dst) == bytes(src)
    with pytest.raises(TransportError, match="offers no transport.*Mooncake TCP"):
        k.side("nixl").add_peer(old.session_id, b"")


def test_a_user_who_sets_no_transport_gets_auto_everywhere() -> None:
    """One default for every way in (the engine API, the toy workers' flag and config, the
    vLLM connector's key), so two sides started without a setting pair by ``pick``."""
    import argparse
    import dataclasses

    from pdxfer import EndpointConfig
    from pdxfer.integrations.vllm import config as C
    from pdxfer.serving.cli_args import add_worker_args
    from pdxfer.serving.toy.worker import WorkerConfig

    ap = argparse.ArgumentParser()
    add_worker_args(ap, "decode")
    for cls in (EndpointConfig, WorkerConfig):
        assert {f.name: f.default for f in dataclasses.fields(cls)}["transport"] == "auto", cls
    assert ap.get_default("transport") == "auto"
    assert C.default("transport") == "auto"
    assert C.parse("kv_consumer", {"bootstrap": "127.0.0.1:9"}).get("transport") == "auto"


# -- device pools: NVLink on one node, RDMA across nodes, host pools unchanged ------------------
ALL = ("nixl", "tcp", "nvlink", "rdma")


@pytest.mark.parametrize("same_host", [True, False])
@pytest.mark.parametrize("device", [True, False])
@pytest.mark.parametrize(
    "a,b",
    list(
        itertools.product(
            [ALL, ("nixl", "tcp"), ("tcp", "rdma"), ("nvlink",), ("nixl", "nvlink")], repeat=2
        )
    ),
)
def test_both_sides_pick_the_same_transport_with_device_kinds(a, b, same_host, device) -> None:
    assert pick(a, b, same_host, device) == pick(b, a, same_host, device)


def test_device_pools_take_nvlink_on_one_node_and_rdma_across_nodes() -> None:
    assert pick(ALL, ALL, same_host=True, device=True) == "nvlink"
    assert pick(ALL, ALL, same_host=False, device=True) == "rdma"
    assert pick(ALL, ("nixl", "tcp"), same_host=True, device=True) == "nixl"  # IPC still
    assert pick(ALL, ("nixl", "tcp"), same_host=False, device=True) == "tcp"
    assert pick(("nvlink",), ("nvlink",), same_host=False, device=True) is None  # one node only


def test_host_pools_keep_todays_choices_whatever_else_runs() -> None:
    for mine in (ALL, ("nixl", "tcp")):
        assert pick(mine, ALL, same_host=True) == "nixl"
        assert pick(mine, ALL, same_host=False) == "tcp"
        assert pick(mine, ALL, same_host=True, device=False) == "nixl"
    assert pick(("nvlink", "tcp"), ("nvlink", "tcp"), same_host=True) == "tcp"


def test_auto_starts_nvlink_only_with_a_gpu_and_a_build_that_has_it(monkeypatch) -> None:
    from pdxfer.transport import auto, nvlink

    monkeypatch.setattr(nvlink, "built", lambda: True)
    assert auto.kinds_here(cuda=True, nics=[]) == ("nixl", "tcp", "nvlink")
    assert auto.kinds_here(cuda=False, nics=[]) == ("nixl", "tcp")
    assert auto.kinds_here(cuda=True, nics=["mlx5_0"]) == ("nixl", "tcp", "nvlink", "rdma")
    monkeypatch.setattr(nvlink, "built", lambda: False)
    assert auto.kinds_here(cuda=True, nics=[]) == ("nixl", "tcp")
    assert auto.rdma_devices("/nonexistent") == []


class _AnyMemory(MemoryTransport):
    """Stands in for a transport that takes device memory (the bytes are host memory here);
    remembers what it was given."""

    def __init__(self, fabric: MemoryFabric) -> None:
        super().__init__(fabric)
        self.locations: list[str] = []

    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        self.locations.append(location)
        super().register(addr, nbytes, "cpu", item_bytes)


class _DevKinds(_Kinds):
    def side(self, *kinds: str) -> AutoTransport:
        def make(k: str) -> MemoryTransport:
            t = _AnyMemory(self.fabric)
            self.made.setdefault(k, []).append(t)
            return t

        return AutoTransport(kinds=kinds, make=make)


def _device_side(k: _Kinds, *kinds: str, host_too: bool = False) -> tuple[AutoTransport, list]:
    t = k.side(*kinds)
    bufs = [(ctypes.c_uint8 * 256)()]
    t.register(ctypes.addressof(bufs[0]), 256, "cuda:0")
    if host_too:  # e.g. a decode's host staging buffer
        bufs.append((ctypes.c_uint8 * 256)())
        t.register(ctypes.addressof(bufs[1]), 256, "cpu")
    return t, bufs


def test_device_pools_on_both_sides_pair_over_nvlink_and_writes_land_there() -> None:
    k = _DevKinds()
    (pf, sb), (dc, db) = _device_side(k, *ALL), _device_side(k, *ALL)
    sb[0][:] = bytes(range(256))
    pair(pf, dc)
    assert pf.chosen() == {dc.session_id: "nvlink"} and dc.chosen() == {pf.session_id: "nvlink"}
    pf.write(dc.session_id, [ctypes.addressof(sb[0])], [ctypes.addressof(db[0])], [256])
    assert bytes(db[0]) == bytes(sb[0]) and k.made["nvlink"][0].stats.bytes == 256


def test_a_side_with_host_memory_withholds_nvlink_and_nvlink_never_sees_it() -> None:
    k = _DevKinds()
    (pf, _), (dc, _) = _device_side(k, *ALL), _device_side(k, *ALL, host_too=True)
    assert "nvlink" not in dc.offered() and "nvlink" in pf.offered()
    pair(pf, dc)
    assert set(pf.chosen().values()) == set(dc.chosen().values()) == {"nixl"}
    assert k.made["nvlink"][1].locations == ["cuda:0"]  # the decode's: never its host buffer
    assert k.made["nixl"][1].locations == ["cuda:0", "cpu"]


def test_a_device_kind_that_cannot_register_is_dropped_not_fatal() -> None:
    k = _DevKinds()

    class Refuses(MemoryTransport):
        def register(self, *a, **kw) -> None:
            raise TransportError("no GPUDirect here")

    t = AutoTransport(
        kinds=("tcp", "rdma"),
        make=lambda kind: (Refuses if kind == "rdma" else _AnyMemory)(k.fabric),
    )
    buf = (ctypes.c_uint8 * 64)()
    t.register(ctypes.addressof(buf), 64, "cuda:0")
    assert t.offered() == ["tcp"] and "no GPUDirect" in t._why()
