"""encoder-gateway -> vLLM 0.32 for the families beyond the Qwen-VL ones that tests/test_gateway_engine*.py and
tests/engines/test_vllm_connector.py cover: a vLLM whose vision weights are zeros, fed by our encoders, answers as
vLLM alone given the same bytes (same token ids and top logprobs within a tolerance of the served dtype,
greedy), through the inline hand-off and through the connector hand-off, on images off every grid, several
in one request."""

from __future__ import annotations

import json

import aiohttp
import pytest
import torch

from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.servers import running_server
from testkit.vllm_server import ENGINES_PYTHON, launch_vllm
from tests.support.gateway import (
    chat_request,
    complete,
    image_part,
    images,
    logprob_gap,
    running_gateway,
    zeroed_tower_copy,
)

pytestmark = pytest.mark.engine

MODEL = "tiny"  # --served-model-name of both engines
# model type -> the dtype engines and encoders serve it in: families served by the transformers backend,
# beyond those tested elsewhere. vLLM 0.32 runs Qwen3.5's Gated DeltaNet layers on CPU in bfloat16 only
# ("CPU GDN attention requires BF16."), and refuses a Qwen3.5 without them ("no mamba layers in the model").
MODEL_TYPES = {"qwen3_5": torch.bfloat16}
# Largest logprob difference allowed: float32 as the other engine tests; bfloat16, where our tower and
# vLLM's round differently (measured: 4e-3 to 8e-3 on 2026-12-03), a margin over that.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# Every request's images: sizes off every grid, one, two and three images in a request.
CASES = {
    "1": images([(333, 250)], seed=41),
    "2": images([(200, 150), (97, 301)], seed=42),
    "3": images([(128, 128), (451, 120), (64, 77)], seed=44),
}


@pytest.fixture(scope="module", params=list(MODEL_TYPES))
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def dtype(model_type):
    return MODEL_TYPES[model_type]


@pytest.fixture(scope="module")
def model_dir(model_type, tmp_path_factory):
    # vocab 320: room for the 256 byte tokens beside the special tokens at 250-255.
    root = tmp_path_factory.mktemp(model_type)
    return write_engine_files(write_checkpoint(model_type, root / "model", vocab_size=320))


def engine_args(dtype: torch.dtype, *extra: str) -> list[str]:
    return ["--served-model-name", MODEL, "--dtype", str(dtype).removeprefix("torch."), *extra]


@pytest.fixture(scope="module")
async def reference(model_dir, dtype, tmp_path_factory):
    """vLLM alone on the real checkpoint, running its own tower on the raw images: its answer to every case.
    Stopped before the consumer starts (one engine at a time on this machine)."""
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    log_path = tmp_path_factory.mktemp("vllm-alone") / "vllm.log"
    with launch_vllm(model_dir, log_path=log_path, extra_args=engine_args(dtype)) as server:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            return {
                case: await complete(client, server.url, chat_request(MODEL, [image_part(p) for p in pngs]))
                for case, pngs in CASES.items()
            }


@pytest.fixture(scope="module")
async def encoders(model_dir, dtype):
    async with (
        running_server(model_dir, dtype=dtype) as first,
        running_server(model_dir, dtype=dtype) as second,
    ):
        yield first.url, second.url


@pytest.fixture(scope="module")
async def consumer(model_dir, dtype, reference, encoders, tmp_path_factory):
    """vLLM on a copy whose vision weights are zeros, as an ec_consumer with EncoderServiceConnector: it
    takes inline embeddings and fetches leased ones, and its own tower would answer wrongly."""
    zeroed = zeroed_tower_copy(model_dir, tmp_path_factory.mktemp("zeroed") / "model")
    transfer = {
        "ec_connector": "EncoderServiceConnector",
        "ec_connector_module_path": "receiver.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"encoders": list(encoders), "fetch_timeout_s": 60},
    }
    args = engine_args(dtype, "--ec-transfer-config", json.dumps(transfer))
    log_path = tmp_path_factory.mktemp("vllm-consumer") / "vllm.log"
    with launch_vllm(zeroed, log_path=log_path, extra_args=args) as server:
        yield server


@pytest.mark.parametrize("handoff", ["inline", "connector"])
@pytest.mark.parametrize("case", list(CASES))
async def test_same_tokens_as_vllm_alone(model_type, dtype, reference, encoders, consumer, handoff, case):
    async with (
        running_gateway(consumer.url, encoders, handoff=handoff) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session,
    ):
        got = await complete(session, url, chat_request(MODEL, [image_part(p) for p in CASES[case]]))
    difference = logprob_gap(got, reference[case])
    print(
        f"\n{model_type} ({dtype}), {case} images, {handoff}: {len(got)} tokens equal, largest gap {difference:.2e}"
    )
    assert difference <= TOLERANCE[dtype]


async def test_the_zeroed_tower_alone_answers_otherwise(model_type, dtype, reference, consumer):
    """The raw images straight to the consumer (no lease uuid: its own zeroed tower runs): the answers
    differ from vLLM alone's, so the equal answers above came from our encoders' embeddings."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for case, pngs in CASES.items():
            got = await complete(session, consumer.url, chat_request(MODEL, [image_part(p) for p in pngs]))
            try:
                difference = logprob_gap(got, reference[case])
            except AssertionError:  # other token ids
                continue
            assert difference > TOLERANCE[dtype], (model_type, case, difference)
