"""The router's ``/metrics`` page: its counters, its workers' load and health, the door, and
the KV event feeds (in total, and each worker's feed labelled by the worker)."""

from __future__ import annotations

import collections
from typing import Any

from ..http import merge_metrics, metrics_text
from .backends import Decode, Prefill
from .door import Door
from .kv_feed import KvFeeds
from .kv_stale import StaleCheck


class Metrics:
    """What ``/metrics`` shows, read from the parts that count it."""

    def __init__(
        self,
        counters: collections.Counter[str],
        prefills: list[Prefill],
        decodes: list[Decode],
        door: Door,
        kv: KvFeeds | None,
        stale: StaleCheck | None,
    ) -> None:
        self.counters, self.prefills, self.decodes = counters, prefills, decodes
        self.door, self.kv, self.stale = door, kv, stale

    def text(self) -> str:
        """The page in Prometheus' text format."""
        vals: dict[str, Any] = dict(self.counters)
        vals["outstanding"] = sum(d.outstanding for d in self.decodes)
        vals["healthy_prefills"] = sum(p.healthy for p in self.prefills)
        vals["healthy_decodes"] = sum(d.healthy for d in self.decodes)
        vals["waiting"] = self.door.waiting
        vals["held_at_door"] = self.door.held
        vals["refused_at_door"] = self.door.refused
        if self.kv is not None:
            if self.stale is not None:
                self.stale.sweep()
            feeds = self.kv.feeds.values()
            vals["kv_feeds_synced"] = sum(f.synced for f in feeds)
            vals["kv_indexed_blocks"] = sum(len(ix) for ix in self.kv.indexes.values())
            for k in (
                "batches",
                "gaps",
                "resets",
                "replays",
                "replayed",
                "bad_frames",
                "misses",
                "unpublished",
                "stale",
            ):
                vals[f"kv_events_{k}"] = sum(f.counters[k] for f in feeds)
        text = metrics_text("pdxfer_router", vals)
        if self.kv is not None:  # and each worker's feed, labelled by the worker
            text = merge_metrics(
                [
                    (text, {}),
                    *(
                        (metrics_text("pdxfer_router", v), {"worker": w})
                        for w, v in self.kv.per_worker().items()
                    ),
                ]
            )
        return text
