"""How an item's payload travels to its receiver, server side: the seam between the sender and the
transports, and `TRANSPORTS`, the registry of those besides the gRPC stream (docs/architecture.md,
"Adding a transport")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from .mooncake import MooncakeWriter
from .shm import ShmSegments
from .stream import STREAM

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from protos import encoder_pb2 as pb

    from ..config import ServerConfig
    from ..payload import ItemPayload


class CallTransport(Protocol):
    """One call's use of a transport."""

    async def place(self, header: pb.ItemHeader, payload: ItemPayload) -> bool:
        """Puts the payload where this transport carries it and says where in `header`; False: it
        follows on the stream as chunks."""

    def hand_over(self) -> None:
        """The stream completed: what was placed is the receiver's now."""

    def close(self) -> None:
        """The call is over: takes back what was placed unless it was handed over."""


class ServerTransport(Protocol):
    """A transport as the server runs it, built from its ServerConfig section."""

    @staticmethod
    def open_call(
        running: ServerTransport | None, request: pb.EncodeRequest | pb.FetchRequest, peer: str
    ) -> CallTransport | None:
        """The call's use of this transport, when its receiver offered it (`running` None: the server
        runs without it); None when the receiver did not. `peer`: the caller's address, as gRPC gives it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def collector(self) -> Collector:
        """Its Prometheus metrics."""


# The transports besides the stream, by name; in the order a call's offers are considered. A name is also
# the `ServerConfig` section that turns its transport on (None: off) and the field of `EncodeRequest` /
# `FetchRequest` where a receiver offers it.
TRANSPORTS: dict[str, type[ServerTransport]] = {
    "shm": ShmSegments,
    "mooncake": MooncakeWriter,
}


class ServerTransports:
    """The transports a server runs with, from start-up to shutdown, and each call's choice among them."""

    def __init__(self, config: ServerConfig):
        self._running = {
            name: transport(section)
            for name, transport in TRANSPORTS.items()
            if (section := getattr(config, name)) is not None
        }

    def __getitem__(self, name: str) -> ServerTransport:
        return self._running[name]

    def __iter__(self) -> Iterator[ServerTransport]:
        return iter(self._running.values())

    async def start(self) -> None:
        for transport in self:
            await transport.start()

    async def stop(self) -> None:
        for transport in self:
            await transport.stop()

    def open_call(self, request: pb.EncodeRequest | pb.FetchRequest, peer: str) -> CallTransport:
        """The transport of a call's payloads: the first one its receiver offered, else the stream."""
        for name, transport in TRANSPORTS.items():
            call = transport.open_call(self._running.get(name), request, peer)
            if call is not None:
                return call
        return STREAM
