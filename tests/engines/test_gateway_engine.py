"""encoder-gateway in front of a real vLLM server: the same greedy tokens and logprobs as vLLM given the raw
images and running its own vision tower; streaming, client-precomputed items, engine errors, disconnects."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from encoder_common.vllm_inputs import GridEmbeds
from receiver import EncoderReceiver
from testkit.servers import running_server
from tests.support.gateway import (
    chat_request,
    complete,
    engine_server,
    engine_session,
    image_part,
    images,
    logprob_gap,
    running_gateway,
)

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4  # float32 engine and encoders; the towers differ only in kernels


@pytest.fixture(scope="module")
def vllm(default_model_dir, tmp_path_factory):
    with engine_server(default_model_dir, tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="module")
async def encoders(default_model_dir):
    """Two encoder servers on the same checkpoint, float32."""
    async with running_server(default_model_dir) as first, running_server(default_model_dir) as second:
        yield [first.url, second.url]


@pytest.fixture(scope="module")
async def gateway(vllm, encoders):
    async with running_gateway(vllm.url, encoders) as url:
        yield url


@pytest.fixture
async def session():
    async with engine_session() as session:
        yield session


SIZES = {
    1: [(224, 168)],
    2: [(112, 112), (308, 196)],
    5: [(56, 56), (140, 112), (224, 224), (84, 168), (196, 140)],
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("count", [1, 2, 5])
async def test_same_tokens_as_vllm_alone(gateway, vllm, default_model_dir, session, count, stream):
    parts = [image_part(png) for png in images(SIZES[count], seed=count)]
    body = chat_request(str(default_model_dir), parts, stream=stream)
    direct = await complete(session, vllm.url, body)
    through_gateway = await complete(session, gateway, body)
    assert len(direct) > 0
    difference = logprob_gap(through_gateway, direct)
    print(
        f"\n{count} images, stream={stream}: {len(direct)} tokens equal, largest logprob difference {difference:.2e}"
    )
    assert difference <= TOLERANCE


async def test_images_spread_over_both_encoders(gateway, vllm, default_model_dir, session, encoders):
    parts = [image_part(png) for png in images(SIZES[5], seed=50)]
    await complete(session, gateway, chat_request(str(default_model_dir), parts))
    async with session.get(f"{gateway}/metrics") as reply:
        text = await reply.text()
    for url in encoders:
        match = re.search(rf'encoder_receiver_items_total{{encoder="{re.escape(url)}"}} (\S+)', text)
        assert match and float(match.group(1)) > 0, f"no items went to {url}"
    assert re.search(r"encoder_gateway_images_total (\S+)", text)


async def test_client_precomputed_item_beside_raw_images(gateway, vllm, default_model_dir, session, encoders):
    """An image_embeds part the client made passes through beside raw images: vLLM sees only embeddings."""
    first, second, third = images([(112, 140), (196, 196), (56, 112)], seed=70)
    async with EncoderReceiver(encoders[:1]) as receiver:
        result = await receiver.encode("client-side", [{"modality": "image", "data": second}])
    mixed = [image_part(first), GridEmbeds().inline_part(result.items[0]), image_part(third)]
    raw = [image_part(first), image_part(second), image_part(third)]
    for stream in (False, True):
        direct = await complete(session, vllm.url, chat_request(str(default_model_dir), raw, stream=stream))
        through_gateway = await complete(
            session, gateway, chat_request(str(default_model_dir), mixed, stream=stream)
        )
        difference = logprob_gap(through_gateway, direct)
        print(f"\nprecomputed + raw, stream={stream}: largest logprob difference {difference:.2e}")
        assert difference <= TOLERANCE


async def test_models_and_health(gateway, vllm, session, encoders):
    async with session.get(f"{gateway}/v1/models") as via, session.get(f"{vllm.url}/v1/models") as direct:
        assert via.status == direct.status == 200
        assert [m["id"] for m in (await via.json())["data"]] == [
            m["id"] for m in (await direct.json())["data"]
        ]
    async with session.get(f"{gateway}/health") as reply:
        state = await reply.json()
        assert reply.status == 200, state
    assert state["engine"]["status"] == "ok"
    assert state["encoders"] == {url: "SERVING" for url in encoders}


async def test_engine_error_passed_through(gateway, vllm, default_model_dir, session):
    """vLLM's own refusal (a request longer than the model's context) reaches the client as vLLM sent it."""
    body = chat_request(str(default_model_dir), [image_part(images([(112, 112)])[0])], max_tokens=100_000)
    async with session.post(f"{gateway}/v1/chat/completions", json=body) as reply:
        assert reply.status == 400
        error = (await reply.json())["error"]
    assert "max_tokens" in error["message"] or "maximum context length" in error["message"], error


async def _running_requests_become(
    session: aiohttp.ClientSession, vllm_url: str, count: int, within_s: float
) -> bool:
    """Polls vLLM's `num_requests_running` gauge until it reads `count`. The gauge follows the
    scheduler's stats as the engine reports them, so it can lag the first streamed event."""
    for _ in range(int(within_s / 0.25)):
        async with session.get(f"{vllm_url}/metrics") as reply:
            text = await reply.text()
        running = sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))
        if running == count:
            return True
        await asyncio.sleep(0.25)
    return False


async def test_client_disconnect_mid_stream_aborts_the_engine_request(
    gateway, vllm, default_model_dir, session
):
    body = chat_request(
        str(default_model_dir), [image_part(images([(112, 112)])[0])], stream=True, max_tokens=3000
    )
    body["ignore_eos"] = True  # long enough that only an abort ends it within the test
    client = aiohttp.ClientSession()
    reply = await client.post(f"{gateway}/v1/chat/completions", json=body)
    assert reply.status == 200
    await reply.content.readline()  # the first event: the engine is generating
    assert await _running_requests_become(session, vllm.url, 1, within_s=30), "vLLM never counted the request"
    await client.close()  # the client goes away mid-stream
    if not await _running_requests_become(session, vllm.url, 0, within_s=60):
        pytest.fail("vLLM still runs the request 60 s after the client disconnected from the gateway")
    async with session.get(f"{gateway}/metrics") as reply:
        assert re.search(
            r'encoder_gateway_requests_total{outcome="cancelled",status="499"} 1\.0', await reply.text()
        )
