"""The EncoderService servicer: protobuf in, the item pipeline, framed bytes out, each item reported
to the metrics as it is sent."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

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
from .config import ServerConfig
from .leases import LeaseStore
from .metrics import ServerMetrics
from .models import ModelSpec
from .pipeline import ItemPipeline
from .shm import ShmCall, ShmSegments
from .streams import StreamBudget

log = logging.getLogger(__name__)


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
        lease_max_bytes=config.leases.max_bytes,
        lease_max_ttl_ms=int(config.leases.max_ttl_s * 1000),
        preprocess_profile=config.preprocess_profile,
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
    check_text_fields(request)
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
        pipeline: ItemPipeline,
        config: ServerConfig,
        info: pb.ModelInfo,
        metrics: ServerMetrics,
        shm: ShmSegments | None = None,
        leases: LeaseStore | None = None,
        streams: StreamBudget | None = None,
    ):
        self.pipeline = pipeline
        self.config = config
        self.info = info
        self.metrics = metrics
        self.shm = shm
        self.leases = leases
        self.streams = streams or StreamBudget(config.streams)

    def parse_Encode(self, raw: bytes) -> pb.EncodeRequest:
        if len(raw) > self.config.max_request_bytes:  # refused before it is parsed
            raise InvalidItemError(f"request is {len(raw)} bytes, over the limit of {self.config.max_request_bytes}")
        return parse_request(raw)

    def parse_Fetch(self, raw: bytes) -> pb.FetchRequest:
        return parse_fetch_request(raw, self.config.max_items_per_request)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    @_maps_errors
    async def Encode(self, request: pb.EncodeRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        with self.metrics.record(request.request_id, len(request.items), context) as record:
            check_request(request, self.config)
            lease = request.lease if request.HasField("lease") else None
            if lease is not None and self.leases is None:
                raise InvalidItemError("this server grants no leases (--lease-max-bytes is 0)")
            await self.streams.admit()
            shm = ShmCall(self.shm, request)
            charge = self.streams.call()
            try:
                async with contextlib.aclosing(self.pipeline.payloads(request.items, charge)) as payloads:
                    async for item, payload, cache_hit, key in payloads:
                        message = payload.header_message(item.index, cache_hit)
                        if lease is not None:
                            message.header.lease.CopyFrom(self.leases.grant(key, payload, lease.ttl_ms))
                        # No chunks follow a payload withheld for its Fetch, or placed in shared memory.
                        withheld = lease is not None and lease.withhold_payload
                        placed = withheld or shm.place(message.header, payload.payload_views())
                        started = time.perf_counter()
                        # Each message records when it began waiting for the receiver: the budget's
                        # watchdog cancels a stream stuck longer than the stall timeout.
                        charge.sending_since = time.monotonic()
                        yield message
                        if not placed:
                            for chunk in payload.chunks():
                                charge.sending_since = time.monotonic()
                                yield chunk
                        charge.sending_since = None
                        charge.release(item.index)
                        record.item_sent(
                            message.header,
                            response_bytes=message.ByteSize() + (0 if placed else payload.nbytes),
                            stream_s=time.perf_counter() - started,
                        )
                shm.hand_over()
            finally:
                shm.close()  # takes back the segments of a call cancelled, failed or out of time
                charge.close()

    @_maps_errors
    async def Fetch(self, request: pb.FetchRequest, context) -> AsyncIterator[pb.EncodeResponse | bytes]:
        """Streams leased items in Encode's format; every key is looked up before the first message."""
        if self.leases is None:
            raise NotFoundError("this server grants no leases (--lease-max-bytes is 0): nothing to fetch")
        payloads = [self.leases.get(key) for key in request.keys]
        shm = ShmCall(self.shm, request)
        try:
            for index, payload in enumerate(payloads):
                message = payload.header_message(index, cache_hit=False)
                placed = shm.place(message.header, payload.payload_views())
                yield message
                if not placed:
                    for chunk in payload.chunks():
                        yield chunk
            shm.hand_over()
        finally:
            shm.close()
        for key in request.keys:
            self.leases.fetched(key)


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
                response_serializer=wire.serialize,
            ),
            "Fetch": grpc.unary_stream_rpc_method_handler(
                servicer.Fetch,
                request_deserializer=None,
                response_serializer=wire.serialize,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo,
                request_deserializer=None,  # an empty message: nothing to read
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )
