"""What the tiers tell an observer about their L2 index: runs of pages stored (with their
token ids and the page before them), pages gone, all gone. A serving layer turns these into
KV events (the router's view of which worker holds which prefix); the tiers know nothing
of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class CacheObserver(Protocol):
    def stored(
        self,
        keys: Sequence[str],
        parent: str | None,
        tokens: np.ndarray,
        page_size: int,
        scope: str,
    ) -> None:
        """Pages ``keys`` (consecutive, after page ``parent`` or first) entered L2, holding
        ``tokens`` (``len(keys) * page_size``); ``scope``: the request's key scope."""

    def removed(self, keys: Sequence[str]) -> None:
        """Pages left L2 (evicted or cleared)."""
