"""The gRPC stream, the transport every call has: nothing to offer, every payload follows its header as
chunks, which the assembler writes into the item's tensor (assembly.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import TransferStats

if TYPE_CHECKING:
    from protos import encoder_pb2 as pb

    from ..config import ReceiverConfig


class StreamTransport:
    """Calls that offer nothing besides the stream (transfer="grpc", and a refetch after a refused
    placement)."""

    def __init__(self, strict: bool = True, config: ReceiverConfig | None = None):
        # Strict or not, the stream is always there; it has no settings of its own.
        self.stats = TransferStats()  # stays empty: nothing is offered

    def open_call(self, request: pb.EncodeRequest | pb.FetchRequest, url: str, items: int) -> None:
        return None

    def end_call(self, reader: object, complete: bool) -> None:
        pass

    def close(self) -> None:
        pass


STREAM = StreamTransport()
