"""Affinity placement without processes: rendezvous ranking, the balance bound, spill order, minimal
movement when an encoder leaves or joins (hypothesis property tests), and re-placement after a failure."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from receiver import FailoverPolicy, ShardError
from receiver.affinity import PlacementMemory, content_key, place, ranking, request_cap
from receiver.placement import Affinity, RequestPlacement

urls_strategy = st.lists(
    st.integers(1, 65535).map(lambda port: f"grpc://10.0.0.1:{port}"), min_size=1, max_size=8, unique=True
)
keys_strategy = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=48)
balance_strategy = st.floats(1.0, 3.0)
distinct_keys = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=200, unique=True)


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [content_key(rng.randbytes(64)) for _ in range(n)]


@given(keys_strategy, urls_strategy, balance_strategy, st.data())
@settings(max_examples=150, deadline=None)
def test_no_encoder_takes_more_than_ceil_balance_times_the_mean_of_a_request(keys, urls, balance, data):
    in_flight = {url: data.draw(st.integers(0, 50)) for url in urls}
    memory = PlacementMemory()
    for key in keys:  # where some keys went before
        for url in data.draw(st.lists(st.sampled_from(urls), max_size=2)):
            memory.sent(key, url)
    plan = place(keys, urls, balance=balance, in_flight=in_flight, memory=memory)
    counts = Counter(plan.encoders)
    assert len(plan.encoders) == len(keys) and set(counts) <= set(range(len(urls)))
    assert max(counts.values()) <= request_cap(len(keys), len(urls), balance)


@given(keys_strategy, urls_strategy, balance_strategy)
@settings(max_examples=150, deadline=None)
def test_an_item_goes_to_the_first_encoder_of_its_own_ranking_that_has_room(keys, urls, balance):
    plan = place(keys, urls, balance=balance)
    cap = request_cap(len(keys), len(urls), balance)
    taken = Counter()
    for key, encoder in zip(keys, plan.encoders):
        order = ranking(key, urls)
        passed_over = order[: order.index(encoder)]
        assert all(taken[e] == cap for e in passed_over)  # each one ranked above it was full
        taken[encoder] += 1
    assert plan.spilled == sum(encoder != ranking(key, urls)[0] for key, encoder in zip(keys, plan.encoders))


@given(distinct_keys, urls_strategy, st.data())
@settings(max_examples=150, deadline=None)
def test_an_encoder_leaving_moves_only_the_keys_it_ranked_first_for(keys, urls, data):
    gone = data.draw(st.sampled_from(urls))
    left = [url for url in urls if url != gone]
    if not left:
        return
    for key in keys:
        before = urls[ranking(key, urls)[0]]
        after = left[ranking(key, left)[0]]
        assert after == before or before == gone
        if before == gone:  # it moves to its second choice
            assert after == urls[ranking(key, urls)[1]]


@given(distinct_keys, urls_strategy)
@settings(max_examples=150, deadline=None)
def test_an_encoder_joining_takes_keys_only_for_itself_and_order_of_urls_does_not_matter(keys, urls):
    joined = [*urls, "grpc://10.0.0.2:1"]
    shuffled = random.Random(len(keys)).sample(urls, len(urls))
    for key in keys:
        before = urls[ranking(key, urls)[0]]
        assert joined[ranking(key, joined)[0]] in (before, "grpc://10.0.0.2:1")
        assert shuffled[ranking(key, shuffled)[0]] == before


def test_the_removed_encoders_keys_spread_over_the_other_four():
    urls = [f"grpc://127.0.0.1:{5000 + i}" for i in range(5)]
    keys = keys_of(5000)
    moved = Counter(urls[ranking(k, urls[1:])[0] + 1] for k in keys if ranking(k, urls)[0] == 0)
    assert set(moved) == set(urls[1:])
    assert min(moved.values()) > 0.15 * sum(moved.values())  # about a quarter each


def test_in_flight_items_steer_a_request_away_from_a_busy_encoder_within_its_ranking():
    urls = ["grpc://a:1", "grpc://b:1", "grpc://c:1"]
    keys = keys_of(30, seed=1)
    idle = place(keys, urls)
    busy_url = urls[Counter(idle.encoders).most_common(1)[0][0]]
    steered = place(keys, urls, in_flight={busy_url: 100})
    assert Counter(steered.encoders)[urls.index(busy_url)] < Counter(idle.encoders)[urls.index(busy_url)]
    assert steered.spilled > idle.spilled


def test_an_item_that_must_spill_goes_where_it_was_encoded_before():
    urls = ["grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1"]
    keys = keys_of(400, seed=3)
    # Two keys with the same first choice, in a 2-item request: one of them must spill (cap 1).
    by_top: dict[int, list[bytes]] = {}
    for key in keys:
        by_top.setdefault(ranking(key, urls)[0], []).append(key)
    first, second = next(pair[:2] for pair in by_top.values() if len(pair) >= 2)
    memory = PlacementMemory()
    plan = place([first, second], urls, memory=memory)
    assert plan.spilled == 1 and len(set(plan.encoders)) == 2
    again = place([second, first], urls, memory=memory)  # the other order: same encoders as before
    assert dict(zip([second, first], again.encoders)) == dict(zip([first, second], plan.encoders))


def test_of_two_items_known_only_on_the_same_encoder_the_more_often_placed_one_spills():
    urls = ["grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1"]
    by_top: dict[int, list[bytes]] = {}
    for key in keys_of(400, seed=4):
        by_top.setdefault(ranking(key, urls)[0], []).append(key)
    top, (rare, popular) = next((e, keys[:2]) for e, keys in by_top.items() if len(keys) >= 2)
    memory = PlacementMemory()
    for times, key in ((1, rare), (5, popular)):
        for _ in range(times):
            assert place([key], urls, memory=memory).encoders == [top]
    for request in ([popular, rare], [rare, popular]):  # either order
        plan = place(request, urls, memory=memory)
        placed = dict(zip(request, plan.encoders))
        assert placed[rare] == top and placed[popular] == ranking(popular, urls)[1]
    assert memory.holders(rare) == {urls[top]} and len(memory.holders(popular)) == 2


def test_balance_below_one_is_refused():
    with pytest.raises(ValueError, match="balance"):
        place(keys_of(2), ["grpc://a:1"], balance=0.9)


@dataclass(frozen=True)
class Encoder:
    url: str


def test_a_failed_encoders_items_are_re_placed_on_the_next_encoder_of_their_ranking():
    encoders = [Encoder(f"grpc://e{i}:1") for i in range(4)]
    urls = [e.url for e in encoders]
    keys = dict(enumerate(keys_of(8, seed=2)))
    state = RequestPlacement(
        "req", keys, 1e12, FailoverPolicy(), affinity=Affinity(keys, balance=8.0, in_flight=Counter())
    )  # a loose balance: every item on its first choice
    first = {e.url: items for e, items in state.plan(encoders, 4, random.Random(0))}
    assert all(urls[ranking(keys[i], urls)[0]] == url for url, items in first.items() for i in items)
    victim, items = next(iter(first.items()))
    unavailable = grpc.StatusCode.UNAVAILABLE
    state.shard_failed(
        ShardError(encoder_url=victim, request_id="req", item_indices=items, code=unavailable, message="x")
    )
    survivors = [e for e in encoders if e.url != victim]
    again = {e.url: moved for e, moved in state.plan(survivors, 4, random.Random(0))}
    for url, moved in again.items():
        for i in moved:
            assert ranking(keys[i], urls)[:2] == [urls.index(victim), urls.index(url)]
    assert sorted(i for moved in again.values() for i in moved) == sorted(items)
    assert +state.placed == {"affinity": 8 + len(items), "re_placed": len(items)}


def test_affinity_refuses_fixed_counts():
    keys = dict(enumerate(keys_of(2)))
    with pytest.raises(ValueError, match="num_items_assigned"):
        RequestPlacement(
            "req", keys, 1e12, FailoverPolicy(), num_items_assigned=[2], affinity=Affinity(keys, 1.25, {})
        )
