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
- shared: 3 and 8 receivers (prefill nodes) at once over 4 encoders, one Zipf workload dealt among them:
  forwards against distinct images, on a fleet without the fleet-wide store and on one with it (a
  redis-server of its own); then on each, one encoder killed and restarted with an empty cache half-way
  through a workload: forwards after the restart against the images new to the second half.

Modes run interleaved in rounds (the order rotating), so the machine's noise falls on all alike; every
phase of a fleet gets images of its own, so no phase sees another's caches. Compare modes as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from bench_affinity_scenarios.fleet_changes import membership, slow_encoder
from bench_affinity_scenarios.modes import MODES, ModeResult, run_modes
from bench_affinity_scenarios.shared_fleet import receivers, restart
from bench_affinity_scenarios.workloads import (
    Images,
    hot_workload,
    no_repeat_workload,
    zipf_workload,
)

from testkit.bench_harness import MachineLoad, add_record_flag, print_json, record_result
from testkit.default_model import ensure_default_model
from testkit.launcher import launch_server, launch_servers
from testkit.redis_server import running_redis

FLAGS = ("--dtype", "float32")


async def latency(fleets, pair, workload_name: str, load: str, rate, images_for, args) -> list[ModeResult]:
    """One workload at one load: one request in flight (`rate` None), or open loop at `rate` per second."""
    workload = (
        zipf_workload(args.latency_requests, args.images, args.zipf, args.seed + 1)
        if workload_name == "zipf"
        else no_repeat_workload(args.latency_requests, args.seed + 1)
    )
    images = images_for(args.images if workload_name == "zipf" else sum(map(len, workload)))
    saved, args.concurrency = args.concurrency, (1 if rate is None else args.concurrency)
    try:
        return await run_modes(fleets, pair, workload, images, args, f"{workload_name} {load}", rate=rate)
    finally:
        args.concurrency = saved


async def compare_modes(fleets, images_for, args, report, out: dict) -> None:
    """Random against affinity placement (and the receiver cache) on the Zipf, no-repeat, latency and
    hot-image workloads."""
    results = out["results"]
    pair = ("random", "affinity")
    zipf = zipf_workload(args.requests, args.images, args.zipf, args.seed)
    report(await run_modes(fleets, MODES, zipf, images_for(args.images), args, "zipf"))
    capacity = {"zipf": results[0].throughput_rps}
    if args.no_repeat_requests:
        fresh = no_repeat_workload(args.no_repeat_requests, args.seed)
        report(await run_modes(fleets, pair, fresh, images_for(sum(map(len, fresh))), args, "no-repeat", swap=True))
        capacity["no-repeat"] = results[-2].throughput_rps
    out["capacity_rps"] = capacity  # random placement's, closed loop
    for name, rate_of in (("light", None), ("80%", 0.8)):
        for workload_name, workload_capacity in capacity.items():
            rate = None if rate_of is None else rate_of * workload_capacity
            report(await latency(fleets, pair, workload_name, name, rate, images_for, args))
    hot = hot_workload(args.hot_requests, args.seed + 3)
    report(await run_modes(fleets, pair, hot, images_for(sum(map(len, hot)) + 1), args, "hot image"))


async def shared(fleet, model_dir, stack, log_dir, images_for, args, out: dict) -> None:
    """Several receivers sharing one fleet, without and with the fleet-wide store; an encoder restarted."""
    fleets = [("no store", fleet, FLAGS)]
    if args.store:
        redis = stack.enter_context(running_redis(log_dir))
        flags = (*FLAGS, "--store-url", redis.url)
        fleets.append(("store", stack.enter_context(launch_servers(model_dir, args.encoders, *flags, log_dir=log_dir)), flags))
    out["shared"], out["restart"] = [], []
    for count in args.receivers:
        for label, processes, _ in fleets:
            out["shared"].append(await receivers([p.url for p in processes], count, images_for, args, label))
            print_json(out["shared"][-1], file=sys.stderr)
    for label, processes, flags in fleets:
        out["restart"].append(await restart(processes, flags, model_dir, images_for, args, label))
        print_json(out["restart"][-1], file=sys.stderr)


async def bench(args: argparse.Namespace) -> dict:
    model_dir = ensure_default_model(args.model_dir or tempfile.mkdtemp(prefix="bench-affinity-"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-affinity-logs-"))
    images_for = Images()
    out: dict = {"results": []}
    results = out["results"]

    def report(found: list[ModeResult]) -> None:
        for result in found:
            print_json(asdict(result), file=sys.stderr)
        results.extend(found)

    with contextlib.ExitStack() as stack:
        fleets = {
            mode: stack.enter_context(launch_servers(model_dir, args.encoders, *FLAGS, log_dir=log_dir))
            for mode in (MODES if args.modes else ["affinity"])
        }
        if args.modes:
            await compare_modes(fleets, images_for, args, report, out)
        if args.receivers:
            await shared(fleets["affinity"], model_dir, stack, log_dir, images_for, args, out)
        if args.scenarios:
            extra = stack.enter_context(launch_server(model_dir, *FLAGS, log_dir=log_dir))
            out["membership"] = await membership(fleets["affinity"], extra, images_for, args)
            print_json({"membership": out["membership"]}, file=sys.stderr)
            out["slow"] = await slow_encoder(fleets["affinity"], images_for, args)
            print_json({"slow": out["slow"]}, file=sys.stderr)
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
    p.add_argument("--no-modes", dest="modes", action="store_false", help="skip the random / affinity comparisons")
    p.add_argument(
        "--receivers", type=lambda text: [int(n) for n in text.split(",") if n], default=[3, 8],
        help="receiver counts of the shared-fleet scenario, comma-separated (empty: skip it)",
    )  # fmt: skip
    p.add_argument("--shared-requests", type=int, default=1000, help="requests of each shared-fleet run")
    p.add_argument("--receiver-concurrency", type=int, default=4, help="requests in flight per receiver there")
    p.add_argument("--no-store", dest="store", action="store_false", help="no fleet with the fleet-wide store")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (closed loop)")
    p.add_argument("--round", type=int, default=100, help="requests per mode in one round")
    p.add_argument("--balance", type=float, default=1.25, help="affinity's load bound, x the fleet's median queued work")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model-dir", default=None, help="where the built-in model goes (default: a temporary dir)"
    )
    add_record_flag(p)
    args = p.parse_args()
    load = MachineLoad()
    out = asyncio.run(bench(args))
    out["results"] = [asdict(r) for r in out["results"]]
    figures = {"args": {k: v for k, v in vars(args).items() if k != "record"}, **out}
    print_json(figures, indent=1)
    if args.record:
        print(f"wrote {record_result('affinity', figures, args.record, load=load)}", file=sys.stderr)


if __name__ == "__main__":
    main()
