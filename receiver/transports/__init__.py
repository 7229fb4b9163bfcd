"""How payloads reach this receiver: `TRANSPORTS`, the one list of them by `ReceiverConfig.transfer`'s
names (the gRPC stream, always there, shared memory and the Mooncake transfer engine; "auto" picks among
them per encoder), each loaded when used so this module stays free of torch; what a shard call offers
(`ReceiverTransport`) and how its item headers are read."""

from __future__ import annotations

import enum
import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from protos import encoder_pb2 as pb

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


# Reads an item's header for the call's transport: where its payload is, and its tensor when the
# transport placed it (ReceiverTransport.open_call returns one per call). Quoted: this module loads
# without torch (receiver.config imports it).
PayloadReader = Callable[["pb.ItemHeader"], tuple[Placement, "torch.Tensor | None"]]


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
