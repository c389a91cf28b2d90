"""A hybrid model streamed by layer (``send_by: layer``), worker to worker over pdxfer's
in-memory transport: a full group, a sliding-window group and a Mamba-style state group, as
vLLM's hybrid KV cache manager hands them over (its null block 0 for window blocks it
freed). The prefill worker gets one ``LayerOrder`` a step and the request-end ``SendOrder``,
the decode one ``LoadOrder``, as the scheduler side writes them.

- The full group's blocks reach the decode's blocks before the prompt's last step; the
  window's only from ``groups.window_first`` on, as they are computed; the load ends only
  once the state page came too, after the request's end.
- The decode ends with the prefill's bytes: every full block, the window blocks it holds,
  the state page; the window blocks it does not hold are never written.
- A chunked local attention group (Llama 4) moves the last prompt token's chunk only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pdxfer import BootstrapServer
from pdxfer.integrations.vllm import config as C
from pdxfer.integrations.vllm import groups as G
from pdxfer.integrations.vllm import worker as W
from pdxfer.integrations.vllm.groups import Group
from pdxfer.integrations.vllm.metadata import (
    LayerOrder,
    LoadOrder,
    OpenOrder,
    PdxferMetadata,
    SendOrder,
)
from pdxfer.transport import MemoryFabric, MemoryTransport

BS, NB, H, D = 16, 40, 2, 8
WINDOW, PAGE = 64, 4096
N, STEP = 150, 48
"""Prompt tokens and tokens a step: steps [0, 48), [48, 96), [96, 144), [144, 150)."""
ROOM = 4242
FULL_L, WIN_L, STATE_L = (
    "model.layers.2.attn",
    ("model.layers.0.attn", "model.layers.1.attn"),
    "model.layers.3.mixer",
)
GROUPS = (
    Group(0, "full", BS, (FULL_L,)),
    Group(1, "window", BS, WIN_L, window=WINDOW),
    Group(2, "state", BS, (STATE_L,), page_bytes=PAGE),
)


class Side:
    def __init__(
        self,
        role: str,
        fabric: MemoryFabric,
        boot: str,
        groups: tuple[Group, ...] = GROUPS,
        model: str = "hybrid",
        by_layer: bool = True,
    ) -> None:
        extra = {"bootstrap": boot, "instance": "p0" if role == "kv_producer" else "d0"}
        if by_layer:
            extra["send_by"] = "layer"
        self.boot = boot
        self.w = W.PdxferWorker(C.parse(role, extra, model), W.RankInfo(0, 1, BS, H), groups)
        self.w.transport = MemoryTransport(fabric)
        self.kv = {n: torch.zeros(NB, H, BS, D) for n in (FULL_L, *WIN_L)}
        self.state = torch.zeros(NB, PAGE // 4)
        states = {STATE_L: self.state} if any(g.kind == "state" for g in groups) else {}
        self.w.register_kv_caches({**self.kv, **states})


@contextlib.contextmanager
def sides(
    groups: tuple[Group, ...] = GROUPS, model: str = "hybrid", by_layer: bool = True
) -> Iterator[tuple[Side, Side]]:
    """A prefill and a decode worker of ``groups`` on one in-memory fabric and bootstrap
    (``by_layer``: ``send_by: layer``, else the per-step default)."""
    boot = BootstrapServer("127.0.0.1", 0).start()
    fabric = MemoryFabric()
    made: list[Side] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            made.append(Side(role, fabric, boot.address, groups, model, by_layer))
        yield made[0], made[1]
    finally:
        for x in made:
            x.w.close()
        boot.stop()


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with sides() as both:
        yield both


def load(d: Side, name: str, tables: tuple[tuple[int, ...], ...]) -> None:
    """Give the decode its one ``LoadOrder``: the whole prompt, into ``tables`` (a group
    each), from instance p0."""
    order = LoadOrder(name, ROOM, d.boot, "p0", tables[0], 0, N, groups=tables)
    d.w.run_orders(PdxferMetadata(loads=[order]))


def step(name: str, t0: int, tables: tuple[tuple[int, ...], ...]) -> PdxferMetadata:
    """The prefill's ``LayerOrder`` for the step computing ``[t0, t0 + STEP)``: each group's
    table cut to the blocks the step reaches."""
    t1 = min(N, t0 + STEP)
    cut = tuple(t[: -(-t1 // BS)] for t in tables)
    return PdxferMetadata(
        layers=[LayerOrder(name, ROOM, None, (), t0, t1, t1 == N, num_tokens=N, groups=cut)]
    )


def wait(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


P_FULL = list(range(1, 11))
P_WIN = list(range(11, 21))
P_STATE = 21
D_FULL = list(range(22, 32))
D_WIN_START = (N - WINDOW + 1) // BS  # vLLM's decode holds the window from here
D_WIN = [0] * D_WIN_START + list(range(32, 32 + 10 - D_WIN_START))
D_STATE = 39


def _win_table(t0: int) -> tuple[int, ...]:
    """The prefill's window table at a step starting at ``t0``: vLLM freed the blocks below
    ``(t0 - window + 1) // block_size`` (the null block), and may have reused them."""
    freed = max(0, t0 - WINDOW + 1) // BS
    return tuple(0 if i < freed else b for i, b in enumerate(P_WIN))


def test_full_groups_stream_and_the_load_ends_with_every_group(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.w.run_orders(PdxferMetadata(opens=[OpenOrder("a", ROOM, None)]))
    load(d, "a-d", (tuple(D_FULL), tuple(D_WIN), (D_STATE,)))
    first = G.window_first(GROUPS[1], N)
    for t0 in range(0, N, STEP):
        t1 = min(N, t0 + STEP)
        for k in range(t0 // BS, -(-t1 // BS)):  # the step computes these blocks' tokens
            p.kv[FULL_L][P_FULL[k]] = torch.randn(H, BS, D)
            for n in WIN_L:
                p.kv[n][P_WIN[k]] = torch.randn(H, BS, D)
        for i in range(max(0, t0 - WINDOW + 1) // BS):  # freed window blocks get reused
            for n in WIN_L:
                p.kv[n][P_WIN[i]] = -7.0
        last = t1 == N
        if last:
            # the full group's complete blocks crossed before the last step was computed
            done = t0 // BS
            wait(
                "the streamed full blocks",
                lambda done=done: all(
                    torch.equal(d.kv[FULL_L][D_FULL[k]], p.kv[FULL_L][P_FULL[k]])
                    for k in range(done)
                ),
            )
            assert not d.w.get_finished([])[1], "the load ends only with every group"
        meta = step("a", t0, (tuple(P_FULL), _win_table(t0), ()))
        p.w.run_orders(meta)
        for n in (*WIN_L, FULL_L):
            p.w.save_layer(meta, n, p.kv[n])
        p.w.after_forward(meta)
    p.state[P_STATE] = torch.randn(PAGE // 4)
    # every step went before the request's end (the last one too: the state is still to go)
    assert p.w.counters["step_chunks"] == 4 and p.w.counters["sends"] == 0
    assert p.w.counters["send_failures"] == 0
    # a streamed room succeeds on the sender's one TransferDone, sent as its room ends: the
    # sender's room is still open, so the load cannot have ended (nor can it later, unsent)
    assert p.w.ep is not None and p.w.ep.prefill is not None
    assert not p.w.ep.prefill.rooms[ROOM].state.terminal
    assert not d.w.get_finished([])[1], "no load ends before the state page was sent"
    p.w.run_orders(
        PdxferMetadata(
            sends=[
                SendOrder(
                    "a",
                    ROOM,
                    None,
                    tuple(P_FULL),
                    N,
                    groups=(tuple(P_FULL), _win_table(144), (0, P_STATE)),
                )
            ]
        )
    )
    got: set[str] = set()
    wait("the load", lambda: bool(got.update(d.w.get_finished([])[1]) or got))
    assert got == {"a-d"} and d.w.counters["load_failures"] == 0
    for k in range(10):
        assert torch.equal(d.kv[FULL_L][D_FULL[k]], p.kv[FULL_L][P_FULL[k]]), k
        for n in WIN_L:
            if k >= D_WIN_START:
                assert torch.equal(d.kv[n][D_WIN[k]], p.kv[n][P_WIN[k]]), (n, k)
    assert first <= D_WIN_START
    for n in WIN_L:  # blocks the decode does not hold (its null block 0 among them): untouched
        assert not d.kv[n][0].any() and not d.kv[n][39].any()
    assert torch.equal(d.state[D_STATE], p.state[P_STATE])
    wait("the send's end", lambda: "a" in p.w.get_finished(["a"])[0])


def test_without_a_state_the_stream_ends_every_room_and_a_late_decode_gets_it_all() -> None:
    """Full and window groups only (Gemma 3's shape): the last step's layers end both rooms,
    so the load ends before the request does; a decode that asks only then still gets every
    block it holds, and the request-end send adds nothing."""
    with sides(GROUPS[:2], by_layer=False) as (p, d):
        p.w.run_orders(PdxferMetadata(opens=[OpenOrder("b", ROOM, None)]))
        for t0 in range(0, N, STEP):
            for k in range(t0 // BS, -(-min(N, t0 + STEP) // BS)):
                for n in p.kv:
                    p.kv[n][[P_FULL, P_WIN][n in WIN_L][k]] = torch.randn(H, BS, D)
            meta = step("b", t0, (tuple(P_FULL), _win_table(t0)))
            p.w.run_orders(meta)
            p.w.after_forward(meta)
        assert p.w.counters["sends"] == 1 and p.w.counters["step_chunks"] == 3
        load(d, "b-d", (tuple(D_FULL), tuple(D_WIN)))
        got: set[str] = set()
        wait("the load", lambda: bool(got.update(d.w.get_finished([])[1]) or got))
        assert got == {"b-d"} and d.w.counters["load_failures"] == 0
        tables = (tuple(P_FULL), _win_table(144))
        p.w.run_orders(PdxferMetadata(sends=[SendOrder("b", ROOM, None, tables[0], N, tables)]))
        assert p.w.counters["sends"] == 1
        for k in range(10):
            assert torch.equal(d.kv[FULL_L][D_FULL[k]], p.kv[FULL_L][P_FULL[k]]), k
            for n in WIN_L:
                if k >= D_WIN_START:
                    assert torch.equal(d.kv[n][D_WIN[k]], p.kv[n][P_WIN[k]]), (n, k)
        # the decode counts what both rooms wrote: 10 full blocks and the window's a layer
        held = (10 - D_WIN_START) * len(WIN_L)
        assert d.w.counters["net_bytes"] == (10 + held) * H * BS * D * 4
        wait("the send's end", lambda: "b" in p.w.get_finished(["b"])[0])


def test_a_chunk_group_streams_the_last_tokens_chunk_and_nothing_before_it() -> None:
    """Full and chunked local attention groups (Llama 4's shape), chunk 64: vLLM's prefill
    frees the blocks of each chunk before the one a step starts in, and its decode holds
    only the last prompt token's chunk (blocks 8 and 9 of a 150-token prompt). The stream
    ends both rooms with the last step: the decode has the prefill's bytes in every full
    block and in the chunk's, and vLLM's null block is never written."""
    chunk = 64
    groups = (GROUPS[0], Group(1, "chunk", BS, WIN_L, chunk=chunk))
    with sides(groups, "llama4", by_layer=False) as (p, d):
        held = G.chunk_first(groups[1], N)
        assert held == 8
        d_chunk = [0] * held + [32, 33]
        load(d, "c-d", (tuple(D_FULL), tuple(d_chunk)))
        p.w.run_orders(PdxferMetadata(opens=[OpenOrder("c", ROOM, None)]))
        for t0 in range(0, N, STEP):
            for k in range(t0 // BS, -(-min(N, t0 + STEP) // BS)):
                for n in p.kv:
                    p.kv[n][[P_FULL, P_WIN][n in WIN_L][k]] = torch.randn(H, BS, D)
            freed = t0 // chunk * chunk // BS  # vLLM's null block below the step's chunk
            table = tuple(0 if i < freed else b for i, b in enumerate(P_WIN))
            meta = step("c", t0, (tuple(P_FULL), table))
            p.w.run_orders(meta)
            p.w.after_forward(meta)
        got: set[str] = set()
        wait("the load", lambda: bool(got.update(d.w.get_finished([])[1]) or got))
        assert got == {"c-d"} and d.w.counters["load_failures"] == 0
        assert p.w.counters["sends"] == 1
        for k in range(10):
            assert torch.equal(d.kv[FULL_L][D_FULL[k]], p.kv[FULL_L][P_FULL[k]]), k
        for n in WIN_L:
            for k in (8, 9):
                assert torch.equal(d.kv[n][d_chunk[k]], p.kv[n][P_WIN[k]]), (n, k)
            assert not d.kv[n][0].any(), n  # the null block
            written = [b for b in range(NB) if d.kv[n][b].any()]
            assert written == [32, 33], (n, written)
        # the decode counts what both rooms wrote: 10 full blocks, 2 chunk blocks a layer
        assert d.w.counters["net_bytes"] == (10 + 2 * len(WIN_L)) * H * BS * D * 4
