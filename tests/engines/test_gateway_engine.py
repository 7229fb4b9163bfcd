"""encoder-gateway in front of a real vLLM server: the same greedy tokens and logprobs as vLLM given the raw
images and running its own vision tower; streaming, client-precomputed items, engine errors, disconnects; one
trace across the gateway, the receiver, two encoder processes and vLLM, with an encoder killed mid-request."""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp
import pytest

from encoder_common import tracing
from encoder_common.vllm_inputs import GridEmbeds
from receiver import EncoderReceiver
from testkit.fault_proxy import fault_proxy
from testkit.launcher import launch_server
from testkit.otlp_collector import OtlpCollector, children, tree_root
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
def collector():
    """The OTLP endpoint vLLM, the traced encoders and the traced gateway export to."""
    with OtlpCollector() as running:
        yield running


@pytest.fixture(scope="module")
def vllm(default_model_dir, tmp_path_factory, collector):
    # vLLM exports over OTLP/gRPC (its default), the encoders and the gateway over OTLP/HTTP (ours).
    otlp = ("--otlp-traces-endpoint", collector.grpc_endpoint)  # vLLM's spans join the gateway's traceparent
    with engine_server(default_model_dir, tmp_path_factory.mktemp("vllm"), extra_args=otlp) as server:
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


# --- one trace across the gateway, the receiver, two encoder processes and vLLM ---------------------

# 448x448 -> 256 tokens x 2048 x fp32 = 2 MiB per item: two chunks, so a fault can land mid-item.
TRACED_SIZES = [(448, 448)] * 4
ITEM_BYTES = 256 * 2048 * 4
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
ENCODE = "encoder.v1.EncoderService/Encode"
STAGES = {"encoder.decode", "encoder.preprocess", "encoder.queue", "encoder.forward"}


def traced_encoder(model_dir, collector, log_dir, name: str):
    """An encoder-server process exporting its spans to `collector` as service `name`."""
    flags = ("--dtype", "float32", "--otlp-traces-endpoint", collector.endpoint)
    env = {"OTEL_SERVICE_NAME": name, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    return launch_server(model_dir, *flags, log_dir=log_dir, env=env)


@pytest.fixture(scope="module")
def traced_encoders(default_model_dir, collector, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("traced-encoders")
    with (
        traced_encoder(default_model_dir, collector, log_dir, "encoder-a") as first,
        traced_encoder(default_model_dir, collector, log_dir, "encoder-b") as second,
    ):
        yield [first, second]


@pytest.fixture
def traced_gateway_process(collector, monkeypatch):
    """Tracing on in this process (the gateway and its receiver) for one test, exporting every 100 ms."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    assert tracing.configure("encoder-gateway", collector.endpoint)
    yield
    tracing.shutdown()


def traced_request(model_dir, seed: int) -> tuple[dict, dict]:
    parts = [image_part(png) for png in images(TRACED_SIZES, seed=seed)]
    return chat_request(str(model_dir), parts), {"traceparent": f"00-{TRACE_ID[:-2]}{seed:02x}-{CALLER}-01"}


def finished_trace(collector, trace_id: str) -> list:
    """The trace once vLLM's span (the last to end) and both encoders' server spans are in."""

    def whole(spans) -> bool:
        trace = [span for span in spans if span.trace_id == trace_id]
        served = {span.service for span in trace if span.name == ENCODE and span.kind == "SERVER"}
        return any(span.name == "llm_request" for span in trace) and len(served) >= 2

    collector.wait_for(whole, timeout=60)
    return collector.trace(trace_id)


def check_encoder_calls(trace: list, receiver_span, urls: list[str]) -> dict[str, list]:
    """Each successful Encode call of the receiver answered by a server span with an `encoder.sent` event
    per item and every stage under it for each item it computed; returns the client spans by encoder URL."""
    calls: dict[str, list] = {}
    for call in children(trace, receiver_span, ENCODE):
        calls.setdefault(call.attributes["encoder.url"], []).append(call)
        if call.status == "ERROR":
            continue
        (served,) = children(trace, call, ENCODE)
        assert served.kind == "SERVER" and served.service.startswith("encoder-")
        sent = [attributes for name, _, attributes in served.events if name == "encoder.sent"]
        assert len(sent) == call.attributes["encoder.items"]
        computed = {item["encoder.item.index"] for item in sent if not item["encoder.cache_hit"]}
        stages = children(trace, served)
        assert {s.attributes["encoder.item.index"] for s in stages if s.name == "encoder.forward"} == computed
        assert {span.name for span in stages} == (STAGES if computed else set())
    assert set(calls) <= set(urls)
    return calls


async def test_one_trace_across_gateway_receiver_encoders_and_vllm(
    traced_gateway_process, traced_encoders, vllm, default_model_dir, collector, session
):
    urls = [encoder.url for encoder in traced_encoders]
    body, headers = traced_request(default_model_dir, seed=1)
    async with (
        running_gateway(vllm.url, urls) as gateway,
        session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
    trace_id = headers["traceparent"].split("-")[1]
    trace = finished_trace(collector, trace_id)
    root = tree_root(trace, parent_id=CALLER)  # one trace id, parent links forming one tree under the caller
    assert (root.service, root.name, root.kind) == ("encoder-gateway", "POST /v1/chat/completions", "SERVER")
    steps = [span.name for span in children(trace, root)]
    assert steps == ["gateway.read_images", "receiver.encode", "gateway.handoff", "POST"], steps
    (receiver_span,) = children(trace, root, "receiver.encode")
    calls = check_encoder_calls(trace, receiver_span, urls)
    assert sorted(calls) == sorted(urls)  # the images were encoded on both encoders
    assert {s.service for s in trace} == {"encoder-gateway", "encoder-a", "encoder-b", vllm_service(trace)}
    (engine_call,) = children(trace, root, "POST")
    (engine_span,) = children(trace, engine_call)  # vLLM joined the traceparent of the engine call
    assert (
        engine_span.name == "llm_request" and engine_span.attributes["gen_ai.usage.prompt_tokens"] > 4 * 256
    )
    print(f"\none trace: {len(trace)} spans from {sorted({s.service for s in trace})}")


def vllm_service(trace: list) -> str:
    (span,) = [span for span in trace if span.name == "llm_request"]
    return span.service


async def test_an_encoder_killed_mid_request_shows_as_a_retry_on_the_other(
    traced_gateway_process, traced_encoders, vllm, default_model_dir, collector, session, tmp_path
):
    survivor = traced_encoders[1]
    with traced_encoder(default_model_dir, collector, tmp_path, "encoder-victim") as victim:
        async with fault_proxy(victim.port) as proxy:
            urls = [proxy.url, survivor.url]
            body, headers = traced_request(default_model_dir, seed=20)  # images no encoder has cached
            async with running_gateway(vllm.url, urls) as gateway:
                held = asyncio.Event()
                # The victim's stream is held after one and a half items: then it is killed.
                proxy.arm(ITEM_BYTES + ITEM_BYTES // 2, fault=held.set, hang=True)
                request = asyncio.create_task(
                    session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers)
                )
                await asyncio.wait_for(held.wait(), 120)
                await asyncio.sleep(2.0)  # the receiver reads what was relayed before the kill
                victim.process.kill()
                assert victim.process.wait(10) == -signal.SIGKILL
                proxy.cut()
                async with await request as reply:
                    assert reply.status == 200, await reply.text()
    trace_id = headers["traceparent"].split("-")[1]
    trace = finished_trace(collector, trace_id)
    root = tree_root(trace, parent_id=CALLER)
    (receiver_span,) = children(trace, root, "receiver.encode")
    calls = check_encoder_calls(trace, receiver_span, urls)
    (failed,) = calls[proxy.url]
    assert failed.status == "ERROR" and failed.attributes["rpc.grpc.status_code"] == 14  # UNAVAILABLE
    (failover,) = [event for event in receiver_span.events if event[0] == "receiver.failover"]
    _, at_ns, what = failover
    assert what["encoder.url"] == proxy.url and what["encoder.status"] == "UNAVAILABLE"
    retries = [call for call in calls[survivor.url] if call.start_ns >= at_ns]
    assert retries and all(call.status != "ERROR" for call in retries)
    assert sum(call.attributes["encoder.items"] for call in retries) == what["encoder.items"] >= 1
    assert any(span.name == "llm_request" for span in trace)
