"""The EncoderService servicer: parses a request (request_parsing.py), takes its items' flows from the item
pipeline or its payloads from the lease store, and hands them to an ItemSender (sender.py), which charges
and sends them; errors become statuses at the error edge (error_edge.py)."""

from __future__ import annotations

import grpc

from encoder_common.errors import InvalidItemError, NotFoundError
from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import wire

from . import __version__
from .config import ServerConfig
from .error_edge import error_edge
from .leases import LeaseStore
from .metrics import ServerMetrics
from .models import ModelSpec
from .payload import ItemOut
from .pipeline import ItemPipeline, ready
from .request_parsing import EncodeCall, check_encode_request, parse_encode_request, parse_fetch_request
from .sender import ItemSender
from .streams import StreamBudget
from .transports import ServerTransports


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
        backend=spec.backend,
        backend_version=spec.backend_version,
    )


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    def __init__(
        self,
        pipeline: ItemPipeline,
        config: ServerConfig,
        info: pb.ModelInfo,
        metrics: ServerMetrics,
        transports: ServerTransports,
        leases: LeaseStore | None = None,
        streams: StreamBudget | None = None,
    ):
        self.pipeline = pipeline
        self.config = config
        self.info = info
        self.metrics = metrics
        self.transports = transports
        self.leases = leases
        self.streams = streams or StreamBudget(config.streams)

    def parse_Encode(self, raw: bytes) -> EncodeCall:
        return parse_encode_request(raw, self.config.max_request_bytes)

    def parse_Fetch(self, raw: bytes) -> pb.FetchRequest:
        return parse_fetch_request(raw, self.config.max_items_per_request)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    @error_edge
    async def Encode(self, call: EncodeCall, context: grpc.aio.ServicerContext) -> None:
        """Streams each item's header, then its payload (chunks, or placed by the transport the request
        offered), in the items' order."""
        request = call.request
        with self.metrics.record(request.request_id, len(request.items), context) as record:
            check_encode_request(request, self.config.max_items_per_request)
            lease = request.lease if request.HasField("lease") else None
            if lease is not None and self.leases is None:
                raise InvalidItemError("this server grants no leases (--lease-max-bytes is 0)")
            async with self.streams.call(context.peer()) as charge:
                transport = self.transports.open_call(request, context.peer())
                sender = ItemSender(context, charge, record, transport, leases=self.leases, lease=lease)
                with self.pipeline.admit(request.items, call.images) as flows:
                    await sender.send_all(flows)

    @error_edge
    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> None:
        """Streams leased items in Encode's format; every key is looked up before the first message."""
        if self.leases is None:
            raise NotFoundError("this server grants no leases (--lease-max-bytes is 0): nothing to fetch")
        leased = [self.leases.get(key) for key in request.keys]
        with self.metrics.record("fetch", len(leased), context) as record:
            async with self.streams.call(context.peer()) as charge:
                sender = ItemSender(context, charge, record, self.transports.open_call(request, context.peer()))
                await sender.send_all([ready(ItemOut(index, payload)) for index, payload in enumerate(leased)])
        for key in request.keys:
            self.leases.fetched(key)


def method_handlers(servicer: EncoderServicer) -> grpc.GenericRpcHandler:
    """The service's handlers. Encode's and Fetch's responses reach gRPC serialized already (ItemSender:
    each header serialized, each chunk framed by protos.wire), so no serializer runs per message."""
    service = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name
    return grpc.method_handlers_generic_handler(
        service,
        {
            # Requests arrive as bytes and are parsed inside the call, so that undecodable bytes get
            # INVALID_ARGUMENT instead of gRPC's INTERNAL for a failing deserializer.
            "Encode": grpc.unary_stream_rpc_method_handler(
                servicer.Encode,
                request_deserializer=None,
                response_serializer=None,
            ),
            "Fetch": grpc.unary_stream_rpc_method_handler(
                servicer.Fetch,
                request_deserializer=None,
                response_serializer=None,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo,
                request_deserializer=None,  # an empty message: nothing to read
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )
