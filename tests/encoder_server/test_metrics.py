"""Metrics and logs: the server's Prometheus endpoint scraped over HTTP, its per-request log line, and
the receiver's counters."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from encoder_common.errors import ERROR_TABLE, outcome_for
from encoder_server.batcher import BatchingConfig
from encoder_server.metrics import CacheStats, ServerMetrics
from encoder_server.models import load_vision_encoder
from encoder_server.transports.shm import ShmConfig
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver, ShardError
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.launcher import launch_server
from testkit.servers import running_server


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the /metrics page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_scrape_counts_calls_items_tokens_bytes_batches_and_stages(default_model_dir):
    images = [image_bytes(56, 84, seed=1), image_bytes(100, 60, seed=2), image_bytes(28, 28, seed=3)]
    async with running_server(default_model_dir, metrics_port=0, cache_bytes=0) as server:
        port = server.metrics_port
        assert port and port != server.port
        at_rest = scrape(port)
        assert value(at_rest, "encoder_queue_items") == 0 and value(at_rest, "encoder_requests_in_flight") == 0
        async with EncoderReceiver([server.url]) as rx:
            results = [
                await rx.encode("one", [{"data": images[0]}]),
                await rx.encode("two", [{"data": images[1]}, {"data": images[2]}]),
            ]
            with pytest.raises(ShardError):
                await rx.encode("bad", [{"data": images[0]}, {"data": b"not an image"}])
        await raw_encode(server.url, pb.EncodeRequest(request_id="video", items=[pb.ImageItem(index=0, modality=pb.VIDEO, data=b"x")]))
        samples = scrape(port)

    # The bad call streams its item 0 whole before item 1 fails it: 4 items sent in all.
    items = [item for result in results for item in result.items] + [results[0].items[0]]
    assert value(samples, "encoder_requests_total", outcome="ok", code="OK") == 2
    assert value(samples, "encoder_requests_total", outcome="invalid", code="INVALID_ARGUMENT") == 2
    assert value(samples, "encoder_items_total", outcome="ok", code="OK") == 4
    assert value(samples, "encoder_items_total", outcome="invalid", code="INVALID_ARGUMENT") == 2
    assert value(samples, "encoder_tokens_total") == sum(item.num_tokens for item in items)
    payload = sum(item.embedding.numel() * item.embedding.element_size() for item in items)
    assert payload < value(samples, "encoder_response_bytes_total") < payload + 200 * len(items)
    # Forwards are counted by the batcher's calls (the warm-up forward is not one of them).
    forwards = value(samples, "encoder_batch_items_count")
    assert 1 <= forwards <= 4 and value(samples, "encoder_batch_items_sum") == 4
    assert value(samples, "encoder_forward_seconds_count") == forwards
    for stage in ("queue", "preprocess", "forward", "stream"):
        assert value(samples, "encoder_item_stage_seconds_count", stage=stage) == 4, stage
    forward_s = value(samples, "encoder_item_stage_seconds_sum", stage="forward")
    received = [item for result in results for item in result.items]
    assert forward_s >= sum(item.forward_ms for item in received) / 1000 * (1 - 1e-6)
    assert not any(name.startswith("encoder_cache") for name, _ in samples)  # the cache is off
    for stage in ("queue", "preprocess", "forward", "stream"):
        assert value(samples, "encoder_item_stage_seconds_bucket", stage=stage, le="+Inf") == 4, stage


def test_call_tallies_are_exported_as_prometheus_counters_and_cumulative_histograms():
    metrics = ServerMetrics()
    calls = metrics.calls
    # A bucket holds the values up to and including its bound, as Prometheus's `le` says.
    for seconds in (0.0005, 0.001, 0.003, 100.0):
        calls.stage_seconds["stream"].observe(seconds)
    calls.requests["ok", "OK"] += 3
    calls.items["invalid", "INVALID_ARGUMENT"] += 2
    calls.tokens, calls.bytes_sent, calls.in_flight = 1024, 7 << 20, 1
    samples = parse(generate_latest(metrics.registry).decode())

    stream = {"stage": "stream"}
    assert value(samples, "encoder_item_stage_seconds_bucket", le="0.001", **stream) == 2
    assert value(samples, "encoder_item_stage_seconds_bucket", le="0.0025", **stream) == 2
    assert value(samples, "encoder_item_stage_seconds_bucket", le="0.005", **stream) == 3
    assert value(samples, "encoder_item_stage_seconds_bucket", le="30.0", **stream) == 3
    assert value(samples, "encoder_item_stage_seconds_bucket", le="+Inf", **stream) == 4
    assert value(samples, "encoder_item_stage_seconds_count", **stream) == 4
    assert value(samples, "encoder_item_stage_seconds_sum", **stream) == pytest.approx(100.0045)
    assert value(samples, "encoder_item_stage_seconds_count", stage="queue") == 0
    assert value(samples, "encoder_requests_total", outcome="ok", code="OK") == 3
    assert value(samples, "encoder_items_total", outcome="invalid", code="INVALID_ARGUMENT") == 2
    assert value(samples, "encoder_tokens_total") == 1024
    assert value(samples, "encoder_response_bytes_total") == 7 << 20
    assert value(samples, "encoder_requests_in_flight") == 1


async def raw_encode(url: str, request: pb.EncodeRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as channel:
        encode = channel.unary_stream(
            "/encoder.v1.EncoderService/Encode",
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=pb.EncodeResponse.FromString,
        )
        try:
            async for _ in encode(request):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def wait_for(predicate, what: str) -> None:
    for _ in range(3000):  # 30 s: far more than a loaded machine needs
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_queue_depth_in_flight_and_a_deadline_while_the_forward_is_busy(default_model_dir):
    encoder = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    batching = BatchingConfig(max_batch_images=1)
    async with running_server(default_model_dir, encoder=encoder, metrics_port=0, batching=batching) as server:
        encoder.hold()
        async with EncoderReceiver([server.url]) as rx:
            call = asyncio.create_task(rx.encode("busy", [{"data": image_bytes(28, 28, seed=i)} for i in range(3)]))
            # One item is in the blocked forward, two wait in the queue.
            await wait_for(lambda: value(scrape(server.metrics_port), "encoder_queue_items") == 2, "2 queued items")
            assert value(scrape(server.metrics_port), "encoder_requests_in_flight") == 1
            with pytest.raises(ShardError) as raised:
                # Long enough to reach the server on a loaded machine; the held forward makes it expire there.
                await rx.encode("late", [{"data": image_bytes(28, 28, seed=9)}], timeout=3.0)
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            encoder.release()
            assert len((await call).items) == 3
        await wait_for(
            lambda: cancelled(scrape(server.metrics_port), "encoder_requests_total") == 1, "the expired call to be counted"
        )
        samples = scrape(server.metrics_port)
    assert value(samples, "encoder_queue_items") == 0 and value(samples, "encoder_requests_in_flight") == 0
    assert cancelled(samples, "encoder_items_total") == 1
    assert value(samples, "encoder_batch_items_count") == 3 and value(samples, "encoder_batch_items_bucket", le="1.0") == 3


def cancelled(samples, name: str) -> float:
    """Cancelled calls (or items) under either code: the receiver's own deadline and gRPC's expire at
    the same moment, and which one ends the call on the server (CANCELLED or DEADLINE_EXCEEDED) is a race."""
    return sum(value(samples, name, outcome="cancelled", code=code) for code in ("CANCELLED", "DEADLINE_EXCEEDED"))


async def test_cache_hook_is_read_at_each_scrape(default_model_dir):
    stats = CacheStats(hits=0, misses=0, bytes_held=0, entries=0)
    async with running_server(default_model_dir, metrics_port=0, warmup=False) as server:
        server.metrics.watch_cache(lambda: stats)
        first = scrape(server.metrics_port)
        stats = CacheStats(hits=3, misses=5, bytes_held=1 << 20, entries=2, evictions=4)
        second = scrape(server.metrics_port)
    assert value(first, "encoder_cache_hits_total") == 0 and ("encoder_cache_bytes", ()) in first
    assert value(second, "encoder_cache_hits_total") == 3 and value(second, "encoder_cache_misses_total") == 5
    assert value(second, "encoder_cache_evictions_total") == 4
    assert value(second, "encoder_cache_bytes") == 1 << 20 and value(second, "encoder_cache_entries") == 2


async def test_the_servers_own_cache_is_reported(default_model_dir):
    png = image_bytes(40, 40, seed=11)
    async with running_server(default_model_dir, metrics_port=0, warmup=False) as server:
        async with EncoderReceiver([server.url]) as rx:
            first = await rx.encode("miss", [{"data": png}])
            second = await rx.encode("hit", [{"data": png}])
        samples = scrape(server.metrics_port)
    assert not first.items[0].cache_hit and second.items[0].cache_hit
    assert value(samples, "encoder_cache_misses_total") == 1 and value(samples, "encoder_cache_hits_total") == 1
    assert value(samples, "encoder_cache_entries") == 1
    assert value(samples, "encoder_cache_bytes") >= first.items[0].embedding.numel() * 4


async def test_cache_evictions_are_exported(default_model_dir):
    # 28x28 images make items of ~32 KiB with this model: the cache holds one of them at a time.
    pngs = [image_bytes(28, 28, seed=20 + i) for i in range(3)]
    async with running_server(default_model_dir, metrics_port=0, warmup=False, cache_bytes=48 << 10) as server:
        async with EncoderReceiver([server.url]) as rx:
            results = [await rx.encode(f"evict-{i}", [{"data": png}]) for i, png in enumerate(pngs)]
        samples = scrape(server.metrics_port)
    item_bytes = results[0].items[0].embedding.numel() * results[0].items[0].embedding.element_size()
    assert 24 << 10 < item_bytes < 48 << 10, item_bytes  # what the cache size above assumes
    assert value(samples, "encoder_cache_misses_total") == 3 and value(samples, "encoder_cache_hits_total") == 0
    assert value(samples, "encoder_cache_evictions_total") == 2 and value(samples, "encoder_cache_entries") == 1


async def test_shared_memory_stats_are_exported(default_model_dir):
    # 28x28: ~32 KiB, under the 64 KiB floor of a segment (goes as chunks); the others go through segments.
    images = [{"data": image_bytes(w, h, seed=w)} for w, h in [(28, 28), (640, 480), (700, 700)]]
    async with running_server(default_model_dir, metrics_port=0, warmup=False, cache_bytes=0, shm=ShmConfig()) as server:
        at_rest = scrape(server.metrics_port)
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            result = await rx.encode("shm-metrics", images)
        sizes = [item.embedding.numel() * item.embedding.element_size() for item in result.items]
        del result  # the items' tensors are views of their segments: freeing them releases both
        assert server.transports["shm"].outstanding() == []  # the server saw the receiver release both segments
        samples = scrape(server.metrics_port)
    assert value(at_rest, "encoder_shm_items_total") == 0 and value(at_rest, "encoder_shm_pool_segments") == 0
    assert value(samples, "encoder_shm_items_total") == 2
    assert value(samples, "encoder_shm_bytes_total") == sum(sizes[1:])
    assert value(samples, "encoder_shm_fallbacks_total", reason="small_item") == 1
    assert value(samples, "encoder_shm_segments_released_total") == 2
    assert value(samples, "encoder_shm_segments_reclaimed_total", reason="timeout") == 0
    assert value(samples, "encoder_shm_segments_reclaimed_total", reason="cancel") == 0
    assert 1 <= value(samples, "encoder_shm_pool_segments") <= 2
    assert value(samples, "encoder_shm_pool_peak_bytes") >= value(samples, "encoder_shm_pool_bytes") >= sizes[2]
    # Items in segments send only their header over gRPC: the response bytes are the chunked item's and 3 headers.
    assert sizes[0] < value(samples, "encoder_response_bytes_total") < sizes[0] + 600
    assert value(samples, "encoder_items_total", outcome="ok", code="OK") == 3


def test_the_outcome_label_follows_the_error_table():
    # One table: the outcome of a status code is that of the error class the code stands for.
    for error_class, status in ERROR_TABLE.items():
        assert outcome_for(status.grpc) == error_class.outcome, error_class
    assert outcome_for(grpc.StatusCode.OK) == "ok" and outcome_for(grpc.StatusCode.CANCELLED) == "cancelled"
    assert outcome_for(grpc.StatusCode.UNAUTHENTICATED) == "invalid"
    assert outcome_for(grpc.StatusCode.UNAVAILABLE) == outcome_for(grpc.StatusCode.RESOURCE_EXHAUSTED) == "overloaded"
    assert outcome_for(grpc.StatusCode.DEADLINE_EXCEEDED) == "cancelled"
    assert outcome_for(grpc.StatusCode.DATA_LOSS) == outcome_for(grpc.StatusCode.INTERNAL) == "error"


LOG_LINE = re.compile(
    r"request (?P<id>\S+): (?P<code>[A-Z_]+), (?P<sent>\d+)/(?P<items>\d+) items, (?P<tokens>\d+) tokens, "
    r"[\d.]+ MB, preprocess [\d.]+ ms, queue [\d.]+ ms, forward [\d.]+ ms, stream [\d.]+ ms, total [\d.]+ ms$"
)


async def test_one_log_line_per_request_with_id_items_tokens_and_timings_and_no_image_bytes(default_model_dir, caplog):
    png = image_bytes(64, 64, seed=4)
    async with running_server(default_model_dir, warmup=False) as server:
        with caplog.at_level(logging.INFO, logger="encoder_server"):
            async with EncoderReceiver([server.url]) as rx:
                ok = await rx.encode("log-ok", [{"data": png}, {"data": png}])
                with pytest.raises(ShardError):
                    await rx.encode("log-bad", [{"data": b"GIF89a-broken"}])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request log-")]
    assert len(lines) == 2, lines
    good, bad = (LOG_LINE.match(line).groupdict() for line in lines)
    assert good == {"id": "log-ok", "code": "OK", "sent": "2", "items": "2", "tokens": str(ok.num_tokens)}
    assert bad == {"id": "log-bad", "code": "INVALID_ARGUMENT", "sent": "0", "items": "1", "tokens": "0"}
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert base64.b64encode(png)[:40].decode() not in everything and "GIF89a" not in everything


def test_the_server_command_serves_metrics_on_metrics_port(default_model_dir, tmp_path):
    with launch_server(default_model_dir, "--metrics-port", "0", "--no-warmup", log_dir=tmp_path) as process:
        match = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log())
        assert match, process.log()
        samples = scrape(int(match.group(1)))
    assert ("encoder_queue_items", ()) in samples and ("encoder_requests_in_flight", ()) in samples


async def test_receiver_counters_and_their_prometheus_export(default_model_dir):
    async with running_server(default_model_dir, warmup=False) as a, running_server(default_model_dir, warmup=False) as b:
        async with EncoderReceiver([a.url, b.url], seed=0) as rx:
            result = await rx.encode("r", [{"data": image_bytes(28, 28 * (i + 1), seed=i)} for i in range(4)])
            with pytest.raises(ShardError):
                await rx.encode("bad", [{"data": b"nope"}], num_items_assigned=[1, 0])
            rx.metrics.retry(a.url, 2)
            rx.metrics.failover(a.url, 3)
            snapshot = rx.metrics.snapshot()
            registry = CollectorRegistry()
            registry.register(rx.metrics.prometheus_collector())
            samples = parse(generate_latest(registry).decode())
    per_encoder = {url: [i for i in result.items if i.encoder_url == url] for url in (a.url, b.url)}
    assert snapshot["items_by_encoder"] == {url: len(items) for url, items in per_encoder.items()}
    assert snapshot["tokens_by_encoder"] == {url: sum(i.num_tokens for i in items) for url, items in per_encoder.items()}
    assert snapshot["requests"] == {"ok": 1, "error": 1} and snapshot["latency_count"] == 2
    assert snapshot["shard_failures"] == {f"{a.url} INVALID_ARGUMENT": 1}
    assert snapshot["retries"] == {a.url: 2} and snapshot["failovers"] == {a.url: 3}
    for url, items in per_encoder.items():
        assert value(samples, "encoder_receiver_items_total", encoder=url) == len(items)
    assert value(samples, "encoder_receiver_shard_failures_total", encoder=a.url, code="INVALID_ARGUMENT") == 1
    assert value(samples, "encoder_receiver_failovers_total", from_encoder=a.url) == 3
    assert value(samples, "encoder_receiver_request_seconds_count") == 2
    assert value(samples, "encoder_receiver_request_seconds_sum") == pytest.approx(snapshot["latency_sum_s"])
    assert value(samples, "encoder_receiver_request_seconds_bucket", le="+Inf") == 2
