"""What `EncoderReceiver.encode` returns: per-item embeddings in item order, and their concatenation."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from protos import encoder_pb2 as pb

from .windows import ItemsOffset, check_items_offset, window_bounds


@dataclass
class ItemResult:
    index: int  # position in the caller's request
    embedding: torch.Tensor  # [num_tokens, hidden_size]; on the meta device (no data) when withheld under a lease
    grid_thw: tuple[int, ...]
    encoder_url: str | None  # None for a precomputed item
    deepstack: torch.Tensor | None = None  # [num_deepstack_layers, num_tokens, hidden_size]
    cache_hit: bool = False  # the encoder's cache had it
    receiver_cache_hit: bool = False  # this receiver's cache had it: no RPC (encoder_url: who encoded it)
    precomputed: bool = False  # the caller supplied the embedding; no encoder ran
    lease: pb.LeaseGrant | None = None  # set when encoded with a lease: the key a Fetch names it by
    queue_ms: float = 0.0
    preprocess_ms: float = 0.0
    forward_ms: float = 0.0
    stream_ms: float = 0.0  # from the call's start until the item's last byte arrived
    image_size: tuple[int, int] | None = None  # (width, height) of the image as the encoder loaded it

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embedding.shape[1])


@dataclass
class EncodeResult:
    request_id: str
    items: list[ItemResult] = field(default_factory=list)

    @cached_property
    def embedding(self) -> torch.Tensor:
        """All items' rows, in item order: [total_tokens, hidden_size]."""
        return torch.cat([item.embedding for item in self.items])

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    def window_bounds(
        self, extend_prefix_len: int, extend_seq_len: int, items_offset: ItemsOffset
    ) -> tuple[int, int]:
        """Bounds of `window`'s rows; checks that `items_offset` has one run per item, as long as the item."""
        check_items_offset(items_offset, [item.num_tokens for item in self.items])
        return window_bounds(extend_prefix_len, extend_seq_len, items_offset)

    def window(
        self, extend_prefix_len: int, extend_seq_len: int, items_offset: ItemsOffset
    ) -> tuple[torch.Tensor, int, int]:
        """The embedding rows of the multimodal tokens inside one chunked-prefill window.

        `items_offset` holds each item's placeholder run in the prompt as inclusive (start, end)
        positions; the window is [extend_prefix_len, extend_prefix_len + extend_seq_len). Returns
        (rows, start, end) with rows = embedding[start:end].
        """
        start, end = self.window_bounds(extend_prefix_len, extend_seq_len, items_offset)
        return self.embedding[start:end], start, end

    # SGLang's name for `window`, which prefill code written against SGLang calls.
    chunk = window
