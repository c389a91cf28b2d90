"""A toy worker's KV events: its L2 prefix cache (``pdxfer.tiers``) observed and published
in vLLM's schema (``kv_events.EventPublisher``), so the router indexes the toy workers as it
does vLLM's. A page's hash is its tiers key; a scoped (tenant) run carries the scope as the
first block's extra key. ``mute`` (fault injection, ``AFTER:COUNT``) drops COUNT batches after the
first AFTER, as a hung publisher would: nothing sent, nothing numbered, so no gap shows."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ..kv_events import BlockRemoved, BlockStored, EventPublisher


class KvEventsObserver:
    """A ``pdxfer.tiers.CacheObserver`` that publishes each call as one batch."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, mute: str = "") -> None:
        self.pub = EventPublisher(endpoint, replay_endpoint)
        after, _, count = mute.partition(":")
        self._after, self._count = (int(after), int(count)) if mute else (0, 0)
        self._lock = threading.Lock()

    def _publish(self, events: list[BlockStored] | list[BlockRemoved]) -> None:
        with self._lock:
            if self._after:
                self._after -= 1
            elif self._count:
                self._count -= 1
                return
        self.pub.publish(list(events))

    def stored(
        self,
        keys: Sequence[str],
        parent: str | None,
        tokens: np.ndarray,
        page_size: int,
        scope: str,
    ) -> None:
        extras = [[scope]] + [None] * (len(keys) - 1) if scope and parent is None else None
        self._publish(
            [
                BlockStored(
                    [bytes.fromhex(k) for k in keys],
                    bytes.fromhex(parent) if parent else None,
                    np.asarray(tokens, np.int64).tolist(),
                    page_size,
                    extra_keys=extras,
                )
            ]
        )

    def removed(self, keys: Sequence[str]) -> None:
        if keys:
            self._publish([BlockRemoved([bytes.fromhex(k) for k in keys])])

    def close(self) -> None:
        self.pub.close()
