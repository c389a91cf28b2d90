"""Prefill side: ``KVSender`` (one per request) and the handlers for decode messages.

A room's writes, its ``TransferDone`` and its ``AbortAck`` all run on one worker thread, in
order (``control.Workers``): a terminal message queued behind the room's writes is sent only
after they returned, which is what lets the decode free its pages without a late write.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import auth, wire
from .. import integrity as I
from .. import plan as P
from ..config import knobs
from ..errors import (
    Aborted,
    DeadlineExceeded,
    DuplicateRoom,
    LayoutMismatch,
    PdxferError,
    PlanError,
    TransportError,
)
from ..plan import chunk as C
from ..pools import PoolSpec, check_pools, layout_signature
from ..transport.auto import mismatch as transport_mismatch
from ..transport.base import Started
from .handles import KVPoll, RoomHandle
from .liveness import Liveness
from .staging import Staging, bounce
from .trust import Session, new_nonce

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger("pdxfer.sender")


@dataclass(slots=True, eq=False)
class DecodePeer:
    """A decode endpoint that said Hello: where to write and how its pools pair with ours."""

    endpoint_id: str
    ctrl_addr: str
    session: str
    pools: dict[str, PoolSpec]
    pairings: dict[str, P.BufferPairing]
    regions: list[tuple[int, int]]
    sess: Session | None = None
    """The authenticated pair (with a secret): the only source of this peer's frames, and
    the only way to answer it."""
    instance: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    """Its place in its decode group (the ranks of one instance that may share a room)."""
    probe_failures: int = 0
    hung: bool = False
    """Heartbeat state while this peer holds rooms for a repair (``liveness.py``)."""

    def is_(self, who: str) -> bool:
        """Whether this peer is the decode endpoint or instance ``who`` (room binding)."""
        return who in (self.endpoint_id, self.instance) and bool(who)


@dataclass(slots=True, eq=False)
class Chunk:
    """Pages per anchor pool; each pool's pages cover tokens from that pool's own cursor
    (``first``), so pools with different page sizes need not split chunks alike."""

    pages: dict[str, np.ndarray]
    first: dict[str, int]
    slots: dict[str, int]
    last: bool
    plans: dict[Target, P.Blocks] = field(default_factory=dict)
    """Plans made in ``send()`` for a write that could not start there (``_start``)."""


@dataclass(slots=True, eq=False)
class Target:
    """One decode endpoint's request for a room."""

    req: wire.TransferRequest
    peer: DecodePeer
    dst: dict[str, np.ndarray]
    scheduled: int = 0
    finished: bool = False
    aborted: bool = False
    bytes: int = 0
    blocks: int = 0
    seconds: float = 0.0
    """Planning and writing, summed over chunks."""
    write_seconds: float = 0.0
    """The transport writes alone (the raw write time within ``seconds``)."""
    digests: list[wire.Digest] = field(default_factory=list)
    """Integrity digests of what was written so far (sent with ``TransferDone``)."""
    ok: bool = False
    """Finished with Success (a decode may then ask for its range again: a repair)."""
    released: bool = False
    """Its decode sent ``Release``: it will not ask for a repair."""


@dataclass(slots=True, eq=False)
class SenderRoom:
    room: int
    deadline: float
    state: KVPoll = KVPoll.Bootstrapping
    failure: PdxferError | None = None
    hold_until: float = 0.0
    """While > 0 the room succeeded but its decode may ask for a range again (repair)."""
    chunks: list[Chunk] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    expected: int = 1
    cursor: dict[str, int] = field(default_factory=dict)
    last_given: bool = False
    t_created: float = field(default_factory=time.monotonic)
    t_request: float = 0.0
    bound: str | None = None
    """The decode endpoint or instance this room is for (``sender(room, peer=...)``); without
    it the room belongs to the decode group that asks first (``PrefillSide._binding``)."""


Pending = tuple[wire.TransferRequest, "DecodePeer", int]
"""A request that came before its room's sender: the request, its peer, its size in memory."""


class KVSender(RoomHandle):
    """The engine's handle for one request on the prefill side. Every call returns at once."""

    _side: PrefillSide
    _st: SenderRoom

    def send(self, pages: Mapping[str, object], slots: Mapping[str, int] | None = None,
             last: bool = False) -> None:
        """Hand over a finished prefill chunk: page indices per pool (anchors only), in prompt
        order. The last chunk also names the slot of each slot pool. A chunk given before the
        decode's request arrived waits for it."""
        self._side.add_chunk(self._st, pages, dict(slots or {}), last)

    @property
    def prefix_len(self) -> int | None:
        """The decode's ``prefix_len`` once its request arrived (tokens it already holds)."""
        return min((t.req.prefix_len for t in self._st.targets), default=None)

    @property
    def holding(self) -> bool:
        """True while the decode may still ask to re-send a range (``hold_for_repair``): keep
        the source pages until this turns False (its ``Release`` or the hold deadline)."""
        return self._st.hold_until > 0

    def abort(self, reason: str = "aborted by prefill engine") -> None:
        self._side.fail(self._st, Aborted(f"room {self._st.room}: {reason}"))


class PrefillSide:
    """Room tables and message handlers of a prefill endpoint."""

    def __init__(self, ep: Core) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.rooms: dict[int, SenderRoom] = {}
        self.pending: dict[int, tuple[float, list[Pending]]] = {}
        self.pending_bytes = 0
        self.pending_count = 0
        self.tombstones: OrderedDict[tuple[int, str, int], tuple[float, str]] = OrderedDict()
        """Rooms that failed (key ``(room, "", 0)``) or that a decode aborted before its
        request came (``(room, endpoint, nonce)``): a late request for them is refused."""
        self.refused: OrderedDict[int, str] = OrderedDict()
        """Rooms whose decode's handshake this rank refused (the room fails on creation)."""
        self.peers: OrderedDict[str, DecodePeer] = OrderedDict()
        self.page_sizes = {p.name: p.page_size for p in ep.pools}
        host = all(p.location == "cpu" for p in ep.pools)
        n = Staging.wanted(ep.pools) if host and knobs().gather else 0
        self.staging = Staging(n) if n else None  # gathers head slices into few big writes
        if self.staging is not None:
            ep.transport.register(self.staging.addr, n, "cpu")
        self.liveness = Liveness(self.cfg.heartbeat_s, self._holders, ep.transport.probe,
                                 self._holder_lost, name="pdxfer-hold-heartbeat")

    def close(self) -> None:
        self.liveness.close()

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
            st = SenderRoom(room, now + self.cfg.bootstrap_timeout_s, bound=peer)
            self.rooms[room] = st
            self.ep.count("requests")
            for req, dpeer, _ in self._take_pending(room):
                self._attach(st, req, dpeer, now)
            refused = self.refused.pop(room, None)
        if refused is not None and not st.targets:
            self.fail(st, LayoutMismatch(refused))
        return KVSender(self, st)

    def _take_pending(self, room: int) -> list[Pending]:
        _, waiting = self.pending.pop(room, (0.0, []))
        self.pending_bytes -= sum(n for _, _, n in waiting)
        self.pending_count -= len(waiting)
        return waiting

    def _tombstone(self, key: tuple[int, str, int], why: str) -> None:
        self.tombstones[key] = (time.monotonic() + self.cfg.bootstrap_timeout_s, why)
        self.tombstones.move_to_end(key)
        while len(self.tombstones) > self.cfg.max_tombstones:
            self.tombstones.popitem(last=False)
            self.ep.count("tombstones_evicted")

    def add_chunk(self, st: SenderRoom, pages: Mapping[str, object], slots: dict[str, int],
                  last: bool) -> None:
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
        with self.ep.lock:
            if st.state.terminal:
                return
            first = {n: st.cursor.get(n, 0) for n in arrays}
            for n, a in arrays.items():
                st.cursor[n] = first[n] + a.size * self.ep.pool(n).page_size
            st.chunks.append(Chunk(arrays, first, slots, last))
            st.last_given = last
            if last and _decodes(st) >= st.expected:
                st.state = KVPoll.Transferring
            self._pump(st)

    def fail(self, st: SenderRoom, err: PdxferError) -> None:
        """Fail a room; each decode is told once its in-flight writes have drained."""
        with self.ep.lock:
            if st.state.terminal:
                return
            st.state = KVPoll.Failed
            st.failure = err
            self.ep.count_failure(err)
            log.info("room %d failed: %s", st.room, err)
            self._tombstone((st.room, "", 0), str(err))
            for t in st.targets:
                self.ep.workers.submit(st.room, lambda t=t: self._finish(st, t, False, err))
            if not st.targets:
                self.rooms.pop(st.room, None)

    # -- messages ----------------------------------------------------------------------------
    def on_hello(self, msg: wire.Hello, _: Session | None, h: wire.Header) -> None:
        """A decode opens (or reopens) its pair. With a secret the frame's MAC was checked
        before this ran; here the Hello must also be fresh: a nonce is accepted once."""
        fresh = self.ep.trust.fresh_hello(h, msg.ts)
        if fresh == "again":  # a retransmission: the ack may have been lost
            with self.ep.lock:
                old = self.peers.get(msg.endpoint_id)
            if old is not None and old.sess is not None and old.sess.pair == h.pair:
                self.ep.send_raw(old.ctrl_addr, old.sess.ack)
            return
        if fresh:
            self.ep.reject(fresh, f"Hello from {msg.endpoint_id}: {fresh}")
            return
        if self.ep.secret is not None and msg.to != self.ep.endpoint_id:
            self.ep.reject("wrong_pair", f"Hello from {msg.endpoint_id} is for {msg.to!r}")
            return
        reason = self._check_hello(msg)
        if not reason and msg.agent:
            try:
                self.ep.transport.add_peer(msg.session, msg.agent)
            except TransportError as e:
                reason = str(e)
        peer_pools = {p.name: p for p in msg.pools}
        pairings: dict[str, P.BufferPairing] = {}
        mine = list(self.ep.pools)
        if not reason:
            for p in mine:
                q = peer_pools.get(p.name)
                if q is None or p.item_bytes == 0 or q.item_bytes == 0:
                    continue
                pr = P.pair_buffers(p, q)
                if isinstance(pr, str):
                    reason = pr
                    break
                pairings[p.name] = pr
        nonce = new_nonce()
        ack = wire.HelloAck(
            endpoint_id=self.ep.endpoint_id, ok=not reason, reason=reason,
            session=self.ep.transport.session_id, tp_rank=self.cfg.tp_rank,
            tp_size=self.cfg.tp_size, pools=() if reason else tuple(mine),
            nonce=b"" if reason else nonce,
            agent=b"" if reason else self.ep.transport.peer_info())
        frame = self.ep.ack_frame(ack, h.pair)
        if reason:
            log.warning("refused Hello from %s: %s", msg.endpoint_id, reason)
            self.ep.count_failure(LayoutMismatch(reason))
            self._handshake_refused(msg, reason)
            self.ep.send_raw(msg.ctrl_addr, frame)
            return
        sess = Session(h.pair, None, ack=frame)
        if self.ep.secret is not None:
            sess.recv_key, sess.send_key = auth.session_keys(
                self.ep.secret, h.pair, nonce, msg.endpoint_id, self.ep.endpoint_id)
        peer = DecodePeer(msg.endpoint_id, msg.ctrl_addr, msg.session, peer_pools, pairings,
                          [(b.addr, b.nbytes) for q in msg.pools for b in q.buffers], sess,
                          msg.instance, msg.tp_rank, msg.tp_size)
        sess.peer = peer
        with self.ep.lock:
            old = self.peers.pop(msg.endpoint_id, None)
            if old is None and not self._make_room_for_peer():
                why = f"too many decode peers ({self.cfg.max_peers})"
                self.ep.reject("table_full", f"Hello from {msg.endpoint_id}: {why}")
                return
            self.peers[msg.endpoint_id] = peer
        if old is not None:
            self.ep.trust.drop(old.sess)
            if old.ctrl_addr != peer.ctrl_addr:
                self.ep.forget(old.ctrl_addr)
        if self.ep.secret is not None:
            self.ep.trust.add(sess)
        self.ep.send_raw(msg.ctrl_addr, frame)

    def _check_hello(self, msg: wire.Hello) -> str:
        if msg.signature != layout_signature(msg.pools):
            return "Hello signature does not match its own pools"
        if why := transport_mismatch(self.ep.transport.name, msg.transport):
            return why
        if msg.model != self.cfg.model_id:
            return "model differs: " + model_diff(self.cfg.model_id, msg.model)
        return check_pools(list(self.ep.pools), list(msg.pools)) or ""

    def _make_room_for_peer(self) -> bool:
        """Evict the least recently used idle peer when the table is full (under the lock);
        False when every peer is in use."""
        if len(self.peers) < self.cfg.max_peers:
            return True
        busy = {id(t.peer) for st in self.rooms.values() for t in st.targets}
        busy |= {id(p) for _, w in self.pending.values() for _, p, _ in w}
        for eid, p in self.peers.items():
            if id(p) not in busy:
                del self.peers[eid]
                self.ep.trust.drop(p.sess)
                self.ep.forget(p.ctrl_addr)
                self.ep.count("peers_evicted")
                return True
        return False

    def _handshake_refused(self, msg: wire.Hello, reason: str) -> None:
        """Tell the room that started a refused handshake, so the prefill does not wait for a
        request that cannot come (only a room not bound to another decode)."""
        if msg.room is None:
            return
        why = (f"room {msg.room}: handshake from decode endpoint {msg.endpoint_id} refused: "
               f"{reason}")
        with self.ep.lock:
            st = self.rooms.get(msg.room)
            if st is None:
                self.refused[msg.room] = why
                while len(self.refused) > self.cfg.max_tombstones:
                    self.refused.popitem(last=False)
                return
            if (st.targets or st.state.terminal
                    or st.bound and st.bound not in (msg.endpoint_id, msg.instance)):
                return
        self.fail(st, LayoutMismatch(why))

    def _peer(self, endpoint_id: str, sess: Session | None, what: str) -> DecodePeer | None:
        """The registered peer a message comes from: with a secret, its session's (and the
        message must name that peer); without one, the endpoint it names."""
        with self.ep.lock:
            if sess is not None:
                peer = sess.peer
                if not isinstance(peer, DecodePeer) or (endpoint_id and endpoint_id != peer.endpoint_id):
                    peer = None
                    reason = "wrong_pair"
                elif self.peers.get(peer.endpoint_id) is not peer:
                    peer, reason = None, "unknown_peer"
            else:
                peer = self.peers.get(endpoint_id)
                reason = "unknown_peer"
            if peer is not None:
                self.peers.move_to_end(peer.endpoint_id)
                return peer
        self.ep.reject(reason, f"{what} from {endpoint_id or 'an unnamed endpoint'}: no Hello "
                               "from it (no answer is sent)")
        return None

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
                    self._refuse(req, peer, f"room {req.room} already failed on prefill: "
                                            f"{tomb[1]}", "remote")
                    return
                self._park(req, peer, now)
                return
            self._attach(st, req, peer, now, dst)

    def _park(self, req: wire.TransferRequest, peer: DecodePeer, now: float) -> None:
        """Hold a request whose room has no sender yet, within the pending caps."""
        exp, waiting = self.pending.get(req.room, (now + self.cfg.bootstrap_timeout_s, []))
        if any(p.endpoint_id == peer.endpoint_id for _, p, _ in waiting):
            self._refuse(req, peer, f"duplicate room {req.room} from the same decode endpoint",
                         "duplicate_room")
            return
        size = _pending_size(req)
        waiting.append((req, peer, size))
        self.pending[req.room] = (exp, waiting)
        self.pending_bytes += size
        self.pending_count += 1

    def _pending_fits(self, req: wire.TransferRequest, peer: DecodePeer) -> bool:
        """Whether one more request fits the pending caps; refuses it when not."""
        n, size = self.pending_count, _pending_size(req)
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
                                    "aborted by decode before its request arrived")
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
        self.rooms.pop(st.room, None)

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
            for room, (exp, _) in list(self.pending.items()):
                if now > exp:
                    for req, peer, _ in self._take_pending(room):
                        self._refuse(req, peer, f"no prefill request for room {room} within "
                                                f"{self.cfg.bootstrap_timeout_s} s", "deadline")
            for key, (exp, _) in list(self.tombstones.items()):
                if now > exp:
                    del self.tombstones[key]
            for st in [x for x in self.rooms.values() if x.hold_until and now > x.hold_until
                       and all(t.finished for t in x.targets)]:
                log.info("room %d: no Release from the decode before the hold deadline", st.room)
                st.hold_until = 0.0
                del self.rooms[st.room]
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
        if _decodes(st) >= st.expected:
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

    def _pump(self, st: SenderRoom) -> None:
        """Queue every chunk each target has not been given yet (called under the lock).

        A small chunk's write is started right here (``_start``) and only awaited on the
        worker; either way the room's jobs stay in order on its worker, so a terminal message
        queued later still runs after every write has returned."""
        for t in st.targets:
            while t.scheduled < len(st.chunks):
                ci = t.scheduled
                t.scheduled += 1
                job = self._start(st, t, ci)
                if job is None:
                    job = lambda t=t, ci=ci: self._write(st, t, ci)  # noqa: E731
                self.ep.workers.submit(st.room, job)

    def _start(self, st: SenderRoom, t: Target, ci: int) -> Callable[[], None] | None:
        """Plan a small chunk and start its write now, returning the worker job that awaits
        it; None to leave the whole write to the worker (large, sliced, failed or already
        late chunks, or the transport cannot start it at once)."""
        chunk = st.chunks[ci]
        pages = sum(a.size for a in chunk.pages.values())
        if (not self.cfg.start_in_send or st.state == KVPoll.Failed or t.finished
                or t.req.silent or pages > P.FEW_PAGES
                # more entries than one batch at most (no merged runs): not worth planning here
                or pages * sum(len(pr) for pr in t.peer.pairings.values())
                > self.ep.transport.batch_entries
                or (self.staging is not None and _sliced(t))
                or time.monotonic() > st.deadline):
            return None
        t0 = time.perf_counter()
        try:
            blocks = self._plan(t, chunk, st.cursor)
            if isinstance(blocks, str) or not len(blocks):
                return None  # the worker fails it (or just finishes) on the usual path
            started = self.ep.transport.start(t.peer.session, *blocks.lists(), tag=st.room)
        except Exception:  # noqa: BLE001 - a bug must not escape into the engine's send()
            log.exception("room %d: starting a write in send() failed", st.room)
            return None  # the worker plans again and fails the room with the reason
        if started is None:
            chunk.plans[t] = blocks  # the worker writes it without planning again
            return None
        self.ep.count("started_writes")
        return lambda: self._await(st, t, chunk, blocks, started, t0)

    def _await(self, st: SenderRoom, t: Target, chunk: Chunk, blocks: P.Blocks,
               started: Started, t0: float) -> None:
        """The worker's half of a started write: wait for it (even if the room failed
        meanwhile: the write is in flight and must drain), then as ``_write``. The success
        message of a last chunk is encoded while the write runs, off the request's path."""
        frame = None
        self._digest(t, chunk)  # while the write runs
        if chunk.last and not t.aborted:
            frame = wire.encode(wire.TransferDone(
                room=st.room, nonce=t.req.nonce, endpoint_id=self.ep.endpoint_id,
                rank=self.cfg.tp_rank, ok=True, bytes=t.bytes + blocks.total_bytes,
                blocks=t.blocks + len(blocks), seconds=t.seconds + time.perf_counter() - t0,
                digests=tuple(t.digests)))
        try:
            self.ep.transport.finish(t.peer.session, started)
        except TransportError as e:
            self._write_failed(st, t, e)
            return
        self._wrote(st, t, chunk, blocks, len(blocks), t0, started.submitted,
                    frame)

    def _digest(self, t: Target, chunk: Chunk) -> None:
        """Digest what this chunk writes to ``t``, in the mode its decode asked for (over the
        source pages, in logical order: ``integrity.py``). A digest that cannot be taken is
        logged and left out: the write goes on, and the decode fails the request for the
        range no digest covers (rather than this worker dying mid-room)."""
        mode = t.req.integrity
        if mode == "off" or t.req.silent:
            return
        try:
            self._digest_chunk(t, chunk, mode)
        except Exception:  # noqa: BLE001 - e.g. a device the portable digest cannot read
            self.ep.count("integrity_digest_errors")
            log.exception("room %d: cannot digest what is sent to decode %s (integrity=%s; "
                          "the decode will fail the request; integrity='off' on the decode "
                          "turns the check off)", t.req.room, t.peer.endpoint_id, mode)

    def _digest_chunk(self, t: Target, chunk: Chunk, mode: str) -> None:
        t0 = time.perf_counter()
        n = nb = 0
        ask = C.ask_of(t.req, t.dst)
        for w in C.written(ask, t.peer.pairings, chunk.pages, chunk.first, self.page_sizes):
            pr = t.peer.pairings[w.pool]
            if not (I.supported(pr.src.location) and I.supported(pr.dst.location)):
                continue  # memory that cannot be digested (the decode does not expect it)
            span = I.Span(w.pages, w.first, w.start, w.end, w.lo, w.hi)
            vals = I.digests(pr.src, span, mode, I.sample_stride(pr.src, pr.dst),
                             portable=I.portable(pr.src, pr.dst))
            t.digests.append(wire.Digest(w.pool, w.start, w.end, w.lo, w.hi, tuple(vals)))
            n += len(vals)
            nb += vals.nbytes
        if chunk.last:
            for name, _ in t.req.slots.items():
                pr = t.peer.pairings.get(name)
                sslot = chunk.slots.get(name)
                if (pr is None or name in t.req.skip or sslot is None
                        or not (I.supported(pr.src.location) and I.supported(pr.dst.location))):
                    continue
                vals = I.slot_digests(pr.src, int(sslot), mode,
                                      portable=I.portable(pr.src, pr.dst))
                t.digests.append(wire.Digest(name, 0, 0, 0, 0, tuple(vals)))
                n += len(vals)
                nb += vals.nbytes
        self.ep.count("integrity_digests", n)
        self.ep.count("integrity_bytes", nb)
        self.ep.count("integrity_seconds", time.perf_counter() - t0)

    def _plan(self, t: Target, chunk: Chunk, cursor: dict[str, int]) -> P.Blocks | str:
        return C.plan_chunk(C.ask_of(t.req, t.dst), t.peer.pairings, chunk.pages, chunk.first,
                            chunk.slots, chunk.last, cursor, self.page_sizes, self.ep.regions,
                            t.peer.regions)

    def _write(self, st: SenderRoom, t: Target, ci: int) -> None:
        if st.state == KVPoll.Failed or t.finished:
            return
        chunk = st.chunks[ci]
        if t.req.silent:  # another rank writes everything this decode rank needs
            if chunk.last:
                self._finish(st, t, True, None)
            return
        t0 = time.perf_counter()
        blocks = chunk.plans.pop(t, None) or self._plan(t, chunk, st.cursor)
        if isinstance(blocks, str):
            self.fail(st, PlanError(blocks))
            self._finish(st, t, False, st.failure)
            return
        self._digest(t, chunk)
        gathered = (bounce(blocks, self.staging)
                    if self.staging is not None and _sliced(t) else None)
        wire_blocks = gathered[0] if gathered is not None else blocks
        if gathered is not None:
            self.ep.count("gathered_writes")
        tw = time.perf_counter()
        try:
            self.ep.transport.write(
                t.peer.session, *wire_blocks.lists(),
                deadline=st.deadline, should_stop=lambda: st.state == KVPoll.Failed,
                tag=st.room)
        except TransportError as e:
            self._write_failed(st, t, e)
            return
        finally:
            if gathered is not None:
                self.staging.release(gathered[1], gathered[2])  # type: ignore[union-attr]
        self._wrote(st, t, chunk, blocks, len(wire_blocks), t0, tw)

    def _write_failed(self, st: SenderRoom, t: Target, e: TransportError) -> None:
        self.fail(st, TransportError(
            f"room {st.room}: write to decode {t.peer.endpoint_id} failed: {e}"))
        self._finish(st, t, False, st.failure)

    def _wrote(self, st: SenderRoom, t: Target, chunk: Chunk, blocks: P.Blocks, entries: int,
               t0: float, tw: float, frame: bytes | None = None) -> None:
        now = time.perf_counter()
        t.bytes += blocks.total_bytes
        t.blocks += entries
        t.seconds += now - t0
        t.write_seconds += now - tw
        if chunk.last:
            self._finish(st, t, True, None, frame)

    def _finish(self, st: SenderRoom, t: Target, ok: bool, err: PdxferError | None,
                frame: bytes | None = None) -> None:
        """Send the target its one terminal message; runs on the room's worker thread.

        The outcome is decided under the lock (an abort decided first turns it into a
        failure; one decided after finds the target finished and sends nothing more) and the
        message goes out right after the lock is released: the send writes to the socket
        (tens to hundreds of microseconds on a busy host), which other threads should not
        wait for. The room's terminal messages all come from this worker, so they stay in
        order. ``frame``: the success message, encoded ahead."""
        now = time.monotonic()
        success = False
        out: bytes | None = None
        with self.ep.lock:
            if t.finished:
                return
            t.finished = True
            if ok and st.state == KVPoll.Failed:  # aborted or expired while the write ran
                ok, err = False, st.failure
            t.ok = ok
            if not (t.req.silent and not t.aborted):  # a silent sender's decode does not wait
                if t.aborted:
                    out = wire.encode(wire.AbortAck(
                        room=st.room, nonce=t.req.nonce, endpoint_id=self.ep.endpoint_id,
                        rank=self.cfg.tp_rank))
                elif ok and frame is not None:
                    out = frame
                else:
                    out = wire.encode(wire.TransferDone(
                        room=st.room, nonce=t.req.nonce, endpoint_id=self.ep.endpoint_id,
                        rank=self.cfg.tp_rank, ok=ok, reason=str(err) if err else "",
                        kind=err.kind if err else "", bytes=t.bytes, blocks=t.blocks,
                        seconds=t.seconds, digests=tuple(t.digests) if ok else ()))
            all_done = _decodes(st) >= st.expected and all(x.finished for x in st.targets)
            if ok and all_done and not st.state.terminal:
                st.state = KVPoll.Success
                success = True
            if all_done or st.state == KVPoll.Failed and all(x.finished for x in st.targets):
                self._end_or_hold(st)
        if out is not None:
            self.ep.send_frame(t.peer.ctrl_addr, out, t.peer.sess)
        if success:
            self.ep.count("success")
            self.ep.timeline.observe("waiting", st.t_request - st.t_created)
            self.ep.timeline.observe("transfer", now - st.t_request)
        self.ep.count_transfer(t.bytes, t.blocks)


def _decodes(st: SenderRoom) -> int:
    """Decode endpoints that asked for the room (a repair adds a target, not a decode)."""
    return len({t.peer.endpoint_id for t in st.targets})


def _pending_size(req: wire.TransferRequest) -> int:
    """Memory a parked request holds: its packed indices and their unpacked int64 copy."""
    return 1024 + 3 * sum(len(v) for v in req.dst.values())


def model_diff(prefill: str, decode: str) -> str:
    """Which parts of two ``key=value`` model fingerprints differ (else both strings)."""
    def parts(s: str) -> dict[str, str]:
        return dict(x.split("=", 1) for x in s.split() if "=" in x)

    a, b = parts(prefill), parts(decode)
    keys = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    if not keys:
        return f"prefill {prefill!r}, decode {decode!r}"
    return "; ".join(f"{k}: prefill {a.get(k, '-')}, decode {b.get(k, '-')}" for k in keys)


def _sliced(t: Target) -> bool:
    return C.sliced(t.peer.pairings, t.req.heads, t.req.stage)
