"""TierCollector: a tier's statistics as Prometheus families on the engine's registry.

Read from tier.stats() at scrape time (the counters live in the tier, under its lock), labelled
by medium:
  kv_tier_queries_total / kv_tier_hits_total      blocks looked up past the device hits / found
  kv_tier_written_bytes_total / _read_bytes_total bytes stored into / loaded out of the tier
  kv_tier_dropped_writes_total                    offers dropped: the write queue was full
  kv_tier_evictions_total                         blocks removed to make room (LRU)
  kv_tier_dropped_files_total{reason}             blocks dropped as truncated/corrupted/foreign
  kv_tier_usage_bytes / kv_tier_capacity_bytes    occupancy
  kv_tier_load_seconds (summary)                  load_async -> done, per load
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from engine.kv_tier.base import KVTier
from engine.metrics import PREFIX


class TierCollector(Collector):
    """Exposes one tier's TierStats."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier

    def collect(self) -> Iterator:
        s = self.tier.stats()
        labels = ["medium"]
        value = [s.medium]

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=labels)
            family.add_metric(value, v)
            return family

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=labels)
            family.add_metric(value, v)
            return family

        yield counter(
            "kv_tier_queries", "KV tier lookups, in blocks past the device hits.", s.queries
        )
        yield counter("kv_tier_hits", "KV tier lookups, in leading blocks found.", s.hits)
        yield counter("kv_tier_written_bytes", "Bytes stored into the KV tier.", s.bytes_written)
        yield counter("kv_tier_read_bytes", "Bytes loaded from the KV tier.", s.bytes_read)
        yield counter(
            "kv_tier_dropped_writes",
            "Blocks offered to the KV tier and dropped (its write queue was full).",
            s.dropped_writes,
        )
        yield counter("kv_tier_evictions", "Blocks evicted from the KV tier.", s.evictions)
        files = CounterMetricFamily(
            f"{PREFIX}kv_tier_dropped_files",
            "Stored blocks dropped as unusable (never loaded as KV), by reason.",
            labels=["medium", "reason"],
        )
        files.add_metric([s.medium, "truncated"], s.truncated_dropped)
        files.add_metric([s.medium, "corrupted"], s.corrupted_dropped)
        files.add_metric([s.medium, "foreign"], s.foreign_dropped)
        yield files
        yield gauge("kv_tier_usage_bytes", "Bytes the KV tier holds.", s.usage_bytes)
        yield gauge("kv_tier_capacity_bytes", "The KV tier's byte bound.", s.capacity_bytes)
        latency = SummaryMetricFamily(
            f"{PREFIX}kv_tier_load_seconds",
            "Time from starting a KV tier load to its blocks being in place, in seconds.",
            labels=labels,
        )
        latency.add_metric(value, count_value=s.loads, sum_value=s.load_seconds)
        yield latency
