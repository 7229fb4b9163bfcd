"""Encoder URLs to gRPC channels: one channel per encoder, reused by every call."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protos import encoder_pb2 as pb
from protos import wire

_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


def grpc_target(url: str) -> str:
    """`grpc://host:port` (or a bare `host:port`) to the target string grpc dials."""
    for scheme in ("grpc://",):
        if url.startswith(scheme):
            return url[len(scheme) :]
    if "://" in url:
        raise ValueError(f"unsupported encoder URL {url!r}: use grpc://host:port")
    return url


@dataclass
class EncoderEndpoint:
    """One encoder server: its URL, channel and the two RPCs, Encode reading with protos.wire."""

    url: str
    channel: grpc.aio.Channel

    @classmethod
    def connect(cls, url: str) -> EncoderEndpoint:
        channel = grpc.aio.insecure_channel(grpc_target(url))
        return cls(url, channel)

    def __post_init__(self) -> None:
        self.encode = self.channel.unary_stream(
            f"{_SERVICE}/Encode",
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=wire.parse_response,
        )
        self.get_model_info = self.channel.unary_unary(
            f"{_SERVICE}/GetModelInfo",
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )

    async def close(self) -> None:
        await self.channel.close()
