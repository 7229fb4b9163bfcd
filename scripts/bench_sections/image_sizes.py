"""The image-sizes section: images/s through one server at each of the profile's resolutions, with
the tokens per image and the embedding bytes per second they make."""

from __future__ import annotations

import torch

from testkit.bench_harness import Progress
from testkit.images import image_bytes

from .clients import closed_loop, encode_call
from .context import Context


async def run(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    out = {}
    progress = Progress("image_sizes", len(p.image_sizes))
    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        for width, height in p.image_sizes:
            warm = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(1)]
            await encode_call(receiver, "warm", warm)()
            tokens = (await receiver.encode("tokens", [{"data": warm[0]}])).items[0].num_tokens
            images = [
                image_bytes(width, height, seed, compress_level=1)
                for seed in ctx.seeds.take(p.image_size_images)
            ]
            calls = [encode_call(receiver, f"size-{i}", [d]) for i, d in enumerate(images)]
            rate = await closed_loop(p.serving_clients, calls)
            itemsize = torch.finfo(getattr(torch, p.dtype)).bits // 8
            out[f"{width}x{height}"] = {
                "images_per_s": rate,
                "tokens_per_image": tokens,
                "embedding_gbps": rate * tokens * p.tower["out_hidden_size"] * itemsize / 1e9,
            }
            progress.step(f"{width}x{height}")
    progress.close()
    return {"tower": p.tower, "dtype": p.dtype, "device": p.device, "sizes": out}
