"""The prefill sends while it computes, and the decode may ask first: vLLM's real
``Scheduler`` drives both connector sides (as in ``test_vllm_connector``), with a small
``max_num_batched_tokens`` so a prompt spans several steps.

- The scheduler side gives a request its room when it is scheduled and, per step, orders the
  blocks that step computed (the step reaching the prompt's end orders all, the partial last
  block too); the room in the answer is the one the workers opened.
- A decode engaged at dispatch (the early form: its request carries the room, the bootstrap
  and the prefill's instance, not the prefill's answer) holds the first blocks' KV while the
  prefill still computes the rest, and ends with exactly the prefill's KV.
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.v1.request import RequestStatus

from pdxfer import BootstrapServer
from tests.harness import vllm_engine as base
from tests.harness.vllm_engine import (
    BS,
    SAMPLED,
    early_params,
    expected,
    make_pair,
    model,
    orders,
    prefill_params,
    run_until,
    server,
)

__all__ = ["model", "server"]  # the fixtures

STEP = 64  # tokens per step: two blocks


def test_the_scheduler_orders_each_steps_blocks_and_answers_the_room_it_opened(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="meta", batched=STEP, prefill_extra={"send_by": "step"})
    p = pair.p
    tokens = [(i * 11) % 900 + 10 for i in range(150)]  # 5 blocks, the last one partial
    p.add("m", tokens, 1, prefill_params(None, "d-meta"))  # the prefill draws the room
    metas = [m for _ in range(3) for m in orders(p)]
    blocks = p.blocks("m")
    (opened,) = [o for m in metas for o in m.opens]
    assert opened.req_id == "m"
    chunks = [c for m in metas for c in m.chunks]
    assert [(c.block_ids, c.num_tokens, c.last) for c in chunks] == [
        (tuple(blocks[:2]), 2 * BS, False),
        (tuple(blocks[:4]), 4 * BS, False),
        (tuple(blocks[:5]), 150, True),
    ], "each step's blocks; the last step's all of them"
    assert all(c.room == opened.room and c.peer == "d-meta" for c in chunks)
    run_until([p], lambda: "m" in p.finished)
    assert p.finished["m"].kv_transfer_params["pdxfer_room"] == opened.room, (
        "the answer names the room the workers opened (the one drawn at scheduling)"
    )


def test_send_by_request_orders_the_whole_prompt_once(model: Path, server: BootstrapServer) -> None:
    pair = make_pair(
        model, server, name="whole", batched=STEP, prefill_extra={"send_by": "request"}
    )
    p = pair.p
    tokens = [(i * 7) % 900 + 10 for i in range(150)]
    p.add("w", tokens, 1, prefill_params(77, "d-whole"))
    chunks = [c for _ in range(3) for m in orders(p) for c in m.chunks]
    assert [(len(c.block_ids), c.last) for c in chunks] == [(5, True)]


def test_an_early_decode_holds_the_first_blocks_while_the_prefill_computes_the_rest(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="early", batched=STEP)
    p, d = pair.p, pair.d
    free_p, free_d = p.free_blocks(), d.free_blocks()
    tokens = [(i * 13) % 900 + 10 for i in range(150)]
    d.add("e-d", tokens, 3, early_params(pair, 6101))
    d.step()  # the decode allocates and asks before the prefill has the request
    assert d.conn.worker.counters["loads"] == 1
    p.add("e", tokens, 1, prefill_params(6101, "d-early"))
    p.step()  # the first 64 tokens: blocks 0 and 1 are handed over after the step
    dst = d.blocks("e-d")

    def arrived(k: int) -> bool:
        got = torch.stack([d.kv[:, dst[q // BS], :, q % BS, :] for q in range(k)])
        return torch.equal(got, expected(tokens, k))

    base.run_until([], lambda: arrived(2 * BS))
    assert "e" not in p.finished and p.sched.requests["e"].num_computed_tokens == STEP, (
        "two blocks are at the decode while the prefill has computed only them"
    )
    run_until([p, d], lambda: "e-d" in d.finished and "e" not in p.sched.requests)
    assert d.computed["e-d"][0] == (len(tokens) - 1, 1), "only the last token recomputed"
    assert d.outputs["e-d"] == [SAMPLED] * 3
    assert p.ep.metrics()["transport_bytes"] == 5 * p.conn.worker.layout.block_bytes
    assert p.free_blocks() == free_p and d.free_blocks() == free_d


def test_a_prefix_cache_hit_on_the_prefill_is_sent_with_the_first_step(
    model: Path, server: BootstrapServer
) -> None:
    # the decode has no prefix cache of its own: all of b's blocks cross, its cached ones too
    pair = make_pair(model, server, name="hit", batched=STEP, prefix_caching=False)
    p, d = pair.p, pair.d
    shared = [(i * 17) % 800 + 20 for i in range(4 * BS)]
    a, b = shared + list(range(40, 50)), shared + list(range(60, 90))
    for rid, toks, room in (("a", a, 6201), ("b", b, 6202)):
        d.add(f"{rid}-d", toks, 2, early_params(pair, room))
        d.step()
        p.add(rid, toks, 1, prefill_params(room, "d-hit"))
        run_until(
            [p, d],
            lambda rid=rid: (
                f"{rid}-d" in d.finished  # type: ignore[misc]
                and rid not in p.sched.requests
            ),
        )
        assert d.computed[f"{rid}-d"][0] == (len(toks) - 1, 1)
    assert p.computed["b"][0][0] == 4 * BS, "the prefill computed only past its cached prefix"
    d_blocks = d.conn.worker.layout.block_bytes
    assert p.ep.metrics()["transport_bytes"] == (5 + 5) * d_blocks


def test_an_aborted_prefill_keeps_handed_blocks_until_no_write_reads_them(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="abort", batched=STEP, timeouts=2.0)
    p = pair.p
    free_p = p.free_blocks()
    tokens = [(i * 5) % 900 + 10 for i in range(150)]
    p.add("x", tokens, 1, prefill_params(6301, "d-abort"))
    p.step()  # two blocks handed over; no decode asked
    p.sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert p.free_blocks() < free_p, "handed blocks are held until the worker lets go"
    run_until([p], lambda: p.free_blocks() == free_p)
    assert p.conn.worker.sender.in_flight == 0, "the room is gone"


def keep_busy(p: base.Engine) -> None:
    """A busy prefill: one request runs at a time, and "busy" runs for hundreds of steps, so
    the next request waits in vLLM's queue."""
    p.sched.max_num_running_reqs = p.sched.max_num_active_reqs = 1
    p.add("busy", list(range(10, 40)), 500, None)
    p.step()


def test_an_early_decode_waits_while_its_prefill_request_is_queued_past_the_grace(
    model: Path, server: BootstrapServer
) -> None:
    """The decode asks at dispatch; the prefill has the request but keeps it queued (one
    running request at a time, another one running) for longer than ``room_grace_s``. The
    prefill's engine expected the room on arrival, so the decode still loads exactly the
    prefill's KV once vLLM schedules it (its ask is early as well, which alone would hold it
    too; test_unknown_room tests an expected room asked for late); a room the prefill never
    received, asked for in the sequential form, fails after the grace (that failure is what
    says the grace has passed)."""
    pair = make_pair(
        model, server, name="queued", batched=STEP, prefill_extra={"room_grace_s": 0.2}
    )
    p, d = pair.p, pair.d
    keep_busy(p)
    tokens = [(i * 19) % 900 + 10 for i in range(150)]
    d.add("q-d", tokens, 2, early_params(pair, 6401))
    # a room this prefill never receives, asked for as after a prefill's answer (an early
    # ask would wait until the bootstrap deadline: the prefill cannot know it never comes)
    d.add("u-d", tokens, 2, {**early_params(pair, 6402), "pdxfer_num_tokens": len(tokens)})
    d.step()
    p.add("q", tokens, 1, prefill_params(6401, "d-queued"))
    for _ in range(2):
        p.step()  # "q" stays queued behind "busy"; its room is expected, not open
    assert p.sched.requests["q"].status == RequestStatus.WAITING
    assert p.ep.tables()["expected"] == 1 and p.ep.tables()["rooms"] == 0
    run_until([d], lambda: "u-d" in d.computed, timeout=30)
    assert d.computed["u-d"][0] == (0, len(tokens)), (
        "the unknown room failed after the grace and its decode recomputed it"
    )
    assert d.conn.worker.counters["load_failures"] == 1
    assert "q-d" not in d.computed, "the queued request's decode still waits"
    p.sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)  # "q" runs now
    run_until([p, d], lambda: "q-d" in d.computed)
    assert d.computed["q-d"][0] == (len(tokens) - 1, 1), "loaded: only the last token computed"
    assert torch.equal(base.held(d, "q-d", len(tokens) - 1), expected(tokens, len(tokens) - 1))
    assert d.conn.worker.counters["load_failures"] == 1
    run_until([p, d], lambda: "q-d" in d.finished and "q" not in p.sched.requests)
    assert p.ep.tables()["expected"] == 0


def test_a_queued_prefill_request_that_is_aborted_fails_its_early_decode_at_once(
    model: Path, server: BootstrapServer
) -> None:
    """A request aborted while queued never opens its room: the expectation is withdrawn,
    and the decode waiting for it fails now (it recomputes), not at the bootstrap deadline."""
    pair = make_pair(
        model,
        server,
        name="withdraw",
        batched=STEP,
        timeouts=60.0,
        prefill_extra={"room_grace_s": 0.2},
    )
    p, d = pair.p, pair.d
    keep_busy(p)
    tokens = [(i * 23) % 900 + 10 for i in range(100)]
    p.add("w", tokens, 1, prefill_params(6501, "d-withdraw"))
    p.step()
    assert p.ep.tables()["expected"] == 1
    d.add("w-d", tokens, 2, early_params(pair, 6501))
    d.step()
    base.run_until([], lambda: p.ep.tables()["pending"] == 1)  # the decode's request waits
    p.sched.finish_requests("w", RequestStatus.FINISHED_ABORTED)
    p.step()  # the abort order reaches the workers
    assert p.ep.tables()["expected"] == 0
    run_until([d], lambda: "w-d" in d.computed, timeout=20)
    assert d.conn.worker.counters["load_failures"] == 1
    assert d.computed["w-d"][0] == (0, len(tokens)), "recomputed after the refusal"
    assert p.ep.metrics()["refused_aborted"] == 1
    p.sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
