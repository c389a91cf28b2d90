"""``Core``: one rank's shared state, used by both sides and by the ``Endpoint`` front.

The sides (``sender.PrefillSide``, ``receiver.DecodeSide``) see only this object: config,
pools, transport, control socket, room workers, the lock, counters and signing. They never
import the ``Endpoint`` front, which builds a core and one side and is the engine's API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import trust, wire
from ..config import EndpointConfig
from ..errors import ConfigError, PdxferError
from ..metrics import Timeline
from ..netaddr import check_local
from ..pools import PoolSpec
from ..transport import Transport, make_transport
from ..trust import Session, Trust, check_serving
from .control import Control, Workers
from .timed_lock import Clocks, TimedLock

log = logging.getLogger(__name__)

Handler = Callable[[Any, "Session | None", wire.Header], None]
"""A message handler: the decoded message, the session it was admitted under (None without a
secret, or for a Hello) and its header."""

SLOW_S = 1.0
"""A control handler or tick that runs this long is counted (``slow_handlers``) and logged:
the control thread answers nothing meanwhile (a Hello waits, its decode retransmits)."""


class Counts(dict[str, float]):
    """An endpoint's named counts and high-water marks (some are seconds or milliseconds, so
    floats). A name never counted reads 0 without being added, as in ``collections.Counter``."""

    def __missing__(self, key: str) -> float:
        return 0


class Core:
    """Shared state of one rank. Built before its side; ``start_control`` opens the control
    socket once the side has registered its message handlers."""

    def __init__(
        self, config: EndpointConfig, pools: Sequence[PoolSpec], transport: Transport | None = None
    ) -> None:
        self.config = config
        self.pools: tuple[PoolSpec, ...] = tuple(pools)
        self.pool_names = frozenset(p.name for p in pools)
        self._by_name = {p.name: p for p in pools}
        self.endpoint_id = config.endpoint_id
        self.secret = trust.load_secret(config.secret)
        self.loopback_only = check_serving(
            f"{config.role} endpoint (control socket)",
            config.host,
            config.advertise,
            secret=self.secret,
            opt_in=config.insecure,
        )
        self.trust = Trust(self.secret)
        self.lock = TimedLock(SLOW_S)
        """Guards the side's tables and the counters (timed: ``timed_lock.py``)."""
        self.counters = Counts()
        self.timeline = Timeline()
        self.handlers: dict[type, Handler] = {}
        self._logged: dict[str, float] = {}
        self.control: Control | None = None
        self.ctrl_addr = ""
        check_local(config.address)  # peers must be able to dial what this rank advertises
        self.transport = transport or make_transport(
            config.transport, config.address, config.device, config.limits.transfer_timeout_s
        )
        self.regions: list[tuple[int, int]] = []
        for p in pools:
            for b in p.buffers:
                if (b.addr, b.nbytes) in self.regions:
                    continue  # pools may share memory (an engine's groups over one tensor)
                self.transport.register(b.addr, b.nbytes, p.location, p.item_bytes)
                self.regions.append((b.addr, b.nbytes))
        self.workers = Workers(config.limits.workers, name=f"pdxfer-{config.role}")

    def start_control(self, on_tick: Callable[[], None]) -> None:
        self.control = Control(
            self.config.host,
            self._on_frame,
            on_tick,
            max_frame=wire.MAX_FRAME + wire.HEADER_LEN,
            name=f"pdxfer-{self.config.role}-control",
            screen=self._screen,
            reject=self.reject,
            advertise=self.config.address,
            loopback_only=self.loopback_only,
        )
        self.ctrl_addr = self.control.address

    def pool(self, name: str) -> PoolSpec:
        p = self._by_name.get(name)
        if p is None:
            raise ConfigError(f"unknown pool {name!r} (have {sorted(self._by_name)})")
        return p

    # -- control plane -------------------------------------------------------------------------
    def send(self, addr: str, msg: wire.Msg, sess: Session | None) -> bool:
        return self.send_frame(addr, wire.encode(msg), sess)

    def send_frame(self, addr: str, frame: bytes, sess: Session | None) -> bool:
        """Send a frame to a peer; with a secret, sealed under its session (never unsealed)."""
        if self.secret is not None:
            if sess is None or not sess.established:
                self.count("send_unsealed_refused")
                return False
            frame = sess.seal(frame)
        return self.send_raw(addr, frame)

    def hello_frame(self, hello: wire.Hello, pair: bytes) -> bytes:
        """A Hello under the secret's Hello key, ``pair`` its fresh nonce."""
        key = self.trust.hello_key
        return wire.frame(
            wire.payload(hello), wire.Hello, wire.HELLO if key else wire.PLAIN, pair, 0, key
        )

    def ack_frame(self, ack: wire.HelloAck, pair: bytes) -> bytes:
        """A HelloAck under the key bound to the Hello's nonce ``pair``."""
        key = trust.ack_key(self.secret, pair) if self.secret else None
        return wire.frame(
            wire.payload(ack), wire.HelloAck, wire.ACK if key else wire.PLAIN, pair, 0, key
        )

    def send_raw(self, addr: str, frame: bytes) -> bool:
        """Send a frame as it is (a Hello or HelloAck, sealed by ``hello_frame``/``ack_frame``)."""
        ok = self.control is not None and self.control.send(addr, frame)
        if not ok:
            self.count("send_failures")
        return ok

    def add_peer(self, session: str, info: bytes) -> None:
        """Pair the transport with a peer (at a Hello or its HelloAck, on the control thread);
        its longest run is ``add_peer_max_ms``."""
        t0 = time.perf_counter()
        try:
            self.transport.add_peer(session, info)
        finally:
            self.gauge_max("add_peer_max_ms", (time.perf_counter() - t0) * 1e3)

    def push_sockets(self) -> int:
        return self.control.sockets() if self.control is not None else 0

    def forget(self, addr: str) -> None:
        """Drop the socket to a peer that is gone for good."""
        if self.control is not None:
            self.control.forget(addr)

    def _screen(self, head: memoryview, size: int) -> bool:
        """Whether a frame of ``size`` bytes may be received, from its header alone: a frame
        refused here is dropped unread (it costs its header). The MAC comes once it arrived."""
        try:
            h = wire.header(head, size)
            self._handler(h)
            self.trust.key(h)
        except wire.Rejected as e:
            self.reject(e.reason, str(e))
            return False
        return True

    def _handler(self, h: wire.Header) -> Handler:
        handler = self.handlers.get(h.kind)
        if handler is None:
            raise wire.Rejected(
                "unexpected", f"{self.config.role} endpoint does not take {h.kind.__name__}"
            )
        return handler

    def _on_frame(self, frame: bytes | memoryview) -> bool:
        """Header, size and MAC first; the payload is decoded only once all of them passed.
        True when the frame was admitted (its connection then counts as authenticated)."""
        try:
            h = wire.header(frame)
            handler = self._handler(h)
            sess = self.trust.admit(frame, h)
            msg = wire.body(frame, h)
        except wire.Rejected as e:
            self.reject(e.reason, str(e))
            return False
        t0 = Clocks.now(self.lock)
        handler(msg, sess, h)
        self.timed(h.kind.__name__, t0.since(self.lock))
        return True

    def timed(self, what: str, c: Clocks) -> None:
        """Account one run of the control thread's work (a message's handler, a tick): the
        longest is ``handler_max_ms``; one past ``SLOW_S`` is counted and logged (at most
        once a second), naming what ran and where its time went (``Clocks``)."""
        seconds = c.wall
        self.gauge_max("handler_max_ms", seconds * 1e3)
        if seconds < SLOW_S:
            return
        self.count("slow_handlers")
        with self.lock:
            now = time.monotonic()
            if now - self._logged.get("slow_handler", 0.0) < 1.0:
                return
            self._logged["slow_handler"] = now
        log.warning(
            "%s endpoint %s: the control thread spent %.1f s in %s (it answered no "
            "other message meanwhile): %s",
            self.config.role,
            self.endpoint_id,
            seconds,
            what,
            c.explain(),
        )

    def reject(self, reason: str, text: str) -> None:
        """Count a refused frame by reason; log it at most once a second per reason (a flood
        must not turn into a flood of log lines)."""
        with self.lock:
            self.counters["wire_rejected"] += 1
            self.counters[f"rejected_{reason}"] += 1
            now = time.monotonic()
            if now - self._logged.get(reason, 0.0) < 1.0:
                return
            self._logged[reason] = now
        log.warning("rejected control message (%s): %s", reason, text)

    # -- counters ------------------------------------------------------------------------------
    def count(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def gauge_max(self, name: str, value: float) -> None:
        """Keep the largest value seen under ``name`` (a high-water mark among the counters)."""
        with self.lock:
            if value > self.counters[name]:
                self.counters[name] = round(value, 3)

    def count_failure(self, err: PdxferError) -> None:
        self.count(f"failures_{err.kind}")

    def count_transfer(self, nbytes: int, blocks: int) -> None:
        with self.lock:
            self.counters["bytes"] += nbytes
            self.counters["blocks"] += blocks

    def close(self) -> None:
        """Drain the workers, then close the control plane and the transport."""
        self.workers.close()
        if self.control is not None:
            self.control.close()
        self.transport.close()
