"""Chunked-prefill windows: which rows of a request's embedding fall inside one prefill window (the
slice of the prompt one prefill step runs) of its prompt.

`items_offset` lists each item's placeholder run in the prompt as inclusive (start, end) token
positions; row r of the request's embedding belongs to the r-th placeholder position overall.
SGLang calls a window a "chunk" (`get_embedding_chunk`); here a chunk is a wire message only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from encoder_common.errors import ItemsOffsetError

ItemsOffset = Sequence[tuple[int, int]]


class Window(NamedTuple):
    """One chunked-prefill step of a request: `extend_prefix_len` tokens cached, `extend_seq_len` more run."""

    extend_prefix_len: int
    extend_seq_len: int
    items_offset: ItemsOffset


def check_items_offset(items_offset: ItemsOffset, num_tokens: int | Sequence[int]) -> None:
    """Raises ItemsOffsetError unless the runs are valid, sorted, disjoint and match the embedding.

    `num_tokens` is the embedding's total row count, or each item's token count, in which case
    every run must be exactly as long as its item.
    """
    previous_end = -1
    for i, (start, end) in enumerate(items_offset):
        if start < 0 or end < start:
            raise ItemsOffsetError(
                f"item {i}: items_offset run ({start}, {end}) is not an inclusive range of positions"
            )
        if start <= previous_end:
            raise ItemsOffsetError(
                f"item {i}: items_offset run ({start}, {end}) starts at or before the previous run's end "
                f"{previous_end}; runs must be sorted and disjoint"
            )
        previous_end = end
    lengths = [end - start + 1 for start, end in items_offset]
    if isinstance(num_tokens, int):
        if sum(lengths) != num_tokens:
            raise ItemsOffsetError(
                f"items_offset covers {sum(lengths)} positions, the embedding has {num_tokens} rows"
            )
        return
    if len(lengths) != len(num_tokens):
        raise ItemsOffsetError(f"items_offset has {len(lengths)} runs for {len(num_tokens)} items")
    for i, (length, expected) in enumerate(zip(lengths, num_tokens)):
        if length != expected:
            start, end = items_offset[i]
            raise ItemsOffsetError(
                f"item {i}: items_offset run ({start}, {end}) covers {length} positions, "
                f"the item has {expected} tokens"
            )


def window_bounds(extend_prefix_len: int, extend_seq_len: int, items_offset: ItemsOffset) -> tuple[int, int]:
    """Rows start:end of the embedding whose positions lie in the window.

    The window is [extend_prefix_len, extend_prefix_len + extend_seq_len).

    `items_offset` must already be checked (sorted and disjoint).
    """
    if extend_prefix_len < 0 or extend_seq_len < 0:
        raise ValueError(
            f"extend_prefix_len={extend_prefix_len} and extend_seq_len={extend_seq_len} must be >= 0"
        )
    return (
        _positions_before(items_offset, extend_prefix_len),
        _positions_before(items_offset, extend_prefix_len + extend_seq_len),
    )


def _positions_before(items_offset: ItemsOffset, position: int) -> int:
    count = 0
    for start, end in items_offset:
        if position <= start:
            break
        count += min(end + 1, position) - start
    return count


def window_rows(
    embedding: torch.Tensor, extend_prefix_len: int, extend_seq_len: int, items_offset: ItemsOffset
) -> tuple[torch.Tensor, int, int]:
    """The rows of `embedding` [num_tokens, hidden_size] for one prefill window, and their bounds.

    Returns (rows, start, end) with rows = embedding[start:end]: the multimodal tokens whose
    positions lie in [extend_prefix_len, extend_prefix_len + extend_seq_len). Raises
    ItemsOffsetError when `items_offset` overlaps, is unsorted, or does not cover every row.
    """
    if embedding.dim() != 2:
        raise ValueError(f"embedding must be [num_tokens, hidden_size], got shape {tuple(embedding.shape)}")
    check_items_offset(items_offset, int(embedding.shape[0]))
    start, end = window_bounds(extend_prefix_len, extend_seq_len, items_offset)
    return embedding[start:end], start, end


# SGLang's name for it, which prefill code written against SGLang calls.
get_embedding_chunk = window_rows
