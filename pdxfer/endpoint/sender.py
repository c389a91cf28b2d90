"""Prefill side: ``KVSender`` (the engine's handle for one request) and ``PrefillSide``, which
owns the room table and answers the decode's requests, aborts and releases.

``PrefillSide`` holds the rest of the side as objects, each owning its state and handed
what it shares: ``DecodePeers`` (``decode_peers.py``: handshakes and the peer table),
``PendingRequests`` (``pending.py``: requests parked until their room opens),
``Tombstones`` and ``Expected`` (rooms that ended here, or that the engine will open),
``Writer`` (``writer.py``: writes and terminal messages, on each room's worker) and
``Settler`` (``settler.py``). All of it is read and changed under the core's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from .. import plan as P
from .. import wire
from ..bootstrap.registration import MAX_REFUSALS, REASON_CHARS, TEXT_CHARS
from ..errors import (
    Aborted,
    DeadlineExceeded,
    DuplicateRoom,
    LayoutMismatch,
    PdxferError,
    PlanError,
)
from ..plan import chunk as C
from ..trust import Session
from .decode_peers import DecodePeer, DecodePeers, model_diff
from .expected import Expected
from .handles import KVPoll, RoomHandle
from .liveness import Liveness
from .pending import Parked, PendingRequests, pending_size
from .sender_rooms import Chunk, SenderRoom, Slot, Target, decodes
from .settler import Settler
from .tombstones import Tombstones
from .writer import Writer

if TYPE_CHECKING:
    from .core import Core

__all__ = ["DecodePeer", "KVSender", "PrefillSide", "model_diff"]

log = logging.getLogger(__name__)


class KVSender(RoomHandle):
    """The engine's handle for one request on the prefill side. Every call returns at once."""

    _side: PrefillSide
    _st: SenderRoom

    def send(
        self,
        pages: Mapping[str, object],
        slots: Mapping[str, int] | None = None,
        last: bool = False,
        *,
        layers: tuple[int, int] | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        """Hand over a finished prefill chunk: page indices per pool (anchors only), in prompt
        order. The last chunk also names the slot of each slot pool. A chunk given before the
        decode's request arrived waits for it.

        A chunk may carry some layers (``layers=(a, b)``: the buffers of layer ids
        ``[a, b)``) and name the tokens it computed (``tokens=(t0, t1)``; ``pages`` are then
        the pages holding tokens ``t0 .. t1 - 1``, and a page it fills in part is written
        for those tokens alone). Each layer must be given in token order, without gaps or
        overlaps; ``last`` marks the room's final send, by which every layer holds every
        token (``PlanError`` otherwise, as for a chunk that breaks these rules)."""
        self._side.add_chunk(self._st, pages, dict(slots or {}), last, layers, tokens)

    @property
    def prefix_len(self) -> int | None:
        """The decode's ``prefix_len`` once its request arrived (tokens it already holds)."""
        return min((t.req.prefix_len for t in self._st.targets), default=None)

    @property
    def holding(self) -> bool:
        """True while the decode may still ask to re-send a range (``hold_for_repair``): keep
        the source pages until this turns False (its ``Release`` or the hold deadline)."""
        return self._st.hold_until > 0

    @property
    def reading(self) -> bool:
        """True while a write may still read the source pages (also after a failure: writes
        in flight drain first). Pages the engine reuses before this is False may be sent in
        their new state."""
        return any(not t.finished for t in self._st.targets)

    def abort(self, reason: str = "aborted by prefill engine") -> None:
        self._side.fail(self._st, Aborted(f"room {self._st.room}: {reason}"))


class PrefillSide:
    """A prefill endpoint's rooms: the engine's calls, the decode's requests, aborts and
    releases, repair holds and deadlines; the side's other parts are held here."""

    def __init__(self, ep: Core) -> None:
        self.ep = ep
        self.cfg = cfg = ep.config
        lim = cfg.limits
        self.rooms: dict[int, SenderRoom] = {}
        self.pending = PendingRequests(lim.max_pending, lim.max_pending_bytes)
        self.tombstones = Tombstones(lim.max_tombstones, lim.bootstrap_timeout_s, ep.count)
        """Rooms that ended here, or that a decode aborted before its request came: a late
        request for them is refused at once (``tombstones.py``)."""
        self.expected = Expected(lim.max_tombstones, lim.bootstrap_timeout_s)
        """Rooms the engine received but has not opened (``expect``): a request for one waits
        until the bootstrap deadline, not only ``room_grace_s`` (``expected.py``)."""
        self.refused: OrderedDict[int, str] = OrderedDict()
        """Rooms whose decode's handshake this rank refused (the room fails on creation)."""
        self.refusals: OrderedDict[str, str] = OrderedDict()
        """Decodes whose handshake this rank refused last, and why (the newest
        ``MAX_REFUSALS``): carried in its registration, so a router can tell a client why
        that pair cannot serve it (``BootstrapServer.refusals``)."""
        self.refusals_changed = threading.Event()
        self.peers = DecodePeers(ep, self._peers_in_use, self._verdict)
        self.settler = Settler(ep.transport, ep.count, cfg.limits.transfer_timeout_s)
        """Holds what tells a decode a room's writes are over while a failed write to it may
        still land (``settler.py``)."""
        self.writer = Writer(ep, self.settler, self.fail, self._end_or_hold)
        self.page_sizes = {p.name: p.page_size for p in ep.pools}
        self.layers_of = C.pool_layers({p.name: p for p in ep.pools})
        self.liveness = Liveness(
            cfg.limits.heartbeat_s,
            self._holders,
            ep.transport.probe,
            self._holder_lost,
            name="pdxfer-hold-heartbeat",
        )

    def tables(self) -> dict[str, int]:
        """Sizes of this side's tables (leak checks, metrics; under the lock)."""
        return {
            "rooms": len(self.rooms),
            "pending": len(self.pending),
            "pending_bytes": self.pending.bytes,
            "held": sum(1 for s in self.rooms.values() if s.hold_until),
            "tombstones": len(self.tombstones),
            "refused": len(self.refused),
            "expected": len(self.expected.rooms),
            "peers": len(self.peers),
        }

    def close(self) -> None:
        self.liveness.close()
        self.settler.close()

    def _holders(self) -> dict[str, DecodePeer]:
        """Decodes that hold rooms here for a repair and have not released them."""
        with self.ep.lock:
            return {
                t.peer.endpoint_id: t.peer
                for st in self.rooms.values()
                if st.hold_until
                for t in st.targets
                if t.req.hold_for_repair and not t.released and t.peer.session
            }

    def _holder_lost(self, p: DecodePeer, dead: bool) -> None:
        """A decode that holds rooms stopped answering: if it is gone its Release will never
        come, so its holds end now (the engine gets its pages back). A hung one keeps them:
        it may wake up and ask for a repair; the hold deadline bounds that."""
        if not dead:
            log.info(
                "decode endpoint %s (%s) holding rooms is not responding", p.endpoint_id, p.session
            )
            return
        with self.ep.lock:
            held = [
                st
                for st in self.rooms.values()
                if st.hold_until and any(t.peer.endpoint_id == p.endpoint_id for t in st.targets)
            ]
            for st in held:
                for t in st.targets:
                    if t.peer.endpoint_id == p.endpoint_id:
                        t.released = True
                if all(t.finished for t in st.targets):
                    self._end_or_hold(st)
            p.probe_failures = 0
        if held:
            self.ep.count("holds_dropped", len(held))
            log.warning(
                "decode endpoint %s (%s) is gone: %d rooms held for its repairs end",
                p.endpoint_id,
                p.session,
                len(held),
            )

    def _peers_in_use(self) -> set[int]:
        """Peers the rooms and parked requests refer to (the peer table keeps them)."""
        busy = {id(t.peer) for st in self.rooms.values() for t in st.targets}
        return busy | self.pending.peers()

    def _verdict(self, msg: wire.Hello, reason: str) -> None:
        """A decode's handshake was refused (``reason``) or accepted (""): kept in the rank's
        refusals, and a refused one fails the room that started it, so the prefill does not
        wait for a request that cannot come (only a room not bound to another decode)."""
        who, kept = (msg.instance or msg.endpoint_id)[:TEXT_CHARS], reason[:REASON_CHARS]
        with self.ep.lock:
            if who and self.refusals.get(who, "") != kept:
                self.refusals.pop(who, None)
                if kept:
                    self.refusals[who] = kept
                    while len(self.refusals) > MAX_REFUSALS:
                        self.refusals.popitem(last=False)
                self.refusals_changed.set()
        if not reason or msg.room is None:
            return
        why = f"room {msg.room}: handshake from decode endpoint {msg.endpoint_id} refused: {reason}"
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None:
                self.refused[msg.room] = why
                while len(self.refused) > self.cfg.limits.max_tombstones:
                    self.refused.popitem(last=False)
                return
            if (
                st.targets
                or st.state.terminal
                or st.bound
                and st.bound not in (msg.endpoint_id, msg.instance)
            ):
                return
        self.fail(st, LayoutMismatch(why))

    # -- engine calls -------------------------------------------------------------------------

    def create(self, room: int, peer: str | None = None) -> KVSender:
        now = time.monotonic()
        with self.ep.lock:
            if room in self.rooms:
                raise DuplicateRoom(
                    f"room {room} is already active on prefill endpoint {self.ep.endpoint_id}"
                )
            self.tombstones.forget(room)
            self.expected.pop(room)
            st = SenderRoom(room, now + self.cfg.limits.bootstrap_timeout_s, bound=peer)
            self.rooms[room] = st
            self.ep.count("requests")
            for p in self.pending.take(room):
                self._attach(st, p.req, p.peer, now)
            refused = self.refused.pop(room, None)
        if refused is not None and not st.targets:
            self.fail(st, LayoutMismatch(refused))
        return KVSender(self, st)

    def expect(self, room: int, decode: str | None = None) -> None:
        """The engine received ``room``'s request and will open it later: a decode's request
        for it waits until the bootstrap deadline. Idempotent (renews the deadline); nothing
        to do for a room already open."""
        now = time.monotonic()
        with self.ep.lock:
            if room in self.rooms:
                return
            self.tombstones.forget(room)  # a new request reusing the room
            e = self.expected.add(room, decode, now)
            if self.expected.evicted:
                self.ep.count("expected_evicted", self.expected.evicted)
                self.expected.evicted = 0
            self.pending.extend(room, e.deadline)

    def withdraw(self, room: int, reason: str = "aborted by prefill engine") -> None:
        """The engine ended an expected room it never opened: a decode's request parked for
        it is refused now (``aborted``), and so is one that comes later."""
        with self.ep.lock:
            if self.expected.pop(room) is None or room in self.rooms:
                return
            why = f"was withdrawn by the prefill engine before it opened it ({reason})"
            self.tombstones.ended(room, why, "aborted")
            for p in self.pending.take(room):
                self._refuse(p.req, p.peer, f"room {room} {why}", "aborted")

    def add_chunk(
        self,
        st: SenderRoom,
        pages: Mapping[str, object],
        slots: dict[str, int],
        last: bool,
        layers: tuple[int, int] | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        if st.last_given:
            raise PlanError(f"room {st.room}: send() after the last chunk")
        arrays: dict[str, np.ndarray] = {}
        for name, idx in pages.items():
            pool = self.ep.pool(name)
            if pool.kind != "paged" or pool.indices_from is not None:
                raise PlanError(
                    f"room {st.room}: pool {name!r} takes no page indices in send() "
                    f"(slot pool, or follows {pool.indices_from!r})"
                )
            a = P.as_indices(idx, f"room {st.room} pool {name!r}")
            if isinstance(a, str):
                raise PlanError(a)
            arrays[name] = a
        layers = _pair(layers, "layers", st.room)
        tokens = _pair(tokens, "tokens", st.room)
        starts: list[Slot] = []
        try:
            with self.ep.lock:
                if st.state.terminal:
                    return
                c = C.claim(
                    st.room,
                    arrays,
                    self.page_sizes,
                    self.layers_of,
                    st.layer_cursor,
                    layers,
                    tokens,
                )
                if isinstance(c, str):
                    raise PlanError(c)
                st.layer_cursor.update(c.cursors)
                for n, cur in c.cursors.items():
                    st.cursor[n] = C.low(cur)
                st.chunks.append(Chunk(arrays, c.first, slots, last, c.span, c.layers))
                st.last_given = last
                if last and decodes(st) >= st.expected:
                    st.state = KVPoll.Transferring
                starts = self.writer.pump(st, start=True)
        finally:
            self.writer.start_slots(starts)  # off the lock (``Writer.pump``)

    def fail(self, st: SenderRoom, err: PdxferError) -> None:
        """Fail a room; each decode is told once its in-flight writes have drained."""
        with self.ep.lock:
            if st.state.terminal:
                return
            st.state = KVPoll.Failed
            st.failure = err
            self.ep.count_failure(err)
            log.info("room %d failed: %s", st.room, err)
            self.tombstones.ended(st.room, f"already failed on prefill: {err}")
            for t in st.targets:
                self.ep.workers.submit(st.room, partial(self.writer.finish, st, t, False, err))
            if not st.targets:
                self.rooms.pop(st.room, None)

    # -- messages ----------------------------------------------------------------------------

    def on_request(self, req: wire.TransferRequest, sess: Session | None, _: wire.Header) -> None:
        now = time.monotonic()
        peer = self.peers.lookup(req.endpoint_id, sess, f"request for room {req.room}")
        if peer is None:
            return
        with self.ep.lock:
            st = self.rooms.get(req.room)
            if st is None and not self._pending_fits(req, peer):
                return  # refused before its indices are even unpacked
            if st is not None and self._unbound(st, req, peer):
                return  # another decode's room: refused before its indices are unpacked
            why, dst = self._validate(req, peer)
            if why:
                self._refuse(req, peer, why, "plan")
                return
            if st is not None and st.repairable(peer):
                self._repair(st, req, peer, dst)
                return
            if st is None:
                tomb = self.tombstones.find(req.room, peer.endpoint_id, req.nonce)
                if tomb is not None:
                    self._refuse(req, peer, f"room {req.room} {tomb.why}", tomb.kind)
                    return
                self._park(req, peer, now)
                return
            self._attach(st, req, peer, now, dst)

    def _park(self, req: wire.TransferRequest, peer: DecodePeer, now: float) -> None:
        """Hold a request whose room has no sender yet, within the pending caps, for the
        grace its engine gets to open the room (``room_grace_s``): a room this prefill never
        saw may be one whose request has not reached it yet (early dispatch), or one it will
        never hold, and only the grace tells them apart. A room the engine ``expect``s, or
        one a decode asks for early (at dispatch: the request may still be on its way here),
        waits until the bootstrap deadline."""
        e = self.expected.get(req.room)
        grace = min(self.cfg.limits.room_grace_s, self.cfg.limits.bootstrap_timeout_s)
        exp = self.pending.deadline(req.room)
        if exp is None:
            exp = e.deadline if e else now + grace
        if req.early and not e:
            exp = max(exp, now + self.cfg.limits.bootstrap_timeout_s)
        if self.pending.has(req.room, peer.endpoint_id):
            self._refuse(
                req,
                peer,
                f"duplicate room {req.room} from the same decode endpoint",
                "duplicate_room",
            )
            return
        self.pending.park(Parked(req, peer, pending_size(req)), exp)

    def _pending_fits(self, req: wire.TransferRequest, peer: DecodePeer) -> bool:
        """Whether one more request fits the pending caps; refuses it when not."""
        if self.pending.fits(pending_size(req)):
            return True
        self.ep.count("rejected_pending_full")
        self._refuse(
            req,
            peer,
            f"too many requests waiting for their room on this prefill "
            f"({self.pending.count}, {self.pending.bytes} bytes)",
            "busy",
        )
        return False

    def on_abort(self, msg: wire.Abort, sess: Session | None, _: wire.Header) -> None:
        peer = self.peers.lookup(msg.endpoint_id, sess, f"abort of room {msg.room}")
        if peer is None:
            return
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            # a repair shares its first request's nonce: the unfinished one is the one to stop
            mine = (
                []
                if st is None
                else [
                    t
                    for t in st.targets
                    if t.req.nonce == msg.nonce and t.peer.endpoint_id == peer.endpoint_id
                ]
            )
            target = next((t for t in mine if not t.finished), mine[-1] if mine else None)
            if target is None:
                known = self.pending.drop(msg.room, msg.nonce, peer.endpoint_id)
                if not known and msg.room not in self.rooms:
                    # the request may still be on its way: refuse it when it comes
                    self.tombstones.aborted(
                        msg.room,
                        peer.endpoint_id,
                        msg.nonce,
                        "already failed on prefill: aborted by decode before its request arrived",
                    )
                if not known and self.ep.transport.tainted(peer.session):
                    # a room that ended here while a failed write to this decode may still
                    # land: its ack waits for the proof (the decode asks again)
                    self.ep.count("abort_acks_held")
                    self.settler.kick(peer.session)
                    return
                self.ep.send(
                    peer.ctrl_addr,
                    wire.AbortAck(
                        room=msg.room,
                        nonce=msg.nonce,
                        endpoint_id=self.ep.endpoint_id,
                        rank=self.cfg.tp_rank,
                        known=known,
                    ),
                    peer.sess,
                )
                return
            assert st is not None  # a target is one of the room's
            target.aborted = True
            if st.state == KVPoll.Success and not target.finished:
                # a repair of a room that succeeded: stop that one target once its writes
                # have drained (its worker job runs after them), the room stays held
                err = Aborted(f"room {msg.room}: repair aborted by decode")
                self.ep.workers.submit(st.room, lambda: self.writer.finish(st, target, False, err))
                return
        self.fail(st, Aborted(f"room {msg.room}: aborted by decode ({msg.reason or 'no reason'})"))

    def on_release(self, msg: wire.Release, sess: Session | None, _: wire.Header) -> None:
        """The decode needs no repair: a held room ends and its pages are the engine's."""
        peer = self.peers.lookup(msg.endpoint_id, sess, f"release of room {msg.room}")
        if peer is None:
            return
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None or not any(
                t.req.nonce == msg.nonce and t.peer.endpoint_id == peer.endpoint_id
                for t in st.targets
            ):
                self.ep.count("stale_messages")
                return
            for t in st.targets:
                if t.peer.endpoint_id == peer.endpoint_id:
                    t.released = True
            if st.hold_until and all(t.finished for t in st.targets):
                self._end_or_hold(st)

    def _end_or_hold(self, st: SenderRoom) -> None:
        """A room whose writes all finished leaves the table, unless it succeeded for a
        decode that may still ask for a repair (it asked ``hold_for_repair`` and has not sent
        ``Release``): then it is held until those Releases or its deadline."""
        if st.state == KVPoll.Success and any(
            x.req.hold_for_repair and not x.released for x in st.targets
        ):
            if not st.hold_until:
                st.hold_until = time.monotonic() + self.cfg.limits.transfer_timeout_s
            return
        st.hold_until = 0.0
        self._forget(st)

    def _forget(self, st: SenderRoom) -> None:
        """Take a room out of the table; one that succeeded is remembered (a failed one
        already is), so that a late request for it is refused at once (``UnknownRoom``)."""
        self.rooms.pop(st.room, None)
        if st.state == KVPoll.Success:
            self.tombstones.ended(
                st.room,
                "already ended on this prefill (it succeeded and its pages are released)",
                "unknown_room",
            )

    def _repair(
        self,
        st: SenderRoom,
        req: wire.TransferRequest,
        peer: DecodePeer,
        dst: dict[str, np.ndarray],
    ) -> None:
        """A decode that held this room asks for a range again (its local restore failed,
        or a digest did not match): write the range from the pages still held (called under
        the lock)."""
        if not any(
            t.peer.endpoint_id == peer.endpoint_id and t.req.hold_for_repair and not t.released
            for t in st.targets
        ):
            self._refuse(
                req,
                peer,
                f"room {req.room} is not held for decode {req.endpoint_id}",
                "duplicate_room",
            )
            return
        if any(t.peer.endpoint_id == peer.endpoint_id and not t.finished for t in st.targets):
            self._refuse(
                req,
                peer,
                f"room {req.room}: a repair for decode {req.endpoint_id} is already running",
                "duplicate_room",
            )
            return
        self.ep.count("repairs")
        st.targets.append(Target(req, peer, dst))
        if st.hold_until:
            st.hold_until = time.monotonic() + min(
                req.deadline_s, self.cfg.limits.transfer_timeout_s
            )
        self.writer.pump(st)

    def tick(self, now: float) -> None:
        expired: list[SenderRoom] = []
        with self.ep.lock:
            for st in self.rooms.values():
                if not st.state.terminal and now > st.deadline:
                    expired.append(st)
            grace = min(self.cfg.limits.room_grace_s, self.cfg.limits.bootstrap_timeout_s)
            for room, parked in self.pending.take_expired(now):
                kind, why = (
                    (
                        "deadline",
                        f"expected by this prefill's engine, which did "
                        f"not open it within {self.cfg.limits.bootstrap_timeout_s} s",
                    )
                    if self.expected.pop(room)
                    else (
                        "deadline",
                        f"asked for at dispatch, and this prefill's "
                        f"engine did not open it within "
                        f"{self.cfg.limits.bootstrap_timeout_s} s",
                    )
                    if any(p.req.early for p in parked)
                    else (
                        "unknown_room",
                        f"unknown to this prefill (its engine did not open it within {grace} s)",
                    )
                )
                for p in parked:
                    self._refuse(p.req, p.peer, f"room {room} is {why}", kind)
            self.expected.expire(now)
            self.tombstones.expire(now)
            for st in [
                x
                for x in self.rooms.values()
                if x.hold_until and now > x.hold_until and all(t.finished for t in x.targets)
            ]:
                log.info("room %d: no Release from the decode before the hold deadline", st.room)
                st.hold_until = 0.0
                self._forget(st)
        for st in expired:
            what = (
                "no request from the decode"
                if st.state == KVPoll.Bootstrapping
                else f"not finished (state {st.state.name})"
            )
            self.fail(st, DeadlineExceeded(f"room {st.room}: {what} before its deadline"))

    # -- internals -----------------------------------------------------------------------------

    def _refuse(self, req: wire.TransferRequest, peer: DecodePeer, reason: str, kind: str) -> None:
        log.info("refused request for room %d: %s", req.room, reason)
        self.ep.count(f"refused_{kind}")
        self.ep.send(
            peer.ctrl_addr,
            wire.TransferDone(
                room=req.room,
                nonce=req.nonce,
                endpoint_id=self.ep.endpoint_id,
                rank=self.cfg.tp_rank,
                ok=False,
                reason=reason,
                kind=kind,
            ),
            peer.sess,
        )

    def _validate(
        self, req: wire.TransferRequest, peer: DecodePeer
    ) -> tuple[str, dict[str, np.ndarray]]:
        dst = {name: wire.unpack_indices(packed) for name, packed in req.dst.items()}
        why = C.check_ask(C.ask_of(req, dst), peer.pools, peer.pairings, self.ep.pool_names)
        return (why, {}) if why else ("", dst)

    def _attach(
        self,
        st: SenderRoom,
        req: wire.TransferRequest,
        peer: DecodePeer,
        now: float,
        dst: dict[str, np.ndarray] | None = None,
    ) -> None:
        if st.state.terminal:
            self._refuse(req, peer, f"room {req.room} already ended on prefill", "remote")
            return
        if self._unbound(st, req, peer):
            return
        if any(t.peer.endpoint_id == peer.endpoint_id for t in st.targets):
            self._refuse(
                req,
                peer,
                f"duplicate room {req.room} from the same decode endpoint",
                "duplicate_room",
            )
            return
        if dst is None:
            why, dst = self._validate(req, peer)
            if why:
                self._refuse(req, peer, why, "plan")
                return
        st.targets.append(Target(req, peer, dst))
        st.t_request = st.t_request or now
        st.expected = req.decode_peers
        st.deadline = now + min(req.deadline_s, self.cfg.limits.transfer_timeout_s)
        if decodes(st) >= st.expected:
            st.state = KVPoll.Transferring if st.last_given else KVPoll.WaitingForInput
        self.writer.pump(st)

    def _unbound(self, st: SenderRoom, req: wire.TransferRequest, peer: DecodePeer) -> bool:
        """Refuse (and count) a request from a decode the room does not belong to."""
        why = st.why_unbound(peer, self.cfg.limits.fan_out)
        if not why:
            return False
        self.ep.count("rejected_not_bound")
        self._refuse(req, peer, why, "protocol")
        return True


def _pair(x: tuple[int, int] | None, what: str, room: int) -> tuple[int, int] | None:
    """``layers``/``tokens`` of a ``send()`` as two ints (``PlanError`` otherwise)."""
    if x is None:
        return None
    try:
        a, b = (int(v) for v in x)
    except (TypeError, ValueError) as e:
        raise PlanError(f"room {room}: {what} must be two integers, got {x!r}") from e
    return a, b
