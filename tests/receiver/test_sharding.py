"""The shard planner: contiguous runs, counts that differ by at most one, random placement."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from receiver.fleet.sharding import plan_shards, random_counts


@pytest.mark.parametrize("num_items", [0, 1, 2, 5, 7, 64])
@pytest.mark.parametrize("num_encoders", [1, 2, 3, 8])
def test_shards_cover_every_item_once_in_contiguous_runs(num_items, num_encoders):
    for seed in range(20):
        shards = plan_shards(num_items, num_encoders, random.Random(seed))
        covered = [i for shard in shards for i in shard.items]
        assert sorted(covered) == list(range(num_items))
        for shard in shards:
            assert list(shard.items) == list(range(shard.items[0], shard.items[-1] + 1))
        assert len({shard.encoder for shard in shards}) == len(shards)
        sizes = [len(shard.items) for shard in shards]
        assert all(sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
        assert len(shards) == min(num_items, num_encoders)


def test_counts_follow_the_shuffled_position_rule():
    for n in range(10):
        for e in range(1, 5):
            counts = random_counts(n, e, random.Random(n * 10 + e))
            assert sum(counts) == n
            assert sorted(counts) == sorted((i + n) // e for i in range(e))


def test_which_encoder_gets_an_odd_item_is_random():
    firsts = Counter(plan_shards(1, 3, random.Random(seed))[0].encoder for seed in range(300))
    assert set(firsts) == {0, 1, 2} and min(firsts.values()) > 60


def test_caller_counts_are_used_in_encoder_order_and_validated():
    shards = plan_shards(5, 3, random.Random(0), num_items_assigned=[2, 0, 3])
    assert [(s.encoder, s.items) for s in shards] == [(0, (0, 1)), (2, (2, 3, 4))]
    for bad in ([2, 2], [2, 2, 2], [6, -1, 0]):
        with pytest.raises(ValueError, match="must have 3 non-negative entries summing to 5"):
            plan_shards(5, 3, random.Random(0), num_items_assigned=bad)


def test_seeded_plans_repeat():
    plan = lambda: plan_shards(7, 3, random.Random(42))  # noqa: E731
    assert plan() == plan()
