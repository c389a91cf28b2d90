"""``Endpoint``: the engine's front for one rank.

Thin on purpose: it validates the pool group, builds the rank's shared ``Core`` and one side
(``sender.PrefillSide`` or ``receiver.DecodeSide``), registers with the bootstrap server, and
answers metrics. The sides never import this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import wire
from ..bootstrap import BootstrapClient, Refusal, Registration
from ..config import EndpointConfig
from ..errors import Aborted, ConfigError, PdxferError, UntrustedBootstrap
from ..metrics import prometheus_text
from ..netaddr import unreachable_from
from ..pools import PoolSpec, layout_signature
from ..transport import Transport
from ..trust import trusted_bootstrap
from .core import Core
from .handles import Release
from .receiver import DecodeSide, KVReceiver
from .sender import KVSender, PrefillSide
from .timed_lock import Clocks

log = logging.getLogger(__name__)


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
            return (
                f"pool {p.name!r} shares the indices of {a.name!r} but has page size "
                f"{p.page_size} and {p.num_items} pages (anchor: {a.page_size}, {a.num_items})"
            )
    return None


class Endpoint:
    """One prefill or decode rank. ``close()`` drains, deregisters and joins its threads."""

    def __init__(
        self, config: EndpointConfig, pools: Sequence[PoolSpec], transport: Transport | None = None
    ) -> None:
        why = validate_pools(pools)
        if why:
            raise ConfigError(why)
        if config.bootstrap:  # the prefills it names are dialled from other hosts
            why = unreachable_from(config.address, config.bootstrap)
            if why:
                raise ConfigError(
                    f"{config.role} endpoint with bootstrap {config.bootstrap}: {why}"
                )
        self.config = config
        self.pools: tuple[PoolSpec, ...] = tuple(pools)
        self.endpoint_id = config.endpoint_id
        self._closed = False
        self.core = core = Core(config, pools, transport)
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._bootstrap: BootstrapClient | None = None
        self._stop_reg = threading.Event()
        try:
            if config.role == "prefill":
                self.prefill = p_side = PrefillSide(core)
                core.handlers = {
                    wire.Hello: p_side.peers.on_hello,
                    wire.TransferRequest: p_side.on_request,
                    wire.Abort: p_side.on_abort,
                    wire.Release: p_side.on_release,
                }
            else:
                self.decode = d_side = DecodeSide(core)
                core.handlers = {
                    wire.HelloAck: d_side.on_hello_ack,
                    wire.TransferDone: d_side.on_done,
                    wire.AbortAck: d_side.on_abort_ack,
                    wire.Abort: d_side.on_abort,
                }
            core.start_control(self._on_tick)
            if config.role == "prefill" and config.bootstrap:
                self._bootstrap = BootstrapClient(
                    config.bootstrap, secret=core.secret, stop=self._stop_reg
                )
                self._bootstrap.register(self.registration())
                threading.Thread(
                    target=self._reregister, daemon=True, name="pdxfer-register"
                ).start()
        except BaseException:
            self.close()
            raise

    @property
    def transport(self) -> Transport:
        return self.core.transport

    @property
    def ctrl_addr(self) -> str:
        return self.core.ctrl_addr

    # -- public ------------------------------------------------------------------------------
    def registration(self) -> Registration:
        c = self.config
        return Registration(
            instance=c.instance,
            endpoint_id=self.endpoint_id,
            ctrl_addr=self.ctrl_addr,
            session=self.transport.session_id,
            signature=layout_signature(self.pools),
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            dp_rank=c.dp_rank,
            dp_size=c.dp_size,
            pp_rank=c.pp_rank,
            pp_size=c.pp_size,
            refused=self._refused(),
        )

    def _refused(self) -> tuple[Refusal, ...]:
        if self.prefill is None:
            return ()
        with self.core.lock:
            return tuple(Refusal(d, why) for d, why in self.prefill.refusals.items())

    def sender(self, room: int, peer: str | None = None) -> KVSender:
        """A sender for ``room``. ``peer`` binds the room to the decode chosen for it (its
        endpoint id or its instance name): a request for the room from any other decode is
        refused, even from one that holds the shared secret."""
        if self.prefill is None:
            raise ConfigError("sender() needs a prefill endpoint")
        return self.prefill.create(room, peer)

    def expect(self, room: int, decode: str | None = None) -> None:
        """Declare a room whose request this prefill's engine received but will open (with
        ``sender``) only later, e.g. once it schedules the request: a decode that asks first
        is held until ``bootstrap_timeout_s`` instead of ``room_grace_s``. Idempotent; the
        expectation ends when the room opens, on ``withdraw``, or at its deadline."""
        if self.prefill is None:
            raise ConfigError("expect() needs a prefill endpoint")
        self.prefill.expect(room, decode)

    def withdraw(self, room: int, reason: str = "aborted by prefill engine") -> None:
        """The engine ended an ``expect``-ed room without opening it (its request was
        aborted): a decode waiting for it fails now (``aborted``). No-op for other rooms."""
        if self.prefill is None:
            raise ConfigError("withdraw() needs a prefill endpoint")
        self.prefill.withdraw(room, reason)

    def receiver(
        self,
        room: int,
        bootstrap: str | None = None,
        *,
        instance: str | None = None,
        dp: int | None = None,
        release: Release | None = None,
        early: bool = False,
    ) -> KVReceiver:
        """A receiver for ``room``. ``release(dst, slots)`` is called once, from a pdxfer
        thread, when a failed request's pages can be reused without risk of a late write.
        ``early``: the request reached this decode at dispatch, maybe before the prefill got
        its own (the early form): the prefill holds an ask for a room it does not know yet
        until the bootstrap deadline instead of failing it after its ``room_grace_s``."""
        if self.decode is None:
            raise ConfigError("receiver() needs a decode endpoint")
        addr = bootstrap or self.config.bootstrap
        if not addr:
            raise ConfigError("receiver() needs the prefill's bootstrap address")
        if self.config.trusted_bootstraps:  # before any lookup or connection
            try:
                addr = trusted_bootstrap(addr, self.config.trusted_bootstraps)
            except UntrustedBootstrap as e:
                self.core.count("untrusted_bootstraps_refused")
                log.warning("room %d refused: %s", room, e)
                raise
        return self.decode.create(room, addr, instance, dp, release, early)

    def pool(self, name: str) -> PoolSpec:
        return self.core.pool(name)

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of this endpoint's counters (tiers count repairs here)."""
        self.core.count(name, n)

    def tables(self) -> dict[str, int]:
        """Sizes of the tables a rank keeps per room and peer (leak checks, metrics)."""
        with self.core.lock:
            if self.prefill is not None:
                return {
                    **self.prefill.tables(),
                    "sessions": len(self.core.trust),
                    "push_sockets": self.core.push_sockets(),
                }
            assert self.decode is not None
            return {
                "rooms": len(self.decode.rooms),
                "peers": len(self.decode.peers),
                "sessions": len(self.core.trust),
                "push_sockets": self.core.push_sockets(),
            }

    def metrics(self) -> dict[str, Any]:
        core = self.core
        with core.lock:
            m: dict[str, Any] = dict(core.counters)
            side = self.prefill or self.decode
            m["active_rooms"] = len(side.rooms) if side else 0
            m.update({f"table_{k}": v for k, v in self.tables().items()})
            if self.prefill:
                m["pending_requests"] = self.prefill.pending.count
            if self.decode:
                m["quarantined_pages"] = self.decode.quarantined_pages()
        m.update(
            lock_wait_max_ms=round(core.lock.wait_max_s * 1e3, 3),
            lock_hold_max_ms=round(core.lock.hold_max_s * 1e3, 3),
        )
        if core.control is not None:
            m["control_late_max_ms"] = round(core.control.late_max_s * 1e3, 3)
        s = core.transport.stats
        m.update(
            transport_calls=s.calls,
            transport_entries=s.entries,
            transport_bytes=s.bytes,
            transport_failures=s.failures,
            transport_retries=s.retries,
            transport_taints=s.taints,
            control_handler_errors=core.control.handler_errors if core.control else 0,
            control_connections=core.control.connections() if core.control else 0,
        )
        return m

    def prometheus(self) -> bytes:
        """``metrics()`` and the request-phase histograms as Prometheus text."""
        labels = {
            "role": self.config.role,
            "endpoint": self.endpoint_id,
            "tp_rank": str(self.config.tp_rank),
        }
        return prometheus_text("pdxfer_endpoint", self.metrics, labels, self.core.timeline)

    def close(self) -> None:
        """Fail what is still active (peers hear at once), drain the workers, then close the
        control plane and the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_reg.set()
        if self.prefill is not None:
            self.prefill.refusals_changed.set()
        if self._bootstrap is not None:
            try:
                self._bootstrap.deregister(self.endpoint_id)
            except PdxferError as e:
                log.info("deregister from bootstrap failed: %s", e)
        why = f"{self.config.role} endpoint closing"
        sender, receiver = self.prefill, self.decode
        with self.core.lock:
            sends = [s for s in sender.rooms.values() if not s.state.terminal] if sender else []
            recvs = [r for r in receiver.rooms.values() if not r.state.terminal] if receiver else []
        for s in sends:
            assert sender is not None
            sender.fail(s, Aborted(f"room {s.room}: {why}"))
        for r in recvs:
            assert receiver is not None
            receiver.fail(r, Aborted(f"room {r.room}: {why}"))
        if self.decode is not None:
            self.decode.close()
        if self.prefill is not None:
            self.prefill.close()
        self.core.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reregister(self) -> None:
        """Register again every ``register_interval_s``, and at once when the rank refused
        (or accepted again) a decode's handshake, so a router finds why at the bootstrap."""
        changed = self.prefill.refusals_changed if self.prefill else threading.Event()
        while True:
            changed.wait(self.config.limits.register_interval_s)
            if self._stop_reg.is_set():
                return
            changed.clear()
            try:
                assert self._bootstrap is not None
                self._bootstrap.register(self.registration())
            except PdxferError as e:  # the bootstrap is down or said no: try again later
                log.info("re-registration with %s failed: %s", self.config.bootstrap, e)

    def _on_tick(self) -> None:
        side = self.prefill or self.decode
        if side is not None:
            t0 = Clocks.now(self.core.lock)
            side.tick(time.monotonic())
            self.core.timed("tick", t0.since(self.core.lock))
