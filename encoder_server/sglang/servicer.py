"""The `sglang.grpc.encoder.SglangEncoder` servicer: SGLang's Encode calls go through the native
servicer's admission, embedding cache and batcher; each part's embedding, or its error, is pushed
over ZMQ to the SGLang receiver as SGLang's own encoder pushes it.

An SGLang part is one Encode call: its items' embeddings are joined row-wise into one tensor, sent
as two frames [pickled EmbeddingData, raw tensor bytes]; a failed part sends one frame, an
EmbeddingData carrying error_msg and error_code, so the receiver fails the request at once
instead of waiting for its timeout. The RPC's status says the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch
import zmq

from encoder_common.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    OverloadedError,
    UnsupportedModalityError,
    http_status_for,
    status_for,
)
from protos import encoder_pb2 as pb
from protos import sglang_encoder_pb2 as sglang_pb
from protos import wire

from ..config import ServerConfig
from ..metrics import ServerMetrics
from ..payload import ItemPayload
from ..pipeline import ItemPipeline
from ..checks import check_receive_url_request, check_sglang_encode_request, parse_message
from ..sender import ItemSender
from ..streams import StreamBudget, StreamCharge
from .config import SglangConfig
from .embedding_data import EmbeddingDataLayout, PartMeta, embedding_data_pickle
from .items import read_item

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


class DeliveryError(EncoderError):
    """A part's embedding could not be pushed to its SGLang receiver."""


@dataclass
class _Registration:
    receive_count: int
    urls: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class ReceiveUrls:
    """zmq_to_scheduler: where each request's embedding goes, registered by SchedulerReceiveUrl
    calls (one per receiving rank, receive_count in all) that may come before or after its Encode."""

    def __init__(self, keep_s: float, max_pending: int):
        self.keep_s = keep_s
        self.max_pending = max_pending
        self._registrations: dict[str, _Registration] = {}

    def register(self, req_id: str, url: str, receive_count: int) -> None:
        self._expire()
        registration = self._registrations.get(req_id)
        if registration is None:
            if len(self._registrations) >= self.max_pending:
                raise OverloadedError(f"{len(self._registrations)} registrations are waiting for their Encode")
            registration = self._registrations[req_id] = _Registration(receive_count)
        if not registration.receive_count:  # its Encode came first and is waiting
            registration.receive_count = receive_count
        if registration.receive_count != receive_count:
            raise InvalidItemError(
                f"receive_count {receive_count} differs from the {registration.receive_count} registered for {req_id!r}"
            )
        if url not in registration.urls:
            if len(registration.urls) == receive_count:
                raise InvalidItemError(f"{req_id!r} already has its {receive_count} receive URLs")
            registration.urls.append(url)
            registration.changed.set()

    async def wait(self, req_id: str, timeout_s: float) -> list[str]:
        """The request's receive URLs once all have registered; DeadlineExceededError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            registration = self._registrations.setdefault(req_id, _Registration(receive_count=0))
            if registration.receive_count and len(registration.urls) == registration.receive_count:
                return list(registration.urls)
            registration.changed.clear()
            try:
                await asyncio.wait_for(registration.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise DeadlineExceededError(
                    f"{len(registration.urls)} of {registration.receive_count or '?'} receive URLs registered for "
                    f"{req_id!r} within {timeout_s:g} s (zmq_to_scheduler: SchedulerReceiveUrl calls)"
                ) from None

    def registered(self, req_id: str) -> list[str]:
        registration = self._registrations.get(req_id)
        return [] if registration is None else list(registration.urls)

    def forget(self, req_id: str) -> None:
        self._registrations.pop(req_id, None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.keep_s
        for req_id in [r for r, reg in self._registrations.items() if reg.created < cutoff]:
            del self._registrations[req_id]


@dataclass(frozen=True)
class _Part:
    """One Encode call's result: the pickled metadata frame and the joined tensor bytes."""

    meta: bytes
    tensor: bytes
    tokens: int
    width: int
    headers: list[pb.ItemHeader]


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
        self._zmq = zmq.Context()
        self._background: set[asyncio.Future] = set()

    def close(self) -> None:
        """Ends the ZMQ context once the pushes still running have finished (blocks: call it off the loop)."""
        self._zmq.term()

    async def Encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request: sglang_pb.EncodeRequest | None = None
        try:
            request = parse_message(raw, sglang_pb.EncodeRequest, refuse_unknown=False)
            response = await self._encode_and_push(request, context)
        except EncoderError as exc:
            await context.abort(status_for(exc), str(exc))
        except Exception:
            log.exception("SGLang request %r failed", getattr(request, "req_id", "?"))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while encoding; see the server log")
        return response.SerializeToString()

    async def SchedulerReceiveUrl(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = parse_message(raw, sglang_pb.SchedulerReceiveUrlRequest, refuse_unknown=False)
            check_receive_url_request(request)
            _endpoint_of_url(request.receive_url)
            self.receive_urls.register(request.req_id, request.receive_url, request.receive_count)
        except EncoderError as exc:
            await context.abort(status_for(exc), str(exc))
        return sglang_pb.SchedulerReceiveUrlResponse().SerializeToString()

    async def Send(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SEND_UNIMPLEMENTED)

    async def _encode_and_push(
        self, request: sglang_pb.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> sglang_pb.EncodeResponse:
        """One part, accounted like a native Encode call: encoded, then pushed to its receiver(s). On
        any failure, the call's cancellation included, the receiver is told (see _tell_failure)."""
        with self.metrics.record(request.req_id, len(request.mm_items), context) as record:
            endpoints: list[str] = []
            try:
                check_sglang_encode_request(request, self.server_config.max_items_per_request)
                endpoints = [_endpoint(request.prefill_host, port) for port in request.embedding_port]
                async with self.streams.call(context.peer()) as charge:  # the part's bytes count until pushed
                    part = await self._encode_part(request, charge)
                    if not endpoints:  # zmq_to_scheduler: the receiving ranks register their URLs
                        remaining = context.time_remaining()
                        timeout = self.config.receive_url_timeout_s
                        if remaining is not None:
                            timeout = min(timeout, remaining)
                        urls = await self.receive_urls.wait(request.req_id, timeout)
                        endpoints = [_endpoint_of_url(url) for url in urls]
                    pushes = asyncio.gather(*(self._push(endpoint, [part.meta, part.tensor]) for endpoint in endpoints))
                    frames = [header.payload_bytes * len(endpoints) for header in part.headers]
                    frames[0] += len(part.meta) * len(endpoints)
                    sender = ItemSender(context, charge, record)
                    await sender.push(part.headers, pushes, frames)
            except BaseException as exc:
                await self._tell_failure(request, endpoints, exc)
                raise
            finally:
                self.receive_urls.forget(request.req_id)
        return sglang_pb.EncodeResponse(
            embedding_size=len(part.tensor), embedding_len=part.tokens, embedding_dim=part.width
        )

    async def _encode_part(self, request: sglang_pb.EncodeRequest, charge: StreamCharge) -> _Part:
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
        async with contextlib.aclosing(pipeline.payloads(items, charge)) as payloads:
            return _join(request, [payload async for _, payload, _, _ in payloads], self.layout)

    async def _push(self, endpoint: str, frames: list[bytes], timeout_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = self.config.push_timeout_s if timeout_s is None else timeout_s
        await loop.run_in_executor(None, self._push_blocking, endpoint, frames, timeout_s)

    def _push_blocking(self, endpoint: str, frames: list[bytes], timeout_s: float) -> None:
        sock = self._zmq.socket(zmq.PUSH)
        # IMMEDIATE: nothing is queued for a receiver that is not there; the send times out instead.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        connect_timeout_s = min(timeout_s, self.config.connect_timeout_s)
        sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        try:
            sock.connect(endpoint)
            tracker = sock.send_multipart(frames, copy=False, track=True)
            tracker.wait(timeout_s)  # the bytes are handed to the connection
        except zmq.Again:
            raise DeliveryError(
                f"no SGLang receiver listening at {endpoint} (no connection within {connect_timeout_s:g} s)"
            ) from None
        except zmq.NotDone:
            raise DeliveryError(f"pushing the embedding to {endpoint} took over {timeout_s:g} s") from None
        except zmq.ZMQError as exc:
            raise DeliveryError(f"pushing the embedding to {endpoint} failed: {exc}") from None
        finally:
            sock.close()

    async def _tell_failure(self, request: sglang_pb.EncodeRequest, endpoints: Sequence[str], exc: BaseException) -> None:
        """Pushes SGLang's error shape to the part's receiver(s), so the request fails there at once
        instead of waiting for its timeout. Before the call's status goes out, unless the call was
        cancelled (its deadline passed): then in the background."""
        if isinstance(exc, DeliveryError):
            return  # the receiver is what failed
        if not endpoints:  # zmq_to_scheduler: whichever ranks have registered
            endpoints = [_endpoint_of_url(url) for url in self.receive_urls.registered(request.req_id)]
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
        pushes = asyncio.gather(*(self._push(endpoint, [meta], timeout_s) for endpoint in endpoints))
        pushes.add_done_callback(_log_failed_error_push)
        if isinstance(exc, asyncio.CancelledError):
            self._background.add(pushes)
            pushes.add_done_callback(self._background.discard)
        else:
            await asyncio.wait([pushes])


def _log_failed_error_push(pushes: asyncio.Future) -> None:
    if not pushes.cancelled() and pushes.exception() is not None:
        log.warning("could not tell an SGLang receiver about a failed part: %s", pushes.exception())


def _endpoint(host: str, port: int) -> str:
    """The tcp:// endpoint of a receiver's PULL socket; IPv6 addresses in brackets."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if not host or any(c in host for c in "/@ ") or not 0 < port < 65536:
        raise InvalidItemError(f"receiver address {host!r}:{port} is not a host and port")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass  # a name
    return f"tcp://{host}:{port}"


def _endpoint_of_url(url: str) -> str:
    """A receive URL (`host:port`, `[v6]:port`, optionally `tcp://`) as a tcp:// endpoint."""
    host, sep, port = url.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidItemError(f"receive URL {url!r} is not host:port")
    return _endpoint(host, int(port))


def _join(
    request: sglang_pb.EncodeRequest, payloads: Sequence[ItemPayload], layout: EmbeddingDataLayout
) -> _Part:
    """The part's items' embeddings joined row-wise, in SGLang's layout: deepstack layers (Qwen3-VL)
    side by side with the embedding along the width, as SGLang's encoder concatenates them."""
    headers = [payload.header for payload in payloads]
    dtype = wire.TORCH_DTYPES[headers[0].dtype]
    layers = 1 + headers[0].num_deepstack_layers
    if layers == 1:
        tensor = b"".join(view for payload in payloads for view in payload.payload_views())
    else:
        rows = []
        for payload, header in zip(payloads, headers):
            flat = torch.frombuffer(bytearray(b"".join(payload.payload_views())), dtype=dtype)
            rows.append(flat.view(layers, header.num_tokens, header.hidden_size).permute(1, 0, 2).reshape(header.num_tokens, -1))
        tensor = wire.tensor_bytes(torch.cat(rows)).tobytes()
    tokens = sum(header.num_tokens for header in headers)
    width = headers[0].hidden_size * layers
    meta = embedding_data_pickle(
        PartMeta(
            req_id=request.req_id,
            num_parts=request.num_parts,
            part_idx=request.part_idx,
            grid_thw=[list(header.grid_thw) for header in headers],
            dtype=dtype,
            shape=[tokens, width],
        ),
        layout,
    )
    return _Part(meta, tensor, tokens, width, headers)


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
