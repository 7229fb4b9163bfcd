"""The shared-memory transport's Prometheus metrics: what the pool placed, released and took back, why
offered items went as chunks, and the pool's size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .pool import ShmSegments


class ShmCollector(Collector):
    """The shared-memory pool's counts, read at each scrape (plain reads: the scrape runs on another thread)."""

    def __init__(self, segments: ShmSegments):
        self.segments = segments

    def collect(self) -> Iterator:
        segments = self.segments
        stats = segments.stats
        yield CounterMetricFamily(
            "encoder_shm_items", "Items whose payload was handed over in a shared-memory segment", value=stats.items
        )
        yield CounterMetricFamily("encoder_shm_bytes", "Payload bytes written into shared-memory segments", value=stats.bytes)
        yield CounterMetricFamily(
            "encoder_shm_segments_released", "Announced segments their receiver released", value=stats.released
        )
        reclaimed = CounterMetricFamily(
            "encoder_shm_segments_reclaimed",
            "Announced segments the server took back: after the release timeout, or when the call ended early",
            labels=["reason"],
        )
        reclaimed.add_metric(["timeout"], stats.reclaimed_timeout)
        reclaimed.add_metric(["cancel"], stats.reclaimed_cancel)
        yield reclaimed
        fallbacks = CounterMetricFamily(
            "encoder_shm_fallbacks", "Items offered shared memory that went as chunks, by reason", labels=["reason"]
        )
        for reason, count in sorted(dict(stats.fallbacks).items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        pool = segments.pool()
        yield GaugeMetricFamily("encoder_shm_pool_segments", "Shared-memory segments held, announced or warm", value=pool.segments)
        yield GaugeMetricFamily("encoder_shm_pool_bytes", "Bytes of shared-memory segments held", value=pool.bytes)
        yield GaugeMetricFamily(
            "encoder_shm_pool_peak_bytes", "Most bytes of shared-memory segments held at once", value=stats.peak_bytes
        )
