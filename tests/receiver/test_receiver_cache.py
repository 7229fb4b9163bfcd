"""The receiver's embedding cache: a repeated image costs no RPC, concurrent requests for one image
make one, results stay correct whatever callers do to their tensors, and leases, shared memory and
precomputed items work beside it. Real servers, counted by an interceptor on each."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from encoder_server.transports.shm import ShmConfig
from receiver import EncoderReceiver, ItemResult
from receiver.embeddings.item_cache import ItemCache
from testkit.images import image_bytes
from testkit.rpc_log import logged_server

IMAGES = [image_bytes(56 + 28 * i, 56, seed=200 + i) for i in range(6)]


def item(index: int, fill: float, rows: int = 4) -> ItemResult:
    return ItemResult(index, torch.full((rows, 8), fill), (1, 2, 2), "grpc://e:1")


def test_the_cache_hands_out_copies_and_keeps_its_own():
    cache = ItemCache(1 << 20)
    original = item(0, 1.0)
    cache.put(b"k", original)
    original.embedding.fill_(9.0)  # the caller that put it keeps changing its tensor
    first = cache.get(b"k", 3)
    first.embedding.fill_(7.0)  # so does the one that got it
    second = cache.get(b"k", 5)
    assert second.embedding.eq(1.0).all() and second.index == 5 and second.receiver_cache_hit
    assert second.embedding.data_ptr() != first.embedding.data_ptr()


def test_the_cache_is_bounded_in_bytes_least_recently_used_out_first():
    one = item(0, 1.0).embedding.nbytes  # 128 bytes
    cache = ItemCache(3 * one)
    for key in (b"a", b"b", b"c"):
        cache.put(key, item(0, 1.0))
    assert cache.get(b"a", 0) is not None  # a is now the most recent
    cache.put(b"d", item(0, 1.0))
    assert cache.get(b"b", 0) is None and len(cache) == 3 and cache.bytes == 3 * one
    cache.put(b"huge", item(0, 1.0, rows=100))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get(b"huge", 0) is None and len(cache) == 3


@pytest.fixture(scope="module")
async def pair(default_model_dir):
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(logged_server(default_model_dir)) for _ in range(2)]
        yield servers


def encoded(servers) -> list[int]:
    """Every item index the servers were sent, over all Encode calls so far."""
    return [i for server in servers for call in server.rpc_log.sent("Encode") for i in call]


async def test_a_repeated_image_costs_no_rpc_and_stays_correct_when_callers_modify_results(pair):
    async with EncoderReceiver([s.url for s in pair], placement="affinity", cache_bytes=64 << 20) as rx:
        before = len(encoded(pair))
        first = await rx.encode("first", [{"data": IMAGES[0]}, {"data": IMAGES[1]}, {"data": IMAGES[0]}])
        assert len(encoded(pair)) - before == 2  # the repeat within the request is encoded once
        assert first.items[2].receiver_cache_hit and first.items[2].embedding.equal(first.items[0].embedding)
        want = [first.items[0].embedding.clone(), first.items[1].embedding.clone()]
        first.items[0].embedding.fill_(0.0)  # a caller writes into what it got

        again = await rx.encode("again", [{"data": IMAGES[1]}, {"data": IMAGES[0]}])
        assert len(encoded(pair)) - before == 2  # no RPC at all
        assert [i.receiver_cache_hit for i in again.items] == [True, True]
        assert again.items[0].embedding.equal(want[1]) and again.items[1].embedding.equal(want[0])
        assert rx.metrics.snapshot()["cache_lookups"] == {"hit": 3, "miss": 2}
        assert rx.metrics.snapshot()["cache_bytes"] == rx.cache.bytes > 0


async def test_images_that_share_a_fast_hash_never_get_each_others_embedding(pair, monkeypatch):
    """The cache and the image references key on each image's sha256; the fast hash (xxh3-128) only
    says where to look, here the same for every image."""
    import encoder_common.digests
    import receiver.fleet.failover

    same = b"same for every image"
    monkeypatch.setattr(encoder_common.digests.xxhash, "xxh3_128_digest", lambda data: same)
    monkeypatch.setattr(receiver.fleet.failover, "content_key", lambda data: same)  # the held digests' and memo's key
    async with EncoderReceiver([pair[0].url], cache_bytes=64 << 20) as rx:
        first = (await rx.encode("first", [{"data": IMAGES[4]}])).items[0]
        other = (await rx.encode("other", [{"data": IMAGES[5]}])).items[0]
        again = (await rx.encode("again", [{"data": IMAGES[5]}, {"data": IMAGES[4]}])).items
    async with EncoderReceiver([pair[1].url]) as alone:
        want = (await alone.encode("alone", [{"data": IMAGES[5]}])).items[0]
    assert not other.receiver_cache_hit and other.embedding.equal(want.embedding)
    assert not other.embedding.equal(first.embedding)
    assert again[0].embedding.equal(want.embedding) and again[1].embedding.equal(first.embedding)


async def test_concurrent_requests_for_one_new_image_make_one_rpc(pair):
    async with EncoderReceiver([s.url for s in pair], cache_bytes=64 << 20, seed=0) as rx:
        before = len(encoded(pair))
        results = await asyncio.gather(*(rx.encode(f"c{i}", [{"data": IMAGES[2]}]) for i in range(8)))
        assert len(encoded(pair)) - before == 1
        assert all(r.items[0].embedding.equal(results[0].items[0].embedding) for r in results)
        assert sum(r.items[0].receiver_cache_hit for r in results) == 7


async def test_leased_calls_bypass_the_cache_and_precomputed_items_pass_through(pair):
    async with EncoderReceiver([s.url for s in pair], placement="affinity", cache_bytes=64 << 20) as rx:
        plain = await rx.encode("plain", [{"data": IMAGES[3]}])
        before = len(encoded(pair))
        leased = await rx.encode("leased", [{"data": IMAGES[3]}], lease_ms=5000)
        assert len(encoded(pair)) - before == 1 and leased.items[0].lease.key  # a lease needs the encoder
        precomputed = {"precomputed_embedding": plain.items[0].embedding, "grid_thw": plain.items[0].grid_thw}
        mixed = await rx.encode("mixed", [precomputed, {"data": IMAGES[3]}])
        assert len(encoded(pair)) - before == 1
        assert mixed.items[0].precomputed and mixed.items[1].receiver_cache_hit
        assert mixed.items[0].embedding.equal(mixed.items[1].embedding)


async def test_shared_memory_results_are_cached_as_copies(default_model_dir):
    async with logged_server(default_model_dir, shm=ShmConfig()) as server:
        async with EncoderReceiver([server.url], transfer="shm", cache_bytes=64 << 20) as rx:
            first = await rx.encode("shm", [{"data": IMAGES[4]}, {"data": IMAGES[5]}])
            assert rx.transfer_stats.items_shm == 2
            want = [i.embedding.clone() for i in first.items]
            del first  # its buffers go back to the receiver's pool and are reused
            await rx.encode("other", [{"data": image_bytes(112, 112, seed=99)}])
            again = await rx.encode("again", [{"data": IMAGES[4]}, {"data": IMAGES[5]}])
            assert [i.receiver_cache_hit for i in again.items] == [True, True]
            assert all(i.embedding.equal(w) for i, w in zip(again.items, want))
            assert len(server.rpc_log.sent("Encode")) == 2
