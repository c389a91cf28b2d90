"""Which worker holds which prefix blocks, from the engines' KV events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), and the longest cached prefix of a prompt per worker.

Blocks are keyed by a chain hash the index computes itself from the token ids each event
carries (parent's chain state * P + hash of the block's tokens and extra keys), so it matches
whatever hash algorithm and seed the engine uses; the engine's own block hashes only name
blocks for removal and as parents. Two numpy maps hold it all: block key -> holder (a worker
id, or "several": a bitmask on the side), and (worker, engine hash) -> chain state.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .u64map import U64Map, fix_keys

M64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
P_INV = pow(P, -1, 1 << 64)
CHUNK = 4096
"""Blocks chained per vector operation (longer chains go in pieces)."""
MULTI = np.uint16(0xFFFF)
MAX_WORKERS = 0xFFFE


def _powers(base: int, n: int) -> np.ndarray:
    out = np.empty(n, np.uint64)
    x = 1
    for i in range(n):
        out[i] = x
        x = (x * base) & M64
    return out


_PP, _PINV = _powers(P, CHUNK), _powers(P_INV, CHUNK)
_TOK = _powers(0xC2B2AE3D27D4EB4F, 4096)


def fmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (wrapping uint64 arithmetic)."""
    x = np.atleast_1d(np.asarray(x, np.uint64))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def extra_hash(extra: Any) -> int:
    """A block's extra keys (cache salt, LoRA name, multimodal ids), order kept."""
    text = json.dumps(list(extra), default=str, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def chain_states(parent: int, tokens: np.ndarray, block_size: int,
                 extras: Sequence[Any] | None = None) -> np.ndarray:
    """The chain state of each full block of ``tokens`` after ``parent`` (0: the first)."""
    n = len(tokens) // block_size
    tok = np.asarray(tokens[:n * block_size], np.int64).astype(np.uint64).reshape(n, block_size)
    th = fmix((tok * _TOK[:block_size]).sum(axis=1, dtype=np.uint64) + np.uint64(block_size))
    if extras:
        for i, e in enumerate(extras[:n]):
            if e:
                th[i] ^= np.uint64(extra_hash(e))
    out = np.empty(n, np.uint64)
    s = parent
    for a in range(0, n, CHUNK):
        part = th[a:a + CHUNK]
        k = len(part)
        acc = np.cumsum(part * _PINV[:k], dtype=np.uint64) + np.uint64((s * P) & M64)
        out[a:a + k] = acc * _PP[:k]
        s = int(out[a + k - 1])
    return out


def chain_many(parents: np.ndarray, lens: np.ndarray, tokens: np.ndarray, block_size: int,
               extras: Sequence[Any] | None = None) -> np.ndarray:
    """``chain_states`` of several chains at once (each at most ``CHUNK`` blocks)."""
    n = int(lens.sum())
    tok = tokens[:n * block_size].astype(np.uint64).reshape(n, block_size)
    th = fmix((tok * _TOK[:block_size]).sum(axis=1, dtype=np.uint64) + np.uint64(block_size))
    if extras:
        for i, e in enumerate(extras[:n]):
            if e:
                th[i] ^= np.uint64(extra_hash(e))
    starts = np.cumsum(lens) - lens
    loc = np.arange(n) - np.repeat(starts, lens)
    acc = np.cumsum(th * _PINV[loc], dtype=np.uint64)
    base = np.where(starts > 0, acc[np.maximum(starts - 1, 0)], np.uint64(0))
    seg = np.repeat(np.arange(len(lens)), lens)
    p_s0 = parents * np.uint64(P)
    return (acc - base[seg] + p_s0[seg]) * _PP[loc]


def block_keys(states: np.ndarray) -> np.ndarray:
    return fix_keys(fmix(states))


def _engine_keys(hashes: Sequence[int | bytes], worker: int) -> np.ndarray:
    """(worker, engine block hash) -> a map key; byte hashes use their first 8 bytes."""
    h = np.fromiter(((x if isinstance(x, int) else int.from_bytes(x[:8], "big")) & M64
                     for x in hashes), np.uint64, len(hashes))
    return fix_keys(fmix(h ^ fmix(np.uint64(((worker + 1) * P) & M64))))


Stored = tuple[Sequence[int | bytes], "int | bytes | None", Sequence[int], "Sequence[Any] | None"]
"""A ``BlockStored``'s hashes, parent hash, token ids and extra keys."""


def _bits(m: int) -> list[int]:
    """The positions of a non-negative int's set bits."""
    if m < 1 << 64:
        out = []
        while m:
            b = m & -m
            out.append(b.bit_length() - 1)
            m ^= b
        return out
    raw = np.frombuffer(m.to_bytes((m.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


class KvIndex:
    """One block size's index over many workers (names -> small ids)."""

    def __init__(self, block_size: int, capacity: int = 1024) -> None:
        self.block_size = block_size
        self.holders = U64Map({"w": np.uint16}, capacity)
        self.blocks = U64Map({"state": np.uint64, "w": np.uint16}, capacity)
        self.multi: dict[int, int] = {}
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.orphans = 0
        """Stored blocks whose parent the index did not know (joined mid-stream)."""

    # -- workers ----------------------------------------------------------------------------
    def worker(self, name: str) -> int:
        w = self.ids.get(name)
        if w is None:
            if len(self.names) >= MAX_WORKERS:
                raise ValueError("too many workers for one KV index")
            w = self.ids[name] = len(self.names)
            self.names.append(name)
        return w

    def blocks_of(self, name: str) -> int:
        w = self.ids.get(name)
        if w is None:
            return 0
        live = self.blocks.live_slots()
        return int((self.blocks.cols["w"][live] == w).sum())

    def nbytes(self) -> int:
        """The maps' arrays, and the shared blocks' dict with its int objects."""
        side = sys.getsizeof(self.multi) + sum(sys.getsizeof(k) + sys.getsizeof(v)
                                               for k, v in self.multi.items())
        return self.holders.nbytes() + self.blocks.nbytes() + side

    def __len__(self) -> int:
        """Indexed (worker, block) pairs."""
        return self.blocks.live

    # -- events -----------------------------------------------------------------------------
    def stored(self, name: str, hashes: Sequence[int | bytes], parent: int | bytes | None,
               tokens: Sequence[int] | np.ndarray, extras: Sequence[Any] | None = None) -> int:
        """A ``BlockStored``: returns how many blocks were indexed (0 when its parent is
        unknown or its tokens do not fill exactly its blocks)."""
        w = self.worker(name)
        n = len(hashes)
        if n == 0 or len(tokens) != n * self.block_size:
            return 0
        s0 = 0
        if parent is not None:
            slot = self.blocks.find(_engine_keys([parent], w))[0]
            if slot < 0:
                self.orphans += n
                return 0
            s0 = int(self.blocks.cols["state"][slot])
        states = chain_states(s0, np.asarray(tokens), self.block_size, extras)
        self.blocks.put(_engine_keys(hashes, w), state=states,
                        w=np.full(n, w, np.uint16))
        self._hold(block_keys(states), w)
        return n

    def stored_many(self, name: str, events: Sequence[Stored]) -> int:
        """Consecutive ``BlockStored`` events of one worker at once, in waves: each wave
        the events whose parents no event still waiting stores, in one vectorized pass."""
        w = self.worker(name)
        bs = self.block_size
        todo = [e for e in events if e[0] and len(e[2]) == len(e[0]) * bs
                and len(e[0]) <= CHUNK]
        n = 0
        while todo:
            made = {h for e in todo for h in e[0]}
            wave = [e for e in todo if e[1] is None or e[1] not in made]
            if not wave:  # a cycle (hostile): what is left is not indexed
                break
            n += self._store_wave(w, wave)
            todo = [e for e in todo if e[1] is not None and e[1] in made]
        return n

    def _store_wave(self, w: int, wave: Sequence[Stored]) -> int:
        bs = self.block_size
        parents = [e[1] for e in wave if e[1] is not None]
        pslots = iter(self.blocks.find(_engine_keys(parents, w)).tolist() if parents else [])
        keep: list[tuple[Stored, int]] = []
        for e in wave:
            slot = next(pslots) if e[1] is not None else None
            if slot is None:
                keep.append((e, 0))
            elif slot >= 0:
                keep.append((e, int(self.blocks.cols["state"][slot])))
            else:
                self.orphans += len(e[0])
        if not keep:
            return 0
        lens = np.array([len(e[0]) for e, _ in keep])
        tokens = np.concatenate([np.asarray(e[2], np.int64) for e, _ in keep])
        extras = None
        if any(e[3] for e, _ in keep):
            extras = [x for e, _ in keep for x in (e[3] or [None] * len(e[0]))]
        states = chain_many(np.array([s for _, s in keep], np.uint64), lens, tokens, bs,
                            extras)
        hashes = [h for e, _ in keep for h in e[0]]
        self.blocks.put(_engine_keys(hashes, w), state=states,
                        w=np.full(len(hashes), w, np.uint16))
        self._hold(block_keys(states), w)
        return len(hashes)

    def _hold(self, keys: np.ndarray, w: int) -> None:
        keys = np.unique(keys)
        slots = self.holders.find(keys)
        new = slots < 0
        if new.any():
            self.holders.put_absent(keys[new], w=np.full(int(new.sum()), w, np.uint16))
        old = np.flatnonzero(~new)
        if len(old):
            cur = self.holders.cols["w"][slots[old]]
            other = old[cur != w]
            for i in other.tolist():  # shared blocks: the slow path, on the side
                k, s = int(keys[i]), slots[i]
                v = self.holders.cols["w"][s]
                self.multi[k] = self.multi.get(k, 0) if v == MULTI else 1 << int(v)
                self.multi[k] |= 1 << w
                self.holders.cols["w"][s] = MULTI

    def removed(self, name: str, hashes: Sequence[int | bytes]) -> int:
        """A ``BlockRemoved``: returns how many indexed blocks it removed."""
        w = self.ids.get(name)
        if w is None or not hashes:
            return 0
        slots = self.blocks.find(_engine_keys(hashes, w))
        slots = slots[slots >= 0]
        return self._release(slots, w)

    def cleared(self, name: str) -> int:
        """``AllBlocksCleared`` (or the worker is dropped): forget all it holds."""
        w = self.ids.get(name)
        if w is None:
            return 0
        live = self.blocks.live_slots()
        return self._release(live[self.blocks.cols["w"][live] == w], w)

    def _release(self, slots: np.ndarray, w: int) -> int:
        if not len(slots):
            return 0
        keys = np.unique(block_keys(self.blocks.cols["state"][slots]))
        self.blocks.delete_slots(slots)
        hs = self.holders.find(keys)
        ok = hs >= 0
        keys, hs = keys[ok], hs[ok]
        cur = self.holders.cols["w"][hs]
        self.holders.delete_slots(hs[cur == w])
        for i in np.flatnonzero(cur == MULTI).tolist():
            k, s = int(keys[i]), hs[i]
            m = self.multi.get(k, 0) & ~(1 << w)
            if m & (m - 1):
                self.multi[k] = m
                continue
            self.multi.pop(k, None)
            if m:
                self.holders.cols["w"][s] = m.bit_length() - 1
            else:
                self.holders.delete_slots(np.array([s]))
        return len(slots)

    # -- lookups ----------------------------------------------------------------------------
    def prompt_keys(self, ids: Sequence[int], salt: str | None = None) -> np.ndarray:
        """The block keys of a prompt's full blocks (``salt``: vLLM's ``cache_salt``, an
        extra key of the first block)."""
        if len(ids) < self.block_size:
            return np.empty(0, np.uint64)
        extras = [[salt]] if salt else None
        return block_keys(chain_states(0, np.asarray(ids), self.block_size, extras))

    def match_groups(self, keys: np.ndarray) -> list[tuple[int, list[str]]]:
        """Workers holding a prefix of ``keys``, grouped by how many leading blocks."""
        if not len(keys):
            return []
        slots = self.holders.find(keys)
        found = slots >= 0
        n = len(slots) if found.all() else int(np.argmin(found))
        if n == 0:
            return []
        hold = self.holders.cols["w"][slots[:n]].tolist()
        groups: list[tuple[int, int]] = []  # (workers' bitmask, how many blocks they hold)
        mask = -1
        for i, h in enumerate(hold):
            m = self.multi.get(int(keys[i]), 0) if h == MULTI else 1 << h
            new = mask & m
            if i and mask != new:
                groups.append((mask & ~new, i))
            mask = new
            if not mask:
                break
        if mask > 0:
            groups.append((mask, n))
        names = self.names
        return [(d, [names[w] for w in _bits(m)]) for m, d in groups]

    def match(self, keys: np.ndarray) -> dict[str, int]:
        """Per worker holding a prefix of ``keys``: how many leading blocks it holds."""
        return {w: d for d, ws in self.match_groups(keys) for w in ws}

    def cached_groups(self, ids: Sequence[int], salt: str | None = None
                      ) -> list[tuple[int, list[str]]]:
        """Workers holding leading tokens of ``ids``, grouped by how many tokens."""
        return [(d * self.block_size, ws)
                for d, ws in self.match_groups(self.prompt_keys(ids, salt))]

    def cached_tokens(self, ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per worker: how many leading tokens of ``ids`` it holds in its cache."""
        return {w: t for t, ws in self.cached_groups(ids, salt) for w in ws}
