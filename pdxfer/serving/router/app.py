"""``pdxfer router``: the OpenAI-compatible front door over prefill/decode pairs.

Per choice the router picks one prefill and one decode, draws the room, and sends the prompt
to both at once: the prefill computes and pushes KV, the decode waits for it and generates,
streaming token events back (always: so a stop string or a client that leaves ends the
request on the workers at once). Text, chunks and responses follow OpenAI (``openai_api``).

Pairing policies: ``round_robin`` (prefill and decode each in turn), ``least_outstanding``,
and ``kv_aware`` (the default with several decodes): on each leg the worker whose cached
prefix of the prompt, weighed against its load, leaves the least to do (``kv_policy``). What
a worker holds comes from its KV events where it publishes them (``kv_feed``, ``--kv-events``),
else from the router's history of the prompts it sent there (``pdxfer.tiers``' hash chain);
a feed its worker's answers contradict is taken as out of sync (``kv_stale``).
A pair that fails before the first token is left for another; a full worker (503) sends the
choice to another pair, and the client gets 503 (never 502) when every pair is full.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import json
import logging
import secrets
import time
from typing import Any

import aiohttp
from aiohttp import web

from pdxfer.config import knobs
from pdxfer.netaddr import host_of, unreachable_from
from pdxfer.tiers import page_keys
from pdxfer.trust import load_secret

from ..errors import BadRequest, OutOfCapacity, ServingError, UpstreamError
from ..http import error_body, error_response, merge_metrics, metrics_text, read_json, serve
from . import openai_api as oa
from .backends import (
    Attempt,
    AttemptFailed,
    Backend,
    Decode,
    Done,
    Http,
    Prefill,
    ToyBackend,
    later,
    parse_decode,
    parse_prefill,
    registered,
)
from .door import Door
from .kv_feed import FeedSpec, KvFeeds
from .kv_policy import Held, choose, pending_tokens, per_request
from .kv_stale import LIMITS as STALE
from .kv_stale import Served, StaleCheck, StaleLimits
from .media import DEFAULT as MEDIA
from .media import MediaPolicy
from .settings import DEFAULT, RouterSettings
from .settings import POLICIES as SETTINGS_POLICIES

log = logging.getLogger(__name__)
POLICIES = tuple(p for p in SETTINGS_POLICIES if p != "auto")
"""The pairing policies ``auto`` resolves to."""


def usable(xs: list[Any], avoid: set[str]) -> list[Any]:
    """The workers a choice may take: healthy ones not avoided, else any not avoided."""
    return (
        [x for x in xs if x.key not in avoid and x.healthy]
        or [x for x in xs if x.key not in avoid]
        or xs
    )


def auto_policy(n_prefills: int, n_decodes: int) -> str:
    """``auto``: KV-aware wherever a leg has a choice (several prefills or several decodes),
    so configured KV events are used; round robin for a single pair, where nothing differs."""
    return "kv_aware" if n_prefills > 1 or n_decodes > 1 else "round_robin"


HEALTH_TTL_S = 1.0


def parse_api_keys(spec: str) -> dict[str, str]:
    """``PDXFER_API_KEYS``: ``KEY`` (one tenant) or ``TENANT:KEY,TENANT:KEY`` -> key: tenant."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        tenant, sep, key = item.rpartition(":")
        if not sep:
            tenant, key = "default", item
        if len(key) < 16:
            raise ValueError("an API key must be at least 16 characters")
        out[key] = tenant or "default"
    return out


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
        self.auto_policy = policy == "auto"
        """Whether the policy follows the number of workers (DP groups show up later)."""
        if policy == "auto":
            policy = auto_policy(len(prefills), len(decodes))
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} or auto, got {policy!r}")
        self.prefills, self.decodes, self.policy = prefills, decodes, policy
        self.timeout_s = timeout_s
        self.expose_cache_stats = expose_cache_stats
        """Whether clients see how much of their prompt came from the decode's cache
        (``cached_tokens``, ``restored_tokens``, bytes): off by default, since a hit tells
        a client what another one asked (caches are per tenant either way)."""
        self.api_keys = parse_api_keys(knobs().api_keys) if api_keys is None else api_keys
        self.secret = load_secret()
        self.backend: Backend = backend or ToyBackend()
        self.kv = kv
        """The workers' KV event feeds and their index (None: history only)."""
        self.stale = StaleCheck(kv, stale) if kv is not None else None
        """What the workers' answers say of their feeds (a stale feed is suspected)."""
        self.load_weight = load_weight
        self.media = media
        """What chat requests may carry in ``image_url`` parts (``media.py``)."""
        self.door = door or Door(DEFAULT["prefill_queue_tokens"], DEFAULT["max_held"])
        """Where requests wait while every prefill's queue is full (``door.py``)."""
        self._rr_p = itertools.count()
        self._rr_d = itertools.count()
        self.counters = collections.Counter[str]()
        self.session: aiohttp.ClientSession | None = None
        self._http: Http | None = None
        self._health_at = 0.0
        self._health: dict[str, Any] = {}
        self._bg: set[asyncio.Task[Any]] = set()
        self._watch: asyncio.Future[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=8 << 20, middlewares=[_json_errors, self._authenticate]
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
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5.0)
        )
        self._http = Http(self.session, self.secret)
        await self.backend.setup(self._http, self.decodes)
        if self.kv is not None:
            self.kv.start()
        self._watch = asyncio.ensure_future(self._watch_down())

    @property
    def http(self) -> Http:
        assert self._http is not None, "the router's app has not started"
        return self._http

    async def _stop(self, app: web.Application) -> None:
        if self.kv is not None:
            await self.kv.stop()
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _watch_down(self) -> None:
        """While a worker is marked down, look again every ``HEALTH_TTL_S``: a worker (or
        its host) that comes back is used again without anyone calling ``/health``. Off the
        request path, so a worker that does not answer never slows a request."""
        while True:
            await asyncio.sleep(HEALTH_TTL_S)
            if all(x.healthy for x in (*self.prefills, *self.decodes)):
                continue
            try:
                await self.refresh_health(force=True)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("health refresh failed")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With API keys configured, ``/v1/*`` needs ``Authorization: Bearer KEY``; the key
        names the tenant, which scopes prefix reuse."""
        request["tenant"] = ""
        if self.api_keys and request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            tenant = self.api_keys.get(auth.removeprefix("Bearer ").strip())
            if not auth.startswith("Bearer ") or tenant is None:
                self.counters["unauthorized"] += 1
                return web.json_response(
                    error_body("invalid or missing API key", "invalid_api_key", 401), status=401
                )
            request["tenant"] = tenant
        return await handler(request)

    # -- pairing ------------------------------------------------------------------------------
    def pick(
        self, ids: list[int], avoid_p: set[str], avoid_d: set[str], tenant: str = ""
    ) -> tuple[Prefill, Decode, int, int]:
        """A (prefill, decode) pair, and how many leading prompt tokens each holds as far
        as the router knows (0 but under ``kv_aware``)."""

        ps, ds = usable(self.prefills, avoid_p), usable(self.decodes, avoid_d)
        pf_held = dc_held = 0
        # ties go to the worker used least, so an idle fleet is still spread
        if self.policy == "least_outstanding":
            pf = min(ps, key=lambda x: (x.outstanding, x.used))
            dc = min(ds, key=lambda x: (x.outstanding, x.used))
        elif self.policy == "kv_aware":
            if self.stale is not None:
                self.stale.sweep()
            cached = self._cached(ids, tenant)  # KV events: workers in sync
            pf, pf_held = choose(ps, self._held(ps, ids, tenant, cached), len(ids), pending_tokens)
            dc, dc_held = choose(
                ds,
                self._held(ds, ids, tenant, cached),
                len(ids),
                per_request(self.load_weight, len(ids)),
            )
        else:
            pf = ps[next(self._rr_p) % len(ps)]
            dc = ds[next(self._rr_d) % len(ds)]
        pf.used += 1
        dc.used += 1
        return pf, dc, pf_held, dc_held

    def _salt(self, tenant: str) -> str | None:
        salt_of = getattr(self.backend, "cache_salt", None)
        return salt_of(tenant) if salt_of else None

    def _cached(self, ids: list[int], tenant: str) -> Held:
        """Workers whose KV event feed is in sync, by the prompt's leading tokens held."""
        if self.kv is None:
            return []
        return self.kv.cached_groups(ids, self._salt(tenant))

    def _held(self, ws: list[Any], ids: list[int], tenant: str, cached: Held) -> Held:
        """What each of ``ws`` holds of the prompt: from its KV events while its feed is in
        sync (``cached``), else from the router's own history (at the decodes' page size)."""
        out = list(cached)
        keys: dict[int, list[str]] = {}
        for w in ws:
            if self.kv is not None and self.kv.synced(w.key):
                continue
            size = getattr(w, "page_size", self.decodes[0].page_size)
            if size not in keys:
                keys[size] = page_keys(ids, size, tenant)
            h = w.hit(keys[size]) * size
            if h:
                out.append((h, [w.key]))
        return out

    # -- plain handlers -------------------------------------------------------------------------
    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models(self.backend.tokenizer.model))

    async def refresh_health(self, force: bool = False) -> dict[str, Any]:
        now = time.monotonic()
        if not force and now - self._health_at < HEALTH_TTL_S:
            return self._health
        out: dict[str, Any] = {}
        probe = self.backend.probe
        fronts = {_front(p): p for p in reversed(self.prefills)}  # a DP instance once
        looked = await asyncio.gather(
            asyncio.gather(*(probe(self.http, p) for p in fronts.values())),
            asyncio.gather(*(registered(p) for p in fronts.values())),
        )
        by_front = dict(zip(fronts, zip(*looked)))
        self._expand_ranks(by_front)
        for p in self.prefills:
            info, size = by_front[_front(p)]
            ok = info is not None and size is not None
            self._down_forgets(p, ok)
            p.healthy = ok
            p.dp_size = size or p.dp_size
            out[p.key] = (
                "ok"
                if ok
                else "down"
                if info is None
                else f"not registered with bootstrap {p.bootstrap}"
            )
        urls = list(dict.fromkeys(d.url for d in self.decodes))  # a DP front once
        by_url = dict(
            zip(
                urls,
                await asyncio.gather(
                    *(probe(self.http, next(d for d in self.decodes if d.url == u)) for u in urls)
                ),
            )
        )
        self._expand_groups(by_url)
        for d in self.decodes:
            info = by_url.get(d.url)
            if info and d.dp is not None:  # this record is one of the worker's DP groups
                groups = info.get("groups") or []
                info = groups[d.dp] if d.dp < len(groups) else None
                if info and info.get("status", "ok") != "ok":
                    info = None
            self._down_forgets(d, info is not None)
            d.healthy = info is not None
            out[d.key] = "ok" if d.healthy else "down"
            if info:
                d.endpoint_id = info.get("peer") or info.get("endpoint") or d.endpoint_id
                d.max_seq_len = int(info.get("max_seq_len", d.max_seq_len or 0)) or None
                d.page_size = int(info.get("page_size", d.page_size))
        self._health, self._health_at = out, now
        return out

    def _down_forgets(self, w: Prefill | Decode, healthy: bool) -> None:
        """A worker going down may come back empty (a restart): what its events said it
        held is forgotten, and its history with it."""
        if w.healthy and not healthy:
            w.keys.clear()
            if self.kv is not None:
                self.kv.forget(w.key)

    def _expand_groups(self, infos: dict[str, Any]) -> None:
        """A decode URL that answers with DP ``groups`` becomes one record per group (each
        with its own cache keys, load and health), in place of its single record; its KV
        event feed becomes one per group."""
        out: list[Decode] = []
        for d in self.decodes:
            groups = (infos.get(d.url) or {}).get("groups")
            if d.dp is None and isinstance(groups, list) and groups:
                out += [Decode(d.url, d.instance, dp=g) for g in range(len(groups))]
                log.info("decode %s fronts %d DP groups", d.url, len(groups))
                if self.kv is not None:
                    self.kv.ranks(d.url, len(groups))
            else:
                out.append(d)
        self.decodes[:] = out
        if self.auto_policy:
            self.policy = auto_policy(len(self.prefills), len(out))

    def _expand_ranks(self, fronts: dict[tuple[str, str, str], tuple[Any, int | None]]) -> None:
        """A prefill instance whose bootstrap registration has several data-parallel ranks
        becomes one record per rank (each with its own load, cache keys and KV event feed):
        the router picks the rank, sends the request there and tells the decode to load
        from it. A restart with another DP size rebuilds its records (those kept keep their
        figures)."""
        out: list[Prefill] = []
        done: set[tuple[str, str, str]] = set()
        for p in self.prefills:
            f = _front(p)
            size = fronts.get(f, (None, None))[1]
            mine = [q for q in self.prefills if _front(q) == f]
            want = [None] if size == 1 else list(range(size)) if size else None
            if want is None or [q.dp for q in mine] == want:
                out.append(p)
                continue
            if f in done:
                continue
            done.add(f)
            old = {q.dp: q for q in mine}
            out += [old.get(r) or Prefill(p.url, p.bootstrap, p.instance, dp=r) for r in want]
            log.info("prefill %s (instance %s) runs %d DP ranks", p.url, p.instance, len(want))
            if self.kv is not None:
                self.kv.ranks(p.url, len(want))
        self.prefills[:] = out
        if self.auto_policy:  # a DP prefill's ranks are a choice, as several prefills are
            self.policy = auto_policy(len(out), len(self.decodes))

    async def h_health(self, request: web.Request) -> web.Response:
        workers = await self.refresh_health(force=True)
        ok = any(p.healthy for p in self.prefills) and any(d.healthy for d in self.decodes)
        return web.json_response(
            {
                "status": "ok" if ok else "unavailable",
                "workers": workers,
                "policy": self.policy,
                "engine": self.backend.name,
            },
            status=200 if ok else 503,
        )

    async def h_metrics(self, request: web.Request) -> web.Response:
        vals: dict[str, Any] = dict(self.counters)
        vals["outstanding"] = sum(d.outstanding for d in self.decodes)
        vals["healthy_prefills"] = sum(p.healthy for p in self.prefills)
        vals["healthy_decodes"] = sum(d.healthy for d in self.decodes)
        vals["waiting"] = self.door.waiting
        vals["held_at_door"] = self.door.held
        vals["refused_at_door"] = self.door.refused
        if self.kv is not None:
            if self.stale is not None:
                self.stale.sweep()
            feeds = self.kv.feeds.values()
            vals["kv_feeds_synced"] = sum(f.synced for f in feeds)
            vals["kv_indexed_blocks"] = sum(len(ix) for ix in self.kv.indexes.values())
            for k in (
                "batches",
                "gaps",
                "resets",
                "replays",
                "replayed",
                "bad_frames",
                "misses",
                "unpublished",
                "stale",
            ):
                vals[f"kv_events_{k}"] = sum(f.counters[k] for f in feeds)
        text = metrics_text("pdxfer_router", vals)
        if self.kv is not None:  # and each worker's feed, labelled by the worker
            text = merge_metrics(
                [
                    (text, {}),
                    *(
                        (metrics_text("pdxfer_router", v), {"worker": w})
                        for w, v in self.kv.per_worker().items()
                    ),
                ]
            )
        return web.Response(text=text)

    # -- the API --------------------------------------------------------------------------------
    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, oa.parse_completion)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, functools.partial(oa.parse_chat, media=self.media))

    async def _serve(self, request: web.Request, parse: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        try:
            ask = parse(await read_json(request), self.backend.tokenizer)
            ask.tenant = request.get("tenant", "")
            self.backend.check(ask)
            await self._check_context(ask)
        except ServingError as e:
            self.counters["bad_requests"] += 1
            return error_response(e)
        rid = f"{'chatcmpl' if ask.chat else 'cmpl'}-{secrets.token_hex(8)}"
        base = ask.seed if ask.seed is not None else secrets.randbits(62)
        jobs = [
            (i * ask.n + j, ids, (base + j) % (1 << 63))
            for i, ids in enumerate(ask.prompts)
            for j in range(ask.n)
        ]
        if ask.stream:
            return await self._stream(request, ask, rid, jobs, t0)
        try:
            choices = await asyncio.gather(
                *(self._choice(ask, ids, idx, seed, t0, None) for idx, ids, seed in jobs)
            )
        except AttemptFailed as e:
            return self._failure(e)
        self.counters["success"] += 1
        body = oa.response(ask, rid, sorted(choices, key=lambda c: c.index))
        return web.json_response(self._redact(body))

    def _redact(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Drop what tells a client about the cache unless the operator turned it on."""
        if self.expose_cache_stats:
            return obj
        usage = obj.get("usage")
        if usage and "prompt_tokens_details" in usage:
            usage["prompt_tokens_details"]["cached_tokens"] = 0
        for ext in [obj.get("pdxfer"), *(obj.get("pdxfer") or {}).get("choices", [])]:
            if isinstance(ext, dict):
                for k in (
                    "restored_tokens",
                    "restored_l2_tokens",
                    "restored_l3_tokens",
                    "prefill_cached_tokens",
                    "decode_cached_tokens",
                    "prefill_reused_tokens",
                    "prefill_layer_sends",
                    "bytes",
                    "decode_ttft_s",
                    "repaired_tokens",
                    "ranks",
                    "kv_wait_s",
                    "kv_local_s",
                    "kv_net_s",
                ):
                    ext.pop(k, None)
        return obj

    async def _check_context(self, ask: oa.Ask) -> None:
        if any(d.max_seq_len is None for d in self.decodes) or any(
            p.dp_size is None for p in self.prefills
        ):  # what the workers are (their limits, their DP ranks) before the first pick
            await self.refresh_health()
        limits = [d.max_seq_len for d in self.decodes if d.max_seq_len]
        longest = max(len(p) for p in ask.prompts)
        if limits and longest + ask.max_tokens + ask.spec_k > min(limits):
            raise BadRequest(
                f"prompt ({longest} tokens) + max_tokens ({ask.max_tokens}) + "
                f"speculative_k ({ask.spec_k}) exceeds the context of "
                f"{min(limits)} tokens"
            )

    def _failure(self, e: AttemptFailed) -> web.Response:
        self.counters["failures"] += 1
        if e.capacity:
            self.counters["capacity_rejections"] += 1
            return error_response(OutOfCapacity(str(e)))
        if e.client:
            return web.json_response(
                error_body(str(e), "invalid_request", e.status), status=e.status
            )
        return error_response(UpstreamError(str(e)))

    async def _stream(
        self,
        request: web.Request,
        ask: oa.Ask,
        rid: str,
        jobs: list[tuple[int, list[int], int]],
        t0: float,
    ) -> web.StreamResponse:
        """Chunks of every choice as they come; the response starts with the first text, so a
        failure before it still gets a proper HTTP status."""
        created = int(time.time())
        resp: web.StreamResponse | None = None
        q: asyncio.Queue[tuple[int, str, list[dict[str, Any]]]] = asyncio.Queue()

        async def on_delta(index: int, text: str, lps: list[dict[str, Any]]) -> None:
            q.put_nowait((index, text, lps))

        tasks = [
            asyncio.ensure_future(self._choice(ask, ids, idx, seed, t0, on_delta))
            for idx, ids, seed in jobs
        ]
        started: set[int] = set()

        async def send(obj: Any) -> None:
            nonlocal resp
            if resp is None:
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
            await resp.write(f"data: {json.dumps(self._redact(obj))}\n\n".encode())

        async def drain(first: list[tuple[int, str, list[dict[str, Any]]]]) -> None:
            items = list(first)
            while not q.empty():
                items.append(q.get_nowait())
            for idx, text, lps in items:  # in the order the choices produced them
                role = ask.chat and idx not in started
                started.add(idx)
                await send(oa.chunk(ask, rid, created, idx, text, None, lps, role=role))

        try:
            pending = set(tasks)
            done_choices: list[oa.Choice] = []
            while pending:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait(
                    pending | {getter}, return_when=asyncio.FIRST_COMPLETED
                )
                if not getter.done():
                    getter.cancel()
                    await asyncio.gather(getter, return_exceptions=True)
                got = [getter.result()] if getter.done() and not getter.cancelled() else []
                await drain(got)
                for t in done - {getter}:
                    pending.discard(t)
                    try:
                        c = t.result()
                    except AttemptFailed as e:
                        if resp is None:
                            return self._failure(e)
                        self.counters["stream_errors"] += 1
                        await send({"error": error_body(str(e), "upstream", e.status)["error"]})
                        continue
                    done_choices.append(c)
                    role = ask.chat and c.index not in started
                    last = oa.chunk(
                        ask,
                        rid,
                        created,
                        c.index,
                        None if ask.chat else "",
                        c.finish_reason,
                        role=role,
                    )
                    last["pdxfer"] = oa.extension(c)
                    await send(last)
            if ask.include_usage:
                await send(oa.usage_chunk(ask, rid, created, done_choices))
            if resp is None:  # nothing was generated at all (e.g. EOS first)
                await send(oa.usage_chunk(ask, rid, created, done_choices))
            assert resp is not None
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.counters["success"] += 1
            return resp
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    # -- one choice -----------------------------------------------------------------------------
    async def _choice(
        self, ask: oa.Ask, ids: list[int], index: int, seed: int, t0: float, on_delta: Any
    ) -> oa.Choice:
        avoid_p: set[str] = set()
        avoid_d: set[str] = set()
        err: AttemptFailed | None = None
        tries = max(2, len(self.prefills) * len(self.decodes))
        for attempt in range(tries):
            full = await self.door.enter(usable(self.prefills, avoid_p), len(ids), self.timeout_s)
            pf, dc, pf_held, dc_held = self.pick(ids, avoid_p | full, avoid_d, ask.tenant)
            marks = (
                (self.kv.mark(pf.key), self.kv.mark(dc.key))
                if self.kv is not None
                else (None, None)
            )
            c = oa.Choice(index)
            if attempt:
                self.counters["retries"] += 1
                log.info("retrying on %s + %s after: %s", pf.url, dc.url, err)
            try:
                await self._attempt(ask, ids, seed, pf, dc, c, t0, on_delta, len(ids) - pf_held)
                if self.policy == "kv_aware":
                    dc.remember(page_keys(ids, dc.page_size, ask.tenant))
                    pf.remember(page_keys(ids, self.decodes[0].page_size, ask.tenant))
                    self._report(c, ids, pf, dc, pf_held, dc_held)
                    self.judge(
                        len(ids), c.stats, (pf.key, pf_held, marks[0]), (dc.key, dc_held, marks[1])
                    )
                return c
            except AttemptFailed as e:
                err = e
                if e.client or c.token_ids:
                    break  # a bad request, or text already went out: no second try
                if e.capacity:
                    avoid_d.add(dc.key)
                    avoid_p.add(pf.key)
                elif attempt >= 1:
                    break
                else:
                    avoid_p.add(pf.key)
                    avoid_d.add(dc.key)
                # a worker may have restarted (a new endpoint id to bind rooms to)
                await self.refresh_health(force=True)
        assert err is not None
        raise err

    def _report(
        self, c: oa.Choice, ids: list[int], pf: Prefill, dc: Decode, pf_held: int, dc_held: int
    ) -> None:
        """Which workers a choice went to and how much of its prompt each held (as the
        router saw it when it chose): in the ``pdxfer`` extension, the metrics and the log."""
        c.stats["prefill_cached_tokens"] = pf_held
        c.stats["decode_cached_tokens"] = dc_held
        self.counters["kv_prompt_tokens"] += len(ids)
        self.counters["kv_prefill_cached_tokens"] += pf_held
        self.counters["kv_decode_cached_tokens"] += dc_held
        log.info(
            "routed %d prompt tokens: prefill %s (held %d, events %s), decode %s "
            "(held %d, events %s)",
            len(ids),
            pf.key,
            pf_held,
            self.kv is not None and self.kv.synced(pf.key),
            dc.key,
            dc_held,
            self.kv is not None and self.kv.synced(dc.key),
        )

    def judge(
        self,
        n_tokens: int,
        stats: dict[str, Any],
        pf: tuple[str, int, int | None],
        dc: tuple[str, int, int | None],
    ) -> None:
        """A served choice as evidence on its workers' feeds: per leg, its worker, what the
        router credited it with and its feed's mark at the choice (None: the credit did not
        come from its events), against what the worker reported it held (the prefill's
        reused prompt tokens, the decode's restored ones; either may be absent)."""
        if self.stale is None:
            return
        got = [stats.get("prefill_reused_tokens"), stats.get("restored_tokens")]
        self.stale.served(
            n_tokens,
            [
                Served(w, held, ev, int(a) if isinstance(a, (int, float)) else None)
                for (w, held, ev), a in zip((pf, dc), got)
            ],
        )

    def _later(self, coro: Any) -> None:
        later(self._bg, coro)

    async def _attempt(
        self,
        ask: oa.Ask,
        ids: list[int],
        seed: int,
        pf: Prefill,
        dc: Decode,
        c: oa.Choice,
        t0: float,
        on_delta: Any,
        pf_work: int = 0,
    ) -> None:
        """One try on a pair; ``pf_work``: the prompt tokens the prefill has to compute
        (its ``pending`` until the first token: the prefill is done by then)."""
        room = secrets.randbits(63)
        pf.outstanding += 1
        dc.outstanding += 1
        pf.pending += pf_work
        finished, rendered = False, False
        detok, stops = ask.tok.detokenizer(), oa.StopText(ask.stop)
        events = self.backend.stream(self.http, Attempt(ask, ids, seed, pf, dc, room))
        try:
            try:
                async for ev in events:
                    if isinstance(ev, Done):
                        c.finish_reason = ev.finish_reason
                        c.stats = {
                            **ev.stats,
                            "room": room,
                            "prefill": pf.url,
                            "decode": dc.url,
                            "seconds": time.perf_counter() - t0,
                        }
                        if dc.dp is not None:
                            c.stats["decode_dp"] = dc.dp
                        if pf.dp is not None:
                            c.stats["prefill_dp"] = pf.dp
                        finished = True
                        break
                    if pf_work and ev.token_ids:
                        pf.pending -= pf_work
                        pf_work = 0
                        self.door.released()
                    c.token_ids += ev.token_ids
                    c.logprobs += ev.logprobs
                    rendered |= ev.text is not None
                    text = stops.feed(ev.text if ev.text is not None else detok.feed(ev.token_ids))
                    await self._emit(c, text, ev.logprobs, on_delta)
                    if stops.stopped:
                        c.finish_reason = "stop"
                        c.stats = {
                            "room": room,
                            "prefill": pf.url,
                            "decode": dc.url,
                            "seconds": time.perf_counter() - t0,
                        }
                        break  # leaving closes the stream: the decode stops generating
            finally:
                await events.aclose()
            if not stops.stopped:
                if not finished:
                    raise AttemptFailed(502, f"decode {dc.url} ended the stream early")
                tail = "" if rendered else detok.flush()
                await self._emit(c, stops.feed(tail) + stops.flush(), [], on_delta)
            if c.finish_reason == "cancelled":
                raise AttemptFailed(502, f"room {room} was cancelled on {dc.url}")
        except BaseException:
            why = "the router gave up on this request"
            self._later(self.backend.abort(self.http, pf.url, room, why))
            self._later(self.backend.abort(self.http, dc.url, room, why))
            raise
        finally:
            pf.outstanding -= 1
            dc.outstanding -= 1
            if pf_work:
                pf.pending -= pf_work
                self.door.released()
            if stops.stopped:
                self._later(self.backend.abort(self.http, pf.url, room, "stop string reached"))

    async def _emit(
        self, c: oa.Choice, text: str, lps: list[dict[str, Any]], on_delta: Any
    ) -> None:
        if not text and not lps:
            return
        c.text += text
        if on_delta is not None:
            await on_delta(c.index, text, lps)


def _front(p: Prefill) -> tuple[str, str, str]:
    """A prefill instance behind one URL (all its DP ranks' records share it)."""
    return (p.url, p.bootstrap, p.instance)


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
    log.info("router: %d prefill, %d decode, %s", len(prefills), len(decodes), router.policy)
    return serve(router.app(), s.host, s.port, advertise=s.advertise, what="router")
