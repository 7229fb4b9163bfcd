"""The transfer engine's Prometheus metrics: what it wrote into receivers' slots, how long the writes
took, and why offered items went as chunks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .writer import MooncakeWriter


class MooncakeCollector(Collector):
    """The engine's counts, read at each scrape (plain reads: the scrape runs on another thread)."""

    def __init__(self, writer: MooncakeWriter):
        self.writer = writer

    def collect(self) -> Iterator:
        stats = self.writer.stats
        yield CounterMetricFamily(
            "encoder_mooncake_items",
            "Items whose payload the transfer engine wrote into a receiver's slot",
            value=stats.items,
        )
        yield CounterMetricFamily(
            "encoder_mooncake_bytes", "Payload bytes the transfer engine wrote", value=stats.bytes
        )
        yield CounterMetricFamily(
            "encoder_mooncake_write_seconds",
            "Seconds from handing a payload to a write thread to its write's end",
            value=stats.write_seconds,
        )
        fallbacks = CounterMetricFamily(
            "encoder_mooncake_fallbacks",
            "Items offered the transfer engine that went as chunks, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(dict(stats.fallbacks).items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
