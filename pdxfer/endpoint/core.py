"""``Core``: one rank's shared state, used by both sides and by the ``Endpoint`` front.

The sides (``sender.PrefillSide``, ``receiver.DecodeSide``) see only this object: config,
pools, transport, control socket, room workers, the lock, counters and signing. They never
import the ``Endpoint`` front, which builds a core and one side and is the engine's API.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from .. import auth, wire
from ..config import EndpointConfig
from ..errors import ConfigError, PdxferError, WireError
from ..metrics import Timeline
from ..pools import PoolSpec
from ..transport import Transport, make_transport
from .control import Control, Workers

log = logging.getLogger("pdxfer.endpoint")


def _hello_parts(h: wire.Hello) -> tuple[str, ...]:
    return (h.endpoint_id, h.ctrl_addr, h.session, h.signature, str(h.tp_rank), str(h.tp_size))


class Core:
    """Shared state of one rank. Built before its side; ``start_control`` opens the control
    socket once the side has registered its message handlers."""

    def __init__(self, config: EndpointConfig, pools: Sequence[PoolSpec],
                 transport: Transport | None = None) -> None:
        self.config = config
        self.pools: tuple[PoolSpec, ...] = tuple(pools)
        self.pool_names = frozenset(p.name for p in pools)
        self._by_name = {p.name: p for p in pools}
        self.endpoint_id = config.endpoint_id
        self.secret = auth.load_secret(config.secret)
        self.lock = threading.RLock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.timeline = Timeline()
        self.handlers: dict[type, Callable[[Any], None]] = {}
        self.control: Control | None = None
        self.ctrl_addr = ""
        self.transport = transport or make_transport(
            config.transport, config.host, config.device, config.transfer_timeout_s)
        self.regions: list[tuple[int, int]] = []
        for p in pools:
            for b in p.buffers:
                self.transport.register(b.addr, b.nbytes, p.location)
                self.regions.append((b.addr, b.nbytes))
        self.workers = Workers(config.workers, name=f"pdxfer-{config.role}")

    def start_control(self, on_tick: Callable[[], None]) -> None:
        self.control = Control(self.config.host, self._on_frame, on_tick,
                               max_frame=wire.MAX_FRAME, name=f"pdxfer-{self.config.role}-control")
        self.ctrl_addr = self.control.address

    def pool(self, name: str) -> PoolSpec:
        p = self._by_name.get(name)
        if p is None:
            raise ConfigError(f"unknown pool {name!r} (have {sorted(self._by_name)})")
        return p

    # -- control plane -------------------------------------------------------------------------
    def send(self, addr: str, msg: wire.Msg) -> bool:
        return self.send_frame(addr, wire.encode(msg))

    def send_frame(self, addr: str, frame: bytes) -> bool:
        ok = self.control is not None and self.control.send(addr, frame)
        if not ok:
            self.count("send_failures")
        return ok

    def forget(self, addr: str) -> None:
        """Drop the socket to a peer that is gone for good."""
        if self.control is not None:
            self.control.forget(addr)

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = wire.decode(frame)
        except WireError as e:
            self.count("wire_rejected")
            log.warning("rejected control message: %s", e)
            return
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.count("unexpected_messages")
            log.warning("%s endpoint got unexpected %s", self.config.role, type(msg).__name__)
            return
        handler(msg)

    # -- counters ------------------------------------------------------------------------------
    def count(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def count_failure(self, err: PdxferError) -> None:
        self.count(f"failures_{err.kind}")

    def count_transfer(self, nbytes: int, blocks: int) -> None:
        with self.lock:
            self.counters["bytes"] += nbytes
            self.counters["blocks"] += blocks

    # -- signing -------------------------------------------------------------------------------
    def check_auth(self, hello: wire.Hello) -> str:
        """Why a Hello is not authorised ("" when it is)."""
        if self.secret is None:
            return ""
        if not hello.auth:
            return f"authentication required: this endpoint needs {auth.ENV} on the peer"
        if not auth.verify(self.secret, hello.auth, *_hello_parts(hello)):
            self.count("auth_failures")
            return "authentication failed: wrong Hello signature (different secret?)"
        return ""

    def signed(self, hello: wire.Hello) -> wire.Hello:
        if self.secret is None:
            return hello
        return msgspec.structs.replace(hello, auth=auth.sign(self.secret, *_hello_parts(hello)))

    def close(self) -> None:
        """Drain the workers, then close the control plane and the transport."""
        self.workers.close()
        if self.control is not None:
            self.control.close()
        self.transport.close()
