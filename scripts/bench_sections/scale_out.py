"""The scale-out section: requests sharded by the receiver across two encoder processes against one,
with the cores the encoder processes actually got."""

from __future__ import annotations

import functools

from testkit.bench_harness import Stopwatch, interleaved, median, process_cpu_seconds
from testkit.images import image_bytes

from .clients import closed_loop, encode_call, rates
from .context import Context

CLIENTS = 2  # requests in flight


async def run(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.serving_image
    urls = {
        "one": [ctx.servers["scale-a"].url],
        "two": [ctx.servers["scale-a"].url, ctx.servers["scale-b"].url],
    }
    receivers = {k: EncoderReceiver(v, seed=0) for k, v in urls.items()}
    pids = [ctx.servers[name].process.pid for name in ("scale-a", "scale-b")]
    cores: dict[str, list[float]] = {mode: [] for mode in urls}

    async def measure(mode: str, requests: int) -> float:
        calls = []
        for r in range(requests):
            images = [
                image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.scale_items)
            ]
            calls.append(encode_call(receivers[mode], f"scale-{r}", images))
        cpu, wall = process_cpu_seconds(*pids), Stopwatch()
        rate = await closed_loop(CLIENTS, calls)
        # How many cores the encoder processes got: what bounds 2 single-thread processes on a busy host.
        cores[mode].append((process_cpu_seconds(*pids) - cpu) / wall.seconds())
        return rate

    try:
        await measure("two", 1)  # warm-up of the second encoder
        runs = await interleaved(
            "scale_out", p.rounds, {mode: functools.partial(measure, mode, p.scale_requests) for mode in urls}
        )
    finally:
        for rx in receivers.values():
            await rx.close()
    return {
        "image": f"{width}x{height}",
        "items_per_request": p.scale_items,
        "requests_in_flight": CLIENTS,
        "torch_threads_per_process": p.torch_threads,
        "max_batch_images": 1,
        "encoder_cores_used": {mode: median(values) for mode, values in cores.items()},
        **rates(runs, "two", "one"),
    }
