"""EncoderServiceConnector in a real vLLM (ec_consumer, CPU): embeddings fetched from the encoders by lease
key give vLLM-alone's tokens and logprobs, the consumer's own vision tower never runs for them (its
weights are zeroed), a lost embedding fails only its request while the engine keeps serving, and the
fetches are spans of the request's trace when vLLM traces."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from encoder_common.vllm_inputs import GridEmbeds
from encoder_server.leases import LeaseConfig
from gateway.app import start
from gateway.config import GatewayConfig
from gateway.handoff import leased_part
from receiver import EncoderReceiver
from testkit.launcher import launch_server, side_by_side
from testkit.otlp_collector import OtlpCollector, children
from testkit.servers import running_server
from testkit.vllm_server import ENGINES_PYTHON, connector_transfer_config, launch_vllm
from tests.support.gateway import (
    answers,
    chat_request,
    complete,
    engine_session,
    image_part,
    images,
    logprob_gap,
    zeroed_tower_copy,
)

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4  # float32 engine and encoders
MODEL = "tiny"  # --served-model-name of both engines
LEASE_MS = 120_000

# Every request's images, by case; the engine alone answers each once, from the raw images. Sides are
# multiples of 28 (one merged token); tests/engines/test_gateway_engine_images.py covers other sizes and file kinds.
CASES = {
    "1": images([(224, 168)], seed=1),
    "2": images([(112, 112), (308, 196)], seed=2),
    "5": images([(56, 56), (140, 112), (224, 224), (84, 168), (196, 140)], seed=5),
    "mixed": images([(112, 140), (196, 196), (56, 112)], seed=7),
    "killed": images([(168, 112)], seed=11),
    "after-kill": images([(112, 168)], seed=12),
    "evicted": images([(140, 140)], seed=13),
    "evictor": images([(140, 140)], seed=14),
    "traced": images([(112, 140), (168, 168)], seed=18),  # leased by the trace test alone
    "expired": images([(112, 84)], seed=15),
    "after-expiry": images([(140, 84)], seed=16),
    "after-unknown": images([(84, 140)], seed=17),
}


@pytest.fixture(scope="module")
def zeroed_tower_model(default_model_dir, tmp_path_factory):
    """The same checkpoint with every vision-tower weight zeroed: a tower that ran would answer wrongly."""
    return zeroed_tower_copy(default_model_dir, tmp_path_factory.mktemp("zeroed-tower") / "model")


@pytest.fixture
async def session():
    async with engine_session() as session:
        yield session


def served(extra: list[str]) -> list[str]:
    return ["--served-model-name", MODEL, *extra]


@pytest.fixture(scope="module")
async def encoders(default_model_dir):
    """Two encoders with the default lease budget, and one whose budget holds one 140x140 item (25 tokens
    x 2048 float32, 200 KiB) but not two."""
    async with (
        running_server(default_model_dir) as first,
        running_server(default_model_dir) as second,
        running_server(default_model_dir, leases=LeaseConfig(max_bytes=300_000)) as small,
    ):
        yield first, second, small


@pytest.fixture(scope="module")
def killable_encoder(default_model_dir, tmp_path_factory):
    """An encoder in a process of its own, for the test that kills it between encode and fetch."""
    with launch_server(
        default_model_dir, "--dtype", "float32", log_dir=tmp_path_factory.mktemp("killable")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def collector():
    """The OTLP endpoint the consumer exports its traces to."""
    with OtlpCollector() as running:
        yield running


@pytest.fixture(scope="module")
def engines(encoders, killable_encoder, zeroed_tower_model, default_model_dir, tmp_path_factory, collector):
    """vLLM alone on the real checkpoint, and vLLM as ec_consumer with EncoderServiceConnector on the
    zeroed-tower checkpoint, tracing; started side by side."""
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    urls = [server.url for server in encoders] + [killable_encoder.url]
    logs = tmp_path_factory.mktemp("vllm")
    transfer = ["--ec-transfer-config", connector_transfer_config(urls, timeout=60)]
    with side_by_side(
        launch_vllm(default_model_dir, log_path=logs / "alone.log", extra_args=served([])),
        launch_vllm(
            zeroed_tower_model,
            log_path=logs / "consumer.log",
            extra_args=served([*transfer, "--otlp-traces-endpoint", collector.grpc_endpoint]),
            extra_env={"OTEL_SERVICE_NAME": "vllm-consumer", "OTEL_BSP_SCHEDULE_DELAY": "100"},
        ),
    ) as servers:
        yield servers


@pytest.fixture(scope="module")
async def reference(engines):
    """vLLM alone, running its own tower on the raw images: its answer to every case."""
    return await answers(engines[0].url, MODEL, CASES)


@pytest.fixture(scope="module")
def consumer(engines):
    return engines[1]


@pytest.fixture(scope="module")
async def gateway(consumer, encoders):
    config = GatewayConfig(
        engine_url=consumer.url,
        encoders=(encoders[0].url, encoders[1].url),
        host="127.0.0.1",
        port=0,
        handoff="connector",
    )
    runner, port = await start(config)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def leased_parts(urls: list[str], pngs: list[bytes], lease_ms: int = LEASE_MS) -> list[dict]:
    """Encodes as the gateway does in connector mode; the parts only name each leased item."""
    async with EncoderReceiver(urls) as receiver:
        result = await receiver.encode(
            "client", [{"data": png} for png in pngs], lease_ms=lease_ms, withhold_payloads=True
        )
    return [leased_part(item) for item in result.items]


async def post(session: aiohttp.ClientSession, url: str, parts: list[dict]) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/chat/completions", json=chat_request(MODEL, parts)) as reply:
        return reply.status, await reply.json()


async def assert_engine_serves(session, consumer, encoders, reference, case: str) -> None:
    """The engine is up and answers a fresh request exactly as vLLM alone does."""
    async with session.get(f"{consumer.url}/health") as reply:
        assert reply.status == 200
    parts = await leased_parts([encoders[0].url], CASES[case])
    got = await complete(session, consumer.url, chat_request(MODEL, parts))
    assert logprob_gap(got, reference[case]) <= TOLERANCE


@pytest.mark.parametrize("count", ["1", "2", "5"])
async def test_through_the_gateway_same_tokens_as_vllm_alone(gateway, reference, encoders, session, count):
    before = [server.leases.fetches for server in encoders[:2]]
    got = await complete(session, gateway, chat_request(MODEL, [image_part(p) for p in CASES[count]]))
    difference = logprob_gap(got, reference[count])
    print(f"\n{count} images through the connector: {len(got)} tokens equal, largest logprob difference {difference:.2e}")
    assert difference <= TOLERANCE
    fetched = [server.leases.fetches - b for server, b in zip(encoders[:2], before)]
    assert sum(fetched) == int(count)  # every item came from an encoder's lease
    if count == "5":
        assert all(fetched), f"the items did not spread over both encoders: {fetched}"
    assert all(len(server.leases) == 0 for server in encoders[:2])  # each lease released by its fetch


async def test_client_precomputed_item_beside_raw_images(gateway, reference, encoders, session):
    """A client's own image_embeds part (tensor inline) beside raw images: vLLM 0.32 refuses tensor and
    metadata-only parts in one request, so the gateway hands this request inline, and answers correctly."""
    first, second, third = CASES["mixed"]
    async with EncoderReceiver([encoders[0].url]) as receiver:
        precomputed = await receiver.encode("client-side", [{"data": second}])
    grants = [server.leases.grants for server in encoders[:2]]
    parts = [image_part(first), GridEmbeds().inline_part(precomputed.items[0]), image_part(third)]
    got = await complete(session, gateway, chat_request(MODEL, parts))
    difference = logprob_gap(got, reference["mixed"])
    print(f"\nprecomputed + raw (inline for this request): largest logprob difference {difference:.2e}")
    assert difference <= TOLERANCE
    assert [server.leases.grants for server in encoders[:2]] == grants  # nothing leased for it


async def test_the_consumers_own_tower_is_wrong_so_it_never_ran_for_leased_items(
    consumer, reference, session
):
    """Given raw images, the consumer runs its zeroed tower and answers differently from vLLM alone: the
    equal answers above came from the encoders' embeddings."""
    got = await complete(session, consumer.url, chat_request(MODEL, [image_part(p) for p in CASES["2"]]))
    want = reference["2"]
    differs = [s[0] for s in got] != [s[0] for s in want] or max(
        abs(a[1] - b[1]) for a, b in zip(got, want)
    ) > 1e-2
    assert differs, "a zeroed vision tower answered like the real one: the check proves nothing"


async def test_encoder_killed_between_encode_and_fetch_fails_that_request_only(
    consumer, encoders, killable_encoder, reference, session
):
    parts = await leased_parts([killable_encoder.url], CASES["killed"])
    os.kill(killable_encoder.process.pid, signal.SIGKILL)
    killable_encoder.process.wait()
    status, body = await post(session, consumer.url, parts)
    print(f"\nencoder killed: {status} {body}")
    assert status >= 400 and "error" in body
    await assert_engine_serves(session, consumer, encoders, reference, "after-kill")


async def test_entry_evicted_before_fetch_fails_that_request_only(consumer, encoders, reference, session):
    small = encoders[2]
    evicted = await leased_parts([small.url], CASES["evicted"])
    evictor = await leased_parts([small.url], CASES["evictor"])  # the budget holds one: the first goes
    assert small.leases.evictions >= 1
    status, body = await post(session, consumer.url, evicted)
    print(f"\nentry evicted: {status} {body}")
    assert status >= 400 and "error" in body
    got = await complete(session, consumer.url, chat_request(MODEL, evictor))
    assert logprob_gap(got, reference["evictor"]) <= TOLERANCE


async def test_fetch_past_the_lease_deadline_fails_that_request_only(consumer, encoders, reference, session):
    parts = await leased_parts([encoders[0].url], CASES["expired"], lease_ms=200)
    await asyncio.sleep(1.0)  # five times the lease
    status, body = await post(session, consumer.url, parts)
    print(f"\nlease expired: {status} {body}")
    assert status >= 400 and "error" in body
    await assert_engine_serves(session, consumer, encoders, reference, "after-expiry")


async def test_an_unknown_uuid_without_its_embedding_fails_that_request_only(
    consumer, encoders, reference, session
):
    parts = [{"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]}, "uuid": "not-a-lease"}]
    status, body = await post(session, consumer.url, parts)
    assert status >= 400 and "error" in body
    await assert_engine_serves(session, consumer, encoders, reference, "after-unknown")


async def test_the_connectors_fetches_join_the_requests_trace(consumer, encoders, collector, session):
    """A request carrying a `traceparent`: each leased item's fetch in vLLM's engine core is a span of that
    trace, with the receiver's Fetch call under it."""
    trace_id, caller = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    parts = await leased_parts([encoders[0].url], CASES["traced"])
    body = chat_request(MODEL, parts)
    headers = {"traceparent": f"00-{trace_id}-{caller}-01"}
    async with session.post(f"{consumer.url}/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status == 200, await reply.text()

    def fetched(spans) -> bool:  # both items' fetches, and vLLM's span of the request, which ends last
        names = [s.name for s in spans if s.trace_id == trace_id]
        return names.count("connector.fetch") == 2 and "llm_request" in names

    await asyncio.to_thread(collector.wait_for, fetched, 60)
    trace = collector.trace(trace_id)
    fetches = [span for span in trace if span.name == "connector.fetch"]
    assert all(span.parent_id == caller and span.service == "vllm-consumer" for span in fetches)
    for fetch in fetches:
        (receiver_fetch,) = children(trace, fetch, "receiver.fetch")
        (call,) = children(trace, receiver_fetch, "encoder.v1.EncoderService/Fetch")
        assert call.kind == "CLIENT" and call.attributes["rpc.grpc.status_code"] == 0
        assert call.attributes["encoder.url"] == encoders[0].url
