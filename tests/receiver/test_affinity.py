"""Placement by content and load without processes: rendezvous ranking, the load bound, placement that
depends on content and load alone (so every receiver computes it alike), minimal movement when an encoder
leaves or joins (hypothesis property tests), the receiver's view of the encoders' load, and re-placement
after a failure."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_common.load_report import LoadReport, parse_load
from receiver import FailoverPolicy, ShardError
from receiver.fleet.affinity import HEADROOM_ITEMS, content_key, load_bound, place, ranking
from receiver.fleet.load import FleetLoad
from receiver.fleet.placement import Affinity, RequestPlacement

urls_strategy = st.lists(
    st.integers(1, 65535).map(lambda port: f"grpc://10.0.0.1:{port}"), min_size=1, max_size=8, unique=True
)
keys_strategy = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=48)
balance_strategy = st.floats(1.0, 3.0)
distinct_keys = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=200, unique=True)


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [content_key(rng.randbytes(64)) for _ in range(n)]


loads_strategy = st.lists(st.floats(0.0, 5.0), min_size=8, max_size=8)
cost_strategy = st.floats(0.001, 0.5)


@given(keys_strategy, urls_strategy, balance_strategy, loads_strategy, cost_strategy)
@settings(max_examples=150, deadline=None)
def test_an_item_goes_to_the_first_encoder_of_its_ranking_within_the_load_bound(keys, urls, balance, loads, cost):
    queued = loads[: len(urls)]
    plan = place(keys, urls, balance=balance, queued_s=queued, item_s=cost)
    bound = balance * statistics.median(queued) + HEADROOM_ITEMS * cost
    assert load_bound(queued, cost, balance) == pytest.approx(bound)
    for key, encoder in zip(keys, plan.encoders):
        order = ranking(key, urls)
        assert queued[encoder] <= bound * (1 + 1e-6)
        assert all(queued[e] > bound for e in order[: order.index(encoder)])  # each one ranked above was over it
    assert plan.spilled == sum(encoder != ranking(key, urls)[0] for key, encoder in zip(keys, plan.encoders))


@given(keys_strategy, urls_strategy, balance_strategy, loads_strategy, cost_strategy, st.randoms())
@settings(max_examples=100, deadline=None)
def test_an_item_goes_where_its_content_and_the_load_say_whatever_it_is_sent_with(
    keys, urls, balance, loads, cost, rng
):
    queued = loads[: len(urls)]
    together = place(keys, urls, balance=balance, queued_s=queued, item_s=cost).encoders
    alone = [place([key], urls, balance=balance, queued_s=queued, item_s=cost).encoders[0] for key in keys]
    assert together == alone  # a request's own items never push each other elsewhere
    shuffled = rng.sample(keys, len(keys))
    again = place(shuffled, urls, balance=balance, queued_s=queued, item_s=cost).encoders
    assert {key: e for key, e in zip(shuffled, again)} == {key: e for key, e in zip(keys, together)}


@given(keys_strategy, urls_strategy)
@settings(max_examples=100, deadline=None)
def test_with_no_load_known_every_item_of_a_request_goes_to_its_first_choice_however_many_share_it(keys, urls):
    plan = place(keys, urls)
    assert plan.encoders == [ranking(key, urls)[0] for key in keys] and plan.spilled == 0


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


def same_first_choice(urls: list[str], count: int, seed: int = 3) -> list[bytes]:
    by_top: dict[int, list[bytes]] = {}
    for key in keys_of(400, seed=seed):
        by_top.setdefault(ranking(key, urls)[0], []).append(key)
    return next(keys[:count] for keys in by_top.values() if len(keys) >= count)


def test_items_ranking_one_encoder_first_share_it_on_an_idle_fleet_and_under_an_even_load():
    urls = ["grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1"]
    keys = same_first_choice(urls, 4)
    top = ranking(keys[0], urls)[0]
    for queued in ([0.0] * 4, [2.0] * 4, [0.3, 0.1, 0.0, 0.2]):  # queues' ups and downs stay within the bound
        plan = place(keys, urls, queued_s=queued, item_s=0.1)
        assert plan.encoders == [top] * 4 and plan.spilled == 0, queued


def test_an_encoder_that_falls_behind_gets_no_new_item_until_it_catches_up():
    urls = ["grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1"]
    keys = keys_of(200, seed=5)
    slow = urls.index("grpc://b:1")
    behind = [0.0, 0.5, 0.0, 0.0]  # a slow encoder: its queue, measured at its own pace, drains slowly
    plan = place(keys, urls, queued_s=behind, item_s=0.05)  # bound: 1.25 x 0 + 8 x 0.05 = 0.4 s
    assert slow not in plan.encoders
    first_choices = [key for key in keys if ranking(key, urls)[0] == slow]
    assert plan.spilled == len(first_choices) > 20
    for key, encoder in zip(keys, plan.encoders):  # each to the next of its own ranking: all receivers alike
        if key in first_choices:
            assert encoder == ranking(key, urls)[1]
    caught_up = place(keys, urls, queued_s=[0.0, 0.25, 0.0, 0.0], item_s=0.05)
    assert caught_up.spilled == 0 and caught_up.encoders.count(slow) == len(first_choices)


def test_the_fleet_load_drains_reports_and_counts_what_was_sent_since():
    now = [100.0]
    load = FleetLoad(clock=lambda: now[0])
    assert load.queued_s("grpc://a:1") == 0.0 and load.item_s() == 0.0
    load.report("grpc://a:1", LoadReport(queued_work_s=2.0, item_s=0.1))
    load.report("grpc://b:1", LoadReport(queued_work_s=0.0, item_s=0.3))
    early = load.sending("grpc://a:1", 0.3)  # sent with the report: already in it
    now[0] += 0.5
    later = load.sending("grpc://a:1", 0.4)
    assert load.queued_s("grpc://a:1") == pytest.approx(1.5 + 0.4)
    assert load.item_s() == pytest.approx(0.2)  # the encoders' median
    assert load.item_s("grpc://b:1") == pytest.approx(0.3) and load.item_s("grpc://c:1") == pytest.approx(0.2)
    load.settled("grpc://a:1", later)
    load.settled("grpc://a:1", early)
    now[0] += 5
    assert load.queued_s("grpc://a:1") == 0.0
    load.report("grpc://a:1", LoadReport(queued_work_s=0.0, item_s=0.0))  # no forward measured: keeps the cost
    assert load.item_s() == pytest.approx(0.2)


@pytest.mark.parametrize(
    "metadata, want",
    [
        ((("encoder-load", "1.5 0.02"),), LoadReport(1.5, 0.02)),
        ((("other", "x"), ("encoder-load", b"0 0")), LoadReport(0.0, 0.0)),
        ((("encoder-load", "nan 1"),), None),
        ((("encoder-load", "-1 1"),), None),
        ((("encoder-load", "1"),), None),
        ((), None),
        (None, None),
    ],
)
def test_load_reports_parse_or_are_ignored(metadata, want):
    assert parse_load(metadata) == want
    if want is not None:
        assert parse_load(want.metadata()) == want


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
        "req", keys, 1e12, FailoverPolicy(), affinity=Affinity(keys, balance=1.25, load=FleetLoad())
    )  # no load known: every item on its first choice
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
            "req", keys, 1e12, FailoverPolicy(), num_items_assigned=[2], affinity=Affinity(keys, 1.25, FleetLoad())
        )
