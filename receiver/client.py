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
from protos.errors import EncoderError, error_class_for

from .assembly import ShardAssembler, StreamProtocolError
from .channels import EncoderEndpoint
from .discovery import DEFAULT_REFRESH_S, EncoderDiscovery, EndpointPool, Resolver, resolve_all
from .errors import ShardError
from .items import ImageSource, check_image_only, read_image_bytes
from .precomputed import agreed_model, is_precomputed, precomputed_result
from .metrics import ReceiverMetrics
from .result import EncodeResult, ItemResult
from .sharding import Shard, plan_shards

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class EncoderReceiver:
    """Shards each request's image items across encoder servers and reassembles their embeddings.

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
        resolver: Resolver = resolve_all,
        refresh_s: float = DEFAULT_REFRESH_S,
        metrics: ReceiverMetrics | None = None,
    ):
        """
        Args:
            urls: encoder servers, as `grpc://host:port`, or `dns:///name:port` for every address
                behind a name (a headless Service's pods), re-resolved as pods come and go.
            timeout: default deadline of one `encode` call, in seconds.
            seed: seeds the random sharding (for tests and reproducible runs).
            file_roots: directories `file://` items may be read from; None allows any path.
            resolver: resolves a `dns:` name; the system resolver unless a test brings its own.
            refresh_s: re-resolve `dns:` names when their addresses are older than this.
            metrics: counters to record into (shared between receivers if given).
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.timeout = timeout
        self.file_roots = None if file_roots is None else [Path(r).resolve() for r in file_roots]
        self._rng = random.Random(seed)
        self.metrics = metrics or ReceiverMetrics()
        self.discovery = EncoderDiscovery(self.urls, resolver=resolver, refresh_s=refresh_s, metrics=self.metrics)
        self._pool = EndpointPool(self.discovery, close_grace_s=timeout)
        self._served_model: pb.ModelInfo | None = None
        self._served_model_lock = asyncio.Lock()

    @property
    def _endpoints(self) -> list[EncoderEndpoint]:
        return self._pool.current

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._pool.close()

    async def model_info(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        endpoints = await self._pool.endpoints()
        infos = await asyncio.gather(*(e.get_model_info(pb.GetModelInfoRequest(), timeout=self.timeout) for e in endpoints))
        return dict(zip([e.url for e in endpoints], infos))

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
        or "url" (`file://` or `data:`), or it carries "precomputed_embedding" (a float tensor
        [num_tokens, hidden_size]; see `precomputed_result` for the optional keys), in which case
        it is checked against `served_model()` and never sent. Only the other items are sharded,
        so `num_items_assigned` counts those. Raises UnsupportedModalityError before any RPC if an
        item is not an image, InvalidItemError for an unreadable item or a bad precomputed one
        (before any Encode call), and ShardError when an encoder fails its share.
        """
        check_image_only(items)
        started = time.perf_counter()
        results = await self._precomputed_results(items)
        raw = [index for index in range(len(items)) if index not in results]
        sources = await asyncio.to_thread(self._read_sources, items, raw)
        endpoints = await self._pool.endpoints()
        shards = plan_shards(len(sources), len(endpoints), self._rng, num_items_assigned)
        deadline = timeout if timeout is not None else self.timeout
        tasks = [
            asyncio.create_task(self._run_shard(request_id, shard, sources, results, deadline, endpoints))
            for shard in shards
        ]
        try:
            await asyncio.gather(*tasks)
        except ShardError as exc:
            self._shard_failed(exc)
            raise
        finally:
            for task in tasks:
                task.cancel()
            done = len(results) == len(items)
            self.metrics.request_done(time.perf_counter() - started, list(results.values()) if done else None)
        return EncodeResult(request_id, [results[i] for i in range(len(items))])

    async def _precomputed_results(self, items: Sequence[Mapping[str, Any]]) -> dict[int, ItemResult]:
        """Results of the items that carry their embedding, by index; ModelInfo is fetched only for them."""
        indices = [index for index, item in enumerate(items) if is_precomputed(item)]
        if not indices:
            return {}
        info = await self.served_model()
        return await asyncio.to_thread(lambda: {i: precomputed_result(items[i], i, info) for i in indices})

    def _shard_failed(self, error: ShardError) -> None:
        """Counts the failure; an unreachable encoder makes discovery re-resolve and skip it a while."""
        code = error.code.name if error.code is not None else "PROTOCOL"
        self.metrics.shard_failed(error.encoder_url, code)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.discovery.report_failure(error.encoder_url)

    def _read_sources(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[ImageSource]:
        return [ImageSource(index, read_image_bytes(items[index], index, self.file_roots)) for index in indices]

    async def _run_shard(
        self,
        request_id: str,
        shard: Shard,
        sources: Sequence[ImageSource],
        results: dict[int, ItemResult],
        timeout: float,
        endpoints: Sequence[EncoderEndpoint],
    ) -> None:
        endpoint = endpoints[shard.encoder]
        shard_sources = [sources[i] for i in shard.items]
        indices = [s.index for s in shard_sources]
        request = pb.EncodeRequest(
            request_id=request_id,
            items=[pb.ImageItem(index=s.index, modality=pb.IMAGE, data=s.data) for s in shard_sources],
        )
        assembler = ShardAssembler(indices, endpoint.url)
        call = endpoint.encode(request, timeout=timeout)
        try:
            async for message in call:
                done = assembler.feed(message)
                if done is not None:
                    results[done.index] = done
        except grpc.aio.AioRpcError as exc:
            raise ShardError(
                encoder_url=endpoint.url,
                request_id=request_id,
                item_indices=assembler.missing(),
                code=exc.code(),
                message=exc.details() or "",
            ) from None
        except StreamProtocolError as exc:
            call.cancel()
            raise ShardError(
                encoder_url=endpoint.url, request_id=request_id, item_indices=assembler.missing(), code=None, message=str(exc)
            ) from None
        missing = assembler.missing()
        if missing:
            raise ShardError(
                encoder_url=endpoint.url,
                request_id=request_id,
                item_indices=missing,
                code=None,
                message="stream ended before these items arrived",
            )


__all__ = ["EncoderReceiver", "EncoderError"]
