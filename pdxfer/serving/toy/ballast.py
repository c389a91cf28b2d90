"""KV ballast: a benchmark device that gives the toy model a real model's KV size per token.

The toy model's KV is 768 bytes per token, so moving or restoring a prompt costs nothing next
to computing it, and a benchmark of KV movement measures the toy's compute. ``pdxfer prefill``
and ``pdxfer decode`` with ``--kv-ballast-bytes-per-token N`` add a sidecar pool ``ballast``
of ``N`` bytes per token that follows the KV's page ids (``indices_from="kv"``): it travels in
every transfer with the KV, enters L2/L3 with it and is restored with it, under the same
integrity checks, so it costs what a model with ``N`` more bytes of KV per token would.

Its bytes are a function of (token id, position): the prefill writes them as it computes the
prompt, and the decode checks a received or restored prompt's ballast against what its tokens
give and fails the request when they differ. The ballast is thus also an end-to-end check that
the right bytes landed at the right place (the toy's KV itself is checked only by the tokens it
yields). Generated tokens get no ballast: only prompts are transferred and restored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .kv import PageTable

WORD = 8
"""Ballast is written in uint64 words: ``N`` must be a multiple of 8."""
_MIX = np.uint64(0x9E3779B97F4A7C15)
_STEP = np.uint64(0xD6E8FEB86659FD93)
CHECK_COLUMNS = 64
"""Words per token the decode checks for every prompt token (besides whole rows of a few):
a damaged page or a page written one page off changes all of them."""
FULL_ROWS = 4


class BallastMismatch(ValueError):
    """A prompt's ballast on the decode is not what its tokens give: a wrong or damaged page."""


def validate(nbytes: int) -> None:
    if nbytes < 0 or nbytes % WORD:
        raise ValueError(
            f"kv_ballast_bytes_per_token must be a non-negative multiple of {WORD}, got {nbytes}"
        )


class Ballast:
    """The ballast pool of one worker: ``[num_pages, page_size, N]`` bytes, page ids shared
    with the KV pool."""

    def __init__(self, nbytes: int, num_pages: int, page_size: int) -> None:
        validate(nbytes)
        if nbytes == 0:
            raise ValueError("no ballast pool for 0 bytes per token")
        self.nbytes, self.page_size = nbytes, page_size
        # empty, not zeros: pages never used cost no memory (a prompt's positions are always
        # written before they are read)
        self.tensor = torch.empty((num_pages, page_size, nbytes), dtype=torch.uint8)
        words = nbytes // WORD
        self.rows = self.tensor.numpy().view(np.uint64).reshape(num_pages * page_size, words)
        self._ramp = np.arange(words, dtype=np.uint64) * _STEP
        k = min(CHECK_COLUMNS, words)
        self._cols = np.unique(np.linspace(0, words - 1, k).astype(np.int64))

    def _seeds(self, tokens: Sequence[int], start: int) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.uint64)
        pos = np.arange(start, start + t.size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return ((pos << np.uint64(24)) ^ t ^ np.uint64(0x5BD1E995)) * _MIX

    def _row_ids(self, pages: PageTable, start: int, n: int) -> np.ndarray:
        pt = np.asarray(pages, dtype=np.int64)
        pos = np.arange(start, start + n, dtype=np.int64)
        return pt[pos // self.page_size] * self.page_size + pos % self.page_size

    def expected(
        self, tokens: Sequence[int], start: int, cols: np.ndarray | None = None
    ) -> np.ndarray:
        """The words of positions ``start..`` holding ``tokens`` (all words, or ``cols``)."""
        ramp = self._ramp if cols is None else self._ramp[cols]
        with np.errstate(over="ignore"):
            return np.add.outer(self._seeds(tokens, start), ramp)

    def fill(self, tokens: Sequence[int], start: int, pages: PageTable) -> None:
        """Write the ballast of positions ``[start, start + len(tokens))``."""
        if len(tokens):
            self.rows[self._row_ids(pages, start, len(tokens))] = self.expected(tokens, start)

    def check(self, tokens: Sequence[int], pages: PageTable) -> None:
        """Raise ``BallastMismatch`` unless the prompt's ballast is what its tokens give:
        ``CHECK_COLUMNS`` words of every token and whole rows of ``FULL_ROWS`` tokens (the
        first, the last and evenly spread ones)."""
        n = len(tokens)
        if not n:
            return
        ids = self._row_ids(pages, 0, n)
        got = self.rows[np.ix_(ids, self._cols)]
        bad = np.flatnonzero((got != self.expected(tokens, 0, self._cols)).any(axis=1))
        if not bad.size:
            full = np.unique(np.linspace(0, n - 1, min(FULL_ROWS, n)).astype(np.int64))
            rows = self.rows[ids[full]]
            want = np.stack([self.expected([tokens[i]], int(i))[0] for i in full])
            bad = full[(rows != want).any(axis=1)]
        if bad.size:
            p = int(bad[0])
            raise BallastMismatch(
                f"KV ballast of {bad.size} prompt position(s) is not what the tokens give "
                f"(first: position {p}, page {int(np.asarray(pages)[p // self.page_size])})"
            )
