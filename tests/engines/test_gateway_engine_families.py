"""encoder-gateway -> vLLM 0.32 for the families beyond the Qwen-VL ones that tests/test_gateway_engine*.py and
tests/engines/test_vllm_connector.py cover: a vLLM whose vision weights are zeros, fed by our encoders, answers as
vLLM alone given the same bytes (same token ids and top logprobs within a tolerance of the served dtype,
greedy), through the connector hand-off and, where encoder-gateway takes the family inline (its start-up
check, from encoder_common/families.py), the inline one, on images users send, several in one request. The
start-up refusal of the other families is tests/gateway/test_handoff_families.py's and test_gateway.py's."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from encoder_common.families import BY_MODEL_TYPE
from gateway.handoff import check_family
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.image_set import image_set
from testkit.launcher import side_by_side
from testkit.servers import running_server
from testkit.vllm_server import (
    ENGINES_PYTHON,
    connector_transfer_config,
    launch_vllm,
    launch_vllm_encoder,
)
from tests.support.gateway import (
    answers,
    chat_request,
    complete,
    engine_session,
    image_part,
    logprob_gap,
    running_gateway,
    zeroed_tower_copy,
)

pytestmark = pytest.mark.engine

MODEL = "tiny"  # --served-model-name of both engines


@dataclass(frozen=True)
class Served:
    """How a model type is served here: the dtype of the engines and the encoders, and the encoders' tower
    backend ("transformers": `encoder-server` with default flags; "vllm": `encoder-server --backend vllm`
    from the engines' venv)."""

    dtype: torch.dtype
    backend: str = "transformers"
    # Why vLLM takes inline only images of one token count in a request of this family (None: any mix); the
    # test then sends one image a request inline.
    inline_one_image: str | None = None


# model type -> how it is served. vLLM 0.32 runs Qwen3.5's Gated DeltaNet layers on CPU in bfloat16 only
# ("CPU GDN attention requires BF16."), and refuses a Qwen3.5 without them ("no mamba layers in the model").
# GLM-4.xV and MiniCPM-V have no transformers tower here: vLLM's own code encodes them (--backend vllm);
# MiniCPM-V 4.6's language model is Qwen3.5's, hence bfloat16.
MODEL_TYPES = {
    "qwen3_5": Served(torch.bfloat16),
    "internvl": Served(torch.float32),
    "llava_next": Served(torch.float32),
    "llava_onevision": Served(torch.float32),
    "gemma3": Served(torch.float32),
    "mistral3": Served(torch.float32, "vllm"),
    "idefics3": Served(torch.float32, "vllm"),
    "glm4v": Served(torch.float32, "vllm"),
    "minicpmv4_6": Served(
        torch.bfloat16,
        "vllm",
        inline_one_image="vLLM 0.32 merges MiniCPM-V 4.6's image_embeds parts of different lengths into one "
        "tensor beside one image_sizes row per image ('Cannot merge different batch sizes')",
    ),
}
# Largest logprob difference allowed: float32 as the other engine tests; bfloat16, where our tower and
# vLLM's round differently (measured: 4e-3 to 8e-3 on 2026-12-03), a margin over that.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# Every request's images, as users send them: off every grid, transparent (RGBA, palette with a transparent
# index), EXIF-rotated (alone too: the size vLLM sizes placeholders from is the turned one), tiny, long and
# thin; one and three images in a request, of one size and of several (which give several token counts).
CASES = {
    name: [image_set()[image] for image in names]
    for name, names in {
        "off-grid": ["size-333x250"],
        "exif": ["jpeg-exif-rotated"],
        "alpha-exif": ["png-rgba", "jpeg-exif-rotated", "png-palette-trns"],
        "sizes": ["size-28x28", "size-2000x57-wide", "size-31x1500-thin"],
    }.items()
}


def handoffs(model_type: str) -> list[str]:
    """The hand-offs encoder-gateway takes the family through: the connector always, inline where its start-up
    check (from encoder_common/families.py) lets the family through."""
    taken = ["connector"]
    with contextlib.suppress(ValueError):
        check_family(BY_MODEL_TYPE[model_type].name, "inline")
        taken.insert(0, "inline")
    return taken


@pytest.fixture(scope="module", params=list(MODEL_TYPES))
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def dtype(model_type):
    return MODEL_TYPES[model_type].dtype


@pytest.fixture(scope="module")
def model_dir(model_type, tmp_path_factory):
    # vocab 320: room for the 256 byte tokens beside the special tokens at 250-255.
    root = tmp_path_factory.mktemp(model_type)
    return write_engine_files(write_checkpoint(model_type, root / "model", vocab_size=320))


def engine_args(dtype: torch.dtype, *extra: str) -> list[str]:
    return ["--served-model-name", MODEL, "--dtype", str(dtype).removeprefix("torch."), *extra]


@pytest.fixture(scope="module")
async def encoders(model_type, model_dir, dtype, tmp_path_factory):
    """Two encoder servers on the checkpoint, of the backend the table names."""
    if MODEL_TYPES[model_type].backend == "transformers":
        async with (
            running_server(model_dir, dtype=dtype) as first,
            running_server(model_dir, dtype=dtype) as second,
        ):
            yield first.url, second.url
        return
    log_dir = tmp_path_factory.mktemp("vllm-encoders")
    name = str(dtype).removeprefix("torch.")
    with side_by_side(*(launch_vllm_encoder(model_dir, log_dir / f"encoder-{n}.log", dtype=name) for n in range(2))) as servers:
        yield tuple(server.url for server in servers)


@pytest.fixture(scope="module")
def engines(model_dir, dtype, encoders, tmp_path_factory):
    """vLLM alone on the real checkpoint (its own tower runs on the raw images), and vLLM on a copy whose
    vision weights are zeros, as an ec_consumer with EncoderServiceConnector: it takes inline embeddings and
    fetches leased ones, and its own tower would answer wrongly. Started side by side."""
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    zeroed = zeroed_tower_copy(model_dir, tmp_path_factory.mktemp("zeroed") / "model")
    consumer_args = engine_args(dtype, "--ec-transfer-config", connector_transfer_config(encoders, timeout=60))
    logs = tmp_path_factory.mktemp("vllm")
    with side_by_side(
        launch_vllm(model_dir, log_path=logs / "alone.log", extra_args=engine_args(dtype)),
        launch_vllm(zeroed, log_path=logs / "consumer.log", extra_args=consumer_args),
    ) as (alone, consumer):
        yield alone, consumer


@pytest.fixture(scope="module")
async def reference(engines):
    """vLLM alone's answer to every case."""
    return await answers(engines[0].url, MODEL, CASES)


@pytest.fixture(scope="module")
def consumer(engines):
    return engines[1]


@pytest.mark.parametrize("handoff", ["inline", "connector"])
@pytest.mark.parametrize("case", list(CASES))
async def test_same_tokens_as_vllm_alone(model_type, dtype, reference, encoders, consumer, handoff, case):
    if handoff not in handoffs(model_type):
        pytest.skip(
            f"encoder-gateway refuses {model_type} inline at start-up (tests/gateway/test_handoff_families.py)"
        )
    if handoff == "inline" and len(CASES[case]) > 1 and MODEL_TYPES[model_type].inline_one_image:
        pytest.skip(MODEL_TYPES[model_type].inline_one_image)
    async with (
        running_gateway(consumer.url, encoders, handoff=handoff) as url,
        engine_session() as session,
    ):
        got = await complete(session, url, chat_request(MODEL, [image_part(p) for p in CASES[case]]))
    difference = logprob_gap(got, reference[case])
    print(
        f"\n{model_type} ({dtype}), {case}, {handoff}: {len(got)} tokens equal, largest gap {difference:.2e}"
    )
    assert difference <= TOLERANCE[dtype]


async def test_the_zeroed_tower_alone_answers_otherwise(model_type, dtype, reference, consumer):
    """The raw images straight to the consumer (no lease uuid: its own zeroed tower runs): the answers
    differ from vLLM alone's, so the equal answers above came from our encoders' embeddings."""
    async with engine_session() as session:
        for case, pngs in CASES.items():
            got = await complete(session, consumer.url, chat_request(MODEL, [image_part(p) for p in pngs]))
            try:
                difference = logprob_gap(got, reference[case])
            except AssertionError:  # other token ids
                print(f"\n{model_type}, {case}, zeroed tower: other token ids")
                continue
            print(f"\n{model_type}, {case}, zeroed tower: largest gap {difference:.2e}")
            assert difference > TOLERANCE[dtype], (model_type, case, difference)
