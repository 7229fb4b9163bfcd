"""The shard planner: which encoder gets which contiguous run of a request's items."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    encoder: int  # index into the receiver's encoder list
    items: tuple[int, ...]  # positions in the list of items being sent, contiguous and ascending


def random_counts(num_items: int, num_encoders: int, rng: random.Random) -> list[int]:
    """Per-encoder item counts: shuffle the encoders; the one at shuffled position i gets (i + n) // E.

    The counts differ by at most one and sum to n; which encoders get the larger shares is random.
    """
    order = list(range(num_encoders))
    rng.shuffle(order)
    counts = [0] * num_encoders
    for position, encoder in enumerate(order):
        counts[encoder] = (position + num_items) // num_encoders
    return counts


def plan_shards(
    num_items: int,
    num_encoders: int,
    rng: random.Random,
    num_items_assigned: Sequence[int] | None = None,
) -> list[Shard]:
    """Cuts items 0..n-1 into contiguous shards, one per encoder that gets any, in a random order.

    `num_items_assigned`, when given, fixes the per-encoder counts (in encoder order); it must have
    one non-negative entry per encoder and sum to n.
    """
    if num_encoders < 1:
        raise ValueError("no encoders to shard onto")
    if num_items_assigned is None:
        counts = random_counts(num_items, num_encoders, rng)
        order = list(range(num_encoders))
        rng.shuffle(order)  # which encoder's run comes first in the request
    else:
        counts = [int(c) for c in num_items_assigned]
        if len(counts) != num_encoders or any(c < 0 for c in counts) or sum(counts) != num_items:
            raise ValueError(
                f"num_items_assigned={list(num_items_assigned)} must have {num_encoders} non-negative "
                f"entries summing to {num_items}"
            )
        order = list(range(num_encoders))
    shards: list[Shard] = []
    start = 0
    for encoder in order:
        if counts[encoder]:
            shards.append(Shard(encoder, tuple(range(start, start + counts[encoder]))))
            start += counts[encoder]
    return shards
