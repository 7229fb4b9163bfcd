"""Content-affinity placement: each item goes to the encoder that ranks first for its content key under
rendezvous (highest random weight) hashing, within a bounded load; pure functions, no I/O.

Rendezvous hashing scores every (key, encoder) pair and ranks encoders by score, so when an encoder
joins or leaves only the keys it ranks first for move. The balance bound caps what one encoder may
take of a request's items at ceil(balance x mean); an item that does not fit spills to the next
encoder of its own ranking, so a popular image still lands on the same few encoders.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from .config import DEFAULT_BALANCE

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


def request_cap(num_items: int, num_encoders: int, balance: float) -> int:
    """The most items of one request an encoder may take: ceil(balance x mean), at least one."""
    return max(1, math.ceil(balance * num_items / num_encoders))


@dataclass(slots=True)
class _Placed:
    urls: set[str]  # the encoders it was sent to
    times: int = 0  # how often it was placed


class PlacementMemory:
    """The encoders each key was sent to lately, and how often it was placed (an LRU of keys): an item
    that must spill goes to one that already encoded it, so the balance bound costs no forward where it
    can be helped."""

    def __init__(self, max_keys: int = DEFAULT_MEMORY_KEYS):
        self.max_keys = max_keys
        self._placed: OrderedDict[bytes, _Placed] = OrderedDict()

    def holders(self, key: bytes) -> set[str]:
        entry = self._placed.get(key)
        return entry.urls if entry else set()

    def times_placed(self, key: bytes) -> int:
        entry = self._placed.get(key)
        return entry.times if entry else 0

    def sent(self, key: bytes, url: str) -> None:
        entry = self._placed.setdefault(key, _Placed(set()))
        entry.urls.add(url)
        entry.times += 1
        self._placed.move_to_end(key)
        if len(self._placed) > self.max_keys:
            self._placed.popitem(last=False)


@dataclass(frozen=True)
class AffinityPlan:
    """Where each item goes (a position in the encoder list, per item) and how many did not get their
    first-ranked encoder because of the balance bound."""

    encoders: list[int]
    spilled: int


def place(
    keys: Sequence[bytes],
    urls: Sequence[str],
    *,
    balance: float = DEFAULT_BALANCE,
    in_flight: Mapping[str, int] | None = None,
    memory: PlacementMemory | None = None,
) -> AffinityPlan:
    """Places items (by content key) on `urls`; each goes to the first encoder of its ranking with room.

    Hard bound: no encoder takes more than `request_cap` of these items. Soft bound, across requests:
    an encoder whose items in flight (`in_flight`, by URL) plus these would pass ceil(balance x the
    fleet's mean) is passed over while another in the item's ranking has room under both bounds.
    With a `memory`, items that already went to encoders with room are placed first, on the best
    ranked of those: when two items rank the same encoder first, the one that loses it goes where it
    was encoded before rather than forcing a new forward. Where neither was, the one placed more often
    loses it: a popular image keeps meeting others on its encoder, and once it has a second holder it
    absorbs those meetings, while a rarer one keeps a single copy. The memory learns this plan.
    """
    if not urls:
        raise ValueError("no encoders to place items on")
    if balance < 1.0:
        raise ValueError(f"balance must be at least 1.0, got {balance}")
    busy = [(in_flight or {}).get(url, 0) for url in urls]
    cap = request_cap(len(keys), len(urls), balance)
    fleet_cap = math.ceil(balance * (len(keys) + sum(busy)) / len(urls))
    taken = [0] * len(urls)
    orders = [ranking(key, urls) for key in keys]
    chosen: list[int | None] = [None] * len(keys)

    def take(item: int, candidates: list[int]) -> None:
        fits = [e for e in candidates if taken[e] < cap]
        roomy = [e for e in fits if busy[e] + taken[e] < fleet_cap]
        if fits:
            chosen[item] = (roomy or fits)[0]
            taken[chosen[item]] += 1

    if memory is not None:
        known = [[e for e in order if urls[e] in memory.holders(key)] for key, order in zip(keys, orders)]
        choice = {i: (len(known[i]), memory.times_placed(keys[i])) for i in range(len(keys)) if known[i]}
        for item in sorted(choice, key=choice.__getitem__):
            take(item, known[item])  # fewest known encoders first: they have the least choice
    for item in range(len(keys)):
        if chosen[item] is None:
            take(item, orders[item])  # never finds no room: cap x encoders >= items
    if memory is not None:
        for key, encoder in zip(keys, chosen):
            memory.sent(key, urls[encoder])
    spilled = sum(encoder != order[0] for encoder, order in zip(chosen, orders))
    return AffinityPlan(chosen, spilled)
