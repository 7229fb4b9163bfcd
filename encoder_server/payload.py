"""An item's response as the server sends it: its ItemHeader and its payload framed into chunk
messages once, kept so that every caller (and every cache hit) sends the same bytes objects.

A connection not known to read (see streams.py) gets the item's first chunk cut smaller
(FIRST_CHUNKS_BYTES): a receiver that never reads stalls on the second piece, so its stalled stream
leaves a 64 KiB message inside gRPC instead of a whole 1 MiB chunk. Connections that read get the
kept 1 MiB chunks from the first: the fewer messages, the faster the stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from protos import encoder_pb2 as pb
from protos import wire

from .batcher import TimedEmbedding
from .models import PreparedImage

# An item's first chunks, before 1 MiB ones. The header and the first fit the 64 KiB HTTP/2 window a
# gRPC client starts with; the second does not, so a receiver that never reads stalls on it. (A client
# that has read the header may open its window for a message it has partly received: a first chunk
# of 64 KiB was let through that way, and now and then the second one is too, leaving a 1 MiB chunk.)
FIRST_CHUNKS_BYTES = (32 << 10, 64 << 10)


def cut_small(chunk: bytes) -> list[bytes]:
    """One chunk message as several covering the same bytes, the first ones FIRST_CHUNKS_BYTES long."""
    data, pieces = wire.parse_response(chunk), []
    for size in FIRST_CHUNKS_BYTES:
        if len(data) <= size:
            break
        pieces.append(data[:size])
        data = data[size:]
    return [message for piece in [*pieces, data] for message in wire.chunk_messages(piece)]


class ItemPayload:
    """One item's response, computed once: its header (without the caller's index) and its chunk messages.

    The chunks are framed as the first caller streams them, so each copy overlaps the sending of the
    chunk before it, and are kept: every later caller, and every cache hit, sends the same bytes objects.
    Used from one event loop, where several callers may iterate `chunks()` at once.
    """

    def __init__(self, header: pb.ItemHeader, parts: Sequence[torch.Tensor]):
        self.header = header
        views = [wire.tensor_bytes(part) for part in parts]
        self.nbytes = wire.framed_size([len(view) for view in views])
        self._parts: list[torch.Tensor] | None = list(parts)  # held until every chunk is framed
        self._framing: Iterator[bytes] | None = itertools.chain.from_iterable(map(wire.chunk_messages, views))
        self._chunks: list[bytes] = []

    def payload_views(self) -> list[memoryview]:
        """The payload's bytes without copies: the tensors while held, else the kept chunks' data."""
        if self._parts is not None:
            return [wire.tensor_bytes(part) for part in self._parts]
        return [wire.parse_response(chunk) for chunk in self._chunks]

    def chunks(self, *, small_first: bool = False) -> Iterator[bytes]:
        """The chunk messages in order; with `small_first`, the first one cut as `cut_small` cuts it."""
        index = 0
        while True:
            if index == len(self._chunks):
                chunk = None if self._framing is None else next(self._framing, None)
                if chunk is None:
                    self._framing = self._parts = None  # all framed: the tensors can go
                    return
                self._chunks.append(chunk)
            if index == 0 and small_first:
                yield from cut_small(self._chunks[0])
            else:
                yield self._chunks[index]
            index += 1

    def finish_framing(self) -> None:
        """Frames the chunks no caller has reached yet and lets the tensors go: a payload whose stream
        stopped part-way would otherwise hold both its tensors and its first chunks."""
        if self._framing is not None:
            self._chunks.extend(self._framing)
            self._framing = self._parts = None

    @classmethod
    def build(cls, prepared: PreparedImage, encoded: TimedEmbedding, preprocess_ms: float) -> ItemPayload:
        output = encoded.output
        parts = [output.embedding] + ([output.deepstack] if output.deepstack is not None else [])
        size = prepared.image_size
        header = pb.ItemHeader(
            num_tokens=prepared.num_tokens,
            grid_thw=prepared.grid_thw,
            image_size=None if size is None else pb.ImageSize(width=size[0], height=size[1]),
            hidden_size=output.embedding.shape[1],
            dtype=wire.WIRE_DTYPES[output.embedding.dtype],
            num_deepstack_layers=0 if output.deepstack is None else output.deepstack.shape[0],
            payload_bytes=sum(part.numel() * part.element_size() for part in parts),
            timing=pb.Timing(queue_ms=encoded.queue_ms, preprocess_ms=preprocess_ms, forward_ms=encoded.forward_ms),
        )
        return cls(header, parts)

    def header_message(self, index: int, cache_hit: bool) -> pb.EncodeResponse:
        """The ItemHeader message for one caller; a hit reports no timing, since no work was done for it."""
        header = pb.ItemHeader()
        header.CopyFrom(self.header)
        header.index = index
        if cache_hit:
            header.cache_hit = True
            header.ClearField("timing")
        return pb.EncodeResponse(header=header)
