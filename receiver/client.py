"""`EncoderReceiver`: what a prefill node calls to encode a request's images on the encoder pods."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from protos import encoder_pb2 as pb
from protos.errors import EncoderError

from .assembly import ShardAssembler, StreamProtocolError
from .channels import EncoderEndpoint
from .errors import ShardError
from .items import ImageSource, check_image_only, read_image_bytes
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
    ):
        """
        Args:
            urls: encoder servers, as `grpc://host:port`.
            timeout: default deadline of one `encode` call, in seconds.
            seed: seeds the random sharding (for tests and reproducible runs).
            file_roots: directories `file://` items may be read from; None allows any path.
        """
        if not urls:
            raise ValueError("EncoderReceiver needs at least one encoder URL")
        self.urls = list(urls)
        self.timeout = timeout
        self.file_roots = None if file_roots is None else [Path(r).resolve() for r in file_roots]
        self._rng = random.Random(seed)
        self._endpoints = [EncoderEndpoint.connect(url) for url in self.urls]

    async def __aenter__(self) -> EncoderReceiver:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(endpoint.close() for endpoint in self._endpoints))

    async def model_info(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        infos = await asyncio.gather(*(e.get_model_info(pb.GetModelInfoRequest(), timeout=self.timeout) for e in self._endpoints))
        return dict(zip(self.urls, infos))

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
        item is not an image, InvalidItemError for an unreadable item, and ShardError when an
        encoder fails its share.
        """
        check_image_only(items)
        if all(item.get("data") is not None for item in items):  # nothing to read: no thread round trip
            sources = self._read_sources(items)
        else:
            sources = await asyncio.to_thread(self._read_sources, items)
        shards = plan_shards(len(sources), len(self._endpoints), self._rng, num_items_assigned)
        deadline = timeout if timeout is not None else self.timeout
        results: dict[int, ItemResult] = {}
        tasks = [
            asyncio.create_task(self._run_shard(request_id, shard, sources, results, deadline)) for shard in shards
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return EncodeResult(request_id, [results[i] for i in range(len(items))])

    def _read_sources(self, items: Sequence[Mapping[str, Any]]) -> list[ImageSource]:
        return [ImageSource(index, read_image_bytes(item, index, self.file_roots)) for index, item in enumerate(items)]

    async def _run_shard(
        self,
        request_id: str,
        shard: Shard,
        sources: Sequence[ImageSource],
        results: dict[int, ItemResult],
        timeout: float,
    ) -> None:
        endpoint = self._endpoints[shard.encoder]
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
