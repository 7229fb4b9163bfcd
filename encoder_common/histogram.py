"""A histogram kept as plain numbers, for counters updated on a hot path and exported to Prometheus
only when scraped (the server's per-call tally, the receiver's request latency)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence


class PlainHistogram:
    """Buckets and a sum; `observe` takes no lock, so callers observe from one thread, or under their own."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts by upper bound, as Prometheus's exposition format has them."""
        return list(zip([*map(str, self.bounds), "+Inf"], itertools.accumulate(list(self.counts))))
