"""Affinity placement as encoders come and go, on real servers behind a DNS name the test controls: one
of five leaves and only its items move, for a fresh receiver too; one is killed mid-request and every
result is still correct."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter

import pytest
import torch

from receiver import EncoderReceiver
from receiver.fleet.affinity import content_key, ranking
from testkit.fault_proxy import fault_proxy
from testkit.images import image_bytes
from testkit.launcher import launch_server
from testkit.servers import running_server

NAME = "encoders.test"
URL = f"dns:///{NAME}:50051"
IMAGES = [image_bytes(56 + 28 * (i % 3), 56 + 28 * (i % 2), seed=1000 + i) for i in range(150)]


class Dns:
    """NAME -> the addresses the test lists now."""

    def __init__(self) -> None:
        self.ports: list[int] = []

    def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]


@pytest.fixture(scope="module")
async def fleet(default_model_dir, tmp_path_factory):
    """Four in-process encoders and a fifth in its own process (so it can be killed), reached through
    a fault proxy; all serve the built-in model in float32."""
    async with contextlib.AsyncExitStack() as stack:
        local = [await stack.enter_async_context(running_server(default_model_dir)) for _ in range(4)]
        log_dir = tmp_path_factory.mktemp("membership")
        victim = stack.enter_context(launch_server(default_model_dir, "--dtype", "float32", log_dir=log_dir))
        proxy = await stack.enter_async_context(fault_proxy(victim.port))
        yield local, victim, proxy


async def places(rx: EncoderReceiver) -> dict[bytes, str]:
    """Where each image goes, one single-item request each."""
    where = {}
    for number, data in enumerate(IMAGES):
        result = await rx.encode(f"place-{number}", [{"data": data}])
        where[data] = result.items[0].encoder_url
    return where


async def test_one_of_five_leaving_moves_only_its_items_and_a_killed_one_loses_none(fleet):
    local, victim, proxy = fleet
    dns = Dns()
    dns.ports = [s.port for s in local] + [proxy.port]
    gone_url = f"grpc://127.0.0.1:{proxy.port}"
    async with EncoderReceiver([URL], resolver=dns, refresh_s=0.0, placement="affinity", timeout=120.0) as rx:
        before = await places(rx)
        urls = sorted(set(before.values()))
        assert len(urls) == 5 and gone_url in urls
        for data, url in before.items():  # each on its first-ranked encoder
            assert url == urls[ranking(content_key(data), urls)[0]]

        dns.ports = dns.ports[:4]  # the fifth leaves the name (scaled down, or failed over)
        async with EncoderReceiver([URL], resolver=dns, refresh_s=0.0, placement="affinity") as fresh:
            after = await places(fresh)  # a new prefill node: it places every image where rx did
        stayed = [data for data, url in before.items() if url != gone_url]
        moved = [data for data in stayed if after[data] != before[data]]
        assert len(moved) <= 0.02 * len(stayed)
        spread = Counter(after[data] for data, url in before.items() if url == gone_url)
        assert gone_url not in spread and len(spread) >= 3  # over the others, not onto one

        dns.ports.append(proxy.port)  # it is back; now it is killed in the middle of a request
        first_choice = {d: urls[ranking(content_key(d), urls)[0]] for d in IMAGES}
        # two items ranking each encoder first: no encoder passes the balance bound, so none spills
        two_each = [[d for d in IMAGES if first_choice[d] == url][:2] for url in urls]
        items = [{"data": d} for d in sum(two_each, [])]
        async with EncoderReceiver([local[0].url]) as single:
            want = await single.encode("reference", items)
        landed = asyncio.Event()
        proxy.arm(1, fault=landed.set, hang=True)  # hold its stream at its first byte
        request = asyncio.create_task(rx.encode("killed", items))
        await asyncio.wait_for(landed.wait(), 120)
        victim.process.kill()
        assert victim.process.wait(30) == -signal.SIGKILL
        proxy.cut()
        result = await request
        assert gone_url not in {item.encoder_url for item in result.items}
        for got, expected in zip(result.items, want.items):
            torch.testing.assert_close(got.embedding, expected.embedding, rtol=1e-4, atol=1e-4)
        assert rx.metrics.snapshot()["placements"]["re_placed"] == 2
