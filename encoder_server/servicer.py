"""The EncoderService servicer: protobuf in, preprocessing pool and batcher, framed bytes out."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import wire
from protos.errors import EncoderError, InvalidItemError, OverloadedError, UnsupportedModalityError, status_for

from . import __version__
from .batcher import Batcher, EncodedItem
from .config import ServerConfig
from .images import decode_image
from .metrics import ServerMetrics, recorded
from .models import ModelSpec, PreparedImage, VisionEncoder
from .sources import item_bytes
from .shm import ShmCall, ShmSegments

log = logging.getLogger(__name__)


def model_info(spec: ModelSpec, config: ServerConfig, random_weights: bool) -> pb.ModelInfo:
    return pb.ModelInfo(
        family=spec.family,
        model_type=spec.model_type,
        hidden_size=spec.hidden_size,
        dtype=wire.WIRE_DTYPES[spec.dtype],
        patch_size=spec.patch_size,
        spatial_merge_size=spec.spatial_merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        num_deepstack_layers=spec.num_deepstack_layers,
        weights_fingerprint=spec.weights_fingerprint,
        device=str(spec.device),
        random_weights=random_weights,
        max_items_per_request=config.max_items_per_request,
        max_request_bytes=config.max_request_bytes,
        server_version=__version__,
    )


def parse_request(raw: bytes) -> pb.EncodeRequest:
    """Parses an Encode request, refusing bytes that are not one and fields this server does not know.

    Unknown fields are refused rather than skipped: a newer receiver's field may change what the
    embedding should be, and an embedding silently computed without it would be wrong.
    """
    try:
        request = pb.EncodeRequest.FromString(raw)
    except DecodeError:
        raise InvalidItemError(f"request is not a valid {pb.EncodeRequest.DESCRIPTOR.full_name} message") from None
    unknown = [field.field_number for field in UnknownFieldSet(request)]
    if unknown:
        raise InvalidItemError(f"request has fields unknown to this server: numbers {sorted(set(unknown))}")
    for item in request.items:
        unknown = [field.field_number for field in UnknownFieldSet(item)]
        if unknown:
            raise InvalidItemError(f"item {item.index}: fields unknown to this server: numbers {sorted(set(unknown))}")
    return request


def check_request(request: pb.EncodeRequest, config: ServerConfig) -> None:
    """Refuses a request whose shape is wrong before any of its items is decoded."""
    non_image = [pb.Modality.Name(item.modality).lower() for item in request.items if item.modality != pb.IMAGE]
    if non_image:
        raise UnsupportedModalityError(non_image)
    if not request.items:
        raise InvalidItemError("request has no items")
    if len(request.items) > config.max_items_per_request:
        raise InvalidItemError(
            f"request has {len(request.items)} items, over the limit of {config.max_items_per_request}"
        )
    indices = [item.index for item in request.items]
    if len(set(indices)) != len(indices):
        raise InvalidItemError(f"request repeats item indices: {indices}")
    size = request.ByteSize()
    if size > config.max_request_bytes:
        raise InvalidItemError(f"request is {size} bytes, over the limit of {config.max_request_bytes}")


def _maps_errors(method: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    """Parses the raw request, then turns domain errors into their status code, and anything else
    into a bare INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self, request: bytes, context: grpc.aio.ServicerContext):
        try:
            request = parse_request(request)
            async for message in method(self, request, context):
                yield message
        except EncoderError as exc:
            await context.abort(status_for(exc), str(exc))
        except Exception:
            log.exception("request %r failed", getattr(request, "request_id", "?"))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while encoding; see the server log")

    return wrapper


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    def __init__(
        self,
        encoder: VisionEncoder,
        batcher: Batcher,
        preprocess_pool: Executor,
        config: ServerConfig,
        random_weights: bool,
        metrics: ServerMetrics | None = None,
        shm: ShmSegments | None = None,
    ):
        self.encoder = encoder
        self.batcher = batcher
        self.preprocess_pool = preprocess_pool
        self.config = config
        self.shm = shm
        self.info = model_info(encoder.spec, config, random_weights)
        self.metrics = metrics or ServerMetrics()
        self._preprocessing = 0  # items of admitted calls not yet in the batcher's queue

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    @_maps_errors
    @recorded
    async def Encode(self, request: pb.EncodeRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        started = time.perf_counter()
        check_request(request, self.config)
        self._admit(len(request.items))
        loop = asyncio.get_running_loop()
        self._preprocessing += len(request.items)
        try:
            prepared = await asyncio.gather(
                *(loop.run_in_executor(self.preprocess_pool, self._prepare, item) for item in request.items)
            )
        finally:
            self._preprocessing -= len(request.items)
        preprocess_ms = (time.perf_counter() - started) * 1000
        futures = self.batcher.submit(prepared)
        shm = ShmCall(self.shm, request)
        try:
            for item, prep, future in zip(request.items, prepared, futures):
                encoded: EncodedItem = await future
                for message in self._item_messages(item.index, prep, encoded, preprocess_ms, shm):
                    yield message
            shm.hand_over()
        finally:
            for future in futures:
                future.cancel()  # no-op for finished ones; frees queued work of a cancelled call
            shm.close()  # takes back the segments of a call cancelled, failed or out of time

    def _admit(self, count: int) -> None:
        """Refuses a call before preprocessing when its items would not fit beside the queued and the
        preprocessing ones: under overload, refusals come at once instead of after decoding."""
        limit = self.batcher.config.max_queue_items
        waiting = self.batcher.queue_depth + self._preprocessing
        if waiting + count > limit:
            raise OverloadedError(
                f"encoder queue is full ({waiting} items queued or preprocessing, {count} more asked; limit {limit})"
            )

    def _prepare(self, item: pb.ImageItem) -> PreparedImage:
        """Bytes to pixel values, on a preprocessing thread. Errors name the item."""
        try:
            data = item_bytes(item, self.config.sources)
            image = decode_image(
                data, max_pixels=self.config.max_image_pixels, max_aspect_ratio=self.config.max_aspect_ratio
            )
            try:
                return self.encoder.preprocess(image)
            except ValueError as exc:  # the processor's own refusals (sizes, ratios) of a decodable image
                raise InvalidItemError(f"the image processor refused it: {exc}") from None
        except InvalidItemError as exc:
            raise InvalidItemError(f"item {item.index}: {exc}") from None

    def _item_messages(
        self, index: int, prep: PreparedImage, encoded: EncodedItem, preprocess_ms: float, shm: ShmCall | None = None
    ):
        output = encoded.output
        parts = [output.embedding] + ([output.deepstack] if output.deepstack is not None else [])
        num_layers = 0 if output.deepstack is None else output.deepstack.shape[0]
        header = pb.ItemHeader(
            index=index,
            num_tokens=prep.num_tokens,
            grid_thw=prep.grid_thw,
            hidden_size=output.embedding.shape[1],
            dtype=wire.WIRE_DTYPES[output.embedding.dtype],
            num_deepstack_layers=num_layers,
            payload_bytes=sum(part.numel() * part.element_size() for part in parts),
            timing=pb.Timing(queue_ms=encoded.queue_ms, preprocess_ms=preprocess_ms, forward_ms=encoded.forward_ms),
        )
        placed = shm is not None and shm.place(header, parts)  # same-host fast path: no chunks follow
        yield pb.EncodeResponse(header=header)
        if not placed:
            for part in parts:
                yield from wire.chunk_messages(wire.tensor_bytes(part))


def method_handlers(servicer: EncoderServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with Encode's responses framed by protos.wire instead of protobuf."""
    service = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name
    return grpc.method_handlers_generic_handler(
        service,
        {
            # Requests arrive as bytes and are parsed inside the call, so that undecodable bytes get
            # INVALID_ARGUMENT instead of gRPC's INTERNAL for a failing deserializer.
            "Encode": grpc.unary_stream_rpc_method_handler(
                servicer.Encode,
                request_deserializer=None,
                response_serializer=wire.serialize_response,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo,
                request_deserializer=None,  # an empty message: nothing to read
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )
