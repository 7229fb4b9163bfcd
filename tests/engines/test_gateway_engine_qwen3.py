"""encoder-gateway -> vLLM for Qwen3-VL, both hand-offs: a vLLM whose vision weights are zeros, fed by our
encoders, answers as vLLM alone given the same bytes (same token ids, top logprobs within 1e-4, float32,
greedy), on images off the grid, several in one request. Inline, the deepstack levels travel inside
`image_embeds` (appended along hidden); through the connector hand-off, `EncoderServiceConnector` fetches
the embedding with its levels and places them in vLLM's encoder cache as vLLM's own tower would."""

from __future__ import annotations

import pytest

from receiver import EncoderReceiver
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.launcher import side_by_side
from testkit.servers import running_server
from testkit.vllm_server import connector_transfer_config
from tests.support.gateway import (
    chat_request,
    complete,
    engine_server,
    engine_session,
    image_part,
    images,
    logprob_gap,
    running_gateway,
    zeroed_tower_copy,
)

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4  # float32 engine and encoders
MODEL = "tiny"  # --served-model-name of both engines
SERVED = ["--served-model-name", MODEL]
# Every request's images, off Qwen3-VL's 32 px merged patch: one, and three in one request.
CASES = {
    "1": images([(333, 250)], seed=30),
    "3": images([(200, 150), (97, 301), (128, 77)], seed=31),
}


def request(case: str, stream: bool = False) -> dict:
    return chat_request(MODEL, [image_part(png) for png in CASES[case]], stream=stream)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    # vocab 320: room for the 256 byte tokens beside the special tokens at 250-255.
    return write_engine_files(
        write_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3-vl") / "model", vocab_size=320)
    )


@pytest.fixture(scope="module")
async def encoder(qwen3_model):
    async with running_server(qwen3_model) as server:  # float32, the default (vllm) profile
        yield server


@pytest.fixture(scope="module")
def engines(qwen3_model, encoder, tmp_path_factory):
    """vLLM alone on the real checkpoint, and vLLM on a copy whose vision weights (deepstack mergers
    included) are zeros, as an ec_consumer with EncoderServiceConnector (it takes inline embeddings and
    fetches leased ones), started side by side."""
    zeroed = zeroed_tower_copy(qwen3_model, tmp_path_factory.mktemp("zeroed") / "model")
    args = [*SERVED, "--ec-transfer-config", connector_transfer_config([encoder.url], timeout=60)]
    with side_by_side(
        engine_server(qwen3_model, tmp_path_factory.mktemp("vllm-alone"), extra_args=SERVED),
        engine_server(zeroed, tmp_path_factory.mktemp("vllm-consumer"), extra_args=args),
    ) as servers:
        yield servers


@pytest.fixture(scope="module")
async def reference(engines):
    """vLLM alone, running its own tower on the raw images: its answer to every case."""
    async with engine_session() as session:
        return {case: await complete(session, engines[0].url, request(case)) for case in CASES}


@pytest.fixture(scope="module")
def consumer(engines):
    return engines[1]


async def test_the_encoders_send_deepstack_levels(encoder):
    async with EncoderReceiver([encoder.url]) as receiver:
        item = (await receiver.encode("probe", [{"data": CASES["1"][0]}])).items[0]
    assert (
        item.deepstack is not None and item.deepstack.shape[0] == 2
    )  # the checkpoint's two deepstack layers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("handoff", ["inline", "connector"])
@pytest.mark.parametrize("case", list(CASES))
async def test_same_tokens_as_vllm_alone(reference, encoder, consumer, handoff, case, stream):
    fetches = encoder.leases.fetches
    async with (
        running_gateway(consumer.url, [encoder.url], handoff=handoff) as url,
        engine_session() as session,
    ):
        got = await complete(session, url, request(case, stream))
    difference = logprob_gap(got, reference[case])
    print(
        f"\nQwen3-VL, {case} images, {handoff}, stream={stream}: {len(got)} tokens equal, largest gap {difference:.2e}"
    )
    assert difference <= TOLERANCE
    fetched = encoder.leases.fetches - fetches
    assert fetched == (len(CASES[case]) if handoff == "connector" else 0)  # each leased item fetched once


async def test_the_zeroed_tower_alone_answers_otherwise(reference, consumer):
    """The raw images straight to the consumer (no lease uuid: its own zeroed tower runs): the answers
    differ from vLLM alone's, so the equal answers above came from our encoders' embeddings."""
    async with engine_session() as session:
        for case in CASES:
            got = await complete(session, consumer.url, request(case))
            try:
                difference = logprob_gap(got, reference[case])
            except AssertionError:  # other token ids
                continue
            assert difference > TOLERANCE, (case, difference)
