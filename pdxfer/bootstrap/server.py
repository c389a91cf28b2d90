"""The bootstrap server: prefill endpoints register, decode endpoints look up who serves a room.

It runs aiohttp on its own thread and event loop, so it can live inside a prefill process or
stand alone (``pdxfer bootstrap``). It answers 503 until every rank of an instance has
registered (a decode must never pair with half an instance), 409 to a registration that
conflicts with the instance's topology or layout, and 400/404 with a message to a bad query.
Every connection passes the guard first (``guard.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import msgspec
from aiohttp import web

from .. import trust
from ..errors import BootstrapError
from ..netaddr import host_of, is_local, is_loopback
from .guard import HEADER_TIMEOUT_S, MAX_CONNECTIONS, Guard
from .registration import Instance, Registration

log = logging.getLogger(__name__)


class BootstrapServer:
    """The registry of prefill instances. ``start()`` returns once it listens."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        *,
        advertise: str = "",
        insecure: bool = False,
    ) -> None:
        """``secret`` (or ``PDXFER_SECRET`` / ``PDXFER_SECRET_FILE``) turns on HMAC
        authentication of every request but ``/health``. Without one it serves loopback
        peers only, unless ``insecure`` (or ``PDXFER_INSECURE``) opts in (``trust``): a
        non-loopback ``host`` or ``advertise`` is then refused here."""
        self.host = host
        self.port = port
        self._secret = trust.load_secret(secret)
        self.loopback_only = trust.check_serving(
            "bootstrap server", host, advertise, secret=self._secret, opt_in=insecure
        )
        self._replay = trust.http_replay_guard()
        self._server: asyncio.base_events.Server | None = None
        self._instances: dict[str, Instance] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.counters: dict[str, int] = {
            "registrations": 0,
            "conflicts": 0,
            "lookups": 0,
            "not_ready": 0,
            "bad_requests": 0,
            "auth_failures": 0,
            "peers_refused": 0,
        }

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> BootstrapServer:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="pdxfer-bootstrap", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise BootstrapError(f"bootstrap server did not start within {timeout} s")
        if self._error is not None:
            raise BootstrapError(f"bootstrap server failed to start: {self._error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
        loop.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":
            body = await request.read()
            why = trust.check_http(
                self._secret,
                request.method,
                request.raw_path,
                body,
                request.headers.get("X-Pdxfer-Time"),
                request.headers.get("X-Pdxfer-Signature"),
                request.headers.get("X-Pdxfer-Nonce"),
                self._replay,
            )
            if why:
                self.counters["auth_failures"] += 1
                return web.json_response({"error": why}, status=401)
        return await handler(request)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._auth])
        app.router.add_put("/register", self._h_register)
        app.router.add_delete("/register", self._h_deregister)
        app.router.add_get("/route", self._h_route)
        app.router.add_get("/health", self._h_health)
        app.router.add_get("/instances", self._h_instances)
        app.router.add_get("/refusals", self._h_refusals)
        app.router.add_get("/metrics", self._h_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        guard = Guard(
            asyncio.get_running_loop(),
            MAX_CONNECTIONS,
            HEADER_TIMEOUT_S,
            self.counters,
            self.loopback_only,
        )
        self._server = await asyncio.get_running_loop().create_server(
            lambda: guard.wrap(server()), self.host, self.port
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- registry (plain methods, so they are testable without HTTP) -------------------------
    def holder(self, reg: Registration) -> Registration | None:
        """Another endpoint holding ``reg``'s slot now, if any."""
        with self._lock:
            inst = self._instances.get(reg.instance)
            old = inst.slots.get(reg.slot) if inst is not None else None
            return old if old is not None and old.endpoint_id != reg.endpoint_id else None

    def register(self, reg: Registration, live_holder: str | None = None) -> tuple[int, str]:
        """Register ``reg``. Another endpoint's slot is taken over only when it is not
        ``live_holder`` (the endpoint a liveness probe just found answering): a restarted
        rank replaces its dead predecessor, a second live one gets 409 naming the holder."""
        with self._lock:
            inst = self._instances.get(reg.instance)
            if inst is None:
                inst = self._instances[reg.instance] = Instance(reg)
            shape = (reg.dp_size, reg.pp_size, reg.tp_size)
            if shape != inst.shape:
                self.counters["conflicts"] += 1
                return 409, (
                    f"instance {reg.instance!r} has dp/pp/tp {inst.shape}, "
                    f"registration says {shape}"
                )
            if reg.signature != inst.signature:
                self.counters["conflicts"] += 1
                return 409, (
                    f"instance {reg.instance!r} has layout signature {inst.signature}, "
                    f"registration says {reg.signature}"
                )
            for slot, other in inst.slots.items():
                if other.endpoint_id == reg.endpoint_id and slot != reg.slot:
                    self.counters["conflicts"] += 1
                    return 409, f"endpoint {reg.endpoint_id} already registered at {slot}"
            old = inst.slots.get(reg.slot)
            if (
                old is not None
                and old.endpoint_id != reg.endpoint_id
                and old.endpoint_id == live_holder
            ):
                self.counters["conflicts"] += 1
                return 409, (
                    f"instance {reg.instance!r} slot {reg.slot} is held by live "
                    f"endpoint {old.endpoint_id} at {old.ctrl_addr}"
                )
            if old is not None and old.endpoint_id != reg.endpoint_id:
                log.info(
                    "instance %s slot %s: endpoint %s replaces %s (restart)",
                    reg.instance,
                    reg.slot,
                    reg.endpoint_id,
                    old.endpoint_id,
                )
            inst.slots[reg.slot] = reg
            self.counters["registrations"] += 1
            return 200, "registered"

    def deregister(self, endpoint_id: str) -> bool:
        with self._lock:
            for name, inst in list(self._instances.items()):
                for slot, reg in list(inst.slots.items()):
                    if reg.endpoint_id == endpoint_id:
                        del inst.slots[slot]
                        if not inst.slots:
                            del self._instances[name]
                        return True
        return False

    def route(self, instance: str | None, room: int | None, dp: int | None) -> tuple[int, Any]:
        with self._lock:
            self.counters["lookups"] += 1
            if instance is None:
                if len(self._instances) != 1:
                    return (404 if not self._instances else 400), (
                        "no instance registered"
                        if not self._instances
                        else f"several instances registered ({sorted(self._instances)}): name one"
                    )
                instance = next(iter(self._instances))
            inst = self._instances.get(instance)
            if inst is None:
                return 404, f"unknown instance {instance!r}"
            if not inst.complete:
                self.counters["not_ready"] += 1
                dp_, pp_, tp_ = inst.shape
                return 503, (
                    f"instance {instance!r} has {len(inst.slots)} of {dp_ * pp_ * tp_} "
                    f"ranks registered"
                )
            dp_size, pp_size, tp_size = inst.shape
            if dp is None:
                dp = (room or 0) % dp_size
            if not 0 <= dp < dp_size:
                return 400, f"dp {dp} out of range [0, {dp_size})"
            eps = sorted(
                (r for r in inst.slots.values() if r.dp_rank == dp),
                key=lambda r: (r.pp_rank, r.tp_rank),
            )
            return 200, {
                "instance": instance,
                "dp_rank": dp,
                "dp_size": dp_size,
                "pp_size": pp_size,
                "tp_size": tp_size,
                "signature": inst.signature,
                "endpoints": [
                    {k: v for k, v in msgspec.to_builtins(r).items() if k != "refused"} for r in eps
                ],
            }

    def refusals(self, instance: str | None) -> dict[str, str]:
        """The decodes ``instance``'s ranks refused to pair with, and why (any rank's; no
        instance: the only one registered)."""
        with self._lock:
            if instance is None and len(self._instances) == 1:
                instance = next(iter(self._instances))
            inst = self._instances.get(instance) if instance is not None else None
            regs = list(inst.slots.values()) if inst is not None else []
        return {r.decode: r.reason for reg in regs for r in reg.refused}

    # -- HTTP handlers ----------------------------------------------------------------------
    def _bad(self, status: int, msg: str) -> web.Response:
        if status == 400:
            self.counters["bad_requests"] += 1
        return web.json_response({"error": msg}, status=status)

    async def _h_register(self, request: web.Request) -> web.Response:
        try:
            reg = msgspec.json.decode(await request.read(), type=Registration)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return self._bad(400, f"invalid registration: {e}")
        why = await self._unreachable(reg, request.remote or "")
        if why:
            return self._bad(400, why)
        old = self.holder(reg)
        live = old is not None and await asyncio.to_thread(_answers, old.ctrl_addr)
        status, msg = self.register(reg, old.endpoint_id if live and old else None)
        return web.json_response(
            {"ok": status == 200, "message": msg} if status == 200 else {"error": msg},
            status=status,
        )

    async def _unreachable(self, reg: Registration, remote: str) -> str | None:
        """Why decodes could not dial the control address a registration advertises, or
        None: a loopback address sent from another host, or a first registration whose
        address this server cannot connect to (a typo, the wrong interface, a firewall). Such
        a prefill then fails at its start, naming the address, instead of each request
        waiting out its deadline on the decode."""
        host = host_of(reg.ctrl_addr)
        if is_loopback(host):
            if remote and not is_loopback(remote) and is_local(remote) is False:
                return (
                    f"registration of {reg.endpoint_id} advertises the loopback control "
                    f"address {reg.ctrl_addr} but comes from {remote}: decodes on other "
                    f"hosts cannot reach it (bind and advertise an address they reach: "
                    f"--host/--advertise)"
                )
            return None
        with self._lock:
            inst = self._instances.get(reg.instance)
            known = inst is not None and any(
                r.endpoint_id == reg.endpoint_id and r.ctrl_addr == reg.ctrl_addr
                for r in inst.slots.values()
            )
        if not known and not await asyncio.to_thread(_answers, reg.ctrl_addr, 2.0):
            self.counters["unreachable"] = self.counters.get("unreachable", 0) + 1
            return (
                f"registration of {reg.endpoint_id}: this bootstrap server cannot connect "
                f"to its control address {reg.ctrl_addr}, so decodes could not either "
                f"(advertise an address of that host that others reach: --advertise)"
            )
        return None

    async def _h_deregister(self, request: web.Request) -> web.Response:
        eid = request.query.get("endpoint_id")
        if not eid:
            return self._bad(400, "missing query parameter endpoint_id")
        if not self.deregister(eid):
            return self._bad(404, f"unknown endpoint {eid!r}")
        return web.json_response({"ok": True})

    async def _h_route(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            room = _opt_int(q.get("room"), "room", 0, 1 << 63)
            dp = _opt_int(q.get("dp"), "dp", 0, 4096)
        except ValueError as e:
            return self._bad(400, str(e))
        status, body = self.route(q.get("instance") or None, room, dp)
        if status != 200:
            return self._bad(status, body)
        return web.json_response(body)

    async def _h_refusals(self, request: web.Request) -> web.Response:
        instance = request.query.get("instance") or None
        return web.json_response({"instance": instance, "refused": self.refusals(instance)})

    async def _h_health(self, request: web.Request) -> web.Response:
        with self._lock:
            n = len(self._instances)
        return web.json_response({"status": "ok", "instances": n})

    async def _h_metrics(self, request: web.Request) -> web.Response:
        from ..metrics import CONTENT_TYPE, prometheus_text

        def values() -> dict[str, float]:
            with self._lock:
                return {**self.counters, "instances": len(self._instances)}

        body = prometheus_text("pdxfer_bootstrap", values)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _h_instances(self, request: web.Request) -> web.Response:
        with self._lock:
            body = {
                name: {
                    "shape": inst.shape,
                    "registered": len(inst.slots),
                    "complete": inst.complete,
                }
                for name, inst in self._instances.items()
            }
        return web.json_response(body)


def _answers(ctrl_addr: str, timeout: float = 0.5) -> bool:
    """Whether an endpoint's control socket accepts a connection (a dead process's does not)."""
    host, _, port = ctrl_addr.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _opt_int(v: str | None, name: str, lo: int, hi: int) -> int | None:
    if v is None or v == "":
        return None
    try:
        x = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if not lo <= x < hi:
        raise ValueError(f"{name} {x} out of range [{lo}, {hi})")
    return x
