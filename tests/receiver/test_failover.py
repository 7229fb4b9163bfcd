"""Faults under load, on real encoder processes: kill -9, a hung encoder, overload, SIGTERM drains;
and the server's life cycle (health, dead forward worker, expired deadlines) in-process."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_server.models import load_vision_encoder
from protos import encoder_pb2 as pb
from receiver import EncodeFailedError, EncoderReceiver, FailoverPolicy
from receiver.fleet.channels import EncoderEndpoint
from receiver.fleet.health import HealthTracker
from testkit.encoders import EncoderDouble
from testkit.fault_proxy import fault_proxy
from testkit.images import image_bytes
from testkit.launcher import LaunchedProcess, launch_servers
from testkit.reference import reference_features
from testkit.servers import running_server
from testkit.vllm_server import free_port

SERVICE = "encoder.v1.EncoderService"


def assert_matches(result, images: list[bytes], reference: dict[bytes, torch.Tensor]) -> None:
    assert [item.index for item in result.items] == list(range(len(images)))
    for item, data in zip(result.items, images):
        torch.testing.assert_close(item.embedding, reference[data], rtol=1e-4, atol=1e-4)


def references(model_dir: Path, images: list[bytes]) -> dict[bytes, torch.Tensor]:
    unique = list(dict.fromkeys(images))
    return {data: f.pooler_output[0] for data, f in zip(unique, reference_features(model_dir, unique))}


# 448x448 -> 256 tokens x 2048 x fp32 = 2 MiB per item: two chunks, so a fault can land mid-item.
ITEM_BYTES = 256 * 2048 * 4
BIG = [image_bytes(448, 448, seed=i) for i in range(12)]


@pytest.fixture(scope="module")
def big_reference(default_model_dir):
    return references(default_model_dir, BIG)


@pytest.fixture(scope="module")
def trio(default_model_dir, tmp_path_factory):
    # One image per forward and no embedding cache, so a victim's later items are not produced yet
    # when the fault lands (the baseline runs would otherwise leave them cached, ready to stream).
    flags = ("--max-batch-images", "1", "--cache-bytes", "0")
    with launch_servers(default_model_dir, 3, "--dtype", "float32", *flags, log_dir=tmp_path_factory.mktemp("trio")) as procs:
        yield procs


async def timed_baseline(rx: EncoderReceiver, items: list[dict]) -> float:
    """Seconds the 12-item request takes without faults, after one warm-up run (first forwards of a
    shape and new connections are slower)."""
    await rx.encode("warm", items, num_items_assigned=[4, 4, 4])
    started = time.perf_counter()
    await rx.encode("baseline", items, num_items_assigned=[4, 4, 4])
    return time.perf_counter() - started


def healthy(proc: LaunchedProcess) -> bool:
    return proc.process.poll() is None


# Hold the victim's stream here: one item whole and the next half-way. Counted in bytes the receiver
# gets, so the fault lands at the same point of the stream however far ahead the victim had got (a
# process stopped by a signal may already have sent more into socket buffers). Which of its items
# comes first is the server's business: the assertions count items, never name them.
CUT_AFTER = ITEM_BYTES + ITEM_BYTES // 2
READ_RELAYED_S = 2.0


async def hold_mid_item(proxy, rx: EncoderReceiver, request_id: str, items: list[dict]) -> asyncio.Task:
    """Starts the 12-item request and returns once the victim's stream is held at CUT_AFTER: the
    fault the caller lands next comes after one item arrived whole and before the next one did."""
    held = asyncio.Event()
    proxy.arm(CUT_AFTER, fault=held.set, hang=True)
    request = asyncio.create_task(rx.encode(request_id, items, num_items_assigned=[4, 4, 4]))
    await asyncio.wait_for(held.wait(), 120)
    return request


def assert_one_victim_item_kept(result, victim_url: str, other_urls: list[str]) -> None:
    """The item that arrived whole before the fault is kept; the half-sent one and the unsent ones
    (of the victim's four, items 0-3) were encoded again on the others."""
    kept = [item.index for item in result.items if item.encoder_url == victim_url]
    assert len(kept) == 1 and kept[0] in range(4), kept
    assert {item.encoder_url for item in result.items if item.index != kept[0]} <= set(other_urls)


async def test_hung_encoder_mid_stream_request_completes_within_the_deadline(trio, big_reference):
    victim, *others = trio
    # A healthy encoder's stream may go quiet under load; the probe that follows must not miss its answer.
    policy = FailoverPolicy(stall_timeout_s=2.0, probe_timeout_s=5.0, backoff_s=0.5)
    items = [{"data": d} for d in BIG]
    async with fault_proxy(victim.port) as proxy:
        urls = [proxy.url, *(p.url for p in others)]
        async with EncoderReceiver(urls, failover=policy, timeout=60.0, seed=0) as rx:
            baseline = await timed_baseline(rx, items)
            started = time.perf_counter()
            # The victim stops (SIGSTOP) mid-item: its stream goes silent and its health probes unanswered.
            request = await hold_mid_item(proxy, rx, "hang", items)
            os.kill(victim.process.pid, signal.SIGSTOP)
            try:
                result = await request
                elapsed = time.perf_counter() - started
                assert_matches(result, BIG, big_reference)
                assert_one_victim_item_kept(result, proxy.url, urls[1:])
                # Abandoned by the stall watch (2 s of silence, then a probe unanswered for 5 s), not at
                # the 60 s deadline: a bound no loaded machine comes near.
                assert elapsed < 30.0
                assert rx.metrics.shard_failures == {(proxy.url, "UNAVAILABLE"): 1}
                assert rx.healthy_urls() == urls[1:]

                started = time.perf_counter()
                after = await rx.encode("after-hang", items)  # the hung encoder is skipped, not waited on
                skip_elapsed = time.perf_counter() - started
                assert {i.encoder_url for i in after.items} <= set(urls[1:])
                assert rx.metrics.shard_failures == {(proxy.url, "UNAVAILABLE"): 1}  # no call went to it
            finally:
                os.kill(victim.process.pid, signal.SIGCONT)
                proxy.resume()
            # Back from the hang: after its back-off, a health probe (not a request) lets it back in.
            back_deadline = time.monotonic() + 60
            while proxy.url not in rx.healthy_urls():
                assert time.monotonic() < back_deadline, "the resumed encoder was never probed back in"
                await rx.encode("probe-trigger", items[:2])
                await asyncio.sleep(0.2)
    print(f"hang: baseline {baseline:.2f} s, with SIGSTOP mid-stream {elapsed:.2f} s, next request {skip_elapsed:.2f} s")


async def test_kill_9_one_of_three_encoders_mid_stream_all_12_items_correct(trio, big_reference):
    victim, *others = trio
    assert all(map(healthy, trio))
    items = [{"data": d} for d in BIG]
    # Only the kill may fail an encoder here: no stall watch fires on a busy machine's slow forwards.
    policy = FailoverPolicy(stall_timeout_s=60.0, probe_timeout_s=10.0)
    async with fault_proxy(victim.port) as proxy:
        urls = [proxy.url, *(p.url for p in others)]
        async with EncoderReceiver(urls, failover=policy, timeout=120.0, seed=0) as rx:
            baseline = await timed_baseline(rx, items)
            started = time.perf_counter()
            # kill -9 mid-item: the half-received item must be rewritten from scratch elsewhere, the whole one kept.
            request = await hold_mid_item(proxy, rx, "kill", items)
            # A broken connection makes gRPC drop what it received and the receiver has not read yet:
            # the receiver, on this event loop, gets its turn to read the relayed item first.
            await asyncio.sleep(READ_RELAYED_S)
            victim.process.kill()
            assert victim.process.wait(10) == -signal.SIGKILL
            proxy.cut()  # what the receiver sees of a killed peer: what came before, then the connection's end
            result = await request
            elapsed = time.perf_counter() - started
            assert_matches(result, BIG, big_reference)
            assert_one_victim_item_kept(result, proxy.url, urls[1:])
            assert rx.metrics.shard_failures == {(proxy.url, "UNAVAILABLE"): 1}
            assert rx.healthy_urls() == urls[1:]
            assert_matches(await rx.encode("after-kill", items), BIG, big_reference)
    print(f"kill -9: baseline {baseline:.2f} s, with kill -9 mid-stream {elapsed:.2f} s")


# --- overload and SIGTERM on two small-queue encoders -------------------------------------------

SMALL = [image_bytes(28 * (1 + i % 4), 28 * (1 + (i * 3) % 5), seed=100 + i) for i in range(16)]


@pytest.fixture(scope="module")
def small_reference(default_model_dir):
    return references(default_model_dir, SMALL)


@pytest.fixture(scope="module")
def duo(default_model_dir, tmp_path_factory):
    flags = ("--max-queue-items", "8", "--preprocess-workers", "2", "--grace-seconds", "20")
    with launch_servers(default_model_dir, 2, "--dtype", "float32", *flags, log_dir=tmp_path_factory.mktemp("duo")) as procs:
        yield procs


async def test_an_encoder_down_for_thousands_of_probes_stays_benched_and_requests_go_on():
    """A dead encoder in a fixed list fails a probe whenever a request finds no encoder healthy. After
    1,024 failures in a row its doubling back-off overflowed a float, and every request failed with
    the OverflowError (an encoder-gateway answered 500s): the back-off must stay capped however long."""
    endpoint = EncoderEndpoint.connect(f"grpc://127.0.0.1:{free_port()}")
    policy = FailoverPolicy()
    tracker = HealthTracker(policy)
    tracker.of(endpoint).mark_failed("connection refused")
    try:
        for _ in range(1100):
            assert await tracker.usable([endpoint], set(), time.monotonic() + 5) == []
        health = tracker.of(endpoint)
        assert health.failures == 1101 and not health.healthy
        assert 0.8 * policy.max_backoff_s <= health.retry_at - time.monotonic() <= 1.2 * policy.max_backoff_s
    finally:
        await endpoint.channel.close()


async def test_200_concurrent_requests_each_complete_correctly_or_fail_fast_with_resource_exhausted(duo, small_reference):
    rng = random.Random(7)
    requests = [rng.sample(SMALL, 4) for _ in range(200)]
    outcomes: dict[str, list[float]] = {"completed": [], "RESOURCE_EXHAUSTED": []}

    async with EncoderReceiver([p.url for p in duo], timeout=60.0, seed=1) as rx:

        async def one(i: int, images: list[bytes]) -> None:
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(rx.encode(f"load-{i}", [{"data": d} for d in images]), 90)
            except EncodeFailedError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
                assert all(len(exc.attempts[j]) <= rx.failover.max_attempts for j in exc.item_indices)
                outcomes["RESOURCE_EXHAUSTED"].append(time.perf_counter() - started)
                return
            assert result.request_id == f"load-{i}"
            assert_matches(result, images, small_reference)  # its own rows, in its own order
            outcomes["completed"].append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one(i, images) for i, images in enumerate(requests)))
        wall = time.perf_counter() - started
        assert rx.healthy_urls() == [p.url for p in duo]  # overloaded is not broken
    done, refused = outcomes["completed"], outcomes["RESOURCE_EXHAUSTED"]
    assert len(done) + len(refused) == 200 and len(done) > 0
    slowest_refusal = max(refused, default=0.0)  # every refusal is RESOURCE_EXHAUSTED: after its retries, not timed out
    median = statistics.median(refused) if refused else 0.0
    print(
        f"200 x 4 images on 2 encoders (queue 8): {len(done)} completed, {len(refused)} RESOURCE_EXHAUSTED "
        f"after retries; wall {wall:.1f} s; slowest completion {max(done):.2f} s; refusals median {median:.2f} s, "
        f"slowest {slowest_refusal:.2f} s"
    )


async def test_sigterm_during_load_loses_no_accepted_request(duo, small_reference):
    victim, survivor = duo
    rng = random.Random(8)
    requests = [rng.sample(SMALL, 2) for _ in range(60)]
    completed = 0
    signalled = asyncio.Event()
    limit = asyncio.Semaphore(3)  # 3 x 2 items: within one encoder's queue of 8 once the other drains

    async with EncoderReceiver([victim.url, survivor.url], timeout=60.0, seed=2) as rx:

        async def one(i: int, images: list[bytes]) -> None:
            nonlocal completed
            async with limit:
                result = await asyncio.wait_for(rx.encode(f"term-{i}", [{"data": d} for d in images]), 90)
            assert_matches(result, images, small_reference)
            completed += 1
            if completed == 10:
                victim.process.send_signal(signal.SIGTERM)
                signalled.set()

        await asyncio.gather(*(one(i, images) for i, images in enumerate(requests)))
    assert signalled.is_set() and completed == 60
    assert victim.process.wait(30) == 0
    log = victim.log()
    assert "draining" in log and "stopped" in log and "Traceback" not in log


async def test_sigterm_drain_not_serving_at_once_new_calls_unavailable_running_call_finishes(duo):
    (proc,) = [p for p in duo if healthy(p)][-1:]
    # 3 items of 1024 tokens x 8 KiB: 24 MiB, far more than flow control lets through, and within the
    # stream budget's share for a connection that has not read a call yet (each holds ~36 MB unsent;
    # such a connection may hold half the budget, 128 MiB).
    images = [image_bytes(896, 896, seed=40 + i) for i in range(3)]
    target = proc.url.removeprefix("grpc://")
    async with grpc.aio.insecure_channel(target) as running_channel, grpc.aio.insecure_channel(target) as probe_channel:
        encode = running_channel.unary_stream(
            f"/{SERVICE}/Encode", request_serializer=pb.EncodeRequest.SerializeToString, response_deserializer=pb.EncodeResponse.FromString
        )
        call = encode(pb.EncodeRequest(request_id="long", items=[pb.ImageItem(index=i, modality=pb.IMAGE, data=d) for i, d in enumerate(images)]))
        first = await call.read()  # running now; we stop reading, so flow control holds it open
        assert first.WhichOneof("kind") == "header"
        proc.process.send_signal(signal.SIGTERM)

        health = health_pb2_grpc.HealthStub(probe_channel)
        deadline = time.monotonic() + 60
        while (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health did not turn NOT_SERVING"
            await asyncio.sleep(0.02)
        new_call = probe_channel.unary_stream(f"/{SERVICE}/Encode", request_serializer=pb.EncodeRequest.SerializeToString)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in new_call(pb.EncodeRequest(request_id="late", items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=images[0])]), timeout=5):
                pass
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "the encoder server is shutting down"

        headers = [first.header]
        while (message := await call.read()) is not grpc.aio.EOF:
            if message.WhichOneof("kind") == "header":
                headers.append(message.header)
        assert await call.code() == grpc.StatusCode.OK
        assert [h.index for h in headers] == list(range(3))
    assert proc.process.wait(30) == 0


# --- in-process life cycle: health, a dead forward worker, expired deadlines --------------------


class WorkerKilled(BaseException):
    """Stands in for what ends a thread outright rather than failing one batch."""


@pytest.fixture(scope="module")
def tower(default_model_dir):
    return load_vision_encoder(default_model_dir, "cpu", torch.float32)


async def health_status(url: str) -> int:
    async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    return reply.status


async def test_failed_warmup_never_serves(default_model_dir, tower):
    from encoder_server.server import EncoderServer
    from testkit.servers import server_config

    encoder = EncoderDouble(tower)
    encoder.fail_with = RuntimeError("no device")
    server = EncoderServer(server_config(default_model_dir), encoder=encoder)
    with pytest.raises(RuntimeError, match="no device"):
        await server.start()
    assert server.port is None  # never bound, so never SERVING
    assert not server._batcher.alive


async def test_dead_forward_worker_turns_health_not_serving_and_calls_fail_over(default_model_dir, tower):
    encoder = EncoderDouble(tower)
    async with running_server(default_model_dir, encoder=encoder) as doomed, running_server(default_model_dir) as spare:
        assert await health_status(doomed.url) == health_pb2.HealthCheckResponse.SERVING
        encoder.fail_with = WorkerKilled()
        async with EncoderReceiver([doomed.url, spare.url], timeout=20.0, seed=0) as rx:
            # The batch in flight when the worker dies fails with UNAVAILABLE (it does not hang), and
            # its items move to the spare.
            result = await rx.encode("dies", [{"data": image_bytes(56, 56, seed=i)} for i in range(4)], num_items_assigned=[4, 0])
            assert {item.encoder_url for item in result.items} == {spare.url}
            assert rx.healthy_urls() == [spare.url]
        deadline = time.monotonic() + 60
        while await health_status(doomed.url) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


async def test_server_drops_the_work_of_a_call_whose_deadline_passed(default_model_dir, tower):
    encoder = EncoderDouble(tower)
    async with running_server(default_model_dir, encoder=encoder) as server:
        warm = encoder.items_forwarded
        encoder.hold()
        async with EncoderReceiver([server.url], timeout=20.0) as rx:
            holding = asyncio.create_task(rx.encode("holds-the-worker", [{"data": image_bytes(56, 56)}]))
            await asyncio.to_thread(encoder.in_forward.wait, 10)
            started = time.perf_counter()
            with pytest.raises(EncodeFailedError) as raised:
                await rx.encode("expires", [{"data": image_bytes(56, 84, seed=s)} for s in range(3)], timeout=0.5)
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # The 0.5 s deadline ends the call, not the held forward (released only below, after it).
            assert time.perf_counter() - started < 25.0
            encoder.release()
            assert (await holding).items[0].num_tokens == 4
            after = await rx.encode("after", [{"data": image_bytes(56, 56, seed=99)}])
            assert after.items[0].num_tokens == 4
        # Forwards ran for the holding call and the one after, never for the expired call's 3 items.
        assert encoder.items_forwarded - warm == 2
