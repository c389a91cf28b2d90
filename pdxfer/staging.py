"""Decode-side staging for NHD head slices: big contiguous writes, then one local scatter.

With NHD pages a prefill rank holding fewer heads than the decode rank owns a strided slice of
every destination token; writing it in place costs one transport entry per token and buffer
(tens of microseconds each on TCP). Instead the decode lends the sender a piece of a registered
host buffer: the sender writes its slice of every token packed there (one entry per run of
source pages), and when its ``TransferDone`` arrives the decode scatters the slice into the pool
with one vectorised copy per buffer, before the request can succeed.

Staging layout of one (sender, pool): decode buffer ``j`` of the pool, request token ``k``
(counted from ``prefix_len``) sits at ``addr + (j*ntok + k)*width``. Host (``cpu``) pools only;
other locations keep the per-token path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import numpy as np

from .plan import Blocks
from .pools import BufferSpec, PoolSpec

POOL_NAME = "pdxfer.staging"
DEFAULT_MB = 256


@dataclass(frozen=True, slots=True)
class Lease:
    """One sender's staging for one pool."""

    pool: str
    addr: int
    nbytes: int
    lo: int
    hi: int


class Staging:
    """A registered host buffer handed out first-fit; advertised as an optional slot pool so
    the prefill's bounds check accepts writes into it."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self.addr = int(self.buf.ctypes.data)
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._lock = threading.Lock()

    @staticmethod
    def wanted(pools: tuple[PoolSpec, ...]) -> int:
        """Bytes of staging to reserve: none unless a host pool is NHD and head-sharded."""
        if not any(p.sharding.kind == "heads" and p.token_major and p.location == "cpu"
                   for p in pools):
            return 0
        return int(os.environ.get("PDXFER_STAGING_MB", DEFAULT_MB)) << 20

    def spec(self) -> PoolSpec:
        return PoolSpec(POOL_NAME, "slot", (BufferSpec(self.addr, self.nbytes, 0, "stage"),),
                        self.nbytes, 1, optional=True)

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


def lease_bytes(pool: PoolSpec, ntok: int, lo: int, hi: int) -> int:
    return len(pool.buffers) * ntok * (hi - lo) * pool.sharding.head_bytes


def _host(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def scatter(pool: PoolSpec, lease: Lease, pages: np.ndarray, prefix_len: int, num_tokens: int,
            layers: set[tuple[int, str]]) -> None:
    """Copy a lease's packed head slice into ``pool`` for the buffers ``layers`` the sender
    wrote (``pages`` cover tokens from ``prefix_len``)."""
    ntok = num_tokens - prefix_len
    if ntok <= 0:
        return
    sh = pool.sharding
    width = (lease.hi - lease.lo) * sh.head_bytes
    off = (lease.lo - sh.first_head) * sh.head_bytes
    rel = np.arange(ntok, dtype=np.int64)
    tok = pages[rel // pool.page_size] * pool.page_size + rel % pool.page_size
    stage = _host(lease.addr, lease.nbytes)
    for j, b in enumerate(pool.buffers):
        if (b.layer_id, b.role) not in layers:
            continue
        rows = _host(b.addr, pool.num_items * pool.item_bytes).reshape(-1, pool.token_bytes)
        src = stage[j * ntok * width:(j + 1) * ntok * width].reshape(ntok, width)
        rows[tok, off:off + width] = src


MAX_ENTRY = 8 << 20
"""Split coalesced blocks so one entry never holds the lane for long."""


def bounce(blocks: Blocks, staging: Staging) -> tuple[Blocks, int, int] | None:
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
    return Blocks(np.array(src, u), np.array(dst, u), np.array(nb, u)), addr, total
