"""Measures placement on a fleet of encoder processes: random vs affinity vs affinity with the receiver
cache, on one workload of repeated images (Zipf popularity, the same seed for every mode), and random vs
affinity on a workload without repeats (tail latency: affinity must make no hot spots).

Per mode: forwards the encoders ran (items they reported as cache misses), the fleet's hit rate, items
served by the receiver cache (no RPC), throughput, p50 and p99 request latency. Each mode starts a fresh
fleet, so no mode inherits another's caches. Modes of one workload run back to back on the same machine;
compare them as ratios, the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from receiver import EncoderReceiver  # noqa: E402
from testkit.default_model import ensure_default_model  # noqa: E402
from testkit.images import image_bytes  # noqa: E402
from testkit.launcher import launch_servers  # noqa: E402

MODES = {
    "random": {"placement": "random"},
    "affinity": {"placement": "affinity"},
    "affinity+cache": {"placement": "affinity", "cache_bytes": 1 << 30},
}


@dataclass
class ModeResult:
    mode: str
    workload: str
    requests: int
    items: int
    distinct_images: int
    forwards: int  # items the encoders encoded (cache misses)
    fleet_hit_rate: float  # of the items that reached an encoder
    receiver_cache_hits: int  # items served without an RPC
    throughput_rps: float
    p50_ms: float
    p99_ms: float


def zipf_workload(requests: int, images: int, exponent: float, seed: int) -> list[list[int]]:
    """Requests of 1-4 distinct images, each drawn with probability ~ 1 / rank^exponent."""
    rng = random.Random(seed)
    weights = [1 / rank**exponent for rank in range(1, images + 1)]
    workload = []
    for _ in range(requests):
        picks: list[int] = []
        size = rng.randint(1, 4)
        while len(picks) < size:
            (image,) = rng.choices(range(images), weights)
            if image not in picks:
                picks.append(image)
        workload.append(picks)
    return workload


def no_repeat_workload(requests: int, seed: int) -> list[list[int]]:
    """Requests of 1-4 images, no image twice in the whole workload."""
    rng = random.Random(seed)
    workload, next_image = [], 0
    for _ in range(requests):
        size = rng.randint(1, 4)
        workload.append(list(range(next_image, next_image + size)))
        next_image += size
    return workload


def make_images(count: int, seed: int) -> list[bytes]:
    """PNG images of a few sizes (112 to 224 pixels a side: 16 to 64 tokens)."""
    sides = (112, 168, 224)
    return [image_bytes(sides[i % 3], sides[(i // 3) % 3], seed=seed + i) for i in range(count)]


async def run_mode(urls, mode: str, workload: list[list[int]], images: list[bytes], concurrency: int) -> ModeResult:
    latencies: list[float] = []
    forwards = hits_at_encoders = receiver_hits = 0
    queue = iter(enumerate(workload))
    async with EncoderReceiver(urls, seed=0, **MODES[mode]) as rx:
        await rx.encode("warm", [{"data": image_bytes(56, 56, seed=10**6)}])

        async def client() -> None:
            nonlocal forwards, hits_at_encoders, receiver_hits
            for number, picks in queue:
                started = time.perf_counter()
                result = await rx.encode(f"{mode}-{number}", [{"data": images[i]} for i in picks])
                latencies.append(time.perf_counter() - started)
                for item in result.items:
                    if item.receiver_cache_hit:
                        receiver_hits += 1
                    elif item.cache_hit:
                        hits_at_encoders += 1
                    else:
                        forwards += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    reached = forwards + hits_at_encoders
    return ModeResult(
        mode=mode,
        workload="",
        requests=len(workload),
        items=sum(map(len, workload)),
        distinct_images=len({i for picks in workload for i in picks}),
        forwards=forwards,
        fleet_hit_rate=round(hits_at_encoders / reached, 4) if reached else 1.0,
        receiver_cache_hits=receiver_hits,
        throughput_rps=round(len(workload) / wall, 1),
        p50_ms=round(statistics.median(latencies) * 1000, 2),
        p99_ms=round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 2),
    )


async def bench(args: argparse.Namespace) -> list[ModeResult]:
    model_dir = ensure_default_model(args.model_dir or tempfile.mkdtemp(prefix="bench-affinity-"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-affinity-logs-"))
    repeated = zipf_workload(args.requests, args.images, args.zipf, args.seed)
    fresh = no_repeat_workload(args.no_repeat_requests, args.seed)
    plans = [("zipf", repeated, make_images(args.images, 0), list(MODES))]
    if args.no_repeat_requests:
        fresh_images = make_images(sum(map(len, fresh)), 100_000)
        plans.append(("no-repeat", fresh, fresh_images, ["random", "affinity"]))
    results = []
    for workload_name, workload, images, modes in plans:
        for mode in modes:
            flags = ("--dtype", "float32")  # a fresh fleet per mode: empty caches
            with launch_servers(model_dir, args.encoders, *flags, log_dir=log_dir) as fleet:
                result = await run_mode([p.url for p in fleet], mode, workload, images, args.concurrency)
            result.workload = workload_name
            print(json.dumps(asdict(result)), file=sys.stderr, flush=True)
            results.append(result)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoders", type=int, default=4, help="encoder processes of the built-in model")
    p.add_argument("--requests", type=int, default=2000, help="requests of the repeated-image workload")
    p.add_argument("--images", type=int, default=500, help="distinct images it draws from")
    p.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    p.add_argument("--no-repeat-requests", type=int, default=500, help="requests of the no-repeat workload (0: skip)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="where the built-in model is written (a temporary dir if unset)")
    args = p.parse_args()
    results = asyncio.run(bench(args))
    print(json.dumps({"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "args": vars(args),
                      "results": [asdict(r) for r in results]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
