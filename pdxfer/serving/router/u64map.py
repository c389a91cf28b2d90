"""An open-addressing hash map from 64-bit keys to fixed-width value columns, in numpy.

Every operation takes a batch of keys, in one compiled loop (numba): buckets of ``WAYS``
slots, probing on (by a stride of the key's own) only past a full bucket. So the KV index
ingests blocks at compiled speed and costs a few bytes per entry instead of a Python dict's
~100. Keys must already be well mixed (callers hash them); 0 and 1 are reserved (empty,
deleted) and are remapped.
"""

from __future__ import annotations

import mmap

import numpy as np

from .jit import numba
from .prefetch import prefetch

EMPTY, DELETED = np.uint64(0), np.uint64(1)
MAX_LOAD = 0.75
GROWN_LOAD = 0.55
"""At most this full after a rehash (so a grown map is 0.27 to 0.75 full)."""
WAYS = 8
"""Slots per bucket: a lookup reads a key's bucket at once, and rarely the next."""
AHEAD = 16
"""How many keys ahead a key's bucket is prefetched, before it is probed."""


HUGE = 4 << 20
"""Arrays from this size on are mapped on their own, asking for transparent huge pages."""


def zeros(n: int, dtype: np.dtype | type) -> np.ndarray:
    """``np.zeros``; a large array on huge pages where the kernel gives them: a map grows
    into fresh memory, and faulting it in 4 KiB at a time costs more than filling it."""
    dt = np.dtype(dtype)
    size = n * dt.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < HUGE or advise is None:
        return np.zeros(n, dt)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(advise)
    except OSError:
        pass
    return np.frombuffer(m, dt, n)  # anonymous memory is zeroed; the array keeps the map


def slots_for(entries: int) -> int:
    """The capacity (slots) that holds ``entries`` without growing."""
    return 1 << max(5, (int(np.ceil(entries / MAX_LOAD)) - 1).bit_length())


def fix_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the map stores them (the two reserved values moved)."""
    keys = np.asarray(keys, dtype=np.uint64)
    return np.where(keys < 2, keys + np.uint64(2), keys)


@numba.njit(cache=True, nogil=True, inline="always")
def _bucket(k: np.uint64, m: int) -> int:
    return int(k >> np.uint64(32)) & m


@numba.njit(cache=True, nogil=True)
def _find(table: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    """Each key's slot or -1. The bucket of the key ``AHEAD`` on is prefetched first: the
    cache misses overlap instead of one probe waiting for the last."""
    nb = len(table) // WAYS
    m = nb - 1
    n = len(keys)
    for t in range(min(AHEAD, n)):
        prefetch(table, _bucket(keys[t], m) * WAYS)
    for i in range(n):
        if i + AHEAD < n:
            prefetch(table, _bucket(keys[i + AHEAD], m) * WAYS)
        k = keys[i]
        b = _bucket(k, m)
        step = (int(k >> np.uint64(8)) & m) | 1
        o = -1
        for _ in range(nb):
            end = False
            base = b * WAYS
            for j in range(WAYS):
                x = table[base + j]
                if x == k:
                    o = base + j
                    end = True
                    break
                if x == EMPTY:  # ways fill in order: none past an empty one
                    end = True
                    break
            if end:
                break
            b = (b + step) & m
        out[i] = o


@numba.njit(cache=True, nogil=True, inline="always")
def _place(table: np.ndarray, k: np.uint64, m: int, nb: int, absent: bool) -> tuple[int, int]:
    """Key ``k``'s slot, placed in the first free way of its probe chain when absent
    (``absent``: the caller knows it is); and what that took: 0 (found), 1 (a DELETED way),
    2 (an EMPTY one)."""
    b = _bucket(k, m)
    step = (int(k >> np.uint64(8)) & m) | 1
    free = -1
    for _ in range(nb):
        base = b * WAYS
        for j in range(WAYS):
            x = table[base + j]
            if x == k and not absent:
                return base + j, 0
            if x <= DELETED:
                if free < 0:
                    free = base + j
                if x == EMPTY or absent:
                    took = 2 if table[free] == EMPTY else 1
                    table[free] = k
                    return free, took
        b = (b + step) & m
    took = 2 if table[free] == EMPTY else 1  # every bucket probed (never: the map grows first)
    table[free] = k
    return free, took


@numba.njit(cache=True, nogil=True)
def _upsert(
    table: np.ndarray,
    keys: np.ndarray,
    out: np.ndarray,
    absent: bool,
    new: np.ndarray,
    col: np.ndarray,
    vals: np.ndarray,
    cur: np.ndarray,
) -> tuple[int, int]:
    """Each key's slot, placing the absent ones (in the first free way of their probe
    chain; ``new`` marks them); ``absent``: the caller knows none is present. ``col``
    (when not empty): set to ``vals`` for the placed keys, read into ``cur`` for all.
    Buckets (and their ``col``) are prefetched ``AHEAD`` keys early, as in ``_find``.
    Returns how many it placed, and how many of those took an EMPTY slot (not a DELETED
    one)."""
    nb = len(table) // WAYS
    m = nb - 1
    n = len(keys)
    has_col = len(col) > 0
    used = placed = 0
    for t in range(min(AHEAD, n)):
        b = _bucket(keys[t], m) * WAYS
        prefetch(table, b)
        if has_col:
            prefetch(col, b)
    for i in range(n):
        if i + AHEAD < n:
            b = _bucket(keys[i + AHEAD], m) * WAYS
            prefetch(table, b)
            if has_col:
                prefetch(col, b)
        o, took = _place(table, keys[i], m, nb, absent)
        placed += took > 0
        used += took == 2
        new[i] = took > 0
        if took and has_col:
            col[o] = vals[i]
        out[i] = o
        if has_col:
            cur[i] = col[o]
    return placed, used


@numba.njit(cache=True, nogil=True)
def _put2(
    table: np.ndarray,
    keys: np.ndarray,
    out: np.ndarray,
    c1: np.ndarray,
    v1: np.ndarray,
    c2: np.ndarray,
    v2: np.ndarray,
) -> tuple[int, int]:
    """``_upsert``, and two columns set for every key (placed or found: the last of a key
    wins) in the same pass, their lines prefetched ``AHEAD`` with the key's bucket."""
    nb = len(table) // WAYS
    m = nb - 1
    n = len(keys)
    used = placed = 0
    for t in range(min(AHEAD, n)):
        b = _bucket(keys[t], m) * WAYS
        prefetch(table, b)
        prefetch(c1, b)
        prefetch(c2, b)
    for i in range(n):
        if i + AHEAD < n:
            b = _bucket(keys[i + AHEAD], m) * WAYS
            prefetch(table, b)
            prefetch(c1, b)
            prefetch(c2, b)
        o, took = _place(table, keys[i], m, nb, False)
        placed += took > 0
        used += took == 2
        out[i] = o
        c1[o] = v1[i]
        c2[o] = v2[i]
    return placed, used


@numba.njit(cache=True, nogil=True)
def _scatter(col: np.ndarray, slots: np.ndarray, vals: np.ndarray) -> None:
    """``col[slots] = vals`` (in order: the last of a slot wins), prefetching ahead."""
    n = len(slots)
    for t in range(min(AHEAD, n)):
        prefetch(col, slots[t])
    for i in range(n):
        if i + AHEAD < n:
            prefetch(col, slots[i + AHEAD])
        col[slots[i]] = vals[i]


@numba.njit(cache=True, nogil=True)
def _move(src: np.ndarray, dst: np.ndarray, frm: np.ndarray, to: np.ndarray) -> None:
    """``dst[to] = src[frm]`` without the gathered copy between."""
    for i in range(len(frm)):
        dst[to[i]] = src[frm[i]]


@numba.njit(cache=True, nogil=True)
def _gather(col: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """``out = col[slots]``; the loads are independent, so they overlap as they are."""
    for i in range(len(slots)):
        out[i] = col[slots[i]]


_NONE = np.empty(0, np.uint16)
"""No value column (for ``_upsert``)."""


class U64Map:
    def __init__(self, columns: dict[str, np.dtype | type], capacity: int = 1024) -> None:
        cap = 1 << max(5, (capacity - 1).bit_length())
        self._dtypes = {k: np.dtype(v) for k, v in columns.items()}
        self.keys = zeros(cap, np.uint64)
        self.cols = {k: zeros(cap, d) for k, d in self._dtypes.items()}
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

    def get(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Column ``name`` at ``slots`` (all valid)."""
        col = self.cols[name]
        out = np.empty(len(slots), col.dtype)
        _gather(col, np.ascontiguousarray(slots, np.int64), out)
        return out

    def set(self, name: str, slots: np.ndarray, vals: np.ndarray) -> None:
        """Column ``name`` at ``slots`` (all valid) set to ``vals`` (a scalar, or one
        value per slot: the last of a slot wins)."""
        col = self.cols[name]
        v = np.broadcast_to(np.asarray(vals, col.dtype), (len(slots),))
        _scatter(col, np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(v))

    def put(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """Set (insert or overwrite) the keys' values; returns their slots. Duplicate keys
        in one batch: the last wins (as one put after another)."""
        if len(values) == 2:  # one pass: keys and both columns
            keys = np.ascontiguousarray(keys, np.uint64)
            self._room(len(keys))
            (a, va), (b, vb) = (
                (
                    k,
                    np.ascontiguousarray(
                        np.broadcast_to(np.asarray(v, self.cols[k].dtype), (len(keys),))
                    ),
                )
                for k, v in values.items()
            )
            slots = np.empty(len(keys), np.int64)
            placed, used = _put2(self.keys, keys, slots, self.cols[a], va, self.cols[b], vb)
            self.live += placed
            self.used += used
            return slots
        slots, _ = self.upsert(keys)
        for k, v in values.items():
            self.set(k, slots, v)
        return slots

    def _room(self, n: int) -> None:
        if self.used + n > MAX_LOAD * self.capacity:  # as if all were new
            self._grow(self.live + n)

    def upsert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's slot, placing the absent ones (their values left to the caller), and
        which were placed (a key twice in ``keys``: placed the first time)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        self._room(len(keys))
        slots = np.empty(len(keys), np.int64)
        new = np.empty(len(keys), bool)
        placed, used = _upsert(self.keys, keys, slots, False, new, _NONE, _NONE, _NONE)
        self.live += placed
        self.used += used
        return slots, new

    def upsert_col(
        self, name: str, keys: np.ndarray, vals: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``upsert``, column ``name`` set to ``vals`` for the placed keys; returns the
        slots, which were placed, and every key's ``name`` after."""
        keys = np.ascontiguousarray(keys, np.uint64)
        self._room(len(keys))
        col = self.cols[name]
        n = len(keys)
        slots, new, cur = np.empty(n, np.int64), np.empty(n, bool), np.empty(n, col.dtype)
        placed, used = _upsert(
            self.keys, keys, slots, False, new, col, np.ascontiguousarray(vals, col.dtype), cur
        )
        self.live += placed
        self.used += used
        return slots, new, cur

    def put_absent(self, keys: np.ndarray, **values: np.ndarray) -> np.ndarray:
        """``put`` for distinct keys known to be absent (the caller just looked)."""
        self._room(len(keys))
        slots = self._insert(np.ascontiguousarray(keys, np.uint64))
        for k, v in values.items():
            self.set(k, slots, v)
        return slots

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(len(keys), np.int64)
        placed, used = _upsert(
            self.keys, keys, out, True, np.empty(len(keys), bool), _NONE, _NONE, _NONE
        )
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
        old_cols = self.cols
        keys = self.keys[live]  # in slot order: bucket b goes to b or b + capacity / WAYS,
        cap = self.capacity  # so the new table fills as two streams, not at random
        while need > GROWN_LOAD * cap:
            cap *= 2
        self.keys = zeros(cap, np.uint64)
        self.cols = {k: zeros(cap, d) for k, d in self._dtypes.items()}
        self.live = self.used = 0
        slots = self._insert(keys)
        for k, c in old_cols.items():
            _move(c, self.cols[k], live, slots)
