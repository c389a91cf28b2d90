"""Prefill side: the decode peers. ``DecodePeers`` answers each decode's ``Hello`` (checked for
freshness, model, transport and pool layout) with a ``HelloAck``, keeps the peer table
(bounded: the least recently used idle peer is evicted) and is the one lookup every later
message goes through (``lookup``: with a secret, only the peer's own session speaks for it).

It knows nothing of rooms: which peers the rooms still use, and what to do when a room's
handshake is refused, come in as two callbacks from ``PrefillSide``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import plan as P
from .. import trust, wire
from ..errors import LayoutMismatch, TransportError
from ..pools import PoolSpec, check_pools, layout_signature
from ..transport.auto import mismatch as transport_mismatch
from ..trust import Session, new_nonce

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger(__name__)


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

    subsets: dict[tuple[int, int], dict[str, P.BufferPairing]] = field(default_factory=dict)
    """``pairings`` narrowed to a layer range (partial-layer chunks), made once per range."""

    def layer_pairings(self, layers: tuple[int, int] | None) -> dict[str, P.BufferPairing]:
        """The pairings a chunk of ``layers`` writes (all of them for ``None``); slot pools
        stay whole (the last chunk writes the request's slots, whatever its layers)."""
        if layers is None:
            return self.pairings
        hit = self.subsets.get(layers)
        if hit is None:
            if len(self.subsets) >= 1024:  # the engine's own ranges; bounded all the same
                self.subsets.clear()
            sub = {
                n: pr if pr.src.kind == "slot" else P.layer_subset(pr, *layers)
                for n, pr in self.pairings.items()
            }
            hit = self.subsets[layers] = {n: pr for n, pr in sub.items() if pr is not None}
        return hit

    def is_(self, who: str) -> bool:
        """Whether this peer is the decode endpoint or instance ``who`` (room binding)."""
        return who in (self.endpoint_id, self.instance) and bool(who)


class DecodePeers:
    """The decode peers of a prefill rank, by endpoint id (under the core's lock).

    ``in_use``: ids (``id()``) of the peers rooms or parked requests still refer to (never
    evicted). ``verdict``: called with each ``Hello`` and the reason it was refused ("" when
    accepted): for the room that started the handshake, and the rank's list of refusals."""

    def __init__(
        self, ep: Core, in_use: Callable[[], set[int]], verdict: Callable[[wire.Hello, str], None]
    ) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.table: OrderedDict[str, DecodePeer] = OrderedDict()
        self._in_use = in_use
        self._verdict = verdict

    def __len__(self) -> int:
        return len(self.table)

    def on_hello(self, msg: wire.Hello, _: Session | None, h: wire.Header) -> None:
        """A decode opens (or reopens) its pair. With a secret the frame's MAC was checked
        before this ran; here the Hello must also be fresh: a nonce is accepted once."""
        fresh = self.ep.trust.fresh_hello(h, msg.ts)
        if fresh == "again":  # a retransmission: the ack may have been lost
            with self.ep.lock:
                old = self.table.get(msg.endpoint_id)
            if old is not None and old.sess is not None and old.sess.pair == h.pair:
                self.ep.send_raw(old.ctrl_addr, old.sess.ack)
            return
        if fresh:
            self.ep.reject(fresh, f"Hello from {msg.endpoint_id}: {fresh}")
            return
        with self.ep.lock:
            old = self.table.get(msg.endpoint_id)
        if (
            old is not None
            and old.sess is not None
            and old.sess.pair == h.pair
            and any(h.pair)
            and old.ctrl_addr == msg.ctrl_addr
            and old.session == msg.session
        ):
            # the Hello this peer was paired with, again (without a secret the trust table
            # keeps no nonces, so it is known here by its nonce): answered with the same ack,
            # not paired anew. A decode retransmits while its ack is late (``connect.py``), so
            # a slow control thread may find a queue of them; pairing each anew would pair
            # the transport again each time. A nonce of zeros (a hand-made peer) or another
            # address or transport session is a new endpoint under the old name: it pairs.
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
            endpoint_id=self.ep.endpoint_id,
            ok=not reason,
            reason=reason,
            session=self.ep.transport.session_id,
            tp_rank=self.cfg.tp_rank,
            tp_size=self.cfg.tp_size,
            pools=() if reason else tuple(mine),
            nonce=b"" if reason else nonce,
            agent=b"" if reason else self.ep.transport.peer_info(),
        )
        frame = self.ep.ack_frame(ack, h.pair)
        if reason:
            log.warning("refused Hello from %s: %s", msg.endpoint_id, reason)
            self.ep.count_failure(LayoutMismatch(reason))
            self._verdict(msg, reason)
            self.ep.send_raw(msg.ctrl_addr, frame)
            return
        sess = Session(h.pair, None, ack=frame)
        if self.ep.secret is not None:
            sess.recv_key, sess.send_key = trust.session_keys(
                self.ep.secret, h.pair, nonce, msg.endpoint_id, self.ep.endpoint_id
            )
        peer = DecodePeer(
            msg.endpoint_id,
            msg.ctrl_addr,
            msg.session,
            peer_pools,
            pairings,
            [(b.addr, b.nbytes) for q in msg.pools for b in q.buffers],
            sess,
            msg.instance,
            msg.tp_rank,
            msg.tp_size,
        )
        sess.peer = peer
        with self.ep.lock:
            old = self.table.pop(msg.endpoint_id, None)
            if old is None and not self._make_room_for_peer():
                why = f"too many decode peers ({self.cfg.limits.max_peers})"
                self.ep.reject("table_full", f"Hello from {msg.endpoint_id}: {why}")
                return
            self.table[msg.endpoint_id] = peer
        if old is not None:
            self.ep.trust.drop(old.sess)
            if old.ctrl_addr != peer.ctrl_addr:
                self.ep.forget(old.ctrl_addr)
        if self.ep.secret is not None:
            self.ep.trust.add(sess)
        self.ep.send_raw(msg.ctrl_addr, frame)
        self._verdict(msg, "")

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
        if len(self.table) < self.cfg.limits.max_peers:
            return True
        busy = self._in_use()
        for eid, p in self.table.items():
            if id(p) not in busy:
                del self.table[eid]
                self.ep.trust.drop(p.sess)
                self.ep.forget(p.ctrl_addr)
                self.ep.count("peers_evicted")
                return True
        return False

    def lookup(self, endpoint_id: str, sess: Session | None, what: str) -> DecodePeer | None:
        """The registered peer a message comes from: with a secret, its session's (and the
        message must name that peer); without one, the endpoint it names."""
        with self.ep.lock:
            if sess is not None:
                peer = sess.peer
                if not isinstance(peer, DecodePeer) or (
                    endpoint_id and endpoint_id != peer.endpoint_id
                ):
                    peer = None
                    reason = "wrong_pair"
                elif self.table.get(peer.endpoint_id) is not peer:
                    peer, reason = None, "unknown_peer"
            else:
                peer = self.table.get(endpoint_id)
                reason = "unknown_peer"
            if peer is not None:
                self.table.move_to_end(peer.endpoint_id)
                return peer
        self.ep.reject(
            reason,
            f"{what} from {endpoint_id or 'an unnamed endpoint'}: no Hello "
            "from it (no answer is sent)",
        )
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
