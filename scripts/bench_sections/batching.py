"""The batching section: 16 concurrent clients of one server with batching on (the default) against
a server that runs one image per forward."""

from __future__ import annotations

import asyncio
import functools

from testkit.bench_harness import interleaved
from testkit.images import image_bytes

from .clients import concurrent_clients, encode_call, rates
from .context import Context

MODES = ("on", "off")


async def run(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.batching_image
    receivers = {
        mode: [EncoderReceiver([ctx.servers[f"batching-{mode}"].url]) for _ in range(p.batching_clients)]
        for mode in MODES
    }

    async def measure(mode: str) -> float:
        def client_calls(receiver, client: int):
            images = [
                image_bytes(width, height, seed, compress_level=1)
                for seed in ctx.seeds.take(p.batching_requests)
            ]
            return [encode_call(receiver, f"batching-{client}-{i}", [d]) for i, d in enumerate(images)]

        return await concurrent_clients([client_calls(rx, c) for c, rx in enumerate(receivers[mode])])

    try:
        for mode in MODES:
            await measure(mode)  # warm-up: channels connected, first forwards done
        runs = await interleaved(
            "batching", p.rounds, {mode: functools.partial(measure, mode) for mode in MODES}
        )
    finally:
        for group in receivers.values():
            await asyncio.gather(*(rx.close() for rx in group))
    return {
        "clients": p.batching_clients,
        "image": f"{width}x{height}",
        "model": "built-in default (tiny Qwen2.5-VL tower)",
        **rates(runs, "on", "off"),
    }
