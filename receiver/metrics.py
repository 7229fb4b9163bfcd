"""Receiver-side counters: requests and latency, items per encoder, shard failures, retries, failovers,
DNS re-resolutions, how items were placed, the receiver cache's hits, misses and bytes. Plain numbers
a prefill node reads with `snapshot()`, or exports to Prometheus with `prometheus_collector()`
(prometheus-client is imported only then)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from encoder_common.histogram import PlainHistogram

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ReceiverMetrics:
    """Counters of one EncoderReceiver (or several sharing it); safe to read from another thread.

    Retries count items re-sent after an encoder refused them as overloaded (RESOURCE_EXHAUSTED:
    the encoder stays in use); failovers count items moved off an encoder that failed (unreachable,
    UNAVAILABLE, INTERNAL, a broken or stalled stream), by the encoder they left.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by outcome: "ok" or "error"
        self.items_by_encoder: Counter[str] = Counter()
        self.tokens_by_encoder: Counter[str] = Counter()
        self.shard_failures: Counter[tuple[str, str]] = Counter()  # by (encoder URL, status code name)
        self.retries: Counter[str] = Counter()  # items, by the encoder that refused them as overloaded
        self.failovers: Counter[str] = Counter()  # items, by the failed encoder they were moved off
        self.resolutions: Counter[str] = Counter()  # by outcome: "ok" or "error"
        self.placements: Counter[str] = Counter()  # items placed, by how: "affinity", "spilled", "re_placed"
        self.cache_lookups: Counter[str] = Counter()  # receiver cache, by outcome: "hit" or "miss"
        self.cache_bytes = 0  # what the receiver cache holds now
        self.latency = PlainHistogram(LATENCY_BUCKETS_S)  # encode calls' seconds

    def request_done(self, seconds: float, items: list[Any] | None) -> None:
        """One `encode` call ended: with its ItemResults, or None when it raised."""
        with self._lock:
            self.requests["ok" if items is not None else "error"] += 1
            self.latency.observe(seconds)
            for item in items or ():
                if item.encoder_url is not None and not item.receiver_cache_hit:
                    self.items_by_encoder[item.encoder_url] += 1
                    self.tokens_by_encoder[item.encoder_url] += item.num_tokens

    def shard_failed(self, encoder_url: str, code_name: str) -> None:
        with self._lock:
            self.shard_failures[(encoder_url, code_name)] += 1

    def retry(self, encoder_url: str, items: int) -> None:
        with self._lock:
            self.retries[encoder_url] += items

    def failover(self, from_url: str, items: int) -> None:
        with self._lock:
            self.failovers[from_url] += items

    def placed(self, counts: Counter[str]) -> None:
        with self._lock:
            self.placements.update(counts)

    def cache_looked_up(self, hits: int, misses: int, cache_bytes: int) -> None:
        with self._lock:
            self.cache_lookups.update(hit=hits, miss=misses)
            self.cache_bytes = cache_bytes

    def resolved(self, ok: bool) -> None:
        with self._lock:
            self.resolutions["ok" if ok else "error"] += 1

    def snapshot(self) -> dict[str, Any]:
        """A copy of every counter, as plain dicts (tuple keys joined with ' -> ' or ' ')."""
        with self._lock:
            return {
                "requests": dict(self.requests),
                "items_by_encoder": dict(self.items_by_encoder),
                "tokens_by_encoder": dict(self.tokens_by_encoder),
                "shard_failures": {f"{url} {code}": n for (url, code), n in self.shard_failures.items()},
                "retries": dict(self.retries),
                "failovers": dict(self.failovers),
                "resolutions": dict(self.resolutions),
                "placements": dict(self.placements),
                "cache_lookups": dict(self.cache_lookups),
                "cache_bytes": self.cache_bytes,
                "latency_count": self.latency.count,
                "latency_sum_s": self.latency.sum,
            }

    def prometheus_collector(self):
        """A prometheus_client Collector exposing these counters; register it in any registry."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.registry import Collector

        metrics = self

        class _ReceiverCollector(Collector):
            def collect(self) -> Iterator:
                with metrics._lock:
                    families = []
                    for name, documentation, labels, counts in metrics._counter_table():
                        family = CounterMetricFamily(f"encoder_receiver_{name}", documentation, labels=labels)
                        for key, count in counts.items():
                            family.add_metric(list(key) if isinstance(key, tuple) else [key], count)
                        families.append(family)
                    families.append(
                        GaugeMetricFamily(
                            "encoder_receiver_cache_bytes", "bytes of embeddings the receiver cache holds",
                            value=metrics.cache_bytes,
                        )  # fmt: skip
                    )
                    families.append(
                        HistogramMetricFamily(
                            "encoder_receiver_request_seconds",
                            "encode call latency",
                            buckets=metrics.latency.buckets(),
                            sum_value=metrics.latency.sum,
                        )
                    )
                yield from families

        return _ReceiverCollector()

    def _counter_table(self) -> list[tuple[str, str, list[str], Counter]]:
        return [
            ("requests", "encode calls by outcome", ["outcome"], self.requests),
            ("items", "items received, by encoder", ["encoder"], self.items_by_encoder),
            ("tokens", "embedding rows received, by encoder", ["encoder"], self.tokens_by_encoder),
            ("shard_failures", "failed shards, by encoder and status code", ["encoder", "code"], self.shard_failures),
            ("retries", "items re-sent after an encoder refused them as overloaded", ["encoder"], self.retries),
            ("failovers", "items moved off a failed encoder", ["from_encoder"], self.failovers),
            ("resolutions", "DNS resolutions of encoder names, by outcome", ["outcome"], self.resolutions),
            ("placements", "items placed, by how: affinity, spilled (balance), re_placed", ["how"], self.placements),
            ("cache_lookups", "receiver cache lookups, by outcome", ["outcome"], self.cache_lookups),
        ]
