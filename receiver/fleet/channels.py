"""Encoder URLs to gRPC channels: one channel per encoder, reused by every call; TLS for `grpcs://` URLs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from encoder_common.load_report import LoadReport, parse_load
from protos import encoder_pb2 as pb
from protos import wire

from ..config import ClientTls
from ..urls import grpc_target
from .held_images import HeldImages

_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["EncoderService"].full_name
SERVICE_NAME = _SERVICE[1:]
# How long closing an endpoint waits for the ends of calls whose items all arrived (`hear_end`).
ENDS_GRACE_S = 2.0

log = logging.getLogger(__name__)




@dataclass
class EncoderEndpoint:
    """One encoder server: its URL, channel, call metadata and the RPCs, Encode reading with protos.wire;
    `on_load(url, report)` hears the load report each answer carries in its trailing metadata; `held`:
    the images it said it keeps, named to it by digest."""

    url: str
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...] = ()
    on_load: Callable[[str, LoadReport], None] | None = None
    held: HeldImages = field(default_factory=HeldImages)
    _ends: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        tls: ClientTls | None = None,
        auth_token: str | None = None,
        on_load: Callable[[str, LoadReport], None] | None = None,
    ) -> EncoderEndpoint:
        """A channel to `url`: TLS for `grpcs://` (with `tls`, or the system's CAs), plaintext for `grpc://`.

        `auth_token` goes out as `authorization: Bearer <token>` on every call.
        """
        target = grpc_target(url)
        if url.startswith("grpcs://"):
            channel = grpc.aio.secure_channel(target, (tls or ClientTls()).credentials())
        else:
            channel = grpc.aio.insecure_channel(target)
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        return cls(url, channel, metadata, on_load)

    def __post_init__(self) -> None:
        self.encode = self.channel.unary_stream(
            f"{_SERVICE}/Encode",
            request_serializer=wire.serialize,  # a message, or the bytes of wire.encode_request
            response_deserializer=wire.parse_response,
        )
        self.fetch = self.channel.unary_stream(
            f"{_SERVICE}/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=wire.parse_response,
        )
        self.get_model_info = self.channel.unary_unary(
            f"{_SERVICE}/GetModelInfo",
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        self.health_check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    async def is_serving(self, timeout: float) -> bool:
        """One grpc.health.v1 probe of the encoder service: True only for a SERVING answer in time."""
        call = self.health_check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout, metadata=self.metadata
        )
        try:
            reply = await call
        except grpc.aio.AioRpcError:
            return False
        self.heard(await call.trailing_metadata())
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def heard(self, trailing_metadata) -> None:
        """Passes on the load report in an answer's trailing metadata, when it has one."""
        report = parse_load(trailing_metadata)
        if report is not None and self.on_load is not None:
            self.on_load(self.url, report)

    def hear_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Reads the rest of a call whose every item has arrived, off its caller's path: its status and
        trailing metadata (the load report), and any message after the last item (a broken contract,
        logged: the items are whole and already handed on)."""
        task = asyncio.get_running_loop().create_task(self._read_end(call))
        self._ends.add(task)
        task.add_done_callback(self._ends.discard)

    async def _read_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for _ in call:
                log.warning(
                    "%s: a message after every item of its call had arrived: call cancelled", self.url
                )
                call.cancel()
                return
        except grpc.aio.AioRpcError as exc:
            self.heard(exc.trailing_metadata())
        except asyncio.CancelledError:
            call.cancel()
            raise
        else:
            self.heard(await call.trailing_metadata())

    async def close(self) -> None:
        """Closes the channel once the calls still ending (`hear_end`) have ended, or after ENDS_GRACE_S,
        so that the encoder sees its finished calls complete rather than cancelled."""
        if self._ends:
            await asyncio.wait(self._ends, timeout=ENDS_GRACE_S)
        await self.channel.close()
