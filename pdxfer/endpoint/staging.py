"""Decode-side staging for head slices: big contiguous writes, then one local scatter.

When prefill and decode ranks hold different heads (heterogeneous TP), a sender's slice of a
destination is small and scattered: with NHD pages it is a strided piece of every token (one
transport entry per token and buffer in place), with HND pages one block per page and buffer.
Each entry costs tens of microseconds on TCP, so entry count, not bytes, decides the speed.
Instead the decode lends the sender a piece of a registered host buffer: the sender writes its
slice packed there (its own gather, ``bounce``, turns scattered sources into a few big entries),
and when its ``TransferDone`` arrives the decode scatters the slice into the pool with one
vectorised copy per buffer, before the request can succeed (``Staging`` gives the layout).

Host (``cpu``) pools only; other locations, and a full staging buffer, keep the in-place path.
The allocator also holds the pack staging of whole-row packing (``pack.py``), on a device.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..config import knobs
from ..plan import Blocks
from ..plan.heads import STAGING_POOL, staged_unit
from ..pools import BufferSpec, PoolSpec

POOL_NAME = STAGING_POOL


@dataclass(frozen=True, slots=True)
class Bounced:
    """Blocks gathered into staging by ``bounce``, and the staging to release after the
    write."""

    blocks: Blocks
    addr: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Lease:
    """One sender's staging for one pool: heads ``[lo, hi)`` of a head slice, or whole token
    rows (``packed``, in the pack staging)."""

    pool: str
    addr: int
    nbytes: int
    lo: int
    hi: int
    packed: bool = False


class Staging:
    """A registered host buffer handed out first-fit; advertised as an optional slot pool so
    the prefill's bounds check accepts writes into it.

    Layout of one (sender, pool) lease with heads ``[lo, hi)``, ``width =
    (hi-lo)*head_bytes``, ``ntok`` request tokens counted from ``prefix_len``:

    - token-major (NHD, or page size 1): decode buffer ``j``, request token ``k`` sits at
      ``addr + (j*ntok + k)*width``.
    - HND: decode buffer ``j``, request page ``i`` (``npages = ceil(ntok/page_size)``) is one
      block of ``width*page_size`` bytes at ``addr + (j*npages + i)*width*page_size``: the
      page's heads ``[lo, hi)`` in page order, as they sit (contiguous) inside an HND page.

    Either way consecutive tokens or pages are back to back, which is what lets ``bounce``
    merge."""

    def __init__(self, nbytes: int, location: str = "cpu") -> None:
        self.location = location
        if location == "cpu":
            host = np.empty(nbytes, dtype=np.uint8)
            self.buf: object = host
            self.addr = int(host.ctypes.data)
        else:  # a device (``cuda:N``): the pack staging of device pools (``pack.py``)
            import torch

            dev = torch.empty(nbytes, dtype=torch.uint8, device=location)
            self.buf = dev
            self.addr = int(dev.data_ptr())
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Threads that split large scatters; started on first use, joined by ``close``."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=SCATTER_WORKERS, thread_name_prefix="pdxfer-scatter"
                )
            return self._executor

    def close(self) -> None:
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)

    @staticmethod
    def wanted(pools: tuple[PoolSpec, ...]) -> int:
        """Bytes of staging to reserve: none unless a host pool is head-sharded (either layout:
        only those pools can receive head slices)."""
        if not any(p.sharding.kind == "heads" and p.location == "cpu" for p in pools):
            return 0
        return int(knobs().staging_mb * (1 << 20))

    def spec(self, name: str = POOL_NAME) -> PoolSpec:
        return PoolSpec(
            name,
            "slot",
            (BufferSpec(self.addr, self.nbytes, 0, "stage"),),
            self.nbytes,
            1,
            location=self.location,
            optional=True,
        )

    def alloc(self, n: int) -> int | None:
        """Address of ``n`` free bytes (64-byte aligned), or None when full."""
        n = -(-n // 64) * 64
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= n:
                    self._free[i] = (off + n, size - n)
                    return self.addr + off
        return None

    def release(self, addr: int, n: int) -> None:
        n = -(-n // 64) * 64
        with self._lock:
            self._free.append((addr - self.addr, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                elif size:
                    merged.append((off, size))
            self._free = merged


def _host(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


SCATTER_WORKERS = max(1, min(4, os.cpu_count() or 1))  # not a knob: latency, not CPU share
SCATTER_SPLIT_BYTES = 8 << 20
"""A scatter larger than this is split over threads by buffer: numpy's fancy-indexed copy
releases the GIL, and one core's copy does not saturate memory bandwidth. The scatter sits
between a sender's last byte landing and the request's Success, so its time is latency."""


def scatter(
    pool: PoolSpec,
    lease: Lease,
    pages: np.ndarray,
    prefix_len: int,
    num_tokens: int,
    layers: set[tuple[int, str]],
    executor: ThreadPoolExecutor | None = None,
) -> None:
    """Copy a lease's packed head slice into ``pool`` for the buffers ``layers`` the sender
    wrote (``pages`` cover tokens from ``prefix_len``): per buffer, one fancy-indexed copy of
    the packed units into their rows (tokens, or whole pages for HND), no per-unit loop."""
    ntok = num_tokens - prefix_len
    if ntok <= 0:
        return
    sh = pool.sharding
    count, unit = staged_unit(pool, ntok, lease.lo, lease.hi)
    off = (lease.lo - sh.first_head) * sh.head_bytes
    if pool.token_major:
        row_bytes = pool.token_bytes
        rel = np.arange(ntok, dtype=np.int64)
        idx = pages[rel // pool.page_size] * pool.page_size + rel % pool.page_size
    else:  # HND: the slice is one block at the same offset of every page
        row_bytes, off = pool.item_bytes, off * pool.page_size
        idx = np.asarray(pages[:count], dtype=np.int64)
    stage = _host(lease.addr, lease.nbytes)
    jobs = [
        (
            _host(b.addr, pool.num_items * pool.item_bytes).reshape(-1, row_bytes),
            stage[j * count * unit : (j + 1) * count * unit].reshape(count, unit),
        )
        for j, b in enumerate(pool.buffers)
        if (b.layer_id, b.role) in layers
    ]

    def run(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for rows, src in part:
            rows[idx, off : off + unit] = src

    parts = (
        1
        if executor is None
        else min(
            SCATTER_WORKERS, len(jobs), max(1, len(jobs) * count * unit // SCATTER_SPLIT_BYTES)
        )
    )
    if parts <= 1:
        run(jobs)
        return
    assert executor is not None
    for f in [executor.submit(run, jobs[i::parts]) for i in range(parts)]:
        f.result()


MAX_ENTRY = 8 << 20
"""Split coalesced blocks so one entry never holds the lane for long."""


def bounce(blocks: Blocks, staging: Staging) -> Bounced | None:
    """Copy scattered sources whose destinations are back to back into ``staging`` and
    return fewer, larger blocks (with the lease to release after the write), or None when
    that would not save entries or staging is full. Host sources only."""
    n = len(blocks)
    if n < 64:
        return None
    ends = blocks.dst[:-1] + blocks.nbytes[:-1]
    brk = np.flatnonzero(blocks.dst[1:] != ends) + 1
    if (brk.size + 1) * 4 > n:
        return None
    total = blocks.total_bytes
    addr = staging.alloc(total)
    if addr is None:
        return None
    off = np.concatenate(([0], np.cumsum(blocks.nbytes[:-1].astype(np.int64))))
    for s, o, ln in zip(blocks.src.tolist(), off.tolist(), blocks.nbytes.tolist()):
        ctypes.memmove(addr + o, s, ln)
    starts = np.concatenate(([0], brk))
    stops = np.concatenate((brk, [n]))
    src: list[int] = []
    dst: list[int] = []
    nb: list[int] = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        pos, end = int(off[a]), int(off[b - 1]) + int(blocks.nbytes[b - 1])
        d0 = int(blocks.dst[a]) - pos
        while pos < end:
            step = min(MAX_ENTRY, end - pos)
            src.append(addr + pos)
            dst.append(d0 + pos)
            nb.append(step)
            pos += step
    u = np.uint64
    return Bounced(Blocks(np.array(src, u), np.array(dst, u), np.array(nb, u)), addr, total)
