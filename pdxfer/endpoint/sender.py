"""Prefill side: ``KVSender`` (one per request), the room table and the handlers for the decode's
requests, aborts and releases.

The side is read in three parts: this file (rooms and requests), ``sender_hello.py`` (the
decode peers and their handshakes) and ``sender_writes.py`` (planning, writing and the
terminal messages); ``sender_rooms.py`` holds the tables they share.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .. import plan as P
from .. import wire
from ..config import knobs
from ..errors import (
    Aborted,
    DeadlineExceeded,
    DuplicateRoom,
    LayoutMismatch,
    PdxferError,
    PlanError,
)
from ..plan import chunk as C
from .handles import KVPoll, RoomHandle
from .liveness import Liveness
from .expected import Expected
from .sender_hello import Handshakes, model_diff
from .sender_rooms import (
    Chunk,
    DecodePeer,
    Pending,
    SenderRoom,
    Slot,
    Target,
    decodes,
    pending_size,
)
from .settler import Settler
from .sender_writes import Writes
from .staging import Staging
from .trust import Session

if TYPE_CHECKING:
    from .core import Core

__all__ = ["DecodePeer", "KVSender", "PrefillSide", "model_diff"]

log = logging.getLogger("pdxfer.sender")


class KVSender(RoomHandle):
    """The engine's handle for one request on the prefill side. Every call returns at once."""

    _side: PrefillSide
    _st: SenderRoom

    def send(self, pages: Mapping[str, object], slots: Mapping[str, int] | None = None,
             last: bool = False, *, layers: tuple[int, int] | None = None,
             tokens: tuple[int, int] | None = None) -> None:
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


class PrefillSide(Handshakes, Writes):
    """Room tables and message handlers of a prefill endpoint."""

    def __init__(self, ep: Core) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.rooms: dict[int, SenderRoom] = {}
        self.pending: dict[int, tuple[float, list[Pending]]] = {}
        self.pending_bytes = 0
        self.pending_count = 0
        self.tombstones: OrderedDict[tuple[int, str, int], tuple[float, str, str]] = \
            OrderedDict()
        """Rooms that ended here (key ``(room, "", 0)``: failed, or succeeded and left the
        table) or that a decode aborted before its request came (``(room, endpoint,
        nonce)``): a late request for them is refused at once, with the reason and failure
        kind kept here. Bounded by ``max_tombstones`` (a hostile decode cannot grow it)."""
        self.expected = Expected(self.cfg.max_tombstones, self.cfg.bootstrap_timeout_s)
        """Rooms the engine received but has not opened (``expect``): a request for one waits
        until the bootstrap deadline, not only ``room_grace_s`` (``sender_expect.py``)."""
        self.refused: OrderedDict[int, str] = OrderedDict()
        """Rooms whose decode's handshake this rank refused (the room fails on creation)."""
        self.peers: OrderedDict[str, DecodePeer] = OrderedDict()
        self.page_sizes = {p.name: p.page_size for p in ep.pools}
        self.layers_of = C.pool_layers({p.name: p for p in ep.pools})
        host = all(p.location == "cpu" for p in ep.pools)
        n = Staging.wanted(ep.pools) if host and knobs().gather else 0
        self.staging = Staging(n) if n else None  # gathers head slices into few big writes
        if self.staging is not None:
            ep.transport.register(self.staging.addr, n, "cpu")
        self.liveness = Liveness(self.cfg.heartbeat_s, self._holders, ep.transport.probe,
                                 self._holder_lost, name="pdxfer-hold-heartbeat")
        self.settler = Settler(ep.transport, ep.count, self.cfg.transfer_timeout_s)
        """Holds what tells a decode a room's writes are over while a failed write to it may
        still land (``sender_settle.py``)."""

    def close(self) -> None:
        self.liveness.close()
        self.settler.close()

    def _holders(self) -> dict[str, DecodePeer]:
        """Decodes that hold rooms here for a repair and have not released them."""
        with self.ep.lock:
            return {t.peer.endpoint_id: t.peer for st in self.rooms.values() if st.hold_until
                    for t in st.targets if t.req.hold_for_repair and not t.released
                    and t.peer.session}

    def _holder_lost(self, p: DecodePeer, dead: bool) -> None:
        """A decode that holds rooms stopped answering: if it is gone its Release will never
        come, so its holds end now (the engine gets its pages back). A hung one keeps them:
        it may wake up and ask for a repair; the hold deadline bounds that."""
        if not dead:
            log.info("decode endpoint %s (%s) holding rooms is not responding", p.endpoint_id,
                     p.session)
            return
        with self.ep.lock:
            held = [st for st in self.rooms.values() if st.hold_until
                    and any(t.peer.endpoint_id == p.endpoint_id for t in st.targets)]
            for st in held:
                for t in st.targets:
                    if t.peer.endpoint_id == p.endpoint_id:
                        t.released = True
                if all(t.finished for t in st.targets):
                    self._end_or_hold(st)
            p.probe_failures = 0
        if held:
            self.ep.count("holds_dropped", len(held))
            log.warning("decode endpoint %s (%s) is gone: %d rooms held for its repairs end",
                        p.endpoint_id, p.session, len(held))

    # -- engine calls -------------------------------------------------------------------------

    def create(self, room: int, peer: str | None = None) -> KVSender:
        now = time.monotonic()
        with self.ep.lock:
            if room in self.rooms:
                raise DuplicateRoom(f"room {room} is already active on prefill endpoint "
                                    f"{self.ep.endpoint_id}")
            self.tombstones.pop((room, "", 0), None)
            self.expected.pop(room)
            st = SenderRoom(room, now + self.cfg.bootstrap_timeout_s, bound=peer)
            self.rooms[room] = st
            self.ep.count("requests")
            for req, dpeer, _ in self._take_pending(room):
                self._attach(st, req, dpeer, now)
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
            self.tombstones.pop((room, "", 0), None)  # a new request reusing the room
            e = self.expected.add(room, decode, now)
            if self.expected.evicted:
                self.ep.count("expected_evicted", self.expected.evicted)
                self.expected.evicted = 0
            waiting = self.pending.get(room)
            if waiting is not None:
                self.pending[room] = (max(waiting[0], e.deadline), waiting[1])

    def withdraw(self, room: int, reason: str = "aborted by prefill engine") -> None:
        """The engine ended an expected room it never opened: a decode's request parked for
        it is refused now (``aborted``), and so is one that comes later."""
        with self.ep.lock:
            if self.expected.pop(room) is None or room in self.rooms:
                return
            why = f"was withdrawn by the prefill engine before it opened it ({reason})"
            self._tombstone((room, "", 0), why, "aborted")
            for req, peer, _ in self._take_pending(room):
                self._refuse(req, peer, f"room {room} {why}", "aborted")

    def _take_pending(self, room: int) -> list[Pending]:
        _, waiting = self.pending.pop(room, (0.0, []))
        self.pending_bytes -= sum(n for _, _, n in waiting)
        self.pending_count -= len(waiting)
        return waiting

    def _tombstone(self, key: tuple[int, str, int], why: str, kind: str = "remote") -> None:
        self.tombstones[key] = (time.monotonic() + self.cfg.bootstrap_timeout_s, why, kind)
        self.tombstones.move_to_end(key)
        while len(self.tombstones) > self.cfg.max_tombstones:
            self.tombstones.popitem(last=False)
            self.ep.count("tombstones_evicted")

    def add_chunk(self, st: SenderRoom, pages: Mapping[str, object], slots: dict[str, int],
                  last: bool, layers: tuple[int, int] | None = None,
                  tokens: tuple[int, int] | None = None) -> None:
        if st.last_given:
            raise PlanError(f"room {st.room}: send() after the last chunk")
        arrays: dict[str, np.ndarray] = {}
        for name, idx in pages.items():
            pool = self.ep.pool(name)
            if pool.kind != "paged" or pool.indices_from is not None:
                raise PlanError(f"room {st.room}: pool {name!r} takes no page indices in send() "
                                f"(slot pool, or follows {pool.indices_from!r})")
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
                c = C.claim(st.room, arrays, self.page_sizes, self.layers_of, st.layer_cursor,
                            layers, tokens)
                if isinstance(c, str):
                    raise PlanError(c)
                st.layer_cursor.update(c.cursors)
                for n, cur in c.cursors.items():
                    st.cursor[n] = C.low(cur)
                st.chunks.append(Chunk(arrays, c.first, slots, last, c.span, c.layers))
                st.last_given = last
                if last and decodes(st) >= st.expected:
                    st.state = KVPoll.Transferring
                starts = self._pump(st, start=True)
        finally:
            self.start_slots(starts)  # off the lock (``_pump``)

    def fail(self, st: SenderRoom, err: PdxferError) -> None:
        """Fail a room; each decode is told once its in-flight writes have drained."""
        with self.ep.lock:
            if st.state.terminal:
                return
            st.state = KVPoll.Failed
            st.failure = err
            self.ep.count_failure(err)
            log.info("room %d failed: %s", st.room, err)
            self._tombstone((st.room, "", 0), f"already failed on prefill: {err}")
            for t in st.targets:
                self.ep.workers.submit(st.room, lambda t=t: self._finish(st, t, False, err))
            if not st.targets:
                self.rooms.pop(st.room, None)

    # -- messages ----------------------------------------------------------------------------

    def on_request(self, req: wire.TransferRequest, sess: Session | None, _: wire.Header) -> None:
        now = time.monotonic()
        peer = self._peer(req.endpoint_id, sess, f"request for room {req.room}")
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
            if st is not None and self._repairable(st, peer):
                self._repair(st, req, peer, dst)
                return
            if st is None:
                tomb = (self.tombstones.get((req.room, "", 0))
                        or self.tombstones.get((req.room, peer.endpoint_id, req.nonce)))
                if tomb is not None:
                    self._refuse(req, peer, f"room {req.room} {tomb[1]}", tomb[2])
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
        grace = min(self.cfg.room_grace_s, self.cfg.bootstrap_timeout_s)
        exp, waiting = self.pending.get(req.room, (e.deadline if e else now + grace, []))
        if req.early and not e:
            exp = max(exp, now + self.cfg.bootstrap_timeout_s)
        if any(p.endpoint_id == peer.endpoint_id for _, p, _ in waiting):
            self._refuse(req, peer, f"duplicate room {req.room} from the same decode endpoint",
                         "duplicate_room")
            return
        size = pending_size(req)
        waiting.append((req, peer, size))
        self.pending[req.room] = (exp, waiting)
        self.pending_bytes += size
        self.pending_count += 1

    def _pending_fits(self, req: wire.TransferRequest, peer: DecodePeer) -> bool:
        """Whether one more request fits the pending caps; refuses it when not."""
        n, size = self.pending_count, pending_size(req)
        if n < self.cfg.max_pending and self.pending_bytes + size <= self.cfg.max_pending_bytes:
            return True
        self.ep.count("rejected_pending_full")
        self._refuse(req, peer, f"too many requests waiting for their room on this prefill "
                                f"({n}, {self.pending_bytes} bytes)", "busy")
        return False

    def on_abort(self, msg: wire.Abort, sess: Session | None, _: wire.Header) -> None:
        peer = self._peer(msg.endpoint_id, sess, f"abort of room {msg.room}")
        if peer is None:
            return
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            # a repair shares its first request's nonce: the unfinished one is the one to stop
            mine = [] if st is None else [t for t in st.targets if t.req.nonce == msg.nonce
                                          and t.peer.endpoint_id == peer.endpoint_id]
            target = next((t for t in mine if not t.finished), mine[-1] if mine else None)
            if target is None:
                exp_w = self.pending.get(msg.room)
                known = False
                if exp_w is not None:
                    left = [x for x in exp_w[1] if not (x[0].nonce == msg.nonce and x[1].endpoint_id == peer.endpoint_id)]
                    known = len(left) != len(exp_w[1])
                    self.pending_bytes -= sum(x[2] for x in exp_w[1] if x not in left)
                    self.pending_count -= len(exp_w[1]) - len(left)
                    if left:
                        self.pending[msg.room] = (exp_w[0], left)
                    else:
                        self.pending.pop(msg.room, None)
                if not known and msg.room not in self.rooms:
                    # the request may still be on its way: refuse it when it comes
                    self._tombstone((msg.room, peer.endpoint_id, msg.nonce),
                                    "already failed on prefill: aborted by decode before its "
                                    "request arrived")
                if not known and self.ep.transport.tainted(peer.session):
                    # a room that ended here while a failed write to this decode may still
                    # land: its ack waits for the proof (the decode asks again)
                    self.ep.count("abort_acks_held")
                    self.settler.kick(peer.session)
                    return
                self.ep.send(peer.ctrl_addr, wire.AbortAck(
                    room=msg.room, nonce=msg.nonce, endpoint_id=self.ep.endpoint_id,
                    rank=self.cfg.tp_rank, known=known), peer.sess)
                return
            target.aborted = True
            if st.state == KVPoll.Success and not target.finished:
                # a repair of a room that succeeded: stop that one target once its writes
                # have drained (its worker job runs after them), the room stays held
                err = Aborted(f"room {msg.room}: repair aborted by decode")
                self.ep.workers.submit(st.room, lambda: self._finish(st, target, False, err))
                return
        self.fail(st, Aborted(f"room {msg.room}: aborted by decode ({msg.reason or 'no reason'})"))

    def on_release(self, msg: wire.Release, sess: Session | None, _: wire.Header) -> None:
        """The decode needs no repair: a held room ends and its pages are the engine's."""
        peer = self._peer(msg.endpoint_id, sess, f"release of room {msg.room}")
        if peer is None:
            return
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None or not any(t.req.nonce == msg.nonce and t.peer.endpoint_id == peer.endpoint_id
                                     for t in st.targets):
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
        if st.state == KVPoll.Success and any(x.req.hold_for_repair and not x.released
                                              for x in st.targets):
            if not st.hold_until:
                st.hold_until = time.monotonic() + self.cfg.transfer_timeout_s
            return
        st.hold_until = 0.0
        self._forget(st)

    def _forget(self, st: SenderRoom) -> None:
        """Take a room out of the table; one that succeeded is remembered (a failed one
        already is), so that a late request for it is refused at once (``UnknownRoom``)."""
        self.rooms.pop(st.room, None)
        if st.state == KVPoll.Success:
            self._tombstone((st.room, "", 0), "already ended on this prefill (it succeeded "
                            "and its pages are released)", "unknown_room")

    @staticmethod
    def _repairable(st: SenderRoom, peer: DecodePeer) -> bool:
        """Whether a request from ``peer`` for an existing room is a repair: the room is held,
        or (other decodes still being served) this decode's own request succeeded and asked
        to be held. A repair shares the nonce of the request it repairs."""
        if st.state == KVPoll.Failed:
            return False
        if st.hold_until:
            return True
        mine = [t for t in st.targets if t.peer.endpoint_id == peer.endpoint_id]
        return bool(mine) and all(t.finished and t.ok for t in mine) and any(
            t.req.hold_for_repair and not t.released for t in mine)

    def _repair(self, st: SenderRoom, req: wire.TransferRequest, peer: DecodePeer,
                dst: dict[str, np.ndarray]) -> None:
        """A decode that held this room asks for a range again (its local restore failed,
        or a digest did not match): write the range from the pages still held (called under
        the lock)."""
        if not any(t.peer.endpoint_id == peer.endpoint_id and t.req.hold_for_repair
                   and not t.released for t in st.targets):
            self._refuse(req, peer, f"room {req.room} is not held for decode {req.endpoint_id}",
                         "duplicate_room")
            return
        if any(t.peer.endpoint_id == peer.endpoint_id and not t.finished for t in st.targets):
            self._refuse(req, peer, f"room {req.room}: a repair for decode {req.endpoint_id} "
                                    f"is already running", "duplicate_room")
            return
        self.ep.count("repairs")
        st.targets.append(Target(req, peer, dst))
        if st.hold_until:
            st.hold_until = time.monotonic() + min(req.deadline_s, self.cfg.transfer_timeout_s)
        self._pump(st)

    def tick(self, now: float) -> None:
        expired: list[SenderRoom] = []
        with self.ep.lock:
            for st in self.rooms.values():
                if not st.state.terminal and now > st.deadline:
                    expired.append(st)
            grace = min(self.cfg.room_grace_s, self.cfg.bootstrap_timeout_s)
            for room, (exp, waiting) in list(self.pending.items()):
                if now > exp:
                    kind, why = (("deadline", f"expected by this prefill's engine, which did "
                                  f"not open it within {self.cfg.bootstrap_timeout_s} s")
                                 if self.expected.pop(room) else
                                 ("deadline", f"asked for at dispatch, and this prefill's "
                                  f"engine did not open it within "
                                  f"{self.cfg.bootstrap_timeout_s} s")
                                 if any(r.early for r, _, _ in waiting) else
                                 ("unknown_room", f"unknown to this prefill (its engine did not "
                                  f"open it within {grace} s)"))
                    for req, peer, _ in self._take_pending(room):
                        self._refuse(req, peer, f"room {room} is {why}", kind)
            self.expected.expire(now)
            for key, (exp, *_) in list(self.tombstones.items()):
                if now > exp:
                    del self.tombstones[key]
            for st in [x for x in self.rooms.values() if x.hold_until and now > x.hold_until
                       and all(t.finished for t in x.targets)]:
                log.info("room %d: no Release from the decode before the hold deadline", st.room)
                st.hold_until = 0.0
                self._forget(st)
        for st in expired:
            what = ("no request from the decode" if st.state == KVPoll.Bootstrapping
                    else f"not finished (state {st.state.name})")
            self.fail(st, DeadlineExceeded(f"room {st.room}: {what} before its deadline"))

    # -- internals -----------------------------------------------------------------------------

    def _refuse(self, req: wire.TransferRequest, peer: DecodePeer, reason: str,
                kind: str) -> None:
        log.info("refused request for room %d: %s", req.room, reason)
        self.ep.count(f"refused_{kind}")
        self.ep.send(peer.ctrl_addr, wire.TransferDone(
            room=req.room, nonce=req.nonce, endpoint_id=self.ep.endpoint_id,
            rank=self.cfg.tp_rank, ok=False, reason=reason, kind=kind), peer.sess)

    def _validate(self, req: wire.TransferRequest, peer: DecodePeer
                  ) -> tuple[str, dict[str, np.ndarray]]:
        dst = {name: wire.unpack_indices(packed) for name, packed in req.dst.items()}
        why = C.check_ask(C.ask_of(req, dst), peer.pools, peer.pairings, self.ep.pool_names)
        return (why, {}) if why else ("", dst)

    def _attach(self, st: SenderRoom, req: wire.TransferRequest, peer: DecodePeer, now: float,
                dst: dict[str, np.ndarray] | None = None) -> None:
        if st.state.terminal:
            self._refuse(req, peer, f"room {req.room} already ended on prefill", "remote")
            return
        if self._unbound(st, req, peer):
            return
        if any(t.peer.endpoint_id == peer.endpoint_id for t in st.targets):
            self._refuse(req, peer, f"duplicate room {req.room} from the same decode endpoint",
                         "duplicate_room")
            return
        if dst is None:
            why, dst = self._validate(req, peer)
            if why:
                self._refuse(req, peer, why, "plan")
                return
        st.targets.append(Target(req, peer, dst))
        st.t_request = st.t_request or now
        st.expected = req.decode_peers
        st.deadline = now + min(req.deadline_s, self.cfg.transfer_timeout_s)
        if decodes(st) >= st.expected:
            st.state = KVPoll.Transferring if st.last_given else KVPoll.WaitingForInput
        self._pump(st)

    def _unbound(self, st: SenderRoom, req: wire.TransferRequest, peer: DecodePeer) -> bool:
        """Refuse (and count) a request from a decode the room does not belong to."""
        why = self._binding(st, peer)
        if not why:
            return False
        self.ep.count("rejected_not_bound")
        self._refuse(req, peer, why, "protocol")
        return True

    def _binding(self, st: SenderRoom, peer: DecodePeer) -> str:
        """Why ``peer`` may not ask for this room ("" if it may).

        A room serves one decode group: the one named by ``sender(room, peer=...)``, else the
        first that asks. A group is the TP ranks of one decode instance: further ranks may
        join the first asker while they share its instance and TP size, each rank once, and
        no more of them than the first asker said would ask this prefill rank
        (``decode_peers``). Another decode that holds the secret and knows the room id (a
        misrouted or curious one) gets no byte. ``EndpointConfig.fan_out`` lets several
        decode groups ask for the same room."""
        if st.bound and not peer.is_(st.bound):
            return (f"room {st.room} is bound to decode {st.bound!r}, not decode endpoint "
                    f"{peer.endpoint_id} (instance {peer.instance!r})")
        if self.cfg.fan_out:
            return ""
        others = [t for t in st.targets if t.peer.endpoint_id != peer.endpoint_id]
        if not others:
            return ""
        first = others[0]
        owner = first.peer
        whose = (f"room {st.room} is bound to the decode group that asked first (instance "
                 f"{owner.instance!r}, TP size {owner.tp_size}, endpoint {owner.endpoint_id})")
        if peer.instance != owner.instance or peer.tp_size != owner.tp_size:
            return (f"{whose}, not decode endpoint {peer.endpoint_id} (instance "
                    f"{peer.instance!r}, TP size {peer.tp_size}); EndpointConfig.fan_out "
                    f"serves one room to several decode groups")
        ranks = {t.peer.endpoint_id: t.peer.tp_rank for t in others}
        if peer.tp_rank in ranks.values() or len(ranks) >= first.req.decode_peers:
            return (f"{whose}: its TP rank {peer.tp_rank} (or all {first.req.decode_peers} "
                    f"of its ranks that ask this prefill rank) already asked, so decode "
                    f"endpoint {peer.endpoint_id} is not one of them")
        return ""


def _pair(x: tuple[int, int] | None, what: str, room: int) -> tuple[int, int] | None:
    """``layers``/``tokens`` of a ``send()`` as two ints (``PlanError`` otherwise)."""
    if x is None:
        return None
    try:
        a, b = (int(v) for v in x)  # type: ignore[union-attr]
    except (TypeError, ValueError) as e:
        raise PlanError(f"room {room}: {what} must be two integers, got {x!r}") from e
    return a, b
