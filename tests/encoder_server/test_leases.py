"""Leases and Fetch: an item encoded with a lease streams back by its content key, byte for byte, over
the stream and shared memory; unknown, expired, evicted and fetched keys are NOT_FOUND saying why."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from encoder_server.leases import LeaseConfig, LeaseStore
from encoder_server.transports.shm import ShmConfig
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver
from receiver.fleet.channels import EncoderEndpoint
from receiver.fleet.fetch import FetchFailedError
from testkit.images import image_bytes
from testkit.servers import running_server

IMAGES = [image_bytes(64, 48, seed=1), image_bytes(96, 64, seed=2)]


class ManualClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def fetch_status(url: str, keys: list[bytes]) -> grpc.aio.AioRpcError:
    endpoint = EncoderEndpoint.connect(url)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in endpoint.fetch(pb.FetchRequest(request_id="raw", keys=keys), timeout=30):
                pass
        return caught.value
    finally:
        await endpoint.close()


@pytest.mark.parametrize("transfer", ["grpc", "shm"])
async def test_leased_items_fetch_back_byte_for_byte_once_per_grant(default_model_dir, transfer):
    async with running_server(default_model_dir, shm=ShmConfig(min_bytes=0)) as server:
        async with EncoderReceiver([server.url], transfer=transfer) as rx:
            encoded = await rx.encode("r1", [{"data": data} for data in IMAGES], lease_ms=30_000)
            keys = [item.lease.key for item in encoded.items]
            assert all(len(key) == 32 for key in keys) and keys[0] != keys[1]
            assert all(0 < item.lease.ttl_ms <= 30_000 for item in encoded.items)
            assert len(server.leases) == 2
            for item, key in zip(encoded.items, keys):
                fetched = await rx.fetch("f1", key)
                assert torch.equal(fetched.embedding, item.embedding)
                assert fetched.grid_thw == item.grid_thw
            if transfer == "shm":
                assert rx.transfer_stats.items_shm == 4  # two encoded, two fetched
            # One grant, one fetch: the lease is used up.
            assert len(server.leases) == 0 and server.leases.bytes == 0
            with pytest.raises(FetchFailedError, match="already fetched") as caught:
                await rx.fetch("f2", keys[0])
            assert caught.value.not_found


async def test_a_fetch_over_shared_memory_lands_in_the_callers_own_tensor(default_model_dir):
    async with running_server(default_model_dir, shm=ShmConfig(min_bytes=0)) as server:
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            encoded = await rx.encode("r", [{"data": IMAGES[0]}], lease_ms=30_000)
            given: list[torch.Tensor] = []

            def allocate(shape, dtype):
                given.append(torch.full(shape, -1.0).to(dtype))
                return given[-1]

            fetched = await rx.fetch("f", encoded.items[0].lease.key, allocate=allocate)
            assert len(given) == 1 and fetched.embedding.data_ptr() == given[0].data_ptr()
            assert torch.equal(fetched.embedding, encoded.items[0].embedding)
            assert rx.transfer_stats.items_shm == 2  # encoded and fetched through segments


async def test_a_key_leased_twice_is_kept_for_two_fetches(default_model_dir):
    async with running_server(default_model_dir) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            first = await rx.encode("a", [{"data": IMAGES[0]}], lease_ms=30_000)
            second = await rx.encode("b", [{"data": IMAGES[0]}], lease_ms=30_000)
            key = first.items[0].lease.key
            assert second.items[0].lease.key == key and second.items[0].cache_hit
            await rx.fetch("f1", key)
            await rx.fetch("f2", key)
            with pytest.raises(FetchFailedError, match="already fetched"):
                await rx.fetch("f3", key)


async def test_unknown_and_malformed_keys_are_refused_with_their_reason(default_model_dir):
    async with running_server(default_model_dir) as server:
        error = await fetch_status(server.url, [bytes(32)])
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "never leased on this server" in error.details() and bytes(32).hex() in error.details()
        error = await fetch_status(server.url, [b"short"])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "32-byte" in error.details()
        error = await fetch_status(server.url, [])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no keys" in error.details()
        # The server keeps serving.
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            assert (await rx.encode("after", [{"data": IMAGES[0]}])).items[0].num_tokens > 0


async def test_expired_and_evicted_leases_are_not_found_saying_which(default_model_dir):
    async with running_server(default_model_dir) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            encoded = await rx.encode("r", [{"data": data} for data in IMAGES], lease_ms=30_000)
            first, second = (item.lease.key for item in encoded.items)
            clock = ManualClock()
            # A budget that holds one of the two items: granting the second evicts the first.
            budget = server.leases.bytes - 1
            store = LeaseStore(LeaseConfig(max_bytes=budget, max_ttl_s=10.0), clock=clock)
            server_payloads = {key: server.leases.get(key) for key in (first, second)}
            store.grant(first, server_payloads[first], 5_000)
            store.grant(second, server_payloads[second], 5_000)
            assert store.evictions == 1
            with pytest.raises(Exception, match="evicted"):
                store.get(first)
            assert store.get(second) is server_payloads[second]
            clock.now += 5.0  # the lease's deadline, to the tick
            with pytest.raises(Exception, match="expired"):
                store.get(second)
            assert store.bytes == 0 and store.expirations == 1


async def test_leases_expire_on_the_server_and_a_ttl_is_capped(default_model_dir):
    async with running_server(default_model_dir, leases=LeaseConfig(max_ttl_s=0.2)) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            encoded = await rx.encode("r", [{"data": IMAGES[0]}], lease_ms=60_000)
            assert encoded.items[0].lease.ttl_ms == 200
            await asyncio.sleep(0.5)  # 2.5x the capped lease
            with pytest.raises(FetchFailedError, match="expired"):
                await rx.fetch("late", encoded.items[0].lease.key)


async def test_a_server_without_leases_refuses_a_lease_and_says_so(default_model_dir):
    async with running_server(default_model_dir, leases=LeaseConfig(max_bytes=0)) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            with pytest.raises(Exception, match="grants no leases"):
                await rx.encode("r", [{"data": IMAGES[0]}], lease_ms=1000)
            info = (await rx.model_info())[server.url]
            assert info.lease_max_bytes == 0
        error = await fetch_status(server.url, [bytes(32)])
        assert error.code() == grpc.StatusCode.NOT_FOUND and "grants no leases" in error.details()


async def test_model_info_advertises_the_lease_budget(default_model_dir):
    async with running_server(
        default_model_dir, leases=LeaseConfig(max_bytes=1 << 20, max_ttl_s=5)
    ) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            info = (await rx.model_info())[server.url]
    assert info.lease_max_bytes == 1 << 20 and info.lease_max_ttl_ms == 5000


async def test_withheld_payloads_stay_on_the_encoder_until_fetched(default_model_dir):
    async with running_server(default_model_dir) as server:
        async with (
            EncoderReceiver([server.url], transfer="grpc") as full,
            EncoderReceiver([server.url]) as rx,
        ):
            reference = await full.encode("ref", [{"data": data} for data in IMAGES])
            withheld = await rx.encode(
                "w", [{"data": data} for data in IMAGES], lease_ms=30_000, withhold_payloads=True
            )
            assert (
                rx.transfer_stats.items_shm == 0 and rx.transfer_stats.items_grpc == 0
            )  # no payload offered
            for item, want in zip(withheld.items, reference.items):
                assert item.embedding.device.type == "meta"  # shape and dtype, no data
                assert item.embedding.shape == want.embedding.shape and item.grid_thw == want.grid_thw
                fetched = await rx.fetch("f", item.lease.key, prefer_url=server.url)
                assert torch.equal(fetched.embedding, want.embedding)
            with pytest.raises(ValueError, match="needs a lease"):
                await rx.encode("x", [{"data": IMAGES[0]}], withhold_payloads=True)
