"""The vLLM router's start: how long it waits for a decode to answer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdxfer.cli import build_parser
from pdxfer.serving.router.app import make_backend
from pdxfer.serving.router.backends import Decode, Http
from pdxfer.serving.router.settings import RouterSettings
from pdxfer.serving.router.vllm import SETUP_TIMEOUT_S, VllmBackend


def _backend(*more: str) -> VllmBackend:
    a = build_parser().parse_args(
        [
            "router",
            "--engine",
            "vllm",
            "--prefill",
            "http://127.0.0.1:1,127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
            *more,
        ]
    )
    b = make_backend(RouterSettings.from_args(a))
    assert isinstance(b, VllmBackend)
    return b


def test_the_vllm_router_waits_for_a_decode_at_start_as_long_as_a_request_may_take() -> None:
    # a decode stalled for longer than the fixed wait (a loaded host) but within the
    # router's own per-request deadline must not stop the router from starting
    assert _backend("--timeout", "600").setup_timeout_s == 600
    assert _backend("--timeout", "5").setup_timeout_s == SETUP_TIMEOUT_S
    assert _backend().setup_timeout_s == SETUP_TIMEOUT_S


def test_a_router_start_with_no_decode_answering_fails_at_its_deadline_naming_it() -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(RuntimeError, match=r"within 0 s: \['http://127.0.0.1:1'\]"):
                await VllmBackend(setup_timeout_s=0.2).setup(
                    Http(s, None), [Decode("http://127.0.0.1:1")]
                )  # nothing listens there

    asyncio.run(run())
