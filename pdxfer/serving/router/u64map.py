"""An open-addressing hash map from 64-bit keys to fixed-width value columns, in numpy.

Every operation takes a batch of keys and runs vectorized: buckets of ``WAYS`` slots read as
one row, probing on (by a stride of the key's own) only past a full bucket. So the KV index
ingests blocks at numpy speed and costs a few bytes per entry instead of a Python dict's
~100. Keys must already be well mixed (callers hash them); 0 and 1 are reserved (empty,
deleted) and are remapped.
"""

from __future__ import annotations

import numpy as np

EMPTY, DELETED = np.uint64(0), np.uint64(1)
MAX_LOAD = 0.75
GROWN_LOAD = 0.55
"""At most this full after a rehash (so a grown map is 0.27 to 0.75 full)."""
WAYS = 8
"""Slots per bucket: a lookup reads a key's bucket at once, and rarely the next."""


def fix_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the map stores them (the two reserved values moved)."""
    keys = np.asarray(keys, dtype=np.uint64)
    return np.where(keys < 2, keys + np.uint64(2), keys)


def _probe(keys: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """A key's first bucket and its odd stride to the next (double hashing: no clusters)."""
    b = (keys >> np.uint64(32)).astype(np.int64) & (nb - 1)
    step = ((keys >> np.uint64(8)).astype(np.int64) & (nb - 1)) | 1
    return b, step


class U64Map:
    def __init__(self, columns: dict[str, np.dtype | type], capacity: int = 1024) -> None:
        cap = 1 << max(5, (capacity - 1).bit_length())
        self._dtypes = {k: np.dtype(v) for k, v in columns.items()}
        self.keys = np.zeros(cap, np.uint64)
        self.cols = {k: np.zeros(cap, d) for k, d in self._dtypes.items()}
        self.live = 0
        self.used = 0  # live + deleted slots

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return self.keys.nbytes + sum(c.nbytes for c in self.cols.values())

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Per key its slot, or -1 when absent (``keys`` as ``fix_keys`` returns them)."""
        out = np.full(len(keys), -1, np.int64)
        nb = self.capacity // WAYS
        todo = np.arange(len(keys))
        b, step = _probe(keys, nb)
        grid = self.keys.reshape(nb, WAYS)
        while len(todo):
            rows = grid[b]
            eq = rows == keys[todo, None]
            hit = eq.any(axis=1)
            out[todo[hit]] = b[hit] * WAYS + eq[hit].argmax(axis=1)
            go = ~hit & ~(rows == EMPTY).any(axis=1)  # a full bucket: the key may be further
            todo, b, step = todo[go], (b[go] + step[go]) & (nb - 1), step[go]
        return out

    def put(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """Set (insert or overwrite) the keys' values; returns their slots. Duplicate keys
        in one batch: the first wins."""
        if len(keys) > 1:
            keys, first = np.unique(keys, return_index=True)
            values = {k: np.asarray(v)[first] for k, v in values.items()}
        slots = self.find(keys)
        new = np.flatnonzero(slots < 0)
        if len(new):
            if self.used + len(new) > MAX_LOAD * self.capacity:
                self._grow(self.live + len(new))
            slots[new] = self._insert(keys[new])
        for k, v in values.items():
            self.cols[k][slots] = v
        return slots

    def put_absent(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """``put`` for distinct keys known to be absent (the caller just looked)."""
        if self.used + len(keys) > MAX_LOAD * self.capacity:
            self._grow(self.live + len(keys))
        slots = self._insert(keys)
        for k, v in values.items():
            self.cols[k][slots] = v
        return slots

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Place keys known to be absent: each in the first free way of its bucket (or of
        the next bucket with one)."""
        nb = self.capacity // WAYS
        grid = self.keys.reshape(nb, WAYS)
        out = np.empty(len(keys), np.int64)
        todo = np.arange(len(keys))
        b, step = _probe(keys, nb)
        while len(todo):
            free = grid[b] <= DELETED
            has = free.any(axis=1)
            slot = b * WAYS + free.argmax(axis=1)
            cand = np.flatnonzero(has)
            if len(cand):
                _, win = np.unique(slot[cand], return_index=True)
                win = cand[win]
                s = slot[win]
                self.used += int((self.keys[s] == EMPTY).sum())
                self.keys[s] = keys[todo[win]]
                out[todo[win]] = s
                keep = np.ones(len(todo), bool)
                keep[win] = False
                b = np.where(has, b, (b + step) & (nb - 1))[keep]
                todo, step = todo[keep], step[keep]
            else:
                b = (b + step) & (nb - 1)
        self.live += len(keys)
        return out

    def delete_slots(self, slots: np.ndarray) -> None:
        slots = np.unique(slots[slots >= 0])
        self.keys[slots] = DELETED
        self.live -= len(slots)

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.keys > DELETED)

    def _grow(self, need: int) -> None:
        live = self.live_slots()
        keys = self.keys[live]
        vals = {k: c[live] for k, c in self.cols.items()}
        cap = self.capacity
        while need > GROWN_LOAD * cap:
            cap *= 2
        self.keys = np.zeros(cap, np.uint64)
        self.cols = {k: np.zeros(cap, d) for k, d in self._dtypes.items()}
        self.live = self.used = 0
        slots = self._insert(keys)
        for k, v in vals.items():
            self.cols[k][slots] = v
