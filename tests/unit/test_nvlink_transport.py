"""Mooncake's ``nvlink_intra`` as pdxfer's ``nvlink`` transport, what runs without a GPU: the
choice is validated (a build without it is refused, host memory is refused), the engine
starts with ``MC_INTRANODE_NVLINK`` set and no other engine sees it, and whole CUDA
allocations are registered once each (the peer maps an IPC handle at the allocation's
start). A fake engine stands in for Mooncake's; ``gpu_probe.py`` runs the real one."""

from __future__ import annotations

import os

import pytest

from pdxfer.config import EndpointConfig
from pdxfer.errors import ConfigError, TransportUnavailable
from pdxfer.transport import make_transport, mooncake, nvlink


class _Engine:
    seen_env: list[str | None] = []

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, str]] = []
        self.unregistered: list[int] = []

    def initialize(self, host: str, meta: str, protocol: str, device: str) -> int:
        _Engine.seen_env.append(os.environ.get(nvlink.ENV))
        return 0

    def get_rpc_port(self) -> int:
        return 4242

    def register_memory(self, addr: int, n: int, loc: str) -> int:
        self.registered.append((addr, n, loc))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(mooncake, "_load_engine", lambda: _Engine)
    monkeypatch.setattr(nvlink, "built", lambda: True)
    monkeypatch.setenv(nvlink.ENV, "user-value")
    _Engine.seen_env.clear()
    # two allocations: [0x10000, +0x10000) and [0x40000, +0x8000)
    allocs = [(0x10000, 0x10000), (0x40000, 0x8000)]
    monkeypatch.setattr(
        nvlink,
        "cuda_allocation",
        lambda a: next((x for x in allocs if x[0] <= a < x[0] + x[1]), None),
    )
    return allocs


def test_the_nvlink_engine_starts_with_the_variable_and_others_without_it(fake) -> None:
    t = make_transport("nvlink", "127.0.0.1")
    assert t.protocol == "nvlink_intra" and t.session_id == "127.0.0.1:4242"
    make_transport("tcp", "127.0.0.1")
    assert _Engine.seen_env == ["1", None]  # a user's export reaches neither as it was
    assert os.environ[nvlink.ENV] == "user-value"  # and is back afterwards


def test_whole_allocations_are_registered_once_and_released_with_their_last_buffer(fake) -> None:
    t = make_transport("nvlink", "127.0.0.1")
    eng = t._engine
    t.register(0x10000, 0x4000, "cuda:0")  # the allocation's first buffer
    t.register(0x14000, 0x4000, "cuda:0")  # a second one inside it
    t.register(0x40000, 0x8000, "cuda:0")  # a buffer that is its own allocation
    assert eng.registered == [(0x10000, 0x10000, "cuda:0"), (0x40000, 0x8000, "cuda:0")]
    t.deregister(0x10000)
    assert eng.unregistered == []
    t.deregister(0x14000)
    assert eng.unregistered == [0x10000]


def test_host_memory_is_refused_with_what_to_use_instead(fake) -> None:
    t = make_transport("nvlink", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"device memory only.*'cpu'.*'nixl', 'tcp' or 'auto'"):
        t.register(0x1000, 4096, "cpu")


def test_a_build_without_nvlink_intra_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(nvlink, "built", lambda: False)
    with pytest.raises(TransportUnavailable, match="nvlink_intra.*not in this build"):
        mooncake.MooncakeTransport(protocol="nvlink_intra")
    with pytest.raises(ConfigError, match="protocol must be one of"):
        mooncake.MooncakeTransport(protocol="nvlink")


def test_the_cpu_wheel_has_no_nvlink_intra_and_configs_accept_the_name() -> None:
    nvlink.built.cache_clear()
    assert nvlink.built() is False  # mooncake-transfer-engine-non-cuda, installed here
    EndpointConfig(role="decode", transport="nvlink")
    with pytest.raises(ConfigError, match="'nvlink'"):
        EndpointConfig(role="decode", transport="nvlink_intra")


def test_allocations_take_a_buffer_as_its_own_where_the_driver_cannot_say() -> None:
    a = nvlink.Allocations(lookup=lambda addr: None)
    assert a.add(0x5000, 64) == (0x5000, 64, True)
    assert a.remove(0x5000) == 0x5000 and a.remove(0x5000) is None
