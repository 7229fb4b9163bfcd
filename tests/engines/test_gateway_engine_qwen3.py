"""encoder-gateway -> vLLM for Qwen3-VL: the deepstack features the encoders return reach the engine inside
`image_embeds` (appended along the hidden dimension, as vLLM's Qwen3-VL reads them), and the tokens equal
vLLM's own tower's."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.app import start
from gateway.config import GatewayConfig
from receiver import EncoderReceiver
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.servers import running_server
from tests.support.gateway import chat_request, complete, engine_server, image_part, images, logprob_gap

pytestmark = pytest.mark.engine

# Multiples of Qwen3-VL's 32-pixel merged patch: no resize, so the encoder's PIL preprocessing and vLLM's
# torchvision preprocessing see the same pixels.
SIZES = [(128, 128), (320, 192)]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    # vocab 320: room for the 256 byte tokens beside the special tokens at 250-255.
    return write_engine_files(
        write_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3-vl"), vocab_size=320)
    )


@pytest.fixture(scope="module")
def vllm(qwen3_model, tmp_path_factory):
    with engine_server(qwen3_model, tmp_path_factory.mktemp("vllm-qwen3")) as server:
        yield server


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_qwen3_vl_deepstack_reaches_vllm(qwen3_model, vllm, stream):
    pngs = images(SIZES, seed=30)
    async with running_server(qwen3_model) as encoder:
        async with EncoderReceiver([encoder.url]) as receiver:
            item = (await receiver.encode("probe", [{"data": pngs[0]}])).items[0]
        assert (
            item.deepstack is not None and item.deepstack.shape[0] == 2
        )  # the checkpoint's two deepstack layers
        runner, port = await start(
            GatewayConfig(engine_url=vllm.url, encoders=(encoder.url,), host="127.0.0.1", port=0)
        )
        try:
            body = chat_request(str(qwen3_model), [image_part(png) for png in pngs], stream=stream)
            async with aiohttp.ClientSession() as session:
                direct = await complete(session, vllm.url, body)
                through_gateway = await complete(session, f"http://127.0.0.1:{port}", body)
        finally:
            await runner.cleanup()
    difference = logprob_gap(through_gateway, direct)
    print(
        f"\nQwen3-VL, 2 images, stream={stream}: {len(direct)} tokens equal, largest logprob difference {difference:.2e}"
    )
    assert difference <= 1e-4
