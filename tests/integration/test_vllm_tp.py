"""Real vLLM at different TP sizes on the two sides, through pdxfer's router with the
official ``openai`` client; every output equals a colocated vLLM at TP 1 token for token.

- A ``vllm serve`` prefill at TP 2 (two worker processes, each holding one of the model's two
  KV heads) streams by layer to a decode at TP 1: each prefill rank sends its own head slice
  into the decode's whole-head blocks, and a repeated prefix is restored on the decode from
  L2, so only the suffix comes from the two prefill ranks.
- A prefill at TP 1 feeds a decode at TP 2: each decode rank asks for its own head, keeps
  its own L2 and restores its own half of a repeated prefix.

One pair at a time, each started once for its class (a TP 2 server takes a minute or more to
start here), and one colocated reference for the module, started with the first pair.

No wait here decides a verdict on a slow machine: each only ends a hang. The worst seen on
the shared 2-core VM was a server's whole process given 0.01 s of CPU in 126 s (the VM's
kernel logged RCU stalls then), so every bound is at least twice that, and they nest so that
a real hang is reported by the most telling one: pdxfer's own deadlines (the decode's error
names the room and the cause) inside the router's, inside the client's. A request or a wait
past ``STACKS_AFTER_S`` also leaves the servers' Python stacks (``stacks_if_slow``), named in
the failure with both sides' stats and logs.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import SHAPES, build_model
from pdxfer.serving.vllm.servers import VllmServer, kv_config, read_stats, start_all

from .vllm_helpers import UNBOUND, chat_stream, complete, ref_chat, stacks_if_slow, text, wait

DEADLINE_S = 300.0
"""pdxfer's bootstrap and transfer deadlines on both sides: a request stalled for two
minutes anywhere still has more than two minutes left."""
HEARTBEAT_S = 150.0
"""A decode declares a prefill hung after ``2 * heartbeat_s`` of probes it saw unanswered.
With the usual few seconds, a prefill whose process the machine froze for two minutes while
its decode ran would be declared hung (where the pair's transport leaves a probe to a frozen
process unanswered, as Mooncake's does), its loads failed and the request answered 500
(``kv_load_failure_policy: fail``): a wrong verdict. A stalled process cannot be told from a
frozen one, and telling hung from alive is what ``heartbeat_s`` is for (``test_crash``,
``test_net_faults`` test it): here it only ends a hang, at 300 s."""
ROUTER_S = DEADLINE_S + 60
"""The router's deadline towards the workers (``--timeout``; its start waits that long for
the decode too): past pdxfer's, so that a pdxfer failure comes back as the decode's error."""
CLIENT_S = ROUTER_S + 60
"""The official client's deadline for one request: past the router's."""
WAIT_S = 240.0
"""A wait for counters that follow a request's end (stats files, L2 write-backs)."""
STACKS_AFTER_S = 120.0
"""A body running longer than this dumps the servers' Python stacks (every minute after)."""

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_tp, pytest.mark.engine]
"""The per-test guard (fixtures included: the first test of a class starts its pair) only
ends what no bound above ends. A class's first test took 1-3 minutes here, its pair's
start nearly all of it (the module 1.5-5 minutes at load averages up to 18; 5-10 minutes
at 15-80 before); a real hang in its requests fails at ``CLIENT_S`` (7 minutes) after the
start, its wait for counters at ``WAIT_S`` (4 minutes) after its requests."""

BS = 32
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

    def sent(self, sends0: Sequence[int], n: int | None = None) -> bool:
        """Whether every prefill rank counted a send past ``sends0`` (exactly ``n`` more, if
        given) and none is in flight: only then are its ``transport_bytes`` final (its stats
        file is rewritten mid-send, and the decode may finish loading before the prefill
        writes its file again)."""
        return all(
            (s.get("sends", 0) - s0 == n if n is not None else s.get("sends", 0) > s0)
            and s.get("in_flight_sends", 1) == 0
            for s, s0 in zip(self.p(), sends0)
        )

    def sends(self) -> list[int]:
        return [s.get("sends", 0) for s in self.p()]


@dataclass
class Base:
    """What both pairs share: the model, one bootstrap server, the colocated reference."""

    tmp: Path
    model: Path
    boot: BootstrapServer
    ref: VllmServer


STEP = 64
"""The prefill's tokens per step (``--max-num-batched-tokens``): two blocks."""

REF_ENV = {"VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": "0"}
"""vLLM bounds a chat template's rendering at 30 s of wall time (in a thread): a machine
stall while the reference renders a chat would fail it. The router renders chats itself."""


def _pair(
    name: str, tmp: Path, model: Path, boot: BootstrapServer, prefill_tp: int, decode_tp: int
) -> Pair:
    # these tests are about placement: every pdxfer deadline only ends a hang
    timeouts = {
        "bootstrap_timeout_s": DEADLINE_S,
        "transfer_timeout_s": DEADLINE_S,
        "heartbeat_s": HEARTBEAT_S,
    }
    p_stats, d_stats = tmp / f"{name}-p.json", tmp / f"{name}-d.json"
    # the prefill streams by layer (send_by's default), STEP tokens a step: a prompt spans
    # several steps, each rank handing its heads of each layer over as the forward writes it
    prefill = VllmServer(
        f"{name}-prefill-tp{prefill_tp}",
        model,
        tmp,
        args=["--tensor-parallel-size", str(prefill_tp), "--max-num-batched-tokens", str(STEP)],
        env=UNBOUND,
        kv_transfer_config=kv_config(
            "kv_producer",
            {
                "bootstrap": boot.address,
                "instance": f"{name}-p",
                "stats_file": str(p_stats),
                "send_by": "layer",
                **timeouts,
            },
        ),
    )
    decode = VllmServer(
        f"{name}-decode-tp{decode_tp}",
        model,
        tmp,
        env=UNBOUND,
        args=["--no-enable-prefix-caching", "--tensor-parallel-size", str(decode_tp)],
        kv_transfer_config=kv_config(
            "kv_consumer",
            {
                "bootstrap": boot.address,
                "instance": f"{name}-d",
                "stats_file": str(d_stats),
                "l2_pages": 128,
                "l3": "off",
                **timeouts,
            },
            kv_load_failure_policy="fail",
        ),
    )
    return Pair(name, prefill, decode, p_stats, d_stats, prefill_tp, decode_tp)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    tmp = tmp_path_factory.mktemp("vllm_tp")
    model = build_model(tmp / "model", "small")
    assert S.kv_heads == 2
    boot = BootstrapServer("127.0.0.1", 0).start()
    # started now, waited for with the first pair: the starts overlap
    ref = VllmServer("colocated", model, tmp, env=REF_ENV)
    try:
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
        start_all([base.ref, pair.prefill, pair.decode])
        router = Proc(
            "router",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--timeout",
                str(ROUTER_S),
                "--prefill",
                f"{pair.prefill.url},{base.boot.address},{name}-p",
                "--decode",
                f"{pair.decode.url},{name}-d",
            ],
            timeout=ROUTER_S + 60,
        )
        pair.url = router.url
        yield pair
    finally:
        if router is not None:
            router.stop()
        at_once([pair.prefill.stop, pair.decode.stop])  # by pid; the shutdowns overlap


@contextlib.contextmanager
def evidence(pair: Pair) -> Iterator[None]:
    """The body's failure (a request that failed or timed out, a wait that did not end, a
    wrong token) comes back with both sides' stats, the servers' logs and, for a body past
    ``STACKS_AFTER_S``, the servers' Python stacks."""
    with stacks_if_slow(
        [pair.prefill, pair.decode], pair.prefill.log.parent, after_s=STACKS_AFTER_S, every_s=60.0
    ) as stacks:
        try:
            yield
        except Exception as e:
            raise AssertionError(
                f"{pair.name}: {e!r}; prefill stats {pair.p()}; decode "
                f"stats {pair.d()}; logs {pair.prefill.log}, "
                f"{pair.decode.log}; stacks {stacks}"
            ) from e


def at_once(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Every call in its own thread, all at once; their results in order (the first failure
    raised once all are over)."""
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda f: f(), calls))


def token_exact(pair: Pair, ref: VllmServer, prompts: list[str], chats: list[str]) -> int:
    """Completions and streamed chats through the pair's router and the same to the colocated
    reference, all at once, each equal to the reference's; returns how many went through the
    pair."""
    t = CLIENT_S
    calls: list[Callable[[], Any]] = []
    for url in (ref.url, pair.url):
        calls += [lambda u=url, p=p: complete(u, p, timeout=t) for p in prompts]
    calls += [lambda c=c: ref_chat(ref.url, c, timeout=t) for c in chats]
    calls += [lambda c=c: chat_stream(pair.url, c, timeout=t) for c in chats]
    outs = at_once(calls)
    n = len(prompts)
    want, got = outs[:n], outs[n : 2 * n]
    want_chat, got_chat = outs[2 * n : 2 * n + len(chats)], outs[2 * n + len(chats) :]
    for p, g, w in zip(prompts, got, want):
        assert g == w, f"prompt {p[:40]!r}: {g} != colocated {w}"
    for c, g, w in zip(chats, got_chat, want_chat):
        assert g == w, f"chat {c!r}: {g} != colocated {w}"
    return n + len(chats)


def same_as_ref(pair: Pair, ref: VllmServer, prompt: list[int]) -> None:
    got, want = at_once(
        [
            lambda: complete(pair.url, prompt, timeout=CLIENT_S),
            lambda: complete(ref.url, prompt, timeout=CLIENT_S),
        ]
    )
    assert got == want, f"{got} != colocated {want}"


def restores_a_repeated_prefix(pair: Pair, ref: VllmServer) -> None:
    """A prompt, then another with the same 6-block prefix: every decode rank restores its
    share of those blocks from its own L2, and only the suffix crosses, split evenly over
    the ranks that hold the heads."""
    prefix = [(11 + 37 * i) % 700 + 300 for i in range(6 * BS)]
    a, b = prefix + list(range(400, 420)), prefix + list(range(500, 540))

    def written() -> list[int]:
        return [s.get("tiers", {}).get("l2_writebacks", 0) for s in pair.d()]

    with evidence(pair):
        w0, sends_a = written(), pair.sends()
        same_as_ref(pair, ref, a)
        # the counters below start once a is over on both sides (its prefix written back on
        # every decode rank, its sends over on every prefill rank)
        wait(
            "the write-back and the prefill's sends",
            lambda: all(w - w_ >= 6 for w, w_ in zip(written(), w0)) and pair.sent(sends_a),
            timeout=WAIT_S,
            show=lambda: (w0, pair.d(), pair.p()),
        )
        d0, sent0, sends0 = pair.d(), pair.p_bytes(), pair.sends()
        same_as_ref(pair, ref, b)
        wait(
            "the decode's loads and the prefill's sends",
            lambda: (
                all(s["loads"] > s0["loads"] for s, s0 in zip(pair.d(), d0)) and pair.sent(sends0)
            ),
            timeout=WAIT_S,
            show=lambda: (d0, pair.d(), pair.p()),
        )
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
    def test_token_exact_each_rank_sending_its_heads_half(self, base: Base, down: Pair) -> None:
        bytes0, sends0 = down.p_bytes(), down.sends()
        layers0 = [s.get("layer_sends", 0) for s in down.p()]
        loads0, net0 = down.d_sum("loads"), down.d_sum("net_bytes")
        with evidence(down):
            n = token_exact(
                down,
                base.ref,
                ["Hello", "The river", *[text(13 * i, 60 + 110 * i) for i in range(4)]],
                [f"Tell me about {text(5 * i, 4)}." for i in range(2)],
            )
            wait(
                "the decode's loads and both prefill ranks' sends",
                lambda: down.d_sum("loads") - loads0 == n and down.sent(sends0, n),
                timeout=WAIT_S,
                show=lambda: (n, down.d(), down.p()),
            )
        assert down.d_sum("load_failures") == 0
        # each layer as the forward wrote it once the decode's request had arrived, a step
        # computed before that in one piece (leg4: nobody could receive its layers yet)
        assert all(s["layer_sends"] - l0 >= n for s, l0 in zip(down.p(), layers0)), (
            "each rank handed each request's layers over"
        )
        sent = [b - b0 for b, b0 in zip(down.p_bytes(), bytes0)]
        # each rank holds one of the two KV heads: the same share of every block
        assert sent[0] == sent[1] > 0 and sum(sent) == down.d_sum("net_bytes") - net0, sent

    def test_the_decode_restores_a_prefix_from_l2_and_gets_the_suffix_from_both_ranks(
        self, base: Base, down: Pair
    ) -> None:
        restores_a_repeated_prefix(down, base.ref)


class TestPrefillTP1DecodeTP2:
    def test_token_exact_each_decode_rank_asking_for_its_head(self, base: Base, up: Pair) -> None:
        d0, bytes0, sends0 = up.d(), up.p_bytes(), up.sends()
        with evidence(up):
            n = token_exact(up, base.ref, ["Hello", text(40, 250)], ["Tell me about rivers."])
            wait(
                "both decode ranks' loads and the prefill's sends",
                lambda: (
                    all(s.get("loads", 0) - s0.get("loads", 0) == n for s, s0 in zip(up.d(), d0))
                    and up.sent(sends0, n)
                ),
                timeout=WAIT_S,
                show=lambda: (n, up.d(), up.p()),
            )
        d = up.d()
        assert all(s["load_failures"] == s0.get("load_failures", 0) for s, s0 in zip(d, d0))
        # each decode rank asked for its own head: half of what the prefill sent
        net = [s["net_bytes"] - s0.get("net_bytes", 0) for s, s0 in zip(d, d0)]
        assert net[0] == net[1] > 0 and sum(net) == up.p_bytes()[0] - bytes0[0], net

    def test_each_decode_rank_restores_its_own_half_of_a_prefix(self, base: Base, up: Pair) -> None:
        restores_a_repeated_prefix(up, base.ref)
