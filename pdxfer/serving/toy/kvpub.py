"""A toy worker's KV events: its L2 prefix cache (``pdxfer.tiers``) observed and published
in vLLM's schema (``kv_events.EventPublisher``), so the router indexes the toy workers as it
does vLLM's. A page's hash is its tiers key; a scoped (tenant) run carries the scope as the
first block's extra key."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kv_events import BlockRemoved, BlockStored, EventPublisher


class KvEventsObserver:
    """A ``pdxfer.tiers.CacheObserver`` that publishes each call as one batch."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        self.pub = EventPublisher(endpoint, replay_endpoint)

    def stored(self, keys: Sequence[str], parent: str | None, tokens: np.ndarray,
               page_size: int, scope: str) -> None:
        extras = [[scope]] + [None] * (len(keys) - 1) if scope and parent is None else None
        self.pub.publish([BlockStored([bytes.fromhex(k) for k in keys],
                                      bytes.fromhex(parent) if parent else None,
                                      np.asarray(tokens, np.int64).tolist(), page_size,
                                      extra_keys=extras)])

    def removed(self, keys: Sequence[str]) -> None:
        if keys:
            self.pub.publish([BlockRemoved([bytes.fromhex(k) for k in keys])])

    def close(self) -> None:
        self.pub.close()
