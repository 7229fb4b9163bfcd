"""How payloads reach this receiver: the seam between a shard call (shard_call.py), which puts a
transport's offer in its request, and the assembler (assembly.py), which reads each item the encoder
placed by that transport instead of streaming it as chunks.

`TRANSPORTS` is the one list of them, by the name `ReceiverConfig.transfer` takes: the gRPC stream
(`stream.py`, always there: every transport falls back to it) and shared memory (`shm.py`). Each is
loaded when a receiver uses it, so that this list stays free of torch (the receiver's settings are).
See docs/architecture.md, "Adding a transport".
"""

from __future__ import annotations

import enum
import importlib
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from protos import encoder_pb2 as pb

    from ..assembly import PayloadReader

# Transfer name -> "module:class" under receiver.transports, the class taking `strict`.
TRANSPORTS = {
    "grpc": "stream:StreamTransport",
    "shm": "shm:ShmReceiver",
}
# transfer="auto": this transport where the encoder can take it, else the stream.
AUTO = "shm"
TRANSFERS = ("auto", *TRANSPORTS)


class Placement(enum.Enum):
    """Where an item's payload is, once its header has been read."""

    FILLED = "filled"  # the item's tensor is a view of what the transport placed
    CHUNKS = "chunks"  # follows on the stream as chunks
    REFETCH = "refetch"  # placed where it could not be used: fetch the item again


@dataclass
class TransferStats:
    """What a receiver's transport moved (`EncoderReceiver.transfer_stats`): items that came through shared
    memory, and why others that were offered it came over the stream. The stream's stays empty."""

    items_shm: int = 0
    bytes_shm: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> items that came over gRPC

    @property
    def items_grpc(self) -> int:
        return sum(self.fallbacks.values())


class ReceiverTransport(Protocol):
    """A receiver's transport: what its calls offer an encoder, and how they read what it placed."""

    stats: TransferStats

    def open_call(self, request: pb.EncodeRequest | pb.FetchRequest, url: str) -> PayloadReader | None:
        """Puts this transport's offer in `request` for the encoder at `url` and returns how that call's
        item headers are read; None: nothing offered, every payload comes as chunks."""

    def close(self) -> None: ...


def open_transport(transfer: str) -> ReceiverTransport:
    """The transport of a receiver configured with `transfer` (one of TRANSFERS): a named one is
    strict (shared memory or an error), "auto" falls back to the stream."""
    module, name = TRANSPORTS[AUTO if transfer == "auto" else transfer].split(":")
    transport = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return transport(strict=transfer != "auto")
