"""KV-aware choice of one worker: the longest cached prefix weighed against load.

A worker's cost is the prompt tokens it would compute (those it does not hold) plus its
load: for a worker that counts its ``pending`` prompt tokens (a prefill: what the requests
sent to it still have to compute), those; else ``load_weight`` prompts' worth of tokens per
request it has outstanding. The least cost wins, ties going to the less loaded and then
the less used worker. A worker nothing is
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
_PENDING = operator.attrgetter("pending", "outstanding", "used")


Held = Sequence[tuple[int, Sequence[str]]]
"""Leading prompt tokens held, and the keys of the workers holding that many."""


def choose(workers: Sequence[W], held: Held, n_tokens: int,
           load_weight: float = LOAD_WEIGHT) -> tuple[W, int]:
    """The cheapest worker and how many leading prompt tokens it holds (workers ``held``
    does not name hold none). Per group of equal holdings the least loaded is the
    cheapest, so a fleet is looked at group by group, not worker by worker."""
    per_load = load_weight * max(n_tokens, 1)
    pending = bool(workers) and hasattr(workers[0], "pending")
    order = _PENDING if pending else _LOAD

    def cost(w: W, h: int) -> tuple[float, int, int]:
        load = w.pending if pending else per_load * w.outstanding  # type: ignore[attr-defined]
        return (n_tokens - h + load, w.outstanding, w.used)

    best = min(workers, key=order)
    best_cost = cost(best, 0)
    best_held = 0
    if held:
        by_key = {w.key: w for w in workers}
        for h, keys in held:
            members = [by_key[k] for k in keys if k in by_key]
            if h <= 0 or not members:
                continue
            w = min(members, key=order)
            h = min(h, n_tokens)
            c = cost(w, h)
            if c < best_cost:
                best, best_cost, best_held = w, c, h
    return best, best_held
