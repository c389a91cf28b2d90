"""Pack staging and its copies (``plan/pack.py`` gives the layout and the rule).

Both sides of a packed request hold a ``Staging`` on their pools' device: the prefill
gathers a chunk's token rows into its own (``Packer``: one ``index_select`` per buffer with
torch on a device, ``numpy.take`` on the host), writes them as a few large entries into the
decode's lease, and the decode scatters the lease into its pages (``unpack``: one indexed
copy per buffer) when the sender's ``TransferDone`` arrives, before the request can succeed.
A chunk larger than half the prefill's staging is gathered and written in pieces; a piece
that finds the staging full is written straight from the pages.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import knobs
from ..integrity import torch_bytes
from ..plan import Blocks
from ..plan.pack import Pack
from ..pools import PoolSpec
from .staging import Lease, Staging

log = logging.getLogger(__name__)
_U64 = np.uint64
MAX_ENTRY = 64 << 20
"""Gathered runs are split into entries of at most this: a few per write, so a transport
that spreads entries over threads or lanes still can."""


def staging_for(pools: tuple[PoolSpec, ...], mode: str) -> Staging | None:
    """The pack staging an endpoint with ``pools`` holds under ``mode`` (``EndpointConfig.pack``):
    on the device of its first device pool (``auto``: none without one; ``on``: the host
    when every pool is there), ``PDXFER_PACK_MB`` large; None when off or it cannot be had."""
    n = int(knobs().pack_mb * (1 << 20))
    devices = [p.location for p in pools if p.item_bytes and p.location != "cpu"]
    if mode == "off" or n <= 0 or (mode == "auto" and not devices):
        return None
    try:
        return Staging(n, devices[0] if devices else "cpu")
    except Exception as e:  # noqa: BLE001 - e.g. out of device memory: run without packing
        log.warning(
            "no pack staging (%d MiB on %s): requests are not packed: %s",
            n >> 20,
            devices[0] if devices else "cpu",
            e,
        )
        return None


def _rows(addr: int, nrows: int, row_bytes: int, location: str) -> Any:
    """``nrows`` rows of ``row_bytes`` at ``addr``: a numpy view on the host, torch on a device."""
    if location == "cpu":
        raw = (ctypes.c_uint8 * (nrows * row_bytes)).from_address(addr)
        return np.ctypeslib.as_array(raw).reshape(nrows, row_bytes)
    return torch_bytes(addr, nrows * row_bytes, location).view(nrows, row_bytes)


def _sync(location: str) -> None:
    """Wait for this thread's copies on ``location`` (a transport reads the memory next)."""
    if location != "cpu":
        import torch

        torch.cuda.current_stream(torch.device(location)).synchronize()


def _index(rows: np.ndarray, location: str) -> Any:
    if location == "cpu":
        return rows
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows)).to(location, non_blocking=True)


@dataclass(frozen=True, slots=True)
class Gathered:
    """One piece gathered into the prefill's staging: its blocks, and the lease to release."""

    blocks: Blocks
    addr: int
    nbytes: int


def merged(src: list[int], dst: list[int], nb: list[int]) -> Blocks:
    """Blocks contiguous on both sides joined, then split at ``MAX_ENTRY``."""
    out: list[list[int]] = []
    for s, d, n in zip(src, dst, nb):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    cut = [(s + o, d + o, min(MAX_ENTRY, n - o)) for s, d, n in out for o in range(0, n, MAX_ENTRY)]
    return Blocks(
        np.array([c[0] for c in cut], _U64),
        np.array([c[1] for c in cut], _U64),
        np.array([c[2] for c in cut], _U64),
    )


class Packer:
    """The prefill's gather into its pack staging."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging

    def pieces(self, packs: list[Pack]) -> Iterator[list[tuple[Pack, int]]]:
        """The packs' (pack, buffer) parts in groups of at most half the staging."""
        limit = self.staging.nbytes // 2
        group: list[tuple[Pack, int]] = []
        size = 0
        for p in packs:
            for i in range(len(p.src)):
                if group and size + p.part_bytes > limit:
                    yield group
                    group, size = [], 0
                group.append((p, i))
                size += p.part_bytes
        if group:
            yield group

    def gather(self, parts: list[tuple[Pack, int]]) -> Gathered | None:
        """Copy the parts' rows back to back into the staging; None when it is full."""
        total = sum(p.part_bytes for p, _ in parts)
        addr = self.staging.alloc(total) if total else None
        if addr is None:
            return None
        loc = self.staging.location
        src: list[int] = []
        dst: list[int] = []
        nb: list[int] = []
        idx: dict[int, Any] = {}
        off = 0
        for p, i in parts:
            key = id(p)
            if key not in idx:
                idx[key] = _index(p.rows, loc)
            view = _rows(p.src[i], p.src_rows, p.row_bytes, loc)
            out = _rows(addr + off, int(p.rows.size), p.row_bytes, loc)
            _take(view, idx[key], out)
            src.append(addr + off)
            dst.append(p.dst[i])
            nb.append(p.part_bytes)
            off += p.part_bytes
        _sync(loc)
        return Gathered(merged(src, dst, nb), addr, total)

    def release(self, g: Gathered) -> None:
        self.staging.release(g.addr, g.nbytes)


def _take(view: Any, idx: Any, out: Any) -> None:
    if isinstance(view, np.ndarray):
        np.take(view, idx, axis=0, out=out, mode="clip")  # rows checked by the plan
    else:
        import torch

        torch.index_select(view, 0, idx, out=out)


def unpack(
    pool: PoolSpec,
    lease: Lease,
    pages: np.ndarray,
    prefix_len: int,
    num_tokens: int,
    layers: set[tuple[int, str]],
) -> None:
    """Scatter a pack lease into ``pool``'s pages (covering tokens from ``prefix_len``) for
    the buffers ``layers`` the sender wrote: per buffer one indexed copy of the token rows."""
    ntok = num_tokens - prefix_len
    if ntok <= 0:
        return
    tb, ps, loc = pool.token_bytes, pool.page_size, pool.location
    rel = np.arange(ntok, dtype=np.int64)
    rows = np.asarray(pages, dtype=np.int64)[rel // ps] * ps + rel % ps
    idx = _index(rows, loc)
    for j, b in enumerate(pool.buffers):
        if (b.layer_id, b.role) not in layers:
            continue
        dst = _rows(b.addr, pool.num_items * ps, tb, loc)
        src = _rows(lease.addr + j * ntok * tb, ntok, tb, loc)
        if loc == "cpu":
            dst[idx] = src
        else:
            dst.index_copy_(0, idx, src)
    _sync(loc)
