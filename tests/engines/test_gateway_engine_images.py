"""The images users really send (testkit/image_set.py: sizes off the 28 px grid, every common file kind)
through encoder-gateway to a vLLM whose own vision tower cannot see (its weights zeroed), inline and through
the connector hand-off: the same greedy tokens and top logprobs as vLLM alone given the same bytes; what
vLLM alone refuses, the gateway refuses with a 400 naming the part."""

from __future__ import annotations

import aiohttp
import pytest

from testkit.image_set import image_set, refused_images
from testkit.launcher import side_by_side
from testkit.servers import running_server
from testkit.vllm_server import connector_transfer_config
from tests.support.gateway import (
    chat_request,
    complete,
    engine_server,
    engine_session,
    image_part,
    logprob_gap,
    running_gateway,
    zeroed_tower_copy,
)

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4  # float32 engine and encoders
MODEL = "tiny"  # --served-model-name of both engines
SERVED = ["--served-model-name", MODEL]
IMAGES = image_set()
REFUSED = refused_images()


def request(data: bytes) -> dict:
    return chat_request(MODEL, [image_part(data)])


@pytest.fixture(scope="module")
async def encoder(default_model_dir):
    async with running_server(default_model_dir) as server:  # float32, the default (vllm) profile
        yield server


@pytest.fixture(scope="module")
def engines(encoder, default_model_dir, tmp_path_factory):
    """vLLM alone on the real checkpoint, and vLLM on the zeroed-tower copy as ec_consumer of the encoder (for
    the connector hand-off; it takes inline image_embeds parts too), started side by side."""
    model_dir = zeroed_tower_copy(default_model_dir, tmp_path_factory.mktemp("zeroed-tower") / "model")
    consumer = [*SERVED, "--ec-transfer-config", connector_transfer_config([encoder.url], timeout=60)]
    with side_by_side(
        engine_server(default_model_dir, tmp_path_factory.mktemp("vllm-alone"), extra_args=SERVED),
        engine_server(model_dir, tmp_path_factory.mktemp("vllm-blind"), extra_args=consumer),
    ) as servers:
        yield servers


@pytest.fixture(scope="module")
async def reference(engines):
    """vLLM alone, given each image's bytes: its answer, or its refusal."""
    url = engines[0].url
    answers, refusals = {}, {}
    async with engine_session() as session:
        for name, data in IMAGES.items():
            answers[name] = await complete(session, url, request(data))
        for name, (data, _) in REFUSED.items():
            try:
                async with session.post(f"{url}/v1/chat/completions", json=request(data)) as reply:
                    refusals[name] = f"{reply.status}: {await reply.text()}"
            except aiohttp.ClientError as exc:  # a decompression bomb is a 500 from vLLM 0.32; seen dropped
                refusals[name] = f"connection lost: {exc}"
    return answers, refusals


@pytest.fixture(scope="module")
def blind_vllm(engines):
    return engines[1]


@pytest.fixture(scope="module", params=["inline", "connector"])
async def gateway(request, blind_vllm, encoder):
    async with running_gateway(blind_vllm.url, [encoder.url], handoff=request.param) as url:
        yield url


@pytest.fixture
async def session():
    async with engine_session() as session:
        yield session


@pytest.mark.parametrize("name", list(IMAGES))
async def test_same_tokens_as_vllm_alone_on_the_same_bytes(gateway, reference, session, name):
    answers, _ = reference
    got = await complete(session, gateway, request(IMAGES[name]))
    difference = logprob_gap(got, answers[name])
    print(f"\n{name}: {len(got)} tokens equal, largest logprob difference {difference:.2e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("name", list(REFUSED))
async def test_what_vllm_refuses_is_a_400_naming_the_part(gateway, reference, session, name):
    _, refusals = reference
    assert not refusals[name].startswith("200"), f"vLLM alone accepted {name}"
    print(f"\n{name}: vLLM alone answered {refusals[name][:200]}")
    data, phrase = REFUSED[name]
    async with session.post(f"{gateway}/v1/chat/completions", json=request(data)) as reply:
        status, body = reply.status, await reply.json()
    message = body["error"]["message"]
    assert status == 400, body
    assert message.startswith("message 0 part 0: invalid image:") and phrase in message, message
