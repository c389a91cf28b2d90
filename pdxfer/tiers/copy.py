"""Copies between L1 (the engine's pools) and L2 host pages.

L1 pools are addresses plus a location string; this copier handles ``cpu`` pools with numpy
views over the registered buffers. An engine with device pools passes its own ``Copier``
(e.g. one built on its device streams) to ``TieredCache``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..errors import ConfigError
from ..pools import PoolSpec
from .host import HostPool


class Copier(Protocol):
    def to_host(self, pool: str, l1_pages: np.ndarray, host: HostPool,
                host_pages: np.ndarray) -> None: ...

    def to_l1(self, pool: str, host: HostPool, host_pages: np.ndarray,
              l1_pages: np.ndarray) -> None: ...


class CpuCopier:
    """Gather/scatter whole pages per buffer with numpy fancy indexing."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self.views: dict[str, list[np.ndarray]] = {}
        for p in pools:
            if p.kind != "paged" or p.item_bytes == 0:
                continue
            if p.location != "cpu":
                raise ConfigError(f"pool {p.name!r} is on {p.location}: pass a Copier for it")
            n = p.num_items * p.item_bytes
            self.views[p.name] = [
                np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(b.addr)).reshape(
                    p.num_items, p.item_bytes) for b in p.buffers]

    def to_host(self, pool: str, l1_pages: np.ndarray, host: HostPool,
                host_pages: np.ndarray) -> None:
        dst = host.per_buffer()
        for i, v in enumerate(self.views[pool]):
            dst[host_pages, i] = v[l1_pages]

    def to_l1(self, pool: str, host: HostPool, host_pages: np.ndarray,
              l1_pages: np.ndarray) -> None:
        src = host.per_buffer()
        for i, v in enumerate(self.views[pool]):
            v[l1_pages] = src[host_pages, i]
