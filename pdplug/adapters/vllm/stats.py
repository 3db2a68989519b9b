"""PdplugConnector's transfer counters as vLLM KV-connector stats and Prometheus metrics.

Each prefill worker reports the bytes its KV sender posted and the rooms that ended, as the
difference since its last report (:class:`PdplugKVConnectorStats`); vLLM aggregates the
workers' stats, logs them, and :class:`PdplugPromMetrics` adds them to the engine's
``/metrics`` as ``vllm:pdplug_bytes_transferred_total``, ``vllm:pdplug_rooms_started_total``,
``vllm:pdplug_rooms_succeeded_total`` and ``vllm:pdplug_rooms_failed_total`` (what ``pdplug
bench vllm`` checks; started minus succeeded minus failed is what the prefill ranks still hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["PdplugKVConnectorStats", "PdplugPromMetrics", "COUNTERS"]

#: stats key -> (Prometheus counter name without ``_total``, help text)
COUNTERS = {
    "bytes": ("vllm:pdplug_bytes_transferred", "KV bytes posted by pdplug's KV senders"),
    "rooms_started": ("vllm:pdplug_rooms_started", "pdplug rooms (requests) a prefill rank took"),
    "rooms_ok": ("vllm:pdplug_rooms_succeeded", "pdplug rooms (requests) sent whole"),
    "rooms_failed": ("vllm:pdplug_rooms_failed", "pdplug rooms (requests) that failed"),
}


@dataclass
class PdplugKVConnectorStats(KVConnectorStats):
    """Counters of one interval: ``data[key]`` is an int per :data:`COUNTERS` key (bytes,
    rooms)."""

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        """Every counter back to 0."""
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters to these (another worker, or a replayed interval)."""
        for k in COUNTERS:
            self.data[k] = int(self.data.get(k, 0)) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters as ``{key: int}`` (what vLLM logs)."""
        return {k: int(self.data.get(k, 0)) for k in COUNTERS}

    def is_empty(self) -> bool:
        """No counter moved in this interval."""
        return not any(self.data.get(k) for k in COUNTERS)


class PdplugPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` key, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in COUNTERS.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters (``reduce()``'d stats) to engine ``engine_idx``'s
        Prometheus counters."""
        for key, per_engine in self.counters.items():
            n = int(transfer_stats_data.get(key, 0))
            if n and engine_idx in per_engine:
                per_engine[engine_idx].inc(n)
