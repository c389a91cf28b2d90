"""The KV index's two compiled loops (numba): reading msgpack arrays of ints straight from the
wire bytes, and each stored block's chain state. A burst of frames costs a handful of calls,
not a Python object per token.

``msgpack_ints`` is the bound on hostile input for those fields: a field that is not an array
of at most ``max_items`` allowed items is marked invalid (-1), never read past its bytes.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

M64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15


@numba.njit(cache=True, nogil=True)
def _be(buf: np.ndarray, i: int, n: int) -> np.uint64:
    v = np.uint64(0)
    for k in range(n):
        v = (v << np.uint64(8)) | np.uint64(buf[i + k])
    return v


@numba.njit(cache=True, nogil=True)
def _ints(buf: np.ndarray, offs: np.ndarray, tokens: bool, max_items: int,
          out: np.ndarray, counts: np.ndarray) -> int:
    """Each field ``buf[offs[j]:offs[j + 1]]`` (one msgpack array) into ``out``; its item
    count into ``counts[j]`` (-1: not a valid array). ``tokens``: ints in [0, 2**31);
    else block hashes: any 64-bit int (its bits), or bytes (their first 8, big-endian)."""
    o = 0
    for j in range(len(offs) - 1):
        i, end = offs[j], offs[j + 1]
        counts[j] = -1
        if i >= end:
            continue
        h = buf[i]
        if 0x90 <= h <= 0x9F:
            n, i = h & 0x0F, i + 1
        elif h == 0xDC and i + 3 <= end:
            n, i = int(_be(buf, i + 1, 2)), i + 3
        elif h == 0xDD and i + 5 <= end:
            n, i = int(_be(buf, i + 1, 4)), i + 5
        else:
            continue
        if n > max_items or n > end - i:
            continue
        start, ok = o, True
        for _ in range(n):
            if i >= end:
                ok = False
                break
            b = buf[i]
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
                    ok = False
                    break
                v = _be(buf, i + 1, w)
                if b >= 0xD0 and (v >> np.uint64(8 * w - 1)) & np.uint64(1):
                    neg = True
                    if w < 8:
                        v |= ~((np.uint64(1) << np.uint64(8 * w)) - np.uint64(1))
                i += 1 + w
            elif not tokens and 0xC4 <= b <= 0xC6:
                w = 1 << (b - 0xC4)
                if i + 1 + w > end:
                    ok = False
                    break
                ln = int(_be(buf, i + 1, w))
                i += 1 + w
                if ln > 64 or i + ln > end:
                    ok = False
                    break
                v = _be(buf, i, min(ln, 8))
                i += ln
            else:
                ok = False
                break
            if tokens and (neg or v >= np.uint64(1 << 31)):
                ok = False
                break
            out[o] = v
            o += 1
        if ok and i == end:
            counts[j] = n
        else:
            o = start
    return o


def msgpack_ints(fields: list[Any], tokens: bool, max_items: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Many msgpack arrays (buffers of raw field bytes) -> (their valid items concatenated,
    per field its count or -1)."""
    lens = np.fromiter(map(len, fields), np.int64, len(fields))
    offs = np.zeros(len(fields) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    buf = np.frombuffer(b"".join(fields), np.uint8)
    out = np.empty(len(buf), np.uint64)
    counts = np.empty(len(fields), np.int64)
    o = _ints(buf, offs, tokens, max_items, out, counts)
    return out[:o], counts


@numba.njit(cache=True, nogil=True)
def _fmix(x: np.uint64) -> np.uint64:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def _chain(tokens: np.ndarray, lens: np.ndarray, parents: np.ndarray, xor: np.ndarray,
           weights: np.ndarray, bs: int, out: np.ndarray) -> None:
    p = np.uint64(P)
    k = 0
    for e in range(len(lens)):
        s = parents[e]
        for _ in range(lens[e]):
            acc = np.uint64(0)
            base = k * bs
            for t in range(bs):
                acc += tokens[base + t] * weights[t]
            s = s * p + (_fmix(acc + np.uint64(bs)) ^ xor[k])
            out[k] = s
            k += 1


def chain_blocks(tokens: np.ndarray, lens: np.ndarray, parents: np.ndarray, xor: np.ndarray,
                 weights: np.ndarray, bs: int) -> np.ndarray:
    """Each block's chain state: ``lens[e]`` blocks of event ``e`` after ``parents[e]``'s
    state; a block's token hash XOR ``xor`` (its extra keys) (as ``kv_index.chain_states``)."""
    out = np.empty(int(lens.sum()), np.uint64)
    _chain(tokens.astype(np.uint64, copy=False), lens.astype(np.int64, copy=False),
           parents.astype(np.uint64, copy=False), xor, weights, bs, out)
    return out
