"""Which worker holds which prefix blocks, from the engines' KV events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), and the longest cached prefix of a prompt per worker.

Blocks are keyed by a chain hash the index computes itself from the token ids each event
carries (parent's chain state * P + hash of the block's tokens and extra keys), so it matches
whatever hash algorithm and seed the engine uses; the engine's own block hashes only name
blocks for removal and as parents. Two numpy maps hold it all: block key -> holders (a worker
id and a second one, or "several": a bitmask on the side), and (worker, engine hash) -> chain
state.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np

from .kv_kernels import chain_blocks, engine_keys, msgpack_ints, token_blocks
from .u64map import U64Map, fix_keys

M64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
P_INV = pow(P, -1, 1 << 64)
CHUNK = 4096
"""Blocks chained per vector operation (longer chains go in pieces)."""
MULTI = np.uint16(0xFFFF)
MAX_WORKERS = 0xFFFE


def _powers(base: int, n: int) -> np.ndarray:
    """``base ** i`` mod 2**64 for i < n (uint64 products wrap)."""
    out = np.ones(n, np.uint64)
    out[1:] = np.cumprod(np.full(n - 1, base, np.uint64), dtype=np.uint64)
    return out


_PP, _PINV = _powers(P, CHUNK), _powers(P_INV, CHUNK)
_TOK = _powers(0xC2B2AE3D27D4EB4F, 1 << 16)
"""A token's weight by its place in its block (any block size the schema allows)."""


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


def chain_states(
    parent: int, tokens: np.ndarray, block_size: int, extras: Sequence[Any] | None = None
) -> np.ndarray:
    """The chain state of each full block of ``tokens`` after ``parent`` (0: the first)."""
    n = len(tokens) // block_size
    tok = np.asarray(tokens[: n * block_size], np.int64).astype(np.uint64).reshape(n, block_size)
    th = fmix((tok * _TOK[:block_size]).sum(axis=1, dtype=np.uint64) + np.uint64(block_size))
    if extras:
        for i, e in enumerate(extras[:n]):
            if e:
                th[i] ^= np.uint64(extra_hash(e))
    out = np.empty(n, np.uint64)
    s = parent
    for a in range(0, n, CHUNK):
        part = th[a : a + CHUNK]
        k = len(part)
        acc = np.cumsum(part * _PINV[:k], dtype=np.uint64) + np.uint64((s * P) & M64)
        out[a : a + k] = acc * _PP[:k]
        s = int(out[a + k - 1])
    return out


def chain_many(
    parents: np.ndarray,
    lens: np.ndarray,
    tokens: np.ndarray,
    block_size: int,
    extras: Sequence[Any] | None = None,
) -> np.ndarray:
    """``chain_states`` of several chains at once (each at most ``CHUNK`` blocks)."""
    n = int(lens.sum())
    tok = tokens[: n * block_size].astype(np.uint64).reshape(n, block_size)
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


def _h64(x: int | bytes) -> int:
    return (x if isinstance(x, int) else int.from_bytes(x[:8], "big")) & M64


def _engine_keys(hashes: Sequence[int | bytes], worker: int) -> np.ndarray:
    """(worker, engine block hash) -> a map key (``engine_keys``); byte hashes use their
    first 8 bytes."""
    h = np.fromiter(map(_h64, hashes), np.uint64, len(hashes))
    return engine_keys(h, np.full(len(h), worker, np.int64))


def _fields(ops: Sequence[Op], i: int) -> list[Any]:
    """Field ``i`` of each store as msgpack bytes: a ``msgspec.Raw`` as it came (a buffer),
    a list encoded."""
    out = list(map(itemgetter(i), ops))
    if set(map(type, out)) != {msgspec.Raw}:
        out = [x if type(x) is msgspec.Raw else msgspec.msgpack.encode(x) for x in out]
    return out


def _hashes64(hs: list[Any]) -> np.ndarray:
    """Block hashes (ints, or bytes: their first 8) as uint64."""
    if set(map(type, hs)) <= {int}:  # the common case: ints, negative ones wrapped
        try:
            return np.fromiter(hs, np.uint64, len(hs))
        except OverflowError:
            pass
    return np.fromiter(map(_h64, hs), np.uint64, len(hs))


Op = tuple[Any, ...]
"""An event for ``KvIndex.ingest``: ``("s", worker, hashes, parent, token_ids, extras)``
(hashes and token ids as lists or ``msgspec.Raw``), ``("r", worker, hashes)``, ``("c", worker)``."""

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


def _pair_mask(h: int, h2: int) -> int:
    """The bitmask of a block's holder ``h`` and its second one ``h2`` (its id + 1; 0: none)."""
    return 1 << h | (1 << h2 - 1 if h2 else 0)


class KvIndex:
    """One block size's index over many workers (names -> small ids)."""

    def __init__(self, block_size: int, capacity: int = 1024) -> None:
        """``capacity``: each map's slots to start with (they grow past 3/4 full)."""
        self.block_size = block_size
        self.holders = U64Map({"w": np.uint16, "w2": np.uint16}, capacity)
        """Per block key its holder ``w`` (``MULTI``: several, in ``multi``) and a second
        one, ``w2`` (its id + 1; 0: none)."""
        self.blocks = U64Map({"state": np.uint64, "w": np.uint16}, capacity)
        self.multi: dict[int, int] = {}
        """Block keys of three holders or more -> their bitmask."""
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
        side = sys.getsizeof(self.multi) + sum(
            sys.getsizeof(k) + sys.getsizeof(v) for k, v in self.multi.items()
        )
        return self.holders.nbytes() + self.blocks.nbytes() + side

    def shared(self) -> int:
        """Blocks more than one worker holds."""
        live = self.holders.live_slots()
        return int((self.holders.cols["w2"][live] > 0).sum()) + len(self.multi)

    def __len__(self) -> int:
        """Indexed (worker, block) pairs."""
        return self.blocks.live

    # -- events -----------------------------------------------------------------------------
    def stored(
        self,
        name: str,
        hashes: Sequence[int | bytes],
        parent: int | bytes | None,
        tokens: Sequence[int] | np.ndarray,
        extras: Sequence[Any] | None = None,
    ) -> int:
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
        self.blocks.put(_engine_keys(hashes, w), state=states, w=np.full(n, w, np.uint16))
        self._hold(block_keys(states), w)
        return n

    def stored_many(self, name: str, events: Sequence[Stored]) -> int:
        """Consecutive ``BlockStored`` events of one worker at once, in waves: each wave
        the events whose parents no event still waiting stores, in one vectorized pass."""
        w = self.worker(name)
        bs = self.block_size
        todo = [e for e in events if e[0] and len(e[2]) == len(e[0]) * bs and len(e[0]) <= CHUNK]
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
        states = chain_many(np.array([s for _, s in keep], np.uint64), lens, tokens, bs, extras)
        hashes = [h for e, _ in keep for h in e[0]]
        self.blocks.put(_engine_keys(hashes, w), state=states, w=np.full(len(hashes), w, np.uint16))
        self._hold(block_keys(states), w)
        return len(hashes)

    def _hold(self, keys: np.ndarray, w: int) -> None:
        keys = np.unique(keys)
        self._hold_many(keys, np.full(len(keys), w, np.int64))

    def holder_mask(self, k: int, s: int) -> int:
        """The bitmask of the workers holding block key ``k`` (in holder slot ``s``)."""
        h = int(self.holders.cols["w"][s])
        if h == MULTI:
            return self.multi.get(k, 0)
        return _pair_mask(h, int(self.holders.cols["w2"][s]))

    def _set_holders(self, k: int, s: int, m: int) -> None:
        """Block key ``k``'s holders (slot ``s``) set to bitmask ``m``; none: the slot goes."""
        col, col2 = self.holders.cols["w"], self.holders.cols["w2"]
        rest = m & (m - 1)
        if rest & (rest - 1):
            self.multi[k] = m
            col[s], col2[s] = MULTI, 0
            return
        self.multi.pop(k, None)
        if not m:
            self._drop_slots(np.array([s]))
            return
        col[s] = (m & -m).bit_length() - 1
        col2[s] = rest.bit_length()  # the second holder + 1, or 0

    def _drop_slots(self, hs: np.ndarray) -> None:
        """Holder slots deleted (their second holder cleared for the next key there)."""
        self.holders.cols["w2"][hs] = 0
        self.holders.delete_slots(hs)

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
        return int(self._release_many(np.unique(slots)).sum())

    # -- a burst of events -------------------------------------------------------------------
    def ingest(self, ops: Sequence[Op]) -> np.ndarray:
        """Many workers' events at once, in the order given per worker: returns per worker
        id the blocks stored and removed. Each worker's events split into runs of one kind
        (stores, removes, a clear); the k-th runs of all workers are applied together, as
        events of different workers commute. A store whose parent is stored in the same run
        waits for it (waves); one whose parent the index does not know is an orphan."""
        rounds: list[tuple[list[Op], list[Op], list[int]]] = []
        run: dict[int, tuple[str, int]] = {}
        for op in ops:
            kind, w = op[0], op[1]
            cur = run.get(w)
            if cur is None:
                r = 0
            elif cur[0] != kind or kind == "c":
                r = cur[1] + 1
            else:
                r = cur[1]
            run[w] = (kind, r)
            if r == len(rounds):
                rounds.append(([], [], []))
            if kind == "s":
                rounds[r][0].append(op)
            elif kind == "r":
                rounds[r][1].append(op)
            else:
                rounds[r][2].append(w)
        counts = np.zeros(len(self.names), np.int64)
        for st, rm, cl in rounds:
            if st:
                counts += self._store_ops(st)
            if rm:
                counts += self._remove_ops(rm)
            if cl:
                live = self.blocks.live_slots()
                sel = live[np.isin(self.blocks.cols["w"][live], np.array(cl, np.uint16))]
                counts += self._release_many(sel)
        return counts

    def _store_ops(self, ops: Sequence[Op]) -> np.ndarray:
        bs = self.block_size
        nw = len(self.names)
        hashes, hc = msgpack_ints(_fields(ops, 2), False, 1 << 16)
        th, tc = token_blocks(_fields(ops, 4), bs, _TOK, 1 << 22)  # per block, its tokens' hash
        ok = (hc >= 1) & (tc == hc * bs)
        hn = np.maximum(hc, 0)
        if not ok.all():
            hashes, th = hashes[np.repeat(ok, hn)], th[np.repeat(ok, np.maximum(tc, 0) // bs)]
            ops = [o for o, k in zip(ops, ok.tolist()) if k]
            hn = hn[ok]
        if not ops:
            return np.zeros(nw, np.int64)
        ev_w = np.fromiter(map(itemgetter(1), ops), np.int64, len(ops))
        bw = np.repeat(ev_w, hn)
        ekeys = engine_keys(hashes, bw)
        xor = np.zeros(len(hashes), np.uint64)
        extras = list(map(itemgetter(5), ops))
        if any(extras):
            bstart = np.cumsum(hn) - hn
            for e, x5 in enumerate(extras):
                for i, x in enumerate((x5 or [])[: int(hn[e])]):
                    if x:
                        xor[bstart[e] + i] = np.uint64(extra_hash(x))
        parents = list(map(itemgetter(3), ops))
        if None in parents:
            hp = np.array([p is not None for p in parents], bool)
            ph = _hashes64([p for p in parents if p is not None])
        else:
            hp, ph = np.ones(len(ops), bool), _hashes64(parents)
        pkeys = np.zeros(len(ops), np.uint64)
        if len(ph):
            pkeys[hp] = engine_keys(ph, ev_w[hp])
        counts = np.zeros(nw, np.int64)
        todo = np.arange(len(ops))
        while len(todo):
            parent = np.zeros(len(todo), np.uint64)
            known = ~hp[todo]
            sub = np.flatnonzero(hp[todo])
            if len(sub):
                slots = self.blocks.find(pkeys[todo[sub]])
                found = slots >= 0
                parent[sub[found]] = self.blocks.cols["state"][slots[found]]
                known[sub[found]] = True
            wait = np.zeros(len(todo), bool)
            if not known.all():  # parents unknown so far: stored in this run, or orphans
                left = np.flatnonzero(~known)
                pend = np.repeat(np.isin(np.arange(len(ops)), todo), hn)
                wait[left] = np.isin(pkeys[todo[left]], ekeys[pend])
                orphan = left[~wait[left]]
                self.orphans += int(hn[todo[orphan]].sum())
            ready = known
            if ready.any():
                ev = todo[ready]
                sel = (
                    slice(None)
                    if len(ev) == len(ops)
                    else np.repeat(np.isin(np.arange(len(ops)), ev), hn)
                )
                states, keys = chain_blocks(th[sel], hn[ev], parent[ready], xor[sel])
                self.blocks.put(ekeys[sel], state=states, w=bw[sel].astype(np.uint16))
                self._hold_many(keys, bw[sel])
                counts += np.bincount(bw[sel], minlength=nw)
            elif wait.all():
                break  # a cycle (hostile): what is left is not indexed
            todo = todo[wait]
        return counts

    def _hold_many(self, keys: np.ndarray, ws: np.ndarray) -> None:
        """Worker ``ws[i]`` holds block key ``keys[i]``: one probe per key; a key one other
        worker holds takes the second holder column (vectorized); a key of three holders
        or more, or several times in this batch, takes the slow path, on the side."""
        slots, new, cur = self.holders.upsert_col("w", keys, ws)
        slow = np.flatnonzero(~new & (cur != ws))
        if not len(slow):
            return
        col2 = self.holders.cols["w2"]
        ss = slots[slow]
        _, first, n = np.unique(ss, return_index=True, return_counts=True)
        once = np.zeros(len(slow), bool)
        once[first[n == 1]] = True
        sec = col2[ss].astype(np.int64)
        once &= cur[slow] != MULTI
        done = once & (sec == ws[slow] + 1)  # already its second holder
        pair = once & (sec == 0)
        col2[ss[pair]] = ws[slow[pair]] + 1
        for k, s, w in zip(
            keys[slow[~(done | pair)]].tolist(),
            ss[~(done | pair)].tolist(),
            ws[slow[~(done | pair)]].tolist(),
        ):
            m = self.holder_mask(k, s)
            if not m >> w & 1:
                self._set_holders(k, s, m | 1 << w)

    def _remove_ops(self, ops: Sequence[Op]) -> np.ndarray:
        hs = [h for o in ops for h in o[2]]
        if not hs:
            return np.zeros(len(self.names), np.int64)
        ws = np.repeat(
            np.fromiter(map(itemgetter(1), ops), np.int64, len(ops)), [len(o[2]) for o in ops]
        )
        slots = self.blocks.find(engine_keys(_hashes64(hs), ws))
        return self._release_many(np.unique(slots[slots >= 0]))

    def _release_many(self, slots: np.ndarray) -> np.ndarray:
        """``_release`` of slots of any workers; returns per worker how many."""
        counts = np.zeros(len(self.names), np.int64)
        if not len(slots):
            return counts
        keys = block_keys(self.blocks.cols["state"][slots])
        ws = self.blocks.cols["w"][slots].astype(np.int64)
        counts += np.bincount(ws, minlength=len(self.names))
        self.blocks.delete_slots(slots)
        if len(slots) > 1:  # each (block key, worker) once
            order = np.lexsort((ws, keys))
            keys, ws = keys[order], ws[order]
            once = np.ones(len(keys), bool)
            once[1:] = (keys[1:] != keys[:-1]) | (ws[1:] != ws[:-1])
            keys, ws = keys[once], ws[once]
        hs = self.holders.find(keys)
        ok = hs >= 0
        keys, ws, hs = keys[ok], ws[ok], hs[ok]
        _, first, n = np.unique(hs, return_index=True, return_counts=True)
        once = np.zeros(len(hs), bool)
        once[first[n == 1]] = True
        cur = self.holders.cols["w"][hs].astype(np.int64)
        col, col2 = self.holders.cols["w"], self.holders.cols["w2"]
        sec = col2[hs].astype(np.int64)
        gone = once & (cur == ws) & (sec == 0)  # its only holder
        first2 = once & (cur == ws) & (sec > 0)  # the first of two: the second moves up
        second = once & (cur != MULTI) & (sec == ws + 1)  # the second of two
        col[hs[first2]] = sec[first2] - 1
        col2[hs[first2 | second]] = 0
        self._drop_slots(hs[gone])
        for i in np.flatnonzero(~(gone | first2 | second) & (~once | (cur == MULTI))).tolist():
            k, s, w = int(keys[i]), int(hs[i]), int(ws[i])
            if self.holders.keys[s] != keys[i]:
                continue  # another worker's release in this batch removed the key
            m = self.holder_mask(k, s)
            if m >> w & 1:
                self._set_holders(k, s, m & ~(1 << w))
        return counts

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
        hold2 = self.holders.cols["w2"][slots[:n]].tolist()
        groups: list[tuple[int, int]] = []  # (workers' bitmask, how many blocks they hold)
        mask = -1
        for i, h in enumerate(hold):
            m = self.multi.get(int(keys[i]), 0) if h == MULTI else _pair_mask(h, hold2[i])
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

    def cached_groups(
        self, ids: Sequence[int], salt: str | None = None
    ) -> list[tuple[int, list[str]]]:
        """Workers holding leading tokens of ``ids``, grouped by how many tokens."""
        return [
            (d * self.block_size, ws) for d, ws in self.match_groups(self.prompt_keys(ids, salt))
        ]

    def cached_tokens(self, ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per worker: how many leading tokens of ``ids`` it holds in its cache."""
        return {w: t for t, ws in self.cached_groups(ids, salt) for w in ws}


def warm() -> None:
    """Compile (or load from numba's cache) the ingest loops now, not on a first frame."""
    ix = KvIndex(4, capacity=32)
    w = ix.worker("warm")
    raw = msgspec.Raw(msgspec.msgpack.encode(list(range(4 * 40))))
    hashes = msgspec.Raw(msgspec.msgpack.encode(list(range(1, 41))))  # 40: both maps grow
    ix.ingest([("s", w, hashes, None, raw, None), ("r", w, [7]), ("c", w)])
