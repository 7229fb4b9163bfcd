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
- receivers: 1, 2 and 4 receivers (prefill nodes) splitting one Zipf workload over a fleet: forwards per
  distinct image, random against affinity.

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
from bench_affinity_scenarios.receivers import receivers_sharing
from bench_affinity_scenarios.workloads import (
    Images,
    hot_workload,
    no_repeat_workload,
    zipf_workload,
)

from testkit.bench_harness import MachineLoad, add_record_flag, print_json, record_result
from testkit.default_model import ensure_default_model
from testkit.launcher import launch_server, launch_servers

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
                rate = None if rate_of is None else rate_of * workload_capacity
                report(await latency(fleets, pair, workload_name, name, rate, images_for, args))
        hot = hot_workload(args.hot_requests, args.seed + 3)
        report(await run_modes(fleets, pair, hot, images_for(sum(map(len, hot)) + 1), args, "hot image"))
        if args.scenarios:
            extra = stack.enter_context(launch_server(model_dir, *FLAGS, log_dir=log_dir))
            out["membership"] = await membership(fleets["affinity"], extra, images_for, args)
            print_json({"membership": out["membership"]}, file=sys.stderr)
            out["slow"] = await slow_encoder(fleets["affinity"], images_for, args)
            print_json({"slow": out["slow"]}, file=sys.stderr)
            out["receivers"] = await receivers_sharing(fleets, images_for, args)
            print_json({"receivers": out["receivers"]}, file=sys.stderr)
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
    p.add_argument("--receivers-requests", type=int, default=600, help="requests of each receivers phase")
    p.add_argument("--receiver-counts", type=lambda s: [int(n) for n in s.split(",")], default=[1, 2, 4],
                   help="receivers sharing the fleet, comma-separated")  # fmt: skip
    p.add_argument(
        "--no-scenarios", dest="scenarios", action="store_false", help="skip membership, slow and receivers"
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (closed loop)")
    p.add_argument("--round", type=int, default=100, help="requests per mode in one round")
    p.add_argument("--balance", type=float, default=1.25, help="affinity's load bound, x the soonest finish")
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
