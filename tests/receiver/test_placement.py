"""The failover state machine of one request, driven directly: no processes, no sockets, a fake clock."""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc
import pytest
import torch

from encoder_common.errors import Failover
from receiver import EncodeFailedError, FailoverPolicy, ItemResult, ShardError
from receiver.fleet.health import backoff_s
from receiver.fleet.placement import RequestPlacement

A, B, C = "grpc://a:1", "grpc://b:1", "grpc://c:1"


@dataclass(frozen=True)
class Encoder:
    url: str


ENCODERS = [Encoder(A), Encoder(B), Encoder(C)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def placement(items=range(6), *, deadline=130.0, clock=None, assigned=None, **policy) -> RequestPlacement:
    return RequestPlacement(
        "req",
        items,
        deadline,
        FailoverPolicy(**policy),
        num_items_assigned=assigned,
        clock=clock or Clock(),
        jitter=random.Random(0),
    )


def arrived(state: RequestPlacement, index: int, url: str) -> None:
    state.item_arrived(ItemResult(index, torch.zeros(1, 2), (), url))


def failed(url: str, items, code=grpc.StatusCode.UNAVAILABLE, message="boom") -> ShardError:
    return ShardError(encoder_url=url, request_id="req", item_indices=items, code=code, message=message)


def test_a_failed_shard_re_plans_only_its_unfinished_items_onto_the_other_encoders():
    state = placement(assigned=[2, 2, 2])
    shards = state.plan(ENCODERS, 3, random.Random(0))
    assert {e.url: items for e, items in shards} == {A: [0, 1], B: [2, 3], C: [4, 5]}
    assert state.pending == []
    for index, url in [(0, A), (2, B), (3, B), (4, C), (5, C)]:
        arrived(state, index, url)

    retry = state.shard_failed(failed(A, [1]))
    assert retry.failover is Failover.REPLACE and retry.item_indices == [1]
    assert state.benched == {A} and state.pending == [1]
    usable = [e for e in ENCODERS if e.url not in state.benched]
    ((encoder, items),) = state.plan(usable, 3, random.Random(0))  # the fixed counts no longer apply
    assert encoder.url in {B, C} and items == [1]
    assert [a.status for a in state.attempts[1]] == ["UNAVAILABLE"]
    assert [a.status for a in state.attempts[0]] == ["OK"]


@pytest.mark.parametrize(
    "code, message, expected",
    [
        (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", grpc.StatusCode.UNAUTHENTICATED),
        (grpc.StatusCode.PERMISSION_DENIED, "not allowed", grpc.StatusCode.PERMISSION_DENIED),
        (grpc.StatusCode.INVALID_ARGUMENT, "item 3: not an image", grpc.StatusCode.INVALID_ARGUMENT),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED),
        # gRPC's own refusal of an over-size message is the caller's request, not an overload.
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_terminal_errors_fail_the_request_at_once_and_bench_nothing(code, message, expected):
    state = placement()
    state.plan(ENCODERS, 3, random.Random(0))
    with pytest.raises(EncodeFailedError) as raised:
        state.shard_failed(failed(B, [2, 3], code, message))
    assert raised.value.code == expected
    assert raised.value.encoder_url == B
    assert state.benched == set() and state.busy_until == {} and state.pending == []
    assert [a.status for a in raised.value.attempts[2]] == [code.name]
    assert raised.value.item_indices == [0, 1, 2, 3, 4, 5]


def test_an_item_out_of_attempts_fails_the_request_with_its_last_status():
    state = placement(items=[0], max_attempts=3)
    for url in (A, B):
        state.plan(ENCODERS, 3, random.Random(0))
        assert state.shard_failed(failed(url, [0], grpc.StatusCode.INTERNAL)).failover is Failover.REPLACE
    state.plan(ENCODERS, 3, random.Random(0))
    with pytest.raises(EncodeFailedError, match=r"items \[0\] failed 3 attempts") as raised:
        state.shard_failed(failed(C, [0], grpc.StatusCode.INTERNAL))
    assert raised.value.code == grpc.StatusCode.INTERNAL and raised.value.encoder_url == C


def test_overload_backs_off_without_benching_and_the_busy_encoder_is_avoided_meanwhile():
    clock = Clock()
    state = placement(items=[0, 1], clock=clock, busy_backoff_s=0.1)
    state.plan(ENCODERS, 3, random.Random(0))
    retry = state.shard_failed(failed(A, [0, 1], grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    assert retry.failover is Failover.BACK_OFF and retry.item_indices == [0, 1]
    assert 0.05 <= retry.delay_s <= 0.15  # the first back-off, jittered by +-50%
    assert state.benched == set() and state.pending == []  # due only when the timer fires
    state.due_again(retry.item_indices)
    shards = state.plan(ENCODERS, 3, random.Random(0))
    assert A not in {e.url for e, _ in shards}  # avoided while the others can take the items
    clock.now += 1.0
    state.shard_failed(failed(B, [0, 1], grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    state.shard_failed(failed(C, [0, 1], grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    state.due_again([0, 1])
    # Every encoder busy: the items go to one of them anyway rather than nowhere.
    assert sorted(i for _, items in state.plan(ENCODERS, 3, random.Random(0)) for i in items) == [0, 1]


def test_back_off_doubles_per_attempt_and_never_outlasts_the_deadline():
    clock = Clock()
    state = placement(items=[0], clock=clock, deadline=100.5, busy_backoff_s=0.1, max_attempts=10)
    delays = []
    for _ in range(4):
        delays.append(state.shard_failed(failed(A, [0], grpc.StatusCode.RESOURCE_EXHAUSTED, "full")).delay_s)
    assert delays[:3] == pytest.approx([0.1 * 2**i for i in range(3)], rel=0.5)
    assert delays[3] == 0.5  # 0.8 s due, cut to what is left of the deadline
    assert backoff_s(1.0, 10, random.Random(0), spread=0.0, cap_s=30.0) == 30.0


def test_deadline_and_no_encoder_failures_name_what_happened():
    clock = Clock()
    state = placement(items=[0, 1], clock=clock, deadline=101.0)
    assert state.time_left() == 1.0
    clock.now = 102.0
    assert state.time_left() == 0.0
    failure = state.deadline_passed()
    assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED and failure.item_indices == [0, 1]

    with pytest.raises(EncodeFailedError, match="no encoder is healthy") as raised:
        placement().plan([], 3, random.Random(0))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE

    state = placement(items=[0])
    state.plan(ENCODERS, 3, random.Random(0))
    state.shard_failed(failed(A, [0], grpc.StatusCode.UNAVAILABLE, "connection refused"))
    with pytest.raises(EncodeFailedError, match="every encoder failed or is unhealthy") as raised:
        state.plan([], 3, random.Random(0))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and raised.value.encoder_url == A


def test_a_broken_stream_replaces_like_an_unavailable_encoder():
    state = placement(items=[0, 1])
    state.plan(ENCODERS, 3, random.Random(0))
    arrived(state, 0, A)
    retry = state.shard_failed(failed(A, [1], None, "stream ended before these items arrived"))
    assert retry.failover is Failover.REPLACE and state.pending == [1] and state.benched == {A}
    assert state.attempts[1][0].status == "PROTOCOL"
