"""An open-addressing hash map from 64-bit keys to fixed-width value columns, in numpy.

Every operation takes a batch of keys, in one compiled loop (numba): buckets of ``WAYS``
slots, probing on (by a stride of the key's own) only past a full bucket. So the KV index
ingests blocks at compiled speed and costs a few bytes per entry instead of a Python dict's
~100. Keys must already be well mixed (callers hash them); 0 and 1 are reserved (empty,
deleted) and are remapped.
"""

from __future__ import annotations

import numba
import numpy as np

EMPTY, DELETED = np.uint64(0), np.uint64(1)
MAX_LOAD = 0.75
GROWN_LOAD = 0.55
"""At most this full after a rehash (so a grown map is 0.27 to 0.75 full)."""
WAYS = 8
"""Slots per bucket: a lookup reads a key's bucket at once, and rarely the next."""
AHEAD = 16
"""Keys whose buckets are loaded together before they are probed one by one."""


def fix_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the map stores them (the two reserved values moved)."""
    keys = np.asarray(keys, dtype=np.uint64)
    return np.where(keys < 2, keys + np.uint64(2), keys)


@numba.njit(cache=True, nogil=True)
def _touch(table: np.ndarray, keys: np.ndarray, i: int, m: int) -> np.uint64:
    """Load the first buckets of keys ``i`` to ``i + AHEAD`` at once: independent loads,
    so their cache misses overlap instead of one probe waiting for the last."""
    acc = np.uint64(0)
    for t in range(i, min(i + AHEAD, len(keys))):
        acc ^= table[(int(keys[t] >> np.uint64(32)) & m) * WAYS]
    return acc


@numba.njit(cache=True, nogil=True)
def _find(table: np.ndarray, keys: np.ndarray, out: np.ndarray) -> np.uint64:
    nb = len(table) // WAYS
    m = nb - 1
    sink = np.uint64(0)
    for i in range(len(keys)):
        if i % AHEAD == 0:
            sink ^= _touch(table, keys, i, m)
        k = keys[i]
        b = int(k >> np.uint64(32)) & m
        step = (int(k >> np.uint64(8)) & m) | 1
        out[i] = -1
        for _ in range(nb):
            empty = False
            for j in range(WAYS):
                x = table[b * WAYS + j]
                if x == k:
                    out[i] = b * WAYS + j
                    empty = True
                    break
                if x == EMPTY:
                    empty = True
            if empty:
                break
            b = (b + step) & m
    return sink


@numba.njit(cache=True, nogil=True)
def _upsert(table: np.ndarray, keys: np.ndarray, out: np.ndarray, absent: bool,
            new: np.ndarray) -> tuple[int, int]:
    """Each key's slot, placing the absent ones (in the first free way of their probe
    chain; ``new`` marks them); ``absent``: the caller knows none is present. Returns how
    many it placed, and how many of those took an EMPTY slot (not a DELETED one)."""
    nb = len(table) // WAYS
    m = nb - 1
    used = 0
    placed = 0
    sink = np.uint64(0)
    for i in range(len(keys)):
        if i % AHEAD == 0:
            sink ^= _touch(table, keys, i, m)
        k = keys[i]
        b = int(k >> np.uint64(32)) & m
        step = (int(k >> np.uint64(8)) & m) | 1
        free = -1
        out[i] = -1
        new[i] = False
        for _ in range(nb):
            empty = False
            for j in range(WAYS):
                s = b * WAYS + j
                x = table[s]
                if x == k and not absent:
                    out[i] = s
                    empty = True
                    break
                if x <= DELETED:
                    if free < 0:
                        free = s
                    if x == EMPTY:
                        empty = True
                        if absent:
                            break
            if empty or (absent and free >= 0):
                break
            b = (b + step) & m
        if out[i] < 0:
            if table[free] == EMPTY:
                used += 1
            table[free] = k
            out[i] = free
            new[i] = True
            placed += 1
    return placed, used + int(sink & np.uint64(0))


@numba.njit(cache=True, nogil=True)
def _upsert_col(table: np.ndarray, col: np.ndarray, keys: np.ndarray, vals: np.ndarray,
                slots: np.ndarray, new: np.ndarray, cur: np.ndarray) -> tuple[int, int]:
    """``_upsert`` that also sets ``col`` of each placed key to its value and reads it for
    the others (into ``cur``), the bucket and its column loaded ahead together."""
    nb = len(table) // WAYS
    m = nb - 1
    sink = np.uint64(0)
    placed = used = 0
    for a in range(0, len(keys), AHEAD):
        for t in range(a, min(a + AHEAD, len(keys))):
            b = (int(keys[t] >> np.uint64(32)) & m) * WAYS
            sink ^= table[b] ^ np.uint64(col[b])
        p, u = _upsert(table, keys[a:a + AHEAD], slots[a:a + AHEAD], False, new[a:a + AHEAD])
        placed += p
        used += u
        for t in range(a, min(a + AHEAD, len(keys))):
            if new[t]:
                col[slots[t]] = vals[t]
            cur[t] = col[slots[t]]
    return placed, used + int(sink & np.uint64(0))


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
        out = np.empty(len(keys), np.int64)
        _find(self.keys, np.ascontiguousarray(keys, np.uint64), out)
        return out

    def put(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """Set (insert or overwrite) the keys' values; returns their slots. Duplicate keys
        in one batch: the last wins (as one put after another)."""
        slots, _ = self.upsert(keys)
        for k, v in values.items():
            self.cols[k][slots] = v
        return slots

    def upsert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's slot, placing the absent ones (their values left to the caller), and
        which were placed (a key twice in ``keys``: placed the first time)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if self.used + len(keys) > MAX_LOAD * self.capacity:  # as if all were new
            self._grow(self.live + len(keys))
        slots = np.empty(len(keys), np.int64)
        new = np.empty(len(keys), bool)
        placed, used = _upsert(self.keys, keys, slots, False, new)
        self.live += placed
        self.used += used
        return slots, new

    def upsert_col(self, name: str, keys: np.ndarray, vals: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``upsert``, column ``name`` set to ``vals`` for the placed keys; returns the
        slots, which were placed, and every key's ``name`` after."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if self.used + len(keys) > MAX_LOAD * self.capacity:
            self._grow(self.live + len(keys))
        col = self.cols[name]
        n = len(keys)
        slots, new, cur = np.empty(n, np.int64), np.empty(n, bool), np.empty(n, col.dtype)
        placed, used = _upsert_col(self.keys, col, keys, np.ascontiguousarray(vals, col.dtype),
                                   slots, new, cur)
        self.live += placed
        self.used += used
        return slots, new, cur

    def put_absent(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """``put`` for distinct keys known to be absent (the caller just looked)."""
        if self.used + len(keys) > MAX_LOAD * self.capacity:
            self._grow(self.live + len(keys))
        slots = self._insert(np.ascontiguousarray(keys, np.uint64))
        for k, v in values.items():
            self.cols[k][slots] = v
        return slots

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(len(keys), np.int64)
        placed, used = _upsert(self.keys, keys, out, True, np.empty(len(keys), bool))
        self.live += placed
        self.used += used
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
