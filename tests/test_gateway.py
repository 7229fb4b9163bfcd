"""encoder-gateway's refusals, each answered before or instead of the engine: bad image, unsupported
modality, no encoder, overloaded encoders, engine down, image URLs into the cluster; and its CLI."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import torch
from aiohttp import web

from encoder_common.errors import InvalidItemError
from encoder_common.http_fetch import fetch_http
from encoder_server.batcher import BatchingConfig
from encoder_server.models import load_vision_encoder
from gateway.app import start
from gateway.cli import build_parser, config_from_args
from gateway.config import GatewayConfig
from gateway.sources import SourcePolicy
from receiver import EncoderReceiver
from testkit.gated_encoder import GatedEncoder
from testkit.support import image_bytes, running_server
from testkit.vllm_server import free_port
from tests.gateway_support import chat_request, data_url, image_part


@contextlib.asynccontextmanager
async def gateway(encoders: list[str], engine_url: str | None = None, **options):
    """A gateway on 127.0.0.1; by default its engine URL is a port nothing listens on."""
    engine_url = engine_url or f"http://127.0.0.1:{free_port()}"
    config = GatewayConfig(engine_url=engine_url, encoders=tuple(encoders), host="127.0.0.1", port=0, **options)
    runner, port = await start(config)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, body) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
            return reply.status, dict(reply.headers), await reply.json()


@pytest.fixture(scope="module")
async def encoder(default_model_dir):
    async with running_server(default_model_dir) as server:
        yield server.url


async def test_bad_image_is_400_naming_message_and_part(encoder):
    body = chat_request("m", [image_part(image_bytes(64, 64)), {"type": "image_url", "image_url": {"url": data_url(b"not an image")}}])
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
    assert status == 400 and reply["error"]["message"].startswith("message 0 part 0: data: URI has invalid base64")


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
    async with gateway([f"grpc://127.0.0.1:{free_port()}"], encode_timeout_s=20) as url:
        status, headers, reply = await post(url, chat_request("m", [image_part(image_bytes(64, 64))]))
    assert status == 503, reply
    assert "no encoder is reachable" in reply["error"]["message"]
    assert "Retry-After" not in headers


async def test_all_encoders_overloaded_is_503_with_retry_after(default_model_dir):
    gated = GatedEncoder(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    async with running_server(default_model_dir, encoder=gated, batching=BatchingConfig(max_queue_items=1)) as server:
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
                    status, headers, reply = await post(url, chat_request("m", [image_part(image_bytes(56, 56, seed=3))]))
            finally:
                gated.release()
            await asyncio.gather(blocker, queued)
    assert status == 503, reply
    assert headers["Retry-After"] == "7"
    assert "overloaded" in reply["error"]["message"]


async def test_engine_down_is_502(encoder):
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, chat_request("m", [image_part(image_bytes(64, 64))]))
    assert status == 502
    assert "is unreachable" in reply["error"]["message"]


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
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_url_pointing_at_loopback_is_refused(encoder):
    async with image_site(image_bytes(64, 64)) as site, gateway([encoder]) as url:
        body = chat_request("m", [{"type": "image_url", "image_url": {"url": f"{site}/image.png"}}])
        status, _, reply = await post(url, body)
    assert status == 400
    message = reply["error"]["message"]
    assert message.startswith("message 0 part 0: fetching") and "loopback" in message, message


async def test_fetch_refuses_redirects_and_allows_internal_only_when_told():
    png = image_bytes(32, 32)
    async with image_site(png) as site:
        with pytest.raises(InvalidItemError, match="loopback"):
            await asyncio.to_thread(fetch_http, f"{site}/image.png", max_bytes=1 << 20, timeout_s=5, allow_internal=False)
        assert await asyncio.to_thread(fetch_http, f"{site}/image.png", max_bytes=1 << 20, timeout_s=5) == png
        with pytest.raises(InvalidItemError, match="redirect"):
            await asyncio.to_thread(fetch_http, f"{site}/redirect", max_bytes=1 << 20, timeout_s=5, follow_redirects=False)
        with pytest.raises(InvalidItemError, match="over the limit"):
            await asyncio.to_thread(fetch_http, f"{site}/image.png", max_bytes=100, timeout_s=5)


async def test_allowed_internal_url_reaches_the_engine(encoder):
    """--allow-internal-urls: the loopback image is fetched and encoded; the request gets as far as the engine."""
    async with image_site(image_bytes(64, 64)) as site:
        async with gateway([encoder], sources=SourcePolicy(allow_internal_urls=True)) as url:
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
        status, _, reply = await post(url, chat_request("m", [{"type": "image_url", "image_url": {"url": outside.as_uri()}}]))
        assert status == 400 and "outside the allowed directories" in reply["error"]["message"]
        status, _, reply = await post(url, chat_request("m", [{"type": "image_url", "image_url": {"url": inside.as_uri()}}]))
        assert status == 502, reply  # read and encoded; the engine is down
    async with gateway([encoder]) as url:
        status, _, reply = await post(url, chat_request("m", [{"type": "image_url", "image_url": {"url": inside.as_uri()}}]))
        assert status == 400 and "file:// URLs are disabled" in reply["error"]["message"]


def test_every_flag_reads_an_environment_variable(monkeypatch):
    monkeypatch.setenv("ENCODER_GATEWAY_ENGINE_URL", "http://engine:8000")
    monkeypatch.setenv("ENCODER_GATEWAY_ENCODERS", "grpc://a:1, grpc://b:2")
    monkeypatch.setenv("ENCODER_GATEWAY_ALLOW_INTERNAL_URLS", "true")
    monkeypatch.setenv("ENCODER_GATEWAY_AUTH_TOKEN", "secret")
    config = config_from_args(build_parser().parse_args([]))
    assert config.engine_url == "http://engine:8000"
    assert config.encoders == ("grpc://a:1", "grpc://b:2")
    assert config.sources.allow_internal_urls and config.auth_token == "secret"
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "[env ENCODER_GATEWAY_" in action.help, action.option_strings
