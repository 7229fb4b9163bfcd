"""Where encoder-precompute's embeddings come from: running encoder servers (through an EncoderReceiver)
or the vision tower loaded in this process."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from encoder_common.errors import EncoderError, InvalidItemError
from receiver.client import EncoderReceiver
from receiver.config import ReceiverConfig
from receiver.embeddings.result import ItemResult
from receiver.errors import ShardError

from .files import ModelStamp, dtype_name


class ServerBackend:
    """Encodes through running encoder servers, sharded by an EncoderReceiver."""

    def __init__(self, urls: Sequence[str], config: ReceiverConfig):
        self.receiver = EncoderReceiver(urls, config)

    async def stamp(self) -> ModelStamp:
        served = await self.receiver.served_model()
        fingerprints = {info.weights_fingerprint for info in (await self.receiver.model_info()).values()}
        if len(fingerprints) > 1:
            raise EncoderError(
                f"the encoders serve {len(fingerprints)} different weights; one directory holds one model's"
            )
        return ModelStamp.of_info(served)

    async def encode(self, request_id: str, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        try:
            result = await self.receiver.encode(
                request_id, [{"modality": "image", "data": d} for d in images]
            )
        except ShardError as exc:
            if not issubclass(exc.cause_class, InvalidItemError):
                raise
            if len(images) == 1:
                return [InvalidItemError(str(exc))]
            # Find the bad images one by one, so one broken file does not cost its neighbours.
            return [
                out for i, data in enumerate(images) for out in await self.encode(f"{request_id}.{i}", [data])
            ]
        return result.items

    async def close(self) -> None:
        await self.receiver.close()


class InProcessBackend:
    """Encodes with the vision tower loaded in this process (needs transformers)."""

    def __init__(self, model_dir: str, device: str | None, dtype: torch.dtype):
        from encoder_server.models import load_vision_encoder

        self.encoder = load_vision_encoder(model_dir, device, dtype)

    async def stamp(self) -> ModelStamp:
        spec = self.encoder.spec
        return ModelStamp(
            spec.model_type, spec.weights_fingerprint, dtype_name(spec.dtype), spec.hidden_size
        )

    async def encode(self, request_id: str, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        return await asyncio.to_thread(self._encode, images)

    def _encode(self, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        from encoder_server.images import DEFAULT_MAX_ASPECT_RATIO
        from encoder_server.profiles import DEFAULT_PROFILE, PROFILES

        profile = PROFILES[DEFAULT_PROFILE]  # as a server with default flags encodes the bytes
        outputs: list[ItemResult | InvalidItemError | None] = [None] * len(images)
        prepared = {}
        for i, data in enumerate(images):
            try:
                image = profile.decode(data, max_pixels=None, max_aspect_ratio=DEFAULT_MAX_ASPECT_RATIO)
                prepared[i] = self.encoder.preprocess(image, profile)
            except InvalidItemError as exc:
                outputs[i] = exc
        if prepared:
            for (i, prep), out in zip(prepared.items(), self.encoder.encode(list(prepared.values()))):
                outputs[i] = ItemResult(i, out.embedding, prep.grid_thw, encoder_url=None, deepstack=out.deepstack)
        return outputs  # type: ignore[return-value]

    async def close(self) -> None:
        pass


