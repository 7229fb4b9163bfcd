"""Measures placement on a fleet of encoder processes: random vs affinity vs affinity with the receiver
cache, on one workload of repeated images (Zipf popularity, the same seed for every mode), and random vs
affinity on a workload without repeats (tail latency: affinity must make no hot spots).

Per mode: forwards the encoders ran (items they reported as cache misses), the fleet's hit rate, items
served by the receiver cache (no RPC), throughput, p50 and p99 request latency. Each mode has a fleet of
its own (no mode sees another's caches), all started at once; the workload runs in rounds, each round
through every mode in turn (the order rotating), so the machine's noise falls on all modes alike.
Compare modes as ratios. The no-repeat workload then runs on the random and affinity fleets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


class ModeRun:
    """One mode's receiver and what its requests measured so far."""

    def __init__(self, mode: str, urls: list[str], balance: float):
        self.mode = mode
        self.rx = EncoderReceiver(urls, seed=0, balance=balance, **MODES[mode])
        self.latencies: list[float] = []
        self.wall = 0.0
        self.forwards = self.hits_at_encoders = self.receiver_hits = 0

    async def round(self, requests: list[tuple[int, list[int]]], images: list[bytes], concurrency: int):
        queue = iter(requests)

        async def client() -> None:
            for number, picks in queue:
                started = time.perf_counter()
                result = await self.rx.encode(f"{self.mode}-{number}", [{"data": images[i]} for i in picks])
                self.latencies.append(time.perf_counter() - started)
                for item in result.items:
                    if item.receiver_cache_hit:
                        self.receiver_hits += 1
                    elif item.cache_hit:
                        self.hits_at_encoders += 1
                    else:
                        self.forwards += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        self.wall += time.perf_counter() - started

    def result(self, workload_name: str, workload: list[list[int]]) -> ModeResult:
        latencies = sorted(self.latencies)
        reached = self.forwards + self.hits_at_encoders
        return ModeResult(
            mode=self.mode,
            workload=workload_name,
            requests=len(workload),
            items=sum(map(len, workload)),
            distinct_images=len({i for picks in workload for i in picks}),
            forwards=self.forwards,
            fleet_hit_rate=round(self.hits_at_encoders / reached, 4) if reached else 1.0,
            receiver_cache_hits=self.receiver_hits,
            throughput_rps=round(len(workload) / self.wall, 1),
            p50_ms=round(statistics.median(latencies) * 1000, 2),
            p99_ms=round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 2),
        )


async def interleaved(runs: list[ModeRun], workload: list[list[int]], images: list[bytes], args) -> None:
    """The workload in rounds of `args.round` requests, each round through every mode, order rotating."""
    numbered = list(enumerate(workload))
    for number, start in enumerate(range(0, len(numbered), args.round)):
        chunk = numbered[start : start + args.round]
        for run in runs[number % len(runs) :] + runs[: number % len(runs)]:
            await run.round(chunk, images, args.concurrency)


async def bench(args: argparse.Namespace) -> list[ModeResult]:
    model_dir = ensure_default_model(args.model_dir or tempfile.mkdtemp(prefix="bench-affinity-"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-affinity-logs-"))
    repeated = zipf_workload(args.requests, args.images, args.zipf, args.seed)
    images = make_images(args.images, 0)
    results = []
    with contextlib.ExitStack() as stack:
        flags = ("--dtype", "float32")
        fleets = {
            mode: stack.enter_context(launch_servers(model_dir, args.encoders, *flags, log_dir=log_dir))
            for mode in MODES
        }
        runs = [ModeRun(mode, [p.url for p in fleet], args.balance) for mode, fleet in fleets.items()]
        try:
            for run in runs:
                await run.rx.encode("warm", [{"data": image_bytes(56, 56, seed=10**6)}])
            await interleaved(runs, repeated, images, args)
            results += [run.result("zipf", repeated) for run in runs]
            if args.no_repeat_requests:
                fresh = no_repeat_workload(args.no_repeat_requests, args.seed)
                fresh_images = make_images(sum(map(len, fresh)), 100_000)
                modes = ("random", "affinity")
                again = [ModeRun(mode, [p.url for p in fleets[mode]], args.balance) for mode in modes]
                await interleaved(again, fresh, fresh_images, args)
                results += [run.result("no-repeat", fresh) for run in again]
                for run in again:
                    await run.rx.close()
        finally:
            for run in runs:
                await run.rx.close()
    for result in results:
        print(json.dumps(asdict(result)), file=sys.stderr, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoders", type=int, default=4, help="encoder processes of the built-in model")
    p.add_argument("--requests", type=int, default=2000, help="requests of the repeated-image workload")
    p.add_argument("--images", type=int, default=500, help="distinct images it draws from")
    p.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    p.add_argument("--no-repeat-requests", type=int, default=500, help="requests without repeats (0: none)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--round", type=int, default=100, help="requests per mode in one round")
    p.add_argument("--balance", type=float, default=1.25, help="affinity's bound, x the mean")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="where the built-in model goes (default: a temporary dir)")
    args = p.parse_args()
    results = asyncio.run(bench(args))
    print(json.dumps({"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "args": vars(args),
                      "results": [asdict(r) for r in results]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
