"""The EncoderService servicer: protobuf in, preprocessing pool and batcher, framed bytes out."""

from __future__ import annotations

import asyncio
import functools
import hashlib
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
from encoder_common.errors import EncoderError, InvalidItemError, UnsupportedModalityError, status_for

from . import __version__
from .batcher import Batcher
from .cache import EmbeddingCache
from .config import ServerConfig
from .images import decode_image
from .metrics import ServerMetrics, recorded
from .models import ModelSpec, PreparedImage, VisionEncoder
from .payload import ItemPayload
from .shm import ShmCall, ShmSegments
from .sources import item_bytes
from .streams import StreamBudget, StreamCharge

log = logging.getLogger(__name__)

# Items up to this size are read and hashed on the event loop (sha256 runs at 0.4-1.6 GB/s here: at
# most ~2 ms for 1 MiB, ~0.3 ms for a typical 470 KB JPEG): cheaper than the round trip to a
# preprocessing thread, which on a loaded host costs more than the hash itself and was half of a
# cache hit's per-call time. (Telling the size copies the bytes out of the message, ~0.1 ms per MiB.)
INLINE_READ_BYTES = 1 << 20


# Free-text fields are bounded: they end up in logs and errors (a 1 MB request id was once accepted
# and logged). Request ids are UUID-like; URLs other than data: URIs (which carry the image itself
# and count against max_request_bytes) are short.
MAX_REQUEST_ID_CHARS = 256
MAX_URL_CHARS = 8192
MAX_PROBE_NAME_CHARS = 256


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
        extra_tokens_per_item=spec.extra_tokens_per_item,
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
    check_text_fields(request)
    return request


def check_text_fields(request: pb.EncodeRequest) -> None:
    """Refuses over-long free-text fields, naming the field, before anything logs them."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidItemError(
            f"request_id is {len(request.request_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}"
        )
    if len(request.shm.probe) > MAX_PROBE_NAME_CHARS:
        raise InvalidItemError(f"shm.probe is {len(request.shm.probe)} characters, over the limit of {MAX_PROBE_NAME_CHARS}")
    for item in request.items:
        if item.WhichOneof("source") == "url" and not item.url.startswith("data:") and len(item.url) > MAX_URL_CHARS:
            raise InvalidItemError(f"item {item.index}: url is {len(item.url)} characters, over the limit of {MAX_URL_CHARS}")


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
        *,
        metrics: ServerMetrics | None = None,
        shm: ShmSegments | None = None,
        cache: EmbeddingCache | None = None,
        streams: StreamBudget | None = None,
    ):
        self.encoder = encoder
        self.batcher = batcher
        self.preprocess_pool = preprocess_pool
        self.config = config
        self.shm = shm
        self.cache = cache
        self.streams = streams or StreamBudget(config.streams)
        self.info = model_info(encoder.spec, config, random_weights)
        self.metrics = metrics or ServerMetrics()
        self._preprocessing = 0  # items of admitted calls not yet in the batcher's queue (nor done)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    @_maps_errors
    @recorded
    async def Encode(self, request: pb.EncodeRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        check_request(request, self.config)
        await self.streams.admit()
        # Refused at once, before any decoding, when the call's items would not fit beside those
        # queued and those still being read or preprocessed: under overload refusals stay fast.
        self.batcher.check_room(len(request.items) + self._preprocessing)
        self._preprocessing += len(request.items)
        charge = self.streams.call()
        # Each item goes its own way (cache hit, another call's computation, or the batcher) as soon
        # as its bytes are read; the stream still sends them in request order.
        tasks = [asyncio.ensure_future(self._item_payload(item, charge)) for item in request.items]
        for task in tasks:
            task.add_done_callback(_retrieve_exception)  # items left behind when an earlier one failed
        shm = ShmCall(self.shm, request)
        try:
            for item, task in zip(request.items, tasks):
                payload, cache_hit = await task
                message = payload.header_message(item.index, cache_hit)
                placed = shm.place(message.header, payload.payload_views())  # same host: no chunks follow
                # Each message records when it began waiting for the receiver: the budget's watchdog
                # cancels a stream stuck longer than the stall timeout.
                charge.sending_since = time.monotonic()
                yield message
                if not placed:
                    for chunk in payload.chunks():
                        charge.sending_since = time.monotonic()
                        yield chunk
                charge.sending_since = None
                charge.release(item.index)
            shm.hand_over()
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished ones; a cancelled call's items leave the queue
            shm.close()  # takes back the segments of a call cancelled, failed or out of time
            charge.close()

    async def _item_payload(self, item: pb.ImageItem, charge: StreamCharge) -> tuple[ItemPayload, bool]:
        """An item's response and whether it came from the cache, charged to the call's stream budget
        until sent (a computed one from before its forward). Errors name the item."""
        loop = asyncio.get_running_loop()
        admitted = _Admission(self)
        try:
            if item.WhichOneof("source") == "data" and len(item.data) <= INLINE_READ_BYTES:
                data, key = self._read_item(item)
            else:
                data, key = await loop.run_in_executor(self.preprocess_pool, self._read_item, item)
            compute = functools.partial(self._compute, data, admitted, charge, item.index)
            if key is None:  # the cache is off
                return await compute(), False
            payload, hit = await self.cache.get_or_compute(key, compute)
            if hit:  # from the cache, or another call's computation: this stream holds it too
                await charge.reserve(item.index, payload.nbytes)
            return payload, hit
        except InvalidItemError as exc:
            raise InvalidItemError(f"item {item.index}: {exc}") from None
        finally:
            admitted.done()

    def _read_item(self, item: pb.ImageItem) -> tuple[bytes, bytes | None]:
        """The item's bytes and, with the cache on, its cache key; on a preprocessing thread unless small."""
        data = item_bytes(item, self.config.sources)
        if self.cache is None:
            return data, None
        # item_bytes has checked a client's content_sha256 against the bytes: no need to hash them again.
        return data, self.cache.key(item.content_sha256 or hashlib.sha256(data).digest())

    async def _compute(self, data: bytes, admitted: _Admission, charge: StreamCharge, index: int) -> ItemPayload:
        """Decode, preprocess, forward (batched with other calls' items) and frame one item.

        The payload is charged to the stream budget before the forward makes it (twice: the output
        tensors live until their last chunk is framed): a call refused for want of room costs no
        forward and holds no output.
        """
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        prepared = await loop.run_in_executor(self.preprocess_pool, self._prepare, data)
        preprocess_ms = (time.perf_counter() - started) * 1000
        spec = self.encoder.spec
        payload_bytes = (1 + spec.num_deepstack_layers) * prepared.num_tokens * spec.hidden_size * spec.dtype.itemsize
        await charge.reserve(index, 2 * payload_bytes)  # the output, and its chunks as they are framed
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
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo,
                request_deserializer=None,  # an empty message: nothing to read
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )
