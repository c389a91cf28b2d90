"""The connector's figures in vLLM's own metrics: its periodic log line and ``/metrics``.

vLLM asks each worker for the stats of the last step (``get_kv_connector_stats``), sums them
over the TP ranks (``aggregate``), ships the plain ``data`` dict to the front end, rebuilds it
there with ``build_kv_connector_stats`` for the log line (``reduce``) and hands it to
``PdxferPromMetrics.observe`` for Prometheus. So ``data`` holds only numbers and lists of
numbers: counters since the last step, and one entry per finished load for the histograms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS: dict[str, str] = {
    "sends": "requests whose KV this prefill sent",
    "send_failures": "sends that failed (the decode recomputes or fails the request)",
    "step_chunks": "steps whose computed KV was handed to the sender before the prompt's "
    "end (prefill)",
    "prompt_steps": "steps that computed part of the prompt of a request to send, one per "
    "request (prefill; how vLLM chunked them)",
    "layer_sends": "layer-wise hand-offs to the sender (prefill, send_by layer)",
    "streamed_steps": "steps whose layers went to the sender one by one as computed, the "
    "decode having asked before the step (prefill, send_by layer)",
    "sent_tokens": "prompt tokens whose KV this prefill sent",
    "loads": "requests whose KV this decode received or restored",
    "load_failures": "loads that failed (blocks reported to vLLM as load errors)",
    "loaded_tokens": "prompt tokens whose KV this decode received or restored",
    "net_bytes": "KV bytes this decode received over the network",
    "restored_l2_pages": "blocks restored from host DRAM (L2) instead of the network",
    "restored_l3_pages": "blocks restored from storage (L3) instead of the network",
    "repaired_tokens": "tokens a short restore had the prefill send after all",
    "writebacks": "finished requests written back to the decode's tiers",
    "writeback_failures": "write-backs that failed (a later request misses them)",
    "untrusted_refused": "requests naming a bootstrap server this decode does not trust "
    "(served without pdxfer, never paired)",
}
"""Counters carried per step (each also in the worker's cumulative ``stats()``)."""

SERIES: dict[str, str] = {
    "ready_seconds": "per load, from the decode's request to its KV in place (network and restore)",
    "load_bytes": "per load, KV bytes received over the network",
}
"""Per-load observations, for histograms."""


@dataclass
class PdxferStats(KVConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> PdxferStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data[k] = [*self.data.get(k, []), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS if d.get(k)}
        ready = d.get("ready_seconds") or []
        if ready:
            out["ready_ms_mean"] = round(1e3 * sum(ready) / len(ready), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PdxferPromMetrics(KVConnectorPromMetrics):
    """``vllm:pdxfer_<counter>_total`` for every counter, and histograms of the per-load
    time to KV in place and bytes received, labelled per engine as vLLM's own metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:pdxfer_{k}", documentation=f"pdxfer: {doc}.", labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for k, doc in COUNTERS.items()
        }
        buckets = {
            "ready_seconds": [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
            "load_bytes": [float(1 << s) for s in range(12, 36, 2)],
        }
        self.series = {
            k: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:pdxfer_{k}",
                    documentation=f"pdxfer: {doc}.",
                    buckets=buckets[k],
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for k, doc in SERIES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
            elif k in self.series:
                for x in v:
                    self.series[k][engine_idx].observe(x)
