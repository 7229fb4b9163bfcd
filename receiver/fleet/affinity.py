"""Placement by content and load: each item goes to the encoder that ranks first for its content key
under rendezvous (highest random weight) hashing, unless that encoder is over a load bound; pure
functions, no I/O.

Rendezvous hashing scores every (key, encoder) pair and ranks encoders by score, so when an encoder
joins or leaves only the keys it ranks first for move. The load bound is on work, in seconds, as the
encoders measure it (`receiver.fleet.load`): a new item passes over an encoder where it would finish later
than `balance` x the soonest it could finish on any encoder, and goes to the next one of its own
ranking within that bound. An item this receiver sent before goes back where it went: that encoder
holds its embedding, which costs no forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..config import DEFAULT_BALANCE

# Keys whose encoders the receiver remembers: ~100 bytes each, so about 10 MB at most.
DEFAULT_MEMORY_KEYS = 100_000


def content_key(data: bytes) -> bytes:
    """An image's content key: xxh3-128 of its encoded bytes (~10 us for a 465 KB JPEG).

    The server's cache keys on the sha256 of the same bytes (under the model's namespace), so both sides
    mean the same thing by "the same image": the same bytes."""
    return xxhash.xxh3_128_digest(data)


def _encoder_seed(url: str) -> int:
    return xxhash.xxh3_64_intdigest(url.encode())


def ranking(key: bytes, urls: Sequence[str]) -> list[int]:
    """Positions in `urls`, best first, for `key`: by each encoder's rendezvous score for the key."""
    scores = [xxhash.xxh3_64_intdigest(key, seed=_encoder_seed(url)) for url in urls]
    return sorted(range(len(urls)), key=lambda i: (-scores[i], urls[i]))


class PlacementMemory:
    """The encoders each key was sent to lately (an LRU of keys): an item sent again goes to one that
    already encoded it, so a spill for load costs a forward only once."""

    def __init__(self, max_keys: int = DEFAULT_MEMORY_KEYS):
        self.max_keys = max_keys
        self._placed: OrderedDict[bytes, set[str]] = OrderedDict()

    def holders(self, key: bytes) -> set[str]:
        return self._placed.get(key, set())

    def sent(self, key: bytes, url: str) -> None:
        self._placed.setdefault(key, set()).add(url)
        self._placed.move_to_end(key)
        if len(self._placed) > self.max_keys:
            self._placed.popitem(last=False)


@dataclass(frozen=True)
class AffinityPlan:
    """Where each item goes (a position in the encoder list, per item), the forward-seconds each new item
    is expected to cost there (0 for an item sent there before), and how many items are not on their
    first-ranked encoder."""

    encoders: list[int]
    costs: list[float]
    spilled: int


def place(
    keys: Sequence[bytes],
    urls: Sequence[str],
    *,
    balance: float = DEFAULT_BALANCE,
    queued_s: Sequence[float] | None = None,
    item_s: float = 0.0,
    memory: PlacementMemory | None = None,
) -> AffinityPlan:
    """Places items (by content key) on `urls`, given each encoder's queued seconds of work (0 when
    unknown) and the seconds one item costs (the fleet's mean; 0 when unknown: then every new item goes
    to its first choice). One cost for all encoders: at rest they are alike, and a slow encoder shows
    in its queued seconds, which it measures at its own speed.

    An item `memory` knows goes to the best ranked encoder it was sent to: a cache hit there. A new item
    goes to the first encoder of its ranking where it would finish (queued seconds + its cost, counting
    the items placed before it in this call) within `balance` x the soonest it could finish anywhere.
    There is no cap on how many items of one request share an encoder. The memory learns this plan.
    """
    if not urls:
        raise ValueError("no encoders to place items on")
    if balance < 1.0:
        raise ValueError(f"balance must be at least 1.0, got {balance}")
    work = list(queued_s) if queued_s is not None else [0.0] * len(urls)
    chosen: list[int] = []
    costs: list[float] = []
    spilled = 0
    for key in keys:
        order = ranking(key, urls)
        holders = memory.holders(key) if memory is not None else set()
        held = [e for e in order if urls[e] in holders]
        if held:
            encoder, seconds = held[0], 0.0
        else:
            bound = balance * (min(work) + item_s) * (1 + 1e-9)  # the soonest one is always within it
            encoder = next(e for e in order if work[e] + item_s <= bound)
            seconds = item_s
            work[encoder] += seconds
        chosen.append(encoder)
        costs.append(seconds)
        spilled += encoder != order[0]
        if memory is not None:  # at once: the same image twice in a request goes to one encoder
            memory.sent(key, urls[encoder])
    return AffinityPlan(chosen, costs, spilled)
