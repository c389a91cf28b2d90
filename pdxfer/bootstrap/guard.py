"""The bootstrap server's connection guard: a cap on open connections, a deadline for each
request's header (no slowloris), and, in protected mode, loopback peers only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .. import trust

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
"""Connections the bootstrap server keeps open; past it the oldest is closed for a new one."""
HEADER_TIMEOUT_S = 5.0
"""A connection that has not sent a complete request by then is closed (no slowloris)."""


class GuardedConn(asyncio.Protocol):
    """aiohttp's request handler behind a guard: counted, and closed when it idles."""

    def __init__(self, guard: Guard, inner: Any) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream server's connection
        self.transport = transport
        if self.guard.loopback_only:  # protected mode: no secret, so no other host
            peer = transport.get_extra_info("peername")
            if not trust.peer_allowed(peer[0] if peer else None):
                self.guard.counters["peers_refused"] += 1
                log.warning(
                    "bootstrap server: refused %s: no shared secret is set, so only "
                    "loopback peers are served",
                    peer[0],
                )
                self.refused = True
                transport.abort()
                return
        self.guard.opened(self)
        self.inner.connection_made(transport)
        self.arm()

    def arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.guard.loop.call_later(self.guard.timeout_s, self.expire)

    def expire(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            c = self.guard.counters
            c["idle_connections_closed"] = c.get("idle_connections_closed", 0) + 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.arm()  # a request arriving byte by byte still has to finish in time
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:  # aiohttp never saw it
            return
        if self.timer is not None:
            self.timer.cancel()
        self.guard.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()


class Guard:
    """Caps open connections (evicting the oldest) and closes idle ones."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limit: int,
        timeout_s: float,
        counters: dict[str, int],
        loopback_only: bool = False,
    ) -> None:
        self.loop, self.limit, self.timeout_s, self.counters = loop, limit, timeout_s, counters
        self.loopback_only = loopback_only
        self.conns: dict[GuardedConn, None] = {}

    def wrap(self, inner: Any) -> GuardedConn:
        return GuardedConn(self, inner)

    def opened(self, c: GuardedConn) -> None:
        self.conns[c] = None
        while len(self.conns) > self.limit:
            oldest = next(iter(self.conns))
            self.conns.pop(oldest)
            self.counters["connections_evicted"] = self.counters.get("connections_evicted", 0) + 1
            if oldest.transport is not None:
                oldest.transport.close()

    def closed(self, c: GuardedConn) -> None:
        self.conns.pop(c, None)
