"""Placement by content and load, the same in every receiver: each item goes to the encoder that ranks
first for its content key under rendezvous hashing, unless that encoder's reported queue is over the load
bound (then to the next of the key's own ranking); pure functions, no I/O."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..config import DEFAULT_BALANCE

# Queued items' worth of work an encoder may have beyond `balance` x the fleet's median before new items
# pass it over.
HEADROOM_ITEMS = 8.0


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


# The bound is on work, in seconds, as the encoders measure it (receiver.fleet.load): an encoder whose
# queued seconds pass `balance` x the fleet's median plus HEADROOM_ITEMS items' worth is passed over.
# Coarse on purpose: the queues' ups and downs under an even load, and the small differences between
# receivers' views of the load, stay within it, so keys move only off an encoder that falls behind (slow,
# saturated, stopped). Medians, so that the encoder falling behind does not widen the bound it is held to.
def load_bound(queued_s: Sequence[float], item_s: float, balance: float = DEFAULT_BALANCE) -> float:
    """The most queued seconds an encoder may have and still take new items: `balance` x the fleet's
    median, plus HEADROOM_ITEMS items of `item_s` seconds. The least loaded encoder is always within it."""
    if balance < 1.0:
        raise ValueError(f"balance must be at least 1.0, got {balance}")
    return balance * statistics.median(queued_s) + HEADROOM_ITEMS * item_s


@dataclass(frozen=True)
class AffinityPlan:
    """Where each item goes (a position in the encoder list, per item), and how many items are not on
    their first-ranked encoder."""

    encoders: list[int]
    spilled: int


def place(
    keys: Sequence[bytes],
    urls: Sequence[str],
    *,
    balance: float = DEFAULT_BALANCE,
    queued_s: Sequence[float] | None = None,
    item_s: float = 0.0,
) -> AffinityPlan:
    """Places items (by content key) on `urls`, given each encoder's queued seconds of work (0 when
    unknown; a slow encoder measures its queue at its own pace) and the seconds one item costs at the
    fleet's median pace (0 when unknown).

    Each item goes to the first encoder of its ranking whose queued seconds are within `load_bound`.
    The items of one call do not count against each other: a request's images that rank one encoder
    first go there together (one batch), as they would in any other request, so an image lands on the
    same encoder whatever it is sent with, and the same image twice in a request goes to one encoder.
    """
    if not urls:
        raise ValueError("no encoders to place items on")
    work = list(queued_s) if queued_s is not None else [0.0] * len(urls)
    bound = load_bound(work, item_s, balance) * (1 + 1e-9)
    within = [seconds <= bound for seconds in work]
    chosen: list[int] = []
    spilled = 0
    for key in keys:
        order = ranking(key, urls)
        encoder = next(e for e in order if within[e])
        chosen.append(encoder)
        spilled += encoder != order[0]
    return AffinityPlan(chosen, spilled)
