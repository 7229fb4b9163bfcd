"""Several receivers (prefill nodes) sharing one fleet of real servers, a Zipf-repeated workload sent by all
at once: every receiver places an image where the others do, so the fleet encodes each image about once,
with and without the fleet-wide store (a real redis-server); and with the store, an encoder restarted
with an empty cache starts warm. The full-size runs are scripts/bench_affinity.py's shared scenarios."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest
import torch

from encoder_server.store import StoreConfig
from receiver import EncoderReceiver
from testkit import load_script
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.redis_server import running_redis
from testkit.servers import running_server

pytestmark = pytest.mark.services  # a real redis-server (scripts/setup_redis.sh)

workloads = load_script("bench_affinity_scenarios/workloads")

FORWARD_S = 0.004
_seeds = itertools.count(70_000)


def images(count: int) -> list[bytes]:
    return [image_bytes(32 + 4 * (i % 5), 32, seed=next(_seeds)) for i in range(count)]


def double() -> EncoderDouble:
    return EncoderDouble(tokens=16, dtype=torch.float32, forward_s=FORWARD_S)


@contextlib.asynccontextmanager
async def fleet(model_dir, count: int, **overrides):
    """`count` in-process encoders on made-up embeddings whose forwards take FORWARD_S."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(running_server(model_dir, encoder=double(), **overrides))
            for _ in range(count)
        ]


async def send(receivers: list[EncoderReceiver], requests: list[tuple[int, list[int]]], pictures: list[bytes]) -> int:
    """The requests dealt round-robin to the receivers, all sending at once (3 in flight each); returns
    the forwards the encoders ran for them (items that were not cache hits)."""
    forwards = 0

    async def one_receiver(rx: EncoderReceiver, share) -> None:
        nonlocal forwards
        queue = iter(share)

        async def client() -> None:
            nonlocal forwards
            for number, picks in queue:
                result = await rx.encode(f"r{number}", [{"data": pictures[i]} for i in picks])
                forwards += sum(not item.cache_hit for item in result.items)

        await asyncio.gather(*(client() for _ in range(3)))

    await asyncio.gather(*(one_receiver(rx, requests[i :: len(receivers)]) for i, rx in enumerate(receivers)))
    return forwards


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.mark.parametrize("with_store", [False, True], ids=["no store", "store"])
async def test_three_receivers_over_four_encoders_encode_each_image_about_once(default_model_dir, redis_url, with_store):
    workload = workloads.zipf_workload(240, 120, 1.1, seed=5)
    distinct = len({i for picks in workload for i in picks})
    store = {"store": StoreConfig(url=redis_url)} if with_store else {}
    async with fleet(default_model_dir, 4, **store) as servers, contextlib.AsyncExitStack() as stack:
        urls = [s.url for s in servers]
        receivers = [await stack.enter_async_context(EncoderReceiver(urls, placement="affinity")) for _ in range(3)]
        forwards = await send(receivers, list(enumerate(workload)), images(120))
    assert distinct <= forwards <= 1.05 * distinct, (forwards, distinct)


async def test_with_the_store_an_encoder_restarted_with_an_empty_cache_starts_warm(default_model_dir, redis_url):
    workload = workloads.zipf_workload(240, 120, 1.1, seed=9)
    pictures = images(120)
    half = len(workload) // 2
    numbered = list(enumerate(workload))
    store = StoreConfig(url=redis_url)
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(running_server(default_model_dir, encoder=double(), store=store))
            for _ in range(3)
        ]
        first_life = contextlib.AsyncExitStack()
        stack.push_async_callback(first_life.aclose)
        victim = await first_life.enter_async_context(running_server(default_model_dir, encoder=double(), store=store))
        urls = [s.url for s in servers] + [victim.url]
        receivers = [await stack.enter_async_context(EncoderReceiver(urls, placement="affinity")) for _ in range(3)]
        await send(receivers, numbered[:half], pictures)
        await first_life.aclose()  # stopped: what its cache held is gone
        restarted = running_server(default_model_dir, encoder=double(), store=store, port=victim.port)
        again = await stack.enter_async_context(restarted)
        assert again.url == victim.url and len(again.cache) == 0
        forwards = await send(receivers, numbered[half:], pictures)
        assert again.store.stats.lookups["hit"] > 0  # the images it held before came back from the store
    new = {i for picks in workload[half:] for i in picks} - {i for picks in workload[:half] for i in picks}
    assert forwards <= 1.05 * len(new), (forwards, len(new))
