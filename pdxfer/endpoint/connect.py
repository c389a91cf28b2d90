"""Route lookup and handshakes of a decode rank (blocking work, on the connector's threads).

The decode side asks ``connect`` for a room's prefill peers; the answer comes back through a
callback on a connector thread, or at once from ``cached`` when every peer of the route is
live and acknowledged (then nothing blocks and the caller posts the request itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from .. import trust, wire
from ..bootstrap import BootstrapClient
from ..errors import (
    BootstrapError,
    ConfigError,
    DeadlineExceeded,
    LayoutMismatch,
    PdxferError,
    PeerLost,
    TransportError,
)
from ..netaddr import host_of, is_local, is_loopback, unreachable_from
from ..plan import topology as T
from ..pools import PoolSpec, layout_signature
from ..trust import Session, new_nonce
from .liveness import refuses

if TYPE_CHECKING:
    from .core import Core

HELLO_RETRY_S = 0.5
"""The first wait for a HelloAck before the Hello goes again; each later wait doubles, up to
``HELLO_RETRY_MAX_S``."""
HELLO_RETRY_MAX_S = 4.0
"""A prefill that is slow to answer (its control thread starved of CPU, or held up) answers
every copy it finds queued, and each copy costs both sides a frame, a lookup of the port and
their threads' turns at the CPU and the GIL: a fixed 0.5 s pace sent 134 copies per decode
rank in a 67 s wait on a loaded machine (268 Hellos for the prefill to read, as many acks for
the decodes), which is load added where there is already too much. A lost Hello still goes
again within seconds."""


RouteKey = tuple[str, "str | None", "int | None"]
"""(bootstrap address, prefill instance, DP group) of a room."""


@dataclass(slots=True, eq=False)
class PrefillPeer:
    """A prefill endpoint this decode handshook with."""

    endpoint_id: str
    ctrl_addr: str
    tp_rank: int
    session: str = ""
    pools: dict[str, PoolSpec] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    refused: str = ""
    dead: bool = False
    hung: bool = False
    probe_failures: int = 0
    sess: Session | None = None
    """This pair's session: its handshake nonce, then (with a secret) its keys."""


Resolved = tuple[list[PrefillPeer], list[T.Assignment], int]
"""A room's peers, their pool assignments and the prefill's ``decode_peers``."""


def _cannot_meet(own: str, bootstrap: str, ctrl: str) -> str | None:
    """Why this decode (advertising ``own``) and a prefill registered at ``ctrl`` with
    ``bootstrap`` can never talk, checked before any Hello waits out its deadline."""
    why = unreachable_from(own, ctrl)
    if why:
        return why
    boot = host_of(bootstrap)
    if is_loopback(host_of(ctrl)) and not is_loopback(boot) and is_local(boot) is False:
        return (
            f"it registered the loopback control address {ctrl} with bootstrap "
            f"{bootstrap}, which is on another host: only its own host can reach that "
            f"address (start the prefill with --host/--advertise an address this host "
            f"can reach)"
        )
    return None


class Connector:
    """Bootstrap clients, routes, handshaken prefill peers and cached resolutions."""

    def __init__(self, ep: Core, extra_pools: tuple[PoolSpec, ...] = ()) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.extra_pools = extra_pools
        self.peers: dict[str, PrefillPeer] = {}
        self._handshakes: dict[bytes, PrefillPeer] = {}
        """Handshakes waiting for their HelloAck, by the Hello's nonce."""
        self._routes: dict[RouteKey, dict[str, Any]] = {}
        self._resolved: dict[RouteKey, Resolved] = {}
        self._vouched: dict[RouteKey, float] = {}
        """When each route was last looked up or carried a room to success (``vouch``)."""
        self._clients: dict[str, BootstrapClient] = {}
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdxfer-connect")

    def connect(
        self,
        key: RouteKey,
        room: int,
        deadline: float,
        on_ok: Callable[[Resolved], None],
        on_fail: Callable[[PdxferError | Exception], None],
    ) -> None:
        """Resolve on a connector thread; exactly one callback runs there."""

        def job() -> None:
            try:
                out = self.resolve(key, room, deadline)
            except Exception as e:  # noqa: BLE001 - reported to the room, never lost
                self.forget_route(key)
                on_fail(e)
                return
            on_ok(out)

        self._pool.submit(job)

    def drop_peer(self, p: PrefillPeer, keep_session: bool = False) -> None:
        """A peer declared lost: forget it and every route through it. ``keep_session``
        (a hung peer, which may come back): its session stays admitted, since the answers
        to the aborts of its quarantined rooms (``AbortAck``) come under it once the network
        heals; the receiver drops it when no room waits on that peer any more."""
        with self.ep.lock:
            if self.peers.get(p.endpoint_id) is p:
                del self.peers[p.endpoint_id]
            if keep_session:
                if p.sess is not None and self._handshakes.get(p.sess.pair) is p:
                    del self._handshakes[p.sess.pair]
            else:
                self._forget_session(p)
            self._routes = {
                k: v
                for k, v in self._routes.items()
                if all(e.get("endpoint_id") != p.endpoint_id for e in v["endpoints"])
            }

    def close(self) -> None:
        """Stop every lookup and handshake wait, and join the connector threads."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def resolve(self, key: RouteKey, room: int, deadline: float) -> Resolved:
        """Route, handshakes and pool assignment for a room (blocking: bootstrap lookup and
        Hello). Cached per route while the route is room-independent (one DP group, or the
        DP rank named)."""
        why = unreachable_from(self.cfg.address, key[0])
        if why:
            raise ConfigError(f"room {room}: bootstrap {key[0]}: {why}")
        route = self._route(key, room, deadline)
        ranks = T.contacts(int(route["tp_size"]), self.cfg.tp_size, self.cfg.tp_rank)
        if isinstance(ranks, str):
            raise LayoutMismatch(f"prefill instance {route['instance']!r}: {ranks}")
        eps = sorted(
            (e for e in route["endpoints"] if e["tp_rank"] in ranks),
            key=lambda e: (int(e.get("pp_rank", 0)), int(e["tp_rank"])),
        )
        if len(eps) != len(ranks) * int(route.get("pp_size", 1)):
            raise BootstrapError(
                f"prefill instance {route['instance']!r} has not "
                f"registered every endpoint of tp ranks {ranks}"
            )
        for e in eps:
            why = _cannot_meet(self.cfg.address, key[0], str(e["ctrl_addr"]))
            if why:
                raise ConfigError(
                    f"room {room}: prefill endpoint {e['endpoint_id']} "
                    f"(instance {route['instance']!r}): {why}"
                )
        peers = [self._handshake(e, deadline, room) for e in eps]
        plan = T.assign(
            {p.name: p for p in self.ep.pools},
            [(int(e.get("pp_rank", 0)), p.pools) for e, p in zip(eps, peers)],
        )
        if isinstance(plan, str):
            raise LayoutMismatch(f"prefill instance {route['instance']!r}: {plan}")
        need = {p.name for p in self.ep.pools if p.item_bytes and not p.optional}
        held = {n for p in peers for n, q in p.pools.items() if q.item_bytes}
        if need and not need & held:
            raise LayoutMismatch(
                f"prefill instance {route['instance']!r} holds none of this "
                f"decode's pools {sorted(need)}"
            )
        out = (peers, plan, T.decode_peers(int(route["tp_size"]), self.cfg.tp_size))
        if _fixed(key, route):
            with self.ep.lock:
                self._resolved[key] = out
        return out

    def vouch(self, key: RouteKey) -> None:
        """A room through this route succeeded: its prefill endpoints are alive now."""
        with self.ep.lock:
            if key in self._routes:
                self._vouched[key] = time.monotonic()

    def _stale(self, key: RouteKey) -> bool:
        """Whether a cached route went unconfirmed for ``route_fresh_s`` (under the lock): a
        prefill that died while no room waited on it (so no heartbeat watched it) and came
        back as a new process must not be reached at its dead address. A route looked up
        again whose prefill is still the same endpoint is not handshaken again."""
        return time.monotonic() - self._vouched.get(key, 0.0) > self.cfg.limits.route_fresh_s

    def cached(self, key: RouteKey) -> Resolved | None:
        """A resolution every peer of which is still the live, acknowledged peer: then a
        request is sent from the caller's thread, with no hop through the connector."""
        with self.ep.lock:
            c = self._resolved.get(key)
            if c is None or self._stale(key):
                return None
            for p in c[0]:
                if (
                    self.peers.get(p.endpoint_id) is not p
                    or p.dead
                    or p.hung
                    or p.refused
                    or not p.ready.is_set()
                ):
                    return None
            return c

    def _route(self, key: RouteKey, room: int, deadline: float) -> dict[str, Any]:
        bootstrap, instance, dp = key
        with self.ep.lock:
            cached = None if self._stale(key) else self._routes.get(key)
            client = self._clients.get(bootstrap)
            if client is None:
                client = self._clients[bootstrap] = BootstrapClient(
                    bootstrap, secret=self.ep.secret, stop=self._closing
                )
        if cached is not None and _fixed(key, cached):
            return cached
        route = client.route(room, instance, dp, deadline=deadline)
        if not isinstance(route, dict) or not isinstance(route.get("endpoints"), list):
            raise BootstrapError(f"bootstrap {bootstrap} answered an invalid route")
        with self.ep.lock:
            self._routes[key] = route
            self._vouched[key] = time.monotonic()
        return route

    def forget_route(self, key: RouteKey) -> None:
        with self.ep.lock:
            self._routes.pop(key, None)
            self._resolved.pop(key, None)
            self._vouched.pop(key, None)

    def _forget_session(self, p: PrefillPeer) -> None:
        """Drop a replaced or lost peer's handshake and session (under the lock)."""
        if p.sess is not None:
            if self._handshakes.get(p.sess.pair) is p:
                del self._handshakes[p.sess.pair]
            self.ep.trust.drop(p.sess)

    def _handshake(self, e: dict[str, Any], deadline: float, room: int) -> PrefillPeer:
        eid = str(e["endpoint_id"])
        frame = b""
        with self.ep.lock:
            peer = self.peers.get(eid)
            fresh = peer is None or peer.dead or peer.refused
            if fresh:
                if peer is not None:
                    self._forget_session(peer)
                peer = self.peers[eid] = PrefillPeer(eid, str(e["ctrl_addr"]), int(e["tp_rank"]))
                pair = new_nonce()
                secret = self.ep.secret
                peer.sess = Session(
                    pair, peer, ack_key=trust.ack_key(secret, pair) if secret else None
                )
                self._handshakes[pair] = peer
                if secret is not None:
                    self.ep.trust.add(peer.sess)
                hello = wire.Hello(
                    endpoint_id=self.ep.endpoint_id,
                    ctrl_addr=self.ep.ctrl_addr,
                    session=self.ep.transport.session_id,
                    tp_rank=self.cfg.tp_rank,
                    tp_size=self.cfg.tp_size,
                    signature=layout_signature(self.ep.pools),
                    pools=tuple(self.ep.pools) + self.extra_pools,
                    ts=time.time(),
                    room=room,
                    instance=self.cfg.instance,
                    to=eid,
                    model=self.cfg.model_id,
                    transport=self.ep.transport.name,
                    agent=self.ep.transport.peer_info(),
                )
                frame = self.ep.hello_frame(hello, pair)
        assert peer is not None
        t0 = time.monotonic()
        if fresh:
            self.ep.send_raw(peer.ctrl_addr, frame)
        # re-send the Hello now and then, less often the longer it goes unanswered: a lost
        # Hello must not cost the whole deadline, a slow prefill must not get a flood
        retry = HELLO_RETRY_S
        while not peer.ready.wait(max(0.0, min(retry, deadline - time.monotonic()))):
            retry = min(2 * retry, HELLO_RETRY_MAX_S)
            if time.monotonic() >= deadline or self._closing.is_set():
                with self.ep.lock:
                    if self.peers.get(eid) is peer:
                        del self.peers[eid]
                    self._forget_session(peer)
                hint = (
                    " (or it needs the shared secret, which this endpoint does not have)"
                    if self.ep.secret is None
                    else " (or it has another shared secret)"
                )
                raise DeadlineExceeded(
                    f"no HelloAck from prefill endpoint {eid} at "
                    f"{peer.ctrl_addr} before the deadline{hint}"
                )
            if fresh and refuses(peer.ctrl_addr, HELLO_RETRY_S):
                # an unanswered Hello to a port nothing listens on: the prefill is gone (its
                # registration outlived it); waiting for the deadline would wait for the dead
                with self.ep.lock:
                    if self.peers.get(eid) is peer:
                        del self.peers[eid]
                    self._forget_session(peer)
                    peer.dead = True
                peer.ready.set()  # rooms waiting on this handshake learn it at once
                raise PeerLost(
                    f"prefill endpoint {eid} at {peer.ctrl_addr} is gone (its "
                    f"control port refuses connections)"
                )
            if fresh:
                self.ep.count("hello_retransmits")
                self.ep.send_raw(peer.ctrl_addr, frame)
        if fresh:
            self.ep.gauge_max("hello_wait_max_ms", (time.monotonic() - t0) * 1e3)
        if peer.dead and not peer.session:
            raise PeerLost(
                f"prefill endpoint {eid} at {peer.ctrl_addr} is gone (its control "
                f"port refuses connections)"
            )
        if peer.refused:
            raise LayoutMismatch(f"prefill endpoint {eid} refused the handshake: {peer.refused}")
        return peer

    def on_hello_ack(self, msg: wire.HelloAck, sess: Session | None, h: wire.Header) -> None:
        """Settle a handshake this rank started (``ready`` wakes the waiting connector). Only
        the answer to a Hello still waiting counts: an ack never replaces an established peer,
        and with a secret its MAC (checked before decoding) binds it to the Hello's nonce."""
        with self.ep.lock:
            peer = self._handshakes.get(h.pair)
            if peer is None or (sess is not None and sess.peer is not peer):
                self.ep.count("stale_messages")
                return
            if msg.endpoint_id != peer.endpoint_id or peer.ready.is_set():
                self.ep.count("stale_messages")
                return
            secret = self.ep.secret
            if msg.ok and secret is not None and len(msg.nonce) != 16:
                self.ep.reject("invalid", f"HelloAck from {msg.endpoint_id} without a nonce")
                return
            del self._handshakes[h.pair]  # this ack is the one: later copies are stale
        if msg.ok:  # even without pairing data: the transport decides. Off the lock: pairing
            # may take long (NIXL loads the peer's metadata), and the lock is every thread's
            try:
                self.ep.add_peer(msg.session, msg.agent)
            except TransportError as e:
                msg = msgspec.structs.replace(msg, ok=False, reason=str(e))
        with self.ep.lock:
            if msg.ok:
                peer.session = msg.session
                peer.pools = {p.name: p for p in msg.pools}
                if secret is not None and peer.sess is not None:
                    s = peer.sess
                    s.send_key, s.recv_key = trust.session_keys(
                        secret, s.pair, msg.nonce, self.ep.endpoint_id, peer.endpoint_id
                    )
                    s.ack_key = None
            else:
                peer.refused = msg.reason or "refused"
                self.ep.trust.drop(peer.sess)
            peer.ready.set()


def _fixed(key: RouteKey, route: dict[str, Any]) -> bool:
    """Whether a route holds for every room: the instance has one DP rank, or the key names
    the rank (else the bootstrap picks one by room)."""
    return route.get("dp_size") == 1 or key[2] is not None
