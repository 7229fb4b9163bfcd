"""The forward worker's load as it measures it: seconds per patch and patches per item (moving averages
of the forwards run), the forward-seconds demanded over a window, and what the batcher reports of them
(`BatcherLoad`): the receivers place items by it, the autoscaler reads its saturation."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BatcherLoad:
    """What the forward worker has to do, as it measures it.

    `queued_work_s`: seconds of forwards for the items queued and those in the running forward (their
    patches x the measured seconds per patch). `item_s`: what one more item costs (the mean item's
    patches x seconds per patch). `saturation`: forward-seconds asked of the worker per second over the
    last window (items queued, and items refused as overloaded at `item_s` each), over the one second
    per second one worker has: 1.0 keeps it busy all the time, above 1.0 work comes faster than it goes.
    """

    queued_work_s: float
    item_s: float
    saturation: float



# Weight of the newest forward in the moving averages of seconds per patch and patches per item.
_EWMA_WEIGHT = 0.2


class WorkMeter:
    """Seconds per patch and patches per item, as moving averages of the forwards run; the forward-seconds
    demanded, per window. Not locked itself: the batcher calls it under its lock."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.seconds_per_patch = 0.0  # 0 until the first forward: no cost claimed before it is measured
        self.patches_per_item = 0.0
        self.demanded_s = 0.0  # since start: the counter behind the saturation gauge
        self._demand: deque[tuple[float, float]] = deque()  # (time.monotonic(), forward-seconds asked)

    @property
    def item_s(self) -> float:
        return self.seconds_per_patch * self.patches_per_item

    def forward(self, seconds: float, items: int, patches: int) -> None:
        if patches <= 0 or items <= 0:
            return
        for name, value in (("seconds_per_patch", seconds / patches), ("patches_per_item", patches / items)):
            old = getattr(self, name)
            setattr(self, name, value if old == 0.0 else old + _EWMA_WEIGHT * (value - old))

    def demanded(self, seconds: float) -> None:
        now = time.monotonic()
        self.demanded_s += seconds
        self._demand.append((now, seconds))
        self._forget(now)

    def saturation(self) -> float:
        self._forget(time.monotonic())
        return sum(seconds for _, seconds in self._demand) / self.window_s

    def _forget(self, now: float) -> None:
        while self._demand and self._demand[0][0] < now - self.window_s:
            self._demand.popleft()
