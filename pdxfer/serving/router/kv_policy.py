"""KV-aware choice of one worker: the longest cached prefix weighed against load.

A worker's cost is the prompt tokens it would compute (those it does not hold) plus
``load_weight`` prompts' worth of tokens per request it already has outstanding; the least
cost wins, ties going to the less loaded and then the less used worker. A worker nothing is
known of counts as holding nothing, so a stale or dropped index degrades to least
outstanding, never to worse.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Protocol, TypeVar

LOAD_WEIGHT = 0.5


class Loaded(Protocol):
    @property
    def key(self) -> str: ...

    outstanding: int
    used: int


W = TypeVar("W", bound=Loaded)
_LOAD = operator.attrgetter("outstanding", "used")


Held = Sequence[tuple[int, Sequence[str]]]
"""Leading prompt tokens held, and the keys of the workers holding that many."""


def choose(workers: Sequence[W], held: Held, n_tokens: int,
           load_weight: float = LOAD_WEIGHT) -> tuple[W, int]:
    """The cheapest worker and how many leading prompt tokens it holds (workers ``held``
    does not name hold none). Per group of equal holdings the least loaded is the
    cheapest, so a fleet is looked at group by group, not worker by worker."""
    per_load = load_weight * max(n_tokens, 1)
    best = min(workers, key=_LOAD)
    best_cost = (n_tokens + per_load * best.outstanding, best.outstanding, best.used)
    best_held = 0
    if held:
        by_key = {w.key: w for w in workers}
        for h, keys in held:
            members = [by_key[k] for k in keys if k in by_key]
            if h <= 0 or not members:
                continue
            w = min(members, key=_LOAD)
            h = min(h, n_tokens)
            cost = (n_tokens - h + per_load * w.outstanding, w.outstanding, w.used)
            if cost < best_cost:
                best, best_cost, best_held = w, cost, h
    return best, best_held
