"""Measures placement on a fleet of encoder processes, random placement against placement by content and
load ("affinity"), each scenario with its baseline in the same run:

- zipf: repeated images (Zipf popularity), closed loop: forwards the encoders ran, hit rate, throughput,
  p50/p99; random, affinity and affinity with the receiver cache, each on a fleet of its own.
- no-repeat: images that never repeat, closed loop: throughput (random's is the fleet's capacity there).
- latency: both workloads at light load (one request in flight) and open loop at 80% of random's
  measured capacity on that workload (Poisson arrivals), on fresh images: p50/p99.
- membership: 5 encoders behind a name the bench resolves; after a Zipf run one leaves and the run
  repeats: how many images that lived on the other four moved.
- slow: two receivers (two prefill nodes) sharing 4 encoders, images that never repeat; then one
  encoder is made slow (stopped 3/4 of the time with SIGSTOP/SIGCONT): its share of new work, before
  and after.
- hot: one image in half the requests, the others new: throughput and forwards.

Modes run interleaved in rounds (the order rotating), so the machine's noise falls on all alike; every
phase of a fleet gets images of its own, so no phase sees another's caches. Compare modes as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from receiver import EncoderReceiver  # noqa: E402
from testkit.default_model import ensure_default_model  # noqa: E402
from testkit.images import image_bytes  # noqa: E402
from testkit.launcher import launch_server, launch_servers  # noqa: E402

MODES = {
    "random": {"placement": "random"},
    "affinity": {"placement": "affinity"},
    "affinity+cache": {"placement": "affinity", "cache_bytes": 1 << 30},
}
FLAGS = ("--dtype", "float32")


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


def hot_workload(requests: int, seed: int) -> list[list[int]]:
    """Requests of 1-4 images: image 0 (the hot one) in half of them, every other image new."""
    rng = random.Random(seed)
    workload, next_image = [], 1
    for _ in range(requests):
        size = rng.randint(1, 4)
        hot = rng.random() < 0.5
        fresh = size - hot
        workload.append([0] * hot + list(range(next_image, next_image + fresh)))
        next_image += fresh
    return workload


def make_images(count: int, seed: int) -> list[bytes]:
    """PNG images of a few sizes (112 to 224 pixels a side: 16 to 64 tokens)."""
    sides = (112, 168, 224)
    return [image_bytes(sides[i % 3], sides[(i // 3) % 3], seed=seed + i) for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ModeRun:
    """One mode's receivers (one per fleet it takes turns on) and what its requests measured so far."""

    def __init__(self, mode: str, fleets: list[list[str]], balance: float, **options):
        self.mode = mode
        self.receivers = [
            EncoderReceiver(urls, seed=0, balance=balance, **{**MODES[mode], **options}) for urls in fleets
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
        started = time.perf_counter()
        result = await self.rx.encode(f"{self.mode}-{number}", [{"data": images[i]} for i in picks])
        self.latencies.append(time.perf_counter() - started)
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

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        self.wall += time.perf_counter() - started

    async def open_loop(self, requests: list[tuple[int, list[int]]], images: list[bytes], rate: float, rng):
        """Requests arriving as a Poisson process of `rate` per second, whatever is still in flight."""
        started = time.perf_counter()
        tasks = []
        for number, picks in requests:
            tasks.append(asyncio.create_task(self.request(number, picks, images)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        self.wall += time.perf_counter() - started

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
            p50_ms=round(statistics.median(self.latencies) * 1000, 2),
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


class Images:
    """Fresh image sets: every phase draws its own, so no phase meets another's cached embeddings."""

    def __init__(self) -> None:
        self.next_seed = 0

    def __call__(self, count: int) -> list[bytes]:
        self.next_seed += 1_000_000
        return make_images(count, self.next_seed)


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


class Dns:
    """The membership scenario's name -> the ports it lists now."""

    def __init__(self, ports: list[int]):
        self.ports = ports

    def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]


async def membership(fleet, extra, images_for, args) -> dict:
    """One of 5 encoders leaves between two runs of the same Zipf workload (8 in flight)."""
    dns = Dns([p.port for p in fleet] + [extra.port])
    workload = zipf_workload(args.membership_requests, args.images, args.zipf, args.seed + 7)
    images = images_for(args.images)
    run = ModeRun("affinity", [["dns:///encoders.bench:50051"]], args.balance, resolver=dns, refresh_s=0.0)
    try:
        await run.closed_loop(list(enumerate(workload)), images, args.concurrency)
        before = {image: set(urls) for image, urls in run.served.items()}
        gone = extra.url
        dns.ports = dns.ports[:4]
        run.served.clear()
        await run.closed_loop(list(enumerate(workload)), images, args.concurrency)
        lived_elsewhere = [image for image, urls in before.items() if gone not in urls]
        moved = [image for image in lived_elsewhere if not run.served[image] <= before[image]]
        spread = Counter(url for image, urls in before.items() if gone in urls for url in run.served[image])
        return {
            "images": len(before),
            "lived_on_the_other_four": len(lived_elsewhere),
            "moved": len(moved),
            "moved_fraction": round(len(moved) / max(1, len(lived_elsewhere)), 4),
            "departed_images_now_on": len(spread),
        }
    finally:
        await run.close()


@contextlib.contextmanager
def slowed(pid: int, stopped_s: float = 0.03, running_s: float = 0.01):
    """Makes a process slow: stopped `stopped_s`, running `running_s`, over and over, until exit."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


async def slow_encoder(fleet, images_for, args) -> dict:
    """Two receivers share 4 encoders (images never repeat); then one encoder is made slow."""
    urls = [p.url for p in fleet]
    slow = fleet[0]
    runs = [ModeRun("affinity", [urls], args.balance) for _ in range(2)]
    shares = {}
    try:
        for phase in ("before", "slowed"):
            workload = no_repeat_workload(args.slow_requests, args.seed + 11)
            images = images_for(sum(map(len, workload)))
            for run in runs:
                run.forwards_by_encoder.clear()
            numbered = list(enumerate(workload))
            halves = [numbered[0::2], numbered[1::2]]  # one half per receiver, at once
            with slowed(slow.process.pid) if phase == "slowed" else contextlib.nullcontext():
                await asyncio.gather(
                    *(run.closed_loop(half, images, args.concurrency // 2) for run, half in zip(runs, halves))
                )
            by_receiver = [
                round(run.forwards_by_encoder[slow.url] / max(1, sum(run.forwards_by_encoder.values())), 4)
                for run in runs
            ]
            total = sum(run.forwards_by_encoder[slow.url] for run in runs)
            shares[phase] = {
                "share_of_new_work": round(total / sum(sum(r.forwards_by_encoder.values()) for r in runs), 4),
                "by_receiver": by_receiver,
            }
        return shares
    finally:
        for run in runs:
            await run.close()


async def bench(args: argparse.Namespace) -> dict:
    model_dir = ensure_default_model(args.model_dir or tempfile.mkdtemp(prefix="bench-affinity-"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-affinity-logs-"))
    images_for = Images()
    out: dict = {"results": []}
    results = out["results"]

    def report(found: list[ModeResult]) -> None:
        for result in found:
            print(json.dumps(asdict(result)), file=sys.stderr, flush=True)
        results.extend(found)

    with contextlib.ExitStack() as stack:
        fleets = {
            mode: stack.enter_context(launch_servers(model_dir, args.encoders, *FLAGS, log_dir=log_dir))
            for mode in MODES
        }
        pair = ("random", "affinity")
        zipf = zipf_workload(args.requests, args.images, args.zipf, args.seed)
        report(await run_modes(fleets, MODES, zipf, images_for(args.images), args, "zipf"))
        capacity = {"zipf": results[0].throughput_rps}
        if args.no_repeat_requests:
            fresh = no_repeat_workload(args.no_repeat_requests, args.seed)
            report(
                await run_modes(
                    fleets, pair, fresh, images_for(sum(map(len, fresh))), args, "no-repeat", swap=True
                )
            )
            capacity["no-repeat"] = results[-2].throughput_rps
        out["capacity_rps"] = capacity  # random placement's, closed loop
        for name, rate_of in (("light", None), ("80%", 0.8)):
            for workload_name, workload_capacity in capacity.items():
                workload = (
                    zipf_workload(args.latency_requests, args.images, args.zipf, args.seed + 1)
                    if workload_name == "zipf"
                    else no_repeat_workload(args.latency_requests, args.seed + 1)
                )
                images = images_for(args.images if workload_name == "zipf" else sum(map(len, workload)))
                rate = None if rate_of is None else rate_of * workload_capacity
                saved, args.concurrency = args.concurrency, (1 if rate is None else args.concurrency)
                try:
                    report(
                        await run_modes(
                            fleets, pair, workload, images, args, f"{workload_name} {name}", rate=rate
                        )
                    )
                finally:
                    args.concurrency = saved
        hot = hot_workload(args.hot_requests, args.seed + 3)
        report(await run_modes(fleets, pair, hot, images_for(sum(map(len, hot)) + 1), args, "hot image"))
        if args.scenarios:
            extra = stack.enter_context(launch_server(model_dir, *FLAGS, log_dir=log_dir))
            out["membership"] = await membership(fleets["affinity"], extra, images_for, args)
            print(json.dumps({"membership": out["membership"]}), file=sys.stderr, flush=True)
            out["slow"] = await slow_encoder(fleets["affinity"], images_for, args)
            print(json.dumps({"slow": out["slow"]}), file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--encoders", type=int, default=4, help="encoder processes of the built-in model, per mode"
    )
    p.add_argument("--requests", type=int, default=2000, help="requests of the repeated-image workload")
    p.add_argument("--images", type=int, default=500, help="distinct images it draws from")
    p.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    p.add_argument("--no-repeat-requests", type=int, default=500, help="requests without repeats (0: none)")
    p.add_argument(
        "--latency-requests",
        type=int,
        default=300,
        help="requests per workload and load of the latency phase",
    )
    p.add_argument("--hot-requests", type=int, default=400, help="requests of the hot-image workload")
    p.add_argument("--membership-requests", type=int, default=600, help="requests of each membership run")
    p.add_argument("--slow-requests", type=int, default=400, help="requests of each slow-encoder phase")
    p.add_argument("--no-scenarios", dest="scenarios", action="store_false", help="skip membership and slow")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (closed loop)")
    p.add_argument("--round", type=int, default=100, help="requests per mode in one round")
    p.add_argument("--balance", type=float, default=1.25, help="affinity's load bound, x the soonest finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model-dir", default=None, help="where the built-in model goes (default: a temporary dir)"
    )
    args = p.parse_args()
    out = asyncio.run(bench(args))
    out["results"] = [asdict(r) for r in out["results"]]
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(
        json.dumps(
            {"machine": machine, "date": time.strftime("%Y-%m-%d"), "args": vars(args), **out}, indent=1
        )
    )


if __name__ == "__main__":
    main()
