"""Dynamic batching and backpressure: the batcher on its own, then through a real server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch

from encoder_common.errors import OverloadedError, TokenCountMismatchError, UnavailableError
from encoder_server.batcher import Batcher, BatchingConfig
from encoder_server.images import decode_image
from encoder_server.models import load_vision_encoder
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver, ShardError
from receiver.fleet.channels import EncoderEndpoint
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server


@pytest.fixture(scope="module")
def real_encoder(default_model_dir):
    return load_vision_encoder(default_model_dir, "cpu", torch.float32)


@pytest.fixture
def encoder(real_encoder):
    gated = EncoderDouble(real_encoder)
    yield gated
    gated.release()


@pytest.fixture(scope="module")
def prepared(real_encoder):
    """Eight real images after preprocessing; image i has (i + 1) * 16 patches and (i + 1) * 4 tokens."""
    items = [real_encoder.preprocess(decode_image(image_bytes(56, 56 * (i + 1), seed=i))) for i in range(8)]
    assert [item.num_patches for item in items] == [16 * (i + 1) for i in range(8)]
    return items


@pytest.fixture
def make_batcher(encoder):
    started: list[Batcher] = []

    def make(**config) -> Batcher:
        batcher = Batcher(encoder, BatchingConfig(**config))
        batcher.start()
        started.append(batcher)
        return batcher

    yield make
    encoder.release()
    for batcher in started:
        batcher.stop()


async def eventually(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


async def occupy_worker(batcher: Batcher, encoder: EncoderDouble, item) -> asyncio.Future:
    """Sends one item and waits until the worker is stuck in its forward, so later items queue up."""
    encoder.hold()
    (future,) = batcher.submit([item])
    assert await asyncio.to_thread(encoder.in_forward.wait, 10), "the worker never started the forward"
    return future


async def test_waiting_items_share_forwards_of_at_most_max_batch_images(make_batcher, encoder, prepared):
    batcher = make_batcher(max_batch_images=3)
    first = await occupy_worker(batcher, encoder, prepared[0])
    rest = batcher.submit(prepared[1:6])
    encoder.release()
    results = await asyncio.gather(first, *rest)
    assert encoder.batches == [1, 3, 2]
    assert [r.batch_size for r in results] == [1, 3, 3, 3, 2, 2]


async def test_max_batch_patches_closes_a_batch_but_an_oversized_item_still_runs_alone(
    make_batcher, encoder, prepared
):
    # Items 0..3 have 16, 32, 48, 64 patches; item 7 has 128, over the per-batch limit on its own.
    batcher = make_batcher(max_batch_patches=80)
    first = await occupy_worker(batcher, encoder, prepared[0])
    rest = batcher.submit([prepared[1], prepared[2], prepared[3], prepared[7]])
    encoder.release()
    await asyncio.gather(first, *rest)
    assert encoder.batches == [1, 2, 1, 1]  # [16] [32+48] [64] [128]


async def test_max_wait_gathers_items_that_arrive_after_the_first(make_batcher, encoder, prepared):
    # A wait no loaded machine outlasts between the two submits: the second item always joins the batch.
    batcher = make_batcher(max_wait_ms=120_000, max_batch_images=2)
    futures = batcher.submit([prepared[0]])
    await asyncio.sleep(0.05)  # the worker is gathering now
    futures += batcher.submit([prepared[1]])
    results = await asyncio.gather(*futures)
    assert encoder.batches == [2]
    assert results[0].queue_ms < 60_000  # the batch was full, so it did not wait the whole 2 minutes


async def test_batched_outputs_equal_each_item_encoded_alone(make_batcher, encoder, prepared, real_encoder):
    batcher = make_batcher()
    first = await occupy_worker(batcher, encoder, prepared[0])
    rest = batcher.submit(prepared[1:])
    encoder.release()
    results = await asyncio.gather(first, *rest)
    assert encoder.batches == [1, 7]
    for item, result in zip(prepared, results):
        (alone,) = real_encoder.encode([item])
        assert result.output.embedding.shape == (item.num_tokens, real_encoder.spec.hidden_size)
        torch.testing.assert_close(result.output.embedding, alone.embedding, rtol=1e-5, atol=1e-5)


async def test_full_queue_refuses_at_once_by_items_and_by_patches(make_batcher, encoder, prepared):
    batcher = make_batcher(max_queue_items=3, max_queue_patches=120)
    first = await occupy_worker(batcher, encoder, prepared[0])
    queued = batcher.submit([prepared[1], prepared[2]])  # 32 + 48 patches waiting
    with pytest.raises(OverloadedError, match=r"queue is full \(2 items, 80 patches waiting; limits 3 items, 120"):
        batcher.submit([prepared[3], prepared[4]])  # 2 more items: over 3
    with pytest.raises(OverloadedError):
        batcher.submit([prepared[5]])  # 96 more patches: over 120
    with pytest.raises(OverloadedError):
        batcher.check_room(2)
    batcher.check_room(1)
    assert batcher.queue_depth == 2 and batcher.queued_patches == 80  # refused calls left nothing behind
    encoder.release()
    await asyncio.gather(first, *queued)
    assert encoder.items_forwarded == 3


async def test_cancelled_items_leave_the_queue_at_once_and_cost_no_forward(make_batcher, encoder, prepared):
    batcher = make_batcher(max_queue_items=2)
    first = await occupy_worker(batcher, encoder, prepared[0])
    doomed, kept = batcher.submit([prepared[1], prepared[2]])
    doomed.cancel()
    await eventually(lambda: batcher.queue_depth == 1, "the cancelled item left the queue")
    assert batcher.queued_patches == prepared[2].num_patches
    (late,) = batcher.submit([prepared[3]])  # its room is free again while the worker is still busy
    encoder.release()
    await asyncio.gather(first, kept, late)
    assert encoder.items_forwarded == 3 and encoder.batches == [1, 2]


async def test_token_count_mismatch_fails_only_its_own_item(make_batcher, encoder, prepared, real_encoder):
    batcher = make_batcher()
    first = await occupy_worker(batcher, encoder, prepared[0])
    liar = dataclasses.replace(prepared[2], num_tokens=prepared[2].num_tokens + 1)
    good_a, bad, good_b = batcher.submit([prepared[1], liar, prepared[3]])
    encoder.release()
    await first
    with pytest.raises(TokenCountMismatchError, match="produced 12 tokens, but preprocessing expected 13"):
        await bad
    for item, future in ((prepared[1], good_a), (prepared[3], good_b)):
        (alone,) = real_encoder.encode([item])
        torch.testing.assert_close((await future).output.embedding, alone.embedding, rtol=1e-5, atol=1e-5)


async def test_stop_fails_queued_items_as_unavailable_and_refuses_new_ones(encoder, prepared):
    batcher = Batcher(encoder, BatchingConfig())
    batcher.start()
    first = await occupy_worker(batcher, encoder, prepared[0])
    (queued,) = batcher.submit([prepared[1]])
    stopping = asyncio.create_task(asyncio.to_thread(batcher.stop))
    await eventually(lambda: batcher._stopping, "stop() took the lock")
    encoder.release()
    await stopping
    assert (await first).output.embedding.shape[0] == prepared[0].num_tokens  # the running forward finished
    with pytest.raises(UnavailableError, match="shutting down"):
        await queued
    with pytest.raises(UnavailableError, match="not running"):
        batcher.submit([prepared[2]])
    assert encoder.items_forwarded == 1


@pytest.mark.parametrize(
    "field, value", [("max_batch_images", 0), ("max_batch_patches", 0), ("max_queue_items", 0), ("max_wait_ms", -1)]
)
def test_config_rejects_values_that_would_stall_the_worker(field, value):
    with pytest.raises(ValueError, match=field):
        BatchingConfig(**{field: value})


# Through a real server: the status codes a client sees, and what its call costs.


def request_for(image: bytes, request_id: str) -> pb.EncodeRequest:
    return pb.EncodeRequest(request_id=request_id, items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=image)])


async def drain(call) -> list:
    return [message async for message in call]


@pytest.fixture(params=["cache-on", "cache-off"])
async def held_server(request, default_model_dir, real_encoder):
    """A server whose forwards wait at a gate, with a 2-item queue; yields (server, encoder, endpoint)."""
    encoder = EncoderDouble(real_encoder)
    cache_bytes = 1 << 26 if request.param == "cache-on" else 0
    async with running_server(
        default_model_dir, encoder=encoder, batching=BatchingConfig(max_queue_items=2), cache_bytes=cache_bytes
    ) as server:
        endpoint = EncoderEndpoint.connect(server.url)
        encoder.reset()
        try:
            yield server, encoder, endpoint
        finally:
            encoder.release()
            await endpoint.close()


async def start_blocking_call(server, encoder: EncoderDouble, endpoint: EncoderEndpoint) -> asyncio.Task:
    encoder.hold()
    task = asyncio.create_task(drain(endpoint.encode(request_for(image_bytes(28, 28, seed=900), "blocker"))))
    assert await asyncio.to_thread(encoder.in_forward.wait, 10), "the first call never reached the forward"
    return task


async def test_server_refuses_a_call_beyond_the_queue_with_resource_exhausted_at_once(held_server):
    server, encoder, endpoint = held_server
    blocker = await start_blocking_call(server, encoder, endpoint)
    queued = [
        asyncio.create_task(drain(endpoint.encode(request_for(image_bytes(28, 28, seed=s), f"q{s}")))) for s in (1, 2)
    ]
    await eventually(lambda: server._batcher.queue_depth == 2, "two calls are queued")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await drain(endpoint.encode(request_for(image_bytes(28, 28, seed=3), "over"), timeout=20))
    # Refused while the forward is still held, not after it.
    assert encoder.in_forward.is_set() and not blocker.done()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "encoder queue is full (2 items" in raised.value.details()
    encoder.release()
    for task in (blocker, *queued):
        header = (await task)[0]
        assert header.num_tokens == 4 and not header.cache_hit
    assert encoder.items_forwarded == 3


async def test_call_past_its_deadline_leaves_the_queue_and_costs_no_forward(held_server):
    server, encoder, endpoint = held_server
    blocker = await start_blocking_call(server, encoder, endpoint)
    # Time enough to be seen queued on a loaded machine; the held forward makes it expire there.
    late = asyncio.create_task(drain(endpoint.encode(request_for(image_bytes(28, 28, seed=4), "late"), timeout=8.0)))
    await eventually(lambda: server._batcher.queue_depth == 1, "the call is queued")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await late
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: server._batcher.queue_depth == 0, "the expired call's item left the queue")
    encoder.release()
    await blocker
    assert encoder.items_forwarded == 1 and encoder.preprocessed == 2


async def test_cancelled_call_leaves_the_queue_and_costs_no_forward(held_server):
    server, encoder, endpoint = held_server
    blocker = await start_blocking_call(server, encoder, endpoint)
    call = endpoint.encode(request_for(image_bytes(28, 28, seed=5), "cancelled"))
    reading = asyncio.create_task(drain(call))
    await eventually(lambda: server._batcher.queue_depth == 1, "the call is queued")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await eventually(lambda: server._batcher.queue_depth == 0, "the cancelled call's item left the queue")
    encoder.release()
    await blocker
    assert encoder.items_forwarded == 1
    async with EncoderReceiver([server.url]) as rx:  # and the server keeps serving
        assert (await rx.encode("after", [{"data": image_bytes(28, 28, seed=5)}])).items[0].num_tokens == 4


async def test_overloaded_shard_reaches_the_receiver_as_a_typed_error(held_server):
    server, encoder, endpoint = held_server
    blocker = await start_blocking_call(server, encoder, endpoint)
    async with EncoderReceiver([server.url]) as rx:
        with pytest.raises(ShardError) as raised:
            await rx.encode("too-many", [{"data": image_bytes(28, 28, seed=10 + i)} for i in range(3)])
    assert raised.value.cause_class is OverloadedError
    assert raised.value.item_indices == [0, 1, 2]
    encoder.release()
    await blocker
    assert encoder.preprocessed == 1  # refused before any of its items was decoded
