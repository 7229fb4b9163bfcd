"""The embedding cache: LRU in bytes, keys that pin the model, single flight, and hits through a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import grpc
import pytest
import torch

from encoder_common import digests
from encoder_common.digests import DigestMemo
from encoder_server.cache import EmbeddingCache, cache_namespace
from encoder_server.cli import build_parser
from encoder_server.models import load_vision_encoder
from encoder_server.payload import ItemPayload
from encoder_server.profiles import PROFILES
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver
from receiver.fleet.channels import EncoderEndpoint
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server
from tests.encoder_server.test_batcher import eventually

NAMESPACE = hashlib.sha256(b"test-model").digest()


def payload(size: int, tag: int = 0) -> ItemPayload:
    """A payload of one `size`-byte part; its chunk message adds 2 bytes of framing."""
    return ItemPayload(pb.ItemHeader(num_tokens=tag), [torch.full((size,), tag, dtype=torch.uint8)])


def key_of(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def test_lru_stays_within_its_byte_budget_and_evicts_the_least_recently_used():
    cache = EmbeddingCache(100, NAMESPACE)
    for n in range(3):
        cache.put(key_of(n), payload(40, n))  # 42 bytes each: the third put would make 126, so item 0 goes
    assert cache.get(key_of(0)) is None and len(cache) == 2 and cache.bytes == 84
    assert cache.get(key_of(1)).header.num_tokens == 1  # now the most recently used
    cache.put(key_of(3), payload(40, 3))
    assert cache.get(key_of(2)) is None and cache.get(key_of(1)) is not None
    assert cache.bytes == 84 and cache.evictions == 2
    cache.put(key_of(4), payload(99))  # 101 bytes framed, more than the whole cache: not stored
    assert cache.get(key_of(4)) is None and len(cache) == 2
    cache.put(key_of(1), payload(10, 1))  # replacing an entry accounts for the old size
    assert cache.bytes == 54


def test_payload_chunks_are_framed_once_and_shared_by_callers_streaming_at_once():
    parts = [torch.arange(3 * wire.CHUNK_BYTES // 4, dtype=torch.int32), torch.arange(7, dtype=torch.int32)]
    item = ItemPayload(pb.ItemHeader(), parts)
    first, second = item.chunks(), item.chunks()
    interleaved = [next(first), next(second), next(second), next(first), *first, *second]
    # The 3 MiB part in three 1 MiB chunks, the 28-byte part in 1; twice.
    assert len(interleaved) == 8
    assert all(a is b for a, b in zip(interleaved[:4:2], interleaved[1:4:2]))
    assert list(item.chunks()) == interleaved[:4:2] + interleaved[4:6]
    assert sum(map(len, item.chunks())) == item.nbytes
    payload_bytes = b"".join(bytes(wire.parse_response(chunk)) for chunk in item.chunks())
    assert payload_bytes == b"".join(part.numpy().tobytes() for part in parts)


def test_keys_change_with_weights_preprocessing_profile_dtype_and_backend_but_not_otherwise(default_model_dir):
    spec = load_vision_encoder(default_model_dir, "cpu", torch.float32).spec
    vllm = PROFILES["vllm"]
    digest = hashlib.sha256(image_bytes(8, 8)).digest()
    base = EmbeddingCache(1, cache_namespace(spec, vllm)).key(digest)
    assert len(base) == 32
    assert EmbeddingCache(1, cache_namespace(dataclasses.replace(spec), vllm)).key(digest) == base
    for change in (
        {"weights_fingerprint": "0" * 64},
        {"preprocess_fingerprint": "0" * 64},
        {"dtype": torch.bfloat16},
        {"backend": "vllm"},  # two backends' embeddings of one image may differ in the last bits
        {"backend_version": "0.0.0"},
    ):
        assert EmbeddingCache(1, cache_namespace(dataclasses.replace(spec, **change), vllm)).key(digest) != base, change
    keys = {EmbeddingCache(1, cache_namespace(spec, profile)).key(digest) for profile in PROFILES.values()}
    assert len(keys) == len(PROFILES)  # two profiles never share an embedding
    other_image = hashlib.sha256(image_bytes(8, 8, seed=1)).digest()
    assert EmbeddingCache(1, cache_namespace(spec, vllm)).key(other_image) != base
    with pytest.raises(ValueError, match="32 bytes"):
        EmbeddingCache(1, NAMESPACE).key(digest[:16])


class Computation:
    """A compute function that waits for the test's go, and counts how often it ran."""

    def __init__(self, result: ItemPayload | Exception):
        self.result = result
        self.runs = 0
        self.cancelled = 0
        self.go = asyncio.Event()

    async def __call__(self) -> ItemPayload:
        self.runs += 1
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


async def test_concurrent_callers_of_one_key_compute_it_once():
    cache = EmbeddingCache(1000, NAMESPACE)
    compute = Computation(payload(10, 7))
    callers = [asyncio.create_task(cache.get_or_compute(key_of(1), compute)) for _ in range(3)]
    await asyncio.sleep(0)
    compute.go.set()
    results = await asyncio.gather(*callers)
    assert compute.runs == 1
    assert [hit for _, hit in results] == [False, True, True]
    assert all(p is results[0][0] for p, _ in results)
    assert (await cache.get_or_compute(key_of(1), compute)) == (results[0][0], True)
    assert (cache.misses, cache.hits) == (1, 3)


async def test_computation_survives_its_first_caller_leaving_while_another_waits():
    cache = EmbeddingCache(1000, NAMESPACE)
    compute = Computation(payload(10, 7))
    first = asyncio.create_task(cache.get_or_compute(key_of(1), compute))
    await asyncio.sleep(0)
    second = asyncio.create_task(cache.get_or_compute(key_of(1), compute))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    compute.go.set()
    assert (await second)[0].header.num_tokens == 7
    assert first.cancelled() and compute.runs == 1 and compute.cancelled == 0


async def test_computation_is_cancelled_when_every_caller_has_gone_and_the_next_starts_afresh():
    cache = EmbeddingCache(1000, NAMESPACE)
    compute = Computation(payload(10, 7))
    callers = [asyncio.create_task(cache.get_or_compute(key_of(1), compute)) for _ in range(2)]
    await asyncio.sleep(0)
    for caller in callers:
        caller.cancel()
    await asyncio.gather(*callers, return_exceptions=True)
    await asyncio.sleep(0)
    assert compute.cancelled == 1 and len(cache) == 0
    compute.go.set()
    assert (await cache.get_or_compute(key_of(1), compute)) == (compute.result, False)
    assert compute.runs == 2


async def test_errors_reach_every_waiting_caller_and_are_not_cached():
    cache = EmbeddingCache(1000, NAMESPACE)
    failing = Computation(ValueError("bytes are not an image"))
    callers = [asyncio.create_task(cache.get_or_compute(key_of(1), failing)) for _ in range(2)]
    await asyncio.sleep(0)
    failing.go.set()
    for outcome in await asyncio.gather(*callers, return_exceptions=True):
        assert isinstance(outcome, ValueError)
    working = Computation(payload(10, 3))
    working.go.set()
    assert (await cache.get_or_compute(key_of(1), working))[1] is False
    assert failing.runs == 1 and working.runs == 1


def test_cache_size_flag_and_its_environment_variable(monkeypatch):
    assert build_parser().parse_args(["--model", "m"]).cache_bytes == 1 << 30
    assert build_parser().parse_args(["--model", "m", "--cache-bytes", "0"]).cache_bytes == 0
    monkeypatch.setenv("ENCODER_CACHE_BYTES", "12345")
    assert build_parser().parse_args(["--model", "m"]).cache_bytes == 12345


# Through a real server on loopback.


@pytest.fixture(scope="module")
def encoder(default_model_dir):
    return EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))


@pytest.fixture(scope="module")
async def server(default_model_dir, encoder):
    async with running_server(default_model_dir, encoder=encoder) as server:
        yield server


@pytest.fixture
def counted(encoder):
    encoder.reset()
    yield encoder
    encoder.release()


async def test_repeated_image_is_a_hit_with_the_same_bytes_and_no_decode_or_forward(server, counted):
    image = image_bytes(100, 80, seed=21)
    async with EncoderReceiver([server.url]) as rx:
        first = (await rx.encode("first", [{"data": image}])).items[0]
        again = (await rx.encode("again", [{"data": image}, {"data": image_bytes(60, 60, seed=22)}])).items
    assert not first.cache_hit and first.forward_ms > 0
    assert again[0].cache_hit and not again[1].cache_hit
    assert torch.equal(again[0].embedding, first.embedding)
    assert again[0].grid_thw == first.grid_thw
    assert (again[0].queue_ms, again[0].preprocess_ms, again[0].forward_ms) == (0, 0, 0)
    assert counted.preprocessed == 2 and counted.items_forwarded == 2  # the hit was never decoded


async def test_concurrent_calls_for_one_image_compute_it_once(server, counted):
    image = image_bytes(90, 70, seed=23)
    counted.hold()
    hits = server.cache.hits
    async with EncoderReceiver([server.url]) as rx:
        calls = [asyncio.create_task(rx.encode(f"same-{i}", [{"data": image}])) for i in range(4)]
        assert await asyncio.to_thread(counted.in_forward.wait, 10)
        await eventually(lambda: server.cache.hits == hits + 3, "the other three calls joined the first")
        counted.release()
        results = [(await call).items[0] for call in calls]
    assert counted.items_forwarded == 1 and counted.preprocessed == 1
    assert sorted(r.cache_hit for r in results) == [False, True, True, True]
    for result in results[1:]:
        assert torch.equal(result.embedding, results[0].embedding)


async def test_content_sha256_is_checked_and_a_mismatch_is_refused(server, counted):
    image = image_bytes(40, 40, seed=24)
    endpoint = EncoderEndpoint.connect(server.url)
    try:
        good = pb.ImageItem(index=5, modality=pb.IMAGE, data=image, content_sha256=hashlib.sha256(image).digest())
        messages = [m async for m in endpoint.encode(pb.EncodeRequest(request_id="sha", items=[good]))]
        assert messages[0].index == 5 and not messages[0].cache_hit
        again = [m async for m in endpoint.encode(pb.EncodeRequest(request_id="sha-again", items=[good]))]
        assert again[0].cache_hit  # the client's digest and the server's own hash give the same key
        bad = pb.ImageItem(index=6, modality=pb.IMAGE, data=image, content_sha256=hashlib.sha256(b"other").digest())
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [m async for m in endpoint.encode(pb.EncodeRequest(request_id="bad-sha", items=[bad]))]
    finally:
        await endpoint.close()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "item 6: content_sha256 does not match the item's bytes"
    assert counted.items_forwarded == 1


async def test_a_bad_image_fails_every_call_that_waited_for_it_naming_each_ones_item(server, counted):
    counted.hold()
    async with EncoderReceiver([server.url]) as rx:
        calls = [
            asyncio.create_task(rx.encode(f"bad-{i}", [{"data": image_bytes(20, 20, seed=30 + i)}] * i + [{"data": b"junk"}]))
            for i in range(1, 3)
        ]
        counted.release()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for i, outcome in enumerate(outcomes, start=1):
        assert f"item {i}: bytes are not an image file" in str(outcome)
    async with EncoderReceiver([server.url]) as rx:  # nothing was cached for the junk bytes
        with pytest.raises(Exception, match="item 0: bytes are not an image file"):
            await rx.encode("junk-again", [{"data": b"junk"}])


async def test_cache_off_computes_every_time(default_model_dir, encoder):
    encoder.reset()
    image = image_bytes(50, 50, seed=25)
    async with running_server(default_model_dir, encoder=encoder, cache_bytes=0) as server:
        encoder.reset()  # the warm-up forward
        async with EncoderReceiver([server.url]) as rx:
            results = [(await rx.encode(f"off-{i}", [{"data": image}])).items[0] for i in range(2)]
    assert [r.cache_hit for r in results] == [False, False]
    assert encoder.items_forwarded == 2


def test_digest_memo_gives_sha256_of_bytes_seen_before_without_hashing_them_again(monkeypatch):
    memo = DigestMemo(max_bytes=1 << 20)
    image = image_bytes(64, 64)
    expected = hashlib.sha256(image).digest()
    assert memo.sha256(image) == expected
    hashed = []
    real_sha256 = digests.hashlib.sha256
    monkeypatch.setattr(digests.hashlib, "sha256", lambda data: hashed.append(data) or real_sha256(data))
    again = bytes(bytearray(image))  # equal bytes in another object, as the next request brings them
    assert memo.sha256(again) == expected
    assert hashed == [] and memo.hits == 1


def test_digest_memo_never_gives_a_digest_for_other_bytes_under_the_same_fast_hash(monkeypatch):
    monkeypatch.setattr(digests.xxhash, "xxh3_128_digest", lambda data: b"same for everyone")
    memo = DigestMemo(max_bytes=1 << 20)
    first, second = b"one image", b"another image"
    assert memo.sha256(first) == hashlib.sha256(first).digest()
    assert memo.sha256(second) == hashlib.sha256(second).digest()
    assert memo.sha256(first) == hashlib.sha256(first).digest()
    assert memo.hits == 0


def test_digest_memo_keeps_at_most_its_byte_budget_of_images():
    memo = DigestMemo(max_bytes=1000)
    for n in range(10):
        memo.sha256(bytes([n]) * 300)
    assert memo.bytes <= 1000
    memo.sha256(bytes([9]) * 300)  # the newest are kept
    assert memo.hits == 1
    assert memo.sha256(b"x" * 2000) == hashlib.sha256(b"x" * 2000).digest()  # larger than the memo: hashed
    assert memo.bytes <= 1000
