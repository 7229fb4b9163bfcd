"""The gRPC stream, the transport every call has: an item's payload follows its header on the Encode
(or Fetch) stream as chunk messages. The sender (sender.py) writes those chunks for every item that no
other transport placed, so a call that offered nothing else gets `STREAM`, which places nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protos import encoder_pb2 as pb

    from ..payload import ItemPayload


class StreamCall:
    """A call whose payloads all go as chunks on its stream: nothing to place, hand over or take back."""

    async def place(self, header: pb.ItemHeader, payload: ItemPayload) -> bool:
        return False

    def hand_over(self) -> None:
        pass

    def close(self) -> None:
        pass


STREAM = StreamCall()
