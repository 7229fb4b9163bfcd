"""One call's use of the transfer engine: each payload written into the next granted slot that holds
it (slots are taken in the offer's order and never twice, so a receiver knows which ones a call that
ended early may still be writing), or the reason it follows as chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protos import encoder_pb2 as pb
from protos.mooncake import placement_mac

if TYPE_CHECKING:
    from ...payload import ItemPayload
    from .writer import MooncakeWriter


class MooncakeCall:
    """One Encode or Fetch call that offered the transfer engine."""

    def __init__(
        self, writer: MooncakeWriter | None, request: pb.EncodeRequest | pb.FetchRequest, refused: str | None
    ):
        self.request_id = request.request_id
        self._writer = writer
        self._offer = request.mooncake
        self._next_slot = 0
        self._refused = refused is not None

    async def place(self, header: pb.ItemHeader, payload: ItemPayload) -> bool:
        """Writes the item's payload into a granted slot and says so in `header.mooncake`; False: it
        goes as chunks."""
        writer = self._writer
        if writer is None:
            header.mooncake.fallback = pb.MOONCAKE_DISABLED
            return False
        if self._refused:
            writer.fallback(header, pb.MOONCAKE_OFFER_REFUSED)
            return False
        if header.payload_bytes < writer.config.min_bytes:
            writer.fallback(header, pb.MOONCAKE_SMALL_ITEM)
            return False
        slots = self._offer.slots
        index = next(
            (i for i in range(self._next_slot, len(slots)) if slots[i].capacity >= header.payload_bytes), None
        )
        if index is None:
            writer.fallback(header, pb.MOONCAKE_NO_SLOT)
            return False
        self._next_slot = index + 1
        header.mooncake.slot = index
        address = slots[index].address
        if not await writer.write(self._offer.session, payload.payload_views(), address):
            writer.fallback(header, pb.MOONCAKE_WRITE_FAILED)
            return False
        header.mooncake.mac = placement_mac(
            self._offer.token, self.request_id, header.index, index, address, header.payload_bytes
        )
        return True

    def hand_over(self) -> None:
        """Nothing to hand over: the slots are the receiver's memory."""

    def close(self) -> None:
        """Nothing to take back: a write the call's end cut off finishes on its thread, and the receiver
        keeps the slots it granted out of use until no write of theirs can land."""
