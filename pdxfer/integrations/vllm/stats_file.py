"""A worker rank's stats as a JSON file (``stats_file``; ``.dp<rank>`` added under DP, ``.tp<rank>`` under TP), for
tests and tools that read a running server's figures without scraping ``/metrics``.

Rewritten whole, through a temporary file and a rename: a reader never sees half of it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from .rank import RankInfo

log = logging.getLogger(__name__)


class StatsFile:
    def __init__(self, path: str, rank: RankInfo, dp_rank: int = 0, dp_size: int = 1) -> None:
        if path and dp_size > 1:  # each data-parallel rank is an engine of its own
            path = f"{path}.dp{dp_rank}"
        self.path = f"{path}.tp{rank.tp_rank}" if path and rank.tp_size > 1 else path
        """Empty: no file is written."""

    def write(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Rewrite the file with ``stats()`` (not called when there is no file)."""
        if not self.path:
            return
        try:
            d = os.path.dirname(os.path.abspath(self.path))
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".pdxfer-stats")
            with os.fdopen(fd, "w") as f:
                json.dump(stats(), f, default=str)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot write stats to %s: %s", self.path, e)
