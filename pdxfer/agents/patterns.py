"""Test geometry and byte patterns that reveal misplacement.

Every byte of a request's KV is a hash of (room, pool, layer, role, token position, byte of the
token within the GLOBAL head range). A byte landing one token, one head, one layer or one
request off therefore shows up as a mismatch, whatever the dtype, TP split or page layout.
Used by the tests, the demo and the benchmarks; not needed by engines.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..pools import PoolSpec

SENTINEL = 0xA5

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int64": torch.int64,
}


@dataclass(frozen=True, slots=True)
class PoolGeom:
    """A pool to allocate: enough to build identical-shaped pools in separate processes.

    ``kind``: ``mha`` (K and V per layer, ``heads`` x ``head_dim``), ``paged`` (one
    ``[pages, page_size, dim]`` buffer per layer, e.g. MLA latent), ``slots`` (``layers``
    buffers of ``[pages, dim]`` rows), ``logical`` (indices only).
    """

    name: str
    kind: Literal["mha", "paged", "slots", "logical"]
    layers: int = 1
    pages: int = 64
    page_size: int = 16
    heads: int = 1
    head_dim: int = 16
    dim: int = 16
    dtype: str = "float16"
    layout: Literal["NHD", "HND"] = "NHD"
    total_heads: int | None = None
    first_head: int = 0
    first_layer: int = 0
    indices_from: str | None = None
    page_remap: bool = False
    optional: bool = False
    device: str = "cpu"
    """Where the pool's tensors live (``cuda:0``: device memory, registered as such)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(_DTYPES)}")
        if self.layers < 1 and self.kind != "logical":
            raise ValueError("layers must be >= 1")


def build(
    geoms: list[PoolGeom], device: str | None = None
) -> tuple[list[PoolSpec], dict[str, list[torch.Tensor]]]:
    """Allocate zeroed tensors for each geometry (on ``device`` if given, else on the
    geometry's own) and describe them as PoolSpecs.

    Tensors are returned per pool in the same order as the PoolSpec's buffers.
    """
    specs: list[PoolSpec] = []
    tensors: dict[str, list[torch.Tensor]] = {}
    where = device
    for g in geoms:
        device = where or g.device
        dt = _DTYPES[g.dtype]
        ids = list(range(g.first_layer, g.first_layer + g.layers))
        if g.kind == "mha":
            shape = (
                (g.pages, g.page_size, g.heads, g.head_dim)
                if g.layout == "NHD"
                else (g.pages, g.heads, g.page_size, g.head_dim)
            )
            k = [torch.zeros(shape, dtype=dt, device=device) for _ in ids]
            v = [torch.zeros(shape, dtype=dt, device=device) for _ in ids]
            specs.append(
                PoolSpec.mha(
                    g.name,
                    k,
                    v,
                    page_size=g.page_size,
                    layout=g.layout,
                    total_heads=g.total_heads,
                    first_head=g.first_head,
                    layer_ids=ids,
                    indices_from=g.indices_from,
                    optional=g.optional,
                    page_remap=g.page_remap,
                )
            )
            tensors[g.name] = k + v
        elif g.kind == "paged":
            ts = [torch.zeros(g.pages, g.page_size, g.dim, dtype=dt, device=device) for _ in ids]
            specs.append(
                PoolSpec.paged(
                    g.name,
                    ts,
                    page_size=g.page_size,
                    layer_ids=ids,
                    indices_from=g.indices_from,
                    optional=g.optional,
                    page_remap=g.page_remap,
                )
            )
            tensors[g.name] = ts
        elif g.kind == "slots":
            ts = [torch.zeros(g.pages, g.dim, dtype=dt, device=device) for _ in ids]
            specs.append(PoolSpec.slots(g.name, ts, layer_ids=ids, optional=g.optional))
            tensors[g.name] = ts
        else:
            specs.append(PoolSpec.logical(g.name, num_pages=g.pages, page_size=g.page_size))
            tensors[g.name] = []
    return specs, tensors


def _ids(spec: PoolSpec, i: int) -> tuple[int, int, int]:
    b = spec.buffers[i]
    return zlib.crc32(spec.name.encode()) & 0xFFFF, b.layer_id, zlib.crc32(b.role.encode()) & 0xFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit avalanche hash (splitmix64's finaliser; int64 arithmetic wraps)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    x = x ^ (x >> 30)
    x = x * -4658895280553007687
    x = x ^ (x >> 27)
    x = x * -7723592293110705685
    return x ^ (x >> 31)


def pattern(
    room: int, pool: int, layer: int, role: int, positions: torch.Tensor, width: int, byte0: int = 0
) -> torch.Tensor:
    """``[len(positions), width]`` uint8 derived from every coordinate.

    Two per-token hashes and one per-byte hash, combined with two uint8 operations (cheap on
    hundreds of MiB): a token row matches another token's row with probability ~2^-16, a
    byte matches a misplaced byte with probability 2^-8.
    """
    seed = ((((room & 0xFFFFFFFF) * 1_000_003 + pool) * 1_000_003 + layer) * 131 + role) % (1 << 40)
    pos = positions.to(torch.int64)
    h1 = (_mix(pos * 2 + seed) & 0xFF).to(torch.uint8)[:, None]
    h2 = (_mix(pos * 2 + 1 + seed * 3) & 0xFF).to(torch.uint8)[:, None]
    g = (_mix(torch.arange(width, dtype=torch.int64) + byte0 + seed * 7) & 0xFF).to(torch.uint8)
    return (g[None, :] + h1) ^ h2


def _token_rows(spec: PoolSpec, t: torch.Tensor) -> torch.Tensor:
    """A ``[num_token_slots, token_bytes]``-indexable uint8 view (HND gathered per head)."""
    u8 = t.view(torch.uint8)
    if spec.sharding.layout == "HND" and spec.page_size > 1 and spec.sharding.kind == "heads":
        sh = spec.sharding
        v = u8.view(spec.num_items, sh.rank_heads, spec.page_size, sh.head_bytes)
        return v.permute(0, 2, 1, 3)  # [pages, ps, heads, hb]
    return u8.view(spec.num_items, spec.page_size, spec.token_bytes)


def _slots_of(
    spec: PoolSpec, pages: np.ndarray, first: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, end, dtype=torch.int64)
    rel = pos - first
    pg = torch.as_tensor(np.asarray(pages, dtype=np.int64))[rel // spec.page_size]
    return pos, pg, rel % spec.page_size


def _on(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x`` (built on the host) where ``t`` lives: patterns and indices are computed on the
    host, pools may be on a device."""
    return x if x.device == t.device else x.to(t.device)


def _byte0(spec: PoolSpec) -> int:
    sh = spec.sharding
    return sh.first_head * sh.head_bytes if sh.kind == "heads" else 0


def fill_tokens(
    spec: PoolSpec,
    tensors: list[torch.Tensor],
    room: int,
    pages: Any,
    first: int,
    start: int,
    end: int,
) -> None:
    """Write the pattern of tokens ``[start, end)`` into ``pages`` (covering from ``first``)."""
    if end <= start or spec.item_bytes == 0:
        return
    pos, pg, off = _slots_of(spec, pages, first, start, end)
    for i, t in enumerate(tensors):
        pid, layer, role = _ids(spec, i)
        pat = pattern(room, pid, layer, role, pos, spec.token_bytes, _byte0(spec))
        rows = _token_rows(spec, t)
        rows[_on(pg, t), _on(off, t)] = _on(pat.view(-1, *rows.shape[2:]), t)


def check_tokens(
    spec: PoolSpec,
    tensors: list[torch.Tensor],
    room: int,
    pages: Any,
    first: int,
    start: int,
    end: int,
) -> tuple[int, str]:
    """Count bytes of tokens ``[start, end)`` that differ from the pattern; describe the first."""
    if end <= start or spec.item_bytes == 0:
        return 0, ""
    pos, pg, off = _slots_of(spec, pages, first, start, end)
    bad, first_bad = 0, ""
    for i, t in enumerate(tensors):
        pid, layer, role = _ids(spec, i)
        pat = pattern(room, pid, layer, role, pos, spec.token_bytes, _byte0(spec))
        got = _token_rows(spec, t)[_on(pg, t), _on(off, t)].reshape(pat.shape).cpu()
        diff = got != pat
        n = int(diff.sum())
        if n and not first_bad:
            r, c = (int(x) for x in diff.nonzero()[0])
            first_bad = (
                f"pool {spec.name} layer {layer} {spec.buffers[i].role} token "
                f"{int(pos[r])} byte {c}: got {int(got[r, c])}, want {int(pat[r, c])}"
            )
        bad += n
    return bad, first_bad


def fill_slot(spec: PoolSpec, tensors: list[torch.Tensor], room: int, slot: int) -> None:
    for i, t in enumerate(tensors):
        pid, layer, role = _ids(spec, i)
        row = t.view(torch.uint8).view(spec.num_items, spec.item_bytes)
        row[slot] = _on(pattern(room, pid, layer, role, torch.zeros(1), spec.item_bytes)[0], t)


def check_slot(
    spec: PoolSpec, tensors: list[torch.Tensor], room: int, slot: int
) -> tuple[int, str]:
    bad = 0
    for i, t in enumerate(tensors):
        pid, layer, role = _ids(spec, i)
        row = t.view(torch.uint8).view(spec.num_items, spec.item_bytes)[slot].cpu()
        bad += int(
            (row != pattern(room, pid, layer, role, torch.zeros(1), spec.item_bytes)[0]).sum()
        )
    return bad, (f"slot pool {spec.name} slot {slot}: {bad} bytes differ" if bad else "")


def fill_sentinel(tensors: dict[str, list[torch.Tensor]]) -> None:
    for ts in tensors.values():
        for t in ts:
            t.view(torch.uint8).fill_(SENTINEL)


def scrub(spec: PoolSpec, tensors: list[torch.Tensor], items: Any) -> None:
    """Refill ``items`` (pages or slots) with the sentinel: what an engine reusing them does
    first, so a byte that lands later shows (``dirty``)."""
    idx = torch.as_tensor(np.asarray(list(items), dtype=np.int64))
    for t in tensors:
        t.view(torch.uint8).view(spec.num_items, -1)[_on(idx, t)] = SENTINEL


def dirty(spec: PoolSpec, tensors: list[torch.Tensor], items: Any) -> int:
    """Bytes of ``items`` that are no longer the sentinel."""
    idx = torch.as_tensor(np.asarray(list(items), dtype=np.int64))
    return sum(
        int((t.view(torch.uint8).view(spec.num_items, -1)[_on(idx, t)] != SENTINEL).sum())
        for t in tensors
    )


def untouched(spec: PoolSpec, tensors: list[torch.Tensor], exclude: Any) -> int:
    """Bytes that are no longer the sentinel in items (pages or slots) not in ``exclude``."""
    keep = np.ones(spec.num_items, dtype=bool)
    ex = np.asarray(list(exclude), dtype=np.int64)
    keep[ex[(ex >= 0) & (ex < spec.num_items)]] = False
    idx = torch.as_tensor(np.flatnonzero(keep))
    bad = 0
    for t in tensors:
        rows = t.view(torch.uint8).view(spec.num_items, -1)
        bad += int((rows[_on(idx, t)] != SENTINEL).sum())
    return bad
