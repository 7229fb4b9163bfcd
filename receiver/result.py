"""What `EncoderReceiver.encode` returns: per-item embeddings in item order, and their concatenation."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class ItemResult:
    index: int  # position in the caller's request
    embedding: torch.Tensor  # [num_tokens, hidden_size]
    grid_thw: tuple[int, ...]
    encoder_url: str | None  # None for a precomputed item
    deepstack: torch.Tensor | None = None  # [num_deepstack_layers, num_tokens, hidden_size]
    cache_hit: bool = False
    queue_ms: float = 0.0
    preprocess_ms: float = 0.0
    forward_ms: float = 0.0
    stream_ms: float = 0.0  # from the call's start until the item's last byte arrived

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
