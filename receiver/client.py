"""`EncoderReceiver`: what a prefill node calls to encode a request's images on the encoder pods."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from protos import encoder_pb2 as pb
from protos import wire
from encoder_common.errors import EncoderError, Failover, SharedMemoryUnavailableError, error_class_for

from .assembly import Allocator, ShardAssembler, StreamProtocolError
from .channels import ClientTls, EncoderEndpoint
from .discovery import DEFAULT_REFRESH_S, EncoderDiscovery, EndpointPool, Resolver, resolve_all
from .errors import EncodeFailedError, ShardError
from .fetch import fetch_leased
from .health import FailoverPolicy, HealthTracker
from .items import ImageSource, check_items, read_image_bytes
from .metrics import ReceiverMetrics
from .placement import RequestPlacement
from .precomputed import agreed_model, is_precomputed, precomputed_results
from .result import EncodeResult, ItemResult
from .shm import ShmReceiver, TransferStats

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0

class EncoderReceiver:
    """Shards each request's image items across encoder servers and reassembles their embeddings.

    When an encoder fails (unreachable, UNAVAILABLE, INTERNAL, a broken or stalled stream), the
    items it did not finish are re-sharded onto the other encoders within the request's deadline;
    finished items are kept, half-received ones start over. Failed encoders are skipped by later
    requests until a health probe finds them SERVING again. An overloaded encoder's items are
    retried after a back-off without benching it; an invalid item, refused credentials
    (UNAUTHENTICATED, PERMISSION_DENIED) or the deadline fail the request at once. The error class
    of the status decides which (`encoder_common.errors.Failover`; see `placement.RequestPlacement`).

    Use it as an async context manager (or call `close()`); one channel per encoder URL is opened
    once and shared by every `encode` call, which may run concurrently.
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
            tls: CAs to trust and client certificate (mTLS) for `grpcs://` URLs.
            auth_token: sent as `authorization: Bearer <token>` on every call.
            resolver: resolves a `dns:` name; the system resolver unless a test brings its own.
            refresh_s: re-resolve `dns:` names when their addresses are older than this.
            metrics: counters to record into (shared between receivers if given).
            transfer: how payloads travel. "auto": through shared memory from encoders that prove
                they share this host (started with --shm-transfer), the gRPC stream otherwise;
                "shm": shared memory or SharedMemoryUnavailableError; "grpc": the stream only.
            hidden_size: the served model's embedding width, which precomputed items are checked
                against while this receiver has not fetched ModelInfo (a request of precomputed
                items only never fetches it).
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.timeout = timeout
        self.file_roots = None if file_roots is None else [Path(r).resolve() for r in file_roots]
        self.failover = failover or FailoverPolicy()
        self.hidden_size = hidden_size
        self._rng = random.Random(seed)
        self._shm = ShmReceiver.for_transfer(transfer)  # first: it may refuse `transfer`; "auto" touches no file yet
        self._jitter = random.Random()
        self.metrics = metrics or ReceiverMetrics()
        self.discovery = EncoderDiscovery(self.urls, resolver=resolver, refresh_s=refresh_s, metrics=self.metrics)
        self._endpoint_pool = EndpointPool(
            self.discovery,
            close_grace_s=timeout,
            connect=lambda url: EncoderEndpoint.connect(url, tls=tls, auth_token=auth_token),
        )
        self._health = HealthTracker(self.failover)
        self._served_model: pb.ModelInfo | None = None
        self._served_model_lock = asyncio.Lock()

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._endpoint_pool.close()
        if self._shm is not None:
            self._shm.close()

    @property
    def transfer_stats(self) -> TransferStats:
        """Items that came through shared memory, and why others fell back to the stream."""
        return self._shm.stats if self._shm is not None else TransferStats()

    async def model_info(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        endpoints = await self._endpoint_pool.endpoints()
        infos = await asyncio.gather(
            *(e.get_model_info(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=e.metadata) for e in endpoints)
        )
        return {e.url: info for e, info in zip(endpoints, infos)}

    async def served_model(self) -> pb.ModelInfo:
        """The model the encoders serve, fetched once per receiver; they must agree on hidden size, dtype."""
        async with self._served_model_lock:
            if self._served_model is None:
                try:
                    infos = await self.model_info()
                except grpc.aio.AioRpcError as exc:
                    status = f"{exc.code().name}: {exc.details()}"
                    message = f"cannot fetch ModelInfo to check precomputed items: {status}"
                    raise error_class_for(exc.code())(message) from None
                self._served_model = agreed_model(infos)
        return self._served_model

    @property
    def endpoints(self) -> list[EncoderEndpoint]:
        """The encoders of the latest call (for `dns:` names, the addresses last resolved)."""
        return self._endpoint_pool.current

    def healthy_urls(self) -> list[str]:
        """The encoders this receiver currently sends to (the others are backing off)."""
        return self._health.healthy_urls(self.endpoints)

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

        Each item is a dict with "modality" ("image") and one of "data" (encoded image bytes)
        or "url" (`file://` or `data:`), or it carries "precomputed_embedding" (a float tensor
        [num_tokens, hidden_size]; see `precomputed_result` for the optional keys), in which case
        it is never sent. A request that sends other items checks it against `served_model()`; a
        request of precomputed items only makes no RPC at all and checks them against ModelInfo
        already fetched, else the configured `hidden_size`, else what the tensors prove (see
        `precomputed_results`). Only the other items are sharded, so `num_items_assigned` counts
        those, and fixes the first placement's per-encoder counts while every encoder is healthy.

        Raises UnsupportedModalityError before any RPC if an item is not an image,
        InvalidItemError for an unreadable item or a bad precomputed one (before any Encode
        call), and EncodeFailedError (a ShardError listing what happened to each item) when an
        item is refused as invalid, no encoder can serve an item, or the deadline passes.

        With `lease_ms`, each encoder keeps the items it encoded for a later `fetch` (by
        `ItemResult.lease.key`) for that long at most; precomputed items get no lease. With
        `withhold_payloads` too, only the headers come back: each embedding is a tensor on the meta
        device (shape and dtype, no data) and the payloads wait on the encoders for their Fetch.
        """
        if withhold_payloads and lease_ms is None:
            raise ValueError("withhold_payloads needs a lease (lease_ms): a withheld payload is only had by Fetch")
        lease = pb.Lease(ttl_ms=lease_ms, withhold_payload=withhold_payloads) if lease_ms is not None else None
        check_items(items)
        started = time.perf_counter()
        results: dict[int, ItemResult] = {}
        try:
            results = await self._precomputed_results(items)
            raw = [index for index in range(len(items)) if index not in results]
            if all(items[index].get("data") is not None for index in raw):  # nothing to read: no thread hop
                sources = self._read_sources(items, raw)
            else:
                sources = await asyncio.to_thread(self._read_sources, items, raw)
            budget = timeout if timeout is not None else self.timeout
            await self._encode_sources(
                request_id, sources, num_items_assigned, time.monotonic() + budget, results, lease
            )
        finally:
            done = len(results) == len(items)
            self.metrics.request_done(time.perf_counter() - started, list(results.values()) if done else None)
        return EncodeResult(request_id, [results[i] for i in range(len(items))])

    async def _precomputed_results(self, items: Sequence[Mapping[str, Any]]) -> dict[int, ItemResult]:
        """Results of the items that carry their embedding, by index.

        ModelInfo is fetched for them only when the request talks to the encoders anyway: a request
        of precomputed items alone must be served while every encoder is down.
        """
        indices = [index for index, item in enumerate(items) if is_precomputed(item)]
        if not indices:
            return {}
        info = await self.served_model() if len(indices) < len(items) else self._served_model
        return await asyncio.to_thread(precomputed_results, items, indices, info, self.hidden_size)

    def _read_sources(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> dict[int, ImageSource]:
        return {index: ImageSource(index, read_image_bytes(items[index], index, self.file_roots)) for index in indices}

    async def _encode_sources(
        self,
        request_id: str,
        sources: Mapping[int, ImageSource],
        num_items_assigned: Sequence[int] | None,
        deadline: float,
        results: dict[int, ItemResult],
        lease: pb.Lease | None = None,
    ) -> None:
        """Places items on encoders, and re-places those of every failed shard, until all are in `results`.

        `RequestPlacement` decides what each failure means; this loop runs the calls it plans. Items an
        encoder refused as overloaded wait out their back-off on a timer while the other shards go on.
        Encoders are looked up again (and `dns:` names re-resolved when due) at each placement, so
        re-sharded items can land on pods that just appeared.
        """
        placement = RequestPlacement(
            request_id, sources, deadline, self.failover, num_items_assigned=num_items_assigned, jitter=self._jitter
        )
        running: dict[asyncio.Task, EncoderEndpoint | None] = {}  # shard calls; back-off timers map to None

        def arrived(result: ItemResult) -> None:
            results[result.index] = result
            placement.item_arrived(result)

        def settle(encoder: EncoderEndpoint, error: ShardError | None) -> None:
            """A shard ended: its encoder is healthy, or its items go elsewhere or wait out a back-off."""
            if error is None:
                self._health.of(encoder).mark_healthy()
                return
            self._shard_failed(error)
            retry = placement.shard_failed(error)  # raises when the request cannot succeed
            if retry.failover is Failover.BACK_OFF:  # overloaded is not broken: not benched for others
                self.metrics.retry(encoder.url, len(retry.item_indices))
                timer = asyncio.sleep(retry.delay_s, result=retry.item_indices)
                running[asyncio.create_task(timer)] = None
            else:
                self._health.of(encoder).mark_failed(f"{error.status}: {error.message}")
                self.metrics.failover(encoder.url, len(retry.item_indices))
                log.warning("request %s: %s; re-sharding its items", request_id, error)

        try:
            while True:
                if placement.pending:
                    known = await self._endpoint_pool.endpoints()
                    usable = await self._health.usable(known, placement.benched, deadline)
                    shards = [
                        (encoder, self._run_shard(request_id, encoder, indices, sources, arrived, placement, lease=lease))
                        for encoder, indices in placement.plan(usable, len(known), self._rng)
                    ]
                    if len(shards) == 1 and not running:
                        # A lone call (all items on one encoder, nothing else pending) runs in this task:
                        # no task and no wait of its own. Its gRPC deadline is the request's.
                        encoder, shard = shards[0]
                        settle(encoder, await shard)
                        continue
                    for encoder, shard in shards:
                        running[asyncio.create_task(shard)] = encoder
                if not running:
                    return
                finished, _ = await asyncio.wait(
                    running, timeout=placement.time_left(), return_when=asyncio.FIRST_COMPLETED
                )
                if not finished:
                    raise placement.deadline_passed()
                for task in finished:
                    encoder = running.pop(task)
                    if encoder is None:  # a back-off timer: its items are due again
                        placement.due_again(task.result())
                    else:
                        settle(encoder, task.result())
        finally:
            for task in running:
                task.cancel()

    def _shard_failed(self, error: ShardError) -> None:
        """Counts the failure; an unreachable encoder makes discovery re-resolve and skip it a while."""
        self.metrics.shard_failed(error.encoder_url, error.status)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.discovery.report_failure(error.encoder_url)

    async def _run_shard(
        self,
        request_id: str,
        endpoint: EncoderEndpoint,
        indices: list[int],
        sources: Mapping[int, ImageSource],
        arrived: Callable[[ItemResult], None],
        placement: RequestPlacement,
        offer_shm: bool = True,
        lease: pb.Lease | None = None,
    ) -> ShardError | None:
        """One Encode call for `indices` on one encoder; stores each item as its last byte arrives.

        Returns None when every item arrived, else a ShardError naming the items that did not; an
        item cut off half-way is dropped whole, so a retry rewrites it from scratch. A stream
        silent for `stall_timeout_s` whose encoder then fails a health probe is abandoned.
        """

        def shard_error(code: grpc.StatusCode | None, message: str) -> ShardError:
            return ShardError(
                encoder_url=endpoint.url,
                request_id=request_id,
                item_indices=assembler.missing(),
                code=code,
                message=message,
            )

        withheld = lease is not None and lease.withhold_payload
        offer = self._shm is not None and offer_shm and not withheld
        shm_offer = self._shm.offer(endpoint.url) if offer else None
        request = wire.encode_request(
            pb.EncodeRequest(request_id=request_id, shm=shm_offer, lease=lease),
            [(pb.ImageItem(index=i, modality=pb.IMAGE), sources[i].data) for i in indices],
        )
        read_shm = self._shm.reader(request_id) if shm_offer is not None else None
        assembler = ShardAssembler(indices, endpoint.url, read_shm, payloads=not withheld)
        remaining = placement.time_left()
        if remaining <= 0:
            return shard_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before the call")
        call = endpoint.encode(request, timeout=remaining, metadata=endpoint.metadata)
        watch = _StallWatch(self.failover, endpoint, call)
        try:
            async for message in call:
                watch.last_message = time.monotonic()
                done = assembler.feed(message)
                if done is not None:
                    arrived(done)
        except grpc.aio.AioRpcError as exc:
            if watch.stalled:
                return shard_error(grpc.StatusCode.UNAVAILABLE, watch.reason)
            return shard_error(exc.code(), exc.details() or "")
        except (StreamProtocolError, SharedMemoryUnavailableError) as exc:
            call.cancel()
            return shard_error(None, str(exc))
        except asyncio.CancelledError:
            if watch.stalled:  # the watchdog cancelled the call; nobody cancelled this task
                return shard_error(grpc.StatusCode.UNAVAILABLE, watch.reason)
            raise
        finally:
            watch.stop()
        if assembler.refetch:  # their segments could not be read: the same items again, over the stream
            error = await self._run_shard(
                request_id, endpoint, list(assembler.refetch), sources, arrived, placement, offer_shm=False, lease=lease
            )
            if error is not None:
                return error
        missing = [i for i in assembler.missing() if i not in placement.done]
        if missing:
            return ShardError(
                encoder_url=endpoint.url,
                request_id=request_id,
                item_indices=missing,
                code=None,
                message="stream ended before these items arrived",
            )
        return None


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

        Asks `prefer_url` first (the encoder that encoded it), then the other encoders. Raises
        receiver.fetch.FetchFailedError, with each encoder's answer, when none streams it.
        """
        endpoints = await self._endpoint_pool.endpoints()
        budget = timeout if timeout is not None else self.timeout
        return await fetch_leased(
            endpoints,
            request_id,
            key,
            deadline=time.monotonic() + budget,
            prefer_url=prefer_url,
            shm=self._shm,
            allocate=allocate,
        )


class _StallWatch:
    """Watches one call: after `stall_timeout_s` without a message it probes the encoder, and
    cancels the call unless the probe answers SERVING (a busy encoder is left alone).

    A timer, not a task: a call that streams along costs one timer handle, and a probe task is made
    only when the stream has been silent that long.
    """

    __slots__ = ("policy", "endpoint", "call", "last_message", "stalled", "reason", "_timer", "_probe")

    def __init__(self, policy: FailoverPolicy, endpoint: EncoderEndpoint, call: grpc.aio.UnaryStreamCall):
        self.policy = policy
        self.endpoint = endpoint
        self.call = call
        self.last_message = time.monotonic()
        self.stalled = False
        self.reason = ""
        self._probe: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(policy.stall_timeout_s, self._check)

    def _check(self) -> None:
        wait = self.last_message + self.policy.stall_timeout_s - time.monotonic()
        if wait > 0:
            self._timer = asyncio.get_running_loop().call_later(wait, self._check)
        else:
            self._probe = asyncio.create_task(self._probe_encoder())

    async def _probe_encoder(self) -> None:
        if await self.endpoint.is_serving(self.policy.probe_timeout_s):
            self.last_message = time.monotonic()
            self._check()
            return
        self.stalled = True
        silence = self.policy.stall_timeout_s
        self.reason = f"no message for {silence:g} s and no SERVING answer to a health probe: abandoned"
        self.call.cancel()

    def stop(self) -> None:
        self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()


__all__ = ["ClientTls", "EncodeFailedError", "EncoderError", "EncoderReceiver", "FailoverPolicy"]
