"""What a receiver believes of each encoder's load, for placement by content and load: the last report
the encoder sent (trailing metadata of a call or a health probe, `encoder_common.load_report`), drained
at one second per second since, plus the work this receiver sent it after that report that has not
come back yet. Every receiver hears the same reports, so all of them see the fleet alike."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from encoder_common.load_report import LoadReport


@dataclass
class _EncoderLoad:
    reported_s: float = 0.0  # queued work the encoder last reported
    reported_at: float = float("-inf")  # when that report arrived
    item_s: float | None = None  # one item's cost, as the encoder measured it; None until it reports one
    sent: dict[int, tuple[float, float]] = field(default_factory=dict)  # shard -> (when sent, its seconds)


class FleetLoad:
    """Encoders' load by URL; updated from the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._encoders: dict[str, _EncoderLoad] = {}
        self._shards = itertools.count()

    def _of(self, url: str) -> _EncoderLoad:
        load = self._encoders.get(url)
        if load is None:
            load = self._encoders[url] = _EncoderLoad()
        return load

    def report(self, url: str, report: LoadReport) -> None:
        load = self._of(url)
        load.reported_s, load.reported_at = report.queued_work_s, self._clock()
        if report.item_s > 0:  # 0: the encoder has run no forward yet, so it knows no cost
            load.item_s = report.item_s

    def item_s(self, url: str | None = None) -> float:
        """One item's cost: what `url` measured, else the median of what the encoders measured (one
        model, so one cost at rest, which a slow encoder does not shift), else 0. An encoder that is slow
        measures its own items as slow, so the work sent to it since its last report counts at its pace."""
        own = self._encoders.get(url) if url is not None else None
        if own is not None and own.item_s is not None:
            return own.item_s
        known = [load.item_s for load in self._encoders.values() if load.item_s is not None]
        return statistics.median(known) if known else 0.0

    def queued_s(self, url: str) -> float:
        """Seconds of work `url` has queued, as far as this receiver can tell now."""
        load = self._of(url)
        now = self._clock()
        drained = max(0.0, load.reported_s - (now - load.reported_at))
        return drained + sum(seconds for sent_at, seconds in load.sent.values() if sent_at > load.reported_at)

    def queued(self, urls: Sequence[str]) -> list[float]:
        """Queued seconds, per URL of `urls`."""
        return [self.queued_s(url) for url in urls]

    def sending(self, url: str, seconds: float) -> int:
        """Counts a shard of `seconds` of work sent to `url` until `settled(url, shard)`; returns its id."""
        shard = next(self._shards)
        self._of(url).sent[shard] = (self._clock(), seconds)
        return shard

    def settled(self, url: str, shard: int) -> None:
        self._of(url).sent.pop(shard, None)
