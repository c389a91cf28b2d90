"""The router in front of ``vllm serve`` workers running ``PdxferConnector``.

vLLM's disaggregated protocol, as its own proxy drives it: the prompt goes to the prefill as
a one-token completion with ``kv_transfer_params: {"do_remote_decode": true}``, and the
decode's request repeats the ``kv_transfer_params`` the prefill answered. pdxfer adds
``pdxfer_room`` and ``pdxfer_decode`` (the decode the prefill binds the room to). By default
(``--dispatch concurrent``) the decode gets its request at once with the answer the prefill
will give (the protocol's early form), so it allocates and asks while the prefill computes.
A tenant becomes vLLM's ``cache_salt`` on both sides. No vLLM import: workers are spoken to
over HTTP. The tokenizer comes from the served model's folder, so the router sends token ids
and KV-aware routing hashes pages of them at the decode's block size. A chat with images
goes to both legs' ``/v1/chat/completions`` as the client's messages (checked by
``media.py``): each leg renders it with the model's processor, so both compute one prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp

from pdxfer.config import one_of

from ..errors import Unpaired
from . import openai_api as oa
from .backends import (
    Attempt,
    AttemptFailed,
    Decode,
    Done,
    Http,
    Prefill,
    Tokens,
    failed,
    json_or_text,
    keep,
    message,
    refusal,
    refuse,
    sse_events,
)
from .settings import DEFAULT, DISPATCHES
from .tokenizers import HFTokenizer, Tokenizer

log = logging.getLogger(__name__)
SETUP_TIMEOUT_S = 120.0
"""How long the router's start waits for a decode to answer ``/v1/models``, at least: never
less than its per-request deadline (``--timeout``), since a decode that may take that long
to answer a request may take that long to answer this one (a process stalled on a loaded
host)."""
PREFILL_CAUSE_S = 1.0
"""How long a failed decode waits for its prefill's answer, to report the cause."""
PREFILL_STATS_S = 5.0
"""How long a finished decode waits for its prefill's answer, for the prefill's figures
(``prefill_s``, reused tokens). The answer can trail the decode's tokens on a loaded host
(the prefill's front end is starved); once the decode has a token the prefill's answer is
never cancelled, only not waited for: vLLM would count a request whose KV went out as
aborted, not as a success."""
_BLOCK = re.compile(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', re.M)
_ENGINE = re.compile(r'^vllm:[^{\s]*\{[^}]*\bengine="(\d+)"', re.M)


class VllmBackend:
    """``vllm serve`` prefill and decode workers with ``PdxferConnector``."""

    name = "vllm"

    def __init__(
        self,
        tokenizer: str | None = None,
        page_size: int | None = None,
        dispatch: str = DEFAULT["dispatch"],
        setup_timeout_s: float = SETUP_TIMEOUT_S,
    ) -> None:
        one_of("dispatch", dispatch, DISPATCHES)
        self.dispatch = dispatch
        self.setup_timeout_s = setup_timeout_s
        self._tokenizer_path = tokenizer
        self._page_size = page_size
        self._tok: Tokenizer | None = None
        self.served = ""
        self._trailing: set[asyncio.Future[Any]] = set()

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tok is not None, "the vLLM backend is not set up"
        return self._tok

    async def _models(self, http: Http, url: str) -> dict[str, Any] | None:
        body = await http.get_json(f"{url}/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None

    async def setup(self, http: Http, decodes: list[Decode]) -> None:
        """Learn the served model from the first decode that answers (they all serve one)."""
        deadline = time.monotonic() + self.setup_timeout_s
        while True:
            for d in decodes:
                m = await self._models(http, d.url)
                if m is not None:
                    self.served = str(m.get("id"))
                    path = self._tokenizer_path or str(m.get("root") or self.served)
                    self._tok = await asyncio.to_thread(HFTokenizer, path, self.served)
                    log.info("vllm: serving %s, tokenizer from %s", self.served, path)
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no vLLM decode answered /v1/models within "
                    f"{self.setup_timeout_s:.0f} s: {[d.url for d in decodes]}"
                )
            await asyncio.sleep(1.0)

    @staticmethod
    def cache_salt(tenant: str) -> str | None:
        """A tenant's vLLM ``cache_salt`` (an extra key of the first block's hash)."""
        return hashlib.sha256(f"pdxfer-tenant|{tenant}".encode()).hexdigest() if tenant else None

    def check(self, ask: oa.Ask) -> None:
        refuse(ask, self.name, speculative_k=bool(ask.spec_k))

    async def _metrics(self, http: Http, url: str) -> str:
        """A worker's ``/metrics`` text ("" when it does not answer)."""
        try:
            async with http.session.get(
                f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=3)
            ) as r:
                return await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return ""

    async def probe(self, http: Http, w: Prefill | Decode) -> dict[str, Any] | None:
        try:
            async with http.session.get(
                f"{w.url}/health", timeout=aiohttp.ClientTimeout(total=3)
            ) as r:
                if r.status != 200:
                    return None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        if isinstance(w, Prefill):
            return {"status": "ok"}
        info: dict[str, Any] = {"status": "ok"}
        m = await self._models(http, w.url)
        if m and m.get("max_model_len"):
            info["max_seq_len"] = int(m["max_model_len"])
        text = await self._metrics(http, w.url)
        block = _BLOCK.search(text)
        size = self._page_size or (int(block.group(1)) if block else None)
        if size:
            info["page_size"] = size
        ranks = data_parallel_size(text)
        if ranks > 1:  # one record per rank: the router sends each request to one
            info["groups"] = [dict(info) for _ in range(ranks)]
        return info

    async def abort(self, http: Http, url: str, room: int, why: str) -> None:
        """vLLM ends a request whose client left (the router closes its stream); a prefill's
        blocks that no decode asks for are freed by its connector at the bootstrap deadline."""
        return None

    def _sampling(self, job: Attempt) -> dict[str, Any]:
        ask = job.ask
        out: dict[str, Any] = {
            "model": self.served,
            "temperature": ask.temperature,
            "top_p": ask.top_p,
            "seed": job.seed,
        }
        if ask.messages is not None:  # images: each leg renders the client's messages
            out["messages"] = ask.messages
        else:
            out["prompt"] = job.ids
        salt = self.cache_salt(ask.tenant)
        if salt:  # clients never set it: the router builds every vLLM request itself
            out["cache_salt"] = salt
        return out

    async def _prefill(self, http: Http, job: Attempt) -> tuple[dict[str, Any], int | None]:
        """The prefill's leg: the prompt with ``max_tokens=1``; its answer's
        ``kv_transfer_params`` (the sequential form hands them to the decode), and the prompt
        tokens its prefix cache held (``usage.prompt_tokens_details.cached_tokens``, with
        ``--enable-prompt-tokens-details``; else None)."""
        pf, dc = job.pf, job.dc
        params: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "pdxfer_room": job.room,
        }
        if dc.peer:  # the prefill binds the room to the decode chosen for it
            params["pdxfer_decode"] = dc.peer
        if pf.dp is not None:  # the rank the decode will load from
            params["pdxfer_dp"] = pf.dp
        payload = {
            **self._sampling(job),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": params,
        }
        url = f"{pf.url}{_path(job)}"
        try:
            async with http.session.post(url, **http.signed(url, payload, rank(pf.dp))) as r:
                body = await json_or_text(r)
                if r.status != 200:
                    raise AttemptFailed.from_status(r.status, f"prefill {pf.url}: {message(body)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AttemptFailed(502, f"prefill {pf.url}: {type(e).__name__}: {e}") from None
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            raise AttemptFailed(
                502,
                f"prefill {pf.url} returned no kv_transfer_params: is "
                f"it running PdxferConnector as kv_producer?",
            )
        if kv.get("pdxfer_room") != job.room:
            raise AttemptFailed(
                502, f"prefill {pf.url} answered room {kv.get('pdxfer_room')!r}, not {job.room}"
            )
        if pf.dp is not None and kv.get("pdxfer_dp") != pf.dp:
            # the decode was told to load from rank pf.dp, which never had the request
            raise AttemptFailed(
                502,
                f"prefill {pf.url} computed room {job.room} on data-parallel rank "
                f"{kv.get('pdxfer_dp')!r}, not on rank {pf.dp} it was sent to "
                f"(X-data-parallel-rank)",
            )
        return kv, _cached_tokens(body)

    @staticmethod
    def early_params(job: Attempt) -> dict[str, Any]:
        """The decode's ``kv_transfer_params`` in the early form: what the prefill will answer
        (room, its bootstrap and instance), known before it computed anything."""
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "pdxfer_room": job.room,
            "pdxfer_bootstrap": job.pf.bootstrap,
            "pdxfer_instance": job.pf.instance,
        }
        if job.pf.dp is not None:
            out["pdxfer_dp"] = job.pf.dp
        return out

    async def stream(self, http: Http, job: Attempt) -> AsyncGenerator[Tokens | Done, None]:
        """One attempt. ``concurrent``: the prefill's and the decode's requests go out at
        once (the decode allocates and asks for the room while the prefill computes); a
        prefill that fails before the decode's first token ends the attempt at once, which
        closes the decode's stream (vLLM aborts the request and its connector the load), and
        the router retries on another pair. ``sequential``: the decode's request carries the
        prefill's answer (vLLM's own proxy protocol). Leaving (the client went away) cancels
        both legs: vLLM aborts a request whose connection closed."""
        t0 = time.perf_counter()
        took: list[float] = []
        held: list[int] = []

        async def prefill() -> dict[str, Any]:
            kv, cached = await self._prefill(http, job)
            took.append(time.perf_counter() - t0)
            held.extend([] if cached is None else [cached])
            return kv

        # a prefill whose DP ranks are not known yet goes first: its answer names the rank;
        # so does a retry's (``Attempt.retry``)
        unknown = job.pf.dp is None and job.pf.dp_size != 1
        dispatch = "sequential" if unknown or job.retry else self.dispatch
        pf_task = asyncio.ensure_future(prefill())
        decoding = False  # the decode's first token came: its KV is in, or recomputed
        try:
            if dispatch == "sequential":
                kv = await pf_task
            else:
                kv = self.early_params(job)
            t1 = time.perf_counter()
            async for ev in _unpaired(_until_failed(self._decode(http, job, kv), pf_task), job):
                decoding |= isinstance(ev, Done) or bool(ev.token_ids)
                if isinstance(ev, Done):
                    if not pf_task.done():  # its answer may trail the decode's last token
                        await asyncio.wait([pf_task], timeout=PREFILL_STATS_S)
                    ev.stats.update(
                        {
                            "dispatch": dispatch,
                            "prefill_s": took[0] if took else None,
                            "ttft_s": ev.stats["first"] - t1
                            if ev.stats.get("first") is not None
                            else None,
                        }
                    )
                    ev.stats.pop("first", None)
                    if held:
                        ev.stats["prefill_reused_tokens"] = held[0]
                yield ev
        finally:
            if decoding and not pf_task.done():  # its work is done: let its answer come
                keep(self._trailing, pf_task, "a prefill's answer after its decode finished")
            else:
                if not pf_task.done():  # the client left or the decode failed: end it
                    pf_task.cancel()
                await asyncio.gather(pf_task, return_exceptions=True)

    async def _decode(
        self, http: Http, job: Attempt, kv: dict[str, Any]
    ) -> AsyncIterator[Tokens | Done]:
        """The decode's leg: its stream as ``Tokens``, then ``Done``."""
        ask, dc = job.ask, job.dc
        payload: dict[str, Any] = {
            **self._sampling(job),
            "max_tokens": ask.max_tokens,
            "stream": True,
            "ignore_eos": ask.ignore_eos,
            "return_token_ids": True,
            "kv_transfer_params": kv,
        }
        chat = ask.messages is not None
        if ask.logprobs is not None:
            payload.update(
                {"logprobs": True, "top_logprobs": ask.logprobs}
                if chat
                else {"logprobs": ask.logprobs}
            )
            payload["return_tokens_as_token_ids"] = True
        if chat:
            payload["stream_options"] = {"include_usage": True}
        url = f"{dc.url}{_path(job)}"
        prompt_tokens: int | None = None
        finish: str | None = None
        first: float | None = None
        try:
            async with http.session.post(url, **http.signed(url, payload, rank(dc.dp))) as r:
                if r.status != 200:
                    raise AttemptFailed.from_status(
                        r.status, f"decode {dc.url}: {message(await json_or_text(r))}"
                    )
                async for ev in sse_events(r):
                    if "error" in ev:
                        raise AttemptFailed(502, f"decode {dc.url}: {message(ev)}")
                    usage = ev.get("usage")
                    if chat and isinstance(usage, dict) and "prompt_tokens" in usage:
                        prompt_tokens = int(usage["prompt_tokens"])
                    for ch in ev.get("choices") or []:
                        ids = [int(t) for t in ch.get("token_ids") or []]
                        if ids and first is None:
                            first = time.perf_counter()
                        if chat:
                            text = (ch.get("delta") or {}).get("content") or ""
                            lps = _chat_logprobs(ch.get("logprobs"))
                        else:
                            text, lps = ch.get("text") or "", _logprobs(ch.get("logprobs"))
                        yield Tokens(ids, lps, text)
                        finish = ch.get("finish_reason") or finish
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AttemptFailed(502, f"decode {dc.url}: {type(e).__name__}: {e}") from None
        if finish is None:
            raise AttemptFailed(502, f"decode {dc.url} ended the stream without a finish reason")
        yield Done(
            finish,
            {"first": first}
            if prompt_tokens is None
            else {"first": first, "prompt_tokens": prompt_tokens},
        )


def data_parallel_size(metrics: str) -> int:
    """A vLLM server's data-parallel ranks as its ``/metrics`` shows them: one ``engine``
    label per engine core (vLLM's stats are on by default; with ``--disable-log-stats``
    there are none, and the server counts as one rank that vLLM balances itself)."""
    return len(set(_ENGINE.findall(metrics))) or 1


def rank(dp: int | None) -> dict[str, str]:
    """The header that sends a request to one data-parallel rank of a vLLM server (its
    engine core; else vLLM's own balancer picks one)."""
    return {} if dp is None else {"X-data-parallel-rank": str(dp)}


async def _until_failed(
    events: AsyncIterator[Tokens | Done], pf_task: asyncio.Future[Any]
) -> AsyncIterator[Tokens | Done]:
    """The decode's events, raced against its prefill until the first one: a prefill that
    fails (or times out) first raises its ``AttemptFailed`` at once, instead of leaving the
    decode waiting for KV that will not come until its own bootstrap deadline. A decode that
    fails before its first token because its prefill did reports the prefill's failure (the
    cause). After the first token the KV is in (or was recomputed): the prefill's answer no
    longer matters."""
    it = events.__aiter__()
    watching = True
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            if watching and not pf_task.done():
                await asyncio.wait([nxt, pf_task], return_when=asyncio.FIRST_COMPLETED)
            if watching and pf_task.done() and not nxt.done() and failed(pf_task):
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
                raise pf_task.exception()  # type: ignore[misc]
            try:
                ev = await nxt
            except StopAsyncIteration:
                return
            except AttemptFailed:
                if watching:
                    if not pf_task.done():
                        await asyncio.wait([pf_task], timeout=PREFILL_CAUSE_S)
                    if pf_task.done() and failed(pf_task):
                        raise pf_task.exception() from None  # type: ignore[misc]
                raise
            watching = False
            yield ev
    finally:
        await it.aclose()  # type: ignore[attr-defined]


async def _unpaired(
    events: AsyncIterator[Tokens | Done], job: Attempt
) -> AsyncIterator[Tokens | Done]:
    """The decode's events; a server error before the first token, where the prefill
    refused this decode's handshake (its bootstrap registration says why), becomes a 409
    naming both sides' values instead of vLLM's bare 500 (``kv_load_failure_policy: fail``:
    vLLM passes no reason on)."""
    first = True
    try:
        async for ev in events:
            first = False
            yield ev
    except AttemptFailed as e:
        why = await refusal(job.pf, job.dc) if first and e.status >= 500 else None
        if why:
            raise AttemptFailed(
                Unpaired.status,
                f"prefill {job.pf.url} (instance {job.pf.instance}) refused to pair with "
                f"decode {job.dc.url} ({job.dc.peer}): {why}",
                unpaired=True,
            ) from None
        raise


def _cached_tokens(body: Any) -> int | None:
    """An answer's ``usage.prompt_tokens_details.cached_tokens`` (None: not there)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _path(job: Attempt) -> str:
    """Which of a worker's endpoints serves the attempt: chat when it carries images."""
    return "/v1/completions" if job.ask.messages is None else "/v1/chat/completions"


def _token_id(s: str) -> int:
    """``token_id:123`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    return int(s.rpartition(":")[2])


def _logprobs(lp: Any) -> list[dict[str, Any]]:
    """vLLM's completion logprobs -> the router's own: per token its id, logprob and top."""
    if not isinstance(lp, dict) or not lp.get("tokens"):
        return []
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [
        {
            "token_id": _token_id(t),
            "logprob": float(v if v is not None else 0.0),
            "top": {_token_id(k): float(x) for k, x in (top or {}).items()},
        }
        for t, v, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops)
    ]


def _chat_logprobs(lp: Any) -> list[dict[str, Any]]:
    """vLLM's chat logprobs (``content``: per token, its top list) -> the router's own."""
    if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
        return []
    return [
        {
            "token_id": _token_id(x["token"]),
            "logprob": float(x.get("logprob") or 0.0),
            "top": {
                _token_id(t["token"]): float(t.get("logprob") or 0.0)
                for t in x.get("top_logprobs") or []
            },
        }
        for x in lp["content"]
        if isinstance(x, dict) and "token" in x
    ]
