"""Mamba2 state across TP sizes on real vLLM: a Nemotron-H-shaped model (``hf_families``,
float32) served by a ``vllm serve`` prefill at TP 2 feeding a decode at TP 1, then a TP 1
prefill feeding a TP 2 decode, through pdxfer's router with the official ``openai`` client.

Each rank holds its share of the state: the conv state's x by heads and its one B/C group
replicated, the SSM state by heads. Each decode rank takes its share from the prefill ranks
that hold it (``plan/pieces.py``), so every answer equals vLLM's own at TP 1 token for token
(float32: TP's split matmuls round ~10^4 times below any logit gap), and every byte each
decode rank loaded equals what its senders wrote (``integrity: full``).

One pair at a time (a TP 2 server takes minutes to start here), each started once for its
test. The reference is the pair's TP 1 server asked directly, before any transfer: a
request without ``kv_transfer_params`` is computed there as colocated vLLM computes it, and
with prefix caching off (``hf_families``) nothing of it is reused by the transfers after.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.servers import VllmServer, kv_config, read_stats, start_all
from tests.harness.hf_families import FAMILIES, build_family

from .vllm_helpers import MAX_TOKENS, UNBOUND, complete, wait

pytestmark = [pytest.mark.timeout(1800), pytest.mark.vllm_tp, pytest.mark.engine]

F = FAMILIES["nemotron_h"]
BS = 160
"""vLLM's attention block for this shape at TP 1 and 2 (it raises a smaller ``--block-size``
until an attention page holds a Mamba page)."""
LENGTHS = (7, BS + 1, 2 * BS + 97)
"""Prompts below one block, one block and a token, and several blocks."""
TIMEOUTS = {"bootstrap_timeout_s": 300.0, "transfer_timeout_s": 300.0, "heartbeat_s": 150.0}
"""Every pdxfer deadline only ends a hang on a loaded machine (``test_vllm_tp`` says why)."""
STATE = {1: (640 * 3 + 8 * 64 * 64) * 4, 2: (384 * 3 + 4 * 64 * 64) * 4}
"""One request's state on one decode rank at TP 1 and 2 (its one Mamba layer): the conv
state (x 512 + B 64 + C 64 channels x 3 rows at TP 1; x 256 and the one B/C group, which
every rank holds, at TP 2) and the SSM state (8 heads x 64 x 64, or 4 heads), float32; the
page's padding is not state and never moves between different TP sizes."""
TOKEN = 1024
"""Attention KV bytes of one token over every rank: K and V of 2 heads x 64, float32."""


def _stats(path: Path, tp: int) -> list[dict[str, Any]]:
    """Each rank's stats file (``.tp<rank>`` appended at TP > 1)."""
    return [read_stats(path) if tp == 1 else read_stats(f"{path}.tp{r}") for r in range(tp)]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(300, 1000) for _ in range(n)] for n in LENGTHS]


def _server(
    tmp: Path, model: Path, name: str, tp: int, kv: str | None = None, **extra: Any
) -> VllmServer:
    return VllmServer(
        f"{name}-tp{tp}",
        model,
        tmp,
        dtype=F.dtype,
        block_size=32,
        env=UNBOUND if tp > 1 else None,
        args=[*F.vllm_args, "--max-model-len", "4096", "--tensor-parallel-size", str(tp)],
        kv_transfer_config=kv_config(kv, extra) if kv else None,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("state_tp")
    return tmp, build_family(tmp / "model", F.name)


@contextlib.contextmanager
def pair(
    base: tuple[Path, Path], p_tp: int, d_tp: int
) -> Iterator[tuple[str, VllmServer, Path, Path]]:
    """(router URL, the pair's TP 1 server, prefill stats, decode stats) of a pair at these
    TP sizes."""
    tmp, model = base
    boot = BootstrapServer("127.0.0.1", 0).start()
    ps, ds = tmp / f"p{p_tp}{d_tp}.json", tmp / f"d{p_tp}{d_tp}.json"
    servers = [
        _server(
            tmp, model, "prefill", p_tp, "kv_producer",
            bootstrap=boot.address, instance="p0", stats_file=str(ps), **TIMEOUTS,
        ),
        _server(
            tmp, model, "decode", d_tp, "kv_consumer",
            bootstrap=boot.address, instance="d0", stats_file=str(ds), integrity="full",
            **TIMEOUTS,
        ),
    ]  # fmt: skip
    router = None
    try:
        start_all(servers, timeout=900)
        router = Proc(
            "router",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--timeout",
                "400",
                "--prefill",
                f"{servers[0].url},{boot.address},p0",
                "--decode",
                f"{servers[1].url},d0",
            ],
            timeout=460,
        )
        yield router.url, servers[0] if p_tp == 1 else servers[1], ps, ds
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        boot.stop()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_state_moves_across_tp_sizes_token_exact_with_colocated(
    base: tuple[Path, Path], p_tp: int, d_tp: int
) -> None:
    prompts = _prompts()
    with pair(base, p_tp, d_tp) as (url, tp1, ps, ds):
        want = [complete(tp1.url, p, timeout=600) for p in prompts]  # colocated, at TP 1
        got = [complete(url, p, timeout=600) for p in prompts]
        wait(
            "every decode rank's checks",
            lambda: all(
                s.get("endpoint", {}).get("integrity_checks", 0) >= len(prompts)
                for s in _stats(ds, d_tp)
            ),
            timeout=240,
        )
        wait(
            "the prefill's sends",
            lambda: all(
                s.get("sends", 0) == len(prompts) and s.get("in_flight_sends", 1) == 0
                for s in _stats(ps, p_tp)
            ),
            timeout=240,
        )
        d, p = _stats(ds, d_tp), _stats(ps, p_tp)
    assert all(len(g) == MAX_TOKENS for g in got), got
    assert got == want
    assert all(s["loads"] == len(prompts) and s["load_failures"] == 0 for s in d), d
    assert all(s["endpoint"].get("integrity_mismatches", 0) == 0 for s in d), d
    sent = [int(s.get("endpoint", {}).get("transport_bytes", 0)) for s in p]
    loaded = [int(s["net_bytes"]) for s in d]
    assert sum(sent) == sum(loaded), (sent, loaded)
    assert all(sent), sent  # every prefill rank wrote its share
    # the prompt's attention blocks (the prefill computes all but the last token) and each
    # decode rank's share of the state, each byte once, never a page's padding
    attn = sum(-(-(n - 1) // BS) for n in LENGTHS) * BS * TOKEN
    assert sum(loaded) == attn + len(prompts) * d_tp * STATE[d_tp], loaded
    assert len(set(loaded)) == 1, loaded  # each decode rank loaded its half alike
