"""The front of vLLM's own encoder disaggregation (EPD), written here for the peers benchmark: an OpenAI
chat-completions endpoint that, for a request with images, first sends the request to the encoder instance
(`ec_producer`, which runs the vision tower and stores each image's embedding through its EC connector)
with one output token, then sends the original request to the prefill/decode instance (`ec_consumer`,
which loads the stored embeddings instead of running its tower) and returns that answer.

This is the flow of vLLM's `examples/online_serving/disaggregated_encoder` (one encoder, one combined
prefill/decode instance). Usage: `python testkit/epd_proxy.py --port P --encoder URL --engine URL`; it
prints "listening on PORT" once it serves.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from gateway.config import ENGINE_KEEPALIVE_S

IMAGE_PARTS = {"image_url", "image_embeds"}


def has_images(body: dict) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for message in body.get("messages", [])
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def encoder_request(body: dict) -> dict:
    """The request the encoder instance gets: the same messages, one token, no streaming."""
    primer = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    primer["max_tokens"] = 1
    primer.pop("max_completion_tokens", None)
    return primer


def build_app(encoder_url: str, engine_url: str) -> web.Application:
    async def on_startup(app: web.Application) -> None:
        app["session"] = ClientSession(
            connector=TCPConnector(keepalive_timeout=ENGINE_KEEPALIVE_S), timeout=ClientTimeout(total=3600)
        )

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: ClientSession = request.app["session"]
        if has_images(body):
            async with session.post(
                f"{encoder_url}/v1/chat/completions", json=encoder_request(body)
            ) as reply:
                if reply.status != 200:  # the encoder's refusal is the answer
                    return web.Response(
                        status=reply.status, body=await reply.read(), content_type="application/json"
                    )
        async with session.post(f"{engine_url}/v1/chat/completions", json=body) as reply:
            if not body.get("stream"):
                return web.Response(
                    status=reply.status, body=await reply.read(), content_type="application/json"
                )
            response = web.StreamResponse(status=reply.status, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def passthrough_get(request: web.Request) -> web.Response:
        async with request.app["session"].get(f"{engine_url}{request.path}") as reply:
            return web.Response(status=reply.status, body=await reply.read(), content_type="application/json")

    app = web.Application(client_max_size=256 * 2**20)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", passthrough_get)
    app.router.add_get("/health", passthrough_get)
    return app


async def serve(port: int, encoder_url: str, engine_url: str) -> None:
    runner = web.AppRunner(build_app(encoder_url, engine_url), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"listening on {port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="epd_proxy.py", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--encoder", required=True, help="the ec_producer vLLM's base URL")
    parser.add_argument("--engine", required=True, help="the ec_consumer vLLM's base URL")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.encoder, args.engine))


if __name__ == "__main__":
    main()
