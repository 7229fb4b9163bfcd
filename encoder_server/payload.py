"""An item's response as the server sends it (`ItemPayload`: its header and its chunk messages, framed
once and shared by every caller and cache hit), and what one item of a call is (`ItemOut`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass

import torch

from protos import encoder_pb2 as pb
from protos import wire

from .batcher import TimedEmbedding
from .models import PreparedImage

# An item's first chunks, before 1 MiB ones, for a connection not known to read (streams.py): the header
# and the first fit the 64 KiB HTTP/2 window a gRPC client starts with, the second does not, so a stalled
# stream leaves a 64 KiB message inside gRPC instead of a 1 MiB chunk. (A client that has read the header
# may open its window for a message it has partly received: now and then the second gets through too.)
# Connections that read get 1 MiB chunks from the first: the fewer messages, the faster the stream.
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


@dataclass(frozen=True, slots=True)
class ItemOut:
    """What one item of a call is, once its payload is there (or known not to be)."""

    index: int  # the item's index in the call
    payload: ItemPayload | None  # None: the item named an image by reference, and it is not held
    _: KW_ONLY
    cache_hit: bool = False  # the cache (or another call's computation) had it
    key: bytes | None = None  # its content key; None when nothing wants one
    content_sha256: bytes | None = None  # its image's sha256 while the cache keeps it, for the header
