"""KV-aware choice of one worker: the longest cached prefix weighed against load.

A worker's cost is the prompt tokens it would compute (those it does not hold) plus
``load_weight`` prompts' worth of tokens per request it already has outstanding; the least
cost wins, ties going to the less loaded and then the less used worker. A worker nothing is
known of counts as holding nothing, so a stale or dropped index degrades to least
outstanding, never to worse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

LOAD_WEIGHT = 0.5


class Loaded(Protocol):
    @property
    def key(self) -> str: ...

    outstanding: int
    used: int


W = TypeVar("W", bound=Loaded)


def choose(workers: Sequence[W], held: Callable[[W], int], n_tokens: int,
           load_weight: float = LOAD_WEIGHT) -> tuple[W, int]:
    """The cheapest worker and how many leading prompt tokens it holds."""
    per_load = load_weight * max(n_tokens, 1)
    best: W | None = None
    best_cost: tuple[float, int, int] | None = None
    best_held = 0
    for w in workers:
        h = min(held(w), n_tokens)
        cost = (n_tokens - h + per_load * w.outstanding, w.outstanding, w.used)
        if best_cost is None or cost < best_cost:
            best, best_cost, best_held = w, cost, h
    assert best is not None, "choose() needs at least one worker"
    return best, best_held
