"""``pdxfer router``: an OpenAI-style ``/v1/completions`` front over prefill/decode pairs.

Per request the router picks one prefill and one decode (round robin, or least outstanding),
draws the room, and sends the prompt to both at once: the prefill computes and pushes KV, the
decode waits for it and generates. The decode's answer is returned (JSON or SSE). If either
side fails before a token went out, the other side is told to abort the room (so nothing
waits for its deadline) and the request is retried once on another pair.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .errors import BadRequest, ServingError, UpstreamError
from .http import error_response, metrics_text, read_json, serve

log = logging.getLogger("pdxfer.serving.router")
VOCAB = 257
MAX_SPEC_K = 8


@dataclass(slots=True)
class Prefill:
    url: str
    bootstrap: str
    instance: str = "default"
    outstanding: int = 0


@dataclass(slots=True)
class Decode:
    url: str
    outstanding: int = 0
    max_seq_len: int | None = None


def parse_prefill(spec: str) -> Prefill:
    """``URL,BOOTSTRAP[,INSTANCE]``, e.g. ``http://10.0.0.1:8100,10.0.0.1:8998``."""
    parts = spec.split(",")
    if len(parts) not in (2, 3) or not parts[0].startswith("http") or not parts[1]:
        raise ValueError(f"--prefill wants URL,BOOTSTRAP[,INSTANCE], got {spec!r}")
    return Prefill(parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else "default")


@dataclass(slots=True)
class _Attempt:
    pf: Prefill
    dc: Decode
    room: int = field(default_factory=lambda: secrets.randbits(63))


class _Failed(Exception):
    """A pair failed; ``client`` marks a 4xx that retrying cannot fix."""

    def __init__(self, status: int, body: Any, client: bool = False) -> None:
        super().__init__(str(body))
        self.status, self.body, self.client = status, body, client


class Router:
    def __init__(self, prefills: list[Prefill], decodes: list[Decode], policy: str = "round_robin",
                 timeout_s: float = 120.0) -> None:
        if not prefills or not decodes:
            raise ValueError("the router needs at least one prefill and one decode")
        if policy not in ("round_robin", "least_outstanding"):
            raise ValueError(f"policy must be round_robin or least_outstanding, got {policy!r}")
        self.prefills, self.decodes, self.policy = prefills, decodes, policy
        self.timeout_s = timeout_s
        self._rr = itertools.count()
        self.counters = collections.Counter[str]()
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=self.timeout_s, sock_connect=5.0))

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # -- pairing ------------------------------------------------------------------------------
    def pick(self, avoid: _Attempt | None) -> _Attempt:
        def choose(xs: list[Any], bad: Any) -> Any:
            cands = [x for x in xs if x is not bad] or xs
            if self.policy == "least_outstanding":
                return min(cands, key=lambda x: x.outstanding)
            return cands[next(self._rr) % len(cands)]

        return _Attempt(choose(self.prefills, avoid and avoid.pf),
                        choose(self.decodes, avoid and avoid.dc))

    # -- handlers -----------------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        out, ok = {}, True
        for w in [*self.prefills, *self.decodes]:
            try:
                async with self.session.get(f"{w.url}/health",
                                            timeout=aiohttp.ClientTimeout(total=5)) as r:
                    out[w.url] = "ok" if r.status == 200 else f"http {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                out[w.url] = f"down: {type(e).__name__}"
            ok &= out[w.url] == "ok"
        return web.json_response({"status": "ok" if ok else "degraded", "workers": out},
                                 status=200 if ok else 503)

    async def h_metrics(self, request: web.Request) -> web.Response:
        vals = dict(self.counters)
        vals["outstanding"] = sum(d.outstanding for d in self.decodes)
        return web.Response(text=metrics_text("pdxfer_router", vals))

    async def _max_seq_len(self, dc: Decode) -> int | None:
        if dc.max_seq_len is None:
            assert self.session is not None
            try:
                async with self.session.get(f"{dc.url}/health") as r:
                    dc.max_seq_len = int((await r.json())["max_seq_len"])
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                return None
        return dc.max_seq_len

    async def _parse(self, request: web.Request) -> dict[str, Any]:
        body = await read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = encode(prompt)
        elif isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids in [0, 257)")
        if not ids:
            raise BadRequest("'prompt' is empty")
        mt = body.get("max_tokens", 16)
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise BadRequest("'max_tokens' must be a positive integer")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean")
        k = body.get("speculative_k", 0)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPEC_K:
            raise BadRequest(f"'speculative_k' must be an integer in [0, {MAX_SPEC_K}]")
        limits = [m for m in [await self._max_seq_len(d) for d in self.decodes] if m]
        if limits and len(ids) + mt + k > min(limits):
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({mt}) + speculative_k "
                             f"({k}) exceeds the context of {min(limits)} tokens")
        return {"ids": ids, "max_tokens": mt, "stream": stream, "spec_k": k,
                "model": str(body.get("model", "pdxfer-toy"))}

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        try:
            q = await self._parse(request)
        except ServingError as e:
            self.counters["bad_requests"] += 1
            return error_response(e)
        last: _Attempt | None = None
        err: _Failed | None = None
        for attempt in range(2):
            a = self.pick(last)
            last = a
            if attempt:
                self.counters["retries"] += 1
                log.info("retrying on %s + %s after: %s", a.pf.url, a.dc.url, err)
            try:
                return await self._run(request, q, a, t0)
            except _Failed as e:
                err = e
                if e.client:
                    break
        assert err is not None
        self.counters["failures"] += 1
        if err.client:
            return web.json_response(err.body, status=err.status)
        return error_response(UpstreamError(f"request failed on two pairs; last: {err}"))

    # -- one attempt --------------------------------------------------------------------------
    async def _post(self, url: str, payload: dict[str, Any]) -> tuple[int, Any]:
        assert self.session is not None
        try:
            async with self.session.post(url, json=payload) as r:
                try:
                    return r.status, await r.json()
                except (aiohttp.ContentTypeError, json.JSONDecodeError):
                    return r.status, {"error": {"message": await r.text()}}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 599, {"error": {"message": f"{url}: {type(e).__name__}: {e}"}}

    async def _abort(self, url: str, room: int, why: str) -> None:
        await self._post(f"{url}/abort", {"room": room, "reason": why})

    async def _run(self, request: web.Request, q: dict[str, Any], a: _Attempt,
                   t0: float) -> web.StreamResponse:
        assert self.session is not None
        a.pf.outstanding += 1
        a.dc.outstanding += 1
        pf_task = asyncio.ensure_future(self._post(
            f"{a.pf.url}/generate", {"room": a.room, "prompt_ids": q["ids"]}))
        dc_payload = {"room": a.room, "bootstrap": a.pf.bootstrap, "instance": a.pf.instance,
                      "prompt_ids": q["ids"], "max_tokens": q["max_tokens"],
                      "stream": q["stream"], "spec_k": q["spec_k"]}
        dc_resp: aiohttp.ClientResponse | None = None
        try:
            dc_task = asyncio.ensure_future(self.session.post(f"{a.dc.url}/generate",
                                                              json=dc_payload))
            done, _ = await asyncio.wait({pf_task, dc_task}, return_when=asyncio.FIRST_COMPLETED)
            if pf_task in done and dc_task not in done:
                status, body = pf_task.result()
                if status != 200:  # the decode would wait for KV that never comes
                    await self._abort(a.dc.url, a.room, f"prefill failed: {_msg(body)}")
            try:
                dc_resp = await dc_task
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                await self._abort(a.pf.url, a.room, "decode unreachable")
                raise _Failed(599, {"error": {"message": f"decode {a.dc.url}: {e}"}}) from None
            if dc_resp.status != 200:
                body = await _json_or_text(dc_resp)
                await self._abort(a.pf.url, a.room, f"decode failed: {_msg(body)}")
                if pf_task.done() and pf_task.result()[0] != 200:
                    body = {"error": {"message": f"prefill: {_msg(pf_task.result()[1])}; "
                                                 f"decode: {_msg(body)}"}}
                raise _Failed(dc_resp.status, body, client=400 <= dc_resp.status < 500
                              and dc_resp.status != 409)
            if not q["stream"]:
                res = await dc_resp.json()
                self.counters["success"] += 1
                return web.json_response(self._completion(q, a, res, t0))
            return await self._relay(request, q, a, dc_resp, t0)
        finally:
            if dc_resp is not None:
                dc_resp.release()
            a.pf.outstanding -= 1
            a.dc.outstanding -= 1
            if not pf_task.done():
                pf_task.add_done_callback(lambda t: t.exception())

    def _completion(self, q: dict[str, Any], a: _Attempt, res: dict[str, Any],
                    t0: float) -> dict[str, Any]:
        ids = res["token_ids"]
        return {
            "id": f"cmpl-{a.room:x}", "object": "text_completion", "created": int(time.time()),
            "model": q["model"],
            "choices": [{"index": 0, "text": detok(ids), "token_ids": ids,
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(q["ids"]), "completion_tokens": len(ids),
                      "total_tokens": len(q["ids"]) + len(ids)},
            "pdxfer": {"room": a.room, "prefill": a.pf.url, "decode": a.dc.url,
                       "restored_tokens": res.get("restored_tokens", 0),
                       "bytes": res.get("bytes", 0), "decode_ttft_s": res.get("ttft_s"),
                       "seconds": time.perf_counter() - t0,
                       **({"accept_lengths": res["accept_lengths"],
                           "mean_accept_length": res["mean_accept_length"]}
                          if "accept_lengths" in res else {})},
        }

    async def _relay(self, request: web.Request, q: dict[str, Any], a: _Attempt,
                     dc_resp: aiohttp.ClientResponse, t0: float) -> web.StreamResponse:
        """Decode SSE -> OpenAI SSE. The decode answers 200 only with the first token ready,
        so from here on a failure is reported in-band and not retried."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"cmpl-{a.room:x}", int(time.time())
        ok = False
        try:
            async for raw in dc_resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if "token_ids" in ev:
                    chunk = {"id": cid, "object": "text_completion", "created": created,
                             "model": q["model"],
                             "choices": [{"index": 0, "text": detok(ev["token_ids"]),
                                          "token_ids": ev["token_ids"], "finish_reason": None}]}
                elif ev.get("done"):
                    ok = True
                    chunk = self._completion(q, a, ev, t0)
                    chunk["choices"][0]["text"] = ""
                    chunk["choices"][0]["token_ids"] = []
                else:
                    chunk = {"error": ev.get("error", ev)}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            await resp.write(f"data: {json.dumps({'error': {'message': str(e)}})}\n\n".encode())
        if ok:
            self.counters["success"] += 1
        else:
            self.counters["stream_errors"] += 1
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _msg(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


async def _json_or_text(r: aiohttp.ClientResponse) -> Any:
    try:
        return await r.json()
    except (aiohttp.ContentTypeError, json.JSONDecodeError):
        return {"error": {"message": await r.text()}}


def encode(text: str) -> list[int]:
    """Same byte tokenizer as ``model.encode`` (kept here so the router never imports torch)."""
    return list(text.encode("utf-8"))


def detok(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def run(a: argparse.Namespace) -> int:
    router = Router([parse_prefill(s) for s in a.prefill],
                    [Decode(u.rstrip("/")) for u in a.decode], a.policy, a.timeout)
    log.info("router: %d prefill, %d decode, %s", len(a.prefill), len(a.decode), a.policy)
    return serve(router.app(), a.host, a.port)
