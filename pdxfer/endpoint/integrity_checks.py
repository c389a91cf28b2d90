"""Decode side: the integrity check (see ``integrity.py``). Each sender's digests of what it
wrote are compared with what landed before the room may succeed; a mismatch fails the room,
or asks that sender once more (``integrity_retry``). Sampled checks of a one-chunk sender are
planned when the request goes out (``prepare``). Fault injection (tests only) damages a page
here, just before the check, as a misdirected or lost write would.

``IntegrityChecks`` is handed the decode side's room table and peer table; it owns only
its cache of buffer maps.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import integrity as I
from .. import wire
from ..errors import IntegrityError, PdxferError
from ..faults import Faults, damage, faults
from ..plan import topology as T
from ..plan.pieces import spans as piece_spans
from ..plan.pieces import written_ranges
from ..pools import PoolSpec
from .connect import PrefillPeer
from .receiver_rooms import RecvRoom

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger(__name__)


def _head_bytes(pool: PoolSpec, heads: tuple[int, int] | None) -> slice | np.ndarray:
    """The bytes of one page of ``pool`` that hold global heads ``[lo, hi)`` (all of it
    when ``heads`` is None or covers every head this rank holds)."""
    sh = pool.sharding
    if heads is None or sh.kind != "heads":
        return slice(None)
    lo, hi = heads[0] - sh.first_head, heads[1] - sh.first_head
    if lo <= 0 and hi >= sh.rank_heads:
        return slice(None)
    hb, ps = sh.head_bytes, pool.page_size
    if pool.token_major:
        return (
            np.arange(ps)[:, None] * pool.token_bytes + np.arange(lo * hb, hi * hb)[None, :]
        ).reshape(-1)
    return np.arange(lo * ps * hb, hi * ps * hb)


def _complete(index: list[int | None]) -> list[int] | None:
    """``index`` when each of the sender's buffers has one of ours, else None."""
    out = [i for i in index if i is not None]
    return out if len(out) == len(index) else None


@dataclass(frozen=True, slots=True)
class _BufferMap:
    theirs: PoolSpec
    """The sender's pool (kept: its ``id()`` is the cache key)."""
    index: list[int | None]
    """Our buffer index for each of its buffers (None: we hold no such buffer)."""


class IntegrityChecks:
    """The decode side's integrity checks, over its ``rooms`` and handshaken ``peers``
    (read under the core's lock)."""

    def __init__(self, ep: Core, rooms: dict[int, RecvRoom], peers: dict[str, PrefillPeer]) -> None:
        self.ep = ep
        self.rooms = rooms
        self.peers = peers
        self.faults: Faults = faults()
        self._bufmaps: dict[int, _BufferMap] = {}

    def prepare(self, st: RecvRoom, peers: list[PrefillPeer], plan: list[T.Assignment]) -> None:
        """Plan the sampled check of what each sender will report for a request it writes in
        one chunk (tokens ``[prefix_len, num_tokens)``, the heads it was asked for or all it
        holds), after the request went out: the check then only gathers and hashes. A digest
        of another range (several chunks) takes the full path; so does anything that cannot
        be planned here, which also reports the reason."""
        out: dict[tuple[str, str, int, int, int, int], I.Prepared] = {}
        try:
            for p, a in zip(peers, plan):
                if a.silent:
                    continue
                for name, theirs in p.pools.items():
                    if name not in self.ep.pool_names or name in a.skip:
                        continue
                    pool = self.ep.pool(name)
                    pages = st.dst.get(pool.indices_from or name)
                    if (
                        pages is None
                        or pool.kind != "paged"
                        or not pool.item_bytes
                        or I.portable(pool, theirs)
                        or not theirs.item_bytes
                    ):
                        continue
                    osh = theirs.sharding
                    lo, hi = (
                        (0, 0)
                        if pool.sharding.kind != "heads"
                        else a.heads.get(name, (osh.first_head, osh.first_head + osh.rank_heads))
                    )
                    idx = _complete(self._buffer_map(pool, theirs))
                    if idx is None:
                        continue
                    prep = I.prepare(
                        pool,
                        I.Span(pages, st.prefix_len, st.prefix_len, st.num_tokens, lo, hi),
                        I.sample_stride(theirs, pool),
                        idx,
                    )
                    if prep is not None:
                        out[(p.endpoint_id, name, st.prefix_len, st.num_tokens, lo, hi)] = prep
        except Exception:  # noqa: BLE001 - the check's full path reports what is wrong
            log.debug("room %d: sampled checks not planned ahead", st.room, exc_info=True)
        st.prepared = out

    def retry(self, st: RecvRoom, sender: str, err: PdxferError) -> bool:
        """Ask ``sender`` for its whole range once more after a digest mismatch
        (``integrity_retry``; called under the lock): the same request frame and nonce, which
        the prefill serves as a repair of the room it still holds. False: fail as usual."""
        frame = st.asks.get(sender)
        peer = next((p for p in st.targets if p.endpoint_id == sender), None)
        if (
            not isinstance(err, IntegrityError)
            or frame is None
            or peer is None
            or sender in st.retried
            or st.state.terminal
        ):
            return False
        st.retried.add(sender)
        st.outstanding.add(sender)
        self.ep.count("integrity_retries")
        log.warning("%s: asking for the range again (integrity_retry)", err)
        self.ep.send_frame(peer.ctrl_addr, frame, peer.sess)
        return True

    def check(self, msg: wire.TransferDone) -> PdxferError | None:
        """Inject a configured page fault, then verify what this sender wrote against its
        digests: None, or the ``IntegrityError`` that fails the room (the sender's writes
        are over either way, so its pages are safe to release)."""
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None or st.nonce != msg.nonce or msg.endpoint_id not in st.outstanding:
                return None
            peer = self.peers.get(msg.endpoint_id)
            skip = st.skips.get(msg.endpoint_id, ())
        if self.faults.page_faults:
            kind = self.faults.page_fault(st.room)
            if kind is not None:
                self._inject(st, kind, msg.endpoint_id)
        if st.integrity == "off" or peer is None:
            return None
        t0 = time.perf_counter()
        try:
            why = self._verify(st, peer, msg.digests, skip)
        finally:
            self.ep.count("integrity_checks")
            self.ep.count("integrity_seconds", time.perf_counter() - t0)
        if not why:
            return None
        return IntegrityError(f"room {st.room}: from prefill endpoint {msg.endpoint_id}: {why}")

    def _verify(
        self,
        st: RecvRoom,
        peer: PrefillPeer,
        digests: tuple[wire.Digest, ...],
        skip: tuple[str, ...],
    ) -> str:
        """Every digest matches what landed, and together they cover every token of every
        layer of every pool this sender writes (a sender that streamed its layers sends one
        digest per layer range and token range)."""
        mode = st.integrity
        covered: dict[str, list[tuple[int, int, int, int]]] = {}
        for d in digests:
            why = self._verify_one(st, peer, d, mode)
            if why:
                return why
            covered.setdefault(d.pool, []).append((d.l0, d.l1, d.start, d.end))
        if st.num_tokens <= st.prefix_len:
            return ""
        for name, theirs in peer.pools.items():
            if name not in self.ep.pool_names or name in skip:
                continue
            pool = self.ep.pool(name)
            if (
                pool.kind != "paged"
                or not pool.item_bytes
                or not theirs.item_bytes
                or not I.supported(theirs.location)
                or (pool.indices_from or name) not in st.dst
            ):
                continue
            why = _uncovered(covered.get(name, []), theirs, st.prefix_len, st.num_tokens)
            if why:
                return f"no digest covers pool {name!r} {why} (mode {mode})"
        return ""

    def _verify_one(self, st: RecvRoom, peer: PrefillPeer, d: wire.Digest, mode: str) -> str:
        theirs = peer.pools.get(d.pool)
        if d.pool not in self.ep.pool_names or theirs is None:
            return f"digest for unknown pool {d.pool!r}"
        pool = self.ep.pool(d.pool)
        every = self._buffer_map(pool, theirs)
        sel = list(range(len(theirs.buffers)))
        if d.l1 > d.l0:  # a partial-layer chunk: the sender's buffers of those layers
            if pool.kind != "paged":
                return f"digest of slot pool {d.pool!r} names layers"
            sel = [i for i, b in enumerate(theirs.buffers) if d.l0 <= b.layer_id < d.l1]
            if not sel:
                return (
                    f"digest of pool {d.pool!r} claims layers [{d.l0}, {d.l1}) the "
                    f"sender's pool does not hold"
                )
            every = [every[i] for i in sel]
        idx = _complete(every)
        if idx is None or len(d.values) != len(idx):
            return f"digest of pool {d.pool!r} does not match the sender's buffers"
        try:
            if pool.kind == "slot":
                slot = st.slots.get(d.pool)
                if slot is None:
                    return f"digest for slot pool {d.pool!r} this request did not name"
                r = written_ranges(theirs, pool, st.pieces.get(peer.endpoint_id, {}).get(d.pool))
                got = I.slot_digests(
                    pool,
                    slot,
                    mode,
                    idx,
                    portable=I.portable(pool, theirs),
                    spans=None if r is None else piece_spans(pool, r),
                )
            else:
                pages = st.dst.get(pool.indices_from or d.pool)
                if pages is None or d.start < st.prefix_len or d.end > st.num_tokens:
                    return (
                        f"digest of pool {d.pool!r} tokens [{d.start}, {d.end}) outside the request"
                    )
                prep = (
                    st.prepared.get((peer.endpoint_id, d.pool, d.start, d.end, d.lo, d.hi))
                    if mode == "sampled" and d.l1 == d.l0
                    else None
                )
                got = (
                    prep.digests()
                    if prep is not None
                    else I.digests(
                        pool,
                        I.Span(pages, st.prefix_len, d.start, d.end, d.lo, d.hi),
                        mode,
                        I.sample_stride(theirs, pool),
                        idx,
                        portable=I.portable(pool, theirs),
                    )
                )
        except PdxferError as e:
            return f"cannot check pool {d.pool!r}: {e}"
        except Exception as e:  # noqa: BLE001 - e.g. a device the portable digest cannot read
            log.exception("room %d: cannot digest pool %r", st.room, d.pool)
            return (
                f"cannot check pool {d.pool!r}: {type(e).__name__}: {e} (integrity='off' "
                f"turns the check off)"
            )
        self.ep.count("integrity_bytes", got.nbytes)
        if got == list(d.values):
            return ""
        for i, (g, w) in enumerate(zip(got, d.values)):
            if g != w:
                b = theirs.buffers[sel[i]]
                where = (
                    f"slot {st.slots.get(d.pool)}"
                    if pool.kind == "slot"
                    else f"tokens [{d.start}, {d.end})"
                )
                self.ep.count("integrity_mismatches")
                return (
                    f"pool {d.pool!r} layer {b.layer_id} {b.role} {where}: received KV "
                    f"does not match the sender's digest ({mode})"
                )
        return ""

    def _buffer_map(self, pool: PoolSpec, theirs: PoolSpec) -> list[int | None]:
        """Our buffer index for each of the sender's buffers (by layer and role), cached
        per peer pool (a pool object lives as long as its peer's handshake)."""
        hit = self._bufmaps.get(id(theirs))
        if hit is None or hit.theirs is not theirs:
            if len(self._bufmaps) > 4096:
                self._bufmaps.clear()
            mine = {(b.layer_id, b.role): i for i, b in enumerate(pool.buffers)}
            hit = self._bufmaps[id(theirs)] = _BufferMap(
                theirs, [mine.get((b.layer_id, b.role)) for b in theirs.buffers]
            )
        return hit.index

    def _inject(self, st: RecvRoom, kind: str, sender: str) -> None:
        """Damage one host page of the room's destination where ``sender`` wrote (fault
        injection, tests only): the bytes of its own heads, as its own misdirected or lost
        write would."""
        skip = st.skips.get(sender, ())
        pools = [
            p
            for p in self.ep.pools
            if p.kind == "paged"
            and p.item_bytes
            and p.location == "cpu"
            and (p.indices_from or p.name) in st.dst
            and p.name not in skip
            and self.faults.pools([p.name])
        ]
        if not pools:
            return
        pool = pools[self.faults.pick(len(pools))]
        pages = st.dst[pool.indices_from or pool.name]
        used = -(
            -(st.num_tokens - st.prefix_len + st.prefix_len % pool.page_size) // pool.page_size
        )
        if used <= 0:
            return
        i = self.faults.pick(min(used, int(pages.size)))
        page = int(pages[i])
        buf = pool.buffers[self.faults.pick(len(pool.buffers))]
        item = pool.item_bytes
        view = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (pool.num_items * item)).from_address(buf.addr)
        ).reshape(pool.num_items, item)
        cols = _head_bytes(pool, st.heads.get(sender, {}).get(pool.name))
        j = i + 1 if i + 1 < used else i - 1  # the next page (a lone page has none)
        taken = set(pages.tolist())
        stale = next((q for q in range(pool.num_items) if q not in taken), None)
        damage(view, kind, page, int(pages[j]) if j >= 0 else None, stale, cols)
        self.ep.count(f"faults_injected_{kind}")


def _uncovered(
    entries: list[tuple[int, int, int, int]], theirs: PoolSpec, start: int, end: int
) -> str:
    """What of tokens ``[start, end)`` no digest covers ("" when all is covered), layer by
    layer of the sender's pool when some digest covers only some layers: ``entries`` are
    ``(l0, l1, start, end)`` (``l0 == l1``: every layer)."""
    if all(l0 == l1 for l0, l1, _, _ in entries):
        ok = I.covers([(a, b) for _, _, a, b in entries], start, end)
        return "" if ok else f"tokens [{start}, {end})"
    for lid in sorted({b.layer_id for b in theirs.buffers}):
        got = [(a, b) for l0, l1, a, b in entries if l0 == l1 or l0 <= lid < l1]
        if not I.covers(got, start, end):
            return f"layer {lid} tokens [{start}, {end})"
    return ""
