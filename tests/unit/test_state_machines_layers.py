"""Partial-layer rooms through both state machines (one process, the in-memory transport):
the decode's room succeeds only once every layer of every token arrived; sends that break
a layer's token order are refused before anything is written; a digest that claims layers
the sender's pool does not hold fails the room instead of counting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdxfer import BootstrapServer, KVPoll, PlanError, wire
from pdxfer.agents import patterns as pat
from tests.harness.memory_pair import Pair, rooms, until, wait

PS = 4
LONG = 60.0
"""A bound on each wait (never a timing assertion: a loaded machine only makes it slower)."""


@pytest.fixture(scope="module")
def srv() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


@pytest.fixture
def pair(srv: BootstrapServer) -> Iterator[Pair]:
    p = Pair(srv, bootstrap_timeout_s=LONG, transfer_timeout_s=LONG)
    yield p
    p.close()


def _pages(src: list[int], t0: int, t1: int) -> list[int]:
    return src[t0 // PS : -(-t1 // PS)]


def _layer_landed(p: Pair, room: int, dst: list[int], tokens: int, layer: int) -> bool:
    spec = p.dspecs[0]
    keep = [i for i, b in enumerate(spec.buffers) if b.layer_id == layer]
    sub = spec.with_(buffers=tuple(spec.buffers[i] for i in keep))
    bad, _ = pat.check_tokens(sub, [p.dt["kv"][i] for i in keep], room, np.array(dst), 0, 0, tokens)
    return bad == 0


def _open(p: Pair, tokens: int) -> tuple[Any, Any, int, list[int], list[int]]:
    room = next(rooms)
    src, dst = p.pages(-(-tokens // PS))
    p.fill(room, src, tokens)
    rx = p.receiver(room)
    rx.request({"kv": dst}, {"aux": 2}, 0, tokens)
    return p.pf.sender(room), rx, room, src, dst


def test_a_streamed_room_succeeds_only_after_its_last_layer_landed(pair: Pair) -> None:
    tx, rx, room, src, dst = _open(pair, 10)
    tx.send({"kv": _pages(src, 0, 6)}, layers=(0, 1), tokens=(0, 6))
    tx.send({"kv": _pages(src, 0, 6)}, layers=(1, 2), tokens=(0, 6))
    tx.send({"kv": _pages(src, 6, 10)}, layers=(0, 1), tokens=(6, 10))
    assert until(lambda: _layer_landed(pair, room, dst, 10, 0), timeout=LONG)
    assert rx.poll() == KVPoll.WaitingForInput and tx.poll() == KVPoll.WaitingForInput
    assert not _layer_landed(pair, room, dst, 10, 1)  # tokens [6, 10) of layer 1 are missing
    tx.send({"kv": _pages(src, 6, 10)}, {"aux": 1}, last=True, layers=(1, 2), tokens=(6, 10))
    assert wait(rx, LONG) == KVPoll.Success and wait(tx, LONG) == KVPoll.Success, rx.failure
    assert pair.wrong_bytes(room, dst, 10) == 0


def test_sends_that_break_a_layers_token_order_are_refused_before_any_write(pair: Pair) -> None:
    tx, rx, room, src, dst = _open(pair, 8)
    tx.send({"kv": _pages(src, 0, 5)}, layers=(0, 1), tokens=(0, 5))
    for bad in [
        dict(layers=(0, 1), tokens=(0, 5)),  # the same layer and tokens again
        dict(layers=(0, 2), tokens=(5, 8)),  # layer 1 has not started
        dict(layers=(1, 2), tokens=(2, 8)),  # a gap in layer 1
        dict(layers=(2, 3), tokens=(0, 5)),  # a layer the pools do not have
        dict(layers=(1, 1), tokens=(0, 5)),
        dict(layers=("a", 1), tokens=(0, 5)),
    ]:
        with pytest.raises(PlanError):
            tx.send({"kv": _pages(src, *bad["tokens"]) if bad["tokens"][0] < 8 else []}, **bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError):  # the pages must be the ones holding the tokens
        tx.send({"kv": src}, layers=(1, 2), tokens=(0, 4))
    # nothing refused was queued: the room completes from the valid sends alone, exactly
    tx.send({"kv": _pages(src, 0, 8)}, layers=(1, 2), tokens=(0, 8))
    tx.send({"kv": _pages(src, 5, 8)}, {"aux": 1}, last=True, layers=(0, 1), tokens=(5, 8))
    assert wait(rx, LONG) == KVPoll.Success, rx.failure
    assert pair.wrong_bytes(room, dst, 8) == 0


def test_a_digest_claiming_layers_the_sender_lacks_fails_the_room(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pair.pf.prefill is not None
    side = pair.pf.prefill.writer
    real = side._digest_chunk

    def forged(t: Any, chunk: Any, mode: str) -> None:
        real(t, chunk, mode)
        d = t.digests[-1]
        t.digests[-1] = wire.Digest(d.pool, d.start, d.end, d.lo, d.hi, d.values, 7, 9)

    monkeypatch.setattr(side, "_digest_chunk", forged)
    tx, rx, room, src, dst = _open(pair, 8)
    tx.send({"kv": src}, layers=(0, 1), tokens=(0, 8))
    tx.send({"kv": src}, {"aux": 1}, last=True, layers=(1, 2), tokens=(0, 8))
    assert wait(rx, LONG) == KVPoll.Failed and rx.failure.kind == "integrity", rx.failure
    assert "layers [7, 9)" in str(rx.failure)
