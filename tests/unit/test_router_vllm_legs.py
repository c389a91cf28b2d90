"""The vLLM backend's two legs over real HTTP, against workers that speak vLLM's
disaggregated protocol (aiohttp servers here: the router's side of the protocol is what is
tested; real vLLM workers are in ``tests/integration/test_vllm_*.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from pdxfer.serving.router import openai_api as oa
from pdxfer.serving.router import vllm as V
from pdxfer.serving.router.backends import (
    Attempt,
    AttemptFailed,
    Decode,
    Done,
    Http,
    Prefill,
    Tokens,
)


class Workers:
    """A prefill whose answer comes only ``lag_s`` after the decode's last token (a starved
    front end), and a decode that streams three tokens: what each leg's client saw."""

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.decoded = asyncio.Event()
        self.prefill_client_left: bool | None = None

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self.decoded.wait()
        await asyncio.sleep(self.lag_s)
        tr = request.transport
        self.prefill_client_left = tr is None or tr.is_closing()
        params = {**body["kv_transfer_params"], "do_remote_prefill": True}
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for i, t in enumerate((5, 6, 7)):
            finish = "length" if i == 2 else None
            ev = {"choices": [{"text": "", "token_ids": [t], "finish_reason": finish}]}
            await r.write(f"data: {json.dumps(ev)}\n\n".encode())
        await r.write(b"data: [DONE]\n\n")
        self.decoded.set()
        return r


async def _serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _attempt(
    prefill: Any, decode: Any, retry: bool = False, after: Any = None
) -> list[Tokens | Done]:
    """One attempt of the vLLM backend on a pair served by these two handlers, its events;
    ``after``: awaited before the workers stop (what must still reach them)."""
    pr, purl = await _serve(prefill)
    dr, durl = await _serve(decode)
    http = Http(None, None)
    http.open(20.0)
    backend = V.VllmBackend()
    backend.served = "m"
    ask = oa.parse_completion({"prompt": [1, 2, 3], "max_tokens": 3})
    pf = Prefill(purl, "127.0.0.1:1", dp_size=1)
    job = Attempt(ask, [1, 2, 3], 0, pf, Decode(durl), 42, retry=retry)
    try:
        events = [ev async for ev in backend.stream(http, job)]
        if after is not None:
            await after()
        return events
    finally:
        await http.close()
        await pr.cleanup()
        await dr.cleanup()


async def _one_request(w: Workers) -> list[Tokens | Done]:
    async def answered() -> None:
        for _ in range(200):  # the prefill's answer, now unwaited, still arrives
            if w.prefill_client_left is not None:
                break
            await asyncio.sleep(0.05)

    return await _attempt(w.prefill, w.decode, after=answered)


def test_a_prefill_answer_trailing_the_decode_is_never_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode's tokens are the answer; a prefill whose own answer comes after the
    router's wait for it is left to answer: cancelling it, vLLM would count a request whose
    KV went out as aborted instead of served."""
    monkeypatch.setattr(V, "PREFILL_STATS_S", 0.1)
    w = Workers(lag_s=0.5)
    events = asyncio.run(_one_request(w))
    assert [t for ev in events if isinstance(ev, Tokens) for t in ev.token_ids] == [5, 6, 7]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.stats["prefill_s"] is None  # not waited for past the bound
    assert w.prefill_client_left is False, "the router cancelled the prefill's request"


def test_a_prefill_answer_within_the_wait_gives_its_figures() -> None:
    w = Workers(lag_s=0.0)
    events = asyncio.run(_one_request(w))
    done = events[-1]
    assert isinstance(done, Done) and done.stats["prefill_s"] is not None
    assert w.prefill_client_left is False


def test_the_workers_session_holds_more_open_legs_than_any_pool_cap() -> None:
    """Each request holds two legs open at once (the decode waits for KV that the prefill's
    leg brings): a session that queued legs behind a connection cap would hold a decode's
    leg open while its prefill's waited for a connection, until one side's deadline.
    ``LEGS`` requests that each answer only once all are connected must all be answered."""
    LEGS = 160

    async def run() -> int:
        connected, everyone = 0, asyncio.Event()

        async def hold(request: web.Request) -> web.Response:
            nonlocal connected
            connected += 1
            if connected >= LEGS:
                everyone.set()
            await everyone.wait()
            return web.json_response({"ok": True})

        runner, url = await _serve(hold)
        http = Http(None, None)
        http.open(20.0)

        async def one() -> int:
            async with http.session.post(f"{url}/v1/completions", json={}) as r:
                return r.status

        try:
            done = await asyncio.wait_for(asyncio.gather(*[one() for _ in range(LEGS)]), 15)
            return sum(s == 200 for s in done)
        except asyncio.TimeoutError:
            return connected
        finally:
            everyone.set()  # the handlers end, so the server stops at once
            await http.close()
            await runner.cleanup()

    assert asyncio.run(run()) == LEGS


@pytest.mark.parametrize("retry", [False, True])
def test_a_retry_sends_the_decode_nothing_until_the_prefill_answered(retry: bool) -> None:
    """A first try dispatches both legs at once (the decode allocates while the prefill
    computes); a retry follows a failure, so its decode's leg waits for the prefill's answer:
    a prefill that fails again (it died: the retry found it gone) leaves the decode no
    request, hence no blocks held for KV that will never come."""

    async def run() -> tuple[int, int | None]:
        decode_legs = 0

        async def prefill(request: web.Request) -> web.Response:
            await request.json()
            await asyncio.sleep(0.3)  # long enough for a leg sent at once to arrive
            return web.json_response({"message": "engine dead"}, status=500)

        async def decode(request: web.Request) -> web.Response:
            nonlocal decode_legs
            decode_legs += 1
            await asyncio.sleep(5)
            return web.json_response({})

        status = None
        try:
            await _attempt(prefill, decode, retry=retry)
        except AttemptFailed as e:
            status = e.status
        return decode_legs, status

    legs, status = asyncio.run(run())
    assert status == 500
    assert legs == (0 if retry else 1)
