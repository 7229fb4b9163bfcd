"""The model the encoders serve, as their ModelInfo says (fetched once per receiver): what a request's
precomputed items are checked against before they are turned into results."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from encoder_common.errors import error_class_for
from protos import encoder_pb2 as pb

from ..embeddings.precomputed import agreed_model, is_precomputed, precomputed_results
from ..embeddings.result import ItemResult
from .discovery import EndpointPool


class ServedModel:
    """The encoders' ModelInfo: every encoder's on demand, and the one they agree on, fetched once."""

    def __init__(self, pool: EndpointPool, timeout: float, hidden_size: int | None):
        self.pool = pool
        self.timeout = timeout
        self.hidden_size = hidden_size  # checks precomputed items while no ModelInfo has been fetched
        self.info: pb.ModelInfo | None = None
        self._lock = asyncio.Lock()

    async def infos(self) -> dict[str, pb.ModelInfo]:
        """Each encoder's ModelInfo, by URL."""
        endpoints = await self.pool.endpoints()
        request = pb.GetModelInfoRequest()
        infos = await asyncio.gather(
            *(e.get_model_info(request, timeout=self.timeout, metadata=e.metadata) for e in endpoints)
        )
        return {e.url: info for e, info in zip(endpoints, infos)}

    async def agreed(self) -> pb.ModelInfo:
        """The model the encoders serve; they must agree on hidden size and dtype."""
        async with self._lock:
            if self.info is None:
                try:
                    infos = await self.infos()
                except grpc.aio.AioRpcError as exc:
                    status = f"{exc.code().name}: {exc.details()}"
                    message = f"cannot fetch ModelInfo to check precomputed items: {status}"
                    raise error_class_for(exc.code())(message) from None
                self.info = agreed_model(infos)
        return self.info

    async def precomputed_results(self, items: Sequence[Mapping[str, Any]]) -> dict[int, ItemResult]:
        """Results of the items that carry their embedding, by index.

        ModelInfo is fetched for them only when the request talks to the encoders anyway: a request
        of precomputed items alone must be served while every encoder is down.
        """
        indices = [index for index, item in enumerate(items) if is_precomputed(item)]
        if not indices:
            return {}
        info = await self.agreed() if len(indices) < len(items) else self.info
        return await asyncio.to_thread(precomputed_results, items, indices, info, self.hidden_size)
