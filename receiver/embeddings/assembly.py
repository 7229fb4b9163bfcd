"""Reassembly: writes an Encode stream's chunks straight into each item's preallocated tensor, or
takes the item's tensor as the call's transport (receiver.transports) placed it."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import numpy as np
import torch

from encoder_common.copies import copy_bytes
from encoder_common.errors import EncoderError
from protos import encoder_pb2 as pb
from protos import wire

from ..buffers import POOL
from ..transports import PayloadReader, Placement
from .result import ItemResult

# Makes the uninitialized tensor an item's payload is received into, from its shape and dtype.
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class StreamProtocolError(EncoderError):
    """The stream broke the contract: an unexpected item, a short payload, a size that does not add up."""


class ItemBuffer:
    """One item's payload: filled chunk by chunk in arrival order, or given whole (as a transport placed it).

    Tensors come from the receive pool unless the caller gives its own `allocate`; a whole payload is
    taken as it is, or copied once into the caller's tensor when there is one.
    """

    def __init__(
        self,
        header: pb.ItemHeader,
        allocate: Allocator | None = None,
        payload: torch.Tensor | None = None,
        layout: tuple[torch.dtype, tuple[int, int, int]] | None = None,
    ):
        """`layout`: the header's `layout()`, when the caller checked it already."""
        self.header = header
        self.dtype, shape = layout or self.layout(header)
        if payload is not None and allocate is None:
            self.tensor = payload.view(self.dtype).reshape(shape)
        else:
            self.tensor = (allocate or POOL.empty)(shape, self.dtype)
        self._bytes = self.tensor.view(torch.uint8).reshape(-1).numpy()
        self.filled = 0
        if payload is not None:
            if self.tensor.data_ptr() != payload.data_ptr():
                copy_bytes(self._bytes, payload.view(torch.uint8).reshape(-1).numpy())
            self.filled = len(self._bytes)

    @staticmethod
    def layout(header: pb.ItemHeader) -> tuple[torch.dtype, tuple[int, int, int]]:
        """The item's dtype and [layers, num_tokens, hidden_size]; refuses a header that does not add up."""
        dtype = wire.TORCH_DTYPES.get(header.dtype)
        if dtype is None:
            raise StreamProtocolError(f"item {header.index}: unknown dtype {header.dtype}")
        layers = 1 + header.num_deepstack_layers
        expected = layers * header.num_tokens * header.hidden_size * dtype.itemsize
        if header.payload_bytes != expected or header.num_tokens == 0:
            raise StreamProtocolError(
                f"item {header.index}: header announces {header.payload_bytes} payload bytes for "
                f"{layers} x {header.num_tokens} x {header.hidden_size} {dtype}"
            )
        return dtype, (layers, header.num_tokens, header.hidden_size)

    @property
    def complete(self) -> bool:
        return self.filled == len(self._bytes)

    def write(self, chunk: memoryview) -> None:
        end = self.filled + len(chunk)
        if end > len(self._bytes):
            raise StreamProtocolError(
                f"item {self.header.index}: {end} payload bytes received, {len(self._bytes)} announced"
            )
        self._bytes[self.filled : end] = np.frombuffer(chunk, dtype=np.uint8)
        self.filled = end


def _shape_only(header: pb.ItemHeader) -> torch.Tensor:
    """A withheld payload: a tensor on the meta device, with the item's shape and dtype and no data."""
    dtype, shape = ItemBuffer.layout(header)
    return torch.empty(shape, dtype=dtype, device="meta")


class ShardAssembler:
    """Consumes one Encode stream's messages for a known set of item indices."""

    def __init__(
        self,
        expected_indices: Collection[int],
        encoder_url: str,
        read_placed: PayloadReader | None = None,
        allocate: Allocator | None = None,
        payloads: bool = True,
        references: Collection[int] = (),
    ):
        """`references`: the items sent as their image's sha256 alone (the server may answer not_held)."""
        self.expected = set(expected_indices)
        self.encoder_url = encoder_url
        self.items: dict[int, ItemResult] = {}
        self.read_placed = read_placed
        self.allocate = allocate
        self.payloads = payloads  # False: headers only (payloads withheld under a lease)
        self.references = set(references)
        self.refetch: list[int] = []  # items placed where they could not be used
        self.not_held: list[int] = []  # references whose embedding the server did not hold
        self.digests: dict[int, bytes] = {}  # arrived items' image sha256, where the server keeps them
        self._current: ItemBuffer | None = None
        self._started = time.perf_counter()

    def feed(self, message: pb.ItemHeader | memoryview) -> ItemResult | None:
        """Takes one message; returns an item's result when its last byte has arrived."""
        if isinstance(message, memoryview):
            if self._current is None:
                raise StreamProtocolError("payload chunk before any item header")
            self._current.write(message)
        else:
            if self._current is not None:
                raise StreamProtocolError(
                    f"item {message.index} started before item {self._current.header.index} was complete"
                )
            index = message.index
            seen = index in self.items or index in self.refetch or index in self.not_held
            if index not in self.expected or seen:
                raise StreamProtocolError(f"unexpected item index {index} in the stream")
            if message.not_held:
                if index not in self.references:
                    raise StreamProtocolError(f"item {index}: answered not_held, but it went with its bytes")
                self.not_held.append(index)
                return None
            if not self.payloads:
                return self._finish(message, _shape_only(message))
            layout = ItemBuffer.layout(message)  # refused before any segment is touched
            payload = None
            if self.read_placed is not None:
                placement, payload = self.read_placed(message)
                if placement is Placement.REFETCH:
                    self.refetch.append(message.index)
                    return None
            self._current = ItemBuffer(message, self.allocate, payload, layout)
        if self._current is not None and self._current.complete:
            done = self._finish(self._current.header, self._current.tensor)
            self._current = None
            return done
        return None

    def _finish(self, header: pb.ItemHeader, tensor: torch.Tensor) -> ItemResult:
        timing = header.timing  # each access of a submessage makes a new wrapper of it
        result = ItemResult(
            index=header.index,
            embedding=tensor.select(0, 0),
            grid_thw=tuple(header.grid_thw),
            encoder_url=self.encoder_url,
            deepstack=tensor[1:] if header.num_deepstack_layers else None,
            cache_hit=header.cache_hit,
            lease=header.lease if header.HasField("lease") else None,
            queue_ms=timing.queue_ms,
            preprocess_ms=timing.preprocess_ms,
            forward_ms=timing.forward_ms,
            stream_ms=(time.perf_counter() - self._started) * 1000,
            image_size=(header.image_size.width, header.image_size.height) if header.HasField("image_size") else None,
        )
        self.items[header.index] = result
        if len(header.content_sha256) == 32:
            self.digests[header.index] = header.content_sha256
        return result

    def missing(self) -> list[int]:
        return sorted(self.expected - set(self.items))
