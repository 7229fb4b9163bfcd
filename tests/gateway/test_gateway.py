"""encoder-gateway's refusals, each answered before or instead of the engine: bad image, unsupported
modality, no encoder, overloaded encoders, engine down, image URLs into the cluster; and its CLI."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import subprocess
import sys

import aiohttp
import pytest
import torch
from aiohttp import web

from encoder_common.sources import SourcePolicy
from encoder_server.batcher import BatchingConfig
from encoder_server.models import load_vision_encoder
from gateway.app import start
from gateway.cli import build_parser, config_from_args
from gateway.protocol import image_parts, replace_parts
from receiver import EncoderReceiver, ReceiverConfig
from testkit import REPO_ROOT
from testkit.checkpoints import write_checkpoint
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.launcher import launch_server
from testkit.servers import running_server
from testkit.vllm_server import free_port
from tests.encoder_server.test_security import TOKEN, pki, token_file  # noqa: F401  (fixtures)
from tests.support.gateway import chat_request, data_url, image_part, running_gateway

# A gateway on 127.0.0.1 whose engine URL is, unless given, a port nothing listens on.
gateway = functools.partial(running_gateway, None)


async def post(url: str, body) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
            return reply.status, dict(reply.headers), await reply.json()


@pytest.fixture(scope="module")
async def encoder(default_model_dir):
    async with running_server(default_model_dir) as server:
        yield server.url


def test_image_parts_found_and_replaced_in_place():
    body = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:,x"}, "uuid": "client-id"},
                {"type": "input_image", "image_url": "data:,y"},
                {"type": "image_embeds", "image_embeds": {"image_embeds": "..."}},
            ]},
        ]
    }  # fmt: skip
    parts = image_parts(body)
    assert [(p.message_index, p.part_index, p.url) for p in parts] == [(1, 1, "data:,x"), (1, 2, "data:,y")]
    new = replace_parts(body, {part: {"type": "image_embeds", "n": i} for i, part in enumerate(parts)})
    assert new["messages"][1]["content"][1:3] == [
        {"type": "image_embeds", "n": 0, "uuid": "client-id"},
        {"type": "image_embeds", "n": 1},
    ]
    assert body["messages"][1]["content"][1]["type"] == "image_url"  # the client's request is left as it was
    assert new["messages"][1]["content"][3] is body["messages"][1]["content"][3]


async def test_bad_image_is_400_naming_message_and_part(encoder):
    body = chat_request(
        "m",
        [
            image_part(image_bytes(64, 64)),
            {"type": "image_url", "image_url": {"url": data_url(b"not an image")}},
        ],
    )
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, body)
    assert status == 400
    message = reply["error"]["message"]
    assert message.startswith("message 0 part 1: invalid image:"), message
    assert "not an image file" in message


async def test_unreadable_data_uri_is_400_naming_the_part(encoder):
    body = chat_request("m", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, body)
    assert status == 400 and reply["error"]["message"].startswith(
        "message 0 part 0: data: URI has invalid base64"
    )


async def test_non_image_part_is_400_with_the_image_only_rule(encoder):
    parts = [image_part(image_bytes(64, 64)), {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}},
             {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]  # fmt: skip
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, chat_request("m", parts))
    assert status == 400
    assert reply["error"]["message"] == "gRPC encode only supports IMAGE modality, got: ['video', 'audio']"


async def test_pass_non_image_forwards_them_to_the_engine(encoder):
    """With the flag the request gets past the modality rule and on to the engine (here: down, so 502)."""
    parts = [{"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}}]
    async with gateway([encoder], pass_non_image=True) as url:
        status, _, reply = await post(url, chat_request("m", parts))
    assert status == 502 and "engine" in reply["error"]["message"]


async def test_no_encoder_reachable_is_503():
    async with gateway([f"grpc://127.0.0.1:{free_port()}"], receiver=ReceiverConfig(timeout=20)) as url:
        status, headers, reply = await post(url, chat_request("m", [image_part(image_bytes(64, 64))]))
    assert status == 503, reply
    assert "no encoder is reachable" in reply["error"]["message"]
    assert "Retry-After" not in headers


async def test_all_encoders_overloaded_is_503_with_retry_after(default_model_dir):
    gated = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    async with running_server(
        default_model_dir, encoder=gated, batching=BatchingConfig(max_queue_items=1)
    ) as server:
        gated.hold()
        async with EncoderReceiver([server.url]) as direct:
            blocker = asyncio.create_task(direct.encode("blocker", [{"data": image_bytes(56, 56, seed=1)}]))
            assert await asyncio.to_thread(gated.in_forward.wait, 30), "the blocker never reached the forward"
            queued = asyncio.create_task(direct.encode("queued", [{"data": image_bytes(56, 56, seed=2)}]))
            for _ in range(200):
                if server._batcher.queue_depth == 1:
                    break
                await asyncio.sleep(0.05)
            try:
                async with gateway([server.url], retry_after_s=7) as url:
                    status, headers, reply = await post(
                        url, chat_request("m", [image_part(image_bytes(56, 56, seed=3))])
                    )
            finally:
                gated.release()
            await asyncio.gather(blocker, queued)
    assert status == 503, reply
    assert headers["Retry-After"] == "7"
    assert "overloaded" in reply["error"]["message"]


async def test_client_disconnect_during_encode_cancels_the_encode_call(default_model_dir):
    gated = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    async with running_server(default_model_dir, encoder=gated) as server, gateway([server.url]) as url:
        gated.hold()
        try:
            client = aiohttp.ClientSession()
            body = chat_request("m", [image_part(image_bytes(56, 56, seed=5))])
            sent = asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body))
            assert await asyncio.to_thread(gated.in_forward.wait, 30), "the encode never reached the forward"
            sent.cancel()
            await client.close()  # the client goes away while its image is being encoded
            cancelled = {"outcome": "cancelled", "code": "CANCELLED"}
            for _ in range(200):
                if server.metrics.registry.get_sample_value("encoder_requests_total", cancelled):
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the encoder's Encode call was not cancelled after the client disconnected")
        finally:
            gated.release()


async def test_engine_down_is_502(encoder):
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, chat_request("m", [image_part(image_bytes(64, 64))]))
    assert status == 502
    assert "is unreachable" in reply["error"]["message"]


async def test_an_idle_engine_connection_is_not_reused_after_the_keepalive(encoder):
    """vLLM closes a connection idle for 5 s, and a request written on it as it closes fails with
    ServerDisconnectedError. The gateway drops idle engine connections sooner (--engine-keepalive): after a
    pause longer than that, the request goes out on a new connection; back to back, requests share one."""
    peer_ports = []

    async def completions(request):
        peer_ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"choices": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    body = chat_request("m", [image_part(image_bytes(64, 64))])
    try:
        async with running_gateway(engine_url, [encoder], engine_keepalive_s=0.3) as url:
            for pause in (0, 0.6, 0):
                await asyncio.sleep(pause)
                status, _, _ = await post(url, body)
                assert status == 200
    finally:
        await runner.cleanup()
    first, after_the_pause, back_to_back = peer_ports
    assert after_the_pause != first, "a connection idle past --engine-keepalive was reused"
    assert back_to_back == after_the_pause, "back-to-back engine calls did not share a pooled connection"


async def test_a_defect_before_the_engine_call_is_a_json_500_naming_it(encoder, monkeypatch, caplog):
    """An exception the gateway does not expect is answered as an OpenAI-style error body (not aiohttp's
    plain-text page), naming the exception, and its traceback is logged; the next request is served."""
    from gateway.serving import ChatCompletionsService

    async def broken(self, body):
        raise RuntimeError("a defect")

    body = chat_request("m", [image_part(image_bytes(64, 64))])
    async with gateway([encoder]) as url:
        with monkeypatch.context() as patch:
            patch.setattr(ChatCompletionsService, "prepare", broken)
            status, _, reply = await post(url, body)
        assert status == 500
        assert reply["error"]["message"] == "internal error in the gateway: RuntimeError: a defect", reply
        assert any(r.exc_info and "before the engine call" in r.getMessage() for r in caplog.records)
        status, _, reply = await post(url, body)  # prepare works again: as far as the engine, which is down
        assert status == 502, reply


@contextlib.asynccontextmanager
async def image_site(png: bytes):
    """An HTTP server on 127.0.0.1 serving /image.png and /redirect (to it)."""

    async def serve_image(request):
        return web.Response(body=png, content_type="image/png")

    async def redirect(request):
        raise web.HTTPFound("/image.png")

    app = web.Application()
    app.router.add_get("/image.png", serve_image)
    app.router.add_get("/redirect", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_url_pointing_at_loopback_is_refused(encoder):
    async with image_site(image_bytes(64, 64)) as site, gateway([encoder]) as url:
        body = chat_request("m", [{"type": "image_url", "image_url": {"url": f"{site}/image.png"}}])
        status, _, reply = await post(url, body)
    assert status == 400
    message = reply["error"]["message"]
    assert message.startswith("message 0 part 0: fetching") and "loopback" in message, message


async def test_allowed_internal_url_reaches_the_engine(encoder):
    """--http-urls any: the loopback image is fetched and encoded; the request gets as far as the engine."""
    async with image_site(image_bytes(64, 64)) as site:
        async with gateway([encoder], sources=SourcePolicy(http_urls="any")) as url:
            body = chat_request("m", [{"type": "image_url", "image_url": {"url": f"{site}/image.png"}}])
            status, _, reply = await post(url, body)
    assert status == 502 and "engine" in reply["error"]["message"], reply


async def test_file_urls_only_under_roots(encoder, tmp_path):
    (tmp_path / "inside").mkdir()
    inside = tmp_path / "inside" / "a.png"
    inside.write_bytes(image_bytes(64, 64))
    outside = tmp_path / "b.png"
    outside.write_bytes(image_bytes(64, 64))
    async with gateway([encoder], sources=SourcePolicy(file_roots=(tmp_path / "inside",))) as url:
        status, _, reply = await post(
            url, chat_request("m", [{"type": "image_url", "image_url": {"url": outside.as_uri()}}])
        )
        assert status == 400 and "outside the allowed directories" in reply["error"]["message"]
        status, _, reply = await post(
            url, chat_request("m", [{"type": "image_url", "image_url": {"url": inside.as_uri()}}])
        )
        assert status == 502, reply  # read and encoded; the engine is down
    async with gateway([encoder]) as url:
        status, _, reply = await post(
            url, chat_request("m", [{"type": "image_url", "image_url": {"url": inside.as_uri()}}])
        )
        assert status == 400 and "file:// URLs are disabled" in reply["error"]["message"]


async def test_start_up_refuses_a_family_vllm_cannot_take_embeddings_of(tmp_path):
    model_dir = write_checkpoint("gemma3", tmp_path / "gemma3")
    async with running_server(model_dir) as server:
        with pytest.raises(ValueError, match="family 'gemma3', whose image_embeds vLLM refuses.*--handoff connector"):
            async with gateway([server.url]):
                pass


def test_config_from_the_environment(monkeypatch, tmp_path):
    (tmp_path / "token").write_text("secret\n")
    monkeypatch.setenv("ENCODER_GATEWAY_ENGINE_URL", "http://engine:8000")
    monkeypatch.setenv("ENCODER_GATEWAY_ENCODERS", "grpc://a:1, grpc://b:2")
    monkeypatch.setenv("ENCODER_GATEWAY_HTTP_URLS", "any")
    monkeypatch.setenv("ENCODER_GATEWAY_AUTH_TOKEN_FILE", str(tmp_path / "token"))
    config = config_from_args(build_parser().parse_args([]))
    assert config.engine_url == "http://engine:8000"
    assert config.encoders == ("grpc://a:1", "grpc://b:2")
    assert config.sources.http_urls == "any" and config.receiver.auth_token == "secret"


async def test_mtls_and_token_flags_reach_the_encoders(default_model_dir, pki, token_file, tmp_path):
    """An encoder serving mTLS with a bearer token: the gateway's TLS and token flags get the image encoded
    (the request then reaches the engine, down here: 502); without the token the encoder refuses it."""
    flags = ["--dtype", "float32", "--tls-cert-file", str(pki.server.cert_file), "--tls-key-file",
             str(pki.server.key_file), "--tls-client-ca-file", str(pki.ca.cert_file), "--auth-token-file", str(token_file)]  # fmt: skip
    (tmp_path / "token").write_text(TOKEN + "\n")
    with launch_server(default_model_dir, *flags, log_dir=tmp_path) as encoder:
        common = ["--engine-url", f"http://127.0.0.1:{free_port()}", "--encoders", f"grpcs://127.0.0.1:{encoder.port}",
                  "--tls-ca-file", str(pki.ca.cert_file), "--tls-cert-file", str(pki.client.cert_file),
                  "--tls-key-file", str(pki.client.key_file), "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
        body = chat_request("m", [image_part(image_bytes(56, 56))])
        for extra, expected in (
            (["--auth-token-file", str(tmp_path / "token")], "the engine at"),
            ([], "UNAUTHENTICATED"),
        ):
            runner, port = await start(config_from_args(build_parser().parse_args([*common, *extra])))
            try:
                status, _, reply = await post(f"http://127.0.0.1:{port}", body)
            finally:
                await runner.cleanup()
            assert status == 502 and expected in reply["error"]["message"], reply


async def test_command_serves_health_and_stops_on_sigterm():
    """`python -m gateway` (the encoder-gateway command): ready line, /health naming what is down, clean stop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", "0",
        "--engine-url", f"http://127.0.0.1:{free_port()}", "--encoders", f"grpc://127.0.0.1:{free_port()}",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        match = re.match(r"encoder-gateway ready on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{match.group(1)}/health") as reply:
                state = await reply.json()
                assert reply.status == 503
        assert state["engine"]["status"] == "unreachable"
        assert list(state["encoders"].values()) == ["NOT_SERVING"]
        process.terminate()
        assert await asyncio.wait_for(process.wait(), 60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_receiver_and_the_in_process_helper_do_not_pull_in_the_http_stack():
    check = (
        "import sys, receiver, gateway.handoff; "
        "assert 'aiohttp' not in sys.modules, 'aiohttp imported'; "
        "assert 'gateway.app' not in sys.modules, 'gateway.app imported'"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
