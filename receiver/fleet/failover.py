"""The failover loop: runs a request's shard calls on the encoders and re-places the items of every
shard that failed, until all items are in or the request cannot succeed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from encoder_common import tracing
from encoder_common.errors import Failover
from protos import encoder_pb2 as pb

from ..config import DEFAULT_BALANCE, FailoverPolicy, ReceiverConfig
from ..embeddings.item_cache import ItemCache
from ..embeddings.result import ItemResult
from ..errors import ShardError
from ..metrics import ReceiverMetrics
from ..transports import ReceiverTransport
from .affinity import content_key
from .channels import EncoderEndpoint
from .discovery import EncoderDiscovery, EndpointPool, Resolver
from .health import HealthTracker
from .held_images import DIGESTS
from .load import FleetLoad
from .placement import Affinity, RequestPlacement
from .shard_call import encode_shard

log = logging.getLogger(__name__)


@dataclass
class Fleet:
    """What every request of one receiver shares: the encoders, what is believed of their health,
    the failover settings, the payload transport and the counters."""

    pool: EndpointPool
    discovery: EncoderDiscovery
    health: HealthTracker
    policy: FailoverPolicy
    metrics: ReceiverMetrics
    transport: ReceiverTransport
    rng: random.Random  # the random sharding's
    jitter: random.Random  # back-off jitter
    placement: str = "random"  # or "affinity" (receiver.fleet.affinity)
    balance: float = DEFAULT_BALANCE  # affinity's load bound: x the fleet's median queued work
    load: FleetLoad = field(default_factory=FleetLoad)  # the encoders' reported load and what was sent since

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        config: ReceiverConfig,
        *,
        resolver: Resolver,
        metrics: ReceiverMetrics,
        transport: ReceiverTransport,
    ) -> Fleet:
        """The fleet behind `urls`; channels open on first use, one per encoder."""
        discovery = EncoderDiscovery(urls, resolver=resolver, refresh_s=config.refresh_s, metrics=metrics)
        load = FleetLoad()
        pool = EndpointPool(
            discovery,
            close_grace_s=config.timeout,
            connect=lambda url: EncoderEndpoint.connect(
                url, tls=config.tls, auth_token=config.auth_token, on_load=load.report
            ),
        )
        health = HealthTracker(config.failover)
        rngs = {"rng": random.Random(config.seed), "jitter": random.Random()}
        settings = {"placement": config.placement, "balance": config.balance, "load": load}
        return cls(pool, discovery, health, config.failover, metrics, transport, **rngs, **settings)

    def shard_failed(self, error: ShardError) -> None:
        """Counts the failure; an unreachable encoder makes discovery re-resolve and skip it a while."""
        self.metrics.shard_failed(error.encoder_url, error.status)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.discovery.report_failure(error.encoder_url)


@dataclass
class EncodeJob:
    """One `encode` call as the loop sees it: its id and deadline, where its items land, and its options."""

    request_id: str
    deadline: float
    results: dict[int, ItemResult]
    num_items_assigned: Sequence[int] | None = None  # fixes random placement's first counts
    lease: pb.Lease | None = None
    on_item: Callable[[ItemResult], None] | None = None  # told of each item as its last byte arrives


async def encode_items(
    fleet: Fleet, cache: ItemCache | None, job: EncodeJob, sources: Mapping[int, bytes]
) -> None:
    """Puts every item of `sources` (image bytes by index) in `job.results`: from the receiver cache when
    there is one, else through `encode_with_failover`. Each item's content key (`affinity.content_key`:
    affinity placement's key, the held digests' key, the digest memo's) is computed here, once. Calls
    that fix counts or ask for a lease bypass the cache: a lease is had only from an encoder that just
    encoded the item."""
    keys = {index: content_key(data) for index, data in sources.items()}

    async def encode(indices: Sequence[int], on_item: Callable[[ItemResult], None]) -> None:
        shard = {index: sources[index] for index in indices}
        await encode_with_failover(fleet, dataclasses.replace(job, on_item=on_item), shard, keys)

    if cache is None or job.lease is not None or job.num_items_assigned is not None:
        await encode_with_failover(fleet, job, sources, keys)
        return
    # The cache keys on each image's sha256 (bytes seen lately confirmed byte for byte instead of hashed):
    # a fast hash's collision must never hand one image's embedding out for another.
    digests = {index: DIGESTS.sha256(data, keys[index]) for index, data in sources.items()}
    hits, misses = await cache.encode_through(digests, job.results, encode)
    fleet.metrics.cache_looked_up(hits, misses, cache.bytes)
    if not misses:
        await asyncio.sleep(0)  # served without any wait: let the other requests' streams in first


async def encode_with_failover(
    fleet: Fleet, job: EncodeJob, sources: Mapping[int, bytes], keys: Mapping[int, bytes]
) -> None:
    """Places `sources` (image bytes by item index) on encoders, and re-places those of every failed
    shard, until all are in `job.results`. `keys` holds each item's content key (`affinity.content_key`)."""
    run = FailoverRun(fleet, job, sources, keys)
    try:
        await run.until_done()
    finally:
        run.stop()


class FailoverRun:
    """One request's shard calls: `RequestPlacement` decides what each failure means, this runs the calls
    it plans. Items an encoder refused as overloaded wait out their back-off on a timer while the other
    shards go on. Encoders are looked up again (and `dns:` names re-resolved when due) at each placement,
    so re-placed items can land on pods that just appeared."""

    def __init__(
        self, fleet: Fleet, job: EncodeJob, sources: Mapping[int, bytes], keys: Mapping[int, bytes]
    ) -> None:
        self.fleet, self.job, self.sources, self.keys = fleet, job, sources, keys
        by_content = None
        if fleet.placement == "affinity":
            by_content = Affinity(keys, fleet.balance, fleet.load)
        self.placement = RequestPlacement(
            job.request_id, sources, job.deadline, fleet.policy,
            num_items_assigned=job.num_items_assigned, jitter=fleet.jitter, affinity=by_content,
        )  # fmt: skip
        self.running: dict[asyncio.Task, EncoderEndpoint | None] = {}  # shard calls; back-off timers: None

    async def until_done(self) -> None:
        """Places what is pending and settles each call as it ends, until no call is left."""
        while True:
            if self.placement.pending and await self._place_pending():
                continue
            if not self.running:
                return
            finished, _ = await asyncio.wait(
                self.running, timeout=self.placement.time_left(), return_when=asyncio.FIRST_COMPLETED
            )
            if not finished:
                raise self.placement.deadline_passed()
            for task in finished:
                encoder = self.running.pop(task)
                if encoder is None:  # a back-off timer: its items are due again
                    self.placement.due_again(task.result())
                else:
                    self._settle(encoder, task.result())

    def stop(self) -> None:
        for task in self.running:
            task.cancel()
        self.fleet.metrics.placed(self.placement.placed)

    async def _place_pending(self) -> bool:
        """Starts the shard calls of the pending items; True when a lone call already ran to its end here."""
        fleet = self.fleet
        known = await fleet.pool.endpoints()
        usable = await fleet.health.usable(known, self.placement.benched, self.job.deadline)
        planned = self.placement.plan(usable, len(known), fleet.rng)
        shards = [(encoder, self._call(encoder, indices)) for encoder, indices in planned]
        if len(shards) == 1 and not self.running:
            # A lone call (all items on one encoder, nothing else pending) runs in this task: no task and
            # no wait of its own. Its gRPC deadline is the request's.
            encoder, call = shards[0]
            self._settle(encoder, await call)
            return True
        for encoder, call in shards:
            self.running[asyncio.create_task(call)] = encoder
        return False

    def _arrived(self, result: ItemResult) -> None:
        self.job.results[result.index] = result
        self.placement.item_arrived(result)
        if self.job.on_item is not None:
            self.job.on_item(result)

    async def _call(self, encoder: EncoderEndpoint, indices: list[int]) -> ShardError | None:
        fleet, job = self.fleet, self.job
        items = [(index, self.sources[index]) for index in indices]
        sent = fleet.load.sending(encoder.url, sum(self.placement.costs.get(index, 0.0) for index in indices))
        try:
            return await encode_shard(
                encoder, job.request_id, items, self.keys,
                deadline=job.deadline, policy=fleet.policy, arrived=self._arrived, transport=fleet.transport,
                lease=job.lease,
            )  # fmt: skip
        finally:
            fleet.load.settled(encoder.url, sent)

    def _settle(self, encoder: EncoderEndpoint, error: ShardError | None) -> None:
        """A shard ended: its encoder is healthy, or its items go elsewhere or wait out a back-off."""
        fleet = self.fleet
        if error is None:
            fleet.health.of(encoder).mark_healthy()
            return
        fleet.shard_failed(error)
        retry = self.placement.shard_failed(error)  # raises when the request cannot succeed
        tracing.event("receiver.back_off" if retry.failover is Failover.BACK_OFF else "receiver.failover", {
            "encoder.url": encoder.url, "encoder.status": error.status, "encoder.message": error.message,
            "encoder.items": len(retry.item_indices), "encoder.delay_s": retry.delay_s,
        })  # fmt: skip
        if retry.failover is Failover.BACK_OFF:  # overloaded is not broken: not benched for others
            fleet.metrics.retry(encoder.url, len(retry.item_indices))
            timer = asyncio.sleep(retry.delay_s, result=retry.item_indices)
            self.running[asyncio.create_task(timer)] = None
        else:
            fleet.health.of(encoder).mark_failed(f"{error.status}: {error.message}")
            fleet.metrics.failover(encoder.url, len(retry.item_indices))
            log.warning("request %s: %s; re-placing its items", self.job.request_id, error)
