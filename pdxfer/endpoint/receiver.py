"""Decode side: ``KVReceiver`` (one per request) and ``DecodeSide``, the room table and the
handlers for prefill messages.

Page lifetime is fail-closed (docs/failure-semantics.md): a failed request's destination
pages go back to the engine (the ``release`` callback) only when no write can still land in
them: every sender answered ``TransferDone`` or ``AbortAck``, or was declared dead. Until
then they stay held and, past ``abort_timeout_s``, are counted as quarantined.

Bootstrap lookups and handshakes block, so they run on the ``Connector``'s threads
(``connect.py``); the engine's calls only record intent and return. Once a route is resolved
and its prefill endpoints have acknowledged the Hello, ``request()`` sends the
TransferRequest from the caller's thread (a non-blocking socket send), saving a thread hop
per request. ``IntegrityChecks`` (``integrity_checks.py``) checks what landed;
``receiver_rooms.py`` holds the room record.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .. import integrity as I
from .. import plan as P
from .. import wire
from ..config import knobs
from ..errors import (
    Aborted,
    BootstrapError,
    DeadlineExceeded,
    DuplicateRoom,
    LayoutMismatch,
    PdxferError,
    PeerLost,
    PlanError,
    from_kind,
)
from ..plan import topology as T
from ..plan.heads import lease_bytes
from ..plan.pack import PACK_POOL, pack_bytes, wanted
from ..pools import PoolSpec
from ..trust import Session
from .connect import Connector, PrefillPeer, Resolved
from .handles import KVPoll, Release, ReleaseOnce, RoomHandle
from .integrity_checks import IntegrityChecks
from .liveness import Liveness
from .pack import staging_for, unpack
from .receiver_rooms import RecvRoom, route_key
from .staging import Lease, Staging, scatter

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger(__name__)


class KVReceiver(RoomHandle):
    """The engine's handle for one request on the decode side. Every call returns at once."""

    _side: DecodeSide
    _st: RecvRoom

    def request(
        self,
        dst: Mapping[str, object],
        slots: Mapping[str, int] | None = None,
        prefix_len: int = 0,
        num_tokens: int | None = None,
        hold_for_repair: bool = False,
    ) -> None:
        """Ask the prefill for tokens ``[prefix_len, num_tokens)`` into ``dst`` (page indices
        per anchor pool, covering tokens from ``prefix_len``) and slot rows ``slots``.
        ``num_tokens`` defaults to what the first pool's pages cover. ``hold_for_repair``
        asks the prefill to keep its pages after Success until ``release_source()`` (or its
        deadline), so a later request for the same room can re-send a range."""
        if not self._st.requested:
            self._st.hold_for_repair = hold_for_repair
        self._side.request(self._st, dst, dict(slots or {}), prefix_len, num_tokens)

    def release_source(self) -> None:
        """Tell the prefill it may free the room's pages (no repair will follow)."""
        self._side.release_sources(self._st, self._st.targets)

    @property
    def done_at(self) -> float | None:
        """``time.monotonic()`` when Success arrived (None before)."""
        return self._st.t_done or None

    @property
    def quarantined(self) -> bool:
        return self._st.quarantined

    @property
    def released(self) -> bool:
        return self._st.released.done

    def stats(self) -> dict[str, Any]:
        st = self._st
        return {
            "bytes": st.bytes,
            "blocks": st.blocks,
            "senders": len(st.targets),
            "seconds": (st.t_done - st.t_request) if st.t_done else None,
        }

    def abort(self, reason: str = "aborted by decode engine") -> None:
        self._side.fail(self._st, Aborted(f"room {self._st.room}: {reason}"))


class DecodeSide:
    """Room tables, connector and heartbeat of a decode endpoint."""

    def __init__(self, ep: Core) -> None:
        self.ep = ep
        self.cfg = ep.config
        odd = sorted({p.location for p in ep.pools if p.item_bytes and not I.supported(p.location)})
        self.integrity = self.cfg.integrity if not odd else "off"
        if self.cfg.integrity != "off" and odd:
            log.warning(
                "integrity=%s: pools on %s cannot be digested (host and CUDA pools "
                "can): received KV is not checked",
                self.cfg.integrity,
                odd,
            )
        self.rooms: dict[int, RecvRoom] = {}
        n = Staging.wanted(ep.pools)
        self.staging = Staging(n) if n else None
        if self.staging is not None:
            ep.transport.register(self.staging.addr, n, "cpu")
        self.packing = staging_for(ep.pools, self.cfg.limits.pack)  # leases of packed requests
        if self.packing is not None:
            ep.transport.register(self.packing.addr, self.packing.nbytes, self.packing.location)
        extra = ((self.staging.spec(),) if self.staging else ()) + (
            (self.packing.spec(PACK_POOL),) if self.packing else ()
        )
        self.connector = Connector(ep, extra)
        self.peers = self.connector.peers
        self.checks = IntegrityChecks(ep, self.rooms, self.peers)
        self.liveness = Liveness(
            self.cfg.limits.heartbeat_s, self._watched, ep.transport.probe, self._peer_lost
        )

    # -- engine calls -------------------------------------------------------------------------

    def create(
        self,
        room: int,
        bootstrap: str,
        instance: str | None,
        dp: int | None,
        release: Release | None,
        early: bool = False,
    ) -> KVReceiver:
        if not 0 <= room < 1 << 63:
            raise PlanError(f"room {room} out of range [0, 2^63)")
        with self.ep.lock:
            if room in self.rooms:
                raise DuplicateRoom(
                    f"room {room} is already active on decode endpoint {self.ep.endpoint_id}"
                )
            st = RecvRoom(
                room,
                bootstrap,
                instance,
                dp,
                ReleaseOnce(room, release),
                time.monotonic() + self.cfg.limits.bootstrap_timeout_s,
                early=early,
            )
            self.rooms[room] = st
            self.ep.count("requests")
        return KVReceiver(self, st)

    def request(
        self,
        st: RecvRoom,
        dst: Mapping[str, object],
        slots: dict[str, int],
        prefix_len: int,
        num_tokens: int | None,
    ) -> None:
        """Validate the engine's request, then send it; a request that raises leaves the room
        Failed at once with that reason (no receiver lingers until its deadline)."""
        if st.requested:
            raise PlanError(f"room {st.room}: request() called twice")
        try:
            arrays, num_tokens = self._check_request(st, dst, slots, prefix_len, num_tokens)
        except Exception as e:
            err = e if isinstance(e, PdxferError) else PlanError(f"room {st.room}: {e}")
            self.fail(st, err)
            raise
        with self.ep.lock:
            if st.state.terminal:
                return
            st.requested = True
            st.dst, st.slots = arrays, {k: int(v) for k, v in slots.items()}
            st.prefix_len, st.num_tokens = prefix_len, num_tokens
            retry = self.cfg.limits.integrity_retry
            if retry and self.integrity != "off" and not st.hold_for_repair:
                st.hold_for_repair = st.auto_hold = True
        c = self.connector.cached(route_key(st))
        if c is None:
            self.connector.connect(
                route_key(st),
                st.room,
                st.deadline,
                lambda r: self._connected(st, r),
                lambda e: self._connect_failed(st, e),
            )
        else:
            self._connected(st, c)  # nothing left that blocks: no hop through the connector

    def _check_request(
        self,
        st: RecvRoom,
        dst: Mapping[str, object],
        slots: dict[str, int],
        prefix_len: int,
        num_tokens: int | None,
    ) -> tuple[dict[str, np.ndarray], int]:
        """The destination arrays and token count, or ``PlanError``: indices in range and
        distinct (a page named twice would lose half its tokens), ``prefix_len`` on a page
        boundary of every pool (the first destination page starts at ``prefix_len``)."""
        arrays: dict[str, np.ndarray] = {}
        for name, idx in dst.items():
            pool = self.ep.pool(name)
            if pool.kind != "paged" or pool.indices_from is not None:
                raise PlanError(f"room {st.room}: pool {name!r} takes no destination indices")
            a = P.as_indices(idx, f"room {st.room} pool {name!r}")
            if isinstance(a, str):
                raise PlanError(a)
            if a.size and (int(a.min()) < 0 or int(a.max()) >= pool.num_items):
                raise PlanError(
                    f"room {st.room}: destination index out of range [0, "
                    f"{pool.num_items}) for pool {name!r}"
                )
            if np.unique(a).size != a.size:
                raise PlanError(
                    f"room {st.room}: pool {name!r} names a destination page more than once"
                )
            if prefix_len % pool.page_size:
                raise PlanError(
                    f"room {st.room}: prefix_len {prefix_len} is not a multiple of "
                    f"pool {name!r}'s page size {pool.page_size} (the decode's "
                    f"pages start at prefix_len; round it down to a page)"
                )
            arrays[name] = a
        for name, slot in slots.items():
            pool = self.ep.pool(name)
            if pool.kind != "slot" or not 0 <= int(slot) < pool.num_items:
                raise PlanError(f"room {st.room}: bad slot {slot} for pool {name!r}")
        if num_tokens is None:
            first = next(iter(arrays.items()), None)
            num_tokens = prefix_len + (
                first[1].size * self.ep.pool(first[0]).page_size if first else 0
            )
        if not 0 <= prefix_len <= num_tokens:
            raise PlanError(f"room {st.room}: need 0 <= prefix_len <= num_tokens")
        for name, a in arrays.items():
            if a.size * self.ep.pool(name).page_size < num_tokens - prefix_len:
                raise PlanError(
                    f"room {st.room}: pool {name!r} pages cover fewer than "
                    f"{num_tokens - prefix_len} tokens"
                )
        return arrays, num_tokens

    def fail(self, st: RecvRoom, err: PdxferError) -> None:
        """Fail a room and ask every sender that may still write to drain and acknowledge."""
        with self.ep.lock:
            if st.state.terminal:
                return
            st.state = KVPoll.Failed
            st.failure = err
            st.abort_deadline = time.monotonic() + self.cfg.limits.abort_timeout_s
            self.ep.timeline.observe("failed", time.monotonic() - st.t_created)
            self.ep.count_failure(err)
            log.info("room %d failed: %s", st.room, err)
            targets = [p for p in st.targets if p.endpoint_id in st.outstanding]
            finished = [p for p in st.targets if p.endpoint_id not in st.outstanding]
        for p in targets:
            self.ep.send(
                p.ctrl_addr,
                wire.Abort(
                    room=st.room, nonce=st.nonce, reason=str(err), endpoint_id=self.ep.endpoint_id
                ),
                p.sess,
            )
        if st.auto_hold and finished:
            self.release_sources(st, finished)
        self._maybe_release(st)

    # -- connector (blocking, off the engine loop) ----------------------------------------------

    def _connected(self, st: RecvRoom, resolved: Resolved) -> None:
        peers, plan, npeers = resolved
        try:
            leases = [self._stage(st, a.heads, p.pools) for p, a in zip(peers, plan)]
            leases = [ls + self._pack(st, a, p.pools, ls) for p, a, ls in zip(peers, plan, leases)]
        except Exception as e:  # noqa: BLE001 - anything unexpected still fails the room
            self.connector.forget_route(route_key(st))
            self._connect_failed(st, e)
            return
        self._post(st, peers, plan, npeers, leases)

    def _connect_failed(self, st: RecvRoom, e: Exception) -> None:
        if not isinstance(e, PdxferError):
            log.error("connect for room %d failed", st.room, exc_info=e)
            e = BootstrapError(f"room {st.room}: {e}")
        self.fail(st, e)

    def _post(
        self,
        st: RecvRoom,
        peers: list[PrefillPeer],
        plan: list[T.Assignment],
        npeers: int,
        leases: list[list[Lease]],
    ) -> None:
        """Send the room's TransferRequest to every peer (never blocks)."""
        now = time.monotonic()
        with self.ep.lock:
            if st.state.terminal:
                self._unlease([x for ls in leases for x in ls])
                return
            st.leases = {p.endpoint_id: ls for p, ls in zip(peers, leases) if ls}
            st.skips = {p.endpoint_id: tuple(a.skip) for p, a in zip(peers, plan)}
            st.heads = {p.endpoint_id: dict(a.heads) for p, a in zip(peers, plan) if a.heads}
            st.pieces = {p.endpoint_id: dict(a.pieces) for p, a in zip(peers, plan) if a.pieces}
            st.integrity = self.integrity
            st.nonce = random.getrandbits(63)
            st.targets = [p for p, a in zip(peers, plan) if not a.silent]
            st.outstanding = {p.endpoint_id for p in st.targets}
            st.state = KVPoll.WaitingForInput
            st.deadline = now + self.cfg.limits.transfer_timeout_s
            st.t_request = now
            req = wire.TransferRequest(
                room=st.room,
                nonce=st.nonce,
                endpoint_id=self.ep.endpoint_id,
                dst={k: wire.pack_indices(v) for k, v in st.dst.items()},
                slots=st.slots,
                prefix_len=st.prefix_len,
                num_tokens=st.num_tokens,
                expected_senders=max(1, len(st.targets)),
                decode_peers=npeers,
                deadline_s=self.cfg.limits.transfer_timeout_s,
                hold_for_repair=st.hold_for_repair,
                integrity=st.integrity,
                early=st.early,
            )
            # Queued under the lock: an abort (which takes the lock) either sees the room
            # terminal before this, or queues its Abort behind the request on the same socket.
            for p, a in zip(peers, plan):
                frame = wire.encode(
                    msgspec.structs.replace(
                        req,
                        heads=a.heads,
                        pieces=a.pieces,
                        skip=a.skip,
                        silent=a.silent,
                        stage={
                            x.pool: x.addr for x in st.leases.get(p.endpoint_id, []) if not x.packed
                        },
                        pack={x.pool: x.addr for x in st.leases.get(p.endpoint_id, []) if x.packed},
                    )
                )
                if st.auto_hold and not a.silent:
                    st.asks[p.endpoint_id] = frame
                self.ep.send_frame(p.ctrl_addr, frame, p.sess)
        if st.integrity == "sampled":
            self.checks.prepare(st, peers, plan)
        if not st.targets:  # every asked rank is silent: nothing this decode needs is there
            if any(p.item_bytes and not p.optional for p in self.ep.pools):
                self.fail(
                    st,
                    LayoutMismatch(
                        f"room {st.room}: no prefill endpoint writes any of this decode's pools"
                    ),
                )
                return
            with self.ep.lock:
                if not st.state.terminal:
                    st.state = KVPoll.Success
                    st.t_done = time.monotonic()

    # -- messages ----------------------------------------------------------------------------

    def _settle(
        self, msg: wire.TransferDone | wire.AbortAck, sess: Session | None
    ) -> RecvRoom | None:
        """The room a sender's terminal message belongs to, now that sender is no longer
        outstanding; None (counted as stale) for an unknown room, old nonce or repeat, or a
        message whose session is not that sender's."""
        st = self.rooms.get(msg.room)
        if sess is not None and not (
            isinstance(sess.peer, PrefillPeer)
            and sess.peer.endpoint_id == msg.endpoint_id
            and st is not None
            and any(p.endpoint_id == msg.endpoint_id for p in st.targets)
        ):
            self.ep.count("rejected_wrong_pair")
            return None
        if st is None or st.nonce != msg.nonce or msg.endpoint_id not in st.outstanding:
            self.ep.count("stale_messages")
            return None
        st.outstanding.discard(msg.endpoint_id)
        return st

    def on_done(self, msg: wire.TransferDone, sess: Session | None, _: wire.Header) -> None:
        bad: PdxferError | None = None
        if msg.ok and (sess is None or sess.peer.endpoint_id == msg.endpoint_id):
            self._unstage(msg)
            bad = self.checks.check(msg)
        success = False
        with self.ep.lock:
            st = self._settle(msg, sess)
            if st is None:
                return
            st.bytes += msg.bytes
            st.blocks += msg.blocks
            if bad is not None and self.checks.retry(st, msg.endpoint_id, bad):
                return
            if msg.ok and bad is None:
                st.done.add(msg.endpoint_id)
                if len(st.done) == len(st.targets) and not st.state.terminal:
                    st.state = KVPoll.Success
                    st.t_done = time.monotonic()
                    success = True
                    self.ep.timeline.observe("bootstrap", st.t_request - st.t_created)
                    self.ep.timeline.observe("transfer", st.t_done - st.t_request)
                    self.ep.count("success")
                    self.ep.count_transfer(st.bytes, st.blocks)
        if success:
            self.connector.vouch(route_key(st))
        if success and st.auto_hold:
            self.release_sources(st, st.targets)
        if bad is not None:
            self.fail(st, bad)
        elif not msg.ok:
            self.fail(
                st,
                from_kind(
                    msg.kind,
                    f"room {msg.room}: prefill endpoint {msg.endpoint_id} failed: {msg.reason}",
                ),
            )
        self._maybe_release(st)

    def release_sources(self, st: RecvRoom, targets: list[PrefillPeer]) -> None:
        """Let senders that hold the room for a repair free its pages (the engine's
        ``release_source``, or this side itself for ``integrity_retry``)."""
        for p in targets:
            self.ep.send(
                p.ctrl_addr,
                wire.Release(room=st.room, nonce=st.nonce, endpoint_id=self.ep.endpoint_id),
                p.sess,
            )

    def on_hello_ack(self, msg: wire.HelloAck, sess: Session | None, h: wire.Header) -> None:
        self.connector.on_hello_ack(msg, sess, h)

    def on_abort_ack(self, msg: wire.AbortAck, sess: Session | None, _: wire.Header) -> None:
        with self.ep.lock:
            st = self._settle(msg, sess)
            peer = (
                None
                if st is None
                else next((p for p in st.targets if p.endpoint_id == msg.endpoint_id), None)
            )
        if st is not None:
            if st.auto_hold and peer is not None:  # it may hold the room for a repair
                self.release_sources(st, [peer])
            self._maybe_release(st)

    def on_abort(self, msg: wire.Abort, sess: Session | None, _: wire.Header) -> None:
        """A prefill gave up on a room (it sends TransferDone(ok=False) for that)."""
        self.ep.count("stale_messages")

    def _retire_sessions(self, peers: list[PrefillPeer]) -> None:
        """Drop the sessions of lost (hung) peers that no room waits on any more (under the
        lock): ``drop_peer`` kept them so their ``AbortAck`` could still be admitted."""
        for p in peers:
            if self.peers.get(p.endpoint_id) is p or p.sess is None:
                continue
            if not any(p in o.targets for o in self.rooms.values()):
                self.ep.trust.drop(p.sess)

    def _maybe_release(self, st: RecvRoom) -> None:
        """Drop a finished room; hand a failed room's pages back once nothing can land."""
        with self.ep.lock:
            if st.outstanding or not st.state.terminal:
                return
            self.rooms.pop(st.room, None)
            self._retire_sessions(st.targets)
            self._unlease([x for ls in st.leases.values() for x in ls])
            st.leases = {}
            if st.state != KVPoll.Failed or not st.released.claim():
                return
            st.quarantined = False
        st.released.fire(st.dst, st.slots)

    # -- staging (head slices, see staging.py) ------------------------------------------------

    def _stage(
        self, st: RecvRoom, heads: Mapping[str, tuple[int, int]], theirs: Mapping[str, PoolSpec]
    ) -> list[Lease]:
        """Leases for the host pools a sender writes as a head slice: part of this rank's
        heads, or part of its own (then its pages are not ours: in place that is one entry
        per token or page and buffer). Whole pages on both sides (1:1) stay direct."""
        out: list[Lease] = []
        if self.staging is None:
            return out
        for name, (lo, hi) in heads.items():
            pool = self.ep.pool(name)
            sh, other = pool.sharding, theirs.get(name)
            if (
                pool.location != "cpu"
                or other is None
                or sh.kind != "heads"
                or (pool.indices_from or name) not in st.dst
            ):
                continue  # only pools this room writes (a room may ask for some pools)
            osh = other.sharding
            if (
                (lo, hi)
                == (sh.first_head, sh.first_head + sh.rank_heads)
                == (osh.first_head, osh.first_head + osh.rank_heads)
            ):
                continue
            n = lease_bytes(pool, st.num_tokens - st.prefix_len, lo, hi)
            addr = self.staging.alloc(n) if n else None
            if addr is None:  # full: that pool falls back to in-place writes
                if n:
                    self.ep.count("staging_full")
                continue
            self.ep.count(f"staged_leases_{sh.layout.lower()}")
            out.append(Lease(name, addr, n, lo, hi))
        return out

    def _pack(
        self, st: RecvRoom, a: T.Assignment, theirs: Mapping[str, PoolSpec], staged: list[Lease]
    ) -> list[Lease]:
        """Leases of the pack staging for the pools a sender writes as whole token rows and
        ``plan.pack.wanted`` picks (a full staging leaves that pool direct)."""
        out: list[Lease] = []
        if self.packing is None or a.silent:
            return out
        k = knobs()
        ntok = st.num_tokens - st.prefix_len
        done = {x.pool for x in staged}
        for pool in self.ep.pools:
            anchor = pool.indices_from or pool.name
            other = theirs.get(pool.name)
            if (
                other is None
                or pool.name in done
                or pool.name in a.skip
                or anchor not in st.dst
                or pool.location != self.packing.location
                or ntok <= 0
                or not wanted(
                    self.cfg.limits.pack,
                    pool,
                    other,
                    a.heads.get(pool.name),
                    int(st.dst[anchor].size),
                    k.pack_min_pages,
                    int(k.pack_max_page_kb * 1024),
                )
            ):
                continue
            n = pack_bytes(pool, ntok)
            addr = self.packing.alloc(n)
            if addr is None:
                self.ep.count("pack_full")
                continue
            self.ep.count("packed_leases")
            out.append(Lease(pool.name, addr, n, 0, 0, packed=True))
        return out

    def _unlease(self, leases: list[Lease]) -> None:
        for x in leases:
            s = self.packing if x.packed else self.staging
            if s is not None:
                s.release(x.addr, x.nbytes)

    def _unstage(self, msg: wire.TransferDone) -> None:
        """Scatter a finished sender's staged slices into the pools (before it counts as done:
        the room cannot succeed, nor its leases be freed, while this runs)."""
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None or st.nonce != msg.nonce or msg.endpoint_id not in st.outstanding:
                return
            leases = st.leases.get(msg.endpoint_id, [])
            peer = self.peers.get(msg.endpoint_id)
        for x in leases:
            pool = self.ep.pool(x.pool)
            theirs = peer.pools.get(x.pool) if peer is not None else None
            layers = (
                {(b.layer_id, b.role) for b in theirs.buffers}
                if theirs is not None
                else {(b.layer_id, b.role) for b in pool.buffers}
            )
            if x.packed:
                unpack(
                    pool,
                    x,
                    st.dst[pool.indices_from or x.pool],
                    st.prefix_len,
                    st.num_tokens,
                    layers,
                )
                continue
            scatter(
                pool,
                x,
                st.dst[pool.indices_from or x.pool],
                st.prefix_len,
                st.num_tokens,
                layers,
                self.staging.executor if self.staging else None,
            )

    # -- periodic ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        expired: list[RecvRoom] = []
        resend: list[tuple[PrefillPeer, wire.Abort]] = []
        with self.ep.lock:
            for st in self.rooms.values():
                if not st.state.terminal and now > st.deadline:
                    expired.append(st)
                elif st.state == KVPoll.Failed and st.outstanding and now > st.abort_deadline:
                    if not st.quarantined:
                        st.quarantined = True
                        self.ep.count("quarantined_requests")
                        log.warning(
                            "room %d: pages quarantined, senders %s have not confirmed "
                            "that their writes drained",
                            st.room,
                            sorted(st.outstanding),
                        )
                    # the Abort (or its ack) may have been lost: ask again until answered
                    st.abort_deadline = now + self.cfg.limits.abort_timeout_s
                    msg = wire.Abort(
                        room=st.room,
                        nonce=st.nonce,
                        reason="retransmit",
                        endpoint_id=self.ep.endpoint_id,
                    )
                    resend += [
                        (self._current(p), msg)
                        for p in st.targets
                        if p.endpoint_id in st.outstanding
                    ]
        for p, msg in resend:
            self.ep.count("abort_retransmits")
            self.ep.send(p.ctrl_addr, msg, p.sess)
        for st in expired:
            what = (
                f"bootstrap lookup ({st.bootstrap}"
                f"{', instance ' + st.instance if st.instance else ''}) or handshake"
                if st.state == KVPoll.Bootstrapping
                else f"transfer (state {st.state.name}, waiting for {sorted(st.outstanding)})"
            )
            self.fail(
                st, DeadlineExceeded(f"room {st.room}: {what} did not finish before its deadline")
            )

    def _current(self, p: PrefillPeer) -> PrefillPeer:
        """Where a retransmitted Abort goes (under the lock): the room's peer, or the one
        that replaced it after a new handshake with the same endpoint (the prefill dropped
        the old pair on that Hello, so only the new session still reaches it)."""
        cur = self.peers.get(p.endpoint_id)
        if (
            cur is not None
            and cur is not p
            and cur.ready.is_set()
            and cur.session
            and not (cur.dead or cur.refused)
        ):
            return cur
        return p

    def quarantined_pages(self) -> int:
        with self.ep.lock:
            return sum(
                int(a.size) for st in self.rooms.values() if st.quarantined for a in st.dst.values()
            )

    def _watched(self) -> dict[str, PrefillPeer]:
        """The prefill endpoints that rooms wait on (the heartbeat probes these)."""
        with self.ep.lock:
            return {
                p.endpoint_id: p
                for st in self.rooms.values()
                for p in st.targets
                if p.endpoint_id in st.outstanding and p.session
            }

    def _peer_lost(self, p: PrefillPeer, dead: bool) -> None:
        what = (
            "stopped answering"
            if dead
            else "is not responding (hung, or the network to it is down)"
        )
        log.warning("prefill endpoint %s (%s) %s", p.endpoint_id, p.session, what)
        self.ep.count("peers_lost" if dead else "peers_hung")
        self.connector.drop_peer(p, keep_session=not dead)
        with self.ep.lock:
            p.dead = p.dead or dead
            hit = [st for st in self.rooms.values() if p.endpoint_id in st.outstanding]
        if dead:
            self.ep.forget(p.ctrl_addr)
        for st in hit:
            self.fail(
                st,
                PeerLost(f"room {st.room}: prefill endpoint {p.endpoint_id} ({p.session}) {what}"),
            )
            if dead:
                with self.ep.lock:
                    # A dead process cannot write any more: its pages are safe.
                    st.outstanding.discard(p.endpoint_id)
                self._maybe_release(st)

    def close(self) -> None:
        self.liveness.close()
        self.connector.close()
        if self.staging is not None:
            self.staging.close()
        if self.packing is not None:
            self.packing.close()
