"""Prometheus metrics of one encoder server (on `--metrics-port`), and each call's accounting
(`RequestRecord`): its item events, tallied in plain numbers until scraped, and its one log line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from encoder_common.errors import outcome_for, status_for
from encoder_common.histogram import PlainHistogram
from protos import encoder_pb2 as pb

from .models.base import ImageEmbedding, PreparedImage, VisionEncoder
from .profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile

if TYPE_CHECKING:
    from .batcher import Batcher

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_ITEMS = (1, 2, 4, 8, 16, 32, 64, 128)
_STAGES = ("queue", "preprocess", "forward", "stream")


@dataclass(frozen=True)
class CacheStats:
    """What an embedding cache reports to the metrics: counts since start and its current size."""

    hits: int
    misses: int
    bytes_held: int
    entries: int
    evictions: int = 0
    not_held: int = 0  # references to images whose embedding it did not hold


class ServerMetrics:
    """The server's metrics in a registry of its own, so several servers can share a process (tests).

    Hooks for parts that live elsewhere:
    - `watch_queue(fn)`: fn() -> items waiting for a forward, read at each scrape.
    - `watch_cache(fn)`: fn() -> CacheStats, read at each scrape; until it is called the cache
      metrics are absent (a server without a cache does not claim 0 hits).
    - `watch_transport(collector)`: a payload transport's own counts (encoder_server/transports), read at
      each scrape; absent for a transport the server runs without.
    - `watch_load(batcher)`: the forward worker whose load (queued work, saturation) and cancelled items
      are read at each scrape.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batch_items = Histogram("encoder_batch_items", "Images per forward", buckets=_BATCH_ITEMS, registry=r)
        self.forward_seconds = Histogram("encoder_forward_seconds", "Duration of one forward", buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("encoder_queue_items", "Items waiting for a forward", registry=r)
        self.calls = CallTally()
        r.register(_CallCollector(self.calls))
        self._cache_stats: Callable[[], CacheStats] | None = None
        self._batcher: Batcher | None = None
        r.register(_CacheCollector(self))
        r.register(_LoadCollector(self))
        self._http: WSGIServer | None = None

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def watch_cache(self, stats: Callable[[], CacheStats]) -> None:
        self._cache_stats = stats

    def watch_transport(self, collector: Collector) -> None:
        self.registry.register(collector)

    def watch_load(self, batcher: Batcher) -> None:
        self._batcher = batcher

    def record(self, request_id: str, num_items: int, context: grpc.aio.ServicerContext | None = None) -> RequestRecord:
        return RequestRecord(self.calls, request_id, num_items, context)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP in a daemon thread; returns the bound port (port 0 picks one)."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class CallTally:
    """What finished Encode calls sent, kept as plain numbers: a call adds to it from the event loop
    with no lock and no label lookup, and a scrape (another thread) reads it through _CallCollector.
    A scrape may see one call's counts half-added; each number on its own is exact."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # by (outcome, status code name)
        self.items: Counter[tuple[str, str]] = Counter()
        self.tokens = 0
        self.bytes_sent = 0
        self.in_flight = 0
        self.stage_seconds = {stage: PlainHistogram(_SECONDS) for stage in _STAGES}


class _CallCollector(Collector):
    def __init__(self, calls: CallTally):
        self.calls = calls

    def collect(self) -> Iterator:
        calls = self.calls
        for name, doc, counts in (
            ("encoder_requests", "Encode calls finished, by outcome and gRPC status code", calls.requests),
            ("encoder_items", "Items of finished Encode calls, by outcome and gRPC status code", calls.items),
        ):
            family = CounterMetricFamily(name, doc, labels=["outcome", "code"])
            for labels, count in list(counts.items()):
                family.add_metric(labels, count)
            yield family
        yield CounterMetricFamily("encoder_tokens", "Embedding rows sent", value=calls.tokens)
        yield CounterMetricFamily(
            "encoder_response_bytes",
            "Bytes of Encode responses of the items sent whole (headers and payload)",
            value=calls.bytes_sent,
        )
        yield GaugeMetricFamily(
            "encoder_requests_in_flight", "Encode calls being served", value=calls.in_flight
        )
        stages = HistogramMetricFamily(
            "encoder_item_stage_seconds",
            "Per item: time in the queue, in preprocessing (its call's), in its batch's forward, "
            "and streaming it",
            labels=["stage"],
        )
        for stage, histogram in calls.stage_seconds.items():
            stages.add_metric([stage], histogram.buckets(), sum_value=histogram.sum)
        yield stages


class _CacheCollector(Collector):
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator:
        if self.metrics._cache_stats is None:
            return
        stats = self.metrics._cache_stats()
        yield CounterMetricFamily("encoder_cache_hits", "Items served from the embedding cache", value=stats.hits)
        yield CounterMetricFamily("encoder_cache_misses", "Items the embedding cache did not hold", value=stats.misses)
        yield GaugeMetricFamily("encoder_cache_bytes", "Bytes of embeddings the cache holds", value=stats.bytes_held)
        yield GaugeMetricFamily("encoder_cache_entries", "Items the cache holds", value=stats.entries)
        yield CounterMetricFamily(
            "encoder_cache_evictions", "Items dropped from the cache to make room", value=stats.evictions
        )
        yield CounterMetricFamily(
            "encoder_cache_references_not_held",
            "Items named by their image's sha256 whose embedding the cache did not hold",
            value=stats.not_held,
        )


class _LoadCollector(Collector):
    """The forward worker's load and the items it dropped, read at each scrape (docs/deployment.md#autoscaling)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator:
        batcher = self.metrics._batcher
        if batcher is None:
            return
        load = batcher.load()
        yield GaugeMetricFamily(
            "encoder_queued_work_seconds",
            "Seconds of forwards queued or running: their patches x the measured seconds per patch",
            value=load.queued_work_s,
        )
        yield GaugeMetricFamily("encoder_item_seconds", "Forward seconds one more item costs (the mean item)", value=load.item_s)
        yield GaugeMetricFamily(
            "encoder_saturation",
            "Forward-seconds asked per second over the saturation window (queued, and refused as overloaded): "
            "1 keeps the forward worker always busy, above 1 demand is over capacity",
            value=load.saturation,
        )
        yield CounterMetricFamily(
            "encoder_demand_seconds", "Forward-seconds asked of the forward worker since start", value=batcher.demanded_s
        )
        cancelled = CounterMetricFamily(
            "encoder_items_cancelled",
            "Items dropped without a forward because their call was cancelled or its deadline passed, by where "
            "they were: queue (they left it), preprocess (they never reached it)",
            labels=["stage"],
        )
        for stage in ("queue", "preprocess"):
            cancelled.add_metric([stage], batcher.cancelled_items[stage])
        yield cancelled


class MeteredEncoder(VisionEncoder):
    """Wraps the loaded encoder so every forward the batcher runs records its size and duration."""

    def __init__(self, encoder: VisionEncoder, metrics: ServerMetrics):
        self.inner = encoder
        self.spec = encoder.spec
        self.metrics = metrics

    def preprocess(self, image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]) -> PreparedImage:
        return self.inner.preprocess(image, profile)

    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        started = time.perf_counter()
        try:
            return self.inner.encode(batch)
        finally:
            self.metrics.forward_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_items.observe(len(batch))


class RequestRecord:
    """One Encode call's accounting, fed by the servicer's events: `item_sent` once per item streamed.

    On exit it counts the call and its items by outcome in the server's CallTally (items not fully
    sent take the call's status) and logs the call's one line: request id, status, items, tokens,
    bytes and timings.
    """

    def __init__(self, calls: CallTally, request_id: str, num_items: int, context):
        self.calls = calls
        self.request_id = request_id
        self.num_items = num_items
        self.context = context
        self.started = time.perf_counter()
        self.preprocess_s = 0.0  # the call's preprocessing (its items run in parallel)
        self.queue_s = 0.0  # the longest any item waited
        self.forward_s = 0.0  # the longest forward any item was in
        self.stream_s = 0.0
        self.items_sent = 0
        self.tokens = 0
        self.bytes = 0

    def __enter__(self) -> RequestRecord:
        self.calls.in_flight += 1
        return self

    def item_sent(self, header: pb.ItemHeader, *, response_bytes: int, stream_s: float) -> None:
        """An item went out whole: its header (tokens, and timings unless a cache hit), the bytes of
        its response messages and the seconds from handing its header to gRPC to its last message."""
        timing = header.timing
        queue_s, preprocess_s, forward_s = timing.queue_ms / 1000, timing.preprocess_ms / 1000, timing.forward_ms / 1000
        stages = self.calls.stage_seconds
        stages["queue"].observe(queue_s)
        stages["preprocess"].observe(preprocess_s)
        stages["forward"].observe(forward_s)
        stages["stream"].observe(stream_s)
        self.preprocess_s = max(self.preprocess_s, preprocess_s)
        self.queue_s = max(self.queue_s, queue_s)
        self.forward_s = max(self.forward_s, forward_s)
        self.stream_s += stream_s
        self.items_sent += 1
        self.tokens += header.num_tokens
        self.bytes += response_bytes
        self.calls.tokens += header.num_tokens

    def item_not_held(self) -> None:
        """An item named by reference was answered `not_held`: no item of the call's count, since its
        caller sends it again with its bytes."""
        self.num_items -= 1

    def __exit__(self, exc_type, exc, tb) -> None:
        code = self._status(exc)
        calls = self.calls
        calls.in_flight -= 1
        calls.bytes_sent += self.bytes
        outcome = outcome_for(code)
        calls.requests[outcome, code.name] += 1
        if self.items_sent:
            calls.items["ok", "OK"] += self.items_sent
        if self.num_items > self.items_sent:
            calls.items[outcome, code.name] += self.num_items - self.items_sent
        log.info(
            "request %s: %s, %d/%d items, %d tokens, %.2f MB, preprocess %.1f ms, queue %.1f ms, "
            "forward %.1f ms, stream %.1f ms, total %.1f ms",
            self.request_id,
            code.name,
            self.items_sent,
            self.num_items,
            self.tokens,
            self.bytes / 1e6,
            self.preprocess_s * 1000,
            self.queue_s * 1000,
            self.forward_s * 1000,
            self.stream_s * 1000,
            (time.perf_counter() - self.started) * 1000,
        )

    def _status(self, exc: BaseException | None) -> grpc.StatusCode:
        if exc is None:
            return grpc.StatusCode.OK
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            remaining = self.context.time_remaining() if self.context is not None else None
            expired = remaining is not None and remaining <= 0
            return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        return status_for(exc)
