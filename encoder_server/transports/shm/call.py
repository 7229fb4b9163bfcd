"""One call's use of shared memory: whether its receiver's probe proved this host, each payload placed
in a segment (or the reason it goes as chunks after all), and its segments handed over to the
receiver when the stream completed, or taken back when it did not."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from protos import encoder_pb2 as pb

if TYPE_CHECKING:
    from ...payload import ItemPayload
    from .pool import ShmSegments
    from .segment import Segment


class ShmCall:
    """One Encode or Fetch call that offered shared memory: its proven probe and its segments."""

    def __init__(self, segments: ShmSegments | None, request: pb.EncodeRequest | pb.FetchRequest):
        self.request_id = request.request_id
        self._segments = segments
        self._probe = segments.read_probe(request.shm.probe) if segments is not None else None
        self._placed: list[tuple[Segment, Path]] = []
        self._handed_over = False

    async def place(self, header: pb.ItemHeader, payload: ItemPayload) -> bool:
        """Puts the item's payload in shared memory when it can and says so in `header.shm`; False:
        it goes as chunks."""
        if self._segments is None:
            header.shm.fallback = pb.SHM_DISABLED
            return False
        if self._probe is None:
            self._segments.fallback(header, pb.SHM_PROBE_UNREADABLE)
            return False
        token, owner = self._probe
        segment = self._segments.place(header, payload.payload_views(), token, owner, self.request_id)
        if segment is None:
            return False
        self._placed.append((segment, segment.public))
        return True

    def hand_over(self) -> None:
        """The stream completed: releasing its segments is up to the receiver (or the reaper) now."""
        self._handed_over = True

    def close(self) -> None:
        """Takes back the segments of a call that did not complete."""
        if self._segments is not None and not self._handed_over:
            for segment, public in self._placed:
                self._segments.take_back(segment, public)
        self._placed.clear()
