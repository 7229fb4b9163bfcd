"""`EncoderReceiver`: what a prefill node calls to encode a request's images on the encoder pods."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from protos import encoder_pb2 as pb
from protos.errors import EncoderError

from .assembly import ShardAssembler, StreamProtocolError
from .channels import ClientTls, EncoderEndpoint
from .errors import EncodeFailedError, ItemAttempt, ShardError
from .health import EncoderPool, FailoverPolicy
from .items import ImageSource, check_image_only, read_image_bytes
from .result import EncodeResult, ItemResult
from .sharding import plan_shards

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def _callers_fault(error: ShardError) -> bool:
    # gRPC itself answers an over-size request with RESOURCE_EXHAUSTED; that is not an overload.
    return error.code == _INVALID or (error.code == _BUSY and "larger than max" in error.message)


class EncoderReceiver:
    """Shards each request's image items across encoder servers and reassembles their embeddings.

    When an encoder fails (unreachable, UNAVAILABLE, INTERNAL, RESOURCE_EXHAUSTED, a broken or
    stalled stream), the items it did not finish are re-sharded onto the other encoders within the
    request's deadline; finished items are kept, half-received ones start over. Failed encoders are
    skipped by later requests until a health probe finds them SERVING again.

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
    ):
        """
        Args:
            urls: encoder servers, as `grpc://host:port` or `grpcs://host:port` (TLS).
            timeout: default deadline of one `encode` call, in seconds, retries included.
            seed: seeds the random sharding (for tests and reproducible runs).
            file_roots: directories `file://` items may be read from; None allows any path.
            failover: retry, stall-detection and back-off settings.
            tls: CAs to trust and client certificate (mTLS) for `grpcs://` URLs.
            auth_token: sent as `authorization: Bearer <token>` on every call.
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.timeout = timeout
        self.file_roots = None if file_roots is None else [Path(r).resolve() for r in file_roots]
        self.failover = failover or FailoverPolicy()
        self._rng = random.Random(seed)
        self._jitter = random.Random()
        self._endpoints = [EncoderEndpoint.connect(url, tls=tls, auth_token=auth_token) for url in self.urls]
        self._pool = EncoderPool(self._endpoints, self.failover)

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(endpoint.close() for endpoint in self._endpoints))

    async def model_info(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        infos = await asyncio.gather(
            *(e.get_model_info(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=e.metadata) for e in self._endpoints)
        )
        return dict(zip(self.urls, infos))

    def healthy_urls(self) -> list[str]:
        """The encoders this receiver currently sends to (the others are backing off)."""
        return [h.endpoint.url for h in self._pool.health if h.healthy]

    async def encode(
        self,
        request_id: str,
        items: Sequence[Mapping[str, Any]],
        *,
        num_items_assigned: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> EncodeResult:
        """Encodes a request's image items; the result holds them in the order given.

        Each item is a dict with "modality" ("image") and one of "data" (encoded image bytes)
        or "url" (`file://` or `data:`). Raises UnsupportedModalityError before any RPC if an
        item is not an image, InvalidItemError for an unreadable item, and EncodeFailedError (a
        ShardError listing what happened to each item) when an item is refused as invalid, no
        encoder can serve an item, or the deadline passes. `num_items_assigned` fixes the first
        placement's per-encoder counts while every encoder is healthy.
        """
        check_image_only(items)
        sources = await asyncio.to_thread(self._read_sources, items)
        budget = timeout if timeout is not None else self.timeout
        results = await self._encode_sources(request_id, sources, num_items_assigned, time.monotonic() + budget)
        return EncodeResult(request_id, [results[i] for i in range(len(items))])

    def _read_sources(self, items: Sequence[Mapping[str, Any]]) -> list[ImageSource]:
        return [ImageSource(index, read_image_bytes(item, index, self.file_roots)) for index, item in enumerate(items)]

    async def _encode_sources(
        self,
        request_id: str,
        sources: Sequence[ImageSource],
        num_items_assigned: Sequence[int] | None,
        deadline: float,
    ) -> dict[int, ItemResult]:
        """Places items on encoders, and re-places those of every failed shard, until all are done.

        Items an encoder refused as overloaded wait out a jittered back-off that doubles with each of
        their attempts, on a timer, while the other shards go on; meanwhile that encoder is avoided
        where another can take them.
        """
        results: dict[int, ItemResult] = {}
        attempts: dict[int, list[ItemAttempt]] = {source.index: [] for source in sources}
        excluded: set[int] = set()  # encoders that failed this request
        busy_until: dict[int, float] = {}  # encoders that said they were overloaded, and until when to avoid them
        running: dict[asyncio.Task, int | None] = {}  # shard calls by encoder; back-off timers by None
        to_place = [source.index for source in sources]
        assigned = num_items_assigned
        last_error: ShardError | None = None

        def fail(code: grpc.StatusCode, reason: str, encoder_url: str = "") -> EncodeFailedError:
            return EncodeFailedError(
                request_id=request_id,
                code=code,
                reason=reason,
                encoder_url=encoder_url,
                attempts=attempts,
                completed=set(results),
            )

        try:
            while True:
                if to_place:
                    encoders = await self._pool.usable(excluded, deadline)
                    now = time.monotonic()
                    idle = [e for e in encoders if busy_until.get(e, 0.0) <= now]
                    encoders = idle or encoders
                    if not encoders:
                        if last_error is None:
                            raise fail(grpc.StatusCode.UNAVAILABLE, "no encoder is healthy")
                        raise fail(
                            last_error.code or grpc.StatusCode.INTERNAL,
                            "every encoder failed or is unhealthy",
                            last_error.encoder_url,
                        )
                    if assigned is not None and len(encoders) != len(self._endpoints):
                        assigned = None  # the fixed counts name encoders that cannot take them now
                    for shard in plan_shards(len(to_place), len(encoders), self._rng, assigned):
                        encoder = encoders[shard.encoder]
                        indices = [to_place[i] for i in shard.items]
                        task = asyncio.create_task(
                            self._run_shard(request_id, encoder, indices, sources, results, attempts, deadline)
                        )
                        running[task] = encoder
                    to_place, assigned = [], None
                if not running:
                    return results
                done, _ = await asyncio.wait(
                    running, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    raise fail(_DEADLINE, "the request's deadline passed")
                for task in done:
                    encoder = running.pop(task)
                    if encoder is None:  # a back-off timer: its items are due again
                        to_place.extend(task.result())
                        continue
                    error = task.result()
                    if error is None:
                        self._pool.mark_healthy(encoder)
                        continue
                    last_error = error
                    for index in error.item_indices:
                        attempts[index].append(ItemAttempt(error.encoder_url, error.status, error.message))
                    if _callers_fault(error):
                        raise fail(_INVALID, "the request was refused as invalid", error.encoder_url)
                    if error.code == _DEADLINE:
                        raise fail(_DEADLINE, "the request's deadline passed", error.encoder_url)
                    exhausted = [i for i in error.item_indices if len(attempts[i]) >= self.failover.max_attempts]
                    if exhausted:
                        raise fail(
                            error.code or grpc.StatusCode.INTERNAL,
                            f"items {exhausted} failed {self.failover.max_attempts} attempts",
                            error.encoder_url,
                        )
                    if error.code == _BUSY:  # overloaded is not broken: not benched for other requests
                        tries = max(len(attempts[i]) for i in error.item_indices)
                        delay = self.failover.busy_backoff_s * 2 ** (tries - 1) * self._jitter.uniform(0.5, 1.5)
                        delay = min(delay, max(0.0, deadline - time.monotonic()))
                        busy_until[encoder] = time.monotonic() + delay
                        running[asyncio.create_task(asyncio.sleep(delay, result=error.item_indices))] = None
                        continue
                    excluded.add(encoder)
                    self._pool.mark_failed(encoder, f"{error.status}: {error.message}")
                    log.warning("request %s: %s; re-sharding its items", request_id, error)
                    to_place.extend(error.item_indices)
                to_place.sort()
        finally:
            for task in running:
                task.cancel()

    async def _run_shard(
        self,
        request_id: str,
        encoder: int,
        indices: list[int],
        sources: Sequence[ImageSource],
        results: dict[int, ItemResult],
        attempts: dict[int, list[ItemAttempt]],
        deadline: float,
    ) -> ShardError | None:
        """One Encode call for `indices` on one encoder; stores each item as its last byte arrives.

        Returns None when every item arrived, else a ShardError naming the items that did not; an
        item cut off half-way is dropped whole, so a retry rewrites it from scratch. A stream
        silent for `stall_timeout_s` whose encoder then fails a health probe is abandoned.
        """
        endpoint = self._endpoints[encoder]

        def shard_error(code: grpc.StatusCode | None, message: str) -> ShardError:
            return ShardError(
                encoder_url=endpoint.url,
                request_id=request_id,
                item_indices=assembler.missing(),
                code=code,
                message=message,
            )

        request = pb.EncodeRequest(
            request_id=request_id,
            items=[pb.ImageItem(index=i, modality=pb.IMAGE, data=sources[i].data) for i in indices],
        )
        assembler = ShardAssembler(indices, endpoint.url)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return shard_error(_DEADLINE, "the request's deadline passed before the call")
        call = endpoint.encode(request, timeout=remaining, metadata=endpoint.metadata)
        watch = _StallWatch(self.failover)
        watchdog = asyncio.create_task(watch.run(endpoint, call))
        try:
            async for message in call:
                watch.last_message = time.monotonic()
                done = assembler.feed(message)
                if done is not None:
                    results[done.index] = done
                    attempts[done.index].append(ItemAttempt(endpoint.url, "OK"))
        except grpc.aio.AioRpcError as exc:
            if watch.stalled:
                return shard_error(grpc.StatusCode.UNAVAILABLE, watch.reason)
            return shard_error(exc.code(), exc.details() or "")
        except StreamProtocolError as exc:
            call.cancel()
            return shard_error(None, str(exc))
        except asyncio.CancelledError:
            if watch.stalled:  # the watchdog cancelled the call; nobody cancelled this task
                return shard_error(grpc.StatusCode.UNAVAILABLE, watch.reason)
            raise
        finally:
            watchdog.cancel()
        if assembler.missing():
            return shard_error(None, "stream ended before these items arrived")
        return None


class _StallWatch:
    """Watches one call: after `stall_timeout_s` without a message it probes the encoder, and
    cancels the call unless the probe answers SERVING (a busy encoder is left alone)."""

    __slots__ = ("policy", "last_message", "stalled", "reason")

    def __init__(self, policy: FailoverPolicy):
        self.policy = policy
        self.last_message = time.monotonic()
        self.stalled = False
        self.reason = ""

    async def run(self, endpoint: EncoderEndpoint, call: grpc.aio.UnaryStreamCall) -> None:
        stall = self.policy.stall_timeout_s
        while True:
            wait = self.last_message + stall - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if await endpoint.is_serving(self.policy.probe_timeout_s):
                self.last_message = time.monotonic()
                continue
            self.stalled = True
            self.reason = f"no message for {stall:g} s and no SERVING answer to a health probe: abandoned"
            call.cancel()
            return


__all__ = ["ClientTls", "EncodeFailedError", "EncoderError", "EncoderReceiver", "FailoverPolicy"]
