"""L2: host DRAM pools mirroring the decode's pool group, with an LRU index from page key.

Each data pool of the group (target KV, draft KV, sidecars of any item size) gets one host
array ``[capacity, buffers * item_bytes]``: a page's bytes for every layer are contiguous, so
one page of one pool is one L3 object and one registered region. A logical anchor (no bytes)
gets no host memory: its pages exist only as keys.

An entry maps a page key to one host page per data pool. Allocation takes a page from every
pool or from none (rollback), evicting least-recently-used unpinned entries when a pool is
full. Entries are ``ready`` once their bytes are complete; only ready entries are hits, so a
half-filled page is never served.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..pools import PoolSpec
from .errors import CapacityError
from .observer import CacheObserver

log = logging.getLogger(__name__)

Register = Callable[[int, int, str], None]


class HostPool:
    """One data pool's host mirror; pages are handed out by ``HostCache`` only."""

    def __init__(self, spec: PoolSpec, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"host pool {spec.name!r}: capacity must be > 0")
        self.name = spec.name
        self.nbuf = len(spec.buffers)
        self.item_bytes = spec.item_bytes
        self.page_bytes = self.nbuf * spec.item_bytes
        self.capacity = capacity
        self.data = np.zeros((capacity, self.page_bytes), dtype=np.uint8)
        self.free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def addr(self) -> int:
        return int(self.data.ctypes.data)

    def page_addr(self, page: int) -> int:
        return self.addr + page * self.page_bytes

    def per_buffer(self) -> np.ndarray:
        """``[capacity, buffers, item_bytes]`` view (the L1 copy layout)."""
        return self.data.reshape(self.capacity, self.nbuf, self.item_bytes)


@dataclass(slots=True, eq=False)
class Entry:
    key: str
    pages: dict[str, int]
    pins: int = 0
    ready: bool = False
    digests: dict[str, int] = field(default_factory=dict)
    """Per data pool, the page's digest when it entered L2 (``integrity.page_digest``):
    checked again once it is copied into L1."""


@dataclass(slots=True)
class HostStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    alloc_failures: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class HostCache:
    """The L2 index and its pools. Thread-safe; every method returns at once."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        capacity: int | Mapping[str, int],
        register: Register | None = None,
    ) -> None:
        self.pools: dict[str, HostPool] = {}
        for p in pools:
            if p.kind != "paged" or p.item_bytes == 0:
                continue
            cap = capacity if isinstance(capacity, int) else capacity.get(p.name, 0)
            self.pools[p.name] = HostPool(p, int(cap))
        if not self.pools:
            raise ConfigError("host cache: the pool group has no paged data pool")
        self.lock = threading.RLock()
        self.observer: CacheObserver | None = None
        """Told of ready entries that leave (evicted, cleared)."""
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.stats = HostStats()
        if register is not None:
            for hp in self.pools.values():
                register(hp.addr, hp.data.nbytes, "cpu")

    # -- lookups -------------------------------------------------------------------------------
    def match_and_pin(self, keys: Sequence[str]) -> list[Entry]:
        """Pin and return the ready entries for the longest leading run of ``keys``."""
        out: list[Entry] = []
        with self.lock:
            for k in keys:
                e = self.entries.get(k)
                if e is None or not e.ready:
                    break
                e.pins += 1
                self.entries.move_to_end(k)
                out.append(e)
            self.stats.hits += len(out)
            self.stats.misses += int(len(out) < len(keys))
        return out

    def contains(self, key: str) -> bool:
        with self.lock:
            e = self.entries.get(key)
            return e is not None and e.ready

    # -- allocation ----------------------------------------------------------------------------
    def alloc(self, keys: Sequence[str]) -> list[Entry]:
        """New pinned, not-ready entries for ``keys`` (none present yet): all or nothing."""
        made: list[Entry] = []
        with self.lock:
            try:
                for k in keys:
                    if k in self.entries:
                        raise ConfigError(f"host cache: key {k} already present")
                    e = Entry(k, self._alloc_group(), pins=1)
                    self.entries[k] = e
                    made.append(e)
            except CapacityError:
                self.stats.alloc_failures += 1
                for e in made:
                    self._drop(e)
                raise
            self.stats.inserts += len(made)
        return made

    def _alloc_group(self) -> dict[str, int]:
        got: dict[str, int] = {}
        try:
            for name, hp in self.pools.items():
                while not hp.free:
                    if not self._evict_one():
                        raise CapacityError(
                            f"host pool {name!r}: all {hp.capacity} pages are pinned or in use"
                        )
                got[name] = hp.free.pop()
        except CapacityError:
            for name, pg in got.items():
                self.pools[name].free.append(pg)
            raise
        return got

    def _evict_one(self) -> bool:
        for e in self.entries.values():
            if e.pins == 0 and e.ready:
                self._drop(e)
                self.stats.evictions += 1
                if self.observer is not None:
                    self.observer.removed([e.key])
                return True
        return False

    def _drop(self, e: Entry) -> None:
        self.entries.pop(e.key, None)
        for name, pg in e.pages.items():
            self.pools[name].free.append(pg)
        e.pages = {}

    # -- lifecycle -----------------------------------------------------------------------------
    def commit(self, entries: Sequence[Entry]) -> None:
        """Mark filled entries ready (hits from now on) and drop the filler's pin."""
        with self.lock:
            for e in entries:
                e.ready = True
                e.pins -= 1

    def discard(self, entries: Sequence[Entry]) -> None:
        """Drop entries whose fill failed (they were never served) and free their pages."""
        with self.lock:
            for e in entries:
                e.pins -= 1
                if self.entries.get(e.key) is e:
                    self._drop(e)

    def unpin(self, entries: Sequence[Entry]) -> None:
        with self.lock:
            for e in entries:
                if e.pins <= 0:
                    raise ConfigError(f"host cache: unpin of unpinned key {e.key}")
                e.pins -= 1

    def pin(self, entries: Sequence[Entry]) -> None:
        with self.lock:
            for e in entries:
                e.pins += 1

    def clear(self) -> int:
        """Drop every unpinned entry; returns how many went."""
        with self.lock:
            gone = [e for e in self.entries.values() if e.pins == 0]
            for e in gone:
                self._drop(e)
            if self.observer is not None and gone:
                self.observer.removed([e.key for e in gone if e.ready])
            return len(gone)

    # -- invariants ----------------------------------------------------------------------------
    def check(self) -> str | None:
        """Why the index and the pools disagree, or None: every page is free or owned by
        exactly one entry, in every pool."""
        with self.lock:
            for name, hp in self.pools.items():
                got = [e.pages.get(name) for e in self.entries.values()]
                owned = [p for p in got if p is not None]
                if len(owned) != len(got):
                    return f"pool {name!r}: an entry has no page"
                allp = sorted([*owned, *hp.free])
                if allp != list(range(hp.capacity)):
                    return (
                        f"pool {name!r}: {len(owned)} owned + {len(hp.free)} free pages do "
                        f"not partition [0, {hp.capacity})"
                    )
            return None

    def pinned(self) -> int:
        with self.lock:
            return sum(1 for e in self.entries.values() if e.pins)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            s = self.stats
            return {
                "entries": len(self.entries),
                "pinned": self.pinned(),
                "not_ready": sum(1 for e in self.entries.values() if not e.ready),
                "hits": s.hits,
                "misses": s.misses,
                "evictions": s.evictions,
                "inserts": s.inserts,
                "alloc_failures": s.alloc_failures,
                **{f"free.{n}": len(hp.free) for n, hp in self.pools.items()},
            }
