"""``Endpoint``: one rank's transport, control socket, threads and room tables.

The facade is thin on purpose: the prefill logic lives in ``sender.py``, the decode logic in
``receiver.py``; this module wires them to the transport and the control plane, validates
pool groups, and keeps the counters behind metrics.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from .. import auth, wire
from ..bootstrap import BootstrapClient, Registration
from ..config import EndpointConfig
from ..errors import Aborted, ConfigError, PdxferError, WireError
from ..metrics import Timeline, prometheus_text
from ..pools import PoolSpec, layout_signature
from ..transport import Transport, make_transport
from .control import Control, Workers
from .receiver import DecodeSide, KVReceiver, Release
from .sender import KVSender, PrefillSide

log = logging.getLogger("pdxfer.endpoint")


def _hello_parts(h: wire.Hello) -> tuple[str, ...]:
    return (h.endpoint_id, h.ctrl_addr, h.session, h.signature, str(h.tp_rank), str(h.tp_size))


def validate_pools(pools: Sequence[PoolSpec]) -> str | None:
    """Why a pool group is inconsistent, or None: unique names, anchors that exist and share
    the follower's page size."""
    by_name: dict[str, PoolSpec] = {}
    for p in pools:
        if p.name in by_name:
            return f"duplicate pool name {p.name!r}"
        by_name[p.name] = p
    for p in pools:
        if p.indices_from is None:
            continue
        a = by_name.get(p.indices_from)
        if a is None:
            return f"pool {p.name!r} follows unknown pool {p.indices_from!r}"
        if a.indices_from is not None or a.kind != "paged" or p.kind != "paged":
            return f"pool {p.name!r} must follow a paged anchor pool"
        if a.page_size != p.page_size or a.num_items > p.num_items:
            return (f"pool {p.name!r} shares the indices of {a.name!r} but has page size "
                    f"{p.page_size} and {p.num_items} pages (anchor: {a.page_size}, {a.num_items})")
    return None


class Endpoint:
    """One prefill or decode rank. ``close()`` drains, deregisters and joins its threads."""

    def __init__(self, config: EndpointConfig, pools: Sequence[PoolSpec],
                 transport: Transport | None = None) -> None:
        why = validate_pools(pools)
        if why:
            raise ConfigError(why)
        self.config = config
        self.pools: tuple[PoolSpec, ...] = tuple(pools)
        self.pool_names = frozenset(p.name for p in pools)
        self._by_name = {p.name: p for p in pools}
        self.endpoint_id = config.endpoint_id
        self.secret = auth.load_secret(config.secret)
        self.lock = threading.RLock()
        self._counters: collections.Counter[str] = collections.Counter()
        self.timeline = Timeline()
        self._closed = False
        self.transport = transport or make_transport(
            config.transport, config.host, config.device, config.transfer_timeout_s)
        self.regions: list[tuple[int, int]] = []
        for p in pools:
            for b in p.buffers:
                self.transport.register(b.addr, b.nbytes, p.location)
                self.regions.append((b.addr, b.nbytes))
        self.workers = Workers(config.workers, name=f"pdxfer-{config.role}")
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._handlers: dict[type, Any]
        if config.role == "prefill":
            self.prefill = p_side = PrefillSide(self)
            self._handlers = {wire.Hello: p_side.on_hello, wire.TransferRequest: p_side.on_request,
                              wire.Abort: p_side.on_abort, wire.Release: p_side.on_release}
        else:
            self.decode = d_side = DecodeSide(self)
            self._handlers = {wire.HelloAck: d_side.on_hello_ack, wire.TransferDone: d_side.on_done,
                              wire.AbortAck: d_side.on_abort_ack, wire.Abort: d_side.on_abort}
        self.control = Control(config.host, self._on_frame, self._on_tick,
                               max_frame=wire.MAX_FRAME, name=f"pdxfer-{config.role}-control")
        self.ctrl_addr = self.control.address
        self._bootstrap: BootstrapClient | None = None
        if config.role == "prefill" and config.bootstrap:
            self._bootstrap = BootstrapClient(config.bootstrap, secret=self.secret)
            try:
                self._bootstrap.register(self.registration())
            except PdxferError:
                self.close()
                raise

    # -- public ------------------------------------------------------------------------------
    def registration(self) -> Registration:
        c = self.config
        return Registration(
            instance=c.instance, endpoint_id=self.endpoint_id, ctrl_addr=self.ctrl_addr,
            session=self.transport.session_id, signature=layout_signature(self.pools),
            tp_rank=c.tp_rank, tp_size=c.tp_size, dp_rank=c.dp_rank, dp_size=c.dp_size,
            pp_rank=c.pp_rank, pp_size=c.pp_size)

    def sender(self, room: int) -> KVSender:
        if self.prefill is None:
            raise ConfigError("sender() needs a prefill endpoint")
        return self.prefill.create(room)

    def receiver(self, room: int, bootstrap: str | None = None, *, instance: str | None = None,
                 dp: int | None = None, release: Release | None = None) -> KVReceiver:
        """A receiver for ``room``. ``release(dst, slots)`` is called once, from a pdxfer
        thread, when a failed request's pages can be reused without risk of a late write."""
        if self.decode is None:
            raise ConfigError("receiver() needs a decode endpoint")
        addr = bootstrap or self.config.bootstrap
        if not addr:
            raise ConfigError("receiver() needs the prefill's bootstrap address")
        return self.decode.create(room, addr, instance, dp, release)

    def pool(self, name: str) -> PoolSpec:
        p = self._by_name.get(name)
        if p is None:
            raise ConfigError(f"unknown pool {name!r} (have {sorted(self._by_name)})")
        return p

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            m: dict[str, Any] = dict(self._counters)
            side = self.prefill or self.decode
            m["active_rooms"] = len(side.rooms) if side else 0
            if self.prefill:
                m["pending_requests"] = len(self.prefill.pending)
            if self.decode:
                m["quarantined_pages"] = self.decode.quarantined_pages()
        s = self.transport.stats
        m.update(transport_calls=s.calls, transport_entries=s.entries,
                 transport_bytes=s.bytes, transport_failures=s.failures,
                 transport_retries=s.retries, control_handler_errors=self.control.handler_errors)
        return m

    def prometheus(self) -> bytes:
        """``metrics()`` and the request-phase histograms as Prometheus text."""
        labels = {"role": self.config.role, "endpoint": self.endpoint_id,
                  "tp_rank": str(self.config.tp_rank)}
        return prometheus_text("pdxfer_endpoint", self.metrics, labels, self.timeline)

    def close(self) -> None:
        """Fail what is still active (peers hear at once), drain the workers, then close the
        control plane and the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bootstrap is not None:
            try:
                self._bootstrap.deregister(self.endpoint_id)
            except PdxferError as e:
                log.info("deregister from bootstrap failed: %s", e)
        side = self.prefill or self.decode
        with self.lock:
            active = [st for st in side.rooms.values() if not st.state.terminal] if side else []
        for st in active:
            side.fail(st, Aborted(f"room {st.room}: {self.config.role} endpoint closing"))
        if self.decode is not None:
            self.decode.close()
        self.workers.close()
        if hasattr(self, "control"):
            self.control.close()
        self.transport.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by the role modules --------------------------------------------------------------
    def send(self, addr: str, msg: wire.Msg) -> bool:
        return self.send_frame(addr, wire.encode(msg))

    def send_frame(self, addr: str, frame: bytes) -> bool:
        ok = self.control.send(addr, frame)
        if not ok:
            self.count("send_failures")
        return ok

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self._counters[name] += n

    def count_failure(self, err: PdxferError) -> None:
        self.count(f"failures_{err.kind}")

    def count_transfer(self, nbytes: int, blocks: int) -> None:
        with self.lock:
            self._counters["bytes"] += nbytes
            self._counters["blocks"] += blocks

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

    # -- control thread ------------------------------------------------------------------------
    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = wire.decode(frame)
        except WireError as e:
            self.count("wire_rejected")
            log.warning("rejected control message: %s", e)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.count("unexpected_messages")
            log.warning("%s endpoint got unexpected %s", self.config.role, type(msg).__name__)
            return
        handler(msg)  # type: ignore[operator]

    def _on_tick(self) -> None:
        side = self.prefill or self.decode
        if side is not None:
            side.tick(time.monotonic())
