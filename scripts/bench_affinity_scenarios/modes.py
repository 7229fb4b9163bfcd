"""Placement modes (random, affinity, affinity with the receiver cache), each a receiver per fleet it
takes turns on, run interleaved over a workload in rounds; what each measured, as a `ModeResult`."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from dataclasses import dataclass

from receiver import EncoderReceiver
from testkit.bench_harness import Stopwatch, median, percentile
from testkit.images import image_bytes

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


class ModeRun:
    """One mode's receivers (one per fleet it takes turns on) and what its requests measured so far."""

    def __init__(self, mode: str, fleets: list[list[str]], balance: float, seed: int = 0, **options):
        self.mode = mode
        self.receivers = [
            EncoderReceiver(urls, seed=seed, balance=balance, **{**MODES[mode], **options}) for urls in fleets
        ]
        self.rx = self.receivers[0]
        self.latencies: list[float] = []
        self.wall = 0.0
        self.forwards = self.hits_at_encoders = self.receiver_hits = 0
        self.served: defaultdict[int, set[str]] = defaultdict(set)  # image -> encoders that served it
        self.forwards_by_encoder: Counter[str] = Counter()

    def turn(self, number: int) -> None:
        """Uses fleet `number` (modulo the fleets it has) for the next requests."""
        self.rx = self.receivers[number % len(self.receivers)]

    async def request(self, number: int, picks: list[int], images: list[bytes]) -> None:
        watch = Stopwatch()
        result = await self.rx.encode(f"{self.mode}-{number}", [{"data": images[i]} for i in picks])
        self.latencies.append(watch.seconds())
        for image, item in zip(picks, result.items):
            if item.receiver_cache_hit:
                self.receiver_hits += 1
                continue
            self.served[image].add(item.encoder_url)
            if item.cache_hit:
                self.hits_at_encoders += 1
            else:
                self.forwards += 1
                self.forwards_by_encoder[item.encoder_url] += 1

    async def closed_loop(self, requests: list[tuple[int, list[int]]], images: list[bytes], concurrency: int):
        queue = iter(requests)

        async def client() -> None:
            for number, picks in queue:
                await self.request(number, picks, images)

        watch = Stopwatch()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        self.wall += watch.seconds()

    async def open_loop(self, requests: list[tuple[int, list[int]]], images: list[bytes], rate: float, rng):
        """Requests arriving as a Poisson process of `rate` per second, whatever is still in flight."""
        watch = Stopwatch()
        tasks = []
        for number, picks in requests:
            tasks.append(asyncio.create_task(self.request(number, picks, images)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        self.wall += watch.seconds()

    def result(self, workload_name: str, workload: list[list[int]]) -> ModeResult:
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
            p50_ms=round(median(self.latencies) * 1000, 2),
            p99_ms=round(percentile(self.latencies, 0.99) * 1000, 2),
        )

    async def close(self) -> None:
        for rx in self.receivers:
            await rx.close()


async def interleaved(
    runs: list[ModeRun], workload: list[list[int]], images: list[bytes], args, *, rate=None
):
    """The workload in rounds of `args.round` requests, each round through every mode, order rotating;
    closed loop at `args.concurrency`, or open loop at `rate` requests per second. Modes with several
    fleets take them in turn, each mode on another fleet in each round."""
    numbered = list(enumerate(workload))
    for number, start in enumerate(range(0, len(numbered), args.round)):
        chunk = numbered[start : start + args.round]
        for run in runs:  # their fleet lists are rotated against each other: never two on one fleet
            run.turn(number)
        for run in runs[number % len(runs) :] + runs[: number % len(runs)]:
            if rate is None:
                await run.closed_loop(chunk, images, args.concurrency)
            else:
                await run.open_loop(chunk, images, rate, random.Random(args.seed + number))


async def run_modes(
    fleets, modes, workload, images, args, name, *, rate=None, swap=False
) -> list[ModeResult]:
    """`modes` on the workload, each on its own fleet; with `swap` (images that never repeat, so no cache
    to keep apart) every mode takes every fleet in turn, so no mode keeps a slower set of processes."""
    urls = [[p.url for p in fleets[mode]] for mode in modes]
    runs = [
        ModeRun(mode, urls[i:] + urls[:i] if swap else [urls[i]], args.balance)
        for i, mode in enumerate(modes)
    ]
    try:
        for run in runs:  # the first forward of each process is not what is measured
            for rx in run.receivers:
                await rx.encode("warm", [{"data": image_bytes(56, 56, seed=10**9 + hash(name) % 1000)}])
        await interleaved(runs, workload, images, args, rate=rate)
        return [run.result(name, workload) for run in runs]
    finally:
        for run in runs:
            await run.close()
