"""How payloads reach this receiver: the seam between a shard call (shard_call.py), which puts a
transport's offer in its request, and the assembler (assembly.py), which reads each item the encoder
placed by that transport instead of streaming it as chunks.

`TRANSPORTS` is the one list of them, by the name `ReceiverConfig.transfer` takes: the gRPC stream
(`stream.py`, always there: every transport falls back to it), shared memory (`shm.py`) and the Mooncake
transfer engine (`mooncake.py`); "auto" (`auto.py`) picks among them per encoder. Each is loaded when a
receiver uses it, so that this list stays free of torch (the receiver's settings are).
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
    from ..config import ReceiverConfig

# Transfer name -> "module:class" under receiver.transports, the class taking `strict` and the
# receiver's settings.
TRANSPORTS = {
    "grpc": "stream:StreamTransport",
    "shm": "shm:ShmReceiver",
    "mooncake": "mooncake:MooncakeReceiver",
}
# transfer="auto": shared memory to an encoder that could share this host, the transfer engine to
# others where it runs here, else the stream.
AUTO = "auto:AutoTransport"
TRANSFERS = ("auto", *TRANSPORTS)


class Placement(enum.Enum):
    """Where an item's payload is, once its header has been read."""

    FILLED = "filled"  # the item's tensor is a view of what the transport placed
    CHUNKS = "chunks"  # follows on the stream as chunks
    REFETCH = "refetch"  # placed where it could not be used: fetch the item again


@dataclass
class TransferStats:
    """What a receiver's transport moved (`EncoderReceiver.transfer_stats`): items that came through shared
    memory or the transfer engine, and why others that were offered one came over the stream. The
    stream's stays empty."""

    items_shm: int = 0
    bytes_shm: int = 0
    items_mooncake: int = 0
    bytes_mooncake: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> items that came over gRPC

    @property
    def items_grpc(self) -> int:
        return sum(self.fallbacks.values())


class ReceiverTransport(Protocol):
    """A receiver's transport: what its calls offer an encoder, and how they read what it placed."""

    stats: TransferStats

    def open_call(self, request: pb.EncodeRequest | pb.FetchRequest, url: str, items: int) -> PayloadReader | None:
        """Puts this transport's offer in `request` (a call of `items` items) for the encoder at `url`
        and returns how that call's item headers are read; None: nothing offered, every payload comes
        as chunks."""

    def end_call(self, reader: PayloadReader, complete: bool) -> None:
        """The call `reader` was opened for is over: `complete`, its stream ended (or its last item
        arrived) rather than being cut off; the encoder writes nothing more for it then."""

    def close(self) -> None: ...


def transport_class(spec: str) -> type:
    """The class a "module:class" entry names."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def open_transport(transfer: str, config: ReceiverConfig) -> ReceiverTransport:
    """The transport of a receiver configured with `transfer` (one of TRANSFERS) and `config`: a named
    one is strict (that transport or an error), "auto" falls back to the stream."""
    if transfer == "auto":
        return transport_class(AUTO)(config)
    return transport_class(TRANSPORTS[transfer])(strict=True, config=config)
