"""The router holds requests at its door while every prefill's queue is full: a prefill never
gets more pending prompt tokens than its limit (but an idle one takes any request), waiting
requests go in arrival order as first tokens free room, and past the waiting bound or the
deadline a request is refused with 503, never lost or left hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdxfer.serving.router import openai_api as oa
from pdxfer.serving.router.app import Router
from pdxfer.serving.router.backends import (
    Attempt,
    AttemptFailed,
    Decode,
    Done,
    Prefill,
    Tokens,
    ToyBackend,
)
from pdxfer.serving.router.door import Door

P0, D0 = "http://p0:1", "http://d0:1"


class _Gated(ToyBackend):
    """Each attempt yields its first token when its prompt's gate opens, then finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[int] = []

    async def stream(self, http: Any, job: Attempt) -> AsyncIterator[Tokens | Done]:
        n = len(job.ids)
        self.started.append(n)
        await self.gates.setdefault(n, asyncio.Event()).wait()
        yield Tokens([65])
        yield Done("length")


def _router(limit: int, max_held: int = 8, timeout_s: float = 30.0) -> tuple[Router, _Gated]:
    be = _Gated()
    r = Router(
        [Prefill(P0, "127.0.0.1:1")],
        [Decode(D0, page_size=16)],
        timeout_s=timeout_s,
        api_keys={},
        backend=be,
        door=Door(limit, max_held),
    )
    return r, be


def _choice(r: Router, n: int) -> asyncio.Future[oa.Choice]:
    ids = list(range(1000, 1000 + n))
    ask = oa.Ask(chat=False, prompts=[ids], prompt_texts=[""], max_tokens=1)
    return asyncio.ensure_future(r.dispatch.choice(ask, ids, 0, 0, 0.0, None))


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_full_prefill_gets_no_more_until_a_first_token_frees_room_in_arrival_order() -> None:
    async def main() -> None:
        r, be = _router(limit=100)
        a = _choice(r, 60)
        await _settle()
        b, c = _choice(r, 50), _choice(r, 51)  # 60 + 50 > 100: both wait
        await _settle()
        assert be.started == [60]
        assert (r.door.waiting, r.prefills[0].pending) == (2, 60)
        be.gates.setdefault(60, asyncio.Event()).set()
        await a
        await _settle()
        # room for the first in line (50), and then not for the second (50 + 51 > 100)
        assert be.started == [60, 50]
        assert (r.door.waiting, r.prefills[0].pending) == (1, 50)
        be.gates.setdefault(50, asyncio.Event()).set()
        be.gates.setdefault(51, asyncio.Event()).set()
        await asyncio.gather(b, c)
        assert be.started == [60, 50, 51]
        assert (r.door.waiting, r.door.held, r.door.refused) == (0, 2, 0)
        assert r.prefills[0].pending == 0

    asyncio.run(main())


def test_an_idle_prefill_takes_a_prompt_longer_than_the_limit() -> None:
    async def main() -> None:
        r, be = _router(limit=100)
        be.gates[500] = asyncio.Event()
        be.gates[500].set()
        c = await _choice(r, 500)
        assert c.token_ids == [65]
        assert r.door.held == 0

    asyncio.run(main())


def test_past_the_waiting_bound_a_request_is_refused_at_once_with_503() -> None:
    async def main() -> None:
        r, be = _router(limit=100, max_held=1)
        a = _choice(r, 90)
        await _settle()
        b = _choice(r, 90)
        await _settle()
        with pytest.raises(AttemptFailed) as e:
            await _choice(r, 90)
        assert e.value.status == 503 and "retry later" in str(e.value)
        assert r.door.refused == 1
        for g in (90,):
            be.gates.setdefault(g, asyncio.Event()).set()
        await asyncio.gather(a, b)
        assert be.started == [90, 90]

    asyncio.run(main())


def test_a_request_that_finds_no_room_by_its_deadline_gets_503_and_leaves_the_queue() -> None:
    async def main() -> None:
        r, be = _router(limit=100, timeout_s=0.2)
        a = _choice(r, 90)
        await _settle()
        with pytest.raises(AttemptFailed) as e:
            await _choice(r, 90)  # the first never sends its first token meanwhile
        assert e.value.status == 503 and "no prefill had room" in str(e.value)
        assert (r.door.waiting, r.door.refused) == (0, 1)
        be.gates.setdefault(90, asyncio.Event()).set()
        await a
        assert be.started == [90]

    asyncio.run(main())


def test_a_limit_of_zero_holds_nothing() -> None:
    async def main() -> None:
        r, be = _router(limit=0)
        cs = [_choice(r, 1000) for _ in range(3)]
        await _settle()
        assert be.started == [1000, 1000, 1000]
        be.gates[1000].set()
        await asyncio.gather(*cs)
        assert r.door.held == 0

    asyncio.run(main())
