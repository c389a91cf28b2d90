"""Real vLLM at different TP sizes on the two sides: a ``vllm serve`` prefill at TP 2 (two
worker processes, each holding one of the model's two KV heads) feeds a decode at TP 1, through
pdxfer's router with the official ``openai`` client. Each prefill rank sends its own head
slice into the decode's whole-head blocks; every output equals a colocated vLLM at TP 1 token
for token, and a repeated prefix is restored on the decode from L2, so only the suffix comes
from the two prefill ranks.

One cluster for the module (a TP 2 server takes a minute or more to start here).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.testing.hf_model import SHAPES, build_model
from pdxfer.testing.vllm_procs import VllmServer, kv_config, read_stats, start_all

from .vllm_helpers import chat_stream, complete, ref_chat, text, wait

pytestmark = pytest.mark.timeout(900)

BS = 32
DECODE, PREFILL = "vllm-tp-d0", "vllm-tp-p0"
S = SHAPES["small"]
BLOCK_BYTES = S.layers * S.kv_heads * BS * 2 * S.head_size * 4  # one block, all layers, fp32


@dataclass
class Cluster:
    prefill: VllmServer
    decode: VllmServer
    ref: VllmServer
    boot: BootstrapServer
    p_stats: Path
    d_stats: Path

    def p(self) -> list[dict[str, Any]]:
        """Each prefill rank's counters (``stats_file`` + ``.tp<rank>`` at TP > 1)."""
        return [read_stats(f"{self.p_stats}.tp{r}") for r in range(2)]

    def p_bytes(self) -> list[int]:
        return [s.get("endpoint", {}).get("transport_bytes", 0) for s in self.p()]

    def d(self) -> dict[str, Any]:
        return read_stats(self.d_stats)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm_tp")
    model = build_model(tmp / "model", "small")
    assert S.kv_heads == 2
    boot = BootstrapServer("127.0.0.1", 0).start()
    # deadlines far past any wait a slow machine causes: this test is about placement
    timeouts = {"bootstrap_timeout_s": 180.0, "transfer_timeout_s": 180.0}
    p_stats, d_stats = tmp / "p.json", tmp / "d.json"
    servers = [
        VllmServer("prefill-tp2", model, tmp, args=["--tensor-parallel-size", "2"],
                   env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                   kv_transfer_config=kv_config("kv_producer", {
                       "bootstrap": boot.address, "instance": PREFILL,
                       "stats_file": str(p_stats), **timeouts})),
        VllmServer("decode-tp1", model, tmp, args=["--no-enable-prefix-caching"],
                   kv_transfer_config=kv_config("kv_consumer", {
                       "instance": DECODE, "stats_file": str(d_stats), "l2_pages": 128,
                       "l3": "off", **timeouts})),
        VllmServer("colocated", model, tmp),
    ]
    try:
        start_all(servers)
        yield Cluster(*servers, boot, p_stats, d_stats)
    finally:
        for s in servers:
            s.stop()
        boot.stop()


@pytest.fixture(scope="module")
def front_door(cluster: Cluster) -> Iterator[str]:
    router = Proc("router", ["router", "--engine", "vllm", "--port", "0",
                             "--prefill", f"{cluster.prefill.url},{cluster.boot.address},{PREFILL}",
                             "--decode", f"{cluster.decode.url},{DECODE}"], timeout=180)
    try:
        yield router.url
    finally:
        router.stop()


def test_a_tp2_prefill_feeds_a_tp1_decode_token_exact(cluster: Cluster, front_door: str
                                                      ) -> None:
    prompts = ["Hello", "The river", *[text(13 * i, 60 + 110 * i) for i in range(4)]]
    chats = [f"Tell me about {text(5 * i, 4)}." for i in range(2)]
    want = {p: complete(cluster.ref.url, p) for p in prompts}
    want_chat = {t: ref_chat(cluster.ref.url, t) for t in chats}
    before = cluster.p_bytes()
    with cf.ThreadPoolExecutor(3) as pool:
        got = dict(zip(prompts, pool.map(lambda p: complete(front_door, p), prompts)))
        got_chat = dict(zip(chats, pool.map(lambda t: chat_stream(front_door, t), chats)))
    for p in prompts:
        assert got[p] == want[p], f"prompt {p[:40]!r}: {got[p]} != colocated {want[p]}"
    for t in chats:
        assert got_chat[t] == want_chat[t], t
    n = len(prompts) + len(chats)
    wait("the decode's loads", lambda: cluster.d().get("loads", 0) == n, timeout=120)
    wait("both prefill ranks' sends", lambda: all(s.get("sends", 0) == n
                                                  and s.get("in_flight_sends", 1) == 0
                                                  for s in cluster.p()))
    d = cluster.d()
    assert d["load_failures"] == 0
    sent = [b - b0 for b, b0 in zip(cluster.p_bytes(), before)]
    # each rank holds one of the two KV heads: the same share of every block
    assert sent[0] == sent[1] > 0 and sum(sent) == d["net_bytes"], (sent, d["net_bytes"])


def test_a_repeated_prefix_comes_from_the_decodes_l2_and_the_suffix_from_both_ranks(
        cluster: Cluster, front_door: str) -> None:
    prefix = [(11 + 37 * i) % 700 + 300 for i in range(6 * BS)]
    a, b = prefix + list(range(400, 420)), prefix + list(range(500, 540))
    assert complete(front_door, a) == complete(cluster.ref.url, a)
    wait("the write-back", lambda: cluster.d().get("writebacks", 0) >= 1
         and cluster.d().get("tiers", {}).get("l2_writebacks", 0) >= 6)
    d0, sent0 = cluster.d(), cluster.p_bytes()
    assert complete(front_door, b) == complete(cluster.ref.url, b)
    wait("the prefill ranks' sends", lambda: all(x > y for x, y in zip(cluster.p_bytes(),
                                                                      sent0)))
    wait("the decode's load", lambda: cluster.d()["loads"] > d0["loads"])
    d1 = cluster.d()
    assert d1["restored_l2_pages"] - d0["restored_l2_pages"] == 6
    suffix = (-(-len(b) // BS) - 6) * BLOCK_BYTES
    sent = [x - y for x, y in zip(cluster.p_bytes(), sent0)]
    assert sent[0] == sent[1] == suffix // 2, (sent, suffix)
    assert d1["net_bytes"] - d0["net_bytes"] == suffix
