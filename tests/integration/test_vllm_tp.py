"""Real vLLM at different TP sizes on the two sides, through pdxfer's router with the
official ``openai`` client; every output equals a colocated vLLM at TP 1 token for token.

- A ``vllm serve`` prefill at TP 2 (two worker processes, each holding one of the model's two
  KV heads) feeds a decode at TP 1: each prefill rank sends its own head slice into the
  decode's whole-head blocks, and a repeated prefix is restored on the decode from L2, so
  only the suffix comes from the two prefill ranks.
- A prefill at TP 1 feeds a decode at TP 2: each decode rank asks for its own head, keeps
  its own L2 and restores its own half of a repeated prefix.

One pair at a time, each started once for its class (a TP 2 server takes a minute or more to
start here), and one colocated reference for the module.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.testing.hf_model import SHAPES, build_model
from pdxfer.testing.vllm_procs import VllmServer, kv_config, read_stats, start_all

from .vllm_helpers import chat_stream, complete, ref_chat, stacks_if_slow, text, wait

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_tp]

BS = 32
DECODE, PREFILL = "vllm-tp-d0", "vllm-tp-p0"
S = SHAPES["small"]
BLOCK_BYTES = S.layers * S.kv_heads * BS * 2 * S.head_size * 4  # one block, all layers, fp32


@dataclass
class Pair:
    name: str
    prefill: VllmServer
    decode: VllmServer
    p_stats: Path
    d_stats: Path
    prefill_tp: int
    decode_tp: int
    url: str = ""
    """pdxfer's router in front of the pair."""

    @staticmethod
    def _files(path: Path, tp: int) -> list[Path]:
        """A connector's ``stats_file`` per rank (``.tp<rank>`` appended at TP > 1)."""
        return [path] if tp == 1 else [Path(f"{path}.tp{r}") for r in range(tp)]

    def p(self) -> list[dict[str, Any]]:
        return [read_stats(f) for f in self._files(self.p_stats, self.prefill_tp)]

    def d(self) -> list[dict[str, Any]]:
        return [read_stats(f) for f in self._files(self.d_stats, self.decode_tp)]

    def p_bytes(self) -> list[int]:
        return [s.get("endpoint", {}).get("transport_bytes", 0) for s in self.p()]

    def d_sum(self, key: str) -> int:
        return sum(s.get(key, 0) for s in self.d())


@dataclass
class Base:
    """What both pairs share: the model, one bootstrap server, the colocated reference."""

    tmp: Path
    model: Path
    boot: BootstrapServer
    ref: VllmServer


STEP = 64
"""The prefill's tokens per step (``--max-num-batched-tokens``): two blocks."""

TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Two ranks on a two-core machine: unbound, one OpenMP thread each (with one thread per core
each, the ranks' spinning OpenMP threads starved the other processes' threads for seconds)."""


def _pair(name: str, tmp: Path, model: Path, boot: BootstrapServer, prefill_tp: int,
          decode_tp: int) -> Pair:
    # deadlines far past any wait a slow machine causes: these tests are about placement.
    # A live process starved of the CPU for longer than two heartbeats (a TP 2 server's
    # ranks beside other runs: load averages of 30-190 were seen) cannot be told from a
    # frozen one, and a hang verdict is what heartbeat_s is for (test_crash, test_net_faults
    # test it); so the heartbeat here allows 20 s without an answer.
    timeouts = {"bootstrap_timeout_s": 180.0, "transfer_timeout_s": 180.0,
                "heartbeat_s": 10.0}
    p_stats, d_stats = tmp / f"{name}-p.json", tmp / f"{name}-d.json"
    # the prefill streams by layer (send_by's default), STEP tokens a step: a prompt spans
    # several steps, each rank handing its heads of each layer over as the forward writes it
    prefill = VllmServer(f"{name}-prefill-tp{prefill_tp}", model, tmp,
                         args=["--tensor-parallel-size", str(prefill_tp),
                               "--max-num-batched-tokens", str(STEP)], env=TP2,
                         kv_transfer_config=kv_config("kv_producer", {
                             "bootstrap": boot.address, "instance": f"{name}-p",
                             "stats_file": str(p_stats), "send_by": "layer", **timeouts}))
    decode = VllmServer(f"{name}-decode-tp{decode_tp}", model, tmp, env=TP2,
                        args=["--no-enable-prefix-caching", "--tensor-parallel-size",
                              str(decode_tp)],
                        kv_transfer_config=kv_config("kv_consumer", {
                            "bootstrap": boot.address, "instance": f"{name}-d", "stats_file": str(d_stats),
                            "l2_pages": 128, "l3": "off", **timeouts},
                            kv_load_failure_policy="fail"))
    return Pair(name, prefill, decode, p_stats, d_stats, prefill_tp, decode_tp)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    tmp = tmp_path_factory.mktemp("vllm_tp")
    model = build_model(tmp / "model", "small")
    assert S.kv_heads == 2
    boot = BootstrapServer("127.0.0.1", 0).start()
    ref = VllmServer("colocated", model, tmp)
    try:
        start_all([ref])
        yield Base(tmp, model, boot, ref)
    finally:
        ref.stop()
        boot.stop()


@contextlib.contextmanager
def running(base: Base, name: str, prefill_tp: int, decode_tp: int) -> Iterator[Pair]:
    """A pair and pdxfer's router in front of it, for one class of tests."""
    pair = _pair(name, base.tmp, base.model, base.boot, prefill_tp, decode_tp)
    router = None
    try:
        start_all([pair.prefill, pair.decode])
        router = Proc("router", ["router", "--engine", "vllm", "--port", "0", "--prefill",
                                 f"{pair.prefill.url},{base.boot.address},{name}-p",
                                 "--decode", f"{pair.decode.url},{name}-d"], timeout=180)
        pair.url = router.url
        yield pair
    finally:
        if router is not None:
            router.stop()
        pair.prefill.stop()
        pair.decode.stop()


def token_exact(pair: Pair, ref: VllmServer, prompts: list[str], chats: list[str]) -> int:
    """Completions and streamed chats through the pair's router, concurrently, each equal to
    the colocated reference; returns how many requests went."""
    want = {p: complete(ref.url, p) for p in prompts}
    want_chat = {t: ref_chat(ref.url, t) for t in chats}
    with stacks_if_slow([pair.prefill, pair.decode], pair.prefill.log.parent) as stacks:
        try:
            with cf.ThreadPoolExecutor(3) as pool:
                got = dict(zip(prompts, pool.map(lambda p: complete(pair.url, p), prompts)))
                got_chat = dict(zip(chats, pool.map(lambda t: chat_stream(pair.url, t),
                                                    chats)))
        except Exception as e:  # a request failed or timed out: keep what says why
            raise AssertionError(f"{pair.name}: {e!r}; prefill stats {pair.p()}; decode "
                                 f"stats {pair.d()}; logs {pair.prefill.log}, "
                                 f"{pair.decode.log}; stacks {stacks}") from e
    for p in prompts:
        assert got[p] == want[p], f"prompt {p[:40]!r}: {got[p]} != colocated {want[p]}"
    for t in chats:
        assert got_chat[t] == want_chat[t], t
    return len(prompts) + len(chats)


def restores_a_repeated_prefix(pair: Pair, ref: VllmServer) -> None:
    """A prompt, then another with the same 6-block prefix: every decode rank restores its
    share of those blocks from its own L2, and only the suffix crosses, split evenly over
    the ranks that hold the heads."""
    prefix = [(11 + 37 * i) % 700 + 300 for i in range(6 * BS)]
    a, b = prefix + list(range(400, 420)), prefix + list(range(500, 540))
    def written() -> list[int]:
        return [s.get("tiers", {}).get("l2_writebacks", 0) for s in pair.d()]

    w0 = written()
    assert complete(pair.url, a) == complete(ref.url, a)
    wait("the write-back", lambda: all(w - w_ >= 6 for w, w_ in zip(written(), w0)),
         timeout=120, show=lambda: (w0, pair.d()))
    d0, sent0 = pair.d(), pair.p_bytes()
    assert complete(pair.url, b) == complete(ref.url, b)
    wait("the decode's loads", lambda: all(s["loads"] > s0["loads"]
                                           for s, s0 in zip(pair.d(), d0)), timeout=120,
         show=lambda: (d0, pair.d()))
    wait("the prefill's sends", lambda: all(x > y for x, y in zip(pair.p_bytes(), sent0)),
         show=lambda: (sent0, pair.p()))
    d1 = pair.d()
    for s, s0 in zip(d1, d0):
        assert s["restored_l2_pages"] - s0["restored_l2_pages"] == 6, s
    suffix = (-(-len(b) // BS) - 6) * BLOCK_BYTES
    sent = [x - y for x, y in zip(pair.p_bytes(), sent0)]
    assert sum(sent) == suffix and len(set(sent)) == 1, (sent, suffix)
    assert sum(s["net_bytes"] - s0["net_bytes"] for s, s0 in zip(d1, d0)) == suffix


@pytest.fixture(scope="class")
def down(base: Base) -> Iterator[Pair]:
    """Prefill TP 2 -> decode TP 1."""
    with running(base, "down", 2, 1) as p:
        yield p


@pytest.fixture(scope="class")
def up(base: Base) -> Iterator[Pair]:
    """Prefill TP 1 -> decode TP 2."""
    with running(base, "up", 1, 2) as p:
        yield p


class TestPrefillTP2DecodeTP1:
    def test_token_exact_each_rank_sending_its_heads_half(self, base: Base, down: Pair
                                                          ) -> None:
        before = down.p_bytes()
        n = token_exact(down, base.ref,
                        ["Hello", "The river", *[text(13 * i, 60 + 110 * i) for i in range(4)]],
                        [f"Tell me about {text(5 * i, 4)}." for i in range(2)])
        wait("the decode's loads", lambda: down.d_sum("loads") == n, timeout=120,
             show=lambda: (n, down.d(), down.p()))
        wait("both prefill ranks' sends", lambda: all(s.get("sends", 0) == n
                                                      and s.get("in_flight_sends", 1) == 0
                                                      for s in down.p()),
             show=lambda: (n, down.p()))
        assert down.d_sum("load_failures") == 0
        # each layer as the forward wrote it once the decode's request had arrived, a step
        # computed before that in one piece (leg4: nobody could receive its layers yet)
        assert all(s["layer_sends"] >= n for s in down.p()), \
            "each rank handed each request's layers over"
        sent = [b - b0 for b, b0 in zip(down.p_bytes(), before)]
        # each rank holds one of the two KV heads: the same share of every block
        assert sent[0] == sent[1] > 0 and sum(sent) == down.d_sum("net_bytes"), sent

    def test_the_decode_restores_a_prefix_from_l2_and_gets_the_suffix_from_both_ranks(
            self, base: Base, down: Pair) -> None:
        restores_a_repeated_prefix(down, base.ref)


class TestPrefillTP1DecodeTP2:
    def test_token_exact_each_decode_rank_asking_for_its_head(self, base: Base, up: Pair
                                                              ) -> None:
        n = token_exact(up, base.ref, ["Hello", text(40, 250)], ["Tell me about rivers."])
        wait("both decode ranks' loads", lambda: all(s.get("loads", 0) == n
                                                     for s in up.d()), timeout=120,
             show=lambda: (n, up.d(), up.p()))
        d = up.d()
        assert all(s["load_failures"] == 0 for s in d)
        # each decode rank asked for its own head: half of what the prefill sent
        assert d[0]["net_bytes"] == d[1]["net_bytes"] and \
            sum(s["net_bytes"] for s in d) == up.p_bytes()[0]

    def test_each_decode_rank_restores_its_own_half_of_a_prefix(self, base: Base, up: Pair
                                                                ) -> None:
        restores_a_repeated_prefix(up, base.ref)
