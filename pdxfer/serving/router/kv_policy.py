"""KV-aware choice of one worker: the longest cached prefix weighed against load.

A worker's cost is the prompt tokens it would compute (those it does not hold) plus its
load, in the same tokens: for a prefill, the prompt tokens the requests already sent to it
still have to compute (``pending``: each counts from its choice until its first token);
for a decode, ``load_weight`` prompts' worth per request it has outstanding. The least cost
wins, ties going to the less loaded and then the less used worker. A worker nothing is
known of counts as holding nothing, so a stale or dropped index degrades to least loaded,
never to worse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Loaded(Protocol):
    @property
    def key(self) -> str: ...

    outstanding: int
    used: int


W = TypeVar("W", bound=Loaded)
Load = Callable[[W], float]
"""A worker's load in prompt tokens."""

Held = Sequence[tuple[int, Sequence[str]]]
"""Leading prompt tokens held, and the keys of the workers holding that many."""


def per_request(load_weight: float, n_tokens: int) -> Load[W]:
    """A decode's load: ``load_weight`` prompts of ``n_tokens`` per outstanding request."""
    per = load_weight * max(n_tokens, 1)
    return lambda w: per * w.outstanding


def pending_tokens(w: W) -> float:
    """A prefill's load: the prompt tokens it still has to compute."""
    return float(w.pending)  # type: ignore[attr-defined]


def choose(workers: Sequence[W], held: Held, n_tokens: int, load: Load[W]) -> tuple[W, int]:
    """The cheapest worker and how many leading prompt tokens it holds (workers ``held``
    does not name hold none). Per group of equal holdings the least loaded is the
    cheapest, so a fleet is looked at group by group, not worker by worker."""

    def order(w: W) -> tuple[float, int, int]:
        return load(w), w.outstanding, w.used

    best = min(workers, key=order)
    best_cost = (n_tokens + load(best), best.outstanding, best.used)
    best_held = 0
    if held:
        by_key = {w.key: w for w in workers}
        for h, keys in held:
            members = [by_key[k] for k in keys if k in by_key]
            if h <= 0 or not members:
                continue
            w = min(members, key=order)
            h = min(h, n_tokens)
            cost = (n_tokens - h + load(w), w.outstanding, w.used)
            if cost < best_cost:
                best, best_cost, best_held = w, cost, h
    return best, best_held
