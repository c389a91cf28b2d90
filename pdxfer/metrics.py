"""Prometheus exposition of pdxfer's counters and request timelines.

Endpoints, the bootstrap server and the serving layer keep plain counters (cheap, lock-held
increments); this module turns a snapshot into Prometheus text on demand, so nothing on the
transfer path touches prometheus_client. Failures become one family labelled by ``kind``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

GAUGES = frozenset(
    {
        "active_rooms",
        "pending_requests",
        "quarantined_pages",
        "peers",
        "instances",
        "in_flight",
        "inflight",
        "free_pages",
        "outstanding",
        "running",
        "waiting",
        "tombstones",
        "push_sockets",
        "healthy_prefills",
        "healthy_decodes",
        "kv_feed_synced",
    }
)
"""Values that go up and down (everything else is a monotonic counter)."""
BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Timeline:
    """Histograms of request phase durations (bootstrap, waiting, transfer, restore, total)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._h: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, phase: str, seconds: float) -> None:
        with self._lock:
            counts, tot = self._h.setdefault(phase, ([0] * (len(BUCKETS) + 1), [0.0]))
            counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            tot[0] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        with self._lock:
            return {p: (list(c), t[0]) for p, (c, t) in self._h.items()}


class _Collector:
    def __init__(
        self,
        prefix: str,
        values: Callable[[], Mapping[str, float]],
        labels: Mapping[str, str],
        timeline: Timeline | None,
    ) -> None:
        self.prefix, self.values, self.labels, self.timeline = prefix, values, labels, timeline

    def collect(self) -> Iterable[Metric]:
        names, vals = list(self.labels), list(self.labels.values())
        failures = CounterMetricFamily(
            f"{self.prefix}_failures", "failed requests by kind", labels=[*names, "kind"]
        )
        for key, v in sorted(self.values().items()):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if key.startswith("failures_"):
                failures.add_metric([*vals, key.removeprefix("failures_")], v)
                continue
            name = f"{self.prefix}_{key}"
            fam: GaugeMetricFamily | CounterMetricFamily = (
                GaugeMetricFamily(name, key.replace("_", " "), labels=names)
                if key in GAUGES
                else CounterMetricFamily(name, key.replace("_", " "), labels=names)
            )
            fam.add_metric(vals, v)
            yield fam
        yield failures
        if self.timeline is not None:
            h = HistogramMetricFamily(
                f"{self.prefix}_request_phase_seconds",
                "request phase durations",
                labels=[*names, "phase"],
            )
            for phase, (counts, total) in sorted(self.timeline.snapshot().items()):
                cum, acc = [], 0
                for b, c in zip([*map(str, BUCKETS), "+Inf"], counts):
                    acc += c
                    cum.append((b, acc))
                h.add_metric([*vals, phase], cum, total)
            yield h


def prometheus_text(
    prefix: str,
    values: Callable[[], Mapping[str, float]],
    labels: Mapping[str, str] | None = None,
    timeline: Timeline | None = None,
) -> bytes:
    """Prometheus text for a counter snapshot (names ``<prefix>_<key>``)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(prefix, values, dict(labels or {}), timeline))
    return generate_latest(reg)
