"""Paged KV storage for the toy model: a page allocator and the pools it hands out pages of.

The pool's tensors are the unit the transfer layer registers and copies, so their shapes and
their order are part of the contract: MHA keeps per layer a K and a V tensor shaped
``[num_pages, page_size, n_kv_heads, head_dim]`` (NHD: one token's heads are contiguous, so a
page is ``page_size`` whole tokens) and lists all K layers before all V layers; MLA keeps one
latent tensor ``[num_pages, page_size, kv_lora_rank]`` per layer. A page id means the same
slot in every tensor of a pool, and in every pool that shares an allocator (a draft pool), so
one page table addresses them all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Literal, TypeAlias

import numpy as np
import torch

AttentionKind = Literal["mha", "mla"]
PageTable: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor
"""Logical page ``i`` of a request lives in physical page ``page_table[i]``."""


class OutOfPagesError(RuntimeError):
    """Raised instead of handing out a page twice: the caller must wait, evict or reject."""


class PageAllocator:
    """Free list of page ids, safe to share between a scheduler thread and transfer callbacks.

    Freed pages are reused lowest id first, so a fresh allocator gives contiguous ids and a
    fragmented one gives scattered ids -- both layouts the model must treat identically.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._free = np.ones(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        with self._lock:
            return int(self._free.sum())

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages at once or none, so a failed request never leaks a partial set."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        with self._lock:
            free_ids = np.flatnonzero(self._free)
            if n > free_ids.size:
                raise OutOfPagesError(
                    f"requested {n} pages but only {free_ids.size} of {self.num_pages} are free"
                )
            taken = free_ids[:n]
            self._free[taken] = False
            return [int(i) for i in taken]

    def free(self, ids: Iterable[int]) -> None:
        """Return pages; a double free or a foreign id is a bookkeeping bug, so it raises."""
        arr = np.asarray(list(ids), dtype=np.int64)
        with self._lock:
            if arr.size and (arr.min() < 0 or arr.max() >= self.num_pages):
                raise ValueError(f"page id out of range [0, {self.num_pages}): {arr.tolist()}")
            if np.unique(arr).size != arr.size or self._free[arr].any():
                raise ValueError(f"double free of pages {arr.tolist()}")
            self._free[arr] = True


class KVPool:
    """The paged KV tensors of one model plus the allocator that owns their page ids."""

    def __init__(
        self,
        *,
        kind: AttentionKind,
        num_layers: int,
        num_pages: int,
        page_size: int,
        token_shape: tuple[int, ...],
        dtype: torch.dtype,
        allocator: PageAllocator | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if kind not in ("mha", "mla"):
            raise ValueError(f"unknown attention kind {kind!r}")
        if allocator is not None and allocator.num_pages != num_pages:
            raise ValueError(
                f"shared allocator has {allocator.num_pages} pages but this pool {num_pages}"
            )
        self.kind: AttentionKind = kind
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.allocator = allocator if allocator is not None else PageAllocator(num_pages)
        shape = (num_pages, page_size, *token_shape)
        # Zero-filled so an unwritten page is recognisable (and harmless) when debugging.
        n_tensors = 2 * num_layers if kind == "mha" else num_layers
        self.tensors: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_tensors)
        ]

    @property
    def k_tensors(self) -> list[torch.Tensor]:
        self._need("mha")
        return self.tensors[: self.num_layers]

    @property
    def v_tensors(self) -> list[torch.Tensor]:
        self._need("mha")
        return self.tensors[self.num_layers :]

    @property
    def latent_tensors(self) -> list[torch.Tensor]:
        self._need("mla")
        return list(self.tensors)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """``(k, v)`` for MHA or ``(latent,)`` for MLA: what attention of layer ``i`` reads."""
        if self.kind == "mha":
            return self.tensors[i], self.tensors[self.num_layers + i]
        return (self.tensors[i],)

    @property
    def page_nbytes(self) -> int:
        """Bytes one page occupies summed over all tensors: the cost of moving a page."""
        return sum(t[0].nbytes for t in self.tensors)

    def _need(self, kind: AttentionKind) -> None:
        if self.kind != kind:
            raise AttributeError(f"a {self.kind} pool has no {kind}-only tensors")


def copy_pages(src: KVPool, src_pages: PageTable, dst: KVPool, dst_pages: PageTable) -> None:
    """Byte-for-byte page copy between pools, standing in for a cross-process transfer."""
    s = torch.as_tensor(np.asarray(src_pages, dtype=np.int64))
    d = torch.as_tensor(np.asarray(dst_pages, dtype=np.int64))
    if s.shape != d.shape:
        raise ValueError(f"{s.numel()} source pages but {d.numel()} destination pages")
    if len(src.tensors) != len(dst.tensors) or any(
        a.shape[1:] != b.shape[1:] or a.dtype != b.dtype
        for a, b in zip(src.tensors, dst.tensors, strict=True)
    ):
        raise ValueError("pools have different layouts; pages cannot be copied byte for byte")
    for a, b in zip(src.tensors, dst.tensors, strict=True):
        b[d.to(b.device)] = a[s.to(a.device)].to(b.device)
