"""Closed-loop clients of the serving sections (requests run with a number of them in flight, measured
in items per second of wall time) and the images/s figures they report against their baseline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from testkit.bench_harness import paired_ratio, summary, timed

Call = Callable[[], Awaitable[int]]  # one request; returns how many items it carried


def encode_call(receiver, request_id: str, images: Sequence[bytes]) -> Call:
    async def call() -> int:
        result = await receiver.encode(request_id, [{"modality": "image", "data": d} for d in images])
        return len(result.items)

    return call


async def closed_loop(clients: int, requests: Sequence[Call]) -> float:
    """Runs the requests with `clients` in flight at a time; returns items per second."""
    queue = list(reversed(requests))
    return await concurrent_clients([queue] * clients)


async def concurrent_clients(per_client: Sequence[list[Call]]) -> float:
    """Each client pops and runs requests from its list, one at a time, all clients at once.

    Lists may be shared. Returns the items of all requests per second of wall time.
    """
    done: list[int] = []

    async def client(requests: list[Call]) -> None:
        while requests:
            done.append(await requests.pop()())

    seconds = await timed(lambda: asyncio.gather(*(client(requests) for requests in per_client)))
    return sum(done) / seconds


def rates(runs: dict[str, list[float]], ours: str, baseline: str) -> dict:
    """Images/s of both sides and their paired ratio, keyed `<side>_images_per_s` and `ratio`."""
    return {
        f"{ours}_images_per_s": summary(runs[ours]),
        f"{baseline}_images_per_s": summary(runs[baseline]),
        "ratio": paired_ratio(runs[ours], runs[baseline]),
    }
