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

from ..errors import ConfigError, PlanError
from ..pools import PoolSpec
from .host import HostPool


class Copier(Protocol):
    def to_host(self, pool: str, l1_pages: np.ndarray, host: HostPool,
                host_pages: np.ndarray) -> None: ...

    def to_l1(self, pool: str, host: HostPool, host_pages: np.ndarray,
              l1_pages: np.ndarray) -> None: ...


class CpuCopier:
    """One ``memmove`` per (page, buffer): both sides hold a page of one buffer contiguously,
    so this is a single copy (numpy fancy indexing would gather into a temporary first)."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self.bases: dict[str, tuple[np.ndarray, int]] = {}
        self.num_items: dict[str, int] = {}
        for p in pools:
            if p.kind != "paged" or p.item_bytes == 0:
                continue
            if p.location != "cpu":
                raise ConfigError(f"pool {p.name!r} is on {p.location}: pass a Copier for it")
            self.bases[p.name] = (np.array([b.addr for b in p.buffers], dtype=np.int64),
                                  p.item_bytes)
            self.num_items[p.name] = p.num_items

    def _pairs(self, pool: str, l1_pages: np.ndarray, host: HostPool, host_pages: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, int]:
        bases, item = self.bases[pool]
        if item != host.item_bytes or len(bases) != host.nbuf:
            raise ConfigError(f"pool {pool!r}: host pool geometry differs from L1")
        pages = np.asarray(l1_pages, dtype=np.int64)
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.num_items[pool]):
            raise PlanError(f"pool {pool!r}: L1 page index out of range [0, "
                            f"{self.num_items[pool]})")
        l1 = bases[None, :] + np.asarray(l1_pages, dtype=np.int64)[:, None] * item
        hp = (host.addr + np.asarray(host_pages, dtype=np.int64)[:, None] * host.page_bytes
              + np.arange(host.nbuf, dtype=np.int64)[None, :] * item)
        return l1.ravel(), hp.ravel(), item

    def to_host(self, pool: str, l1_pages: np.ndarray, host: HostPool,
                host_pages: np.ndarray) -> None:
        l1, hp, item = self._pairs(pool, l1_pages, host, host_pages)
        for d, s in zip(hp.tolist(), l1.tolist()):
            ctypes.memmove(d, s, item)

    def to_l1(self, pool: str, host: HostPool, host_pages: np.ndarray,
              l1_pages: np.ndarray) -> None:
        l1, hp, item = self._pairs(pool, l1_pages, host, host_pages)
        for d, s in zip(l1.tolist(), hp.tolist()):
            ctypes.memmove(d, s, item)
