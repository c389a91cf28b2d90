"""The one small interface through which the router drives an engine's workers.

The router owns what is the same for every engine: the OpenAI front door, pairing policies,
retries, stop strings, streaming. A ``Backend`` owns what differs: how a worker's health is
read, and how one attempt of one choice runs on a (prefill, decode) pair — it yields the
decode's tokens as they come and a last ``Done`` with the attempt's figures, or raises
``AttemptFailed``.

``ToyBackend`` speaks the toy workers' protocol (``toy/prefill.py``, ``toy/decode.py``): the
prompt goes to both workers at once, the decode streams token events. ``vllm.py`` speaks
vLLM's disaggregated-serving protocol (``kv_transfer_params``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from pdxfer import BootstrapClient, PdxferError, endpoint_settings, parse_hostport
from pdxfer.setting import settings_of
from pdxfer.trust import http_headers

from ..errors import BadRequest
from ..toy.config import WorkerConfig
from . import openai_api as oa
from .tokenizers import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

MAX_KEYS = 1 << 17
_PAGE_SIZE: int = settings_of(WorkerConfig)["page_size"].default
"""A decode's page size until its health reports one: a toy worker's default."""


def remember(history: collections.OrderedDict[str, None], keys: list[str]) -> None:
    """Note the page keys of a prompt sent to a worker (the oldest go past ``MAX_KEYS``)."""
    for k in keys:
        history[k] = None
        history.move_to_end(k)
    while len(history) > MAX_KEYS:
        history.popitem(last=False)


def hit(history: collections.OrderedDict[str, None], keys: list[str]) -> int:
    """How many leading page keys a worker's history holds (its cached prefix, in pages)."""
    n = 0
    for k in keys:
        if k not in history:
            break
        n += 1
    return n


@dataclass(slots=True)
class Prefill:
    url: str
    bootstrap: str
    instance: str = endpoint_settings()["instance"].default  # a worker's, unless it names one
    outstanding: int = 0
    pending: int = 0
    """Prompt tokens the requests sent here still have to compute (each from its choice
    until its first token): the prefill's load under ``kv_aware``. ``outstanding`` also
    counts the requests past their prefill, decoding."""
    healthy: bool = True
    used: int = 0
    keys: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    """The page keys of the prompts the router sent here (KV-aware routing's history)."""
    dp: int | None = None
    """One data-parallel rank of the instance behind ``url`` (vLLM ``--data-parallel-size``):
    the router keeps a record per rank, sends the request to that rank and tells the decode
    to load from it."""
    dp_size: int | None = None
    """The instance's data-parallel size as its bootstrap registration says (None: not
    looked up yet)."""

    @property
    def key(self) -> str:
        """This record among the router's prefills (a URL, or a URL's DP rank)."""
        return self.url if self.dp is None else f"{self.url}#dp{self.dp}"

    def remember(self, keys: list[str]) -> None:
        remember(self.keys, keys)

    def hit(self, keys: list[str]) -> int:
        return hit(self.keys, keys)


@dataclass(slots=True)
class Decode:
    url: str
    instance: str | None = None
    """The decode's name as its endpoint knows it (given with ``--decode URL,INSTANCE``):
    rooms are bound to it."""
    endpoint_id: str | None = None
    """What the decode's health names as the peer to bind rooms to (its ``peer``: the
    instance name a TP decode's ranks share; else its ``endpoint`` id)."""
    outstanding: int = 0
    max_seq_len: int | None = None
    page_size: int = _PAGE_SIZE
    healthy: bool = True
    used: int = 0
    keys: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    dp: int | None = None
    """One of several independent decode groups behind ``url`` (``pdxfer decode --dp``, or
    a vLLM decode's data-parallel rank): the router keeps a record per group, so KV-aware
    routing sees each group's cache."""

    @property
    def peer(self) -> str | None:
        """What a prefill binds the room to: the endpoint id when known, else the name."""
        return self.endpoint_id or self.instance

    @property
    def key(self) -> str:
        """This record among the router's decodes (a URL, or a URL's DP group)."""
        return self.url if self.dp is None else f"{self.url}#dp{self.dp}"

    def remember(self, keys: list[str]) -> None:
        remember(self.keys, keys)

    def hit(self, keys: list[str]) -> int:
        return hit(self.keys, keys)


def parse_prefill(spec: str) -> Prefill:
    """``URL,BOOTSTRAP[,INSTANCE]``, e.g. ``http://10.0.0.1:8100,10.0.0.1:8998``."""
    parts = spec.split(",")
    if len(parts) not in (2, 3) or not parts[0].startswith("http") or not parts[1]:
        raise ValueError(f"--prefill wants URL,BOOTSTRAP[,INSTANCE], got {spec!r}")
    boot = parse_hostport(parts[1], f"--prefill {spec!r}: its bootstrap")  # what decodes trust
    return Prefill(parts[0].rstrip("/"), boot, parts[2] if len(parts) == 3 else "default")


def parse_decode(spec: str) -> Decode:
    """``URL[,INSTANCE]``, e.g. ``http://10.0.0.2:8200,decode0``."""
    parts = spec.split(",")
    if len(parts) not in (1, 2) or not parts[0].startswith("http") or not all(parts):
        raise ValueError(f"--decode wants URL[,INSTANCE], got {spec!r}")
    return Decode(parts[0].rstrip("/"), parts[1] if len(parts) == 2 else None)


class AttemptFailed(Exception):
    """One attempt failed; ``client``: a 4xx no other pair can fix; ``capacity``: full;
    ``unpaired``: the pair refused to pair (another pair may serve it)."""

    def __init__(
        self,
        status: int,
        message: str,
        client: bool = False,
        capacity: bool = False,
        unpaired: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.client, self.capacity = status, client, capacity
        self.unpaired = unpaired

    @classmethod
    def from_status(cls, status: int, message: str) -> AttemptFailed:
        """A worker's HTTP error: a 4xx other than timeouts and conflicts is the client's,
        429/503 mean full."""
        return cls(
            status,
            message,
            client=400 <= status < 500 and status not in (408, 409, 429),
            capacity=status in (429, 503),
        )


@dataclass(slots=True)
class Tokens:
    """New output tokens of one choice; ``text`` when the engine rendered them itself
    (else the router detokenizes)."""

    token_ids: list[int]
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    text: str | None = None


@dataclass(slots=True)
class Done:
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Attempt:
    """One try of one choice on one pair."""

    ask: oa.Ask
    ids: list[int]
    seed: int
    pf: Prefill
    dc: Decode
    room: int
    retry: bool = False
    """A second try after one failed: the decode's leg waits for the prefill's answer (no
    decode holds blocks for KV from a prefill that may have just died)."""


class Http:
    """The router's client session towards its workers, signing requests when a secret is
    set (the workers then accept only what the router sent). The router makes it before its
    app runs and opens its session at start (an aiohttp session belongs to a running loop)."""

    def __init__(self, session: aiohttp.ClientSession | None, secret: bytes | None) -> None:
        self._session, self.secret = session, secret

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's app has not started"
        return self._session

    def open(self, timeout_s: float) -> None:
        """A session whose requests each end within ``timeout_s``. No cap on its open
        connections: a request holds both legs open at once, and a decode's leg waits for
        KV its prefill's leg brings, so legs queued behind a cap (aiohttp's default, 100)
        would hold decodes open for prefills that never start: a cap here splits pairs
        rather than bounding the load (the router's door and the workers' admission do)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def signed(
        self, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """aiohttp arguments for a worker POST (``headers``: more of them)."""
        body = json.dumps(payload).encode()
        headers = {
            "Content-Type": "application/json",
            **(headers or {}),
            **http_headers(self.secret, "POST", urllib.parse.urlsplit(url).path, body),
        }
        return {"data": body, "headers": headers}

    async def get_json(self, url: str, timeout: float = 3.0) -> Any:
        """A worker's JSON answer to a GET, or None when it is down or answers an error."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    return None
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None


async def json_or_text(r: aiohttp.ClientResponse) -> Any:
    try:
        return await r.json()
    except (aiohttp.ContentTypeError, json.JSONDecodeError):
        return {"error": {"message": await r.text()}}


def message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


async def sse_events(r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The ``data:`` objects of a server-sent event stream, up to ``[DONE]``."""
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])


async def registered(p: Prefill) -> int | None:
    """The data-parallel size of the prefill's instance if its bootstrap can route to it
    (every rank registered), else None (every request to it would fail however healthy the
    worker is)."""

    def look() -> int | None:
        try:
            route = BootstrapClient(p.bootstrap, timeout=2.0, retries=0).route(
                0, p.instance, deadline=time.monotonic()
            )
        except PdxferError:
            return None
        size = route.get("dp_size", 1) if isinstance(route, dict) else None
        return size if isinstance(size, int) and size >= 1 else None

    return await asyncio.to_thread(look)


async def refusal(p: Prefill, d: Decode) -> str | None:
    """Why ``p``'s instance refused to pair with decode ``d`` (by its instance name or
    endpoint id), as the prefill's registration at its bootstrap says, or None."""
    names = [n for n in (d.instance, d.endpoint_id) if n]

    def look() -> str | None:
        try:
            got = BootstrapClient(p.bootstrap, timeout=2.0, retries=0).refusals(p.instance)
        except PdxferError:
            return None
        return next((got[n] for n in names if n in got), None)

    return await asyncio.to_thread(look) if names else None


class Backend(Protocol):
    """An engine's workers as the router sees them."""

    name: str

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (known once ``setup`` has run)."""

    async def setup(self, http: Http, decodes: list[Decode]) -> None:
        """Learn what the engine serves (model, tokenizer) before the first request."""

    def check(self, ask: oa.Ask) -> None:
        """Refuse (``BadRequest``) what this engine cannot do."""

    async def probe(self, http: Http, w: Prefill | Decode) -> dict[str, Any] | None:
        """A worker's health: None when down; for a decode, what the router learns of it
        (``endpoint`` or ``peer``, ``max_seq_len``, ``page_size``; ``groups``, one such dict
        per group, when it fronts independent DP groups)."""

    def stream(self, http: Http, job: Attempt) -> AsyncGenerator[Tokens | Done, None]:
        """Run one attempt: the decode's tokens as they come, then ``Done``; closing the
        generator ends the attempt on the workers."""

    async def abort(self, http: Http, url: str, room: int, why: str) -> None:
        """Best effort: end ``room`` on that worker (the router gave up on it)."""


class ToyBackend:
    """pdxfer's toy workers: the prompt goes to both at once; the decode streams events."""

    name = "toy"

    def __init__(self) -> None:
        self.tokenizer: Tokenizer = ByteTokenizer()
        self._bg: set[asyncio.Future[Any]] = set()

    async def setup(self, http: Http, decodes: list[Decode]) -> None:
        return None

    def check(self, ask: oa.Ask) -> None:
        refuse(ask, self.name, images=ask.messages is not None)

    async def probe(self, http: Http, w: Prefill | Decode) -> dict[str, Any] | None:
        info = await http.get_json(f"{w.url}/health")
        return info if isinstance(info, dict) else None

    async def abort(self, http: Http, url: str, room: int, why: str) -> None:
        try:
            async with http.session.post(
                f"{url}/abort",
                **http.signed(f"{url}/abort", {"room": room, "reason": why}),
                timeout=aiohttp.ClientTimeout(total=5),
            ) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
            pass  # RuntimeError: the session closed (the router is stopping)

    async def _prefill(self, http: Http, job: Attempt) -> tuple[int, str, Any]:
        ask, pf = job.ask, job.pf
        payload: dict[str, Any] = {
            "room": job.room,
            "prompt_ids": job.ids,
            "temperature": ask.temperature,
            "top_p": ask.top_p,
            "seed": job.seed,
            "tenant": ask.tenant,
        }
        if job.dc.peer:  # the room is bound to the decode chosen for it
            payload["decode_peer"] = job.dc.peer
        try:
            async with http.session.post(
                f"{pf.url}/generate", **http.signed(f"{pf.url}/generate", payload)
            ) as r:
                body = await json_or_text(r)
                return r.status, message(body), body
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 599, f"{pf.url}: {type(e).__name__}: {e}", None

    async def stream(self, http: Http, job: Attempt) -> AsyncGenerator[Tokens | Done, None]:
        ask, pf, dc, room = job.ask, job.pf, job.dc, job.room
        pf_task = asyncio.ensure_future(self._prefill(http, job))

        def prefill_done(t: asyncio.Future[tuple[int, str, Any]]) -> None:
            if not t.cancelled() and t.result()[0] != 200:  # the decode would wait in vain
                later(self._bg, self.abort(http, dc.url, room, f"prefill failed: {t.result()[1]}"))

        pf_task.add_done_callback(prefill_done)
        payload = {
            "room": room,
            "bootstrap": pf.bootstrap,
            "instance": pf.instance,
            "prompt_ids": job.ids,
            "max_tokens": ask.max_tokens,
            "stream": True,
            "spec_k": ask.spec_k,
            "temperature": ask.temperature,
            "top_p": ask.top_p,
            "seed": job.seed,
            "ignore_eos": ask.ignore_eos,
            "logprobs": ask.logprobs,
            "tenant": ask.tenant,
        }
        if dc.dp is not None:
            payload["dp"] = dc.dp
        try:
            async with http.session.post(
                f"{dc.url}/generate", **http.signed(f"{dc.url}/generate", payload)
            ) as r:
                if r.status != 200:
                    msg = message(await json_or_text(r))
                    if pf_task.done() and pf_task.result()[0] != 200:
                        msg = f"prefill: {pf_task.result()[1]}; decode: {msg}"
                    raise AttemptFailed.from_status(r.status, msg)
                async for ev in sse_events(r):
                    if "error" in ev:
                        raise AttemptFailed(502, f"decode {dc.url}: {message(ev)}")
                    if ev.get("done"):
                        if not pf_task.done():  # its answer may trail the decode's
                            await asyncio.wait([pf_task], timeout=5)
                        pb = pf_task.result()[2] if pf_task.done() else None
                        stats = dict(ev)
                        if isinstance(pb, dict):
                            stats["prefill_reused_tokens"] = int(pb.get("reused_tokens") or 0)
                            stats["prefill_layer_sends"] = int(pb.get("layer_sends") or 0)
                            if pb.get("compute_s") is not None:
                                stats["prefill_s"] = float(pb["compute_s"])
                        yield Done(ev.get("finish_reason") or "length", stats)
                        return
                    yield Tokens(
                        [int(t) for t in ev.get("token_ids", [])], ev.get("logprobs") or []
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AttemptFailed(502, f"decode {dc.url}: {type(e).__name__}: {e}") from None
        finally:
            if not pf_task.done():  # its answer trails the decode's
                keep(self._bg, pf_task, "a prefill's answer after its decode finished")


def later(tasks: set[asyncio.Future[Any]], coro: Any) -> None:
    """Run a best-effort call (an abort) even if the request that wants it is cancelled."""
    keep(tasks, asyncio.ensure_future(coro), "a best-effort call failed")


def keep(tasks: set[asyncio.Future[Any]], task: asyncio.Future[Any], what: str) -> None:
    """Let ``task`` finish on its own (a call, or a leg whose answer trails its request):
    ``tasks`` keeps it referenced until it is done; a failure is logged as ``what``, not
    raised."""
    tasks.add(task)

    def done(t: asyncio.Future[Any]) -> None:
        tasks.discard(t)
        if failed(t):
            log.info("%s: %s", what, t.exception())

    task.add_done_callback(done)


def failed(t: asyncio.Future[Any]) -> bool:
    """A done task that raised (not one cancelled)."""
    return not t.cancelled() and t.exception() is not None


def refuse(ask: oa.Ask, engine: str, **features: bool) -> None:
    """A 400 naming the first requested feature ``engine`` does not have."""
    for name, wanted in features.items():
        if wanted:
            raise BadRequest(f"'{name}' is not supported by engine {engine}")
