"""What a worker rank counted: since it started (its stats file) and since vLLM last asked
(``stats.py`` turns that into vLLM's log line and ``/metrics``).

The sender and the loader count into the one ``Counters`` their worker hands them.
"""

from __future__ import annotations

from typing import Any

NAMES = (
    "sends",
    "send_failures",
    "step_chunks",
    "layer_sends",
    "streamed_steps",
    "sent_tokens",
    "loads",
    "load_failures",
    "loaded_tokens",
    "net_bytes",
    "net_us",
    "ready_us",
    "restore_us",
    "restored_pages",
    "restored_l2_pages",
    "restored_l3_pages",
    "repaired_tokens",
    "writebacks",
    "writeback_failures",
)


class Counters:
    def __init__(self) -> None:
        self.totals: dict[str, int] = dict.fromkeys(NAMES, 0)
        """Every count since the rank started."""
        self._interval: dict[str, Any] = {}
        """Counts and per-load figures since vLLM last asked (``take_interval``)."""

    def add(self, key: str, n: int = 1) -> None:
        self.totals[key] += n
        self._interval[key] = self._interval.get(key, 0) + n

    def observe(self, key: str, value: float) -> None:
        """One load's figure for a histogram (``stats.SERIES``)."""
        self._interval.setdefault(key, []).append(value)

    def take_interval(self) -> dict[str, Any] | None:
        """What was counted since the last call (vLLM asks after every step), or None."""
        if not any(self._interval.values()):
            return None
        out, self._interval = self._interval, {}
        return out
