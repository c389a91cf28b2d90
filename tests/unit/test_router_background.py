"""A router call or leg that outlives its request (an abort, a prefill's trailing answer) is
held until it is done, then let go; its failure is logged, never raised into the loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from pdxfer.serving.router.backends import keep, later


async def _fails_after(ev: asyncio.Event) -> None:
    await ev.wait()
    raise RuntimeError("the prefill answered 500")


def test_a_kept_task_is_held_until_done_and_its_failure_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unhandled: list[dict[str, Any]] = []

    async def main() -> set[asyncio.Future[Any]]:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        held: set[asyncio.Future[Any]] = set()
        ev = asyncio.Event()
        task = asyncio.ensure_future(_fails_after(ev))
        keep(held, task, "a prefill's answer after its decode finished")
        later(held, _fails_after(ev))
        assert len(held) == 2  # referenced while pending
        ev.set()
        await asyncio.gather(*list(held), return_exceptions=True)
        await asyncio.sleep(0)
        return held

    with caplog.at_level(logging.INFO, logger="pdxfer.serving.router.backends"):
        held = asyncio.run(main())
    assert held == set()
    assert [r.getMessage() for r in caplog.records] == [
        "a prefill's answer after its decode finished: the prefill answered 500",
        "a best-effort call failed: the prefill answered 500",
    ]
    assert unhandled == []
