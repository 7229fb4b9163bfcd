"""`EncoderReceiver`: what a prefill node calls to encode a request's images on the encoder pods.

A facade: its life cycle, `encode` and `fetch`. The failover loop is `receiver.fleet.failover`, one call to
one encoder (with its stall watch) is `receiver.fleet.shard_call`, where items go is `receiver.fleet.placement`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from encoder_common import tracing
from protos import encoder_pb2 as pb

from .config import ReceiverConfig
from .embeddings.assembly import Allocator
from .embeddings.item_cache import ItemCache
from .embeddings.result import EncodeResult, ItemResult
from .fleet.channels import EncoderEndpoint
from .fleet.discovery import Resolver, resolve_all
from .fleet.failover import EncodeJob, Fleet, encode_items
from .fleet.fetch import fetch_leased
from .fleet.served_model import ServedModel
from .items import check_items, sort_items
from .metrics import ReceiverMetrics
from .transports import TransferStats, open_transport


class EncoderReceiver:
    """Places each request's image items on encoder servers and reassembles their embeddings.

    A failed encoder's unfinished items are re-placed on the others within the request's deadline
    (finished ones kept, half-received ones started over) and it is skipped until a health probe finds
    it SERVING; an overloaded one's items are retried after a back-off; an invalid item, refused
    credentials or the deadline fail the request (`encoder_common.errors.Failover`, `placement`).
    Use it as an async context manager (or call `close()`); its channels, one per encoder URL, are
    shared by every `encode` call, which may run concurrently.
    """

    def __init__(
        self,
        urls: Sequence[str],
        config: ReceiverConfig | None = None,
        *,
        resolver: Resolver = resolve_all,
        metrics: ReceiverMetrics | None = None,
        **settings: Any,
    ):
        """
        Args:
            urls: encoder servers, as `grpc://host:port`, `grpcs://host:port` (TLS), or
                `dns:///name:port` for every address behind a name (a headless Service's pods),
                re-resolved as pods come and go.
            config: every setting (`receiver.config.ReceiverConfig`: deadline, placement, transfer,
                cache, failover, credentials, ...); `settings` are keyword overrides of its fields,
                e.g. `EncoderReceiver(urls, timeout=30, placement="affinity")`.
            resolver: resolves `dns:` names (the system resolver by default).
            metrics: counters to record into (shared between receivers if given).
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.config = config = replace(config or ReceiverConfig(), **settings)
        self._transport = open_transport(config.transfer, config)  # "auto" touches no file yet
        self.metrics = metrics or ReceiverMetrics()
        self._fleet = Fleet.connect(
            self.urls, config, resolver=resolver, metrics=self.metrics, transport=self._transport
        )
        self.cache = ItemCache(config.cache_bytes) if config.cache_bytes else None
        self.discovery = self._fleet.discovery
        self._served = ServedModel(self._fleet.pool, config.timeout, config.hidden_size)

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._fleet.pool.close()
        self._transport.close()

    @property
    def transfer_stats(self) -> TransferStats:
        """Items that came through shared memory, and why others fell back to the stream."""
        return self._transport.stats

    async def model_info(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        return await self._served.infos()

    async def served_model(self) -> pb.ModelInfo:
        """The model the encoders serve, fetched once per receiver; they must agree on hidden size, dtype."""
        return await self._served.agreed()

    @property
    def endpoints(self) -> list[EncoderEndpoint]:
        """The encoders of the latest call (for `dns:` names, the addresses last resolved)."""
        return self._fleet.pool.current

    def healthy_urls(self) -> list[str]:
        """The encoders this receiver currently sends to (the others are backing off)."""
        return self._fleet.health.healthy_urls(self.endpoints)

    async def encode(
        self,
        request_id: str,
        items: Sequence[Mapping[str, Any]],
        *,
        num_items_assigned: Sequence[int] | None = None,
        timeout: float | None = None,
        lease_ms: int | None = None,
        withhold_payloads: bool = False,
    ) -> EncodeResult:
        """Encodes a request's image items; the result holds them in the order given.

        Each item is a dict with "modality" ("image") and one of "data" (encoded image bytes), "url"
        (`file://` or `data:`) or "precomputed_embedding" (never sent; checked as
        `precomputed.precomputed_results` says). `num_items_assigned` (sent items per encoder) fixes
        the first placement while every encoder is healthy. Raises UnsupportedModalityError or
        InvalidItemError before any Encode call, and EncodeFailedError (what happened to each item)
        when an item is refused as invalid, no encoder can serve it, or the deadline passes.

        The receiver cache serves items without an RPC unless the call fixes counts or asks for a lease.
        With `lease_ms`, each encoder keeps the items it encoded for a later `fetch` (by
        `ItemResult.lease.key`) that long at most; with `withhold_payloads` too, only headers come
        back (embeddings on the meta device) and the payloads wait on the encoders for their Fetch.
        """
        if withhold_payloads and lease_ms is None:
            raise ValueError("withhold_payloads needs a lease (lease_ms): a withheld payload is only had by Fetch")
        lease = pb.Lease(ttl_ms=lease_ms, withhold_payload=withhold_payloads) if lease_ms is not None else None
        attributes = {"encoder.request_id": request_id, "encoder.items": len(items), "encoder.placement": self.config.placement}
        with tracing.span("receiver.encode", attributes=attributes):
            check_items(items)
            started = time.perf_counter()
            results: dict[int, ItemResult] = {}
            try:
                results, sources = await sort_items(self._served, items, self.config.file_roots)
                deadline = time.monotonic() + (timeout if timeout is not None else self.config.timeout)
                job = EncodeJob(request_id, deadline, results, num_items_assigned, lease)
                await encode_items(self._fleet, self.cache, job, sources)
            finally:
                done = len(results) == len(items)
                self.metrics.request_done(time.perf_counter() - started, list(results.values()) if done else None)
        return EncodeResult(request_id, [results[i] for i in range(len(items))])

    async def fetch(
        self,
        request_id: str,
        key: bytes,
        *,
        prefer_url: str | None = None,
        allocate: Allocator | None = None,
        timeout: float | None = None,
    ) -> ItemResult:
        """A leased item (see `encode(lease_ms=...)`) by its key, received into a tensor from `allocate`.
        Asks `prefer_url` first (the encoder that encoded it), then the others; raises
        receiver.fleet.fetch.FetchFailedError, with each encoder's answer, when none streams it."""
        with tracing.span("receiver.fetch", attributes={"encoder.request_id": request_id}):
            endpoints = await self._fleet.pool.endpoints()
            deadline = time.monotonic() + (timeout if timeout is not None else self.config.timeout)
            return await fetch_leased(
                endpoints, request_id, key, deadline=deadline, prefer_url=prefer_url, policy=self.config.failover,
                transport=self._transport, allocate=allocate,
            )  # fmt: skip

