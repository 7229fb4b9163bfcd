"""The scenarios of several receivers (prefill nodes) sharing one fleet: each receiver sends its own share
of one Zipf workload at once (`receivers`), and the same with one encoder killed and restarted with an
empty cache half-way (`restart`), where the fleet-wide store is what keeps the restarted encoder warm."""

from __future__ import annotations

import asyncio

from testkit.bench_harness import median, percentile
from testkit.launcher import server_argv, start_process

from .modes import ModeRun
from .workloads import zipf_workload


def _runs(urls: list[str], count: int, args) -> list[ModeRun]:
    return [ModeRun("affinity", [urls], args.balance) for _ in range(count)]


async def _send(runs: list[ModeRun], requests: list[tuple[int, list[int]]], images: list[bytes], args) -> None:
    """The requests dealt round-robin to the receivers, all of them sending at once."""
    shares = [requests[i :: len(runs)] for i in range(len(runs))]
    await asyncio.gather(
        *(run.closed_loop(share, images, args.receiver_concurrency) for run, share in zip(runs, shares))
    )


def _forwards(runs: list[ModeRun]) -> int:
    return sum(run.forwards for run in runs)


async def receivers(urls: list[str], count: int, images_for, args, label: str) -> dict:
    """`count` receivers over the fleet of `urls`, one Zipf workload shared among them."""
    workload = zipf_workload(args.shared_requests, args.images, args.zipf, args.seed + 13)
    images = images_for(args.images)
    runs = _runs(urls, count, args)
    try:
        await _send(runs, list(enumerate(workload)), images, args)
        latencies = [s for run in runs for s in run.latencies]
        distinct = len({i for picks in workload for i in picks})
        spilled = sum(rx.metrics.snapshot()["placements"].get("spilled", 0) for run in runs for rx in run.receivers)
        return {
            "fleet": label,
            "receivers": count,
            "requests": len(workload),
            "distinct_images": distinct,
            "forwards": _forwards(runs),
            "x_distinct": round(_forwards(runs) / distinct, 3),
            "spilled": spilled,
            "throughput_rps": round(len(workload) / max(run.wall for run in runs), 1),
            "p50_ms": round(median(latencies) * 1000, 1),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        }
    finally:
        for run in runs:
            await run.close()


async def restart(fleet, flags: tuple[str, ...], model_dir, images_for, args, label: str) -> dict:
    """Three receivers share the fleet (started with `flags`); half-way through the workload one encoder
    is killed and started again on its port, with an empty cache. Counts the forwards of the second half
    against the images it has that the first half had not."""
    workload = zipf_workload(args.shared_requests, args.images, args.zipf, args.seed + 17)
    images = images_for(args.images)
    runs = _runs([p.url for p in fleet], 3, args)
    half = len(workload) // 2
    numbered = list(enumerate(workload))
    try:
        await _send(runs, numbered[:half], images, args)
        before = _forwards(runs)
        victim = fleet[-1]
        victim.stop()  # SIGKILL
        argv = server_argv(model_dir, *flags, "--port", str(victim.port))
        restarted = await asyncio.to_thread(start_process, argv, victim.log_path.with_suffix(".restarted.log"))
        victim.process, victim.log_path = restarted.process, restarted.log_path  # stopped with the fleet
        await _send(runs, numbered[half:], images, args)
        seen = {i for picks in workload[:half] for i in picks}
        new = {i for picks in workload[half:] for i in picks} - seen
        after = _forwards(runs) - before
        return {
            "fleet": label,
            "receivers": 3,
            "requests": len(workload),
            "forwards_before": before,
            "new_images_after": len(new),
            "forwards_after": after,
            "x_new": round(after / max(1, len(new)), 3),
        }
    finally:
        for run in runs:
            await run.close()
