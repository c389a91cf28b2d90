"""``TieredCache``: the decode-side API an engine calls: match, load, finish, write back.

L1 is the engine's own pools (it reports how many prefix tokens are device-resident), L2 the
``HostCache``, L3 a ``StorageBackend``. ``match`` decides the promised prefix and pins it:
the L2 part is pinned, the L3 part gets pinned, not-ready L2 pages to prefetch into. ``load``
brings the promised pages into the engine's pages and says how many made it, so a failure
after the promise becomes a repair of the rest, never a hole. ``finish`` drops every pin the
match took, whatever happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import integrity
from ..config import knobs
from ..errors import ConfigError
from ..faults import Faults, damage, faults
from ..pools import PoolSpec, layout_signature
from .copy import Copier, default_copier
from .errors import CapacityError
from .host import Entry, HostCache, Register
from .keys import page_keys, pool_key
from .observer import CacheObserver
from .storage import NO_DIGEST, StorageBackend, prefix_hits

log = logging.getLogger(__name__)

L3_BATCH = 32
"""Most pages per L3 call: big enough to batch, small enough to check the deadline between."""

LOAD_BATCH_BYTES = 8 << 20
"""Bytes of L3 pages one restore thread reads, checks and copies to L1 in one go: small
enough to stay in the last-level cache between the three, large enough to batch."""


class _Span:
    """Wall time from the first copy's start to the last one's end (copies run on several
    threads at once), and the bytes copied: ``l1_copy_bytes / l1_copy_seconds``."""

    __slots__ = ("lo", "hi", "nbytes", "_lock")

    def __init__(self) -> None:
        self.lo, self.hi, self.nbytes = float("inf"), 0.0, 0
        self._lock = threading.Lock()

    def add(self, t0: float, t1: float, nbytes: int) -> None:
        with self._lock:
            self.lo, self.hi, self.nbytes = min(self.lo, t0), max(self.hi, t1), self.nbytes + nbytes

    @property
    def seconds(self) -> float:
        return max(0.0, self.hi - self.lo)


@dataclass(slots=True, eq=False)
class Match:
    """What a request will not receive over the network, and the pins that guarantee it."""

    keys: list[str]
    page_size: int
    l1_pages: int
    l2: list[Entry]
    l3: list[Entry]
    good_l3: int = 0
    finished: bool = False
    l3_missing: list[str] = field(default_factory=list)

    @property
    def prefix_pages(self) -> int:
        return self.l1_pages + len(self.l2) + len(self.l3)

    @property
    def prefix_len(self) -> int:
        return self.prefix_pages * self.page_size

    @property
    def promised_pages(self) -> int:
        """Pages to bring into L1 (after the device-resident ones)."""
        return len(self.l2) + len(self.l3)


def _need_model_id(storage: StorageBackend | None, model_id: str) -> None:
    if storage is not None and not model_id:
        raise ConfigError(
            "TieredCache with L3 storage needs model_id (the model's weights and config, e.g. "
            "a digest of them): without it L3 keys are salted only by the KV layout, and "
            "another model with the same KV shape would restore this model's pages as its own"
        )


class TieredCache:
    """One decode rank's L2 and L3 over its pool group. Thread-safe."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        *,
        host_pages: int | Mapping[str, int],
        storage: StorageBackend | None = None,
        register: Register | None = None,
        copier: Copier | None = None,
        salt: str = "",
        model_id: str = "",
        verify: bool = True,
    ) -> None:
        """``model_id`` names the engine's model (weights and config): with the pools' layout
        signature it salts every key, so two models whose KV has the same shape never read
        each other's objects. L3 outlives the process and is shared by a fleet, so it needs
        one (``ConfigError`` without); an L2 alone dies with its process and may go without.
        ``salt`` adds a scope of its own (a tenant). ``verify``: every page restored into L1
        is checked against the digest recorded when it entered L2 (host pools only)."""
        _need_model_id(storage, model_id)  # before any memory is allocated or registered
        paged = [p for p in pools if p.kind == "paged"]
        sizes = {p.page_size for p in paged}
        if len(sizes) != 1:
            raise ConfigError(f"tiers need one page size over the paged pools, got {sorted(sizes)}")
        self.page_size = sizes.pop()
        self.anchor = {p.name: p.indices_from or p.name for p in paged}
        self.data_pools = [p.name for p in paged if p.item_bytes > 0]
        self.model_id = model_id
        self.salt = f"{layout_signature(list(pools))}|{model_id}|{salt}"
        self.host = HostCache(pools, host_pages, register)
        self.verify = verify
        self.l1_specs = {
            p.name: p for p in paged if p.item_bytes and integrity.supported(p.location)
        }
        self.restore_check_seconds = 0.0
        self.l1_copy_seconds = 0.0
        self.l1_copy_bytes = 0
        """L2 -> L1 copies of restores: their speed is ``l1_copy_bytes / l1_copy_seconds``."""
        self.copier: Copier = copier or default_copier(pools)
        self.storage: StorageBackend | None = None
        self.set_storage(storage)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdxfer-writeback")
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdxfer-restore")
        self._loaders = ThreadPoolExecutor(
            max_workers=knobs().copy_workers, thread_name_prefix="pdxfer-load"
        )
        self._page_bytes = sum(hp.page_bytes for hp in self.host.pools.values())
        self._pending: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self.after_match: Callable[[Match], None] | None = None
        """Test hook run at the start of ``load`` (fault injection between match and load)."""
        self.counters: dict[str, int] = {
            "l3_puts": 0,
            "l3_put_failures": 0,
            "l3_gets": 0,
            "l3_get_misses": 0,
            "l2_writebacks": 0,
            "writeback_skipped": 0,
            "integrity_restore_checks": 0,
            "integrity_restore_mismatches": 0,
            "integrity_l3_mismatches": 0,
            "faults_injected_corrupt": 0,
            "faults_injected_skip_write": 0,
            "faults_injected_shift_write": 0,
        }

    def set_storage(self, storage: StorageBackend | None) -> None:
        """Use another L3 backend from now on (its host pages get registered with it)."""
        _need_model_id(storage, self.model_id)
        if storage is not None:
            for hp in self.host.pools.values():
                storage.register(hp.addr, hp.data.nbytes)
        self.storage = storage

    def keys(self, tokens: Sequence[int] | np.ndarray, scope: str = "") -> list[str]:
        """``scope`` narrows the keys further per request (a tenant: one tenant's prompts
        are never another's hits)."""
        salt = f"{self.salt}|{scope}" if scope else self.salt
        return page_keys(tokens, self.page_size, salt)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- restore -------------------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int] | np.ndarray, num_tokens: int, l1_len: int = 0, scope: str = ""
    ) -> Match:
        """Decide and pin the prefix this request gets locally. At least one token is left
        to the network (the engine needs the last token's KV computed fresh)."""
        if not 0 <= l1_len <= num_tokens <= len(tokens):
            raise ConfigError(
                f"need 0 <= l1_len {l1_len} <= num_tokens {num_tokens} <= {len(tokens)} tokens"
            )
        ps = self.page_size
        l1p = l1_len // ps
        keys = self.keys(np.asarray(tokens)[:num_tokens], scope)
        cap = max(l1p, (num_tokens - 1) // ps)
        l2 = self.host.match_and_pin(keys[l1p:cap])
        rest = keys[l1p + len(l2) : cap]
        l3: list[Entry] = []
        if rest and self.storage is not None:
            try:
                n3 = prefix_hits(self.storage, rest, self.data_pools)
            except Exception as e:  # noqa: BLE001 - an unreachable L3 is a miss
                log.warning("L3 exists failed (treated as a miss): %s", e)
                n3 = 0
            with self.host.lock:
                n3 = next((i for i, k in enumerate(rest[:n3]) if k in self.host.entries), n3)
                try:
                    l3 = self.host.alloc(rest[:n3])
                except CapacityError as e:
                    log.info("no L2 room to prefetch %d L3 pages (%s): transferring them", n3, e)
        return Match(keys, ps, l1p, l2, l3)

    def load(
        self,
        m: Match,
        dst: Mapping[str, np.ndarray],
        deadline: float | None = None,
        tag: int | None = None,
    ) -> int:
        """Bring the promised pages into ``dst`` (L1 pages per anchor, covering tokens from
        ``l1_len``): L3 to L2, then L2 to L1. Returns how many pages are right in ``dst``;
        the rest (an L3 object gone or corrupt, the deadline passed) must be repaired.
        ``tag`` (the room) only selects injected faults (``PDXFER_FAULTS`` with
        ``at=restore``).

        L3 pages go in batches of about ``LOAD_BATCH_BYTES`` on ``copy_workers`` threads,
        each batch read, checked and copied to L1 by one thread while its bytes are still in
        cache, batches in parallel (reads, BLAKE3 and the copy release the GIL); L2 pages are
        copied by the copier's own threads meanwhile."""
        if self.after_match is not None:
            self.after_match(m)
        l3 = m.l3 if self.storage is not None else []
        entries = m.l2 + l3
        if not entries:
            m.good_l3 = 0
            return 0
        l1 = {
            pool: np.asarray(dst[self.anchor[pool]], dtype=np.int64)[: len(entries)]
            for pool in self.data_pools
        }
        span = _Span()
        stop = threading.Event()
        per = max(1, min(L3_BATCH, LOAD_BATCH_BYTES // max(1, self._page_bytes)))
        batches = [(lo, min(lo + per, len(l3))) for lo in range(0, len(l3), per)]
        futs = [
            self._loaders.submit(self._load_l3, l3[a:b], l1, len(m.l2) + a, deadline, stop, span)
            for a, b in batches
        ]
        try:
            if m.l2:
                self._to_l1(m.l2, l1, 0, span)
        except BaseException:
            stop.set()
            raise
        finally:
            wait(futs)  # nothing may still write into L1 pages once this returns or raises
        good3 = 0
        for (a, _), f in zip(batches, futs):
            n = f.result()
            if good3 == a:
                good3 += n
        m.good_l3 = good3
        if good3 < len(l3):
            m.l3_missing.append(l3[good3].key)
        with self._lock:
            self.l1_copy_seconds += span.seconds
            self.l1_copy_bytes += span.nbytes
        entries = m.l2 + l3[:good3]
        fl = faults()
        if tag is not None and fl.page_faults and entries:
            kind = fl.page_fault(tag, "restore")
            if kind is not None:
                self._damage(kind, len(entries), dst, fl)
        return self._verify_l1(entries, dst) if entries else 0

    def _load_l3(
        self,
        batch: list[Entry],
        l1: Mapping[str, np.ndarray],
        at: int,
        deadline: float | None,
        stop: threading.Event,
        span: _Span,
    ) -> int:
        """One batch of L3 pages: read into their L2 pages, check, copy into L1 pages from
        ``at``; how many leading pages made it. A miss stops the batches not yet started."""
        if stop.is_set():
            return 0
        if deadline is not None and time.monotonic() > deadline:
            stop.set()
            log.info("restore deadline passed before L3 pages %d-%d", at, at + len(batch))
            return 0
        ok = self._get(batch)
        n = next((i for i, x in enumerate(ok) if not x), len(ok))
        if n < len(batch):
            stop.set()
        if n:
            self._to_l1(batch[:n], l1, at, span)
        return n

    def _to_l1(
        self, entries: list[Entry], l1: Mapping[str, np.ndarray], at: int, span: _Span
    ) -> None:
        """Copy L2 entries into the L1 pages from index ``at`` of ``l1``."""
        t0 = time.perf_counter()
        for pool in self.data_pools:
            hp = self.host.pools[pool]
            self.copier.to_l1(
                pool,
                hp,
                np.array([e.pages[pool] for e in entries]),
                l1[pool][at : at + len(entries)],
            )
        span.add(t0, time.perf_counter(), len(entries) * self._page_bytes)

    def _damage(self, kind: str, n: int, dst: Mapping[str, np.ndarray], f: Faults) -> None:
        """Fault injection (tests only): damage one restored L1 page of one buffer as a bad
        copy would (``faults.py``: ``corrupt``, ``skip_write``, ``shift_write``)."""
        pools = f.pools(
            [
                p
                for p in self.data_pools
                if p in self.l1_specs and self.l1_specs[p].location == "cpu"
            ]
        )
        if not pools:
            return
        spec = self.l1_specs[pools[f.pick(len(pools))]]
        pages = np.asarray(dst[self.anchor[spec.name]], dtype=np.int64)
        i = f.pick(n)
        buf = spec.buffers[f.pick(len(spec.buffers))]
        item = spec.item_bytes
        view = integrity.host_rows(buf.addr, spec.num_items, item)
        page = int(pages[i])
        neighbour = int(pages[i + 1 if i + 1 < n else i - 1]) if n > 1 else None
        # stale bytes that differ (a page holding this very prefix is no fault at all)
        taken = set(pages[:n].tolist())
        stale = next(
            (
                q
                for q in range(spec.num_items)
                if q not in taken and not np.array_equal(view[q], view[page])
            ),
            None,
        )
        damage(view, kind, page, neighbour, stale)
        self._count(f"faults_injected_{kind}")

    def _damage_l2(self, kind: str, new: list[Entry], f: Faults) -> None:
        """Fault injection (tests only, ``at=writeback``): damage the first L2 page of a
        write-back (a page every later restore of that prefix reads) after its digest was
        recorded and before it goes to L3, as a bad host page would."""
        pools = f.pools(list(self.data_pools))
        if not pools:
            return
        pool = pools[f.pick(len(pools))]
        data = self.host.pools[pool].per_buffer()
        page = new[0].pages[pool]
        rows = data[:, f.pick(data.shape[1])]  # one buffer: [pages, item_bytes]
        damage(rows, kind, page, new[1].pages[pool] if len(new) > 1 else None, None)
        self._count(f"faults_injected_{kind}")

    def _record(self, e: Entry) -> None:
        """Remember the page's digest now that it is in L2 (write-back or L3 prefetch)."""
        if not self.verify:
            return
        for pool in self.data_pools:
            e.digests[pool] = integrity.page_digest(
                self.host.pools[pool].per_buffer()[e.pages[pool]]
            )

    def _verify_l1(self, entries: list[Entry], dst: Mapping[str, np.ndarray]) -> int:
        """How many leading pages reached L1 as recorded; the first that did not (a page
        corrupted in L2, a copy gone wrong) and everything after it is repaired instead."""
        if not self.verify or not self.l1_specs:
            return len(entries)
        t0 = time.perf_counter()
        good = len(entries)
        for pool in self.data_pools:
            spec = self.l1_specs.get(pool)
            if spec is None:
                continue
            pages = np.asarray(dst[self.anchor[pool]], dtype=np.int64)[:good]
            got = integrity.l1_page_digests(spec, pages)
            for i, (e, g) in enumerate(zip(entries[:good], got)):
                want = e.digests.get(pool)
                if want is not None and g != want:
                    good = i
                    break
        if good < len(entries):
            self._count("integrity_restore_mismatches")
            log.warning(
                "restored page %d (%s) does not match its L2 digest: repairing %d "
                "pages from the prefill",
                good,
                entries[good].key,
                len(entries) - good,
            )
        self._count("integrity_restore_checks", len(entries))
        with self._lock:
            self.restore_check_seconds += time.perf_counter() - t0
        return good

    def _io_lists(self, entries: list[Entry]) -> tuple[list[str], list[int], list[int]]:
        """L3 keys, L2 addresses and sizes of every data pool's part of each entry."""
        keys, addrs, sizes = [], [], []
        for e in entries:
            for pool in self.data_pools:
                hp = self.host.pools[pool]
                keys.append(pool_key(e.key, pool))
                addrs.append(hp.page_addr(e.pages[pool]))
                sizes.append(hp.page_bytes)
        return keys, addrs, sizes

    def _get(self, batch: list[Entry]) -> list[bool]:
        """Read a batch of pages from L3 into their L2 pages; per page, whether every pool's
        object came, sealed, and (checks on) with the bytes its sealed digest describes."""
        assert self.storage is not None
        keys, addrs, sizes = self._io_lists(batch)
        sealed = [NO_DIGEST] * len(keys)
        try:
            got = self.storage.get_into(keys, addrs, sizes, sealed)
        except Exception as e:  # noqa: BLE001 - a failing L3 is a miss, repaired upstream
            log.warning("L3 get failed: %s", e)
            got = [False] * len(keys)
        n = len(self.data_pools)
        self._count("l3_gets", len(keys))
        self._count("l3_get_misses", got.count(False))
        ok = [all(got[i * n : (i + 1) * n]) for i in range(len(batch))]
        for i, entry in enumerate(batch):
            if ok[i] and self.verify:
                ok[i] = self._check_sealed(entry, sealed[i * n : (i + 1) * n])
        return ok

    def _check_sealed(self, e: Entry, sealed: Sequence[int]) -> bool:
        """Whether an L2 page just read from L3 holds what its sealed digest (recorded when
        the page first entered L2, before its write-back) says; it then keeps that digest
        for the L2 -> L1 check. A page damaged in L2 before its write-back was sealed as it
        was: the tag passes, this does not."""
        self._record(e)
        for pool, want in zip(self.data_pools, sealed):
            if want != NO_DIGEST and e.digests.get(pool) != want:
                self._count("integrity_l3_mismatches")
                log.warning(
                    "L3 page %s (%s) does not match the digest it was stored with: "
                    "a miss, repaired from the prefill",
                    e.key,
                    pool,
                )
                return False
        return True

    def finish(self, m: Match) -> None:
        """Drop the match's pins: L2 hits unpinned, good L3 prefetches become L2 hits, the
        rest freed. Idempotent."""
        with self.host.lock:
            if m.finished:
                return
            m.finished = True
            self.host.unpin(m.l2)
            self.host.commit(m.l3[: m.good_l3])
            self.host.discard(m.l3[m.good_l3 :])

    # -- write-back ----------------------------------------------------------------------------
    def write_back(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Mapping[str, Any],
        num_tokens: int,
        scope: str = "",
    ) -> Future[int]:
        """Store a finished request's full pages: L1 to L2 now (the engine may reuse its
        pages when this returns), L2 to L3 in the background. The future says how many
        pages reached L3; a full L3 is a logged miss."""
        keys = self.keys(np.asarray(tokens)[:num_tokens], scope)
        arrays = {a: np.asarray(p, dtype=np.int64) for a, p in pages.items()}
        for a in {self.anchor[p] for p in self.data_pools}:
            if a not in arrays or arrays[a].size < len(keys):
                raise ConfigError(f"write_back: pool {a!r} needs {len(keys)} pages")
        with self.host.lock:
            idx = [i for i, k in enumerate(keys) if k not in self.host.entries]
            for k in keys:
                if k in self.host.entries:
                    self.host.entries.move_to_end(k)
            try:
                new = self.host.alloc([keys[i] for i in idx])
            except CapacityError as e:
                log.info("write-back of %d pages skipped: %s", len(idx), e)
                self._count("writeback_skipped", len(idx))
                new = []
        try:
            for pool in self.data_pools if new else []:
                hp = self.host.pools[pool]
                l1 = arrays[self.anchor[pool]][idx]
                self.copier.to_host(pool, l1, hp, np.array([ent.pages[pool] for ent in new]))
        except Exception:
            self.host.discard(new)  # bad page indices: nothing half-written stays indexed
            raise
        for ent in new:
            self._record(ent)
        fl = faults()
        if new and fl.page_faults:
            kind = fl.page_fault(-1, "writeback")
            if kind is not None:
                self._damage_l2(kind, new, fl)
        self.host.pin(new)
        self.host.commit(new)
        self._count("l2_writebacks", len(new))
        if new and self.host.observer is not None:
            self._tell_stored(keys, idx, np.asarray(tokens), scope)
        fut = self._writer.submit(self._put, new)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    @property
    def observer(self) -> CacheObserver | None:
        """Told of the pages a write-back stores in L2 and of those that leave it."""
        return self.host.observer

    @observer.setter
    def observer(self, obs: CacheObserver | None) -> None:
        self.host.observer = obs

    def _tell_stored(self, keys: list[str], idx: list[int], tokens: np.ndarray, scope: str) -> None:
        """The new pages, as runs of consecutive pages after the page before each run."""
        assert self.host.observer is not None
        ps = self.page_size
        a = 0
        while a < len(idx):
            b = a
            while b + 1 < len(idx) and idx[b + 1] == idx[b] + 1:
                b += 1
            lo, hi = idx[a], idx[b] + 1
            self.host.observer.stored(
                keys[lo:hi], keys[lo - 1] if lo else None, tokens[lo * ps : hi * ps], ps, scope
            )
            a = b + 1

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _put(self, entries: list[Entry]) -> int:
        try:
            if self.storage is None or not entries:
                return 0
            keys, addrs, sizes = self._io_lists(entries)
            digests = [e.digests.get(p, NO_DIGEST) for e in entries for p in self.data_pools]
            try:
                ok = self.storage.put_from(keys, addrs, sizes, digests)
            except Exception as e:  # noqa: BLE001 - a failing L3 is a logged miss
                log.warning("L3 put failed (those pages are misses): %s", e)
                ok = [False] * len(keys)
            self._count("l3_puts", ok.count(True))
            self._count("l3_put_failures", ok.count(False))
            n = len(self.data_pools)
            return sum(all(ok[i * n : (i + 1) * n]) for i in range(len(entries)))
        finally:
            self.host.unpin(entries)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait for every background L3 write; False if some did not finish in time."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                pending[0].result(timeout=left)
            except Exception:  # noqa: BLE001 - _put logs its own failures
                pass

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            c = dict(self.counters)
            c["l1_copy_bytes"] = self.l1_copy_bytes
            c["l1_copy_us"] = int(self.l1_copy_seconds * 1e6)
        return {**{f"l2.{k}": v for k, v in self.host.snapshot().items()}, **c}

    def check(self) -> str | None:
        return self.host.check()

    def close(self) -> None:
        self.flush()
        self.executor.shutdown(wait=True)
        self._loaders.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.copier.close()
