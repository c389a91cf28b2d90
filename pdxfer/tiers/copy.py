"""Copies between L1 (the engine's pools) and L2 host pages.

L1 pools are addresses plus a location string. ``CpuCopier`` handles ``cpu`` pools with numpy
views over the registered buffers; ``TorchCopier`` handles pools on a CUDA device through
torch (a gather on one side, one transfer, a scatter on the other). ``default_copier`` picks
one by the pools' location; an engine may pass its own ``Copier`` (e.g. one on its own
streams) to ``TieredCache``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from .. import integrity
from ..config import knobs
from ..errors import ConfigError, PlanError
from ..pools import PoolSpec
from .host import HostPool


class Copier(Protocol):
    def to_host(
        self, pool: str, l1_pages: np.ndarray, host: HostPool, host_pages: np.ndarray
    ) -> None: ...

    def to_l1(
        self, pool: str, host: HostPool, host_pages: np.ndarray, l1_pages: np.ndarray
    ) -> None: ...

    def close(self) -> None:
        """Join any threads the copier started (``TieredCache.close`` calls it)."""
        ...


def _check_pages(pool: str, pages: np.ndarray, num_items: int) -> None:
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_items):
        raise PlanError(f"pool {pool!r}: L1 page index out of range [0, {num_items})")


def default_copier(pools: Sequence[PoolSpec]) -> Copier:
    """``CpuCopier`` when every data pool is in host memory, else ``TorchCopier``."""
    if all(p.location == "cpu" for p in pools if p.kind == "paged" and p.item_bytes):
        return CpuCopier(pools)
    return TorchCopier(pools)


class CpuCopier:
    """One ``memmove`` per (page, buffer): both sides hold a page of one buffer contiguously,
    so this is a single copy (numpy fancy indexing would gather into a temporary first)."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self.threads = _Threads()
        self.bases: dict[str, tuple[np.ndarray, int]] = {}
        self.num_items: dict[str, int] = {}
        for p in pools:
            if p.kind != "paged" or p.item_bytes == 0:
                continue
            if p.location != "cpu":
                raise ConfigError(f"pool {p.name!r} is on {p.location}: pass a Copier for it")
            self.bases[p.name] = (
                np.array([b.addr for b in p.buffers], dtype=np.int64),
                p.item_bytes,
            )
            self.num_items[p.name] = p.num_items

    def _pairs(
        self, pool: str, l1_pages: np.ndarray, host: HostPool, host_pages: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        bases, item = self.bases[pool]
        if item != host.item_bytes or len(bases) != host.nbuf:
            raise ConfigError(f"pool {pool!r}: host pool geometry differs from L1")
        pages = np.asarray(l1_pages, dtype=np.int64)
        _check_pages(pool, pages, self.num_items[pool])
        l1 = bases[None, :] + np.asarray(l1_pages, dtype=np.int64)[:, None] * item
        hp = (
            host.addr
            + np.asarray(host_pages, dtype=np.int64)[:, None] * host.page_bytes
            + np.arange(host.nbuf, dtype=np.int64)[None, :] * item
        )
        return l1.ravel(), hp.ravel(), item

    def to_host(
        self, pool: str, l1_pages: np.ndarray, host: HostPool, host_pages: np.ndarray
    ) -> None:
        l1, hp, item = self._pairs(pool, l1_pages, host, host_pages)
        self.threads.copy(hp, l1, item)

    def to_l1(
        self, pool: str, host: HostPool, host_pages: np.ndarray, l1_pages: np.ndarray
    ) -> None:
        l1, hp, item = self._pairs(pool, l1_pages, host, host_pages)
        self.threads.copy(l1, hp, item)

    def close(self) -> None:
        self.threads.close()


class TorchCopier:
    """Pools anywhere torch reaches (``cuda:N``, or ``cpu``): each buffer is a uint8 view
    ``[pages, item_bytes]`` over its registered memory; a copy gathers the pages of every
    buffer on the source side, moves them in one transfer, and scatters them on the other.
    It returns once the bytes are in place (the device stream is synchronised), as the
    restore's Success and the write-back's digest both read them right after."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        import torch

        self._torch = torch
        self.views: dict[str, list[Any]] = {}
        self.item: dict[str, int] = {}
        self.device: dict[str, Any] = {}
        for p in pools:
            if p.kind != "paged" or p.item_bytes == 0:
                continue
            if not integrity.supported(p.location):
                raise ConfigError(f"pool {p.name!r} is on {p.location}: pass a Copier for it")
            n = p.num_items * p.item_bytes
            self.views[p.name] = [
                integrity.torch_bytes(b.addr, n, p.location).view(p.num_items, p.item_bytes)
                for b in p.buffers
            ]
            self.item[p.name] = p.item_bytes
            self.device[p.name] = torch.device(p.location)

    def _index(self, pool: str, host: HostPool, l1_pages: np.ndarray) -> Any:
        views = self.views[pool]
        if self.item[pool] != host.item_bytes or len(views) != host.nbuf:
            raise ConfigError(f"pool {pool!r}: host pool geometry differs from L1")
        pages = np.asarray(l1_pages, dtype=np.int64)
        _check_pages(pool, pages, views[0].shape[0])
        return self._torch.from_numpy(pages).to(self.device[pool])

    def _sync(self, pool: str) -> None:
        if self.device[pool].type == "cuda":
            self._torch.cuda.synchronize(self.device[pool])

    def to_host(
        self, pool: str, l1_pages: np.ndarray, host: HostPool, host_pages: np.ndarray
    ) -> None:
        idx = self._index(pool, host, l1_pages)
        got = self._torch.stack([v.index_select(0, idx) for v in self.views[pool]], dim=1)
        host.per_buffer()[np.asarray(host_pages, dtype=np.int64)] = got.cpu().numpy()

    def to_l1(
        self, pool: str, host: HostPool, host_pages: np.ndarray, l1_pages: np.ndarray
    ) -> None:
        idx = self._index(pool, host, l1_pages)
        src = host.per_buffer()[np.asarray(host_pages, dtype=np.int64)]  # [n, nbuf, item]
        moved = self._torch.from_numpy(src).to(self.device[pool])
        for b, v in enumerate(self.views[pool]):
            v.index_copy_(0, idx, moved[:, b])
        self._sync(pool)

    def close(self) -> None:
        pass


"""``PDXFER_COPY_NICE``: copy threads run this much nicer than the process. A restore's copy overlaps its own
network suffix (and other requests' transfers), whose transport I/O threads are latency
bound: when cores are short, the copy should fill the gaps they leave rather than stall them
(measured: docs/performance.md#transfer, the L2 -> L1 copy). With spare cores it changes
nothing."""


def _nicer() -> None:
    nice = knobs().copy_nice
    if nice > 0 and hasattr(os, "setpriority"):
        try:  # on Linux, PRIO_PROCESS with a thread id sets that thread only
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
            pass  # not permitted or not supported: run at normal priority


SPLIT_BYTES = 8 << 20
"""Copies larger than this are split across threads: both copiers release the GIL, and one
core's copy does not saturate memory bandwidth."""


def _native() -> Any:
    """The streaming copier (``_ntcopy``, built with the package when a C compiler was
    there), or None: then each page is one ``ctypes.memmove``. ``PDXFER_COPY_STREAM=0``
    turns it off."""
    if not knobs().copy_stream:
        return None
    try:
        from . import _ntcopy
    except ImportError:
        return None
    return _ntcopy


def _run(dst: np.ndarray, src: np.ndarray, item: int, native: Any) -> None:
    if native is not None:  # the whole list in one call, GIL released
        native.copy(
            np.ascontiguousarray(dst).view(np.uint64),
            np.ascontiguousarray(src).view(np.uint64),
            item,
        )
        return
    for d, s in zip(dst.tolist(), src.tolist()):
        ctypes.memmove(d, s, item)


class _Threads:
    """Copy threads (started on first use, joined by ``close``) and the copier to run."""

    def __init__(self) -> None:
        self.workers = knobs().copy_workers
        self.native = _native()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, dst: np.ndarray, src: np.ndarray, item: int) -> None:
        n = int(dst.size)
        parts = min(self.workers, max(1, n * item // SPLIT_BYTES), n) if n else 1
        if parts <= 1:
            _run(dst, src, item, self.native)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix="pdxfer-copy", initializer=_nicer
                )
            pool = self._pool
        bounds = np.linspace(0, n, parts + 1).astype(int)
        futs = [
            pool.submit(_run, dst[a:b], src[a:b], item, self.native)
            for a, b in zip(bounds, bounds[1:])
        ]
        for f in futs:
            f.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
