"""The decode worker's prefix-cache seam, and a host-DRAM implementation behind it.

A decode worker asks the cache how much of a prompt it already holds (whole pages only),
copies those pages into the request's pages, and asks the prefill only for the rest
(``prefix_len``). Finished requests write their full prompt pages back. The seam is a
Protocol so the tiered store (L2 host / L3 storage) can replace :class:`HostPrefixCache`
without touching the worker.

Pages are keyed by a hash chain over token ids: page ``i``'s key covers every token up to the
end of page ``i``, so equal keys mean equal prefixes and therefore byte-identical KV (the toy
model is batch-invariant). Every pool with page-indexed tensors is stored (target KV and
draft KV), so a restored prefix brings its draft KV along.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pdxfer.tiers import page_keys as tiers_page_keys

from .kv import KVPool


def page_keys(tokens: Sequence[int], page_size: int, salt: str = "") -> list[str]:
    """The tiers' hash chain over full pages (one key scheme in pdxfer); ``salt`` scopes
    the keys (a tenant: one tenant's prompts are never another's cache hits)."""
    return tiers_page_keys(np.asarray(tokens, dtype=np.int64), page_size, salt)


class PrefixCache(Protocol):
    """What a decode worker needs from a prefix store."""

    def match(self, tokens: Sequence[int], salt: str = "") -> int:
        """Number of leading tokens (a multiple of the page size) that can be restored."""
        ...

    def restore(self, tokens: Sequence[int], num_tokens: int, page_table: Sequence[int],
                salt: str = "") -> int:
        """Copy the first ``num_tokens`` tokens' KV into ``page_table``'s pages; returns the
        tokens actually restored (may be fewer if pages were evicted since ``match``)."""
        ...

    def write_back(self, tokens: Sequence[int], page_table: Sequence[int],
                   salt: str = "") -> None:
        """Keep the full pages of ``tokens`` whose KV sits in ``page_table``'s pages."""
        ...

    def stats(self) -> dict[str, int]:
        ...


class HostPrefixCache:
    """LRU of page copies in host memory, for one or more pools sharing page ids."""

    def __init__(self, pools: Sequence[KVPool], capacity_pages: int) -> None:
        if not pools:
            raise ValueError("HostPrefixCache needs at least one pool")
        if capacity_pages < 0:
            raise ValueError(f"capacity_pages must be >= 0, got {capacity_pages}")
        self.pools = list(pools)
        self.page_size = pools[0].page_size
        self.capacity = capacity_pages
        self._lock = threading.Lock()
        self._pages: collections.OrderedDict[str, list[list[torch.Tensor]]] = (
            collections.OrderedDict())
        self._counters = collections.Counter[str]()

    def _max_pages(self, tokens: Sequence[int]) -> int:
        # Leave at least one token to the prefill: it computes the first output token.
        return max(0, (len(tokens) - 1) // self.page_size)

    def match(self, tokens: Sequence[int], salt: str = "") -> int:
        keys = page_keys(tokens, self.page_size, salt)[: self._max_pages(tokens)]
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._pages:
                    break
                n += 1
        return n * self.page_size

    def restore(self, tokens: Sequence[int], num_tokens: int, page_table: Sequence[int],
                salt: str = "") -> int:
        keys = page_keys(tokens, self.page_size, salt)[: num_tokens // self.page_size]
        with self._lock:
            copies = []
            for k in keys:
                c = self._pages.get(k)
                if c is None:
                    break
                self._pages.move_to_end(k)
                copies.append(c)
        for i, per_pool in enumerate(copies):
            dst = int(page_table[i])
            for pool, saved in zip(self.pools, per_pool, strict=True):
                for t, s in zip(pool.tensors, saved, strict=True):
                    t[dst].copy_(s)
        self._counters["restored_pages"] += len(copies)
        return len(copies) * self.page_size

    def write_back(self, tokens: Sequence[int], page_table: Sequence[int],
                   salt: str = "") -> None:
        if self.capacity == 0:
            return
        keys = page_keys(tokens, self.page_size, salt)
        for i, k in enumerate(keys):
            with self._lock:
                if k in self._pages:
                    self._pages.move_to_end(k)
                    continue
            src = int(page_table[i])
            per_pool = [[t[src].clone() for t in pool.tensors] for pool in self.pools]
            with self._lock:
                self._pages[k] = per_pool
                self._counters["stored_pages"] += 1
                while len(self._pages) > self.capacity:
                    self._pages.popitem(last=False)
                    self._counters["evicted_pages"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counters, "cached_pages": len(self._pages)}
