"""One completion request, parsed to answered: its choices (each prompt, ``n`` times) run
at once (``dispatch``); their text goes out as SSE chunks as it comes or whole at the end,
in OpenAI's shapes (``openai_api``). A failure before any text gets a proper HTTP status
(503 when every pair was full, never 502); what tells a client about the cache is dropped
unless the operator turned it on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
from typing import Any

from aiohttp import web

from ..errors import BadRequest, OutOfCapacity, ServingError, Unpaired, UpstreamError
from ..http import error_body, error_response, read_json
from . import openai_api as oa
from .backends import AttemptFailed, Backend, Decode, Prefill
from .dispatch import Dispatch
from .health import Health


class Completions:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` (by their ``parse``)."""

    def __init__(
        self,
        dispatch: Dispatch,
        health: Health,
        prefills: list[Prefill],
        decodes: list[Decode],
        backend: Backend,
        counters: collections.Counter[str],
        expose_cache_stats: bool,
    ) -> None:
        self.dispatch, self.health = dispatch, health
        self.prefills, self.decodes = prefills, decodes
        self.backend, self.counters = backend, counters
        self.expose_cache_stats = expose_cache_stats
        """Whether clients see how much of their prompt came from the decode's cache
        (``cached_tokens``, ``restored_tokens``, bytes): off by default, since a hit tells
        a client what another one asked (caches are per tenant either way)."""

    async def serve(self, request: web.Request, parse: Any) -> web.StreamResponse:
        """The answer to ``request``, its body read by ``parse`` into an ``Ask``."""
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
                *(self.dispatch.choice(ask, ids, idx, seed, t0, None) for idx, ids, seed in jobs)
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
            await self.health.refresh()
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
        if e.unpaired:
            return error_response(Unpaired(str(e)))
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
            asyncio.ensure_future(self.dispatch.choice(ask, ids, idx, seed, t0, on_delta))
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
                for t in pending & done:  # the choices done (not the getter)
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
