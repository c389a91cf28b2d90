"""A vLLM step that computes nothing does not return at once while a transfer is under way.

vLLM's engine loop steps without pause while a request waits for its KV (a decode engaged
at dispatch waits through the prefill's whole forward) or a finished request's blocks are
being sent. Each such step reaches the connector's ``get_finished``, which waits there a
little for a transfer to end; a step that computes something never waits. Checked on the
worker with a clock that only the wait's own sleeps advance (no wall-clock bound)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from pdxfer import KVPoll
from pdxfer.integrations.vllm import config as C
from pdxfer.integrations.vllm import loader as L
from pdxfer.integrations.vllm import worker as W
from pdxfer.integrations.vllm.metadata import LoadOrder, PdxferMetadata
from pdxfer.transport import MemoryFabric, MemoryTransport


class Rx:
    """A load in flight; Success once ``done``."""

    room, failure = 7, None

    def __init__(self) -> None:
        self.done = False

    def poll(self) -> KVPoll:
        return KVPoll.Success if self.done else KVPoll.Transferring

    def stats(self) -> dict[str, float]:
        return {"bytes": 0, "seconds": 0.0}

    def abort(self, reason: str = "") -> None:
        pass


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[W.PdxferWorker, Rx, list[float]]]:
    w = W.PdxferWorker(
        C.parse("kv_consumer", {"bootstrap": "127.0.0.1:9"}, "m"), W.RankInfo(0, 1, 16, 1)
    )
    w.transport = MemoryTransport(MemoryFabric())
    w.register_kv_caches({"model.layers.0.attn": torch.zeros(4, 1, 16, 8)})
    assert w.loader is not None
    rx = Rx()
    order = LoadOrder("a", 7, "127.0.0.1:9", None, (1, 2), 0, 20)
    w.loader._loads["a"] = L._Load(order, rx, [1, 2])  # type: ignore[arg-type]
    slept: list[float] = []
    # a fake clock from 0: from the host's monotonic value (uptime, in seconds), adding 0.5 ms
    # steps rounds differently with the uptime, and the poll count with it
    clock = [0.0]

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(W, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    yield w, rx, slept
    w.close()


def test_a_step_that_computes_something_never_waits_for_a_transfer(setup) -> None:
    w, rx, slept = setup
    w.run_orders(PdxferMetadata())
    assert w.get_finished([]) == (set(), set())
    assert slept == []


def test_a_step_that_computes_nothing_waits_for_a_load_to_end(setup, monkeypatch) -> None:
    w, rx, slept = setup
    w.run_orders(PdxferMetadata(idle=True))
    monkeypatch.setattr(W.time, "sleep", lambda s: (slept.append(s), setattr(rx, "done", True)))
    assert w.get_finished([]) == (set(), {"a"})  # reported in the step it ended in
    assert len(slept) == 1


def test_the_wait_of_a_step_that_computes_nothing_is_bounded(setup) -> None:
    w, rx, slept = setup
    w.run_orders(PdxferMetadata(idle=True))
    assert w.get_finished([]) == (set(), set())
    # at least the bound, at most one poll more (float sums: a nanosecond of slack)
    assert W.IDLE_WAIT_S - 1e-9 <= sum(slept) <= W.IDLE_WAIT_S + W.IDLE_POLL_S + 1e-9
    slept.clear()
    assert w.get_finished(["a"]) == (set(), set())  # vLLM ends a request: no wait
    assert slept == []
