"""``pdxfer decode --dp N``: N independent decode groups behind one address.

Each group is a whole decode worker -- its own TP ranks, pools, scheduler and tiers, its own
instance name (rooms bind to one group), its own L3 folder (``dp<g>`` under ``--l3-dir``) --
started here as a process of its own on a private port. This front only forwards:
``/generate`` goes to the group the router named (``dp``: the router keeps one record per
group, so KV-aware routing sees each group's cache) or else to the least busy one; ``/abort``
to every group; ``/health`` lists the groups (200 while one serves); ``/metrics`` merges
theirs, labelled ``dp``. A group that dies is reported down and no longer chosen; when this
front stops or dies, the groups stop too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web

from pdxfer.trust import http_headers, load_secret

from ..errors import BadRequest, UpstreamError
from ..http import error_response, merge_metrics, router_only, serve
from .worker import WorkerConfig, config_from_args

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
MAX_BODY = 8 << 20


def group_config(cfg: WorkerConfig, g: int) -> WorkerConfig:
    return replace(
        cfg,
        dp_rank=g,
        port=0,
        instance=f"{cfg.instance}.dp{g}",
        l3_dir=os.path.join(cfg.l3_dir, f"dp{g}") if cfg.l3_dir else "",
    )


def group_main(conn: Connection, cfg: WorkerConfig, log_level: str) -> None:
    """One group's process: a decode worker that tells the front its URL, and stops when the
    front is gone."""
    from .decode import DecodeWorker

    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s dp{cfg.dp_rank} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front, which stops us

    def orphaned() -> None:
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        w = DecodeWorker(cfg)
    except BaseException as e:  # noqa: BLE001 - told to the front, which refuses to start
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        os._exit(1)
    threading.Thread(target=orphaned, daemon=True, name="dp-front-watch").start()
    serve(
        w.app(),
        cfg.host,
        0,
        on_stop=w.close,
        advertise=cfg.advertise,
        announce=lambda url: conn.send(("ready", url)),
    )


class Group:
    def __init__(self, g: int, proc: mp.process.BaseProcess, conn: Connection) -> None:
        self.g, self.proc, self.conn = g, proc, conn
        self.url = ""
        self.busy = 0

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"decode group {self.g} did not start in {timeout:.0f} s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(
                f"decode group {self.g} exited with {self.proc.exitcode} while starting"
            ) from None
        if kind != "ready":
            raise RuntimeError(f"decode group {self.g} could not start: {payload}")
        self.url = payload

    @property
    def alive(self) -> bool:
        return self.proc.exitcode is None


class DPFront:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.secret = load_secret()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        ctx = mp.get_context("spawn")
        self.groups: list[Group] = []
        try:
            for g in range(cfg.dp):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=group_main,
                    args=(theirs, group_config(cfg, g), level),
                    name=f"pdxfer-dp{g}",
                )
                proc.start()
                theirs.close()
                self.groups.append(Group(g, proc, mine))
            for grp in self.groups:
                grp.wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[router_only(self.secret)])
        app.router.add_post("/generate", self.h_generate)
        app.router.add_post("/abort", self.h_abort)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(  # no cap on connections: see ``Http.open``
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def _signed(self, path: str, body: bytes) -> dict[str, str]:
        return {"Content-Type": "application/json", **http_headers(self.secret, "POST", path, body)}

    def _pick(self, body: bytes) -> Group:
        try:
            dp = json.loads(body).get("dp")
        except (ValueError, AttributeError):
            dp = None  # the group answers the bad body
        if dp is not None:
            if isinstance(dp, bool) or not isinstance(dp, int) or not 0 <= dp < len(self.groups):
                raise BadRequest(
                    f"field 'dp' must be a decode group in [0, {len(self.groups)}), got {dp!r}"
                )
            return self.groups[dp]
        live = [g for g in self.groups if g.alive] or self.groups
        return min(live, key=lambda g: g.busy)

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            grp = self._pick(body)
        except BadRequest as e:
            return error_response(e)
        assert self.session is not None
        grp.busy += 1
        try:
            async with self.session.post(
                f"{grp.url}/generate", data=body, headers=self._signed("/generate", body)
            ) as r:
                headers = {
                    k: v
                    for k, v in r.headers.items()
                    if k in ("Content-Type", "Retry-After", "Cache-Control")
                }
                resp = web.StreamResponse(status=r.status, headers=headers)
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(
                UpstreamError(f"decode group {grp.g} ({grp.url}): {type(e).__name__}: {e}")
            )
        finally:
            grp.busy -= 1

    async def _each(self, fn: Any) -> list[Any]:
        return list(await asyncio.gather(*(fn(g) for g in self.groups)))

    async def h_abort(self, request: web.Request) -> web.Response:
        body = await request.read()
        session = self.session
        assert session is not None

        async def one(grp: Group) -> bool:
            try:
                async with session.post(
                    f"{grp.url}/abort",
                    data=body,
                    headers=self._signed("/abort", body),
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:
                    out = await r.json(content_type=None) if r.status == 200 else {}
                    return bool(out.get("found"))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return False

        found = await self._each(one)
        return web.json_response({"found": any(found)})

    async def _get(self, grp: Group, path: str) -> tuple[int, Any]:
        assert self.session is not None
        try:
            async with self.session.get(
                f"{grp.url}{path}", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                text = await r.text()
                return r.status, text
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 599, f"{type(e).__name__}: {e}"

    async def h_health(self, request: web.Request) -> web.Response:
        answers = await self._each(lambda g: self._get(g, "/health"))
        groups: list[dict[str, Any]] = []
        for grp, (status, text) in zip(self.groups, answers):
            try:
                info = json.loads(text)
            except ValueError:
                info = {"error": text}
            if not isinstance(info, dict):
                info = {}
            state = info.get("status", "down")
            if status != 200 and state == "ok":
                state = "down"
            groups.append({**info, "dp": grp.g, "url": grp.url, "status": state})
        ok = [g for g in groups if g["status"] == "ok"]
        first = ok[0] if ok else {}
        body: dict[str, Any] = {
            "status": "ok" if ok else "unavailable",
            "role": "decode",
            "dp_size": len(self.groups),
            "groups": groups,
            "pid": os.getpid(),
            **{k: first[k] for k in ("max_seq_len", "page_size", "kv_landing", "tp") if k in first},
        }
        return web.json_response(body, status=200 if ok else 503)

    async def h_metrics(self, request: web.Request) -> web.Response:
        answers = await self._each(lambda g: self._get(g, "/metrics"))
        parts = [
            (text, {"dp": str(grp.g)})
            for grp, (status, text) in zip(self.groups, answers)
            if status == 200
        ]
        return web.Response(text=merge_metrics(parts))

    def close(self) -> None:
        """Stop every group by pid: SIGTERM to all, then SIGKILL to what is left."""
        for grp in self.groups:
            if grp.alive and grp.proc.pid:
                try:
                    os.kill(grp.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for grp in self.groups:
            grp.proc.join(8)
            if grp.alive and grp.proc.pid:
                try:
                    os.kill(grp.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                grp.proc.join(2)


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a, "decode")
    front = DPFront(cfg)
    log.info("decode front for %d groups: %s", cfg.dp, [g.url for g in front.groups])
    return serve(
        front.app(),
        cfg.host,
        cfg.port,
        on_stop=front.close,
        advertise=cfg.advertise,
        what="decode worker",
    )
