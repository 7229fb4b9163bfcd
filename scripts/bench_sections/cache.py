"""The cache section: the same image twice through one server, the miss's latency against the hit's."""

from __future__ import annotations

import torch

from testkit.bench_harness import Progress, Stopwatch, paired_ratio, summary
from testkit.images import image_bytes

from .context import Context


async def run(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.serving_image
    miss_ms, hit_ms = [], []
    progress = Progress("cache", p.cache_repeats)
    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        for seed in ctx.seeds.take(p.cache_repeats):
            items = [{"data": image_bytes(width, height, seed, compress_level=1)}]
            watch = Stopwatch()
            miss = (await receiver.encode(f"miss-{seed}", items)).items[0]
            miss_ms.append(watch.lap() * 1000)
            hit = (await receiver.encode(f"hit-{seed}", items)).items[0]
            hit_ms.append(watch.lap() * 1000)
            assert not miss.cache_hit and hit.cache_hit and torch.equal(hit.embedding, miss.embedding)
            progress.step()
    progress.close()
    return {
        "image": f"{width}x{height}",
        "miss_ms": summary(miss_ms),
        "hit_ms": summary(hit_ms),
        "speedup": paired_ratio(miss_ms, hit_ms),
    }
