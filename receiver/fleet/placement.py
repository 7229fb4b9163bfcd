"""One request's failover state: which items are done or pending, each item's attempts, the encoders
this request benched or found busy, and its deadline; every failed shard is judged here, in one place."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from encoder_common.errors import (
    DeadlineExceededError,
    EncoderError,
    Failover,
    InvalidItemError,
    PermissionDeniedError,
    UnauthenticatedError,
    status_for_class,
)

from ..config import FailoverPolicy
from ..embeddings.result import ItemResult
from ..errors import EncodeFailedError, ItemAttempt, ShardError
from . import affinity
from .health import backoff_s
from .load import FleetLoad
from .sharding import plan_shards


class HasUrl(Protocol):
    url: str


Encoder = TypeVar("Encoder", bound=HasUrl)


@dataclass(frozen=True)
class Affinity:
    """Placement by content and load for one request (see `receiver.fleet.affinity`): each item's content key,
    the balance factor and the encoders' load (shared, read at each plan)."""

    keys: Mapping[int, bytes]
    balance: float
    load: FleetLoad


@dataclass(frozen=True)
class Retry:
    """What to do with the items of a failed shard that may still be encoded elsewhere."""

    failover: Failover  # REPLACE: the encoder is benched for this request; BACK_OFF: it is busy
    item_indices: list[int]
    delay_s: float = 0.0  # BACK_OFF: the items are due again after this long (place them now for REPLACE)


class RequestPlacement:
    """The placement state of one request, driven by `EncoderReceiver` and free of any I/O.

    Items start pending. `plan` hands the pending items to encoders as shards; `item_arrived` marks an
    item done; `shard_failed` decides what a failure means: it raises EncodeFailedError when the
    request cannot succeed (a terminal error, an item out of attempts), otherwise it records the
    attempt, benches the encoder for this request (REPLACE) or marks it busy (BACK_OFF), and says when
    the unfinished items are due again (`due_again` puts them back).
    """

    def __init__(
        self,
        request_id: str,
        item_indices: Iterable[int],
        deadline: float,
        policy: FailoverPolicy,
        *,
        num_items_assigned: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: random.Random | None = None,
        affinity: Affinity | None = None,
    ):
        if affinity is not None and num_items_assigned is not None:
            raise ValueError("num_items_assigned fixes random placement's counts; affinity places items by content")
        self.request_id = request_id
        self.deadline = deadline
        self.policy = policy
        self.attempts: dict[int, list[ItemAttempt]] = {index: [] for index in item_indices}
        self.done: set[int] = set()
        self.pending: list[int] = sorted(self.attempts)
        self.benched: set[str] = set()  # encoders that failed this request, by URL
        self.busy_until: dict[str, float] = {}  # encoders that said they were overloaded, and until when
        self.last_error: ShardError | None = None
        self._assigned = num_items_assigned  # fixes the first placement's counts only
        self._clock = clock
        self._jitter = jitter or random.Random()
        self.affinity = affinity
        # Items placed: "affinity" (on their first-ranked encoder), "spilled" (another, for the load
        # bound), "re_placed" (again, after their encoder failed).
        self.placed: Counter[str] = Counter()
        self.costs: dict[int, float] = {}  # under affinity: each item's expected forward-seconds where it went

    def time_left(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def plan(
        self, encoders: Sequence[Encoder], num_known: int, rng: random.Random
    ) -> list[tuple[Encoder, list[int]]]:
        """Hands every pending item to one of `encoders` (those usable now, of `num_known`), as shards.

        Busy encoders are avoided while another can take the items. Raises EncodeFailedError when
        there is no encoder to place them on.
        """
        now = self._clock()
        idle = [e for e in encoders if self.busy_until.get(e.url, 0.0) <= now]
        encoders = idle or list(encoders)
        if not encoders:
            if self.last_error is None:
                raise self.failure(grpc.StatusCode.UNAVAILABLE, "no encoder is healthy")
            raise self.failure(
                self.last_error.code or grpc.StatusCode.INTERNAL,
                "every encoder failed or is unhealthy",
                self.last_error.encoder_url,
            )
        # The fixed counts name every known encoder; they no longer apply once one cannot take its share.
        assigned = self._assigned if len(encoders) == num_known else None
        self._assigned = None
        pending, self.pending = self.pending, []
        self.placed["re_placed"] += sum(1 for i in pending if self.attempts[i])
        if self.affinity is not None:
            return self._plan_by_affinity(encoders, pending)
        return [
            (encoders[shard.encoder], [pending[i] for i in shard.items])
            for shard in plan_shards(len(pending), len(encoders), rng, assigned)
        ]

    def _plan_by_affinity(self, encoders: Sequence[Encoder], pending: list[int]) -> list[tuple[Encoder, list[int]]]:
        spec = self.affinity
        urls = [e.url for e in encoders]
        plan = affinity.place(
            [spec.keys[i] for i in pending], urls,
            balance=spec.balance, queued_s=spec.load.queued(urls), item_s=spec.load.item_s(),
        )  # fmt: skip
        self.placed["affinity"] += len(pending) - plan.spilled
        self.placed["spilled"] += plan.spilled
        shards: dict[int, list[int]] = {}
        for item, encoder in zip(pending, plan.encoders):
            shards.setdefault(encoder, []).append(item)
            self.costs[item] = spec.load.item_s(urls[encoder])
        return [(encoders[encoder], items) for encoder, items in shards.items()]

    def item_arrived(self, result: ItemResult) -> None:
        self.done.add(result.index)
        self.attempts[result.index].append(ItemAttempt(result.encoder_url or "", "OK"))

    def shard_failed(self, error: ShardError) -> Retry:
        """Records a failed shard and decides, from its error class alone, what happens next."""
        self.last_error = error
        for index in error.item_indices:
            self.attempts[index].append(ItemAttempt(error.encoder_url, error.status, error.message))
        cause = error.cause_class
        if cause.failover is Failover.TERMINAL:
            reason = _TERMINAL_REASONS.get(cause, "the request was refused")
            raise self.failure(status_for_class(cause), reason, error.encoder_url)
        exhausted = [i for i in error.item_indices if len(self.attempts[i]) >= self.policy.max_attempts]
        if exhausted:
            raise self.failure(
                error.code or grpc.StatusCode.INTERNAL,
                f"items {exhausted} failed {self.policy.max_attempts} attempts",
                error.encoder_url,
            )
        if cause.failover is Failover.BACK_OFF:
            tries = max(len(self.attempts[i]) for i in error.item_indices)
            delay = min(backoff_s(self.policy.busy_backoff_s, tries, self._jitter, spread=0.5), self.time_left())
            self.busy_until[error.encoder_url] = self._clock() + delay
            return Retry(Failover.BACK_OFF, list(error.item_indices), delay)
        self.benched.add(error.encoder_url)
        self.due_again(error.item_indices)
        return Retry(Failover.REPLACE, list(error.item_indices))

    def due_again(self, item_indices: Iterable[int]) -> None:
        """Items to place again (failed elsewhere, or their back-off is over)."""
        self.pending = sorted({*self.pending, *item_indices})

    def deadline_passed(self) -> EncodeFailedError:
        return self.failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")

    def failure(self, code: grpc.StatusCode, reason: str, encoder_url: str = "") -> EncodeFailedError:
        return EncodeFailedError(
            request_id=self.request_id,
            code=code,
            reason=reason,
            encoder_url=encoder_url,
            attempts=self.attempts,
            completed=self.done,
        )


_TERMINAL_REASONS: dict[type[EncoderError], str] = {
    InvalidItemError: "the request was refused as invalid",
    DeadlineExceededError: "the request's deadline passed",
    UnauthenticatedError: "the encoder refused the caller's credentials (a missing or wrong bearer token)",
    PermissionDeniedError: "the caller's credentials do not allow this call",
}
