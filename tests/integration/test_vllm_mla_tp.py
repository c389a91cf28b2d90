"""MLA over TP on real vLLM: a DeepSeek-V2-shaped model (``hf_families``, bf16) served by a
``vllm serve`` prefill at TP 2 feeding a decode at TP 1, then a TP 1 prefill feeding a TP 2
decode, through pdxfer's router with the official ``openai`` client.

The latent is one replicated pool: each decode rank gets it once, from one prefill rank
(counted in the connectors' stats files, one per rank), and every byte it loaded equals the
prefill's (``integrity: full``). Tokens are not compared with colocated vLLM here: TP splits
the model's matmuls, so in bf16 a TP 2 server rounds differently from a TP 1 one and
colocated vLLM at one TP size is no reference for a pair mixing two (at TP 1,
``test_vllm_families`` judges the family's answers against colocated's computation of the
decode's step, where vLLM can compute it colocated).
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

pytestmark = [pytest.mark.timeout(1200), pytest.mark.vllm_tp, pytest.mark.engine]

F = FAMILIES["deepseek_v2"]
BS = 32
LATENT_TOKEN = 2 * (512 + 64) * 2
"""Bytes of one token's latent over the model's two layers (bf16)."""


def _stats(path: Path, tp: int) -> list[dict[str, Any]]:
    """Each rank's stats file (``.tp<rank>`` appended at TP > 1)."""
    return [read_stats(path) if tp == 1 else read_stats(f"{path}.tp{r}") for r in range(tp)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family(tmp_path_factory.mktemp("mla_model"), F.name)


@contextlib.contextmanager
def pair(tmp: Path, model: Path, p_tp: int, d_tp: int) -> Iterator[tuple[str, Path, Path]]:
    """(router URL, prefill stats, decode stats) of a pair at these TP sizes."""
    boot = BootstrapServer("127.0.0.1", 0).start()
    ps, ds = tmp / "p.json", tmp / "d.json"
    args = [*F.vllm_args, *F.exact_args, "--max-model-len", "4096"]

    def server(name: str, tp: int, role: str, extra: dict[str, Any]) -> VllmServer:
        return VllmServer(
            f"{name}-tp{tp}",
            model,
            tmp,
            dtype=F.dtype,
            block_size=BS,
            env=UNBOUND if tp > 1 else None,
            kv_cache_bytes=256 << 20,
            args=[*args, "--tensor-parallel-size", str(tp)],
            kv_transfer_config=kv_config(role, {"bootstrap": boot.address, **extra}),
        )

    servers = [
        server("prefill", p_tp, "kv_producer", {"instance": "p0", "stats_file": str(ps)}),
        server(
            "decode",
            d_tp,
            "kv_consumer",
            {"instance": "d0", "stats_file": str(ds), "integrity": "full"},
        ),
    ]
    router = None
    try:
        start_all(servers, timeout=600)
        router = Proc(
            "router",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--prefill",
                f"{servers[0].url},{boot.address},p0",
                "--decode",
                f"{servers[1].url},d0",
            ],
            timeout=300,
        )
        yield router.url, ps, ds
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        boot.stop()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_each_decode_rank_gets_the_latent_once_from_one_prefill_rank(
    tmp_path: Path, model: Path, p_tp: int, d_tp: int
) -> None:
    n = 5 * BS + 1
    p = [random.Random(7).randrange(300, 1000) for _ in range(n)]
    with pair(tmp_path, model, p_tp, d_tp) as (url, ps, ds):
        assert len(complete(url, p, timeout=600)) == MAX_TOKENS
        wait(
            "every decode rank's check",
            lambda: all(
                s.get("endpoint", {}).get("integrity_checks", 0) >= 1 for s in _stats(ds, d_tp)
            ),
            timeout=120,
        )
        wait(
            "the prefill's sends",
            lambda: all(s.get("in_flight_sends", 1) == 0 for s in _stats(ps, p_tp)),
            timeout=120,
        )
        d, pst = _stats(ds, d_tp), _stats(ps, p_tp)
    got = [int(s["net_bytes"]) for s in d]
    sent = [int(s.get("endpoint", {}).get("transport_bytes", 0)) for s in pst]
    assert all(s["endpoint"].get("integrity_mismatches", 0) == 0 for s in d), d
    # each decode rank: the prompt's latent (whole blocks), once
    assert all(
        -(-(n - 1) // BS) * BS * LATENT_TOKEN <= g <= -(-n // BS) * BS * LATENT_TOKEN for g in got
    ), got
    assert len(set(got)) == 1, got
    # from one prefill rank: what the prefill ranks sent is the decode ranks' sum
    assert sum(sent) == sum(got), (sent, got)
    assert sum(1 for s in sent if s) == 1, sent
