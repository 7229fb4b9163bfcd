"""Cancellation end to end, on real servers: a gateway client that disconnects, a cancelled
`EncoderReceiver.encode` and a deadline that passes all take their items out of every encoder's queue,
no forward runs for them, and `encoder_items_cancelled_total` counts them."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request

import aiohttp
import pytest
import torch

from encoder_server.models import load_vision_encoder
from receiver import EncodeFailedError, EncoderReceiver
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server, wait_until
from tests.support.gateway import chat_request, image_part, running_gateway

CLIENTS = 20


def scraped(server, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics, read over HTTP as Prometheus reads it."""
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    )
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} is not in /metrics")


@contextlib.asynccontextmanager
async def gated_servers(model_dir, count: int):
    """`count` encoder servers on the real tower, each forward held at a gate until released."""
    tower = load_vision_encoder(model_dir, "cpu", torch.float32)
    doubles = [EncoderDouble(tower) for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(running_server(model_dir, encoder=double, metrics_port=0))
            for double in doubles
        ]
        for double in doubles:
            double.reset()  # the warm-up forward
            double.hold()
        try:
            yield servers, doubles
        finally:
            for double in doubles:
                double.release()


async def block_forward(server, double) -> asyncio.Task:
    """A request whose forward holds the server's one forward thread at the gate: later items queue."""
    rx = EncoderReceiver([server.url])
    task = asyncio.create_task(rx.encode("blocker", [{"data": image_bytes(64, 64, seed=99)}]))
    task.add_done_callback(lambda _: asyncio.ensure_future(rx.close()))
    assert await asyncio.to_thread(double.in_forward.wait, 30), "the blocker never reached the forward"
    return task


async def test_twenty_gateway_clients_that_disconnect_mid_encode_cost_no_forward(default_model_dir):
    async with gated_servers(default_model_dir, 1) as ([server], [double]):
        blocker = await block_forward(server, double)
        async with running_gateway("http://127.0.0.1:1", [server.url]) as url:
            sessions = [aiohttp.ClientSession() for _ in range(CLIENTS)]
            posts = [
                asyncio.create_task(
                    session.post(
                        f"{url}/v1/chat/completions",
                        json=chat_request("m", [image_part(image_bytes(56, 56, seed=i))]),
                    )
                )
                for i, session in enumerate(sessions)
            ]
            assert await wait_until(lambda: server._batcher.queue_depth == CLIENTS), (
                server._batcher.queue_depth
            )
            for post, session in zip(posts, sessions):  # every client goes away while its image waits
                post.cancel()
                await session.close()
            assert await wait_until(lambda: server._batcher.queue_depth == 0, 30), "the items stayed queued"
            double.release()
            await blocker
        assert double.items_forwarded == 1  # the blocker's: none of the clients' items was encoded
        assert scraped(server, "encoder_items_cancelled_total", '{stage="queue"}') == CLIENTS
        cancelled = {"outcome": "cancelled", "code": "CANCELLED"}
        assert server.metrics.registry.get_sample_value("encoder_requests_total", cancelled) == CLIENTS


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
async def test_a_cancelled_encode_or_a_passed_deadline_empties_every_encoders_queue(default_model_dir, how):
    async with gated_servers(default_model_dir, 2) as (servers, doubles):
        blockers = [await block_forward(server, double) for server, double in zip(servers, doubles)]
        items = [{"data": image_bytes(56 + 14 * i, 56, seed=i)} for i in range(6)]
        async with EncoderReceiver([s.url for s in servers], timeout=120.0) as rx:
            timeout = 3.0 if how == "deadline" else None
            request = asyncio.create_task(rx.encode(how, items, timeout=timeout))
            queued = lambda: [s._batcher.queue_depth for s in servers]
            assert await wait_until(lambda: sum(queued()) == len(items)), queued()
            assert min(queued()) > 0  # spread over both encoders
            if how == "cancelled":
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
            else:
                with pytest.raises(EncodeFailedError, match="DEADLINE_EXCEEDED"):
                    await request
            assert await wait_until(lambda: sum(queued()) == 0, 30), queued()
            for double in doubles:
                double.release()
            await asyncio.gather(*blockers)
        assert [double.items_forwarded for double in doubles] == [1, 1]
        dropped = [scraped(s, "encoder_items_cancelled_total", '{stage="queue"}') for s in servers]
        assert sum(dropped) == len(items) and min(dropped) > 0
