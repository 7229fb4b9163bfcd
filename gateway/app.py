"""The HTTP binding of `encoder-gateway` (aiohttp): routes, the engine's replies streamed back as they
arrive, errors as OpenAI-style JSON, `/health` and `/metrics`. A client that goes away cancels its handler,
and with it the encode calls and the engine request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from encoder_common import tracing
from encoder_common.sources import SourceReader
from encoder_common.vllm_releases import SUPPORTED_VLLM, in_supported_range
from receiver import EncoderError, EncoderReceiver

from .config import GatewayConfig
from .handoff import Handoff, check_family, handoff_for
from .metrics import GatewayMetrics
from .serving import ChatCompletionsService, GatewayError, engine_unreachable

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", ChatCompletionsService)
CONFIG = web.AppKey("config", GatewayConfig)
_PROBE_TIMEOUT_S = 2.0
_TRACED_ROUTES = ("/v1/chat/completions", "/v1/models")
# Hop-by-hop and framing headers are the gateway's own to set.
_NOT_FORWARDED = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "date",
    "server",
}


def _error_response(error: GatewayError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def _forwarded_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}


async def _forward(
    request: web.Request, service: ChatCompletionsService, path: str, body: Any, method: str
) -> web.StreamResponse:
    """Sends `body` to the engine and relays its answer: status and body as they are, chunks as they arrive.
    The engine call is a CLIENT span whose context goes with it (vLLM joins its `traceparent`)."""
    url = f"{service.engine_url}{path}"
    attributes = {"http.request.method": method, "url.full": url}
    with tracing.span(method, kind=tracing.CLIENT, attributes=attributes) as span:
        try:
            upstream = await service.engine_request(path, body, method)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise engine_unreachable(service.engine_url, exc) from None
        span.set_attribute("http.response.status_code", upstream.status)
        try:
            response = web.StreamResponse(status=upstream.status, headers=_forwarded_headers(upstream))
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        except BaseException:
            upstream.close()  # also on cancellation: closing the connection makes the engine abort the request
            raise
        upstream.release()  # read to the end: the connection goes back to the pool
    return response


@web.middleware
async def _traced(request: web.Request, handler) -> web.StreamResponse:
    """A SERVER span per request to the engine's routes, joined to the caller's `traceparent`; installed
    only while tracing is on."""
    if request.path not in _TRACED_ROUTES:
        return await handler(request)
    attributes = {
        "http.request.method": request.method,
        "http.route": request.path,
        "url.path": request.path,
        "url.scheme": request.scheme,
        "server.address": request.host,
        "client.address": request.remote or "",
    }
    parent = tracing.context_from(request.headers)
    name = f"{request.method} {request.path}"
    with tracing.span(name, kind=tracing.SERVER, parent=parent, attributes=attributes) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            tracing.failed(span, f"HTTP {response.status}")
        return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    metrics = service.metrics
    metrics.in_flight.inc()
    outcome, status = "error", 500
    try:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise GatewayError(400, "the request body is not valid JSON") from None
        try:
            engine_body = await service.prepare(body)
        except (GatewayError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a defect: answered as OpenAI clients read errors, and logged whole
            log.exception("chat request failed before the engine call")
            raise GatewayError(500, f"internal error in the gateway: {type(exc).__name__}: {exc}") from exc
        started = time.perf_counter()
        response = await _forward(request, service, "/v1/chat/completions", engine_body, "POST")
        metrics.engine_seconds.observe(time.perf_counter() - started)
        outcome, status = ("ok" if response.status < 400 else "engine_error"), response.status
        return response
    except GatewayError as error:
        outcome, status = ("error" if error.status == 500 else "refused"), error.status
        return _error_response(error)
    except asyncio.CancelledError:
        outcome, status = "cancelled", 499  # the client closed the connection
        raise
    finally:
        metrics.in_flight.dec()
        metrics.finished(outcome, status)


async def models(request: web.Request) -> web.StreamResponse:
    try:
        return await _forward(request, request.app[SERVICE], "/v1/models", None, "GET")
    except GatewayError as error:
        return _error_response(error)


async def health(request: web.Request) -> web.Response:
    """The gateway's state with the engine's and each encoder's: 200 when both can serve, else 503."""
    service = request.app[SERVICE]
    engine_state = "unreachable"
    try:
        async with service.session.get(
            f"{service.engine_url}/health", timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
        ) as reply:
            engine_state = "ok" if reply.status == 200 else f"HTTP {reply.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    endpoints = service.receiver.endpoints
    serving = await asyncio.gather(*(e.is_serving(_PROBE_TIMEOUT_S) for e in endpoints))
    encoders = {e.url: "SERVING" if ok else "NOT_SERVING" for e, ok in zip(endpoints, serving)}
    ready = engine_state == "ok" and any(serving)
    state = {
        "status": "ok" if ready else "unavailable",
        "gateway": "serving",
        "engine": {"url": service.engine_url, "status": engine_state},
        "encoders": encoders,
    }
    return web.json_response(state, status=200 if ready else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _check_encoders(receiver: EncoderReceiver, handoff: str) -> None:
    """Refuses to start when the encoders serve a family the hand-off cannot give vLLM; an encoder that
    does not answer yet is not fatal (pods start in any order)."""
    try:
        info = await receiver.served_model()
    except EncoderError as exc:
        log.warning("encoders not checked at start-up: %s", exc)
        return
    check_family(info.family, handoff)
    log.info(
        "encoders serve %s (hidden %d, %d deepstack layers)",
        info.family,
        info.hidden_size,
        info.num_deepstack_layers,
    )


async def _check_engine_release(session: aiohttp.ClientSession, engine_url: str) -> None:
    """Refuses (ValueError) a vLLM whose `/version` is outside `SUPPORTED_VLLM`, the releases whose
    `image_embeds` part these formats were read in; an engine that does not answer it yet, or is not vLLM
    (no `/version`), is not fatal: engines and gateways start in any order."""
    try:
        async with session.get(f"{engine_url}/version", timeout=aiohttp.ClientTimeout(total=5)) as reply:
            version = (await reply.json(content_type=None)).get("version") if reply.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
        log.warning("engine release not checked at start-up (%s): %s", engine_url, exc)
        return
    if version is None:
        log.warning("engine release not checked at start-up: %s/version gave no vLLM version", engine_url)
    elif not in_supported_range(str(version)):
        raise ValueError(
            f"the engine at {engine_url} is vLLM {version}, outside the releases this gateway's image_embeds "
            f"part and hand-offs are written for ({SUPPORTED_VLLM}); run a vLLM in that range"
        )
    else:
        log.info("engine: vLLM %s (supported: %s)", version, SUPPORTED_VLLM)


def build_app(config: GatewayConfig, *, handoff: Handoff | None = None) -> web.Application:
    """The gateway application; the receiver and the engine client open on start-up, close on clean-up."""
    app = web.Application(
        client_max_size=256 << 20,  # requests may carry images and embeddings inline
        middlewares=[_traced] if tracing.enabled() else [],
    )
    app[CONFIG] = config

    async def lifecycle(app: web.Application):
        receiver = EncoderReceiver(list(config.encoders), config.receiver)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=config.engine_keepalive_s),
            timeout=aiohttp.ClientTimeout(total=config.engine_timeout_s),
            auto_decompress=False,
        )
        try:
            await _check_encoders(receiver, config.handoff)
            await _check_engine_release(session, config.engine_url)
            app[SERVICE] = ChatCompletionsService(
                receiver=receiver,
                handoff=handoff or handoff_for(config.handoff, lease_ttl_s=config.lease_ttl_s),
                engine_url=config.engine_url,
                session=session,
                sources=SourceReader(config.sources, user_agent="encoder-gateway"),
                metrics=GatewayMetrics(receiver.metrics),
                pass_non_image=config.pass_non_image,
                retry_after_s=config.retry_after_s,
            )
            yield
        finally:
            await session.close()
            await receiver.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


async def start(config: GatewayConfig, *, handoff: Handoff | None = None) -> tuple[web.AppRunner, int]:
    """Starts the gateway on config.host:config.port (0: an OS-chosen port); returns the runner and the port."""
    # handler_cancellation: a client that disconnects cancels its handler, so its encode and engine call stop.
    runner = web.AppRunner(build_app(config, handoff=handoff), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    return runner, runner.addresses[0][1]
