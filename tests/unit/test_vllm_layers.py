"""The vLLM prefill sends layer by layer (``send_by: layer``): vLLM's real ``Scheduler`` drives
both connector sides (as in ``test_vllm_connector``), and the prefill's fake forward writes one
layer at a time and calls ``save_kv_layer`` after each, as vLLM's attention layers do.

- The scheduler orders, per step, the tokens that step computes (a step of 1.5 blocks fills a
  block in part; the next step's order starts there), the first step from token 0 when vLLM
  had a prefix cached.
- Inside the forward, a decode that already asked holds a layer of the step's tokens before
  the prefill has computed the next layer (a hand-off, not a send after the step), and ends
  with exactly the prefill's KV; a layer the forward never reports goes after the step, and
  so do all the layers of a room no decode has asked for yet, in one hand-off.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdxfer import BootstrapServer
from pdxfer.integrations.vllm.scheduler import Streamed, layer_order
from tests.harness import vllm_engine as base
from tests.harness.vllm_engine import (
    BS,
    LAYERS,
    SAMPLED,
    S,
    early_params,
    expected,
    make_pair,
    model,
    orders,
    pattern,
    prefill_params,
    run_until,
    server,
)

__all__ = ["model", "server"]  # the fixtures

STEP = 48  # tokens per step: a block and a half


def layerwise(
    e: base.Engine,
    after: Callable[[int, str, int, int], None] | None = None,
    report: Callable[[int], bool] = lambda i: True,
) -> None:
    """Give ``e`` a forward that computes one layer at a time and reports each to the
    connector (``save_kv_layer``), as vLLM's attention layers do; ``after(layer, rid, first,
    n)`` runs once a layer is reported; ``report(layer)`` False skips the call for it."""

    def forward(self: base.Engine, scheduled: dict[str, int]) -> None:
        steps = []
        for rid, n in scheduled.items():
            r = self.sched.requests[rid]
            first = r.num_computed_tokens - n
            self.computed.setdefault(rid, []).append((first, n))
            steps.append((rid, r, first, n, self.blocks(rid)))
        for i, name in enumerate(LAYERS):
            for _, r, first, n, blocks in steps:
                for pos in range(first, first + n):
                    self.kv[i, blocks[pos // BS], :, pos % BS, :] = pattern(
                        r.all_token_ids[pos], pos
                    )[i]
            if report(i):
                self.conn.save_kv_layer(name, self.kv[i], None)  # type: ignore[arg-type]
            for rid, _, first, n, _ in steps:
                if after is not None:
                    after(i, rid, first, n)

    e._forward = types.MethodType(forward, e)  # type: ignore[method-assign]


def asks_first(pair: base.Pair) -> None:
    """The decode asks before the prefill has the request, and its request reaches the
    prefill (waiting there for the room): a decode that has asked by the time a layer is
    computed gets that layer handed over at once."""
    pair.d.step()
    run_until([], lambda: pair.p.ep.tables()["pending"] == 1)


def test_a_step_order_names_the_tokens_it_computes_and_the_blocks_that_hold_them() -> None:
    st = Streamed(room=1, peer=None, num_tokens=150)
    ids = list(range(10, 15))
    spans = []
    for end in (48, 96, 144, 150):
        o = layer_order("r", st, end, ids, BS)
        assert o is not None
        spans.append((o.start, o.end, o.block_ids, o.last))
        st.tokens = end
    assert spans == [
        (0, 48, (10, 11), False),
        (48, 96, (11, 12), False),
        (96, 144, (13, 14), False),
        (144, 150, (14,), True),
    ], "a block filled in part is named again by the step that completes it"
    assert layer_order("r", st, 150, ids, BS) is None, "nothing new"
    assert layer_order("r", Streamed(1, None, 150), 64, ids[:1], BS) is None, (
        "blocks not all known: the end of the request sends them"
    )
    hit = layer_order("r", Streamed(1, None, 150), 4 * BS + 16, ids, BS)
    assert hit is not None and (hit.start, hit.block_ids) == (0, tuple(ids)), (
        "a prefix vLLM had cached goes with the first step"
    )


def test_the_scheduler_orders_each_steps_tokens_by_layer(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="lmeta", batched=STEP)
    p = pair.p
    assert p.conn.cfg.send_by == "layer", "layer by layer is the default"
    tokens = [(i * 11) % 900 + 10 for i in range(150)]
    p.add("m", tokens, 1, prefill_params(None, "d-lmeta"))
    metas = [m for _ in range(4) for m in orders(p)]
    blocks = p.blocks("m")
    assert not [c for m in metas for c in m.chunks], "no whole-block orders"
    got = [(o.start, o.end, o.block_ids, o.last) for m in metas for o in m.layers]
    assert got == [
        (0, 48, tuple(blocks[0:2]), False),
        (48, 96, tuple(blocks[1:3]), False),
        (96, 144, tuple(blocks[3:5]), False),
        (144, 150, tuple(blocks[4:5]), True),
    ]
    run_until([p], lambda: "m" in p.finished)


def test_an_early_decode_holds_a_layer_before_the_prefill_computed_the_next(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="lwise", batched=STEP)
    p, d = pair.p, pair.d
    free_p, free_d = p.free_blocks(), d.free_blocks()
    tokens = [(i * 13) % 900 + 10 for i in range(150)]
    d.add("l-d", tokens, 3, early_params(pair, 7101))
    asks_first(pair)
    seen: list[tuple[int, int]] = []

    def arrived(layer: int, first: int, n: int) -> bool:
        dst = d.blocks("l-d")
        got = torch.stack(
            [d.kv[layer, dst[q // BS], :, q % BS, :] for q in range(first, first + n)]
        )
        return torch.equal(got, expected(tokens, first + n)[first:, layer])

    def after(layer: int, rid: str, first: int, n: int) -> None:
        if rid != "l" or layer + 1 >= S.layers or first + n >= len(tokens):
            return
        base.run_until([], lambda: arrived(layer, first, n))
        assert not torch.any(
            p.kv[layer + 1, p.blocks("l")[(first + n - 1) // BS], :, (first + n - 1) % BS, :]
        ), "the next layer is not computed"
        seen.append((layer, first))

    layerwise(p, after)
    # the fake forward writes token by token into plain [heads, tokens, C] tiles (as a GPU
    # backend does): a block the step fills in part goes for its tokens
    p.conn.worker.sender.partial_blocks = True
    p.add("l", tokens, 1, prefill_params(7101, "d-lwise"))
    run_until([p, d], lambda: "l-d" in d.computed)
    assert {f for _, f in seen} == {0, 48, 96}, "each step's layers arrived inside its forward"
    assert d.computed["l-d"][0] == (len(tokens) - 1, 1), "only the last token recomputed"
    n = len(tokens) - 1
    assert torch.equal(base.held(d, "l-d", n), expected(tokens, n))
    run_until([p, d], lambda: "l-d" in d.finished and "l" not in p.sched.requests)
    assert d.outputs["l-d"] == [SAMPLED] * 3
    w = p.conn.worker
    assert w.counters["layer_sends"] == 4 * S.layers and w.counters["sends"] == 1
    assert w.counters["streamed_steps"] == 4, "every step went as computed: the decode asked first"
    assert p.ep.metrics()["transport_bytes"] == len(tokens) * w.layout.block_bytes // BS, (
        "each token's KV crosses once: a block filled in two steps goes in two parts"
    )
    assert p.free_blocks() == free_p and d.free_blocks() == free_d


def test_where_blocks_are_packed_a_block_filled_in_part_waits_to_be_complete(
    model: Path, server: BootstrapServer
) -> None:
    """vLLM's CPU backend packs each (block, head) tile per ISA: a token's KV there is not at
    a place pdxfer can address, so a block goes whole, once a step completed it."""
    pair = make_pair(model, server, name="lpack", batched=STEP)
    p, d = pair.p, pair.d
    assert not p.conn.worker.sender.partial_blocks, "CPU tensors: blocks move whole"
    tokens = [(i * 31) % 900 + 10 for i in range(150)]
    layerwise(p)
    d.add("k-d", tokens, 2, early_params(pair, 7301))
    asks_first(pair)
    p.add("k", tokens, 1, prefill_params(7301, "d-lpack"))
    run_until([p, d], lambda: "k-d" in d.computed)
    n = len(tokens) - 1
    assert torch.equal(base.held(d, "k-d", n), expected(tokens, n))
    w = p.conn.worker
    # steps end at 48, 96, 144, 150: complete blocks 1, 3, 4, then the rest
    assert w.counters["step_chunks"] == 3 and w.counters["layer_sends"] == 4 * S.layers
    assert sum(s.get("prompt_steps", 0) for s in p.kv_stats) == 4, "vLLM's steps, counted"
    assert w.counters["streamed_steps"] == 4
    assert p.ep.metrics()["transport_bytes"] == 5 * w.layout.block_bytes, "whole blocks"
    run_until([p, d], lambda: "k-d" in d.finished and "k" not in p.sched.requests)


def test_a_layer_the_forward_does_not_report_is_sent_after_the_step(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="lskip", batched=STEP)
    p, d = pair.p, pair.d
    tokens = [(i * 29) % 900 + 10 for i in range(130)]
    layerwise(p, report=lambda i: i != 1)  # layer 1 is never reported (a graph replay)
    d.add("s-d", tokens, 2, early_params(pair, 7201))
    asks_first(pair)
    p.add("s", tokens, 1, prefill_params(7201, "d-lskip"))
    run_until([p, d], lambda: "s-d" in d.computed)
    assert d.computed["s-d"][0] == (len(tokens) - 1, 1)
    n = len(tokens) - 1
    assert torch.equal(base.held(d, "s-d", n), expected(tokens, n))
    assert d.conn.worker.counters["load_failures"] == 0
    assert p.conn.worker.counters["layer_sends"] == 3 * S.layers, (
        "each of the 3 steps: the reported layers one by one, then layer 1 after the step"
    )
    assert p.conn.worker.counters["streamed_steps"] == 3
    run_until([p, d], lambda: "s-d" in d.finished and "s" not in p.sched.requests)


def test_a_room_no_decode_asked_for_gets_each_steps_layers_after_the_forward_at_once(
    model: Path, server: BootstrapServer
) -> None:
    """Under vLLM's proxy the decode asks after the prefill's answer, so while the forward
    runs nobody can receive a layer; a hand-off per layer only spent the engine thread's
    time inside the forward while the answer waited. Each step's
    layers go after its forward in one hand-off, and the decode that asks later receives
    exactly the prefill's KV."""
    pair = make_pair(model, server, name="lnone", batched=STEP)
    p, d = pair.p, pair.d
    layerwise(p)
    tokens = [(i * 17) % 900 + 10 for i in range(150)]
    base.prefill_then_decode(pair, "n", tokens, room=7401)
    w = p.conn.worker
    # steps end at 48, 96, 144, 150: one hand-off each (complete blocks, then the rest)
    assert w.counters["layer_sends"] == 4, "one hand-off per step, not one per layer"
    assert w.counters["streamed_steps"] == 0, "no step went as computed: nobody had asked"
    assert w.counters["sends"] == 1
    run_until([p, d], lambda: "n-d" in d.computed)
    assert d.computed["n-d"][0] == (len(tokens) - 1, 1), "only the last token recomputed"
    n = len(tokens) - 1
    assert torch.equal(base.held(d, "n-d", n), expected(tokens, n))
    run_until([p, d], lambda: "n-d" in d.finished and "n" not in p.sched.requests)


def parse_send_by(extra: dict[str, Any]) -> str:
    from pdxfer.integrations.vllm import config as C

    return C.parse("kv_producer", {"bootstrap": "127.0.0.1:1", **extra}).send_by


def test_send_by_is_the_one_key_for_when_kv_leaves() -> None:
    import pytest

    from pdxfer import ConfigError

    assert parse_send_by({}) == "layer"
    assert parse_send_by({"send_by": "step"}) == "step"
    assert parse_send_by({"send_by": "request"}) == "request"
    with pytest.raises(ConfigError, match="send_by"):
        parse_send_by({"send_by": "token"})
    with pytest.raises(ConfigError, match="unknown key.*send_per_step"):
        parse_send_by({"send_per_step": True})  # no aliases before 1.0
