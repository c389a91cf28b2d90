"""The router's start: its flags reach its settings; the vLLM router waits for a decode,
and reads a server's data-parallel ranks."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdxfer import ConfigError
from pdxfer.cli import build_parser
from pdxfer.serving.router.app import make_backend
from pdxfer.serving.router.backends import Decode, Http
from pdxfer.serving.router.settings import DISPATCHES, POLICIES, RouterSettings
from pdxfer.serving.router.vllm import SETUP_TIMEOUT_S, VllmBackend, data_parallel_size, rank
from pdxfer.setting import dest_of, settings_of


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


def test_every_router_flag_reaches_its_setting() -> None:
    """``RouterSettings.from_args`` is derived from the fields: a flag whose name differs
    from its field's (``--timeout`` for ``timeout_s``) still lands, and every field is set
    from the parse, none left at a default the command line did not give."""
    a = build_parser().parse_args(
        [
            "router",
            "--prefill",
            "http://127.0.0.1:1,127.0.0.1:2",
            "--prefill",
            "http://127.0.0.1:4,127.0.0.1:5",
            "--decode",
            "http://127.0.0.1:3",
            "--timeout",
            "7",
            "--kv-stale-window",
            "9",
            "--policy",
            "least_outstanding",
            "--dispatch",
            "sequential",
            "--expose-cache-stats",
        ]
    )
    s = RouterSettings.from_args(a)
    assert s.timeout_s == 7 and s.kv_stale_window_s == 9
    assert s.policy == "least_outstanding" and s.dispatch == "sequential"
    assert s.prefill == ("http://127.0.0.1:1,127.0.0.1:2", "http://127.0.0.1:4,127.0.0.1:5")
    assert s.decode == ("http://127.0.0.1:3",) and s.expose_cache_stats
    missing = [n for n, f in settings_of(RouterSettings).items() if not hasattr(a, dest_of(f))]
    assert not missing, f"fields no router flag sets: {missing}"


def test_a_dispatch_or_policy_outside_its_list_is_refused() -> None:
    with pytest.raises(ConfigError, match="dispatch"):
        VllmBackend(dispatch="eventually")
    assert set(POLICIES) >= {"auto", "kv_aware"} and set(DISPATCHES) == {"concurrent", "sequential"}


def test_without_numba_the_router_refuses_to_start_naming_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """numba is the ``router`` extra, not a base dependency: a router started without it
    stops with a ``ConfigError`` (``pdxfer router: error: ...``) saying what to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # what an install without numba sees
    monkeypatch.delitem(sys.modules, "pdxfer.serving.router.jit", raising=False)
    with pytest.raises(ConfigError, match=r"pdxfer\[router\]"):
        importlib.import_module("pdxfer.serving.router.jit")


def test_a_vllm_servers_data_parallel_ranks_are_its_engine_labels_and_a_header_picks_one() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:cache_config_info{block_size="32",engine="1"} 1.0\n'
        'process_open_fds{engine="7"} 3.0\n'
    )
    assert data_parallel_size(text) == 2
    assert data_parallel_size("") == 1  # stats off: one rank as far as the router knows
    assert rank(1) == {"X-data-parallel-rank": "1"} and rank(None) == {}
