"""The scenario of several prefill nodes sharing one fleet: how often the fleet encodes each distinct image
when 1, 2 or 4 receivers split the same Zipf workload between them, under each placement."""

from __future__ import annotations

import asyncio

from .modes import ModeRun
from .workloads import zipf_workload


async def receivers_sharing(fleets, images_for, args) -> list[dict]:
    """Per receiver count and mode: the workload split round-robin over that many receivers (each its own
    `EncoderReceiver`, as separate prefill nodes are), run at once, on fresh images of the mode's fleet."""
    workload = zipf_workload(args.receivers_requests, args.images, args.zipf, args.seed + 13)
    numbered = list(enumerate(workload))
    out = []
    for count in args.receiver_counts:
        for mode in ("random", "affinity"):
            images = images_for(args.images)  # new bytes: nothing cached from an earlier phase
            urls = [p.url for p in fleets[mode]]
            runs = [ModeRun(mode, [urls], args.balance, seed=i) for i in range(count)]
            try:
                await asyncio.gather(
                    *(
                        run.closed_loop(numbered[i::count], images, max(1, args.concurrency // count))
                        for i, run in enumerate(runs)
                    )
                )
            finally:
                for run in runs:
                    await run.close()
            forwards = sum(run.forwards for run in runs)
            distinct = len({image for picks in workload for image in picks})
            out.append({
                "receivers": count,
                "mode": mode,
                "requests": len(workload),
                "distinct_images": distinct,
                "forwards": forwards,
                "forwards_per_distinct_image": round(forwards / distinct, 3),
            })  # fmt: skip
    return out
