"""The KV index's compiled loops (numba): reading msgpack arrays of ints straight from the
wire bytes (token arrays hashed block by block as they are read), and each stored block's
chain state. A burst of frames costs a handful of calls, not a Python object per token.

``msgpack_ints`` and ``token_blocks`` are the bound on hostile input for those fields: a field
that is not an array of at most ``max_items`` allowed items is marked invalid (-1), never read
past its bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .jit import numba

M64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15


@numba.njit(cache=True, nogil=True)
def _be(buf: np.ndarray, i: int, n: int) -> np.uint64:
    v = np.uint64(0)
    for k in range(n):
        v = (v << np.uint64(8)) | np.uint64(buf[i + k])
    return v


@numba.njit(cache=True, nogil=True, inline="always")
def _header(buf: np.ndarray, i: int, end: int) -> tuple[int, int]:
    """The msgpack array header at ``buf[i]`` (``i < end``): (its item count, where its
    items start), or (-1, i): not an array header."""
    h = buf[i]
    if 0x90 <= h <= 0x9F:
        return int(h & 0x0F), i + 1
    if h == 0xDC and i + 3 <= end:
        return int(_be(buf, i + 1, 2)), i + 3
    if h == 0xDD and i + 5 <= end:
        return int(_be(buf, i + 1, 4)), i + 5
    return -1, i


@numba.njit(cache=True, nogil=True, inline="always")
def _int(buf: np.ndarray, i: int, end: int, tokens: bool) -> tuple[bool, np.uint64, int]:
    """The item at ``buf[i]`` (``i < end``): (whether it is one allowed, its value, where
    the next one starts). ``tokens``: ints in [0, 2**31); else block hashes: any 64-bit
    int (its bits), or bytes (their first 8, big-endian)."""
    b = buf[i]
    v = np.uint64(0)
    neg = False
    if b <= 0x7F:
        v, i = np.uint64(b), i + 1
    elif b == 0xCD and i + 3 <= end:  # uint16: most token ids
        v, i = (np.uint64(buf[i + 1]) << np.uint64(8)) | np.uint64(buf[i + 2]), i + 3
    elif b >= 0xE0:
        v, i, neg = np.uint64(b) | np.uint64(0xFFFFFFFFFFFFFF00), i + 1, True
    elif 0xCC <= b <= 0xCF or 0xD0 <= b <= 0xD3:
        w = 1 << (b & 3)
        if i + 1 + w > end:
            return False, v, i
        v = _be(buf, i + 1, w)
        if b >= 0xD0 and (v >> np.uint64(8 * w - 1)) & np.uint64(1):
            neg = True
            if w < 8:
                v |= ~((np.uint64(1) << np.uint64(8 * w)) - np.uint64(1))
        i += 1 + w
    elif not tokens and 0xC4 <= b <= 0xC6:
        w = 1 << (b - 0xC4)
        if i + 1 + w > end:
            return False, v, i
        ln = int(_be(buf, i + 1, w))
        i += 1 + w
        if ln > 64 or i + ln > end:
            return False, v, i
        v = _be(buf, i, min(ln, 8))
        i += ln
    else:
        return False, v, i
    if tokens and (neg or v >= np.uint64(1 << 31)):
        return False, v, i
    return True, v, i


@numba.njit(cache=True, nogil=True)
def _ints(
    buf: np.ndarray,
    offs: np.ndarray,
    tokens: bool,
    max_items: int,
    bs: int,
    weights: np.ndarray,
    out: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Each field ``buf[offs[j]:offs[j + 1]]`` (one msgpack array) into ``out``; its item
    count into ``counts[j]`` (-1: not a valid array of allowed items, ``_int``). ``bs`` > 0
    (token arrays): not the items but each full block of ``bs`` hashed as it is read
    (``_fmix(sum(token * weight) + bs)``), so the tokens are never stored."""
    o = 0
    for j in range(len(offs) - 1):
        i, end = offs[j], offs[j + 1]
        counts[j] = -1
        if i >= end:
            continue
        n, i = _header(buf, i, end)
        if n < 0 or n > max_items or n > end - i:
            continue
        start, ok = o, True
        acc = np.uint64(0)
        t = 0
        for _ in range(n):
            if i >= end:
                ok = False
                break
            ok, v, i = _int(buf, i, end, tokens)
            if not ok:
                break
            if bs == 0:
                out[o] = v
                o += 1
                continue
            acc += v * weights[t]
            t += 1
            if t == bs:
                out[o] = _fmix(acc + np.uint64(bs))
                o += 1
                acc = np.uint64(0)
                t = 0
        if ok and i == end:
            counts[j] = n
        else:
            o = start
    return o


_NO_WEIGHTS = np.empty(0, np.uint64)


def _buffers(fields: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The fields' bytes joined, and where each starts (and the last ends)."""
    lens = np.fromiter(map(len, fields), np.int64, len(fields))
    offs = np.zeros(len(fields) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    return np.frombuffer(b"".join(fields), np.uint8), offs


def msgpack_ints(fields: list[Any], tokens: bool, max_items: int) -> tuple[np.ndarray, np.ndarray]:
    """Many msgpack arrays (buffers of raw field bytes) -> (their valid items concatenated,
    per field its count or -1)."""
    buf, offs = _buffers(fields)
    out = np.empty(len(buf), np.uint64)
    counts = np.empty(len(fields), np.int64)
    o = _ints(buf, offs, tokens, max_items, 0, _NO_WEIGHTS, out, counts)
    return out[:o], counts


def token_blocks(
    fields: list[Any], bs: int, weights: np.ndarray, max_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """Many msgpack token arrays -> (the token hash of each full block of each valid one,
    per field its token count or -1); ``weights``: at least ``bs`` of them (``_ints``)."""
    if not 1 <= bs <= len(weights):
        raise ValueError(f"block size {bs}: 1 to {len(weights)}")
    buf, offs = _buffers(fields)
    out = np.empty(len(buf) // bs + 1, np.uint64)  # a token takes a byte at least
    counts = np.empty(len(fields), np.int64)
    o = _ints(buf, offs, True, max_items, bs, weights.astype(np.uint64, copy=False), out, counts)
    return out[:o], counts


@numba.njit(cache=True, nogil=True)
def _fmix(x: np.uint64) -> np.uint64:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True, nogil=True, inline="always")
def _map_key(x: np.uint64) -> np.uint64:
    """``_fmix(x)`` as a map key: the two reserved values moved (``u64map.fix_keys``)."""
    k = _fmix(x)
    return k + np.uint64(2) if k < np.uint64(2) else k


@numba.njit(cache=True, nogil=True)
def _chain(
    th: np.ndarray,
    lens: np.ndarray,
    parents: np.ndarray,
    xor: np.ndarray,
    out: np.ndarray,
    keys: np.ndarray,
) -> None:
    p = np.uint64(P)
    k = 0
    for e in range(len(lens)):
        s = parents[e]
        for _ in range(lens[e]):
            s = s * p + (th[k] ^ xor[k])
            out[k] = s
            keys[k] = _map_key(s)
            k += 1


def chain_blocks(
    th: np.ndarray, lens: np.ndarray, parents: np.ndarray, xor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each block's chain state, and its block key (``kv_index.block_keys``): ``lens[e]``
    blocks of event ``e`` after ``parents[e]``'s state, from their token hashes ``th``
    (``token_blocks``) XOR ``xor`` (their extra keys), as ``kv_index.chain_states``."""
    n = int(lens.sum())
    out, keys = np.empty(n, np.uint64), np.empty(n, np.uint64)
    _chain(
        th, lens.astype(np.int64, copy=False), parents.astype(np.uint64, copy=False), xor, out, keys
    )
    return out, keys


@numba.njit(cache=True, nogil=True)
def _engine_keys(hashes: np.ndarray, ws: np.ndarray, out: np.ndarray) -> None:
    p = np.uint64(P)
    for i in range(len(hashes)):
        out[i] = _map_key(hashes[i] ^ _fmix((np.uint64(ws[i]) + np.uint64(1)) * p))


def engine_keys(hashes: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """Per block, the key of (its worker ``ws[i]``, its engine hash): ``fmix(hash ^
    fmix((w + 1) * P))``, reserved values moved."""
    out = np.empty(len(hashes), np.uint64)
    _engine_keys(np.ascontiguousarray(hashes, np.uint64), np.ascontiguousarray(ws, np.int64), out)
    return out
