"""Tracing (encoder_common/tracing.py) against a real OTLP/gRPC endpoint on loopback: what turns it on,
one trace from the receiver through the encoder server's stages, the gateway's spans and the
`traceparent` it sends the engine, sampling; and nothing importing opentelemetry while it is off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from encoder_common import tracing
from receiver import EncodeFailedError, EncoderReceiver
from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.otlp_collector import OtlpCollector, children, tree_root
from testkit.servers import running_server
from tests.support.gateway import chat_request, image_part, running_gateway

ENCODE = "encoder.v1.EncoderService/Encode"
MISSING_EXTRA = r"tracing needs the tracing extra \(opentelemetry[.\w]* is missing\): pip install 'encoder-service\[tracing\]'"
OTEL_VARIABLES = (
    *tracing.ENDPOINT_VARIABLES,
    *tracing.PROTOCOL_VARIABLES,
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_SERVICE_NAME",
)


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as running:
        yield running


@pytest.fixture
def otel_env(monkeypatch):
    """No OTEL_* setting from outside; spans exported every 50 ms."""
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield monkeypatch
    tracing.shutdown()


@pytest.fixture
def traced(otel_env, collector):
    """Tracing on in this process, exporting to the collector, for one test."""
    assert tracing.configure("tests", collector.endpoint)
    yield collector


@pytest.fixture
async def server(traced, default_model_dir):
    """An encoder server started with tracing on (its interceptor is chosen as it starts)."""
    async with running_server(default_model_dir) as running:
        yield running


def test_off_unless_a_collector_is_named(otel_env):
    assert not tracing.configure("tests") and not tracing.enabled()
    assert tracing.span("x") is tracing.NO_SPAN and tracing.grpc_metadata((("a", "b"),)) == (("a", "b"),)
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    for name, value in (("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")):
        otel_env.setenv(name, value)
        assert not tracing.configure("tests") and not tracing.enabled()
        otel_env.delenv(name)
    assert tracing.configure("tests") and tracing.enabled()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "OTEL_TRACES_EXPORTER",
            "zipkin",
            "OTEL_TRACES_EXPORTER='zipkin': only 'otlp' (or 'none') is supported",
        ),
        (
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "http/json",
            "traces are exported over 'http/protobuf' or 'grpc'",
        ),
    ],
)
def test_an_exporter_other_than_otlp_over_http_or_grpc_is_refused(otel_env, variable, value, message):
    otel_env.setenv(variable, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tracing.configure("tests", "http://127.0.0.1:1")


async def test_one_trace_from_the_receiver_through_the_servers_stages(traced, server):
    images = [image_bytes(112, 84, seed=1), image_bytes(56, 112, seed=2)]
    async with EncoderReceiver([server.url]) as receiver:
        await receiver.encode("traced", [{"data": data} for data in images])
        await receiver.encode("again", [{"data": data} for data in images])  # cache hits
    spans = traced.wait_for(
        lambda spans: sum(s.attributes.get("encoder.request_id") is not None for s in spans) == 2
    )
    for request_id, computed in (("traced", True), ("again", False)):
        (root,) = [s for s in spans if s.attributes.get("encoder.request_id") == request_id]
        trace = traced.wait_for(
            lambda spans, root=root, want=11 if computed else 3: (
                sum(s.trace_id == root.trace_id for s in spans) >= want
            )
        )
        trace = traced.trace(root.trace_id)
        assert tree_root(trace) == root and root.name == "receiver.encode"
        (client,) = children(trace, root, ENCODE)
        assert client.kind == "CLIENT" and client.attributes["server.port"] == server.port
        assert client.attributes["rpc.grpc.status_code"] == 0 and client.attributes["encoder.items"] == 2
        (served,) = children(trace, client, ENCODE)  # the server joined the context the call carried
        assert served.kind == "SERVER" and served.attributes["rpc.system"] == "grpc"
        sent = [attributes for name, _, attributes in served.events if name == "encoder.sent"]
        assert sorted(a["encoder.item.index"] for a in sent) == [0, 1]
        assert all(a["encoder.cache_hit"] is not computed and a["encoder.transfer"] == "stream" for a in sent)
        assert all(a["encoder.payload_bytes"] > 0 and a["encoder.send_ms"] >= 0 for a in sent)
        stages = children(trace, served)
        if not computed:
            assert stages == []
            continue
        names = ["encoder.decode", "encoder.preprocess", "encoder.queue", "encoder.forward"]
        assert sorted(span.name for span in stages) == sorted(names * 2)
        for index in (0, 1):
            (queue,) = [
                s for s in stages if s.name == "encoder.queue" and s.attributes["encoder.item.index"] == index
            ]
            (forward,) = [
                s
                for s in stages
                if s.name == "encoder.forward" and s.attributes["encoder.item.index"] == index
            ]
            assert queue.end_ns == forward.start_ns <= forward.end_ns
            assert (
                forward.attributes["encoder.batch.size"] >= 1
                and forward.attributes["encoder.batch.tokens"] > 0
            )
        for span in stages:
            assert served.start_ns <= span.start_ns <= span.end_ns <= served.end_ns, span.name


async def test_a_refused_item_fails_the_client_span_not_the_servers(traced, server):
    """INVALID_ARGUMENT is the caller's error: the CLIENT span is ERROR, the SERVER span records the code
    and stays unset (OpenTelemetry's RPC conventions)."""
    async with EncoderReceiver([server.url]) as receiver:
        with pytest.raises(EncodeFailedError):
            await receiver.encode("refused", [{"data": b"not an image"}])
    spans = traced.wait_for(
        lambda spans: any(s.attributes.get("encoder.request_id") == "refused" for s in spans)
    )
    (root,) = [s for s in spans if s.attributes.get("encoder.request_id") == "refused"]
    traced.wait_for(lambda spans: sum(s.trace_id == root.trace_id for s in spans) >= 3)
    trace = traced.trace(root.trace_id)
    (client,) = [s for s in trace if s.kind == "CLIENT"]
    (served,) = children(trace, client, ENCODE)
    assert client.status == "ERROR" and client.attributes["rpc.grpc.status_code"] == 3
    assert served.status == "UNSET" and served.attributes["rpc.grpc.status_code"] == 3


async def test_spans_go_over_otlp_http_by_default_and_over_grpc_when_asked(
    otel_env, collector, default_model_dir
):
    for protocol, endpoint in (("http/protobuf", collector.endpoint), ("grpc", collector.grpc_endpoint)):
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        before = dict(collector.exports)
        assert tracing.configure("tests", endpoint)
        async with running_server(default_model_dir) as server, EncoderReceiver([server.url]) as receiver:
            await receiver.encode(f"over-{protocol}", [{"data": image_bytes(56, 84, seed=5)}])
        tracing.shutdown()  # exports the rest
        transport = "grpc" if protocol == "grpc" else "http"
        assert collector.exports[transport] > before[transport]
        assert {n: collector.exports[n] - before[n] for n in before if n != transport} == {
            n: 0 for n in before if n != transport
        }
        assert any(s.attributes.get("encoder.request_id") == f"over-{protocol}" for s in collector.spans)


async def test_sampling_follows_otel_traces_sampler(otel_env, collector, default_model_dir):
    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    before = len(collector.spans)
    assert tracing.configure("tests", collector.endpoint)
    async with running_server(default_model_dir) as server, EncoderReceiver([server.url]) as receiver:
        await receiver.encode("unsampled", [{"data": image_bytes(84, 84, seed=3)}])
    tracing.shutdown()  # exports whatever was recorded
    assert len(collector.spans) == before


async def test_the_gateway_joins_the_callers_trace_and_passes_it_to_the_engine(
    traced, server, default_model_dir
):
    """A chat request carrying a `traceparent`: the gateway's server span is its child, and the engine
    (here a stand-in that records its headers) gets the `traceparent` of the gateway's engine call."""
    heard: list[str] = []

    async def engine_chat(request: web.Request) -> web.Response:
        heard.append(request.headers.get("traceparent", ""))
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine_chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        async with running_gateway(engine_url, [server.url]) as gateway:
            body = chat_request(str(default_model_dir), [image_part(image_bytes(56, 56, seed=4))])
            headers = {"traceparent": f"00-{trace_id}-{caller}-01"}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as reply,
            ):
                assert reply.status == 200, await reply.text()
    finally:
        await runner.cleanup()
    trace = traced.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "POST" for s in spans))
    trace = traced.trace(trace_id)
    root = tree_root(trace, parent_id=caller)
    assert (root.name, root.kind) == ("POST /v1/chat/completions", "SERVER")
    assert root.attributes["http.response.status_code"] == 200
    steps = [span.name for span in children(trace, root)]
    assert steps == ["gateway.read_images", "receiver.encode", "gateway.handoff", "POST"], steps
    (engine_call,) = children(trace, root, "POST")
    assert (
        engine_call.kind == "CLIENT"
        and engine_call.attributes["url.full"] == f"{engine_url}/v1/chat/completions"
    )
    assert heard == [f"00-{trace_id}-{engine_call.span_id}-01"]


# The child interpreter: an encoder server, a receiver's encode and a gateway app, untraced, and the
# opentelemetry modules imported by then; then what asking for tracing gives. `block` hides opentelemetry,
# as when the extra is not installed.
CHILD = """
import asyncio, json, sys
from pathlib import Path
if {block}:
    sys.modules["opentelemetry"] = None
from encoder_common import tracing
from gateway.app import build_app
from gateway.config import GatewayConfig
from receiver import EncodeFailedError, EncoderReceiver
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server

async def main():
    async with running_server(Path("no-checkpoint"), encoder=EncoderDouble(tokens=4, hidden_size=8)) as server:
        async with EncoderReceiver([server.url]) as receiver:
            await receiver.encode("untraced", [{{"data": image_bytes(56, 56)}}])
        build_app(GatewayConfig(engine_url="http://127.0.0.1:1", encoders=(server.url,)))
    imported = sorted(name for name, module in sys.modules.items() if name.split(".")[0] == "opentelemetry" and module)
    try:
        tracing.configure("child", "http://127.0.0.1:1")
        asked = "traced"
    except ImportError as exc:
        asked = str(exc)
    print(json.dumps({{"imported": imported, "asked": asked}}))

asyncio.run(main())
"""


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "not-installed"])
def test_untraced_nothing_imports_opentelemetry(installed):
    env = {name: value for name, value in os.environ.items() if name not in OTEL_VARIABLES}
    code = CHILD.format(block=not installed)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported"] == []
    if installed:
        assert report["asked"] == "traced"
        return
    assert re.fullmatch(MISSING_EXTRA, report["asked"]), report["asked"]


def test_the_server_command_names_the_missing_extra():
    code = (
        "import sys\nsys.modules['opentelemetry'] = None\nfrom encoder_server.cli import main\n"
        "main(['--model', 'no-checkpoint', '--otlp-traces-endpoint', 'http://127.0.0.1:1'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1
    assert re.fullmatch(f"encoder-server: {MISSING_EXTRA}", done.stderr.strip().splitlines()[-1])
