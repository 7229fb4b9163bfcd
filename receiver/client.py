"""`EncoderReceiver`: what a prefill node calls to encode a request's images on the encoder pods.

A facade: its life cycle, `encode` and `fetch`. The failover loop is `receiver.failover`, one call to
one encoder (with its stall watch) is `receiver.shard_call`, where items go is `receiver.placement`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from protos import encoder_pb2 as pb
from encoder_common.errors import EncoderError

from .assembly import Allocator
from .channels import ClientTls, EncoderEndpoint
from .discovery import DEFAULT_REFRESH_S, Resolver, resolve_all
from .errors import EncodeFailedError
from .affinity import DEFAULT_BALANCE
from .failover import EncodeJob, Fleet, encode_items
from .fetch import fetch_leased
from .health import FailoverPolicy
from .item_cache import ItemCache
from .items import check_items
from .metrics import ReceiverMetrics
from .result import EncodeResult, ItemResult
from .request_items import ServedModel, sort_items
from .shm import ShmReceiver, TransferStats

DEFAULT_TIMEOUT_S = 60.0


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
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        seed: int | None = None,
        file_roots: Sequence[str | Path] | None = None,
        failover: FailoverPolicy | None = None,
        tls: ClientTls | None = None,
        auth_token: str | None = None,
        resolver: Resolver = resolve_all,
        refresh_s: float = DEFAULT_REFRESH_S,
        metrics: ReceiverMetrics | None = None,
        transfer: str = "auto",
        hidden_size: int | None = None,
        placement: str = "random",
        balance: float = DEFAULT_BALANCE,
        cache_bytes: int = 0,
    ):
        """
        Args:
            urls: encoder servers, as `grpc://host:port`, `grpcs://host:port` (TLS), or
                `dns:///name:port` for every address behind a name (a headless Service's pods),
                re-resolved as pods come and go.
            timeout: default deadline of one `encode` call, in seconds, retries included.
            seed: seeds the random sharding (for tests and reproducible runs).
            file_roots: directories `file://` items may be read from; None allows any path.
            failover: retry, stall-detection and back-off settings.
            tls, auth_token: CAs and client certificate for `grpcs://`; a bearer token for every call.
            resolver, refresh_s: resolve `dns:` names (the system resolver by default), this often.
            metrics: counters to record into (shared between receivers if given).
            transfer: "auto": through shared memory from encoders that prove they share this host
                (started with --shm-transfer), the gRPC stream otherwise; "shm": shared memory or
                SharedMemoryUnavailableError; "grpc": the stream only.
            hidden_size: the embedding width precomputed items are checked against while no
                ModelInfo has been fetched (a request of precomputed items only fetches none).
            placement: "random" (count-balanced random shards) or "affinity" (by content key and load,
                see `receiver.affinity`: a new item passes over its first-ranked encoder only where it
                would finish later than `balance` x the soonest it could finish on any encoder).
            cache_bytes: the receiver's embedding cache (`receiver.item_cache`), 0 for none.
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.timeout = timeout
        self.file_roots = None if file_roots is None else [Path(r).resolve() for r in file_roots]
        self.failover = failover or FailoverPolicy()
        self.hidden_size = hidden_size
        self._shm = ShmReceiver.for_transfer(transfer)  # first: it may refuse `transfer`; "auto" touches no file yet
        self.metrics = metrics or ReceiverMetrics()
        self._fleet = Fleet.connect(
            self.urls, tls=tls, auth_token=auth_token, resolver=resolver, refresh_s=refresh_s,
            close_grace_s=timeout, policy=self.failover, metrics=self.metrics, shm=self._shm, seed=seed,
            placement=placement, balance=balance,
        )  # fmt: skip
        self.cache = ItemCache(cache_bytes) if cache_bytes else None
        self.discovery = self._fleet.discovery
        self._served = ServedModel(self._fleet.pool, timeout, hidden_size)

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._fleet.pool.close()
        if self._shm is not None:
            self._shm.close()

    @property
    def transfer_stats(self) -> TransferStats:
        """Items that came through shared memory, and why others fell back to the stream."""
        return self._shm.stats if self._shm is not None else TransferStats()

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
        check_items(items)
        started = time.perf_counter()
        results: dict[int, ItemResult] = {}
        try:
            results, sources = await sort_items(self._served, items, self.file_roots)
            deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
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
        receiver.fetch.FetchFailedError, with each encoder's answer, when none streams it."""
        endpoints = await self._fleet.pool.endpoints()
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        return await fetch_leased(
            endpoints, request_id, key, deadline=deadline, prefer_url=prefer_url, policy=self.failover,
            shm=self._shm, allocate=allocate,
        )  # fmt: skip


__all__ = ["ClientTls", "EncodeFailedError", "EncoderError", "EncoderReceiver", "FailoverPolicy"]
