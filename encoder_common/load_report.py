"""The load report an encoder puts in the trailing metadata of its calls (Encode, Fetch, health Check),
and its parsing on the receiver: the seconds of forward work it has queued and what one more item costs."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Text metadata, so grpcurl shows it: "queued_work_s item_s", both in seconds.
LOAD_KEY = "encoder-load"


@dataclass(frozen=True)
class LoadReport:
    queued_work_s: float  # forwards queued or running, as the encoder measures them
    item_s: float  # what the encoder's forward of one more (mean) item costs

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((LOAD_KEY, f"{self.queued_work_s:.6f} {self.item_s:.6f}"),)


def parse_load(metadata: Iterable[tuple[str, str | bytes]] | None) -> LoadReport | None:
    """The report in a call's trailing metadata; None when it has none or a malformed one (an older
    server, a proxy that strips it): the receiver then keeps its own estimate."""
    for key, value in metadata or ():
        if key != LOAD_KEY:
            continue
        try:
            queued_s, item_s = (
                float(x) for x in (value.decode() if isinstance(value, bytes) else value).split()
            )
        except (ValueError, UnicodeDecodeError):
            return None
        if not all(math.isfinite(x) and x >= 0 for x in (queued_s, item_s)):
            return None
        return LoadReport(queued_s, item_s)
    return None
