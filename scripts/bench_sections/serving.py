"""The serving section: images/s through one encoder server against the same checkpoint in-process
(decode, preprocess, forward, one image at a time)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from testkit.bench_harness import Stopwatch, interleaved
from testkit.images import image_bytes

from .clients import closed_loop, encode_call, rates
from .context import Context


def load_in_process(ctx: Context):
    from encoder_server.models import load_vision_encoder
    from protos.wire import DTYPE_NAMES

    return load_vision_encoder(ctx.models["tower"], ctx.profile.device, DTYPE_NAMES[ctx.profile.dtype])


async def run(ctx: Context) -> dict:
    from encoder_server.images import decode_image
    from receiver import EncoderReceiver

    p = ctx.profile
    encoder = await asyncio.to_thread(load_in_process, ctx)
    width, height = p.serving_image

    def in_process(images: Sequence[bytes]) -> float:
        watch = Stopwatch()
        for data in images:
            (_,) = encoder.encode([encoder.preprocess(decode_image(data))])
        return len(images) / watch.seconds()

    images: list[bytes] = []

    async def server() -> float:
        # Fresh images each round, the same ones on both sides: no run is helped by the cache.
        images[:] = [
            image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.serving_images)
        ]
        calls = [encode_call(receiver, f"serving-{i}", [data]) for i, data in enumerate(images)]
        return await closed_loop(p.serving_clients, calls)

    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        warm = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(2)]
        await asyncio.to_thread(in_process, warm[:1])
        await encode_call(receiver, "warm", warm[1:])()
        runs = await interleaved(
            "serving",
            p.rounds,
            {"server": server, "in_process": lambda: asyncio.to_thread(in_process, images)},
        )
    return {
        "image": f"{width}x{height}",
        "tower": p.tower,
        "dtype": p.dtype,
        "torch_threads": p.torch_threads,
        "clients": p.serving_clients,
        **rates(runs, "server", "in_process"),
    }
