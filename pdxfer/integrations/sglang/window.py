"""Which pages of SGLang's sliding-window (SWA) pool a request moves. Pure: no SGLang import.

SGLang's prefill and decode each hand over the SWA pages of the window of the last prompt
token only, ``[start, n)`` with ``start`` the page-aligned ``max(prefix, n - window)``, as
window-translated page ids (``translate_swa_indices_for_transfer``). pdxfer moves one token
range per pool and room, so the SWA pool travels in a room of its own (``window_room``): the
prefill sends its window's pages after ``start // page`` never-read pages, the decode asks
for ``[start, n)``. Both sides find ``start`` from what SGLang gave them (the window ends at
the prompt's last page), and a prefill refuses a decode whose window starts elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdxfer import ConfigError

UNREAD = 0
"""The page id the prefill gives the pages before its window: never read, as the main room's
prefix pages (the decode asks from the window's start, checked first; a -1 would trip the
head-slice planner's range check, which covers the whole chunk)."""


def window_room(room: int) -> int:
    """The SWA pool's room for SGLang's ``bootstrap_room`` (a bijection of 63-bit rooms)."""
    return (room * 0x9E3779B97F4A7C15 + 0x5157A) & ((1 << 63) - 1)


def swa_pages(state_indices: Any, i: int | None) -> np.ndarray | None:
    """The SWA page ids in SGLang's ``state_indices[i]`` (an array, or a list of them)."""
    if i is None or not state_indices or i >= len(state_indices) or state_indices[i] is None:
        return None
    x = state_indices[i]
    if isinstance(x, (list, tuple)):
        parts = [
            np.asarray(getattr(v, "cpu", lambda v=v: v)(), dtype=np.int64).reshape(-1) for v in x
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.asarray(getattr(x, "cpu", lambda: x)(), dtype=np.int64).reshape(-1)


def start_page(total_pages: int, window_pages: int, room: int) -> int:
    """The window's first page: the window ends at the prompt's last page."""
    if not 0 < window_pages <= total_pages:
        raise ConfigError(
            f"room {room}: {window_pages} SWA pages for a prompt of "
            f"{total_pages} pages (SGLang's window ends at the last prompt page)"
        )
    return total_pages - window_pages


def mismatch(room: int, prefill_start: int, decode_start: int, page: int, n_pages: int) -> str:
    """Why a prefill refuses a decode that asks for another SWA window."""
    return (
        f"room {room}: sliding-window mismatch: the prefill's SWA pages cover tokens "
        f"[{prefill_start * page}, {n_pages * page}), the decode asks for "
        f"[{decode_start}, {n_pages * page}); both sides must run the same sliding window "
        f"size (SGLang's sliding_window_size)"
    )
