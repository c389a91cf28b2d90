"""Prefill side, part 1 of 2: the decode peers. A decode's ``Hello`` (checked for freshness, model,
transport and pool layout, answered with a ``HelloAck``), the peer table (bounded, least
recently used idle peers evicted) and the one lookup every later message goes through
(``_peer``: with a secret, only the peer's own session speaks for it).

A mixin of ``PrefillSide`` (``sender.py``): it shares that class's tables and lock.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from .. import auth, wire
from .. import plan as P
from ..errors import LayoutMismatch, PdxferError, TransportError
from ..pools import check_pools, layout_signature
from ..transport.auto import mismatch as transport_mismatch
from .sender_rooms import DecodePeer, Pending, SenderRoom
from .trust import Session, new_nonce

if TYPE_CHECKING:
    from ..config import EndpointConfig
    from .core import Core

log = logging.getLogger("pdxfer.sender")


class Handshakes:
    """``PrefillSide``'s handshake half (its tables are declared here for readers)."""

    ep: Core
    cfg: EndpointConfig
    rooms: dict[int, SenderRoom]
    pending: dict[int, tuple[float, list[Pending]]]
    refused: OrderedDict[int, str]
    peers: OrderedDict[str, DecodePeer]

    def fail(self, st: SenderRoom, err: PdxferError) -> None:  # in PrefillSide
        raise NotImplementedError

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
        with self.ep.lock:
            old = self.peers.get(msg.endpoint_id)
        if (old is not None and old.sess is not None and old.sess.pair == h.pair
                and any(h.pair) and old.ctrl_addr == msg.ctrl_addr
                and old.session == msg.session):
            # the Hello this peer was paired with, again (without a secret the trust table
            # keeps no nonces, so it is known here by its nonce): answered with the same ack,
            # not paired anew. A decode retransmits while its ack is late (``connect.py``,
            # backing off), and a control thread held up for seconds finds a queue of them; each one
            # handled as new replaced the peer and paired the transport once more. Only the
            # same Hello: a nonce of zeros (a hand-made peer) or another address or transport
            # session is a new endpoint under the old name, and pairs anew.
            self.ep.count("hello_repeats")
            self.ep.send_raw(old.ctrl_addr, old.sess.ack)
            return
        if self.ep.secret is not None and msg.to != self.ep.endpoint_id:
            self.ep.reject("wrong_pair", f"Hello from {msg.endpoint_id} is for {msg.to!r}")
            return
        # how long the Hello took to be handled here (on the wire, in the inbox, behind other
        # work of the control thread): a decode retransmits it meanwhile (``connect.py``)
        self.ep.gauge_max("hello_age_max_ms", max(0.0, time.time() - msg.ts) * 1e3)
        reason = self._check_hello(msg)
        if not reason:  # even without pairing data: the transport decides
            try:
                self.ep.add_peer(msg.session, msg.agent)
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


def model_diff(prefill: str, decode: str) -> str:
    """Which parts of two ``key=value`` model fingerprints differ (else both strings)."""

    def parts(s: str) -> dict[str, str]:
        return dict(x.split("=", 1) for x in s.split() if "=" in x)

    a, b = parts(prefill), parts(decode)
    keys = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    if not keys:
        return f"prefill {prefill!r}, decode {decode!r}"
    return "; ".join(f"{k}: prefill {a.get(k, '-')}, decode {b.get(k, '-')}" for k in keys)
