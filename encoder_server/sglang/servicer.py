"""The `sglang.grpc.encoder.SglangEncoder` servicer: SGLang's Encode calls go through the native item
pipeline (admission, cache, batcher), and each part's embedding, or its error, is pushed over ZMQ to the
SGLang receiver as SGLang's own encoder pushes it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import grpc

from encoder_common.errors import EncoderError, InvalidItemError, UnsupportedModalityError, http_status_for
from protos import encoder_pb2 as pb
from protos import sglang_encoder_pb2 as sglang_pb

from ..config import ServerConfig
from ..error_edge import error_edge
from ..metrics import ServerMetrics
from ..pipeline import ItemPipeline
from ..request_parsing import check_receive_url_request, check_sglang_encode_request, parse_message
from ..sender import ItemSender
from ..streams import StreamBudget
from .config import SglangConfig
from .embedding_data import PartMeta, embedding_data_pickle
from .items import read_item
from .parts import Part, join_part
from .pusher import DeliveryError, ZmqPusher, endpoint, endpoint_of_url
from .receive_urls import ReceiveUrls

log = logging.getLogger(__name__)

SERVICE_NAME = sglang_pb.DESCRIPTOR.services_by_name["SglangEncoder"].full_name

# Telling a receiver about a failure waits at most this long (a receiver that is gone must not hold
# the call's status back for the whole push timeout).
ERROR_PUSH_TIMEOUT_S = 5.0
SEND_UNIMPLEMENTED = (
    "Send (Mooncake RDMA transfer) is not served by this encoder server: run SGLang with "
    "--encoder-transfer-backend zmq_to_tokenizer or zmq_to_scheduler (SGLang's gRPC receiver "
    "supports only those two)"
)


class SglangEncoderServicer:
    """Serves SGLang's contract with the native Encode's item pipeline (same cache, batcher) and metrics."""

    def __init__(self, pipeline: ItemPipeline, server_config: ServerConfig, metrics: ServerMetrics, streams: StreamBudget):
        self.pipeline = pipeline
        self.streams = streams
        self.server_config = server_config
        self.config: SglangConfig = server_config.sglang
        self.metrics = metrics
        self.layout = self.config.layout
        log.info(
            "SglangEncoder pushes EmbeddingData for SGLang %s (the layout of %s to %s; --sglang-version)",
            self.config.version, self.layout.first, self.layout.last,
        )  # fmt: skip
        self.receive_urls = ReceiveUrls(self.config.receive_url_timeout_s, self.config.max_pending_registrations)
        self.pusher = ZmqPusher(self.config.connect_timeout_s, self.config.push_timeout_s)
        self._background: set[asyncio.Future] = set()

    def close(self) -> None:
        """Ends the ZMQ context once the pushes still running have finished (blocks: call it off the loop)."""
        self.pusher.close()

    def parse_Encode(self, raw: bytes) -> sglang_pb.EncodeRequest:
        return parse_message(raw, sglang_pb.EncodeRequest, refuse_unknown=False)

    def parse_SchedulerReceiveUrl(self, raw: bytes) -> sglang_pb.SchedulerReceiveUrlRequest:
        return parse_message(raw, sglang_pb.SchedulerReceiveUrlRequest, refuse_unknown=False)

    @error_edge
    async def Encode(self, request: sglang_pb.EncodeRequest, context: grpc.aio.ServicerContext) -> bytes:
        return (await self._encode_and_push(request, context)).SerializeToString()

    @error_edge
    async def SchedulerReceiveUrl(
        self, request: sglang_pb.SchedulerReceiveUrlRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        check_receive_url_request(request)
        endpoint_of_url(request.receive_url)
        self.receive_urls.register(request.req_id, request.receive_url, request.receive_count)
        return sglang_pb.SchedulerReceiveUrlResponse().SerializeToString()

    async def Send(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SEND_UNIMPLEMENTED)

    async def _encode_and_push(
        self, request: sglang_pb.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> sglang_pb.EncodeResponse:
        """One part, accounted like a native Encode call: its items' embeddings joined row-wise into one
        tensor, pushed to its receiver(s) as two frames [pickled EmbeddingData, raw tensor bytes]. On any
        failure, the call's cancellation included, the receiver is told (see _tell_failure)."""
        with self.metrics.record(request.req_id, len(request.mm_items), context) as record:
            endpoints: list[str] = []
            try:
                check_sglang_encode_request(request, self.server_config.max_items_per_request)
                endpoints = [endpoint(request.prefill_host, port) for port in request.embedding_port]
                async with self.streams.call(context.peer()) as charge:  # the part's bytes count until pushed
                    sender = ItemSender(context, charge, record)
                    part = await self._encode_part(request, sender)
                    if not endpoints:  # zmq_to_scheduler: the receiving ranks register their URLs
                        remaining = context.time_remaining()
                        timeout = self.config.receive_url_timeout_s
                        if remaining is not None:
                            timeout = min(timeout, remaining)
                        urls = await self.receive_urls.wait(request.req_id, timeout)
                        endpoints = [endpoint_of_url(url) for url in urls]
                    pushes = asyncio.gather(*(self.pusher.push(endpoint, [part.meta, part.tensor]) for endpoint in endpoints))
                    frames = [header.payload_bytes * len(endpoints) for header in part.headers]
                    frames[0] += len(part.meta) * len(endpoints)
                    await sender.push(part.headers, pushes, frames)
            except BaseException as exc:
                await self._tell_failure(request, endpoints, exc)
                raise
            finally:
                self.receive_urls.forget(request.req_id)
        return sglang_pb.EncodeResponse(
            embedding_size=len(part.tensor), embedding_len=part.tokens, embedding_dim=part.width
        )

    async def _encode_part(self, request: sglang_pb.EncodeRequest, sender: ItemSender) -> Part:
        """Reads, admits and encodes a part's items (through the cache and batcher), then joins them."""
        pipeline = self.pipeline
        pipeline.check_room(len(request.mm_items))  # before any decoding: refusals under overload stay fast
        reads = [asyncio.ensure_future(read_item(item, pipeline.sources)) for item in request.mm_items]
        try:
            datas = await asyncio.gather(*reads)
        except UnsupportedModalityError:
            raise  # SGLang's own message for it
        except InvalidItemError as exc:
            failed = next(i for i, r in enumerate(reads) if r.done() and r.exception() is exc)
            raise InvalidItemError(f"item {failed}: {exc}") from None
        finally:
            for read in reads:
                read.cancel()  # the other items' reads, when one failed
        items = [pb.ImageItem(index=i, modality=pb.IMAGE, data=data) for i, data in enumerate(datas)]
        with pipeline.admit(items) as flows:
            async with contextlib.aclosing(sender.items(flows)) as outs:
                return join_part(request, [out.payload async for out in outs], self.layout)

    async def _tell_failure(self, request: sglang_pb.EncodeRequest, endpoints: Sequence[str], exc: BaseException) -> None:
        """Pushes SGLang's error shape to the part's receiver(s), one frame (an EmbeddingData carrying
        error_msg and error_code), so the request fails there at once instead of waiting for its timeout.
        Before the call's status goes out, unless the call was cancelled (its deadline passed): then in
        the background."""
        if isinstance(exc, DeliveryError):
            return  # the receiver is what failed
        if not endpoints:  # zmq_to_scheduler: whichever ranks have registered
            endpoints = [endpoint_of_url(url) for url in self.receive_urls.registered(request.req_id)]
        if not endpoints:
            return
        if isinstance(exc, asyncio.CancelledError):
            message, code = f"the encode call for {request.req_id!r} was cancelled or ran out of time", 504
        elif isinstance(exc, EncoderError):
            message, code = str(exc), http_status_for(exc)
        else:
            message, code = "internal error while encoding; see the encoder server's log", 500
        meta = embedding_data_pickle(
            PartMeta(
                req_id=request.req_id,
                num_parts=max(request.num_parts, 1),
                part_idx=request.part_idx,
                error_msg=message,
                error_code=code,
            ),
            self.layout,
        )
        timeout_s = min(self.config.push_timeout_s, ERROR_PUSH_TIMEOUT_S)
        pushes = asyncio.gather(*(self.pusher.push(endpoint, [meta], timeout_s) for endpoint in endpoints))
        pushes.add_done_callback(_log_failed_error_push)
        if isinstance(exc, asyncio.CancelledError):
            self._background.add(pushes)
            pushes.add_done_callback(self._background.discard)
        else:
            await asyncio.wait([pushes])


def _log_failed_error_push(pushes: asyncio.Future) -> None:
    if not pushes.cancelled() and pushes.exception() is not None:
        log.warning("could not tell an SGLang receiver about a failed part: %s", pushes.exception())


def method_handlers(servicer: SglangEncoderServicer) -> grpc.GenericRpcHandler:
    """The service's handlers; requests are parsed inside the calls, so that undecodable bytes get
    INVALID_ARGUMENT instead of gRPC's INTERNAL for a failing deserializer."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name))
            for name in ("Encode", "SchedulerReceiveUrl", "Send")
        },
    )
