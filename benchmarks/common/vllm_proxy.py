"""A minimal front door for a vLLM prefill/decode pair, following vLLM's proxy protocol.

For tests and benchmarks (``benchmarks/vllm.py``): each request goes to the prefill with
``max_tokens=1``, no stream, and ``kv_transfer_params`` naming a fresh room and the decode
instance, then to the decode with the params the prefill returned, its answer relayed as it
comes. ``connector="nixl"`` speaks vLLM's NixlConnector protocol (the prefill's params copied
to the decode); ``connector="colocated"`` passes each request to one server as it is, and
``prefill_leg`` sends that server a request in the prefill's own shape (``prefill_body``),
timed as a pair's leg is, so both legs are the same request. With ``early=(bootstrap,
instance)`` (pdxfer only) both requests go out at once, as ``pdxfer router --engine vllm``
dispatches. It runs in a thread of the caller.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from typing import Any

import aiohttp
from aiohttp import web


def prefill_body(body: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a prefill is sent for a client's ``body``, as vLLM's own disaggregated proxy sends
    it: one token (``max_tokens``, and ``max_completion_tokens`` where given), not streamed
    (``stream_options`` dropped), with ``params`` as its ``kv_transfer_params`` (none: the
    same request to a server that keeps the KV itself)."""
    first = {**body, "stream": False, "max_tokens": 1}
    first.pop("stream_options", None)
    first.pop("kv_transfer_params", None)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    if params is not None:
        first["kv_transfer_params"] = params
    return first


class FrontDoor:
    def __init__(
        self,
        prefill: str,
        decode: str,
        decode_instance: str | None = None,
        connector: str = "pdxfer",
        port: int = 0,
        early: tuple[str, str] | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.timeout = timeout
        """Seconds one relayed request may take, its answer streamed to the end."""
        self.early = early
        self.decode_instance, self.connector = decode_instance, connector
        self._port = port
        self.url = ""
        self.last_params: dict[str, Any] | None = None
        self.prefill_seconds: list[float] = []
        """Per request, how long the prefill leg took (the rest of a TTFT is the decode's)."""
        self.prefill_spans: list[tuple[int, int]] = []
        """Per request, the prefill leg's start and end (``perf_counter_ns``: the host's
        ``CLOCK_MONOTONIC``, comparable with stamps taken in other processes)."""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._bg: set[asyncio.Future[Any]] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-front-door")

    def start(self) -> FrontDoor:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("front door did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()

    async def _models(self, request: web.Request) -> web.Response:
        async with self._session.get(f"{self.decode}/v1/models") as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    def _prefill_params(self) -> dict[str, Any]:
        if self.connector == "nixl":
            return {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        p: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "pdxfer_room": secrets.randbits(63),
        }
        if self.decode_instance:
            p["pdxfer_decode"] = self.decode_instance
        return p

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        if self.connector == "colocated":
            return await self._relay(request, self.prefill + path, body, timed=True)
        ask = self._prefill_params()
        if self.early is not None:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "pdxfer_room": ask["pdxfer_room"],
                "pdxfer_bootstrap": self.early[0],
                "pdxfer_instance": self.early[1],
            }
            # runs beside the decode's leg
            self._bg.add(asyncio.ensure_future(self._prefill(path, body, ask)))
            self._bg = {t for t in self._bg if not t.done()}
        else:
            status, raw, answer, _ = await self._prefill(path, body, ask)
            if status != 200:
                return web.Response(body=raw, status=status, content_type="application/json")
            params = answer.get("kv_transfer_params")
        self.last_params = params
        return await self._relay(
            request, self.decode + path, {**body, "kv_transfer_params": params}
        )

    async def _prefill(
        self, path: str, body: dict[str, Any], params: dict[str, Any] | None
    ) -> tuple[int, bytes, Any, float]:
        """The prefill leg: ``body`` in the prefill's shape to ``prefill``, timed from before
        the request until its answer is read whole (a pair's leg, or ``prefill_leg``'s).
        Returns the status, the answer raw and parsed (when 200), and the leg's seconds."""
        first = prefill_body(body, params)
        t0 = time.perf_counter_ns()
        async with self._session.post(self.prefill + path, json=first) as r:
            raw = await r.read()
        leg = self._leg(t0)
        return r.status, raw, (json.loads(raw) if r.status == 200 else None), leg

    def prefill_leg(
        self, body: dict[str, Any], path: str = "/v1/completions", timeout: float = 600.0
    ) -> tuple[float, Any]:
        """From another thread: ``body`` sent to ``prefill`` as a pair's prefill leg is (the
        same shape, without ``kv_transfer_params``), timed at the same place. Returns the
        leg's seconds and the parsed answer (a colocated server's reference leg)."""
        fut = asyncio.run_coroutine_threadsafe(self._prefill(path, body, None), self._loop)
        status, raw, answer, leg = fut.result(timeout)
        if status != 200:
            raise RuntimeError(f"prefill leg: HTTP {status}: {raw[:500]!r}")
        return leg, answer

    async def _relay(
        self, request: web.Request, url: str, body: dict[str, Any], timed: bool = False
    ) -> web.StreamResponse:
        """``body`` to ``url``, its answer (or stream) relayed as it comes; ``timed``: the time
        to its first chunk is this request's prefill leg (a colocated server)."""
        t0 = time.perf_counter_ns()
        async with self._session.post(url, json=body) as r:
            if not body.get("stream"):
                data = await r.read()
                if timed:
                    self._leg(t0)
                return web.Response(body=data, status=r.status, content_type="application/json")
            out = web.StreamResponse(
                status=r.status,
                headers={"Content-Type": r.headers.get("Content-Type", "text/event-stream")},
            )
            await out.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    if timed:
                        self._leg(t0)
                        timed = False
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client left: the server's stream is dropped
                pass
            return out

    def _leg(self, t0: int) -> float:
        t1 = time.perf_counter_ns()
        self.prefill_seconds.append((t1 - t0) / 1e9)
        self.prefill_spans.append((t0, t1))
        return (t1 - t0) / 1e9

    def close(self) -> None:
        async def stop() -> None:
            await self._session.close()
            if self._runner is not None:
                await self._runner.cleanup()

        if self._ready.is_set():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
