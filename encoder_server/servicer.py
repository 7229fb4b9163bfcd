"""The EncoderService servicer: protobuf in, preprocessing pool and batcher, framed bytes out."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import wire
from encoder_common.errors import (
    EncoderError,
    InvalidItemError,
    NotFoundError,
    UnsupportedModalityError,
    status_for,
)

from . import __version__
from .batcher import Batcher
from .cache import EmbeddingCache, cache_namespace, content_key
from .config import ServerConfig
from .images import decode_image
from .leases import LeaseStore
from .metrics import ServerMetrics, recorded
from .models import ModelSpec, PreparedImage, VisionEncoder
from .payload import ItemPayload
from .shm import ShmCall, ShmSegments
from .sources import item_bytes

log = logging.getLogger(__name__)

# Items up to this size are read and hashed on the event loop (sha256 of 64 KiB: ~50 us): cheaper
# than the round trip to a preprocessing thread, which cost ~0.25 ms of CPU per call on a cache hit.
# (Telling the size copies the bytes out of the message, ~0.1 ms per MiB; ByteSize() costs more.)
INLINE_READ_BYTES = 64 << 10


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
        lease_max_bytes=config.leases.max_bytes,
        lease_max_ttl_ms=int(config.leases.max_ttl_s * 1000),
    )


def _parse_message(raw: bytes, message_class: type[Message]) -> Message:
    """Parses a request, refusing bytes that are not one and top-level fields this server does not know.

    Unknown fields are refused rather than skipped: a newer receiver's field may change what the
    embedding should be, and an embedding silently computed without it would be wrong.
    """
    try:
        request = message_class.FromString(raw)
    except DecodeError:
        raise InvalidItemError(f"request is not a valid {message_class.DESCRIPTOR.full_name} message") from None
    unknown = [field.field_number for field in UnknownFieldSet(request)]
    if unknown:
        raise InvalidItemError(f"request has fields unknown to this server: numbers {sorted(set(unknown))}")
    return request


def parse_request(raw: bytes) -> pb.EncodeRequest:
    """Parses an Encode request; unknown fields in it or in its items are refused (see _parse_message)."""
    request = _parse_message(raw, pb.EncodeRequest)
    for item in request.items:
        unknown = [field.field_number for field in UnknownFieldSet(item)]
        if unknown:
            raise InvalidItemError(f"item {item.index}: fields unknown to this server: numbers {sorted(set(unknown))}")
    return request


def parse_fetch_request(raw: bytes, max_keys: int) -> pb.FetchRequest:
    """Parses a Fetch request; refuses unknown fields and key lists that are empty, too long or malformed."""
    request = _parse_message(raw, pb.FetchRequest)
    if not request.keys:
        raise InvalidItemError("fetch request has no keys")
    if len(request.keys) > max_keys:
        raise InvalidItemError(f"fetch request has {len(request.keys)} keys, over the limit of {max_keys}")
    bad = [index for index, key in enumerate(request.keys) if len(key) != 32]
    if bad:
        raise InvalidItemError(f"keys at positions {bad} are not 32-byte content keys")
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
    """Parses the raw request (with the servicer's `parse_<method name>`), then turns domain errors into
    their status code, and anything else into a bare INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self, request: bytes, context: grpc.aio.ServicerContext):
        try:
            request = getattr(self, f"parse_{method.__name__}")(request)
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
        *,
        metrics: ServerMetrics | None = None,
        shm: ShmSegments | None = None,
        cache: EmbeddingCache | None = None,
        leases: LeaseStore | None = None,
    ):
        self.encoder = encoder
        self.batcher = batcher
        self.preprocess_pool = preprocess_pool
        self.config = config
        self.shm = shm
        self.cache = cache
        self.leases = leases
        self.namespace = cache_namespace(encoder.spec)
        self.info = model_info(encoder.spec, config, random_weights)
        self.metrics = metrics or ServerMetrics()
        self._preprocessing = 0  # items of admitted calls not yet in the batcher's queue (nor done)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    def parse_Encode(self, raw: bytes) -> pb.EncodeRequest:
        return parse_request(raw)

    def parse_Fetch(self, raw: bytes) -> pb.FetchRequest:
        return parse_fetch_request(raw, self.config.max_items_per_request)

    @_maps_errors
    @recorded
    async def Encode(self, request: pb.EncodeRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        check_request(request, self.config)
        # Refused at once, before any decoding, when the call's items would not fit beside those
        # queued and those still being read or preprocessed: under overload refusals stay fast.
        self.batcher.check_room(len(request.items) + self._preprocessing)
        self._preprocessing += len(request.items)
        # Each item goes its own way (cache hit, another call's computation, or the batcher) as soon
        # as its bytes are read; the stream still sends them in request order.
        tasks = [asyncio.ensure_future(self._item_payload(item)) for item in request.items]
        for task in tasks:
            task.add_done_callback(_retrieve_exception)  # items left behind when an earlier one failed
        lease_ms = request.lease.ttl_ms if request.HasField("lease") else None
        send_payloads = not request.lease.withhold_payload
        if lease_ms is not None and self.leases is None:
            raise InvalidItemError("this server grants no leases (--lease-max-bytes is 0)")
        shm = ShmCall(self.shm, request)
        try:
            for item, task in zip(request.items, tasks):
                payload, cache_hit, key = await task
                message = payload.header_message(item.index, cache_hit)
                if lease_ms is not None:
                    message.header.lease.CopyFrom(self.leases.grant(key, payload, lease_ms))
                if not send_payloads:
                    yield message
                    continue
                for framed in _item_messages(shm, message, payload):
                    yield framed
            shm.hand_over()
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished ones; a cancelled call's items leave the queue
            shm.close()  # takes back the segments of a call cancelled, failed or out of time

    @_maps_errors
    async def Fetch(self, request: pb.FetchRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        """Streams leased items in Encode's format; every key is looked up before the first message."""
        if self.leases is None:
            raise NotFoundError("this server grants no leases (--lease-max-bytes is 0): nothing to fetch")
        payloads = [self.leases.get(key) for key in request.keys]
        shm = ShmCall(self.shm, request)
        try:
            for index, payload in enumerate(payloads):
                for framed in _item_messages(shm, payload.header_message(index, cache_hit=False), payload):
                    yield framed
            shm.hand_over()
        finally:
            shm.close()
        for key in request.keys:
            self.leases.fetched(key)

    async def _item_payload(self, item: pb.ImageItem) -> tuple[ItemPayload, bool, bytes | None]:
        """An item's response, whether it came from the cache, and its content key. Errors name the item."""
        loop = asyncio.get_running_loop()
        admitted = _Admission(self)
        try:
            if item.WhichOneof("source") == "data" and len(item.data) <= INLINE_READ_BYTES:
                data, key = self._read_item(item)
            else:
                data, key = await loop.run_in_executor(self.preprocess_pool, self._read_item, item)
            if self.cache is None:
                return await self._compute(data, admitted), False, key
            payload, cache_hit = await self.cache.get_or_compute(key, functools.partial(self._compute, data, admitted))
            return payload, cache_hit, key
        except InvalidItemError as exc:
            raise InvalidItemError(f"item {item.index}: {exc}") from None
        finally:
            admitted.done()

    def _read_item(self, item: pb.ImageItem) -> tuple[bytes, bytes | None]:
        """The item's bytes and, with the cache or leases on, its content key; on a preprocessing thread
        unless small."""
        data = item_bytes(item, self.config.sources)
        if self.cache is None and self.leases is None:
            return data, None
        # item_bytes has checked a client's content_sha256 against the bytes: no need to hash them again.
        return data, content_key(self.namespace, item.content_sha256 or hashlib.sha256(data).digest())

    async def _compute(self, data: bytes, admitted: _Admission) -> ItemPayload:
        """Decode, preprocess, forward (batched with other calls' items) and frame one item."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        prepared = await loop.run_in_executor(self.preprocess_pool, self._prepare, data)
        preprocess_ms = (time.perf_counter() - started) * 1000
        (future,) = self.batcher.submit([prepared])
        admitted.done()  # it counts in the batcher's queue now
        encoded = await future
        return ItemPayload.build(prepared, encoded, preprocess_ms)

    def _prepare(self, data: bytes) -> PreparedImage:
        """Bytes to pixel values, on a preprocessing thread."""
        image = decode_image(data, max_pixels=self.config.max_image_pixels, max_aspect_ratio=self.config.max_aspect_ratio)
        try:
            return self.encoder.preprocess(image)
        except ValueError as exc:  # the processor's own refusals (sizes, ratios) of a decodable image
            raise InvalidItemError(f"the image processor refused it: {exc}") from None


class _Admission:
    """One admitted item's place in the servicer's count of items not yet queued; given back once."""

    __slots__ = ("servicer", "pending")

    def __init__(self, servicer: EncoderServicer):
        self.servicer = servicer
        self.pending = True

    def done(self) -> None:
        if self.pending:
            self.pending = False
            self.servicer._preprocessing -= 1


def _item_messages(shm: ShmCall, header: pb.EncodeResponse, payload: ItemPayload) -> Iterator[pb.EncodeResponse | bytes]:
    """One item's messages: its header, then its chunks unless the payload went into shared memory."""
    placed = shm.place(header.header, payload.payload_views())  # same host: no chunks follow
    yield header
    if not placed:
        yield from payload.chunks()


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


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
            "Fetch": grpc.unary_stream_rpc_method_handler(
                servicer.Fetch,
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
