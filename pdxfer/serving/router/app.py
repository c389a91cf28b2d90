"""``pdxfer router``: the OpenAI-compatible front door over prefill/decode pairs.

Per choice the router picks one prefill and one decode (``pairing``), draws the room, and
sends the prompt to both at once (``dispatch``): the prefill computes and pushes KV, the
decode waits for it and generates, streaming token events back. Text, chunks and responses
follow OpenAI (``openai_api``, ``completions``). This file is the HTTP face: the routes, the
middleware (``api_keys``), start and stop, and the wiring: each part is one object, handed
what it shares (the worker lists, the counters, the client session) when it is made.
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
from typing import Any

from aiohttp import web

from pdxfer.netaddr import host_of, unreachable_from
from pdxfer.trust import load_secret

from ..http import error_body, serve
from . import openai_api as oa
from .api_keys import ApiKeys
from .backends import Backend, Decode, Http, Prefill, ToyBackend, parse_decode, parse_prefill
from .completions import Completions
from .dispatch import Dispatch
from .door import Door
from .health import Health
from .kv_feed import FeedSpec, KvFeeds
from .kv_stale import LIMITS as STALE
from .kv_stale import StaleCheck, StaleLimits
from .media import DEFAULT as MEDIA
from .media import MediaPolicy
from .metrics import Metrics
from .pairing import Pairing
from .settings import DEFAULT, RouterSettings

log = logging.getLogger(__name__)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths and methods answer in OpenAI's error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(
            error_body(
                f"{request.method} {request.path}: {e.reason}",
                "not_found" if e.status == 404 else "invalid_request",
                e.status,
            ),
            status=e.status,
        )


class Router:
    """The router's parts, wired: ``pairing``, ``health``, ``dispatch``, ``completions``,
    ``metrics`` and ``api_keys``, and the aiohttp app that serves them (``app``)."""

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[Decode],
        policy: str = DEFAULT["policy"],
        timeout_s: float = DEFAULT["timeout_s"],
        expose_cache_stats: bool = DEFAULT["expose_cache_stats"],
        api_keys: dict[str, str] | None = None,
        backend: Backend | None = None,
        kv: KvFeeds | None = None,
        load_weight: float = DEFAULT["kv_load_weight"],
        media: MediaPolicy = MEDIA,
        stale: StaleLimits = STALE,
        door: Door | None = None,
    ) -> None:
        if not prefills or not decodes:
            raise ValueError("the router needs at least one prefill and one decode")
        self.prefills, self.decodes = prefills, decodes
        """The workers, one record per DP rank once known; every part shares these lists."""
        self.timeout_s = timeout_s
        self.backend: Backend = backend or ToyBackend()
        self.kv = kv
        """The workers' KV event feeds and their index (None: history only)."""
        self.stale = StaleCheck(kv, stale) if kv is not None else None
        """What the workers' answers say of their feeds (a stale feed is suspected)."""
        self.media = media
        """What chat requests may carry in ``image_url`` parts (``media.py``)."""
        self.door = door or Door(DEFAULT["prefill_queue_tokens"], DEFAULT["max_held"])
        """Where requests wait while every prefill's queue is full (``door.py``)."""
        self.counters = collections.Counter[str]()
        self.pairing = Pairing(prefills, decodes, policy, self.backend, kv, self.stale, load_weight)
        self.api_keys = ApiKeys(api_keys, self.counters)
        self.http = Http(None, load_secret())
        """The session towards the workers (opened at start)."""
        self.health = Health(prefills, decodes, self.backend, self.http, kv)
        self.dispatch = Dispatch(
            prefills,
            decodes,
            self.pairing,
            self.health,
            self.door,
            self.backend,
            self.http,
            kv,
            self.counters,
            timeout_s,
        )
        self.completions = Completions(
            self.dispatch,
            self.health,
            prefills,
            decodes,
            self.backend,
            self.counters,
            expose_cache_stats,
        )
        self.metrics = Metrics(self.counters, prefills, decodes, self.door, kv, self.stale)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=8 << 20, middlewares=[_json_errors, self.api_keys.authenticate]
        )
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_post("/v1/chat/completions", self.h_chat)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.http.open(self.timeout_s)
        await self.backend.setup(self.http, self.decodes)
        if self.kv is not None:
            self.kv.start()
        self.health.start()

    async def _stop(self, app: web.Application) -> None:
        if self.kv is not None:
            await self.kv.stop()
        await self.health.stop()
        await self.http.close()

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models(self.backend.tokenizer.model))

    async def h_health(self, request: web.Request) -> web.Response:
        workers = await self.health.refresh(force=True)
        ok = any(p.healthy for p in self.prefills) and any(d.healthy for d in self.decodes)
        return web.json_response(
            {
                "status": "ok" if ok else "unavailable",
                "workers": workers,
                "policy": self.pairing.policy,
                "engine": self.backend.name,
            },
            status=200 if ok else 503,
        )

    async def h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.text())

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completions.serve(request, oa.parse_completion)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(oa.parse_chat, media=self.media)
        return await self.completions.serve(request, parse)


def make_backend(s: RouterSettings) -> Backend:
    if s.engine == "vllm":
        from .vllm import SETUP_TIMEOUT_S, VllmBackend

        return VllmBackend(s.tokenizer, s.page_size, s.dispatch, max(SETUP_TIMEOUT_S, s.timeout_s))
    return ToyBackend()


def check_reachable(prefills: list[Prefill], decodes: list[Decode]) -> None:
    """The router hands each prefill's bootstrap address to the decodes, which look it up
    from their own hosts: a loopback address there names the decode's host, not the
    bootstrap's. Refused at start rather than failing every request."""
    for p in prefills:
        boot = host_of(p.bootstrap)
        for d in decodes:
            if unreachable_from(boot, d.url):
                raise ValueError(
                    f"--prefill {p.url}: its bootstrap {p.bootstrap} is a "
                    f"loopback address, but decode {d.url} is on another host "
                    f"and would look it up on its own host: name the bootstrap "
                    f"by an address the decodes reach"
                )


def run(a: argparse.Namespace) -> int:
    s = RouterSettings.from_args(a)
    prefills = [parse_prefill(p) for p in s.prefill]
    decodes = [parse_decode(d) for d in s.decode]
    check_reachable(prefills, decodes)
    specs = [FeedSpec.parse(e) for e in s.kv_events]
    known = {p.url for p in prefills} | {d.url for d in decodes}
    for spec in specs:
        if spec.worker not in known:
            raise ValueError(f"--kv-events {spec.worker}: not a --prefill or --decode URL")
    kv = KvFeeds(specs, s.kv_index_blocks) if specs else None
    router = Router(
        prefills,
        decodes,
        s.policy,
        s.timeout_s,
        expose_cache_stats=s.expose_cache_stats,
        backend=make_backend(s),
        kv=kv,
        load_weight=s.kv_load_weight,
        door=Door(s.prefill_queue_tokens, s.max_held),
        stale=StaleLimits(
            s.kv_stale_misses,
            s.kv_stale_window_s,
            s.kv_stale_tolerance_blocks,
            s.kv_stale_deadline_s,
        ),
        media=MediaPolicy(
            max_image_bytes=a.max_image_bytes,
            max_image_pixels=a.max_image_pixels,
            allow_remote=a.allow_remote_images,
        ),
    )
    log.info(
        "router: %d prefill, %d decode, %s", len(prefills), len(decodes), router.pairing.policy
    )
    return serve(router.app(), s.host, s.port, advertise=s.advertise, what="router")
