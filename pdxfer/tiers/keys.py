"""Prefix keys: a hash chain over full pages of token ids.

``h_i = sha256(h_{i-1} || salt || int32 tokens of page i)``: equal prefixes give equal keys on
every process and machine (Python's ``hash()`` is salted per process, so it is never used),
which is what lets L3 be shared by a fleet. A partial last page has no key: only full pages
are cached. The key of one pool's part of a page is derived from the page key and the pool's
name, so a group's pools never collide and need no second index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError


def page_keys(tokens: Sequence[int] | np.ndarray, page_size: int, salt: str = "") -> list[str]:
    """One hex key per FULL page of ``tokens``; ``salt`` separates models or layouts."""
    if page_size <= 0:
        raise ConfigError(f"page_size must be > 0, got {page_size}")
    a = np.asarray(tokens, dtype=np.int64)
    if a.ndim != 1:
        raise ConfigError("tokens must be one-dimensional")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << 31):
        raise ConfigError("token ids must be in [0, 2^31)")
    raw = a.astype("<i4")
    prev = hashlib.sha256(b"pdxfer-prefix-v1|" + salt.encode()).digest()
    out: list[str] = []
    for i in range(a.size // page_size):
        h = hashlib.sha256(prev)
        h.update(raw[i * page_size : (i + 1) * page_size].tobytes())
        prev = h.digest()
        out.append(prev.hex()[:40])
    return out


def pool_key(page_key: str, pool: str) -> str:
    """The storage key of ``pool``'s part of the page ``page_key``."""
    return f"{page_key}.{pool}"
